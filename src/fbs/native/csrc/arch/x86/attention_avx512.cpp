// One query head's attention, and a group of queries over one cached K/V head, with AVX-512: 16 floats of the head
// dimension per register, the cache's fp16 / bf16 / int8 entries converted to fp32 as they are loaded (an int8
// entry's scale applied to its score and to its softmax weight: Entry<int8_t>).
#include "../../attention.h"

#ifdef FBS_X86
#include "avx512.h"

namespace fbs_attn {
#define FBS_A512 __attribute__((target("avx512f,fma")))
using fbs_x86::load16;

namespace {
template <class T>
FBS_A512 void head_t(const float* q, const T* K, const T* V, int64_t n, int64_t hd, float scale, float* p, float* o,
                     const Visible* vis) {
  const int64_t nc = hd / 16;
  __m512 qv[kMaxHd / 16], acc[kMaxHd / 16];
  for (int64_t c = 0; c < nc; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), _mm512_set1_ps(scale));
  const int64_t ew = Entry<T>::width(hd);
  for (int64_t j = 0; j < n; ++j) {
    const T* k = K + j * ew;
    __m512 a = _mm512_mul_ps(qv[0], load16(k));
    for (int64_t c = 1; c < nc; ++c) a = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), a);
    p[j] = !vis || (*vis)(j) ? _mm512_reduce_add_ps(a) * Entry<T>::scale(k, hd) : -INFINITY;
  }
  float z;
  softmax_(p, n, &z);
  for (int64_t c = 0; c < nc; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* v = V + j * ew;
    const __m512 w = _mm512_set1_ps(p[j] * Entry<T>::scale(v, hd));
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm512_fmadd_ps(w, load16(v + 16 * c), acc[c]);
  }
  const __m512 iz = _mm512_set1_ps(1.0f / z);
  for (int64_t c = 0; c < nc; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], iz));
}

using fbs_x86::exp16;

// 16 vectors -> one: lane t = the sum of v[t]'s lanes (a transposing reduction, 45 shuffles / adds for 16 sums)
FBS_A512 inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// The cached entry of virtual slot k: slot k itself, or (a token tree's node, k >= km) the physical slot map[k - km]
// of its k - km-th visible key in the round (group_avx512)
inline int64_t slot_of(int64_t k, const int64_t* map, int64_t km) { return map && k >= km ? map[k - km] : k; }

// acc[i] += sum_j w[i][j] V[k0 + j] over keys j = 0 .. n - 1 (virtual slots, slot_of; V entries of hd values,
// columns c0 .. c0 + 16 NC - 1) for QC queries; w: the softmax numerators already multiplied by their value's scale.
// Each value row is loaded (and converted) once for the QC queries; a query's sums run over j in order, whatever QC
// and NC are.
template <int QC, int NC, class T>
FBS_A512 void pv(const float* const* w, const T* V, int64_t k0, const int64_t* map, int64_t km, int64_t n, int64_t hd,
                 int64_t c0, float* const* acc) {
  const int64_t ew = Entry<T>::width(hd);
  __m512 a[QC][NC];
  for (int i = 0; i < QC; ++i)
    for (int c = 0; c < NC; ++c) a[i][c] = _mm512_loadu_ps(acc[i] + c0 + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* v = V + slot_of(k0 + j, map, km) * ew + c0;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16(v + 16 * c);
    for (int i = 0; i < QC; ++i) {
      const __m512 wi = _mm512_set1_ps(w[i][j]);
      for (int c = 0; c < NC; ++c) a[i][c] = _mm512_fmadd_ps(wi, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < QC; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc[i] + c0 + 16 * c, a[i][c]);
}
// pv for QC queries over every column: up to 6 queries 64 columns at a time, 7 to 12 queries 32 (what the registers
// hold)
template <int QC, class T>
FBS_A512 void pv_all(const float* const* w, const T* V, int64_t k0, const int64_t* map, int64_t km, int64_t n,
                     int64_t hd, float* const* acc) {
  constexpr int NC = QC <= 6 ? 4 : 2;
  for (int64_t c0 = 0; c0 < hd; c0 += 16 * NC) pv<QC, NC>(w, V, k0, map, km, n, hd, c0, acc);
}
template <class T>
FBS_A512 void pv_n(int64_t qc, const float* const* w, const T* V, int64_t k0, const int64_t* map, int64_t km,
                   int64_t n, int64_t hd, float* const* acc) {
  using F = void (*)(const float* const*, const T*, int64_t, const int64_t*, int64_t, int64_t, int64_t, float* const*);
  static constexpr F by_qc[12] = {pv_all<1, T>, pv_all<2, T>, pv_all<3, T>, pv_all<4, T>,  pv_all<5, T>,  pv_all<6, T>,
                                  pv_all<7, T>, pv_all<8, T>, pv_all<9, T>, pv_all<10, T>, pv_all<11, T>, pv_all<12, T>};
  by_qc[qc - 1](w, V, k0, map, km, n, hd, acc);
}

#define FBS_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))

// 16 vectors of 16 int32 lanes transposed in place: lane t of r[c] becomes lane c of r[t]
FBS_VNNI inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int k = 0; k < 2; ++k)
    for (int j = 0; j < 4; ++j) {
      t[8 * k + j] = _mm512_shuffle_i32x4(r[8 * k + j], r[8 * k + 4 + j], 0x88);
      t[8 * k + 4 + j] = _mm512_shuffle_i32x4(r[8 * k + j], r[8 * k + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
  }
}

// The scores of nq coded queries (qq[i]: query_codes' layout) against 16 int8 entries kr (their scales ks), hd = 32 NB:
// s[i * kn + t] = ks[t] * sum_b (s_b (sum hi k_t) + s_b / 254 (sum lo k_t)) under mask. Each 64-value chunk of the 16
// keys is transposed once (lane t of vector w: key t's values 4w .. 4w + 3) and offset to unsigned (+128), so that
// one vpdpbusd adds 4 products for 16 keys; the offset's share, -128 times the sum of the query's codes, is where
// each sum starts. The integer sums are exact; a query's arithmetic does not depend on the others.
template <int NB>
FBS_VNNI void scores_vnni(const int8_t* const* kr, const int8_t* const* qq, int64_t nq, __m512 ks, float* s,
                          int64_t kn, __mmask16 mask) {
  constexpr int64_t hd = 32 * NB;
  __m512i kt[NB / 2][16];
  const __m512i off = _mm512_set1_epi8(char(0x80));
  for (int c = 0; c < NB / 2; ++c) {
    for (int t = 0; t < 16; ++t) kt[c][t] = _mm512_loadu_si512(kr[t] + 64 * c);
    transpose16(kt[c]);
    for (int w = 0; w < 16; ++w) kt[c][w] = _mm512_xor_si512(kt[c][w], off);
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int8_t* hi = qq[i];
    const int8_t* lo = hi + hd;
    const char* fb = reinterpret_cast<const char*>(hi + 2 * hd);  // per block: s, s / 254, hi offset, lo offset
    __m512i ah[NB], al[NB];
    for (int b = 0; b < NB; ++b) {
      int32_t oh, ol;
      std::memcpy(&oh, fb + 16 * b + 8, 4);
      std::memcpy(&ol, fb + 16 * b + 12, 4);
      ah[b] = _mm512_set1_epi32(oh);
      al[b] = _mm512_set1_epi32(ol);
    }
    for (int w = 0; w < 8; ++w)
      for (int b = 0; b < NB; ++b) {
        const __m512i kv = kt[b / 2][(b % 2) * 8 + w];
        int32_t h4, l4;
        std::memcpy(&h4, hi + 32 * b + 4 * w, 4);
        std::memcpy(&l4, lo + 32 * b + 4 * w, 4);
        ah[b] = _mm512_dpbusd_epi32(ah[b], kv, _mm512_set1_epi32(h4));
        al[b] = _mm512_dpbusd_epi32(al[b], kv, _mm512_set1_epi32(l4));
      }
    __m512 r = _mm512_setzero_ps();
    for (int b = 0; b < NB; ++b) {
      float sb, sl;
      std::memcpy(&sb, fb + 16 * b, 4);
      std::memcpy(&sl, fb + 16 * b + 4, 4);
      r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ah[b]), _mm512_set1_ps(sb), r);
      r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al[b]), _mm512_set1_ps(sl), r);
    }
    _mm512_mask_storeu_ps(s + i * kn, mask, _mm512_mul_ps(r, ks));
  }
}

template <class T>
FBS_A512 void group_t(const float* const* q, const int64_t* last, int64_t nq, const T* K, const T* V, int64_t k0,
                           int64_t k1, int64_t hd, float* s, float* part, const int64_t* map, int64_t km,
                           const int8_t* const* qq, const Next* next) {
  const int64_t kn = k1 - k0, nc = hd / 16, ps = hd + 2, ew = Entry<T>::width(hd);
  // the next range's lines, a share per block of keys: one core keeps too few reads of these short streams in
  // flight by itself (a probe of this access pattern, 2 threads: 24 GB/s without, 40 with reads asked for 8 KB ahead)
  const int64_t lines = next ? (next->bytes + 63) / 64 : 0, per = (lines + (kn + 15) / 16 - 1) / ((kn + 15) / 16);
  int64_t asked = 0;
  // scores s[i][j - k0] = q_i . K_j, 16 keys at a time; a block's last keys past k1 repeat key k1 - 1 (not stored)
  alignas(64) float kb[16 * kMaxHd];
  for (int64_t jb = k0; jb < k1; jb += 16) {
    const int64_t nb = std::min<int64_t>(16, k1 - jb);
    for (const int64_t end = std::min(lines, asked + per); asked < end; ++asked) {
      _mm_prefetch(next->k + 64 * asked, _MM_HINT_T1);
      _mm_prefetch(next->v + 64 * asked, _MM_HINT_T1);
    }
    const T* kr[16];
    for (int t = 0; t < 16; ++t) kr[t] = K + slot_of(std::min(jb + t, k1 - 1), map, km) * ew;
    const __mmask16 mask = nb == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nb) - 1);
    __m512 ks = _mm512_set1_ps(1.f);  // the 16 keys' scales (int8 entries)
    if constexpr (Entry<T>::extra > 0) {
      float sc[16];
      for (int t = 0; t < 16; ++t) sc[t] = Entry<T>::scale(kr[t], hd);
      ks = _mm512_loadu_ps(sc);
      if (qq) {  // integer scores (query_codes)
        const int8_t* const* k8 = reinterpret_cast<const int8_t* const*>(kr);
        float* sb = s + (jb - k0);
        switch (hd / 32) {
          case 2: scores_vnni<2>(k8, qq, nq, ks, sb, kn, mask); break;
          case 4: scores_vnni<4>(k8, qq, nq, ks, sb, kn, mask); break;
          case 6: scores_vnni<6>(k8, qq, nq, ks, sb, kn, mask); break;
          default: scores_vnni<8>(k8, qq, nq, ks, sb, kn, mask); break;
        }
        continue;
      }
    }
    // the block's keys as fp32, converted once for all the group's queries (an fp32 cache is read in place)
    const float* kf[16];
    if constexpr (std::is_same_v<T, float>) {
      for (int t = 0; t < 16; ++t) kf[t] = kr[t];
    } else {
      for (int t = 0; t < 16; ++t) {
        for (int64_t c = 0; c < nc; ++c) _mm512_store_ps(kb + t * hd + 16 * c, load16(kr[t] + 16 * c));
        kf[t] = kb + t * hd;
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
      for (int64_t c = 0; c < nc; ++c) {
        const __m512 qc = _mm512_loadu_ps(q[i] + 16 * c);
        for (int t = 0; t < 16; ++t) a[t] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kf[t] + 16 * c), a[t]);
      }
      __m512 r = reduce16(a);
      if constexpr (Entry<T>::extra > 0) r = _mm512_mul_ps(r, ks);
      _mm512_mask_storeu_ps(s + i * kn + (jb - k0), mask, r);
    }
  }
  // per query: its softmax numerators over the keys it sees (zero past them), their max and sum
  for (int64_t i = 0; i < nq; ++i) {
    float* si = s + i * kn;
    float* pi = part + i * ps;
    const int64_t n = std::max<int64_t>(0, std::min(k1, last[i] + 1) - k0);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mk = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, si + j));
    }
    const float m = _mm512_reduce_max_ps(mv);
    // their sum in fp64 (then rounded once)
    __m512d zlo = _mm512_setzero_pd(), zhi = _mm512_setzero_pd();
    const __m512 mb = _mm512_set1_ps(m);
    for (int64_t j = 0; j < kn; j += 16) {
      const int64_t left = kn - j;
      const __mmask16 mk = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(16, n - j));
      const __mmask16 mv16 = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      const __m512 e = _mm512_maskz_mov_ps(mv16, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mv16, si + j), mb)));
      zlo = _mm512_add_pd(zlo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
      zhi = _mm512_add_pd(zhi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
      _mm512_mask_storeu_ps(si + j, mk, e);
    }
    pi[0] = n > 0 ? m : -INFINITY;
    pi[1] = float(_mm512_reduce_add_pd(_mm512_add_pd(zlo, zhi)));
    std::fill_n(pi + 2, hd, 0.f);
  }
  // acc_i = sum_j p_ij V_j: each value row loaded once per chunk of up to 12 queries; the weights p_ij times the value's
  // scale (int8 entries) first, the same product the sum would form
  alignas(64) float vsc[kKeyRange], wb[12 * kKeyRange];
  if constexpr (Entry<T>::extra > 0)
    for (int64_t j = 0; j < kn; ++j) vsc[j] = Entry<T>::scale(V + slot_of(k0 + j, map, km) * ew, hd);
  for (int64_t i0 = 0; i0 < nq; i0 += 12) {
    const int64_t qc = std::min<int64_t>(12, nq - i0);
    const float* pw[12];
    float* aa[12];
    for (int64_t i = 0; i < qc; ++i) {
      const float* pi = s + (i0 + i) * kn;
      aa[i] = part + (i0 + i) * ps + 2;
      if constexpr (Entry<T>::extra > 0) {
        float* wi = wb + i * kKeyRange;
        for (int64_t j = 0; j < kn; j += 16) {
          const __mmask16 mk = kn - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (kn - j)) - 1);
          _mm512_mask_storeu_ps(wi + j, mk,
                                _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, pi + j), _mm512_maskz_loadu_ps(mk, vsc + j)));
        }
        pw[i] = wi;
      } else {
        pw[i] = pi;
      }
    }
    pv_n(qc, pw, V, k0, map, km, kn, hd, aa);
  }
}

}  // namespace

FBS_VNNI void query_codes_vnni(const float* q, int64_t hd, int8_t* out) {
  int8_t* hi = out;
  int8_t* lo = out + hd;
  char* fb = reinterpret_cast<char*>(out + 2 * hd);
  for (int64_t b = 0; b < hd / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(q + 32 * b), x1 = _mm512_loadu_ps(q + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f, inv_lo = 254.f * inv;
    const __m512 lim = _mm512_set1_ps(127.f);
    int32_t sh = 0, sl = 0;
    for (int h = 0; h < 2; ++h) {
      const __m512 x = h ? x1 : x0;
      const __m512 qh = _mm512_min_ps(lim, _mm512_max_ps(-lim, _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(inv)),
                                                                                    _MM_FROUND_TO_NEAREST_INT)));
      const __m512 r = _mm512_fnmadd_ps(qh, _mm512_set1_ps(sc), x);
      const __m512 ql = _mm512_min_ps(lim, _mm512_max_ps(-lim, _mm512_roundscale_ps(_mm512_mul_ps(r, _mm512_set1_ps(inv_lo)),
                                                                                    _MM_FROUND_TO_NEAREST_INT)));
      const __m512i ih = _mm512_cvtps_epi32(qh), il = _mm512_cvtps_epi32(ql);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 32 * b + 16 * h), _mm512_cvtepi32_epi8(ih));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 32 * b + 16 * h), _mm512_cvtepi32_epi8(il));
      sh += _mm512_reduce_add_epi32(ih);
      sl += _mm512_reduce_add_epi32(il);
    }
    const float sl_scale = sc / 254.f;
    const int32_t oh = -128 * sh, ol = -128 * sl;
    std::memcpy(fb + 16 * b, &sc, 4);
    std::memcpy(fb + 16 * b + 4, &sl_scale, 4);
    std::memcpy(fb + 16 * b + 8, &oh, 4);
    std::memcpy(fb + 16 * b + 12, &ol, 4);
  }
}

#define FBS_ATTN_DEFS(T)                                                                                           \
  FBS_A512 void head_avx512(const float* q, const T* K, const T* V, int64_t n, int64_t hd, float scale, float* p,   \
                            float* o, const Visible* vis) {                                                       \
    head_t(q, K, V, n, hd, scale, p, o, vis);                                                                     \
  }                                                                                                               \
  FBS_A512 void group_avx512(const float* const* q, const int64_t* last, int64_t nq, const T* K, const T* V,       \
                             int64_t k0, int64_t k1, int64_t hd, float* s, float* part, const int64_t* map,      \
                             int64_t km, const int8_t* const* qq, const Next* next) {                              \
    group_t(q, last, nq, K, V, k0, k1, hd, s, part, map, km, qq, next);                                           \
  }
FBS_KV_OVERLOADS(FBS_ATTN_DEFS)
#undef FBS_ATTN_DEFS
#undef FBS_A512
}  // namespace fbs_attn
#endif
