// Fused AdamW for host (CPU) memory: one pass over p, m, v, g updates all three in place and, optionally,
// writes a bfloat16 copy of the new parameters. Multi-threaded with OpenMP, vectorizable inner loop.
// The pass is limited by how many cache misses each core keeps in flight, so the work is laid out for that:
// - threads take 64K-element chunks first come, first served (a thread slowed by other work takes fewer);
// - each chunk is walked as two sub-ranges side by side (eight float streams per core instead of four);
// - each float stream is prefetched ahead of use (with -march=native GCC turns the prefetches of the
//   streams written back, p, m and v, into prefetchw; only g's hint selects a cache level).
// Measured on H100 machines: 1.07-1.23x one static slice per thread (experiments/studies/NOTES.md, v7 and v8).
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
//
// A third entry point is for capacity mode, where p, m and v themselves are stored as bfloat16 (uint16 bit
// patterns; g stays float32):
// - megatrain_adamw_bf16_sr: loads p, m, v as float32, does the same math in the same order, and writes each
//   back rounded stochastically to bfloat16 (see to_bf16_sr), so that updates smaller than half a bfloat16
//   step still move p on average. The random bits are a hash of (seed, stream, offset + i): they do not
//   depend on threads or chunking, and a call on a piece of an array, with offset = the piece's start, writes
//   what one call on the whole array writes there. Same chunk layout; blocks are one cache line of each
//   bfloat16 stream (32 elements).
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

// lowbias32 (Chris Wellons' integer hash): a bijection of uint32 with good avalanche.
static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Stochastic float -> bfloat16 rounding with random bits r (the low 16 are used): adding them to the 16
// bits that truncation drops rounds the magnitude up with probability (dropped bits) / 2^16, so the mean over
// r is x exactly (for finite x whose rounding up does not overflow to inf). NaN becomes a quiet NaN with its
// sign kept; inf stays inf. Branch-free so the loop vectorizes.
static inline uint16_t to_bf16_sr(float x, uint32_t r) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + (r & 0xffffu)) >> 16;
  const uint32_t nan = 0x7fc0u | ((u >> 16) & 0x8000u);
  const uint32_t special = ((u & 0x7fffffffu) > 0x7f800000u) ? nan : u >> 16;
  return static_cast<uint16_t>(((u & 0x7f800000u) == 0x7f800000u) ? special : rounded);
}

static inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

namespace {

// The measured layout (see above; experiments/studies/NOTES.md v7 and v8 compare it with the alternatives).
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

// Prefetch each stream kPrefetch elements ahead of block start b (p, m and v for writing, g for reading).
template <class T>
inline void prefetch_streams(const T* p, const T* m, const T* v, const float* g, int64_t b, int64_t hi) {
  if (b + kPrefetch < hi) {
    __builtin_prefetch(p + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(m + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(v + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(g + b + kPrefetch, 0, kPrefetchHint);
  }
}

template <bool kState, bool kBf16>
inline void adamw_block(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                        uint16_t* __restrict p_bf16, int64_t b, int64_t e, int64_t hi, const Hyper& h) {
  prefetch_streams(p, m, v, g, b, hi);
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

// Capacity mode: p, m and v are bfloat16 bits, written back with stochastic rounding. Same math, same order
// as adamw_block. Element i draws from counter offset + i (uint32, wrapping) under one key per stream.
struct Keys {
  uint32_t p, m, v, offset;
};

inline void adamw_sr_block(uint16_t* __restrict p, uint16_t* __restrict m, uint16_t* __restrict v,
                           const float* __restrict g, int64_t b, int64_t e, int64_t hi, const Hyper& h,
                           const Keys& k) {
  prefetch_streams(p, m, v, g, b, hi);
#pragma omp simd
  for (int64_t i = b; i < e; ++i) {
    const float p0 = from_bf16(p[i]);
    const float gi = g[i] * h.grad_scale;
    const float mi = h.b1 * from_bf16(m[i]) + h.one_b1 * gi;
    const float vi = h.b2 * from_bf16(v[i]) + h.one_b2 * gi * gi;
    const float u = (mi * h.inv_bc1) / (std::sqrt(vi * h.inv_bc2) + h.eps) + h.wd * p0;
    const float pi = p0 - h.lr * u;
    const uint32_t j = k.offset + static_cast<uint32_t>(i);
    p[i] = to_bf16_sr(pi, mix32(j ^ k.p));
    m[i] = to_bf16_sr(mi, mix32(j ^ k.m));
    v[i] = to_bf16_sr(vi, mix32(j ^ k.v));
  }
}

// kSplit sub-ranges of whole blocks (kBlock elements) of [lo, hi), walked side by side, then the remainder
// (under kSplit blocks) alone; block(b, e, end) does elements [b, e) of a sub-range that ends at end.
template <int64_t kBlock, class Block>
inline void split_range(int64_t lo, int64_t hi, const Block& block) {
  const int64_t sub = (hi - lo) / kSplit / kBlock * kBlock;
  for (int64_t off = 0; off < sub; off += kBlock)
    for (int64_t k = 0; k < kSplit; ++k) {
      const int64_t b = lo + k * sub + off, end = k + 1 < kSplit ? lo + (k + 1) * sub : hi;
      block(b, b + kBlock, end);
    }
  for (int64_t b = lo + kSplit * sub; b < hi; b += kBlock) block(b, std::min(b + kBlock, hi), hi);
}

template <bool kState, bool kBf16>
void adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                 uint16_t* __restrict p_bf16, int64_t lo, int64_t hi, const Hyper h) {
  split_range<kStep>(lo, hi, [&](int64_t b, int64_t e, int64_t end) {
    adamw_block<kState, kBf16>(p, m, v, g, p_bf16, b, e, end, h);
  });
}

// One cache line of each bfloat16 stream per block (two of g's).
constexpr int64_t kStepBf16 = 32;
static_assert(kChunk % kStepBf16 == 0, "bf16 blocks start on whole cache lines");

void adamw_sr_range(uint16_t* __restrict p, uint16_t* __restrict m, uint16_t* __restrict v,
                    const float* __restrict g, int64_t lo, int64_t hi, const Hyper h, const Keys k) {
  split_range<kStepBf16>(lo, hi, [&](int64_t b, int64_t e, int64_t end) {
    adamw_sr_block(p, m, v, g, b, e, end, h, k);
  });
}

std::atomic<int> g_threads{0};  // 0: OpenMP's default (all cores); set by megatrain_set_threads

// range(lo, hi) over the chunks of [0, n), on all threads.
template <class Range>
void parallel_chunks(int64_t n, const Range& range) {
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
    for (int64_t c = 0; c < chunks; ++c) range(c * chunk, std::min(n, (c + 1) * chunk));
  }
}

template <bool kState, bool kBf16>
void adamw_parallel(float* p, float* m, float* v, const float* g, uint16_t* p_bf16, int64_t n, const Hyper h) {
  parallel_chunks(n, [&](int64_t lo, int64_t hi) { adamw_range<kState, kBf16>(p, m, v, g, p_bf16, lo, hi, h); });
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

// Capacity mode (see the header): p, m, v bfloat16 bits, g float32, all three written back with stochastic
// rounding. Stream k (0: p, 1: m, 2: v) uses key mix32(seed ^ 0x9E3779B9 * (k + 1)); element i uses random
// bits mix32((uint32)(offset + i) ^ key). Counters wrap past 2^32: callers keep offset + n <= 2^32.
extern "C" void megatrain_adamw_bf16_sr(uint16_t* p, uint16_t* m, uint16_t* v, const float* g, int64_t n,
                                        float lr, float b1, float b2, float eps, float wd, float grad_scale,
                                        float bc1, float bc2, uint32_t seed, int64_t offset) {
  const Hyper h = make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2);
  const Keys k{mix32(seed ^ 0x9E3779B9u * 1u), mix32(seed ^ 0x9E3779B9u * 2u), mix32(seed ^ 0x9E3779B9u * 3u),
               static_cast<uint32_t>(offset)};
  parallel_chunks(n, [&](int64_t lo, int64_t hi) { adamw_sr_range(p, m, v, g, lo, hi, h, k); });
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
