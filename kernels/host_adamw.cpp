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
// Both take g as float32 or as bfloat16 bits (g_bf16): a bfloat16 gradient, widened to float32 as it is read,
// gives the results a float32 gradient of the same values gives, at 2 bytes a parameter less read per pass.
//
// A third entry point is for capacity mode, where p, m and v themselves are stored as bfloat16 (uint16 bit
// patterns; g stays float32):
// - megatrain_adamw_bf16_sr: loads p, m, v as float32, does the same math in the same order, and writes each
//   back rounded stochastically to bfloat16 (see to_bf16_sr), so that updates smaller than half a bfloat16
//   step still move p on average. The random bits are a hash of (seed, stream, offset + i): they do not
//   depend on threads or chunking, and a call on a piece of an array, with offset = the piece's start, writes
//   what one call on the whole array writes there. Same chunk layout; blocks are one cache line of each
//   bfloat16 stream (32 elements).
// - megatrain_adamw_bf16_sr_g16: the same with a bfloat16 gradient (uint16 bits), for engines that keep
//   their gradients in bfloat16; one templated element function serves both, so the float32 path is unchanged.
//
// A fifth entry point keeps the moments in 8 bits (issue 35): megatrain_adamw_q8. p is bfloat16 bits (written
// back with stochastic rounding, as above), g is float32 or bfloat16, and m and v are one byte per element,
// each with one float32 scale (the block's absmax) per quantization block. The array is viewed as rows x cols;
// each row is cut into blocks of `block` elements, the last one of a row possibly shorter, so a call on a
// range of whole rows (offset = the flat index of its first element) writes what one call on the whole array
// writes there. The codes are small floats of our own, scaled so that the block's largest magnitude is VMAX:
// - m: sign (bit 7) + "e4m3", exponent bias 15, subnormals, no inf/NaN codes. Magnitude code c in [0, 128),
//   e = c >> 3, f = c & 7: value f * 2^-17 when e == 0, else (1 + f/8) * 2^(e-15); VMAX = 1.875 (c = 127).
// - v: unsigned "e5m3", bias 31: c in [0, 256), value f * 2^-33 when e == 0, else (1 + f/8) * 2^(e-31);
//   VMAX = 1.875 (c = 255).
// Per element, with the old scales sm = absmax_m / VMAX and sv = absmax_v / VMAX of its block:
//   m0 = decode_m(code) * sm, v0 = decode_v(code) * sv, then adamw_sr_block's math in the same order. Per block,
//   the new absmax_m = max |m|, absmax_v = max v, and each moment is encoded as y = min(|x| * VMAX / absmax,
//   VMAX) rounded stochastically to the grid (q8_encode_mag): unbiased, since an EMA step of v by (1 - b2) is
//   under half a step of a 3-bit mantissa and round-to-nearest would never let v decay. One exception: a
//   positive v never gets code 0 (code 1 instead), which keeps sqrt(v) away from 0 where m may be nonzero.
// A sixth keeps m in 7 bits and v in 5 (m7v5, megatrain_adamw_m7v5): small floats of the 8-bit format's kind
// with narrower fields (Q8Grid<bias, mantissa bits>), scaled so that the block's largest magnitude is the format's
// largest value:
// - m: sign (bit 6) + "e3m3", bias 7: f * 2^-9 when e == 0, else (1 + f/8) * 2^(e-7); VMAX = 1.875;
// - v: "e4m1", bias 15: f * 2^-15 when e == 0, else (1 + f/2) * 2^(e-15); VMAX = 1.5.
// The codes are packed eight to a group of 7 (m) and 5 (v) bytes, element 8j + i at bits 7i (5i) of group j's
// little-endian word (rows and blocks a multiple of 8 long, so no group is shared by two of them).
// Random bits: stream 0 rounds p, 1 m, 2 v (the capacity kernel's keys and counters). Non-finite values are
// not special-cased (the engine skips non-finite steps before updating): p follows to_bf16_sr, a NaN or inf
// moment gets some code and the block's absmax may come out NaN or inf (its codes then mean nothing); nothing
// is written out of range and nothing traps.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && !defined(MEGATRAIN_NO_INTRINSICS)
#include <immintrin.h>
#define MEGATRAIN_AVX2 1
#elif defined(__BMI2__) && !defined(MEGATRAIN_NO_INTRINSICS)
#include <immintrin.h>  // pdep and pext (the m7v5 codes' groups)
#endif
// The quantized kernels' passes in AVX-512 too (16 elements a vector), where the compiler targets it and
// MEGATRAIN_NO_AVX512 does not leave them out (tests build that way to compare the two bit for bit).
#if defined(MEGATRAIN_AVX2) && defined(__AVX512F__) && !defined(MEGATRAIN_NO_AVX512)
#define MEGATRAIN_AVX512 1
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

// Gradient element i as float32, from float32 or bfloat16 bits.
static inline float grad_at(const float* g, int64_t i) { return g[i]; }
static inline float grad_at(const uint16_t* g, int64_t i) { return from_bf16(g[i]); }

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
template <class T, class G>
inline void prefetch_streams(const T* p, const T* m, const T* v, const G* g, int64_t b, int64_t hi) {
  if (b + kPrefetch < hi) {
    __builtin_prefetch(p + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(m + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(v + b + kPrefetch, kPrefetchWrite, kPrefetchHint);
    __builtin_prefetch(g + b + kPrefetch, 0, kPrefetchHint);
  }
}

// The stream pass (kState false) only reads p, m and v: its prefetches ask for reading, not for writing, and its
// bfloat16 copy is written past the caches where the build has AVX2 (non-temporal stores of whole 32-byte
// blocks, so no line of it is read first; the engine's copy goes to the GPU by DMA, not back to this core);
// adamw_parallel fences once per thread. Measured on the H200's 16-core host: the stream pass 1.13x
// (experiments/results/h200_host_kernel_rates_846432b.json). The whole update keeps plain stores: non-temporal
// stores of its outputs measured slower on an H100 host (docs/decisions.md, "Tried and rejected").
template <bool kState, bool kBf16, class G>
inline void adamw_block(float* __restrict p, float* __restrict m, float* __restrict v, const G* __restrict g,
                        uint16_t* __restrict p_bf16, int64_t b, int64_t e, int64_t hi, const Hyper& h) {
  if (kState) {
    prefetch_streams(p, m, v, g, b, hi);
  } else if (b + kPrefetch < hi) {
    __builtin_prefetch(p + b + kPrefetch, 0, kPrefetchHint);
    __builtin_prefetch(m + b + kPrefetch, 0, kPrefetchHint);
    __builtin_prefetch(v + b + kPrefetch, 0, kPrefetchHint);
    __builtin_prefetch(g + b + kPrefetch, 0, kPrefetchHint);
  }
#ifdef MEGATRAIN_AVX2
  alignas(32) uint16_t copy[kStep];
  const bool streamed = !kState && kBf16 && e - b == kStep && (reinterpret_cast<uintptr_t>(p_bf16 + b) & 31u) == 0;
  uint16_t* __restrict out = streamed ? copy : kBf16 ? p_bf16 + b : nullptr;
#else
  uint16_t* __restrict out = kBf16 ? p_bf16 + b : nullptr;
#endif
#pragma omp simd
  for (int64_t i = b; i < e; ++i) {
    const float gi = grad_at(g, i) * h.grad_scale;
    const float mi = h.b1 * m[i] + h.one_b1 * gi;
    const float vi = h.b2 * v[i] + h.one_b2 * gi * gi;
    const float u = (mi * h.inv_bc1) / (std::sqrt(vi * h.inv_bc2) + h.eps) + h.wd * p[i];
    const float pi = p[i] - h.lr * u;
    if (kState) {
      m[i] = mi;
      v[i] = vi;
      p[i] = pi;
    }
    if (kBf16) out[i - b] = to_bf16(pi);
  }
#ifdef MEGATRAIN_AVX2
  if (streamed)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p_bf16 + b), _mm256_load_si256(reinterpret_cast<__m256i*>(copy)));
#endif
}

// Capacity mode: p, m and v are bfloat16 bits, written back with stochastic rounding. Same math, same order
// as adamw_block. Element i draws from counter offset + i (uint32, wrapping) under one key per stream.
struct Keys {
  uint32_t p, m, v, offset;
};

template <class G>
inline void adamw_sr_block(uint16_t* __restrict p, uint16_t* __restrict m, uint16_t* __restrict v,
                           const G* __restrict g, int64_t b, int64_t e, int64_t hi, const Hyper& h,
                           const Keys& k) {
  prefetch_streams(p, m, v, g, b, hi);
#pragma omp simd
  for (int64_t i = b; i < e; ++i) {
    const float p0 = from_bf16(p[i]);
    const float gi = grad_at(g, i) * h.grad_scale;
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

template <bool kState, bool kBf16, class G>
void adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const G* __restrict g,
                 uint16_t* __restrict p_bf16, int64_t lo, int64_t hi, const Hyper h) {
  split_range<kStep>(lo, hi, [&](int64_t b, int64_t e, int64_t end) {
    adamw_block<kState, kBf16>(p, m, v, g, p_bf16, b, e, end, h);
  });
}

// One cache line of each bfloat16 stream per block (two of g's).
constexpr int64_t kStepBf16 = 32;
static_assert(kChunk % kStepBf16 == 0, "bf16 blocks start on whole cache lines");

template <class G>
void adamw_sr_range(uint16_t* __restrict p, uint16_t* __restrict m, uint16_t* __restrict v,
                    const G* __restrict g, int64_t lo, int64_t hi, const Hyper h, const Keys k) {
  split_range<kStepBf16>(lo, hi, [&](int64_t b, int64_t e, int64_t end) {
    adamw_sr_block(p, m, v, g, b, e, end, h, k);
  });
}

std::atomic<int> g_threads{0};  // 0: OpenMP's default (all cores); set by megatrain_set_threads

// The threads a parallel region asks for: megatrain_set_threads' count, else OpenMP's default.
int team_size() {
#ifdef _OPENMP
  const int set = g_threads.load(std::memory_order_relaxed);
  return set > 0 ? set : omp_get_max_threads();
#else
  return 1;
#endif
}

// range(lo, hi) over the chunks of [0, n), on all threads; with fence, each thread ends with a store fence (its
// non-temporal stores are then visible to whoever reads after the call returns).
template <class Range>
void parallel_chunks(int64_t n, const Range& range, bool fence = false) {
  const int threads = team_size();
  (void)threads;  // unused without OpenMP
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
#ifdef MEGATRAIN_AVX2
    if (fence) _mm_sfence();
#else
    (void)fence;
#endif
  }
}

template <bool kState, bool kBf16, class G>
void adamw_parallel(float* p, float* m, float* v, const G* g, uint16_t* p_bf16, int64_t n, const Hyper h) {
  parallel_chunks(n, [&](int64_t lo, int64_t hi) { adamw_range<kState, kBf16>(p, m, v, g, p_bf16, lo, hi, h); },
                  !kState && kBf16);
}

Hyper make_hyper(float lr, float b1, float b2, float eps, float wd, float grad_scale, float bc1, float bc2) {
  return Hyper{lr, b1, b2, eps, wd, grad_scale, 1.0f - b1, 1.0f - b2, 1.0f / bc1, 1.0f / bc2};
}

// The keys of streams 0 (p), 1 (m) and 2 (v) under seed, and the counter of element 0.
Keys make_keys(uint32_t seed, int64_t offset) {
  return Keys{mix32(seed ^ 0x9E3779B9u * 1u), mix32(seed ^ 0x9E3779B9u * 2u), mix32(seed ^ 0x9E3779B9u * 3u),
              static_cast<uint32_t>(offset)};
}

template <class G>
void adamw_sr_parallel(uint16_t* p, uint16_t* m, uint16_t* v, const G* g, int64_t n, const Hyper h, const Keys k) {
  parallel_chunks(n, [&](int64_t lo, int64_t hi) { adamw_sr_range(p, m, v, g, lo, hi, h, k); });
}

// ---- 8-bit moments (see the header for the formats) ----

constexpr int64_t kQ8MaxBlock = 4096;  // the largest quantization block: per-thread buffers are this long
constexpr float kQ8Max = 1.875f;       // VMAX of both formats: (1 + 7/8) * 2^0
constexpr int kBiasM = 15, kBiasV = 31;

// The small float with exponent bias kBias, kMant mantissa bits (3 for the 8-bit format; 0 to 3) and
// subnormals: kSub = 2^(1 - kBias - kMant) is the subnormal step; 2^(1 - kBias), the smallest normal value, has
// float32 bits kMinNormalBits. Its largest value is (2 - 2^-kMant) 2^0, the code (kBias << kMant) | (2^kMant - 1).
template <int kBias, int kMant = 3>
struct Q8Grid {
  static_assert(kMant >= 0 && kMant <= 3, "the encoder's 20 random bits reach the dropped mantissa bits' top");
  static constexpr int kDrop = 23 - kMant;  // the float32 mantissa bits that rounding to kMant drops
  static constexpr float kSub = 1.0f / static_cast<float>(uint64_t{1} << (kBias + kMant - 1));
  static constexpr uint32_t kMinNormalBits = (128u - kBias) << 23;
  static constexpr float kFix = static_cast<float>(uint64_t{1} << (kBias + 22));  // 2^kDrop / kSub
  static constexpr float kVmax = 2.0f - 1.0f / static_cast<float>(1u << kMant);

  // The exact value of magnitude code c (exponent c >> kMant, mantissa the low kMant bits): a normal one is its
  // float32 bit pattern (exponent rebased, mantissa on top), a subnormal one f * kSub (exact). Branch-free.
  static inline float decode(uint32_t c) {
    const uint32_t e = c >> kMant, f = c & ((1u << kMant) - 1u);
    const uint32_t bits = ((e + (127 - kBias)) << 23) | (f << kDrop);
    float normal;
    std::memcpy(&normal, &bits, 4);
    const float sub = static_cast<float>(static_cast<int32_t>(f)) * kSub;
    return e == 0 ? sub : normal;
  }

  // Stochastic rounding of y in [0, kQ8Max] to a magnitude code with random bits r (the low 20 used). At or
  // above the smallest normal: adding them to the 20 mantissa bits that truncation to 3 drops rounds up with
  // probability (dropped bits) / 2^20, as to_bf16_sr does with 16; the exponent and top 3 mantissa bits are
  // then the code (no carry past kQ8Max, whose dropped bits are 0). Below, in the uniform subnormal range:
  // t = y / kSub in [0, 8) as 20-bit fixed point, floor(t * 2^20) (the significand shifted right by the
  // exponent's distance, at most 31), rounded up with probability of its fraction (t rounded up to 8 is code
  // 8, the smallest normal: right). So the mean over r is y exactly wherever y / kSub has no bits below 2^-20,
  // and within 2^-20 steps of y elsewhere. Integer operations only, which vectorize whatever the build flags
  // say about floating-point traps.
  // With kMant < 3 the 20 random bits are the top of the kDrop dropped ones (shifted up by 3 - kMant), and the
  // subnormal t is y / kSub in kDrop-bit fixed point: floor(y * 2^(kBias + 22)) for every kMant, the same shift.
  static inline uint32_t encode(float y, uint32_t r) {
    uint32_t u;
    std::memcpy(&u, &y, 4);
    const uint32_t low = (r & 0xfffffu) << (3 - kMant);
    const uint32_t normal = ((u + low) >> kDrop) - ((127u - kBias) << kMant);
    const uint32_t shift = 128u - kBias - (u >> 23);  // >= 1 below the smallest normal
    const uint32_t fixed = ((u & 0x7fffffu) | 0x800000u) >> (shift < 31u ? shift : 31u);
    const uint32_t sub = (fixed + low) >> kDrop;
    return u >= kMinNormalBits ? normal : sub;
  }
};
using GridM = Q8Grid<kBiasM>;
using GridV = Q8Grid<kBiasV>;

// m's code: sign in bit 7, magnitude below.
static inline float decode_m(uint8_t c) {
  const float mag = GridM::decode(c & 0x7fu);
  uint32_t bits;
  std::memcpy(&bits, &mag, 4);
  bits |= static_cast<uint32_t>(c & 0x80u) << 24;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

static inline float decode_v(uint8_t c) { return GridV::decode(c); }

// VMAX / absmax: the factor that maps a block onto [0, VMAX]. Capped at FLT_MAX, so that a block of zeros
// (VMAX / 0) or one whose largest value is a float32 subnormal (VMAX / absmax overflows) maps 0 to 0,
// not inf * 0 = NaN.
static inline float q8_inverse_scale(float absmax) {
  const float q = kQ8Max / absmax;
  constexpr float kBig = std::numeric_limits<float>::max();
  return q < kBig ? q : kBig;
}


#ifdef MEGATRAIN_AVX2
// AVX2 versions of the passes of adamw_q8_block and adamw_small_block, 8 elements a vector, operation for operation
// the arithmetic of the scalar code (same float operations on the same operands, so the same roundings; the
// integer steps rewritten into fewer instructions with equal results, as noted at each). GCC's vectorization of
// the scalar loops spent about twice the instructions (byte packing, selects it would not turn into min/max,
// spills; experiments/studies/NOTES.md).
namespace quant_avx2 {

inline __m256i set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int32_t>(x)); }
inline __m256 as_ps(__m256i x) { return _mm256_castsi256_ps(x); }
inline __m256i as_si(__m256 x) { return _mm256_castps_si256(x); }

// mix32 lane by lane; tail: mix32 without its first step (mix32(x) == mix32_tail(x ^ (x >> 16))).
inline __m256i mix32_tail(__m256i x) {
  x = _mm256_mullo_epi32(x, set1(0x7feb352du));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, set1(0x846ca68bu));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
inline __m256i mix32(__m256i x) { return mix32_tail(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16))); }

// 8 bfloat16 bits (uint16) or float32 values as float32.
inline __m256 load_f32(const uint16_t* a) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  return as_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load_f32(const float* a) { return _mm256_loadu_ps(a); }

// Q8Grid<kBias>::decode of 8 magnitude codes (int32 lanes in [0, 256)): the normal pattern
// ((e + 127 - kBias) << 23) | (f << 20) is (c << 20) + ((127 - kBias) << 23); codes under 8 (e == 0) take
// f * kSub, f == c there.
template <int kBias, int kMant = 3>
inline __m256 decode(__m256i c) {
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(c, 23 - kMant), set1((127u - kBias) << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(Q8Grid<kBias, kMant>::kSub));
  return _mm256_blendv_ps(as_ps(normal), sub, as_ps(_mm256_cmpgt_epi32(set1(1u << kMant), c)));
}

// to_bf16_sr of 8 floats with random bits r, as 8 uint32 lanes (< 2^16). Lanes whose exponent is all ones
// (inf, NaN) are rare: their selects run only when a vector has one.
inline __m256i to_bf16_sr(__m256 x, __m256i r) {
  const __m256i u = as_si(x);
  __m256i out = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_and_si256(r, set1(0xffffu))), 16);
  const __m256i exp_ones = _mm256_cmpeq_epi32(_mm256_and_si256(u, set1(0x7f800000u)), set1(0x7f800000u));
  if (!_mm256_testz_si256(exp_ones, exp_ones)) {
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i nan = _mm256_or_si256(set1(0x7fc0u), _mm256_and_si256(hi, set1(0x8000u)));
    // |u| > 0x7f800000 as int32 (the and clears the sign bit, so signed compare is unsigned compare)
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, set1(0x7fffffffu)), set1(0x7f800000u));
    const __m256i special = _mm256_blendv_epi8(hi, nan, is_nan);
    out = _mm256_blendv_epi8(out, special, exp_ones);
  }
  return out;
}

// Q8Grid<kBias>::encode of 8 values y (float32 bits u) with random bits r. The normal branch:
// ((u + low) >> 20) - ((127 - kBias) << 3) == (u - ((127 - kBias) << 23) + low) >> 20 modulo 2^12 (the callers
// keep the low 8 bits, or y is in [0, 1.875] and it is exact). The subnormal branch, taken only for
// 0 <= u < kMinNormalBits: ((u & 0x7fffff) | 0x800000) >> min(128 - kBias - (u >> 23), 31) equals
// floor(y * 2^(kBias + 22)): y times a power of two is exact, under 2^23 there, and truncated by cvttps; for
// float32 subnormals y (exponent field 0) both are 0. The product is capped at 2^23 as a float (min), which
// changes nothing below the smallest normal and keeps other lanes' conversion defined (its result unused).
// The branch test u >= kMinNormalBits is unsigned: a signed compare or'd with u's sign bit (blendv_ps reads
// only the sign bit of each lane).
template <int kBias, int kMant = 3>
inline __m256i encode(__m256 y, __m256i r) {
  using Grid = Q8Grid<kBias, kMant>;
  const __m256i u = as_si(y);
  const __m256i low = _mm256_slli_epi32(_mm256_and_si256(r, set1(0xfffffu)), 3 - kMant);
  const __m256i normal = _mm256_sub_epi32(u, set1((127u - kBias) << 23));
  const __m256 t = _mm256_min_ps(_mm256_mul_ps(y, _mm256_set1_ps(Grid::kFix)),
                                 _mm256_set1_ps(static_cast<float>(1u << 23)));
  const __m256i fixed = _mm256_cvttps_epi32(t);
  const __m256i is_normal = _mm256_or_si256(_mm256_cmpgt_epi32(u, set1(Grid::kMinNormalBits - 1)), u);
  const __m256i x = as_si(_mm256_blendv_ps(as_ps(fixed), as_ps(normal), as_ps(is_normal)));
  return _mm256_srli_epi32(_mm256_add_epi32(x, low), Grid::kDrop);
}

// 32 uint32 lanes (each < 256) as 32 bytes, in order.
inline void store_bytes(uint8_t* out, __m256i a0, __m256i a1, __m256i a2, __m256i a3) {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(a0, a1), _mm256_packus_epi32(a2, a3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The codes of elements x .. x + 7 as int32 lanes: one byte each (8-bit moments).
struct Q8Codes {
  static inline __m256i load(const uint8_t* a, int64_t x) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a + x)));
  }
  // decode_m without the scale: the magnitude's value with the code's sign bit (bit 7) moved to bit 31
  static inline __m256 decode_m(__m256i c) {
    const __m256 mag = decode<kBiasM>(_mm256_and_si256(c, set1(0x7fu)));
    return _mm256_or_ps(mag, as_ps(_mm256_slli_epi32(_mm256_and_si256(c, set1(0x80u)), 24)));
  }
  static inline __m256 decode_v(__m256i c) { return decode<kBiasV>(c); }
  // The second pass's side: the largest scaled magnitude, the codes of 8 scaled magnitudes y in [0, vmax] with
  // random bits r (m's under 128, so its sign bit is free), m's sign bit from its float's, and 32 codes stored.
  static inline __m256 vmax() { return _mm256_set1_ps(kQ8Max); }
  static inline __m256i code_m(__m256 y, __m256i r) { return encode<kBiasM>(y, r); }
  static inline __m256i sign_m(__m256 mi) { return _mm256_and_si256(_mm256_srli_epi32(as_si(mi), 24), set1(0x80u)); }
  static inline __m256i code_v(__m256 y, __m256i r) { return _mm256_and_si256(encode<kBiasV>(y, r), set1(0xffu)); }
  static inline void store(uint8_t* a, int64_t x, __m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    store_bytes(a + x, c0, c1, c2, c3);
  }
};

// The codes of a small float of kE exponent and kM mantissa bits (bias 2^kE - 1; Q8Grid<bias, kM>), one a byte
// (a block's codes, unpacked from their groups to a buffer of its own, adamw_small_block): m's with its sign in
// the bit above the magnitude (bit kE + kM).
template <int kE, int kM>
struct SmallCodes {
  static constexpr int kBias = (1 << kE) - 1, kSignAt = kE + kM;
  static constexpr uint32_t kMag = (1u << kSignAt) - 1u;
  static inline __m256i load(const uint8_t* a, int64_t x) { return Q8Codes::load(a, x); }
  static inline __m256 decode_m(__m256i c) {
    const __m256 mag = decode<kBias, kM>(_mm256_and_si256(c, set1(kMag)));
    return _mm256_or_ps(mag, as_ps(_mm256_slli_epi32(_mm256_and_si256(c, set1(1u << kSignAt)), 31 - kSignAt)));
  }
  static inline __m256 decode_v(__m256i c) { return decode<kBias, kM>(c); }
  static inline __m256 vmax() { return _mm256_set1_ps(Q8Grid<kBias, kM>::kVmax); }
  static inline __m256i code_m(__m256 y, __m256i r) { return encode<kBias, kM>(y, r); }
  static inline __m256i sign_m(__m256 mi) {
    return _mm256_and_si256(_mm256_srli_epi32(as_si(mi), 31 - kSignAt), set1(1u << kSignAt));
  }
  static inline __m256i code_v(__m256 y, __m256i r) { return _mm256_and_si256(encode<kBias, kM>(y, r), set1(kMag)); }
  static inline void store(uint8_t* a, int64_t x, __m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    store_bytes(a + x, c0, c1, c2, c3);
  }
};

// The first pass on elements [0, n8) of the block (n8 a multiple of 8): p written, m and v to mb and vb, their
// maxima into *am and *av (which start at 0, as the scalar loop's do). sm and sv multiply the decoded codes.
// Element lo + i's codes are at index c0 + i of m and v (c0 = lo where they are the arrays' own; 0 where a
// block's codes were unpacked to buffers of their own).
template <class MC, class VC, bool kP, class G>
inline void pass1(uint16_t* __restrict p, const uint8_t* __restrict m, const uint8_t* __restrict v,
                  const G* __restrict g, int64_t lo, int64_t c0, int64_t n8, float sm_, float sv_, const Hyper& h,
                  const Keys& k, float* __restrict mb, float* __restrict vb, float* am_out, float* av_out) {
  const __m256 sm = _mm256_set1_ps(sm_), sv = _mm256_set1_ps(sv_);
  const __m256 grad_scale = _mm256_set1_ps(h.grad_scale), b1 = _mm256_set1_ps(h.b1), b2 = _mm256_set1_ps(h.b2);
  const __m256 one_b1 = _mm256_set1_ps(h.one_b1), one_b2 = _mm256_set1_ps(h.one_b2);
  const __m256 inv_bc1 = _mm256_set1_ps(h.inv_bc1), inv_bc2 = _mm256_set1_ps(h.inv_bc2);
  const __m256 eps = _mm256_set1_ps(h.eps), wd = _mm256_set1_ps(h.wd), lr = _mm256_set1_ps(h.lr);
  const __m256 abs_mask = as_ps(set1(0x7fffffffu));
  const __m256i kp = set1(k.p);
  __m256i j = _mm256_add_epi32(set1(k.offset + static_cast<uint32_t>(lo)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 am = _mm256_setzero_ps(), av = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8) {
    const int64_t x = lo + i;
    const __m256 gi = _mm256_mul_ps(load_f32(g + x), grad_scale);
    const __m256 m0 = _mm256_mul_ps(MC::decode_m(MC::load(m, c0 + i)), sm);
    const __m256 v0 = _mm256_mul_ps(VC::decode_v(VC::load(v, c0 + i)), sv);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, m0), _mm256_mul_ps(one_b1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, v0), _mm256_mul_ps(_mm256_mul_ps(one_b2, gi), gi));
    if constexpr (kP) {
      const __m256 p0 = load_f32(p + x);
      const __m256 den = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi, inv_bc2)), eps);
      const __m256 u = _mm256_add_ps(_mm256_div_ps(_mm256_mul_ps(mi, inv_bc1), den), _mm256_mul_ps(wd, p0));
      const __m256 pi = _mm256_sub_ps(p0, _mm256_mul_ps(lr, u));
      const __m256i pb = to_bf16_sr(pi, mix32(_mm256_xor_si256(j, kp)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p + x),
                       _mm_packus_epi32(_mm256_castsi256_si128(pb), _mm256_extracti128_si256(pb, 1)));
    }
    _mm256_storeu_ps(mb + i, mi);
    _mm256_storeu_ps(vb + i, vi);
    // max_ps(a, b) is a > b ? a : b, the scalar loop's step (a NaN never replaces the running maximum)
    am = _mm256_max_ps(_mm256_and_ps(mi, abs_mask), am);
    av = _mm256_max_ps(vi, av);
    j = _mm256_add_epi32(j, set1(8));
  }
  alignas(32) float a[8], b[8];
  _mm256_store_ps(a, am);
  _mm256_store_ps(b, av);
  float ma = 0.0f, va = 0.0f;
  for (int l = 0; l < 8; ++l) {
    ma = a[l] > ma ? a[l] : ma;
    va = b[l] > va ? b[l] : va;
  }
  *am_out = ma;
  *av_out = va;
}

// The second pass on elements [0, n32) of the block (n32 a multiple of 32): the scalar
// encode loop's codes of m and v (scaled by im and iv), stored from code index c0 on (as pass1's).
template <class MC, class VC>
inline void pass2(uint8_t* __restrict m, uint8_t* __restrict v, int64_t lo, int64_t c0, int64_t n32, float im_,
                  float iv_, const Keys& k, const float* __restrict mb, const float* __restrict vb) {
  const __m256 im = _mm256_set1_ps(im_), iv = _mm256_set1_ps(iv_);
  const __m256 vmax_m = MC::vmax(), vmax_v = VC::vmax();
  const __m256 abs_mask = as_ps(set1(0x7fffffffu));
  // mix32(j ^ key) == mix32_tail((j ^ (j >> 16)) ^ (key ^ (key >> 16))): the shift distributes over xor
  const __m256i km = set1(k.m ^ (k.m >> 16)), kv = set1(k.v ^ (k.v >> 16));
  __m256i j = _mm256_add_epi32(set1(k.offset + static_cast<uint32_t>(lo)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t i = 0; i < n32; i += 32) {
    __m256i cm[4], cv[4];
    for (int q = 0; q < 4; ++q) {
      const __m256i t = _mm256_xor_si256(j, _mm256_srli_epi32(j, 16));
      const __m256 mi = _mm256_loadu_ps(mb + i + 8 * q);
      // min_ps(a, b) is a < b ? a : b: the scalar clamp, NaN included
      const __m256 ym = _mm256_min_ps(_mm256_mul_ps(_mm256_and_ps(mi, abs_mask), im), vmax_m);
      const __m256i c = MC::code_m(ym, mix32_tail(_mm256_xor_si256(t, km)));
      // the sign bit, kept where the code is not 0
      cm[q] = _mm256_or_si256(c, _mm256_andnot_si256(_mm256_cmpeq_epi32(c, _mm256_setzero_si256()), MC::sign_m(mi)));
      const __m256 yv = _mm256_min_ps(_mm256_mul_ps(_mm256_loadu_ps(vb + i + 8 * q), iv), vmax_v);
      const __m256i c2 = VC::code_v(yv, mix32_tail(_mm256_xor_si256(t, kv)));
      cv[q] = _mm256_max_epu32(c2, _mm256_min_epu32(as_si(yv), set1(1u)));  // a positive v never to code 0
      j = _mm256_add_epi32(j, set1(8));
    }
    MC::store(m, c0 + i, cm[0], cm[1], cm[2], cm[3]);
    VC::store(v, c0 + i, cv[0], cv[1], cv[2], cv[3]);
  }
}

}  // namespace quant_avx2
#endif

#ifdef MEGATRAIN_AVX512
// The quantized kernels' passes with 16 elements a vector: quant_avx2's operations lane for lane (the same float
// operations on the same operands; mask registers where AVX2 blends on a vector's sign bits; the narrowing
// stores truncate where AVX2's saturate, equal for the codes and bfloat16 bits, which are under 2^8 and 2^16).
// The 8-bit pass runs about half the memory rate of the other kernels on a 16-core H200 host (5.2 G params/s at
// 10 B a parameter, against 6.9 at 16 for capacity mode): its hashes and codes are the work, and a vector twice
// as wide does twice as many per instruction.
namespace quant_avx512 {

inline __m512i set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int32_t>(x)); }
inline __m512 as_ps(__m512i x) { return _mm512_castsi512_ps(x); }
inline __m512i as_si(__m512 x) { return _mm512_castps_si512(x); }

inline __m512i mix32_tail(__m512i x) {
  x = _mm512_mullo_epi32(x, set1(0x7feb352du));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, set1(0x846ca68bu));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
inline __m512i mix32(__m512i x) { return mix32_tail(_mm512_xor_si512(x, _mm512_srli_epi32(x, 16))); }

inline __m512 load_f32(const uint16_t* a) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  return as_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load_f32(const float* a) { return _mm512_loadu_ps(a); }

template <int kBias, int kMant = 3>
inline __m512 decode(__m512i c) {
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(c, 23 - kMant), set1((127u - kBias) << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(Q8Grid<kBias, kMant>::kSub));
  return _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(c, set1(1u << kMant)), as_ps(normal), sub);
}

inline __m512i to_bf16_sr(__m512 x, __m512i r) {
  const __m512i u = as_si(x);
  __m512i out = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_and_si512(r, set1(0xffffu))), 16);
  const __mmask16 exp_ones = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, set1(0x7f800000u)), set1(0x7f800000u));
  if (exp_ones) {
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i nan = _mm512_or_si512(set1(0x7fc0u), _mm512_and_si512(hi, set1(0x8000u)));
    const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, set1(0x7fffffffu)), set1(0x7f800000u));
    out = _mm512_mask_blend_epi32(exp_ones, out, _mm512_mask_blend_epi32(is_nan, hi, nan));
  }
  return out;
}

// quant_avx2::encode; its branch test (u >= kMinNormalBits, unsigned) is one unsigned compare here.
template <int kBias, int kMant = 3>
inline __m512i encode(__m512 y, __m512i r) {
  using Grid = Q8Grid<kBias, kMant>;
  const __m512i u = as_si(y);
  const __m512i low = _mm512_slli_epi32(_mm512_and_si512(r, set1(0xfffffu)), 3 - kMant);
  const __m512i normal = _mm512_sub_epi32(u, set1((127u - kBias) << 23));
  const __m512 t = _mm512_min_ps(_mm512_mul_ps(y, _mm512_set1_ps(Grid::kFix)),
                                 _mm512_set1_ps(static_cast<float>(1u << 23)));
  const __m512i fixed = _mm512_cvttps_epi32(t);
  const __mmask16 is_normal = _mm512_cmpge_epu32_mask(u, set1(Grid::kMinNormalBits));
  const __m512i x = _mm512_mask_blend_epi32(is_normal, fixed, normal);
  return _mm512_srli_epi32(_mm512_add_epi32(x, low), Grid::kDrop);
}

// The codes of elements x .. x + 15 as int32 lanes, and back (quant_avx2's Q8Codes, 16 lanes).
struct Q8Codes {
  static inline __m512i load(const uint8_t* a, int64_t x) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + x)));
  }
  static inline __m512 decode_m(__m512i c) {
    const __m512 mag = decode<kBiasM>(_mm512_and_si512(c, set1(0x7fu)));
    return as_ps(_mm512_or_si512(as_si(mag), _mm512_slli_epi32(_mm512_and_si512(c, set1(0x80u)), 24)));
  }
  static inline __m512 decode_v(__m512i c) { return decode<kBiasV>(c); }
  static inline __m512 vmax() { return _mm512_set1_ps(kQ8Max); }
  static inline __m512i code_m(__m512 y, __m512i r) { return encode<kBiasM>(y, r); }
  static inline __m512i sign_m(__m512 mi) { return _mm512_and_si512(_mm512_srli_epi32(as_si(mi), 24), set1(0x80u)); }
  static inline __m512i code_v(__m512 y, __m512i r) { return _mm512_and_si512(encode<kBiasV>(y, r), set1(0xffu)); }
  static inline void store(uint8_t* a, int64_t x, __m512i c) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + x), _mm512_cvtepi32_epi8(c));
  }
};

// quant_avx2::SmallCodes, 16 lanes.
template <int kE, int kM>
struct SmallCodes {
  static constexpr int kBias = (1 << kE) - 1, kSignAt = kE + kM;
  static constexpr uint32_t kMag = (1u << kSignAt) - 1u;
  static inline __m512i load(const uint8_t* a, int64_t x) { return Q8Codes::load(a, x); }
  static inline __m512 decode_m(__m512i c) {
    const __m512 mag = decode<kBias, kM>(_mm512_and_si512(c, set1(kMag)));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, set1(1u << kSignAt)), 31 - kSignAt);
    return as_ps(_mm512_or_si512(as_si(mag), sign));
  }
  static inline __m512 decode_v(__m512i c) { return decode<kBias, kM>(c); }
  static inline __m512 vmax() { return _mm512_set1_ps(Q8Grid<kBias, kM>::kVmax); }
  static inline __m512i code_m(__m512 y, __m512i r) { return encode<kBias, kM>(y, r); }
  static inline __m512i sign_m(__m512 mi) {
    return _mm512_and_si512(_mm512_srli_epi32(as_si(mi), 31 - kSignAt), set1(1u << kSignAt));
  }
  static inline __m512i code_v(__m512 y, __m512i r) { return _mm512_and_si512(encode<kBias, kM>(y, r), set1(kMag)); }
  static inline void store(uint8_t* a, int64_t x, __m512i c) { Q8Codes::store(a, x, c); }
};

#if defined(__BMI2__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// SmallCodes read from and written to their groups in place (kBits bits a code, 8 to a group of kBits bytes, as
// unpack_groups and pack_groups lay them out): elements x .. x + 15 (x a multiple of 16) are the two groups from
// byte x / 8 * kBits, spread to a byte a code with pdep and gathered back with pext, all in registers. Reading
// codes a buffer's 8-byte stores had just written with one 16-byte load stalls where the CPU cannot forward two
// stores to one load (the H200 hosts' Xeons). The masked load and store touch the two groups' bytes only.
template <int kE, int kM, int kBits>
struct PackedSmallCodes : SmallCodes<kE, kM> {
  static constexpr uint64_t kSpread = 0x0101010101010101ull * ((1u << kBits) - 1u);
  static constexpr __mmask16 kBytes = static_cast<__mmask16>((1u << (2 * kBits)) - 1u);
  static inline __m512i load(const uint8_t* a, int64_t x) {
    const __m128i b = _mm_maskz_loadu_epi8(kBytes, a + x / 8 * kBits);
    const uint64_t w0 = _pdep_u64(static_cast<uint64_t>(_mm_cvtsi128_si64(b)), kSpread);
    const uint64_t w1 = _pdep_u64(static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_bsrli_si128(b, kBits))), kSpread);
    return _mm512_cvtepu8_epi32(_mm_set_epi64x(static_cast<int64_t>(w1), static_cast<int64_t>(w0)));
  }
  static inline void store(uint8_t* a, int64_t x, __m512i c) {
    const __m128i b = _mm512_cvtepi32_epi8(c);
    const uint64_t w0 = _pext_u64(static_cast<uint64_t>(_mm_cvtsi128_si64(b)), kSpread);
    const uint64_t w1 = _pext_u64(static_cast<uint64_t>(_mm_extract_epi64(b, 1)), kSpread);
    const __m128i t = _mm_or_si128(_mm_cvtsi64_si128(static_cast<int64_t>(w0)),
                                   _mm_bslli_si128(_mm_cvtsi64_si128(static_cast<int64_t>(w1)), kBits));
    _mm_mask_storeu_epi8(a + x / 8 * kBits, kBytes, t);
  }
};
#define MEGATRAIN_PACKED_CODES 1
#endif

// quant_avx2::pass1, 16 elements a vector, on elements [0, n16) of the block (n16 a multiple of 16).
template <class MC, class VC, bool kP, class G>
inline void pass1(uint16_t* __restrict p, const uint8_t* __restrict m, const uint8_t* __restrict v,
                  const G* __restrict g, int64_t lo, int64_t c0, int64_t n16, float sm_, float sv_, const Hyper& h,
                  const Keys& k, float* __restrict mb, float* __restrict vb, float* am_out, float* av_out) {
  const __m512 sm = _mm512_set1_ps(sm_), sv = _mm512_set1_ps(sv_);
  const __m512 grad_scale = _mm512_set1_ps(h.grad_scale), b1 = _mm512_set1_ps(h.b1), b2 = _mm512_set1_ps(h.b2);
  const __m512 one_b1 = _mm512_set1_ps(h.one_b1), one_b2 = _mm512_set1_ps(h.one_b2);
  const __m512 inv_bc1 = _mm512_set1_ps(h.inv_bc1), inv_bc2 = _mm512_set1_ps(h.inv_bc2);
  const __m512 eps = _mm512_set1_ps(h.eps), wd = _mm512_set1_ps(h.wd), lr = _mm512_set1_ps(h.lr);
  const __m512i abs_mask = set1(0x7fffffffu);
  const __m512i kp = set1(k.p);
  __m512i j = _mm512_add_epi32(set1(k.offset + static_cast<uint32_t>(lo)),
                               _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512 am = _mm512_setzero_ps(), av = _mm512_setzero_ps();
  for (int64_t i = 0; i < n16; i += 16) {
    const int64_t x = lo + i;
    const __m512 gi = _mm512_mul_ps(load_f32(g + x), grad_scale);
    const __m512 m0 = _mm512_mul_ps(MC::decode_m(MC::load(m, c0 + i)), sm);
    const __m512 v0 = _mm512_mul_ps(VC::decode_v(VC::load(v, c0 + i)), sv);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(b1, m0), _mm512_mul_ps(one_b1, gi));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(b2, v0), _mm512_mul_ps(_mm512_mul_ps(one_b2, gi), gi));
    if constexpr (kP) {
      const __m512 p0 = load_f32(p + x);
      const __m512 den = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(vi, inv_bc2)), eps);
      const __m512 u = _mm512_add_ps(_mm512_div_ps(_mm512_mul_ps(mi, inv_bc1), den), _mm512_mul_ps(wd, p0));
      const __m512 pi = _mm512_sub_ps(p0, _mm512_mul_ps(lr, u));
      const __m512i pb = to_bf16_sr(pi, mix32(_mm512_xor_si512(j, kp)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + x), _mm512_cvtepi32_epi16(pb));
    }
    _mm512_storeu_ps(mb + i, mi);
    _mm512_storeu_ps(vb + i, vi);
    am = _mm512_max_ps(as_ps(_mm512_and_si512(as_si(mi), abs_mask)), am);
    av = _mm512_max_ps(vi, av);
    j = _mm512_add_epi32(j, set1(16));
  }
  // The lanes hold no NaN (max_ps keeps its second operand, the running maximum, against a NaN) and no -0, so
  // any order of maxima gives the scalar loop's: a tree of shuffles, not a chain of 16 dependent compares (the
  // chain was a sixth of a 128-element block's time on the H200 hosts).
  *am_out = _mm512_reduce_max_ps(am);
  *av_out = _mm512_reduce_max_ps(av);
}

// quant_avx2::pass2, 16 elements a vector, on elements [0, n16) of the block (n16 a multiple of 16).
template <class MC, class VC>
inline void pass2(uint8_t* __restrict m, uint8_t* __restrict v, int64_t lo, int64_t c0, int64_t n16, float im_,
                  float iv_, const Keys& k, const float* __restrict mb, const float* __restrict vb) {
  const __m512 im = _mm512_set1_ps(im_), iv = _mm512_set1_ps(iv_);
  const __m512 vmax_m = MC::vmax(), vmax_v = VC::vmax();
  const __m512i abs_mask = set1(0x7fffffffu);
  const __m512i km = set1(k.m ^ (k.m >> 16)), kv = set1(k.v ^ (k.v >> 16));
  __m512i j = _mm512_add_epi32(set1(k.offset + static_cast<uint32_t>(lo)),
                               _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int64_t i = 0; i < n16; i += 16) {
    const __m512i t = _mm512_xor_si512(j, _mm512_srli_epi32(j, 16));
    const __m512 mi = _mm512_loadu_ps(mb + i);
    const __m512 ym = _mm512_min_ps(_mm512_mul_ps(as_ps(_mm512_and_si512(as_si(mi), abs_mask)), im), vmax_m);
    const __m512i c = MC::code_m(ym, mix32_tail(_mm512_xor_si512(t, km)));
    // the sign bit, kept where the code is not 0
    const __m512i cm = _mm512_mask_or_epi32(c, _mm512_test_epi32_mask(c, c), c, MC::sign_m(mi));
    const __m512 yv = _mm512_min_ps(_mm512_mul_ps(_mm512_loadu_ps(vb + i), iv), vmax_v);
    const __m512i c2 = VC::code_v(yv, mix32_tail(_mm512_xor_si512(t, kv)));
    const __m512i cv = _mm512_max_epu32(c2, _mm512_min_epu32(as_si(yv), set1(1u)));  // a positive v never code 0
    MC::store(m, c0 + i, cm);
    VC::store(v, c0 + i, cv);
    j = _mm512_add_epi32(j, set1(16));
  }
}

}  // namespace quant_avx512
#endif

// One element of a quantized-moment update from its old moments m0 and v0 (decoded and scaled): p written back
// rounded stochastically, the new moments in *mb and *vb (the quantized kernels' shared math, in the
// order of adamw_sr_block's).
// kP false: the new moments alone, p neither read nor written (a commit pass: the same moments as the stream
// pass that wrote p computed, from the same old codes and gradient).
template <bool kP, class G>
static inline void quantized_element(uint16_t* __restrict p, const G* __restrict g, int64_t x, float m0, float v0,
                                     const Hyper& h, const Keys& k, float* __restrict mb, float* __restrict vb) {
  const float gi = grad_at(g, x) * h.grad_scale;
  const float mi = h.b1 * m0 + h.one_b1 * gi;
  const float vi = h.b2 * v0 + h.one_b2 * gi * gi;
  if constexpr (kP) {
    const float p0 = from_bf16(p[x]);
    const float u = (mi * h.inv_bc1) / (std::sqrt(vi * h.inv_bc2) + h.eps) + h.wd * p0;
    const float pi = p0 - h.lr * u;
    p[x] = to_bf16_sr(pi, mix32((k.offset + static_cast<uint32_t>(x)) ^ k.p));
  }
  *mb = mi;
  *vb = vi;
}

// The scalar pieces of the two moment formats, as the blocks' scalar loops (quantized_update, quantized_encode)
// read them: the scale of a block from its absmax, the value of a code, and a code from a value y in [0, kVmax].
struct Q8Format {
  static constexpr float kVmaxM = kQ8Max, kVmaxV = kQ8Max;  // the largest scaled magnitude of m's and v's codes
  static constexpr uint32_t kMagnitude = 0x7fu, kSign = 0x80u, kV = 0xffu;  // the code's bits
  static float scale(float absmax) { return absmax / kQ8Max; }
  static float inverse_scale(float absmax) { return q8_inverse_scale(absmax); }
  static float value_m(uint32_t c) { return decode_m(static_cast<uint8_t>(c)); }
  static float value_v(uint32_t c) { return GridV::decode(c); }
  static uint32_t code_m(float y, uint32_t r) { return GridM::encode(y, r); }
  static uint32_t code_v(float y, uint32_t r) { return GridV::encode(y, r); }
};

// Small floats for both moments (kEM, kMM: m's exponent and mantissa bits, with a sign above them; kEV, kMV:
// v's), each scaled so that the block's largest magnitude is its format's largest value, each code kBits bits,
// 8 to a group of kBits bytes (adamw_small_block). m7v5: m e3m3 with a sign (7 bits), v e4m1 (5 bits).
template <int kEM, int kMM, int kEV, int kMV>
struct SmallFormat {
  using GridSM = Q8Grid<(1 << kEM) - 1, kMM>;
  using GridSV = Q8Grid<(1 << kEV) - 1, kMV>;
  static constexpr int kBitsM = 1 + kEM + kMM, kBitsV = kEV + kMV;
  static_assert(kBitsM <= 8 && kBitsV <= 8, "a code is at most a byte");
  static constexpr float kVmaxM = GridSM::kVmax, kVmaxV = GridSV::kVmax;
  static constexpr uint32_t kMagnitude = (1u << (kEM + kMM)) - 1u, kSign = 1u << (kEM + kMM);
  static constexpr uint32_t kV = (1u << kBitsV) - 1u;
  static float scale_m(float absmax) { return absmax / kVmaxM; }
  static float scale_v(float absmax) { return absmax / kVmaxV; }
  // kVmax / absmax, capped at FLT_MAX (a block of zeros maps 0 to 0), as q8_inverse_scale
  static float inverse_scale(float vmax, float absmax) {
    const float q = vmax / absmax;
    constexpr float kBig = std::numeric_limits<float>::max();
    return q < kBig ? q : kBig;
  }
  static float value_m(uint32_t c) {
    const float mag = GridSM::decode(c & kMagnitude);
    uint32_t bits;
    std::memcpy(&bits, &mag, 4);
    bits |= (c & kSign) << (31 - kEM - kMM);
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  }
  static float value_v(uint32_t c) { return GridSV::decode(c); }
  static uint32_t code_m(float y, uint32_t r) { return GridSM::encode(y, r); }
  static uint32_t code_v(float y, uint32_t r) { return GridSV::encode(y, r); }
};

// Codes of kBits bits, 8 to a group of kBits bytes: element 8j + i of a group sits at bits kBits * i of the
// group's little-endian word. n (a multiple of 8) codes from a, one a byte to out, and back.
// With BMI2 one pdep spreads a group's word over 8 bytes (a byte per code) and one pext gathers them back. A
// group's word is read and written as 8 bytes but the block's last group's (whose eighth byte may be the next
// block's, another thread's, or past the array's end).
template <int kBits>
inline void unpack_groups(const uint8_t* __restrict a, int64_t n, uint8_t* __restrict out) {
  for (int64_t j = 0; j < n / 8; ++j) {
    uint64_t w = 0;
    if (j + 1 < n / 8) {
      std::memcpy(&w, a + j * kBits, 8);
      w &= (uint64_t{1} << (8 * kBits)) - 1u;
    } else {
      std::memcpy(&w, a + j * kBits, kBits);
    }
#if defined(__BMI2__) && !defined(MEGATRAIN_NO_INTRINSICS)
    const uint64_t bytes = _pdep_u64(w, 0x0101010101010101ull * ((1u << kBits) - 1u));
    std::memcpy(out + 8 * j, &bytes, 8);
#else
    for (int i = 0; i < 8; ++i) out[8 * j + i] = static_cast<uint8_t>((w >> (kBits * i)) & ((1u << kBits) - 1u));
#endif
  }
}

template <int kBits>
inline void pack_groups(const uint8_t* __restrict in, int64_t n, uint8_t* __restrict a) {
  for (int64_t j = 0; j < n / 8; ++j) {
#if defined(__BMI2__) && !defined(MEGATRAIN_NO_INTRINSICS)
    uint64_t bytes;
    std::memcpy(&bytes, in + 8 * j, 8);
    const uint64_t w = _pext_u64(bytes, 0x0101010101010101ull * ((1u << kBits) - 1u));
#else
    uint64_t w = 0;
    for (int i = 0; i < 8; ++i) w |= static_cast<uint64_t>(in[8 * j + i] & ((1u << kBits) - 1u)) << (kBits * i);
#endif
    if (j + 1 < n / 8) {  // the eighth byte is the next group's, written next
      std::memcpy(a + j * kBits, &w, 8);
    } else {
      std::memcpy(a + j * kBits, &w, kBits);
    }
  }
}

// Elements [i0, n) of a block from flat index lo: dequantize the codes mc[i] and vc[i] (one a byte), update
// (p written, the new m and v to mb and vb) and fold their maxima into *am and *av.
template <class Fmt, bool kP, class G>
inline void quantized_update(uint16_t* __restrict p, const G* __restrict g, const uint8_t* __restrict mc,
                             const uint8_t* __restrict vc, int64_t lo, int64_t i0, int64_t n, float sm, float sv,
                             const Hyper& h, const Keys& k, float* __restrict mb, float* __restrict vb,
                             float* am_io, float* av_io) {
  float am = *am_io, av = *av_io;
#pragma omp simd reduction(max : am, av)
  for (int64_t i = i0; i < n; ++i) {
    quantized_element<kP>(p, g, lo + i, Fmt::value_m(mc[i]) * sm, Fmt::value_v(vc[i]) * sv, h, k, mb + i, vb + i);
    const float mi = mb[i], vi = vb[i];
    const float a = std::fabs(mi);
    am = a > am ? a : am;
    av = vi > av ? vi : av;
  }
  *am_io = am;
  *av_io = av;
}

// Elements [i0, n) of a block from flat index lo: the codes of mb[i] and vb[i] under the new inverse scales im
// and iv, one a byte, into mc[i] and vc[i].
template <class Fmt>
inline void quantized_encode(uint8_t* __restrict mc, uint8_t* __restrict vc, int64_t lo, int64_t i0, int64_t n,
                             float im, float iv, const Keys& k, const float* __restrict mb,
                             const float* __restrict vb) {
#pragma omp simd
  for (int64_t i = i0; i < n; ++i) {
    const uint32_t j = k.offset + static_cast<uint32_t>(lo + i);
    const float mi = mb[i];
    const float ym = std::fabs(mi) * im, yv = vb[i] * iv;
    const uint32_t mag = Fmt::code_m(ym < Fmt::kVmaxM ? ym : Fmt::kVmaxM, mix32(j ^ k.m)) & Fmt::kMagnitude;
    const uint32_t sign = std::signbit(mi) ? Fmt::kSign : 0u;
    mc[i] = static_cast<uint8_t>(mag | (mag != 0 ? sign : 0u));  // zero is always code 0, never -0
    const float yvc = yv < Fmt::kVmaxV ? yv : Fmt::kVmaxV;
    const uint32_t cv = Fmt::code_v(yvc, mix32(j ^ k.v)) & Fmt::kV;
    // A positive v never becomes code 0: y >= 0, so min(bits of y, 1) is 1 exactly when y > 0 (integer min and
    // max, as a select of two conditions keeps GCC from vectorizing the loop).
    uint32_t yv_bits;
    std::memcpy(&yv_bits, &yvc, 4);
    vc[i] = static_cast<uint8_t>(std::max(cv, std::min(yv_bits, 1u)));
  }
}

// One quantization block of n elements from flat index lo, in two passes over the buffers mb and vb (n
// floats each): the first dequantizes, updates, writes p and keeps the new m and v and their maxima; the
// second encodes them with the new scales. *m_amax and *v_amax hold the block's old scale on entry and its
// new one on return. With AVX2 the vector passes take the first n / 8 * 8 elements (the update) and n / 32 * 32
// (the codes), the scalar loops the rest.
// The passes a quantized-moment update may run as (kPass): kWhole, the update; kStream, p alone (the moments'
// codes and scales untouched); kCommit, the codes and scales alone (p untouched), from the same old codes and
// gradient as the stream pass: kStream then kCommit leave exactly what kWhole does.
constexpr int kWhole = 0, kStream = 1, kCommit = 2;

template <int kPass, class G>
inline void adamw_q8_block(uint16_t* __restrict p, uint8_t* __restrict m, uint8_t* __restrict v,
                           float* __restrict m_amax, float* __restrict v_amax, const G* __restrict g, int64_t lo,
                           int64_t n, const Hyper& h, const Keys& k, float* __restrict mb,
                           float* __restrict vb) {
  const float sm = Q8Format::scale(*m_amax), sv = Q8Format::scale(*v_amax);
  float am = 0.0f, av = 0.0f;
  int64_t i0 = 0;
  constexpr bool kP = kPass != kCommit;
#if defined(MEGATRAIN_AVX512)
  i0 = n / 16 * 16;
  using MC512 = quant_avx512::Q8Codes;
  quant_avx512::pass1<MC512, MC512, kP>(p, m, v, g, lo, lo, i0, sm, sv, h, k, mb, vb, &am, &av);
#elif defined(MEGATRAIN_AVX2)
  i0 = n / 8 * 8;
  using MC256 = quant_avx2::Q8Codes;
  quant_avx2::pass1<MC256, MC256, kP>(p, m, v, g, lo, lo, i0, sm, sv, h, k, mb, vb, &am, &av);
#endif
  quantized_update<Q8Format, kP>(p, g, m + lo, v + lo, lo, i0, n, sm, sv, h, k, mb, vb, &am, &av);
  if constexpr (kPass == kStream) return;
  const float im = Q8Format::inverse_scale(am), iv = Q8Format::inverse_scale(av);
  i0 = 0;
#if defined(MEGATRAIN_AVX512)
  i0 = n / 16 * 16;
  quant_avx512::pass2<quant_avx512::Q8Codes, quant_avx512::Q8Codes>(m, v, lo, lo, i0, im, iv, k, mb, vb);
#elif defined(MEGATRAIN_AVX2)
  i0 = n / 32 * 32;
  quant_avx2::pass2<quant_avx2::Q8Codes, quant_avx2::Q8Codes>(m, v, lo, lo, i0, im, iv, k, mb, vb);
#endif
  quantized_encode<Q8Format>(m + lo, v + lo, lo, i0, n, im, iv, k, mb, vb);
  *m_amax = am;
  *v_amax = av;
}

// One block of n elements (a multiple of 8) from flat index lo (a multiple of 8) of the small-float formats
// (SmallFormat<kEM, kMM, kEV, kMV>), updated as adamw_q8_block updates bytes. With AVX-512 (and BW, VL, BMI2) the
// vector passes read and write the codes' groups in place (PackedSmallCodes) and only the scalar loops' last 8
// elements go through the buffers mc and vc; otherwise the block's codes are unpacked to a byte each into the
// buffers, updated there (the vector passes with c0 = 0, the scalar loops on the rest) and packed back.
template <int kPass, int kEM, int kMM, int kEV, int kMV, class G>
inline void adamw_small_block(uint16_t* __restrict p, uint8_t* __restrict m, uint8_t* __restrict v,
                              float* __restrict m_amax, float* __restrict v_amax, const G* __restrict g,
                              int64_t lo, int64_t n, const Hyper& h, const Keys& k, float* __restrict mb,
                              float* __restrict vb, uint8_t* __restrict mc, uint8_t* __restrict vc) {
  using Fmt = SmallFormat<kEM, kMM, kEV, kMV>;
  uint8_t* mg = m + lo / 8 * Fmt::kBitsM;
  uint8_t* vg = v + lo / 8 * Fmt::kBitsV;
  const float sm = Fmt::scale_m(*m_amax), sv = Fmt::scale_v(*v_amax);
  float am = 0.0f, av = 0.0f;
  constexpr bool kP = kPass != kCommit;
#if defined(MEGATRAIN_AVX512) && defined(MEGATRAIN_PACKED_CODES)
  // The vector passes read and write the groups in place; the scalar loops take the last 8 elements where n is
  // not a multiple of 16, from their group unpacked to the buffers (at the same index).
  using MC = quant_avx512::PackedSmallCodes<kEM, kMM, Fmt::kBitsM>;
  using VC = quant_avx512::PackedSmallCodes<kEV, kMV, Fmt::kBitsV>;
  const int64_t i0 = n / 16 * 16;
  unpack_groups<Fmt::kBitsM>(mg + i0 / 8 * Fmt::kBitsM, n - i0, mc + i0);
  unpack_groups<Fmt::kBitsV>(vg + i0 / 8 * Fmt::kBitsV, n - i0, vc + i0);
  quant_avx512::pass1<MC, VC, kP>(p, mg, vg, g, lo, 0, i0, sm, sv, h, k, mb, vb, &am, &av);
  quantized_update<Fmt, kP>(p, g, mc, vc, lo, i0, n, sm, sv, h, k, mb, vb, &am, &av);
  if constexpr (kPass == kStream) return;
  const float im = Fmt::inverse_scale(Fmt::kVmaxM, am), iv = Fmt::inverse_scale(Fmt::kVmaxV, av);
  quant_avx512::pass2<MC, VC>(mg, vg, lo, 0, i0, im, iv, k, mb, vb);
  quantized_encode<Fmt>(mc, vc, lo, i0, n, im, iv, k, mb, vb);
  pack_groups<Fmt::kBitsM>(mc + i0, n - i0, mg + i0 / 8 * Fmt::kBitsM);
  pack_groups<Fmt::kBitsV>(vc + i0, n - i0, vg + i0 / 8 * Fmt::kBitsV);
#else
  unpack_groups<Fmt::kBitsM>(mg, n, mc);
  unpack_groups<Fmt::kBitsV>(vg, n, vc);
  int64_t i0 = 0;
#if defined(MEGATRAIN_AVX512)
  using MC = quant_avx512::SmallCodes<kEM, kMM>;
  using VC = quant_avx512::SmallCodes<kEV, kMV>;
  i0 = n / 16 * 16;
  quant_avx512::pass1<MC, VC, kP>(p, mc, vc, g, lo, 0, i0, sm, sv, h, k, mb, vb, &am, &av);
#elif defined(MEGATRAIN_AVX2)
  using MC = quant_avx2::SmallCodes<kEM, kMM>;
  using VC = quant_avx2::SmallCodes<kEV, kMV>;
  i0 = n / 8 * 8;
  quant_avx2::pass1<MC, VC, kP>(p, mc, vc, g, lo, 0, i0, sm, sv, h, k, mb, vb, &am, &av);
#endif
  quantized_update<Fmt, kP>(p, g, mc, vc, lo, i0, n, sm, sv, h, k, mb, vb, &am, &av);
  if constexpr (kPass == kStream) return;
  const float im = Fmt::inverse_scale(Fmt::kVmaxM, am), iv = Fmt::inverse_scale(Fmt::kVmaxV, av);
  i0 = 0;
#if defined(MEGATRAIN_AVX512)
  i0 = n / 16 * 16;
  quant_avx512::pass2<MC, VC>(mc, vc, lo, 0, i0, im, iv, k, mb, vb);
#elif defined(MEGATRAIN_AVX2)
  i0 = n / 32 * 32;
  quant_avx2::pass2<MC, VC>(mc, vc, lo, 0, i0, im, iv, k, mb, vb);
#endif
  quantized_encode<Fmt>(mc, vc, lo, i0, n, im, iv, k, mb, vb);
  pack_groups<Fmt::kBitsM>(mc, n, mg);
  pack_groups<Fmt::kBitsV>(vc, n, vg);
#endif
  *m_amax = am;
  *v_amax = av;
}

// The blocks of a rows x cols array, in groups of consecutive blocks (about kChunk elements, fewer where that
// would leave a thread without work) that threads take first come, first served; each thread has its own
// buffers for a block's new moments (floats) and codes (one a byte, unpacked from m7v5's groups where a pass
// does not read them in place).
struct BlockBuffers {
  alignas(64) float mb[kQ8MaxBlock];
  alignas(64) float vb[kQ8MaxBlock];
  alignas(64) uint8_t mc[kQ8MaxBlock];
  alignas(64) uint8_t vc[kQ8MaxBlock];
};

template <class BlockFn>
void quantized_parallel(int64_t rows, int64_t cols, int64_t block, BlockFn block_fn) {
  const int64_t nb = (cols + block - 1) / block, blocks = rows * nb;
  const int threads = team_size();
  const int64_t per = std::max<int64_t>(1, std::min(kChunk / block, (blocks + threads - 1) / threads));
  (void)per;  // unused without OpenMP
#pragma omp parallel num_threads(threads)
  {
    BlockBuffers buf;
#pragma omp for schedule(dynamic, per) nowait
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r = b / nb, c = (b % nb) * block;
      block_fn(b, r * cols + c, std::min(block, cols - c), buf);
    }
  }
}

template <int kPass, class G>
void adamw_q8_parallel(uint16_t* p, uint8_t* m, uint8_t* v, float* m_amax, float* v_amax, const G* g,
                       int64_t rows, int64_t cols, int64_t block, const Hyper h, const Keys k) {
  quantized_parallel(rows, cols, block, [&](int64_t b, int64_t lo, int64_t n, BlockBuffers& buf) {
    adamw_q8_block<kPass>(p, m, v, m_amax + b, v_amax + b, g, lo, n, h, k, buf.mb, buf.vb);
  });
}

template <int kPass, int kEM, int kMM, int kEV, int kMV, class G>
void adamw_small_parallel(uint16_t* p, uint8_t* m, uint8_t* v, float* m_amax, float* v_amax, const G* g,
                          int64_t rows, int64_t cols, int64_t block, const Hyper h, const Keys k) {
  quantized_parallel(rows, cols, block, [&](int64_t b, int64_t lo, int64_t n, BlockBuffers& buf) {
    adamw_small_block<kPass, kEM, kMM, kEV, kMV>(p, m, v, m_amax + b, v_amax + b, g, lo, n, h, k, buf.mb, buf.vb,
                                                 buf.mc, buf.vc);
  });
}

// Runs fn with the pass as a compile-time constant (kWhole, kStream, kCommit; anything else: kWhole).
template <class Fn>
inline void with_pass(int pass, Fn fn) {
  if (pass == kStream) {
    fn(std::integral_constant<int, kStream>{});
  } else if (pass == kCommit) {
    fn(std::integral_constant<int, kCommit>{});
  } else {
    fn(std::integral_constant<int, kWhole>{});
  }
}

// Calls fn with the gradient as what it is: bfloat16 bits (g_bf16) or float32.
template <class Fn>
void with_gradient(const void* g, int g_bf16, Fn fn) {
  if (g_bf16)
    fn(static_cast<const uint16_t*>(g));
  else
    fn(static_cast<const float*>(g));
}

}  // namespace

// Full precision: float32 p, m, v updated in place; the bfloat16 copy written where p_bf16 is given. The gradient
// is float32, or bfloat16 bits where g_bf16 (a bfloat16 gradient, widened, gives the float32 one's results).
extern "C" void megatrain_adamw(float* p, float* m, float* v, const void* g, uint16_t* p_bf16, int64_t n,
                                float lr, float b1, float b2, float eps, float wd, float grad_scale,
                                float bc1, float bc2, int g_bf16) {
  const Hyper h = make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2);
  with_gradient(g, g_bf16, [&](auto gg) {
    if (p_bf16)
      adamw_parallel<true, true>(p, m, v, gg, p_bf16, n, h);
    else
      adamw_parallel<true, false>(p, m, v, gg, nullptr, n, h);
  });
}

// The split update's first pass: only the bfloat16 copy; p, m and v are read, not written.
extern "C" void megatrain_adamw_stream(float* p, float* m, float* v, const void* g, uint16_t* p_bf16,
                                       int64_t n, float lr, float b1, float b2, float eps, float wd,
                                       float grad_scale, float bc1, float bc2, int g_bf16) {
  const Hyper h = make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2);
  with_gradient(g, g_bf16, [&](auto gg) { adamw_parallel<false, true>(p, m, v, gg, p_bf16, n, h); });
}

// Capacity mode (see the header): p, m, v bfloat16 bits, g float32, all three written back with stochastic
// rounding. Stream k (0: p, 1: m, 2: v) uses key mix32(seed ^ 0x9E3779B9 * (k + 1)); element i uses random
// bits mix32((uint32)(offset + i) ^ key). Counters wrap past 2^32: callers keep offset + n <= 2^32.
extern "C" void megatrain_adamw_bf16_sr(uint16_t* p, uint16_t* m, uint16_t* v, const float* g, int64_t n,
                                        float lr, float b1, float b2, float eps, float wd, float grad_scale,
                                        float bc1, float bc2, uint32_t seed, int64_t offset) {
  adamw_sr_parallel(p, m, v, g, n, make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2), make_keys(seed, offset));
}

// Capacity mode with a bfloat16 gradient (uint16 bits); otherwise megatrain_adamw_bf16_sr.
extern "C" void megatrain_adamw_bf16_sr_g16(uint16_t* p, uint16_t* m, uint16_t* v, const uint16_t* g, int64_t n,
                                            float lr, float b1, float b2, float eps, float wd, float grad_scale,
                                            float bc1, float bc2, uint32_t seed, int64_t offset) {
  adamw_sr_parallel(p, m, v, g, n, make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2), make_keys(seed, offset));
}

// 8-bit moments (see the header): p bfloat16 bits, rows * cols of them; m and v one code byte each; m_amax and
// v_amax one float32 per block, row-major (rows x ceil(cols / block)); g float32 (g_bf16 == 0) or bfloat16
// bits (g_bf16 == 1). Element i of the call uses counter offset + i, as megatrain_adamw_bf16_sr does.
// Preconditions, checked by the Python wrapper: 0 < block <= 4096 (kQ8MaxBlock), rows, cols >= 0,
// offset + rows * cols <= 2^32.
// pass: 0 the whole update, 1 p alone (the stream pass), 2 the moments' codes and scales alone (the commit
// pass, with the same old codes, scales and gradient as the stream pass): 1 then 2 leave what 0 does.
extern "C" void megatrain_adamw_q8(uint16_t* p, uint8_t* m, uint8_t* v, float* m_amax, float* v_amax,
                                   const void* g, int g_bf16, int64_t rows, int64_t cols, int64_t block,
                                   float lr, float b1, float b2, float eps, float wd, float grad_scale,
                                   float bc1, float bc2, uint32_t seed, int64_t offset, int pass) {
  with_gradient(g, g_bf16, [&](auto gt) {
    with_pass(pass, [&](auto kp) {
      adamw_q8_parallel<decltype(kp)::value>(p, m, v, m_amax, v_amax, gt, rows, cols, block,
                                             make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2),
                                             make_keys(seed, offset));
    });
  });
}

// A sixth entry point: 7-bit m (a sign and e3m3) and 5-bit v (e4m1), m7v5; the arguments as megatrain_adamw_q8's,
// with m's codes 7 bits an element and v's 5, each 8 to a group of 7 and 5 bytes (rows x cols * 7 / 8 and
// rows x cols * 5 / 8 bytes), one block size for both scales. Preconditions, checked by the Python wrapper: cols
// and block multiples of 8 (no group is shared by two rows or blocks), 0 < block <= 4096, offset + rows * cols
// <= 2^32.
extern "C" void megatrain_adamw_m7v5(uint16_t* p, uint8_t* m, uint8_t* v, float* m_amax, float* v_amax,
                                     const void* g, int g_bf16, int64_t rows, int64_t cols, int64_t block,
                                     float lr, float b1, float b2, float eps, float wd, float grad_scale,
                                     float bc1, float bc2, uint32_t seed, int64_t offset, int pass) {
  with_gradient(g, g_bf16, [&](auto gt) {
    with_pass(pass, [&](auto kp) {
      adamw_small_parallel<decltype(kp)::value, 3, 3, 4, 1>(p, m, v, m_amax, v_amax, gt, rows, cols, block,
                                                            make_hyper(lr, b1, b2, eps, wd, grad_scale, bc1, bc2),
                                                            make_keys(seed, offset));
    });
  });
}

// The quantized-moment kernels' vector width in elements: 16 (AVX-512), 8 (AVX2) or 1 (the portable loops).
extern "C" int megatrain_q8_vector_width() {
#if defined(MEGATRAIN_AVX512)
  return 16;
#elif defined(MEGATRAIN_AVX2)
  return 8;
#else
  return 1;
#endif
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
