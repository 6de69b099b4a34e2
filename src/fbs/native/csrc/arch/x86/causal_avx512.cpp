// The query blocks of the causal prompt attention (causal.h) with AVX-512: scores of 4 queries x 64 keys in 16
// registers (each transposed key row loaded once for the 4 queries), the weighted values of 4 queries x 64 dims in 16.
#include "../../causal.h"

#include "avx512.h"

namespace fbs_causal {
#define FBS_A512 __attribute__((target("avx512f,fma")))
using fbs_x86::exp16;

namespace {
// S[r][c] (r < NQ queries, c < 4 vectors of 16 keys) = q_r . Kt[:, j0 + 16c ..]
template <int NQ>
FBS_A512 inline void scores(const float* const* q, const float* Kt, int64_t Tp, int64_t j0, int64_t hd, __m512 (*S)[4]) {
  for (int r = 0; r < NQ; ++r)
    for (int c = 0; c < 4; ++c) S[r][c] = _mm512_setzero_ps();
  const float* kt = Kt + j0;
  for (int64_t d = 0; d < hd; ++d, kt += Tp) {
    const __m512 k0 = _mm512_loadu_ps(kt), k1 = _mm512_loadu_ps(kt + 16), k2 = _mm512_loadu_ps(kt + 32),
                 k3 = _mm512_loadu_ps(kt + 48);
    for (int r = 0; r < NQ; ++r) {
      const __m512 qd = _mm512_set1_ps(q[r][d]);
      S[r][0] = _mm512_fmadd_ps(qd, k0, S[r][0]);
      S[r][1] = _mm512_fmadd_ps(qd, k1, S[r][1]);
      S[r][2] = _mm512_fmadd_ps(qd, k2, S[r][2]);
      S[r][3] = _mm512_fmadd_ps(qd, k3, S[r][3]);
    }
  }
}

// O[r][dims c0 .. c0 + 63] = O * alpha[r] + sum_j P[r][j] V[j0 + j][c0 ..], j < n
template <int NQ, int nc>
FBS_A512 inline void values(float* const* o, const float* const* p, const float* alpha, const float* V, int64_t ldv,
                            int64_t j0, int64_t n, int64_t c0) {
  __m512 acc[NQ][4];
  for (int r = 0; r < NQ; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < nc; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o[r] + c0 + 16 * c), a);
  }
  const float* v = V + j0 * ldv + c0;
  for (int64_t j = 0; j < n; ++j, v += ldv) {
    __m512 vv[4];
    for (int c = 0; c < nc; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int r = 0; r < NQ; ++r) {
      const __m512 w = _mm512_set1_ps(p[r][j]);
      for (int c = 0; c < nc; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NQ; ++r)
    for (int c = 0; c < nc; ++c) _mm512_storeu_ps(o[r] + c0 + 16 * c, acc[r][c]);
}

// NQ query rows (positions pos[r]) over keys j0 .. j0 + 63 (those above a row's position, or at T and beyond,
// masked): the online-softmax update of m, l, and o (hd floats each row).
template <int NQ>
FBS_A512 void step(const float* const* q, const int64_t* pos, const float* Kt, int64_t Tp, int64_t kend, const float* V,
                   int64_t ldv, int64_t j0, int64_t hd, float* m, float* l, float* const* o, float* pbuf) {
  __m512 S[NQ][4];
  scores<NQ>(q, Kt, Tp, j0, hd, S);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float alpha[NQ];
  const float* p[NQ];
  const int64_t n = std::min(kKeys, kend - j0);  // value rows read: none at or past kend (no query sees them)
  for (int r = 0; r < NQ; ++r) {
    const int64_t last = pos[r] - j0;  // keys j0 .. j0 + last are seen
    for (int c = 0; c < 4; ++c) {
      const __mmask16 keep = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * c)),
                                                     _mm512_set1_epi32(int32_t(last)));
      S[r][c] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), S[r][c]);
    }
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(S[r][0], S[r][1]), _mm512_max_ps(S[r][2], S[r][3])));
    const float mn = std::max(m[r], mx);  // a row sees key j0 at least (j0 <= its position): mn is finite
    alpha[r] = std::exp(m[r] - mn);
    m[r] = mn;
    const __m512 sh = _mm512_set1_ps(mn);
    __m512 sum = _mm512_setzero_ps();
    float* pr = pbuf + r * kKeys;
    for (int c = 0; c < 4; ++c) {
      const __m512 e = exp16(_mm512_sub_ps(S[r][c], sh));
      const __m512 z = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(S[r][c], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
      sum = _mm512_add_ps(sum, z);
      _mm512_storeu_ps(pr + 16 * c, z);
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    p[r] = pr;
  }
  for (int64_t c0 = 0; c0 < hd; c0 += 64) {  // 64 dims (4 registers) a pass, the last pass what is left
    switch (std::min<int64_t>(4, (hd - c0) / 16)) {
      case 4: values<NQ, 4>(o, p, alpha, V, ldv, j0, n, c0); break;
      case 3: values<NQ, 3>(o, p, alpha, V, ldv, j0, n, c0); break;
      case 2: values<NQ, 2>(o, p, alpha, V, ldv, j0, n, c0); break;
      default: values<NQ, 1>(o, p, alpha, V, ldv, j0, n, c0); break;
    }
  }
}
}  // namespace

FBS_A512 void block_avx512(const float* Q, int64_t G, int64_t p0, int64_t p1, const float* Kt, int64_t Tp, const float* V,
                  int64_t ldv, int64_t hd, float* O, int64_t ldp) {
  const int64_t nq = (p1 - p0) * G;
  std::vector<float> m(nq, -INFINITY), l(nq, 0.f), pbuf(4 * kKeys);
  std::vector<int64_t> pos(nq);
  std::vector<float*> out(nq);
  for (int64_t i = 0; i < nq; ++i) {
    pos[i] = p0 + i / G;
    out[i] = O + (i / G) * ldp + (i % G) * hd;
    std::fill_n(out[i], hd, 0.f);
  }
  for (int64_t j0 = 0; j0 < p1; j0 += kKeys) {
    for (int64_t r = 0; r < nq; r += 4) {
      const int nr = int(std::min<int64_t>(4, nq - r));
      const float* q[4];
      for (int i = 0; i < nr; ++i) q[i] = Q + (r + i) * hd;
      float* const* o = out.data() + r;
      switch (nr) {
        case 4: step<4>(q, pos.data() + r, Kt, Tp, p1, V, ldv, j0, hd, m.data() + r, l.data() + r, o, pbuf.data()); break;
        case 3: step<3>(q, pos.data() + r, Kt, Tp, p1, V, ldv, j0, hd, m.data() + r, l.data() + r, o, pbuf.data()); break;
        case 2: step<2>(q, pos.data() + r, Kt, Tp, p1, V, ldv, j0, hd, m.data() + r, l.data() + r, o, pbuf.data()); break;
        default: step<1>(q, pos.data() + r, Kt, Tp, p1, V, ldv, j0, hd, m.data() + r, l.data() + r, o, pbuf.data()); break;
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const __m512 iz = _mm512_set1_ps(1.f / l[i]);
    for (int64_t c = 0; c < hd; c += 16) _mm512_storeu_ps(out[i] + c, _mm512_mul_ps(_mm512_loadu_ps(out[i] + c), iz));
  }
}
}  // namespace fbs_causal
