// Fused AdamW for host (CPU) memory: one pass over p, m, v, g updates all three in place and, optionally,
// writes a bfloat16 copy of the new parameters. Multi-threaded with OpenMP, vectorizable inner loop.
// The pass is limited by how many cache misses each core keeps in flight, so the work is laid out for that:
// - threads take 64K-element chunks first come, first served (a thread slowed by other work takes fewer);
// - each chunk is walked as two sub-ranges side by side (eight float streams per core instead of four);
// - each float stream is prefetched ahead of use (with -march=native GCC turns the prefetches of the
//   streams written back, p, m and v, into prefetchw; only g's hint selects a cache level).
// Measured on H100 machines: 1.07-1.23x one static slice per thread (experiments/NOTES.md, v7 and v8).
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
#include <atomic>
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

namespace {

// The measured layout (see above; experiments/NOTES.md v7 and v8 compare it with the alternatives).
constexpr int64_t kChunk = 65536;    // elements per chunk that threads take first come, first served
constexpr int64_t kSplit = 2;        // sub-ranges of a chunk walked side by side
constexpr int64_t kStep = 16;        // elements per block: one cache line of each float stream
constexpr int64_t kPrefetch = 1024;  // elements ahead of use that each float stream is prefetched
constexpr int kPrefetchWrite = 1;    // p, m and v are prefetched for writing (prefetchw where the CPU has it)
constexpr int kPrefetchHint = 2;     // __builtin_prefetch locality of g: 2 = L2
static_assert(kChunk % 32 == 0, "chunks start on whole cache lines of the bfloat16 copy");

struct Hyper {
  float lr, b1, b2, eps, wd, grad_scale, one_b1, one_b2, inv_bc1, inv_bc2;
};

template <bool kState, bool kBf16>
inline void adamw_block(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                        uint16_t* __restrict p_bf16, int64_t b, int64_t e, int64_t hi, const Hyper& h) {
  if (b + kPrefetch < hi) {
    __builtin_prefetch(p + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(m + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(v + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(g + b + kPrefetch, 0, kPrefetchHint);
  }
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

template <bool kState, bool kBf16>
void adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                 uint16_t* __restrict p_bf16, int64_t lo, int64_t hi, const Hyper h) {
  // kSplit sub-ranges of whole blocks, walked side by side, then the remainder (under kSplit blocks) alone.
  const int64_t sub = (hi - lo) / kSplit / kStep * kStep;
  for (int64_t off = 0; off < sub; off += kStep)
    for (int64_t k = 0; k < kSplit; ++k) {
      const int64_t b = lo + k * sub + off, end = k + 1 < kSplit ? lo + (k + 1) * sub : hi;
      adamw_block<kState, kBf16>(p, m, v, g, p_bf16, b, b + kStep, end, h);
    }
  for (int64_t b = lo + kSplit * sub; b < hi; b += kStep)
    adamw_block<kState, kBf16>(p, m, v, g, p_bf16, b, std::min(b + kStep, hi), hi, h);
}

std::atomic<int> g_threads{0};  // 0: OpenMP's default (all cores); set by megatrain_set_threads

template <bool kState, bool kBf16>
void adamw_parallel(float* p, float* m, float* v, const float* g, uint16_t* p_bf16, int64_t n, const Hyper h) {
#ifdef _OPENMP
  const int set = g_threads.load(std::memory_order_relaxed);
  const int threads = set > 0 ? set : omp_get_max_threads();
#endif
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads();
#else
    const int64_t nt = 1;
#endif
    // Chunks first come, first served: a thread slowed by other work simply takes fewer. They start at
    // multiples of 32 elements from the buffers' start (whole cache lines of the bf16 copy, too), and are
    // shrunk for arrays under nt full chunks so that every thread still gets work.
    const int64_t chunk = std::min(kChunk, std::max<int64_t>(32, ((n + nt - 1) / nt + 31) / 32 * 32));
    const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; ++c)
      adamw_range<kState, kBf16>(p, m, v, g, p_bf16, c * chunk, std::min(n, (c + 1) * chunk), h);
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

extern "C" void megatrain_set_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

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
