// The int8 product's tile kernel with AVX-512: 16 int8 weights widened to fp32 per chunk, FMA against the rows.
#include "../../int8.h"

#ifdef FBS_X86
#include <immintrin.h>

namespace fbs_int8 {
namespace {
template <int MB>
__attribute__((target("avx512f,fma"))) void tile512(const float* X, int64_t Kp, const int8_t* p, int64_t nc,
                                                    const uint16_t* S, float* Y, int64_t N, int64_t n0) {
  __m512 a[kNB][MB];
  for (int i = 0; i < kNB; ++i)
    for (int m = 0; m < MB; ++m) a[i][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c, p += kNB * kChunk) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
    __m512 w[kNB];
    for (int i = 0; i < kNB; ++i)
      w[i] =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * kChunk))));
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(X + m * Kp + c * kChunk);
      for (int i = 0; i < kNB; ++i) a[i][m] = _mm512_fmadd_ps(w[i], xv, a[i][m]);
    }
  }
  for (int i = 0; i < kNB && n0 + i < N; ++i)
    for (int m = 0; m < MB; ++m) Y[m * N + n0 + i] = _mm512_reduce_add_ps(a[i][m]) * fbs::bf16(S[n0 + i]);
}
}  // namespace

// activation rows in blocks of up to 4 per pass over the tile
void tile_rows_avx512(const float* X, int64_t M, int64_t Kp, const int8_t* p, int64_t nc, const uint16_t* S, float* Y,
                      int64_t N, int64_t n0) {
  for (int64_t m = 0; m < M;) {
    const float* xm = X + m * Kp;
    float* ym = Y + m * N;
    const int64_t left = M - m;
    if (left >= 4) {
      tile512<4>(xm, Kp, p, nc, S, ym, N, n0);
      m += 4;
    } else if (left >= 2) {
      tile512<2>(xm, Kp, p, nc, S, ym, N, n0);
      m += 2;
    } else {
      tile512<1>(xm, Kp, p, nc, S, ym, N, n0);
      m += 1;
    }
  }
}
}  // namespace fbs_int8
#endif
