// One query head's attention with AVX2: 8 floats of the head dimension per register, the cache's fp16 / bf16 / int8
// entries converted to fp32 as they are loaded (an int8 entry's scale applied to its score and its weight).
#include "../../attention.h"

#ifdef FBS_X86
#include "avx2.h"

namespace fbs_attn {
namespace {
template <class T>
__attribute__((target("avx2,fma,f16c"))) void head_t(const float* q, const T* K, const T* V, int64_t n,
                                                        int64_t hd, float scale, float* p, float* o,
                                                        const Visible* vis) {
  using fbs_x86::load8;
  const int64_t nc = hd / 8;
  __m256 qv[kMaxHd / 8], acc[kMaxHd / 8];
  for (int64_t c = 0; c < nc; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * c), _mm256_set1_ps(scale));
  const int64_t w = Entry<T>::width(hd);
  for (int64_t j = 0; j < n; ++j) {
    const T* k = K + j * w;
    __m256 a = _mm256_mul_ps(qv[0], load8(k));
    for (int64_t c = 1; c < nc; ++c) a = _mm256_fmadd_ps(qv[c], load8(k + 8 * c), a);
    p[j] = !vis || (*vis)(j) ? fbs_x86::hsum256(a) * Entry<T>::scale(k, hd) : -INFINITY;
  }
  float z;
  softmax_(p, n, &z);
  for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* v = V + j * w;
    const __m256 pj = _mm256_set1_ps(p[j] * Entry<T>::scale(v, hd));
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(pj, load8(v + 8 * c), acc[c]);
  }
  const __m256 iz = _mm256_set1_ps(1.0f / z);
  for (int64_t c = 0; c < nc; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], iz));
}

}  // namespace

#define FBS_HEAD_DEF(T)                                                                                          \
  __attribute__((target("avx2,fma,f16c"))) void head_avx2(const float* q, const T* K, const T* V, int64_t n,     \
                                                          int64_t hd, float scale, float* p, float* o,          \
                                                          const Visible* vis) {                                 \
    head_t(q, K, V, n, hd, scale, p, o, vis);                                                                   \
  }
FBS_KV_OVERLOADS(FBS_HEAD_DEF)
#undef FBS_HEAD_DEF
}  // namespace fbs_attn
#endif
