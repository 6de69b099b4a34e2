// AVX2 tiles of the block-quantized products (quant.h): maddubs (u8 x s8 -> s16 pairs) and madd into int32, two
// halves of 8 channels per tile. Signed weights use the sign trick (|w| x sign(w) x), so no pair sum saturates.
#include <immintrin.h>

#include "../../quant.h"

namespace fbs_quant {
namespace {
#define FBS_AVX2 __attribute__((target("avx2,fma,f16c")))

FBS_AVX2 inline __m256i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// 8 int32 sums of 4 products: unsigned u x signed s
FBS_AVX2 inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

FBS_AVX2 inline __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int MB>
FBS_AVX2 void tile(const Act& a, const uint8_t* p, const float* S, int64_t kind, float* Y, int64_t ldy, int64_t N,
                   int64_t n0, int64_t m0) {
  const int64_t Kb = a.Kp / kBlock, bb = block_bytes(kind);
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  __m256 af[MB][2];
  for (int m = 0; m < MB; ++m) af[m][0] = af[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < Kb; ++b, p += bb) {
    prefetch_stream(p, bb);
    for (int h = 0; h < 2; ++h) {  // channels 8h..8h+7
      __m256i ai[MB];
      for (int m = 0; m < MB; ++m) ai[m] = _mm256_setzero_si256();
      if (kind == kQ4Block) {
        for (int v = 0; v < 4; ++v) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * v + 32 * h));
          const __m256i wl = _mm256_and_si256(raw, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
          for (int m = 0; m < MB; ++m) {
            const int8_t* x = a.q + (m0 + m) * a.Kp + b * kBlock + 8 * v;
            ai[m] = _mm256_add_epi32(ai[m], dot4(wl, bcast4(x)));
            ai[m] = _mm256_add_epi32(ai[m], dot4(wh, bcast4(x + 4)));
          }
        }
      } else {
        for (int g = 0; g < 8; ++g) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * g + 32 * h));
          const __m256i aw = _mm256_sign_epi8(w, w);
          for (int m = 0; m < MB; ++m) {
            const __m256i xs = _mm256_sign_epi8(bcast4(a.q + (m0 + m) * a.Kp + b * kBlock + 4 * g), w);
            ai[m] = _mm256_add_epi32(ai[m], dot4(aw, xs));
          }
        }
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t r = (m0 + m) * Kb + b;
        const __m256 f = _mm256_cvtepi32_ps(ai[m]);
        if (kind == kQ4Block) {
          const __m256 dw = half8(p + 256 + 16 * h), mw = half8(p + 288 + 16 * h);
          af[m][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a.d[r])), af[m][h]);
          af[m][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.ds[r]), af[m][h]);
        } else if (kind == kQ8Block) {
          af[m][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(half8(p + 512 + 16 * h), _mm256_set1_ps(a.d[r])), af[m][h]);
        } else {
          af[m][h] = _mm256_fmadd_ps(f, _mm256_set1_ps(a.d[r]), af[m][h]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    float out[16];
    for (int h = 0; h < 2; ++h) {
      __m256 y = af[m][h];
      if (kind == kI8Channel) y = _mm256_mul_ps(y, _mm256_loadu_ps(S + n0 + 8 * h));
      _mm256_storeu_ps(out + 8 * h, y);
    }
    for (int64_t i = 0; i < kTile && n0 + i < N; ++i) Y[(m0 + m) * ldy + n0 + i] = out[i];
  }
}
}  // namespace

void tile_avx2(const Act& a, const uint8_t* p, const float* S, int64_t kind, float* Y, int64_t ldy, int64_t N,
               int64_t n0) {
  for (int64_t m = 0; m < a.M;) {
    if (a.M - m >= 2) {
      tile<2>(a, p, S, kind, Y, ldy, N, n0, m);
      m += 2;
    } else {
      tile<1>(a, p, S, kind, Y, ldy, N, n0, m);
      m += 1;
    }
  }
}
}  // namespace fbs_quant
