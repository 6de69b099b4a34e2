// The int8 product's tile kernel with AVX2: each 16-byte chunk as two halves of 8 weights widened to fp32.
#include "../../int8.h"

#ifdef FBS_X86
#include "avx2.h"

namespace fbs_int8 {
namespace {
template <int MB>
__attribute__((target("avx2,fma"))) void tile256(const float* X, int64_t Kp, const int8_t* p, int64_t nc,
                                                 const uint16_t* S, float* Y, int64_t N, int64_t n0) {
  __m256 a[kNB][MB];
  for (int i = 0; i < kNB; ++i)
    for (int m = 0; m < MB; ++m) a[i][m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < nc; ++c, p += kNB * kChunk) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256 w[kNB];
      for (int i = 0; i < kNB; ++i)
        w[i] = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i * kChunk + 8 * h))));
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_loadu_ps(X + m * Kp + c * kChunk + 8 * h);
        for (int i = 0; i < kNB; ++i) a[i][m] = _mm256_fmadd_ps(w[i], xv, a[i][m]);
      }
    }
  }
  for (int i = 0; i < kNB && n0 + i < N; ++i)
    for (int m = 0; m < MB; ++m) Y[m * N + n0 + i] = fbs_x86::hsum256(a[i][m]) * fbs::bf16(S[n0 + i]);
}
}  // namespace

// activation rows in blocks of up to 2 per pass over the tile
void tile_rows_avx2(const float* X, int64_t M, int64_t Kp, const int8_t* p, int64_t nc, const uint16_t* S, float* Y,
                    int64_t N, int64_t n0) {
  for (int64_t m = 0; m < M;) {
    const float* xm = X + m * Kp;
    float* ym = Y + m * N;
    if (M - m >= 2) {
      tile256<2>(xm, Kp, p, nc, S, ym, N, n0);
      m += 2;
    } else {
      tile256<1>(xm, Kp, p, nc, S, ym, N, n0);
      m += 1;
    }
  }
}
}  // namespace fbs_int8
#endif
