// AVX-512 helpers shared by the AVX-512 kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

namespace fbs_x86 {
// exp(x) of 16 lanes as 2^n p(r), x = n ln2 + r (Cephes' expf polynomial, the one fbs_act uses), x clamped to the
// float range; within a few ulp of expf.
__attribute__((target("avx512f,fma"))) inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), _mm512_max_ps(_mm512_set1_ps(-87.3365478515625f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  const __m512 rr = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, rr), rr, rr), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// 16 consecutive values as fp32: fp32 as they are, fp16 by the one conversion instruction (F16C's, in AVX-512F),
// bf16 by widening to 32 bits and shifting into the upper half (exact), int8 codes sign-extended and converted
// (exact; the caller applies the entry's scale)
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
__attribute__((target("avx512f"))) inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
}  // namespace fbs_x86
