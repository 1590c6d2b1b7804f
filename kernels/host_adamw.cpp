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

#ifndef MEGATRAIN_PREFETCH
#define MEGATRAIN_PREFETCH 1024  // elements ahead to prefetch (0: leave it to the hardware)
#endif
#ifndef MEGATRAIN_PREFETCH_HINT
#define MEGATRAIN_PREFETCH_HINT 2  // __builtin_prefetch locality of read-only streams: 3 = L1, 2 = L2
#endif
#ifndef MEGATRAIN_PREFETCH_WRITE
#define MEGATRAIN_PREFETCH_WRITE 1  // 1: prefetch p, m, v for writing (prefetchw where the CPU has it); 0: for reading
#endif
#ifndef MEGATRAIN_CHUNK
#define MEGATRAIN_CHUNK 65536  // > 0: threads take chunks of up to this many elements; 0: one slice per thread
#endif
#ifndef MEGATRAIN_SPLIT
#define MEGATRAIN_SPLIT 2  // sub-ranges each thread walks side by side (more streams in flight per core)
#endif
static_assert(MEGATRAIN_SPLIT >= 1, "MEGATRAIN_SPLIT must be at least 1");
static_assert(MEGATRAIN_CHUNK >= 0 && MEGATRAIN_PREFETCH >= 0, "MEGATRAIN_CHUNK and MEGATRAIN_PREFETCH must be >= 0");
static_assert(MEGATRAIN_PREFETCH_HINT >= 0 && MEGATRAIN_PREFETCH_HINT <= 3, "MEGATRAIN_PREFETCH_HINT is 0 to 3");

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
    __builtin_prefetch(p + b + MEGATRAIN_PREFETCH, MEGATRAIN_PREFETCH_WRITE, MEGATRAIN_PREFETCH_HINT);
    __builtin_prefetch(m + b + MEGATRAIN_PREFETCH, MEGATRAIN_PREFETCH_WRITE, MEGATRAIN_PREFETCH_HINT);
    __builtin_prefetch(v + b + MEGATRAIN_PREFETCH, MEGATRAIN_PREFETCH_WRITE, MEGATRAIN_PREFETCH_HINT);
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
constexpr int64_t kStep = 16;  // one cache line of each float stream per block, prefetched MEGATRAIN_PREFETCH ahead
#else
constexpr int64_t kStep = 2048;
#endif

template <bool kState, bool kBf16>
void adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                 uint16_t* __restrict p_bf16, int64_t lo, int64_t hi, const Hyper h) {
  constexpr int64_t kSplit = MEGATRAIN_SPLIT;
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
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
#if MEGATRAIN_CHUNK > 0
    // Chunks first come, first served: a thread slowed by other work simply takes fewer. They start at
    // multiples of 32 elements from the buffers' start (whole cache lines of the bf16 copy, too), and are
    // shrunk for arrays under nt full chunks so that every thread still gets work.
    (void)t;
    constexpr int64_t kChunk = (MEGATRAIN_CHUNK + 31) / 32 * 32;
    const int64_t chunk = std::min(kChunk, std::max<int64_t>(32, ((n + nt - 1) / nt + 31) / 32 * 32));
    const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; ++c)
      adamw_range<kState, kBf16>(p, m, v, g, p_bf16, c * chunk, std::min(n, (c + 1) * chunk), h);
#else
    // Contiguous slices, starting at multiples of 16 elements from the buffers' start: one per thread.
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
