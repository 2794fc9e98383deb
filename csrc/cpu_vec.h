// AVX2 helpers shared by the CPU ops: 8-lane loads that widen fp32 / bf16 / fp16 to fp32, and a
// horizontal sum. Functions that use them carry EAGLE_AVX2 (GCC only inlines across equal targets) and
// are picked at run time with has_avx2(); every op keeps a scalar path for other CPUs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define EAGLE_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512 foundation on top of EAGLE_AVX2; picked at run time with use_avx512().
#define EAGLE_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#endif

namespace eagle::cpu {

inline bool has_avx2() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

inline bool has_avx512() {
#if defined(__x86_64__)
  static const bool ok = has_avx2() && __builtin_cpu_supports("avx512f");
  return ok;
#else
  return false;
#endif
}

// AVX-512 kernels, unless EAGLE_CPU_AVX512=0 asks for the AVX2 ones (same results; for tests and timings).
inline bool use_avx512() {
  static const bool ok = [] {
    const char* env = std::getenv("EAGLE_CPU_AVX512");
    return has_avx512() && !(env && env[0] == '0' && env[1] == 0);
  }();
  return ok;
}

// The int8 kernels' AVX-512 VNNI paths (use_avx512() and the BW, VL and VNNI extensions).
inline bool use_avx512_vnni() {
#if defined(__x86_64__)
  static const bool ok = use_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

#if defined(__x86_64__)
EAGLE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bf16 is the top half of an fp32: widening is a 16-bit shift.
EAGLE_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

EAGLE_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// exp(x) to ~1 ulp (Cephes' expf: 2^n times a degree-7 polynomial on [-ln2/2, ln2/2]); x is clamped to
// [-88.38, 88.38], so it saturates instead of returning inf / 0 at the extremes.
EAGLE_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// The value each lane takes when stored as T and read back (round to nearest even; fp32 unchanged).
EAGLE_AVX2 inline __m256 round_trip8(__m256 v, const float*) { return v; }
// NaN stays NaN: adding at most 0x8000 to a quiet NaN's payload cannot carry into the exponent.
EAGLE_AVX2 inline __m256 round_trip8(__m256 v, const c10::BFloat16*) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
EAGLE_AVX2 inline __m256 round_trip8(__m256 v, const c10::Half*) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// Store 8 lanes as T, rounding to nearest even.
EAGLE_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
EAGLE_AVX2 inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(round_trip8(v, p)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
EAGLE_AVX2 inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// 256-bit halves of a zmm with AVX512F alone (the f32x8 forms need AVX512DQ).
EAGLE_AVX512 inline __m512 join8(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
EAGLE_AVX512 inline __m256 high8(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
EAGLE_AVX512 inline __m512 dup8(const float* p) {  // p[0..7] into both halves
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

EAGLE_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace eagle::cpu
