// Fused AdamW for host (CPU) memory: one pass over p, m, v, g updates all three in place and, optionally,
// writes a bfloat16 copy of the new parameters. Multi-threaded with OpenMP, vectorizable inner loop.
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
#define MEGATRAIN_PREFETCH 0  // elements ahead to prefetch in software (0: leave it to the hardware)
#endif
#ifndef MEGATRAIN_EXPLICIT_SIMD
#define MEGATRAIN_EXPLICIT_SIMD 0  // 1: intrinsics (AVX-512 or AVX2) instead of the compiler's vectorizer;
#endif                             // 2: the same with non-temporal stores
#if MEGATRAIN_EXPLICIT_SIMD
#include <immintrin.h>
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
inline void adamw_scalar(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                         uint16_t* __restrict p_bf16, int64_t i, const Hyper& h) {
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

#if MEGATRAIN_EXPLICIT_SIMD && (defined(__AVX512F__) || defined(__AVX2__))
// Hand-vectorized loop: the same operations in the same order as adamw_scalar (no contraction), so every
// lane rounds exactly as the scalar code; MEGATRAIN_EXPLICIT_SIMD=2 writes with non-temporal stores when
// every array is vector-aligned (the lines were just read, so this saves the later dirty evictions).
#if defined(__AVX512F__)
using VF = __m512;
using VI = __m512i;
constexpr int64_t kW = 16;
static inline VF vset(float x) { return _mm512_set1_ps(x); }
static inline VF vload(const float* a) { return _mm512_loadu_ps(a); }
static inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF vdiv(VF a, VF b) { return _mm512_div_ps(a, b); }
static inline VF vsqrt(VF a) { return _mm512_sqrt_ps(a); }
template <bool kNT> static inline void vstore(float* a, VF x) {
  if (kNT) _mm512_stream_ps(a, x); else _mm512_storeu_ps(a, x);
}
template <bool kNT> static inline void vstore_bf16(uint16_t* a, VF x) {
  const VI u = _mm512_castps_si512(x);
  const VI lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  VI r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  const __m256i out = _mm512_cvtepi32_epi16(r);
  if (kNT) _mm256_stream_si256(reinterpret_cast<__m256i*>(a), out);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), out);
}
#else
using VF = __m256;
using VI = __m256i;
constexpr int64_t kW = 8;
static inline VF vset(float x) { return _mm256_set1_ps(x); }
static inline VF vload(const float* a) { return _mm256_loadu_ps(a); }
static inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF vdiv(VF a, VF b) { return _mm256_div_ps(a, b); }
static inline VF vsqrt(VF a) { return _mm256_sqrt_ps(a); }
template <bool kNT> static inline void vstore(float* a, VF x) {
  if (kNT) _mm256_stream_ps(a, x); else _mm256_storeu_ps(a, x);
}
template <bool kNT> static inline void vstore_bf16(uint16_t* a, VF x) {
  const VI u = _mm256_castps_si256(x);
  const VI lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  VI r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const VI nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                    _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i out = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  if (kNT) _mm_stream_si128(reinterpret_cast<__m128i*>(a), out);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(a), out);
}
#endif

template <bool kState, bool kBf16, bool kNT>
void adamw_simd(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                uint16_t* __restrict p_bf16, int64_t lo, int64_t hi, const Hyper& h) {
  const VF b1 = vset(h.b1), b2 = vset(h.b2), one_b1 = vset(h.one_b1), one_b2 = vset(h.one_b2);
  const VF scale = vset(h.grad_scale), inv_bc1 = vset(h.inv_bc1), inv_bc2 = vset(h.inv_bc2);
  const VF eps = vset(h.eps), wd = vset(h.wd), lr = vset(h.lr);
  int64_t i = lo;
  for (; i + kW <= hi; i += kW) {
    const VF gi = vmul(vload(g + i), scale);
    const VF mi = vadd(vmul(b1, vload(m + i)), vmul(one_b1, gi));
    const VF vi = vadd(vmul(b2, vload(v + i)), vmul(vmul(one_b2, gi), gi));
    const VF pv = vload(p + i);
    const VF u = vadd(vdiv(vmul(mi, inv_bc1), vadd(vsqrt(vmul(vi, inv_bc2)), eps)), vmul(wd, pv));
    const VF pi = vsub(pv, vmul(lr, u));
    if (kState) {
      vstore<kNT>(m + i, mi);
      vstore<kNT>(v + i, vi);
      vstore<kNT>(p + i, pi);
    }
    if (kBf16) vstore_bf16<kNT>(p_bf16 + i, pi);
  }
  for (; i < hi; ++i) adamw_scalar<kState, kBf16>(p, m, v, g, p_bf16, i, h);
  if (kNT) _mm_sfence();
}

template <bool kState, bool kBf16>
void adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                 uint16_t* __restrict p_bf16, int64_t lo, int64_t hi, const Hyper h) {
#if MEGATRAIN_EXPLICIT_SIMD == 2
  const auto aligned = [](const void* a) { return reinterpret_cast<uintptr_t>(a) % (kW * 4) == 0; };
  if (aligned(p + lo) && aligned(m + lo) && aligned(v + lo) && aligned(g + lo) &&
      (!kBf16 || reinterpret_cast<uintptr_t>(p_bf16 + lo) % (kW * 2) == 0)) {
    adamw_simd<kState, kBf16, true>(p, m, v, g, p_bf16, lo, hi, h);
    return;
  }
#endif
  adamw_simd<kState, kBf16, false>(p, m, v, g, p_bf16, lo, hi, h);
}

#else
template <bool kState, bool kBf16>
void adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                 uint16_t* __restrict p_bf16, int64_t lo, int64_t hi, const Hyper h) {
#if MEGATRAIN_PREFETCH > 0
  // One cache line of each stream per 16 elements, prefetched (into L2) MEGATRAIN_PREFETCH elements ahead.
  constexpr int64_t kStep = 16;
#else
  constexpr int64_t kStep = 2048;
#endif
  for (int64_t b = lo; b < hi; b += kStep) {
    const int64_t e = std::min(b + kStep, hi);
#if MEGATRAIN_PREFETCH > 0
    if (b + MEGATRAIN_PREFETCH < hi) {
      __builtin_prefetch(p + b + MEGATRAIN_PREFETCH, 1, 2);
      __builtin_prefetch(m + b + MEGATRAIN_PREFETCH, 1, 2);
      __builtin_prefetch(v + b + MEGATRAIN_PREFETCH, 1, 2);
      __builtin_prefetch(g + b + MEGATRAIN_PREFETCH, 0, 2);
    }
#endif
#pragma omp simd
    for (int64_t i = b; i < e; ++i) adamw_scalar<kState, kBf16>(p, m, v, g, p_bf16, i, h);
  }
}
#endif

template <bool kState, bool kBf16>
void adamw_parallel(float* p, float* m, float* v, const float* g, uint16_t* p_bf16, int64_t n, const Hyper h) {
#pragma omp parallel
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    // Contiguous, 64-byte aligned slices: each thread streams its own range.
    const int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;
    const int64_t lo = std::min(n, t * per), hi = std::min(n, lo + per);
    if (lo < hi) adamw_range<kState, kBf16>(p, m, v, g, p_bf16, lo, hi, h);
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
