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

// acc[i] += sum_j p[i][j] V[k0 + j] over keys j = 0 .. n - 1 (virtual slots, slot_of; V entries of hd values, columns
// c0 .. c0 + 63) for QC queries
template <int QC, class T>
FBS_A512 void pv(const float* const* p, const T* V, int64_t k0, const int64_t* map, int64_t km, int64_t n, int64_t hd,
                 int64_t c0, float* const* acc) {
  const int64_t ew = Entry<T>::width(hd);
  __m512 a[QC][4];
  for (int i = 0; i < QC; ++i)
    for (int c = 0; c < 4; ++c) a[i][c] = _mm512_loadu_ps(acc[i] + c0 + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* row = V + slot_of(k0 + j, map, km) * ew;
    const T* v = row + c0;
    const float vs = Entry<T>::scale(row, hd);
    const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
    for (int i = 0; i < QC; ++i) {
      const __m512 w = _mm512_set1_ps(p[i][j] * vs);
      a[i][0] = _mm512_fmadd_ps(w, v0, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(w, v1, a[i][1]);
      a[i][2] = _mm512_fmadd_ps(w, v2, a[i][2]);
      a[i][3] = _mm512_fmadd_ps(w, v3, a[i][3]);
    }
  }
  for (int i = 0; i < QC; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc[i] + c0 + 16 * c, a[i][c]);
}
template <class T>
FBS_A512 void group_t(const float* const* q, const int64_t* last, int64_t nq, const T* K, const T* V, int64_t k0,
                           int64_t k1, int64_t hd, float* s, float* part, const int64_t* map, int64_t km) {
  const int64_t kn = k1 - k0, nc = hd / 16, ps = hd + 2, ew = Entry<T>::width(hd);
  // scores s[i][j - k0] = q_i . K_j, 16 keys at a time; a block's last keys past k1 repeat key k1 - 1 (not stored)
  for (int64_t jb = k0; jb < k1; jb += 16) {
    const int64_t nb = std::min<int64_t>(16, k1 - jb);
    const T* kr[16];
    for (int t = 0; t < 16; ++t) kr[t] = K + slot_of(std::min(jb + t, k1 - 1), map, km) * ew;
    const __mmask16 mask = nb == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nb) - 1);
    __m512 ks = _mm512_set1_ps(1.f);  // the 16 keys' scales (int8 entries)
    if constexpr (Entry<T>::extra > 0) {
      float sc[16];
      for (int t = 0; t < 16; ++t) sc[t] = Entry<T>::scale(kr[t], hd);
      ks = _mm512_loadu_ps(sc);
    }
    for (int64_t i = 0; i < nq; ++i) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
      for (int64_t c = 0; c < nc; ++c) {
        const __m512 qc = _mm512_loadu_ps(q[i] + 16 * c);
        for (int t = 0; t < 16; ++t) a[t] = _mm512_fmadd_ps(qc, load16(kr[t] + 16 * c), a[t]);
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
  // acc_i = sum_j p_ij V_j: each value row loaded once per chunk of up to 6 queries and 64 columns
  for (int64_t i0 = 0; i0 < nq; i0 += 6) {
    const int64_t qc = std::min<int64_t>(6, nq - i0);
    const float* pp[6];
    float* aa[6];
    for (int64_t i = 0; i < qc; ++i) {
      pp[i] = s + (i0 + i) * kn;
      aa[i] = part + (i0 + i) * ps + 2;
    }
    for (int64_t c0 = 0; c0 < hd; c0 += 64) {
      switch (qc) {
        case 1: pv<1>(pp, V, k0, map, km, kn, hd, c0, aa); break;
        case 2: pv<2>(pp, V, k0, map, km, kn, hd, c0, aa); break;
        case 3: pv<3>(pp, V, k0, map, km, kn, hd, c0, aa); break;
        case 4: pv<4>(pp, V, k0, map, km, kn, hd, c0, aa); break;
        case 5: pv<5>(pp, V, k0, map, km, kn, hd, c0, aa); break;
        default: pv<6>(pp, V, k0, map, km, kn, hd, c0, aa); break;
      }
    }
  }
}

}  // namespace

#define FBS_ATTN_DEFS(T)                                                                                           \
  FBS_A512 void head_avx512(const float* q, const T* K, const T* V, int64_t n, int64_t hd, float scale, float* p,   \
                            float* o, const Visible* vis) {                                                       \
    head_t(q, K, V, n, hd, scale, p, o, vis);                                                                     \
  }                                                                                                               \
  FBS_A512 void group_avx512(const float* const* q, const int64_t* last, int64_t nq, const T* K, const T* V,       \
                             int64_t k0, int64_t k1, int64_t hd, float* s, float* part, const int64_t* map,      \
                             int64_t km) {                                                                         \
    group_t(q, last, nq, K, V, k0, k1, hd, s, part, map, km);                                                     \
  }
FBS_KV_OVERLOADS(FBS_ATTN_DEFS)
#undef FBS_ATTN_DEFS
#undef FBS_A512
}  // namespace fbs_attn
#endif
