// Fused AdamW for host (CPU) memory: one pass over p, m, v, g updates all three in place and, optionally,
// writes a bfloat16 copy of the new parameters. Multi-threaded with OpenMP, vectorizable inner loop.
// The pass is limited by how many cache misses each core keeps in flight, so the work is laid out for that:
// threads take 64K-element chunks in turn (a thread slowed by other work takes fewer), each chunk is walked
// as two halves side by side (eight read streams per core instead of four), and each stream is prefetched
// into L2 ahead of use. Measured on the H100 machine: +10-18% over one static slice per thread
// (experiments/NOTES.md, v7).
// The math is optax.adamw's (scale_by_adam -> add_decayed_weights -> scale_by_learning_rate):
//   g'  = g * grad_scale
//   m   = b1 m + (1 - b1) g'          v = b2 v + (1 - b2) g'^2
//   u   = (m / bc1) / (sqrt(v / bc2) + eps) + wd p
//   p   = p - lr u
// where bc1 = 1 - b1^t and bc2 = 1 - b2^t are computed by the caller.
//
// Two entry points share one element function, so their results agree bit for bit (the build turns off
// floating-point contraction, so no call site can fuse a multiply-add differently):
// - megatrain_adamw: the whole update, in place (p, m, v; bf16 copy optional);
// - megatrain_adamw_stream: only the bf16 copy of the new p (reads p, m, v, g; writes 2 bytes per
//   parameter instead of 12). The engine runs it first, on the step's critical path, and the whole update
//   later, off it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef MEGATRAIN_PREFETCH
#define MEGATRAIN_PREFETCH 1024  // elements ahead to prefetch into L2 (0: leave it to the hardware)
#endif
#ifndef MEGATRAIN_PREFETCH_HINT
#define MEGATRAIN_PREFETCH_HINT 2  // __builtin_prefetch locality: 3 = into L1, 2 = into L2
#endif
#ifndef MEGATRAIN_CHUNK
#define MEGATRAIN_CHUNK 65536  // > 0: threads take chunks of this many elements in turn; 0: one slice per thread
#endif
#ifndef MEGATRAIN_SPLIT
#define MEGATRAIN_SPLIT 2  // sub-ranges each thread walks side by side (more streams in flight per core)
#endif

// Round-to-nearest-even float -> bfloat16, NaN kept quiet. Branch-free so the loop vectorizes.
static inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : rounded);
}

namespace {

struct Hyper {
  float lr, b1, b2, eps, wd, grad_scale, one_b1, one_b2, inv_bc1, inv_bc2;
};

template <bool kState, bool kBf16>
inline void adamw_block(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                        uint16_t* __restrict p_bf16, int64_t b, int64_t e, int64_t hi, const Hyper& h) {
#if MEGATRAIN_PREFETCH > 0
  if (b + MEGATRAIN_PREFETCH < hi) {
    __builtin_prefetch(p + b + MEGATRAIN_PREFETCH, 1, MEGATRAIN_PREFETCH_HINT);
    __builtin_prefetch(m + b + MEGATRAIN_PREFETCH, 1, MEGATRAIN_PREFETCH_HINT);
    __builtin_prefetch(v + b + MEGATRAIN_PREFETCH, 1, MEGATRAIN_PREFETCH_HINT);
    __builtin_prefetch(g + b + MEGATRAIN_PREFETCH, 0, MEGATRAIN_PREFETCH_HINT);
  }
#endif
#pragma omp simd
  for (int64_t i = b; i < e; ++i) {
    const float gi = g[i] * h.grad_scale;
    const float mi = h.b1 * m[i] + h.one_b1 * gi;
    const float vi = h.b2 * v[i] + h.one_b2 * gi * gi;
    const float u = (mi * h.inv_bc1) / (std::sqrt(vi * h.inv_bc2) + h.eps) + h.wd * p[i];
    const float pi = p[i] - h.lr * u;
    if (kState) {
      m[i] = mi;
      v[i] = vi;
      p[i] = pi;
    }
    if (kBf16) p_bf16[i] = to_bf16(pi);
  }
}

#if MEGATRAIN_PREFETCH > 0
constexpr int64_t kStep = 16;  // one cache line of each stream per block, prefetched MEGATRAIN_PREFETCH ahead
#else
constexpr int64_t kStep = 2048;
#endif

template <bool kState, bool kBf16>
void adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                 uint16_t* __restrict p_bf16, int64_t lo, int64_t hi, const Hyper h) {
  constexpr int64_t kSplit = MEGATRAIN_SPLIT;
  // kSplit sub-ranges of whole blocks, walked side by side; the last one also takes the remainder.
  const int64_t sub = (hi - lo) / kSplit / kStep * kStep;
  for (int64_t off = 0; off < sub; off += kStep)
    for (int64_t k = 0; k < kSplit; ++k) {
      const int64_t b = lo + k * sub + off, end = k + 1 < kSplit ? lo + (k + 1) * sub : hi;
      adamw_block<kState, kBf16>(p, m, v, g, p_bf16, b, b + kStep, end, h);
    }
  for (int64_t b = lo + kSplit * sub; b < hi; b += kStep)
    adamw_block<kState, kBf16>(p, m, v, g, p_bf16, b, std::min(b + kStep, hi), hi, h);
}

int g_threads = 0;  // 0: OpenMP's default (all cores); set by megatrain_set_threads

template <bool kState, bool kBf16>
void adamw_parallel(float* p, float* m, float* v, const float* g, uint16_t* p_bf16, int64_t n, const Hyper h) {
#ifdef _OPENMP
  const int threads = g_threads > 0 ? g_threads : omp_get_max_threads();
#endif
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
#if MEGATRAIN_CHUNK > 0
    // 64-byte aligned chunks handed out in turn: a thread slowed by other work simply takes fewer.
    (void)t;
    (void)nt;
    constexpr int64_t kChunk = (MEGATRAIN_CHUNK + 15) / 16 * 16;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; ++c)
      adamw_range<kState, kBf16>(p, m, v, g, p_bf16, c * kChunk, std::min(n, (c + 1) * kChunk), h);
#else
    // Contiguous, 64-byte aligned slices: each thread streams its own range.
    const int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;
    const int64_t lo = std::min(n, t * per), hi = std::min(n, lo + per);
    if (lo < hi) adamw_range<kState, kBf16>(p, m, v, g, p_bf16, lo, hi, h);
#endif
  }
}

Hyper make_hyper(float lr, float b1, float b2, float eps, float wd, float grad_scale, float bc1, float bc2) {
  return Hyper{lr, b1, b2, eps, wd, grad_scale, 1.0f - b1, 1.0f - b2, 1.0f / bc1, 1.0f / bc2};
}

}  // namespace

extern "C" void megatrain_adamw(float* p, float* m, float* v, const float* g, uint16_t* p_bf16, int64_t n,
                                float lr, float b1, float b2, float eps, float wd, float grad_scale,
                                float bc1, float bc2) {
  const Hyper h = make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2);
  if (p_bf16)
    adamw_parallel<true, true>(p, m, v, g, p_bf16, n, h);
  else
    adamw_parallel<true, false>(p, m, v, g, nullptr, n, h);
}

extern "C" void megatrain_adamw_stream(float* p, float* m, float* v, const float* g, uint16_t* p_bf16,
                                       int64_t n, float lr, float b1, float b2, float eps, float wd,
                                       float grad_scale, float bc1, float bc2) {
  adamw_parallel<false, true>(p, m, v, g, p_bf16, n, make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2));
}

extern "C" void megatrain_set_threads(int n) { g_threads = n > 0 ? n : 0; }

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
