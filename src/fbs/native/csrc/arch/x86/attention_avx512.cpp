// One query head's attention with AVX-512: 16 floats of the head dimension per register.
#include "../../attention.h"

#ifdef FBS_X86
#include <immintrin.h>

namespace fbs_attn {
__attribute__((target("avx512f,fma"))) void head_avx512(const float* q, const float* K, const float* V, int64_t n,
                                                        int64_t hd, float scale, float* p, float* o) {
  const int64_t nc = hd / 16;
  __m512 qv[kMaxHd / 16], acc[kMaxHd / 16];
  for (int64_t c = 0; c < nc; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), _mm512_set1_ps(scale));
  for (int64_t j = 0; j < n; ++j) {
    const float* k = K + j * hd;
    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    for (int64_t c = 1; c < nc; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);
    p[j] = _mm512_reduce_add_ps(a);
  }
  float z;
  softmax_(p, n, &z);
  for (int64_t c = 0; c < nc; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 w = _mm512_set1_ps(p[j]);
    const float* v = V + j * hd;
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), acc[c]);
  }
  const __m512 iz = _mm512_set1_ps(1.0f / z);
  for (int64_t c = 0; c < nc; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], iz));
}
}  // namespace fbs_attn
#endif
