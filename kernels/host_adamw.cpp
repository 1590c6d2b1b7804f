// Fused AdamW for host (CPU) memory: one pass over p, m, v, g updates all three in place and, optionally,
// writes a bfloat16 copy of the new parameters. Multi-threaded with OpenMP, vectorizable inner loop.
// The math is optax.adamw's (scale_by_adam -> add_decayed_weights -> scale_by_learning_rate):
//   g'  = g * grad_scale
//   m   = b1 m + (1 - b1) g'          v = b2 v + (1 - b2) g'^2
//   u   = (m / bc1) / (sqrt(v / bc2) + eps) + wd p
//   p   = p - lr u
// where bc1 = 1 - b1^t and bc2 = 1 - b2^t are computed by the caller.
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

// Round-to-nearest-even float -> bfloat16, NaN kept quiet. Branch-free so the loop vectorizes.
static inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : rounded);
}

extern "C" void megatrain_adamw(float* __restrict p, float* __restrict m, float* __restrict v,
                                const float* __restrict g, uint16_t* __restrict p_bf16, int64_t n,
                                float lr, float b1, float b2, float eps, float wd, float grad_scale,
                                float bc1, float bc2) {
  const float one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
  const float inv_bc1 = 1.0f / bc1, inv_bc2 = 1.0f / bc2;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    const float mi = b1 * m[i] + one_b1 * gi;
    const float vi = b2 * v[i] + one_b2 * gi * gi;
    const float u = (mi * inv_bc1) / (std::sqrt(vi * inv_bc2) + eps) + wd * p[i];
    const float pi = p[i] - lr * u;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if (p_bf16) p_bf16[i] = to_bf16(pi);
  }
}

extern "C" int megatrain_omp_threads() {
#ifdef _OPENMP
  int n = 0;
#pragma omp parallel
  {
#pragma omp single
    n = omp_get_num_threads();
  }
  return n;
#else
  return 1;
#endif
}
