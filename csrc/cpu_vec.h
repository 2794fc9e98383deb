// AVX2 helpers shared by the CPU ops: 8-lane loads that widen fp32 / bf16 / fp16 to fp32, and a
// horizontal sum. Functions that use them carry EAGLE_AVX2 (GCC only inlines across equal targets) and
// are picked at run time with has_avx2(); every op keeps a scalar path for other CPUs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define EAGLE_AVX2 __attribute__((target("avx2,fma,f16c")))
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

EAGLE_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace eagle::cpu
