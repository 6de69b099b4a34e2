// AVX-512 VNNI tiles of the block-quantized products (quant.h): vpdpbusd over 16 channels x 4 k per instruction.
// Signed weights enter vpdpbusd's unsigned operand as w + 128 (xor 0x80); the offset is removed per row with the
// activation sums (Act::c for per-channel scales, 128 ds per block for block scales).
#include <immintrin.h>

#include "../../quant.h"

namespace fbs_quant {
namespace {
#define FBS_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))

FBS_VNNI inline __m512i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

FBS_VNNI inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Integer sums of one tile-block of signed weights (8 groups of 64 B) against MB rows.
template <int MB>
FBS_VNNI inline void dot_s8(const uint8_t* p, const int8_t* const* xq, __m512i* acc) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int g = 0; g < 8; ++g) {
    const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * g), flip);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], w, bcast4(xq[m] + 4 * g));
  }
}

template <int MB>
FBS_VNNI void tile(const Act& a, const uint8_t* p, const float* S, int64_t kind, float* Y, int64_t ldy, int64_t N,
                   int64_t n0, int64_t m0) {
  const int64_t Kb = a.Kp / kBlock, bb = block_bytes(kind);
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 af[MB];
  for (int m = 0; m < MB; ++m) af[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < Kb; ++b, p += bb) {
    prefetch_stream(p, bb);
    const int8_t* xq[MB];
    __m512i ai[MB];
    for (int m = 0; m < MB; ++m) {
      xq[m] = a.q + (m0 + m) * a.Kp + b * kBlock;
      ai[m] = _mm512_setzero_si512();
    }
    if (kind == kQ4Block) {
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(p + 64 * v);
        const __m512i wl = _mm512_and_si512(raw, lo4), wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
        for (int m = 0; m < MB; ++m) {
          ai[m] = _mm512_dpbusd_epi32(ai[m], wl, bcast4(xq[m] + 8 * v));
          ai[m] = _mm512_dpbusd_epi32(ai[m], wh, bcast4(xq[m] + 8 * v + 4));
        }
      }
      const __m512 dw = half16(p + 256), mw = half16(p + 288);
      for (int m = 0; m < MB; ++m) {
        const int64_t r = (m0 + m) * Kb + b;
        af[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[r])), af[m]);
        af[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.ds[r]), af[m]);
      }
    } else if (kind == kQ8Block) {
      dot_s8<MB>(p, xq, ai);
      const __m512 dw = half16(p + 512);
      for (int m = 0; m < MB; ++m) {
        const int64_t r = (m0 + m) * Kb + b;
        const __m512 t =
            _mm512_fmsub_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_set1_ps(a.d[r]), _mm512_set1_ps(128.f * a.ds[r]));
        af[m] = _mm512_fmadd_ps(dw, t, af[m]);
      }
    } else {
      dot_s8<MB>(p, xq, ai);
      for (int m = 0; m < MB; ++m)
        af[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_set1_ps(a.d[(m0 + m) * Kb + b]), af[m]);
    }
  }
  const __mmask16 mask = N - n0 >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
  for (int m = 0; m < MB; ++m) {
    __m512 y = af[m];
    if (kind == kI8Channel) y = _mm512_mul_ps(_mm512_sub_ps(y, _mm512_set1_ps(a.c[m0 + m])), _mm512_loadu_ps(S + n0));
    _mm512_mask_storeu_ps(Y + (m0 + m) * ldy + n0, mask, y);
  }
}

// Many rows (a prompt): the tile's weights are unpacked once into the unsigned bytes vpdpbusd reads (q4: its nibbles;
// q8: its int8 values + 128), with the block scales (and q4's mins) as fp32 (u: Kb blocks of kUnpacked bytes), then
// MB rows at a time stream that copy from L1. The integer sums and the fp32 updates per block are the ones tile()
// makes, in the same order: each row's result is bit for bit tile()'s.
constexpr int64_t kUnpacked = 512 + 128;  // 8 groups of 64 u8, 16 fp32 d, 16 fp32 m (q4)

FBS_VNNI void unpack_q8(const uint8_t* p, int64_t Kb, uint8_t* u) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t b = 0; b < Kb; ++b, p += 544, u += kUnpacked) {
    for (int g = 0; g < 8; ++g) _mm512_store_si512(u + 64 * g, _mm512_xor_si512(_mm512_loadu_si512(p + 64 * g), flip));
    _mm512_store_ps(u + 512, half16(p + 512));
  }
}

FBS_VNNI void unpack_q4(const uint8_t* p, int64_t Kb, uint8_t* u) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < Kb; ++b, p += 320, u += kUnpacked) {
    for (int v = 0; v < 4; ++v) {
      const __m512i raw = _mm512_loadu_si512(p + 64 * v);
      _mm512_store_si512(u + 128 * v, _mm512_and_si512(raw, lo4));
      _mm512_store_si512(u + 128 * v + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4));
    }
    _mm512_store_ps(u + 512, half16(p + 256));
    _mm512_store_ps(u + 576, half16(p + 288));
  }
}

// Rows o .. o + MB - 1 of a Rows8 group against NT unpacked tiles (u, u + Kb * kUnpacked): each activation
// broadcast feeds NT dot products, each row's scales NT updates. The first `rows` rows are stored; the last tile's
// channels under `mask`.
template <int NT, int MB, bool Q8>
FBS_VNNI void rows_q(const Rows8& a, int64_t g8, int o, const uint8_t* u, float* Y, int64_t ldy, __mmask16 mask,
                     int64_t rows) {
  const int64_t Kb = a.Kb;
  const int8_t* xq = a.q + (g8 * Kb * kManyRows + o) * kBlock;
  const float *d = a.d + g8 * Kb * kManyRows + o, *ds = a.ds + g8 * Kb * kManyRows + o;
  __m512 af[NT][MB];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MB; ++m) af[t][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < Kb; ++b, u += kUnpacked, xq += kManyRows * kBlock, d += kManyRows, ds += kManyRows) {
    __m512i ai[NT][MB];
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MB; ++m) ai[t][m] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      __m512i w[NT];
      for (int t = 0; t < NT; ++t) w[t] = _mm512_load_si512(u + t * Kb * kUnpacked + 64 * g);
      for (int m = 0; m < MB; ++m) {
        const __m512i x = bcast4(xq + m * kBlock + 4 * g);
        for (int t = 0; t < NT; ++t) ai[t][m] = _mm512_dpbusd_epi32(ai[t][m], w[t], x);
      }
    }
    for (int t = 0; t < NT; ++t) {
      const float* sc = reinterpret_cast<const float*>(u + t * Kb * kUnpacked + 512);
      const __m512 dw = _mm512_load_ps(sc);
      if (Q8) {  // tile()'s update: the +128 offset removed with the block's activation sum
        for (int m = 0; m < MB; ++m) {
          const __m512 x = _mm512_fmsub_ps(_mm512_cvtepi32_ps(ai[t][m]), _mm512_set1_ps(d[m]),
                                           _mm512_set1_ps(128.f * ds[m]));
          af[t][m] = _mm512_fmadd_ps(dw, x, af[t][m]);
        }
      } else {
        const __m512 mw = _mm512_load_ps(sc + 16);
        for (int m = 0; m < MB; ++m) {  // tile()'s two updates, in its order
          af[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[t][m]), _mm512_mul_ps(dw, _mm512_set1_ps(d[m])), af[t][m]);
          af[t][m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[m]), af[t][m]);
        }
      }
    }
  }
  for (int m = 0; m < rows; ++m)
    for (int t = 0; t < NT; ++t)
      _mm512_mask_storeu_ps(Y + m * ldy + t * kTile, t == NT - 1 ? mask : __mmask16(0xFFFF), af[t][m]);
}

// tile<MB>'s arithmetic for q4 or q8 blocks (the same ops in the same order) over the MB rows of a Rows8 group starting
// at m0 and one tile (p; channels n0 ..). One tile a call: two (each broadcast feeding both) measured 3-6 % slower for
// 6-8 rows in place (s32: the 2 x 8 x 2 accumulators do not fit the 32 registers).
template <int MB, bool Q8>
FBS_VNNI void tile_r8(const Rows8& a, const uint8_t* p, float* Y, int64_t ldy, int64_t N, int64_t n0, int64_t m0) {
  const int64_t Kb = a.Kb, bb = Q8 ? 512 + 32 : 320;
  const __m512i lo4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(char(0x80));
  const int64_t g8 = m0 / kManyRows;
  const int8_t* xq = a.q + g8 * Kb * kManyRows * kBlock;
  const float *d = a.d + g8 * Kb * kManyRows, *ds = a.ds + g8 * Kb * kManyRows;
  __m512 af[MB];
  for (int m = 0; m < MB; ++m) af[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < Kb; ++b, p += bb, xq += kManyRows * kBlock, d += kManyRows, ds += kManyRows) {
    prefetch_stream(p, bb);
    __m512i ai[MB];
    for (int m = 0; m < MB; ++m) ai[m] = _mm512_setzero_si512();
    if (Q8) {
      for (int g = 0; g < 8; ++g) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * g), flip);
        for (int m = 0; m < MB; ++m) ai[m] = _mm512_dpbusd_epi32(ai[m], w, bcast4(xq + m * kBlock + 4 * g));
      }
    } else {
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(p + 64 * v);
        const __m512i wl = _mm512_and_si512(raw, lo4), wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
        for (int m = 0; m < MB; ++m) {
          ai[m] = _mm512_dpbusd_epi32(ai[m], wl, bcast4(xq + m * kBlock + 8 * v));
          ai[m] = _mm512_dpbusd_epi32(ai[m], wh, bcast4(xq + m * kBlock + 8 * v + 4));
        }
      }
    }
    if (Q8) {  // tile()'s q8 update: the +128 offset removed with the block's activation sum
      const __m512 dw = half16(p + 512);
      for (int m = 0; m < MB; ++m) {
        const __m512 x = _mm512_fmsub_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_set1_ps(d[m]), _mm512_set1_ps(128.f * ds[m]));
        af[m] = _mm512_fmadd_ps(dw, x, af[m]);
      }
    } else {  // tile()'s two q4 updates, in its order
      const __m512 dw = half16(p + 256), mw = half16(p + 288);
      for (int m = 0; m < MB; ++m) {
        af[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m]), _mm512_mul_ps(dw, _mm512_set1_ps(d[m])), af[m]);
        af[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[m]), af[m]);
      }
    }
  }
  const int64_t nl = N - n0;  // the tile's channels
  const __mmask16 mask = nl >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << nl) - 1);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(Y + (m0 + m) * ldy + n0, mask, af[m]);
}

template <bool Q8>
void rows8_group(const Rows8& a, const uint8_t* p, float* Y, int64_t ldy, int64_t N, int64_t n0, int64_t m) {
  switch (std::min<int64_t>(kManyRows, a.M - m)) {
    case 8: tile_r8<8, Q8>(a, p, Y, ldy, N, n0, m); break;
    case 7: tile_r8<7, Q8>(a, p, Y, ldy, N, n0, m); break;
    case 6: tile_r8<6, Q8>(a, p, Y, ldy, N, n0, m); break;
    case 5: tile_r8<5, Q8>(a, p, Y, ldy, N, n0, m); break;
    case 4: tile_r8<4, Q8>(a, p, Y, ldy, N, n0, m); break;
    case 3: tile_r8<3, Q8>(a, p, Y, ldy, N, n0, m); break;
    case 2: tile_r8<2, Q8>(a, p, Y, ldy, N, n0, m); break;
    default: tile_r8<1, Q8>(a, p, Y, ldy, N, n0, m); break;
  }
}
}  // namespace

__attribute__((target("avx512f"))) void quantize_avx512(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q,
                                                        float* d, float* ds, float* c) {
  const int64_t Kb = K / kBlock;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    double cc = 0.0;
    for (int64_t b = 0; b < Kb; ++b) {
      const __m512 v0 = _mm512_loadu_ps(xm + b * kBlock), v1 = _mm512_loadu_ps(xm + b * kBlock + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float db = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512 s = _mm512_set1_ps(inv);  // round half to even (the default rounding mode), as nearbyint
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
      int8_t* qb = q + m * K + b * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(i1));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
      d[m * Kb + b] = db;
      ds[m * Kb + b] = db * float(sum);
      cc += double(db) * double(sum);
    }
    c[m] = float(128.0 * cc);
  }
}

void tile_vnni512(const Act& a, const uint8_t* p, const float* S, int64_t kind, float* Y, int64_t ldy, int64_t N,
                  int64_t n0) {
  // rows in passes of up to 8 over the tile, each pass as many rows as are left (one weight read per pass)
  for (int64_t m = 0; m < a.M;) {
    const int64_t rows = std::min<int64_t>(8, a.M - m);
    switch (rows) {
      case 8: tile<8>(a, p, S, kind, Y, ldy, N, n0, m); break;
      case 7: tile<7>(a, p, S, kind, Y, ldy, N, n0, m); break;
      case 6: tile<6>(a, p, S, kind, Y, ldy, N, n0, m); break;
      case 5: tile<5>(a, p, S, kind, Y, ldy, N, n0, m); break;
      case 4: tile<4>(a, p, S, kind, Y, ldy, N, n0, m); break;
      case 3: tile<3>(a, p, S, kind, Y, ldy, N, n0, m); break;
      case 2: tile<2>(a, p, S, kind, Y, ldy, N, n0, m); break;
      default: tile<1>(a, p, S, kind, Y, ldy, N, n0, m); break;
    }
    m += rows;
  }
}

void tile_many_vnni512(const Rows8& a, const uint8_t* p, int64_t kind, int64_t nt, int64_t tb, float* Y, int64_t ldy,
                       int64_t N, int64_t n0, int64_t m0, int64_t m1) {
  const int64_t Kb = a.Kb;
  thread_local std::vector<uint8_t> buf;
  if (int64_t(buf.size()) < nt * Kb * kUnpacked + 64) buf.resize(nt * Kb * kUnpacked + 64);
  uint8_t* u = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  const bool q8 = kind == kQ8Block;
  for (int64_t t = 0; t < nt; ++t) (q8 ? unpack_q8 : unpack_q4)(p + t * tb, Kb, u + t * Kb * kUnpacked);
  const int64_t nl = N - n0 - (nt - 1) * kTile;  // channels of the last tile
  const __mmask16 mask = nl >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << nl) - 1);
  for (int64_t m = m0; m < m1; m += kManyRows) {
    const int64_t rows = std::min(kManyRows, a.M - m), g8 = m / kManyRows;
    float* y = Y + m * ldy + n0;
    if (nt == 2) {  // two tiles, rows in two halves of 4 (the registers of 2 x 4 x 2 accumulators)
      const auto run = q8 ? rows_q<2, 4, true> : rows_q<2, 4, false>;
      run(a, g8, 0, u, y, ldy, mask, std::min<int64_t>(4, rows));
      if (rows > 4) run(a, g8, 4, u, y + 4 * ldy, ldy, mask, rows - 4);
    } else {
      (q8 ? rows_q<1, kManyRows, true> : rows_q<1, kManyRows, false>)(a, g8, 0, u, y, ldy, mask, rows);
    }
  }
}

void tile_rows8_vnni512(const Rows8& a, const uint8_t* p, int64_t kind, int64_t nt, int64_t tb, float* Y, int64_t ldy,
                        int64_t N, int64_t n0) {
  const auto group = kind == kQ8Block ? rows8_group<true> : rows8_group<false>;
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t m = 0; m < a.M; m += kManyRows) group(a, p + t * tb, Y, ldy, N, n0 + t * kTile, m);
}
}  // namespace fbs_quant
