// One-query attention over the static KV cache (attention.h): the portable head, the K/V write, the threaded
// dispatch over (row, head), and the ATen entry. Each is a template over the cache's element type.
#include "attention.h"

#include <atomic>

#include <ATen/Parallel.h>

#include <type_traits>

#include "norm.h"
#include "quant.h"
#include "rowquant.h"

namespace fbs_attn {
void check_kv_type(at::ScalarType t, const char* who) {
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kChar, who,
              ": KV caches must be float32, float16, bfloat16 or int8 (kv_dtype fp32 / fp16 / bf16 / int8), got ", t);
}

int64_t entry_width(at::ScalarType kt, int64_t hd) {
  int64_t w = 0;
  with_kv_type(kt, "fbs attention kernel", [&](auto t) { w = Entry<decltype(t)>::width(hd); });
  return w;
}

const float* key_factors(const std::optional<at::Tensor>& kf, int64_t hkv, int64_t hd, const char* who) {
  if (!kf) return nullptr;
  TORCH_CHECK(kf->scalar_type() == at::kFloat && kf->device().is_cpu() && kf->is_contiguous() && kf->numel() == hkv * hd,
              who, ": key factors (Hkv, 1, hd) contiguous fp32 CPU");
  return kf->data_ptr<float>();
}

void divide_key(const float* k, const float* f, int64_t hd, float* out) {
  for (int64_t d = 0; d < hd; ++d) out[d] = k[d] / f[d];
}

void scale_queries(float* q, const float* KF, int64_t H, int64_t Hkv, int64_t hd) {
  const int64_t group = H / Hkv;
  for (int64_t h = 0; h < H; ++h) {
    const float* f = KF + (h / group) * hd;
    for (int64_t d = 0; d < hd; ++d) q[h * hd + d] *= f[d];
  }
}

float* acc_data(const at::Tensor& acc, const at::Tensor& kc, const char* who) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.device().is_cpu() && acc.is_contiguous() && acc.dim() == 3 &&
                  acc.size(0) == kc.size(0) && acc.size(1) == kc.size(1) && acc.size(2) == kc.size(2),
              who, ": accumulated attention (B, Hkv, C) contiguous fp32, the cache's shape");
  return acc.data_ptr<float>();
}

template <class T>
void head_scalar(const float* q, const T* K, const T* V, int64_t n, int64_t hd, float scale, float* p, float* o,
                 const Visible* vis) {
  const int64_t w = Entry<T>::width(hd);
  for (int64_t j = 0; j < n; ++j) {
    const T* k = K + j * w;
    float a = 0.f;
    for (int64_t d = 0; d < hd; ++d) a += q[d] * float(k[d]);
    p[j] = !vis || (*vis)(j) ? a * Entry<T>::scale(k, hd) * scale : -INFINITY;
  }
  float z;
  softmax_(p, n, &z);
  for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const T* v = V + j * w;
    const float pj = p[j] * Entry<T>::scale(v, hd);
    for (int64_t d = 0; d < hd; ++d) o[d] += pj * float(v[d]);
  }
  for (int64_t d = 0; d < hd; ++d) o[d] /= z;
}

namespace {
// n fp32 values as an entry of T (c10's conversions: round to nearest even, what a PyTorch cast computes; int8:
// the codes and their scale, Entry<int8_t>)
template <class T>
void store_t(const float* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<T, int8_t>) {
    const float s = fbs_rowquant::quantize_row(src, n, dst);
    std::memcpy(dst + n, &s, 4);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
  }
}

template <class T>
void write_kv_t(const float* K, int64_t ks0, int64_t ks1, const float* V, int64_t vs0, int64_t vs1, int64_t b,
                const int64_t* I, const int64_t* L, T* KC, T* VC, int64_t Hkv, int64_t C, int64_t hd, const float* KF) {
  const int64_t w = Entry<T>::width(hd), rs = Hkv * C * w, hs = C * w;  // cache row and head strides
  std::vector<float> kr(KF ? hd : 0);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t at_ = I[i] * rs + g * hs + L[i] * w;
      const float* k = K + i * ks0 + g * ks1;
      if (KF) {
        divide_key(k, KF + g * hd, hd, kr.data());
        k = kr.data();
      }
      store_t(k, hd, KC + at_);
      store_t(V + i * vs0 + g * vs1, hd, VC + at_);
    }
}
}  // namespace

void store(const float* src, int64_t n, void* dst, at::ScalarType kt) {
  with_kv_type(kt, "fbs attention kernel", [&](auto t) { store_t(src, n, static_cast<decltype(t)*>(dst)); });
}

void write_kv(const float* K, int64_t ks0, int64_t ks1, const float* V, int64_t vs0, int64_t vs1, int64_t b,
              const int64_t* I, const int64_t* L, void* KC, void* VC, at::ScalarType kt, int64_t Hkv, int64_t C,
              int64_t hd, const float* KF) {
  with_kv_type(kt, "fbs attention kernel", [&](auto t) {
    using T = decltype(t);
    write_kv_t(K, ks0, ks1, V, vs0, vs1, b, I, L, static_cast<T*>(KC), static_cast<T*>(VC), Hkv, C, hd, KF);
  });
}

namespace {
std::atomic<bool> g_int8_scores{true};
}  // namespace

bool int8_scores() {
  static const bool cpu = quant_isa() == fbs::kIsaAvx512Vnni;  // the quantized products' own check
  return cpu && g_int8_scores.load(std::memory_order_relaxed);
}

namespace {
#ifdef FBS_X86
// attend() for hd a multiple of 64 with AVX-512: queries grouped by the K/V they read (attention.h).
template <class T>
void attend_grouped(const float* Q, int64_t qs0, int64_t qs1, const int64_t* I, const int64_t* L, int64_t m,
                    int64_t H, const T* KC, const T* VC, int64_t Hkv, int64_t C, int64_t hd, float scale, float* O,
                    float* ACC, const Tree* TREE) {
  const int64_t ew = Entry<T>::width(hd), rs = Hkv * C * ew, hs = C * ew, group = H / Hkv;
  // the groups: per cache row (in order of first use) and KV head, its queries (row j, head h); under a token tree,
  // per row j and KV head (group u: row u / Hkv), each row (node) over its own virtual slots (attention.h): the keys
  // before the round (slots below its base), then the round's slots it sees, in order, listed in vmap from vstart[j]
  std::vector<int64_t> cache_rows;
  if (!TREE)
    for (int64_t j = 0; j < m; ++j)
      if (std::find(cache_rows.begin(), cache_rows.end(), I[j]) == cache_rows.end()) cache_rows.push_back(I[j]);
  const int64_t G = (TREE ? m : int64_t(cache_rows.size())) * Hkv;
  std::vector<int64_t> vmap, vstart(TREE ? m + 1 : 0, 0), vlast(TREE ? m : 0);
  if (TREE) {
    for (int64_t j = 0; j < m; ++j) {
      const Visible vis{TREE->bits[j], TREE->base[j]};
      for (int64_t k = TREE->base[j]; k <= L[j]; ++k)
        if (vis(k)) vmap.push_back(k);
      vstart[j + 1] = int64_t(vmap.size());
      vlast[j] = TREE->base[j] + (vstart[j + 1] - vstart[j]) - 1;  // the node's own key, at its chain's slot
    }
  }
  std::vector<int64_t> start(G + 1, 0), qj, qh, last(G, -1);
  for (int64_t u = 0; u < G; ++u) {
    const int64_t g = u % Hkv;
    for (int64_t j = 0; j < m; ++j) {
      if (TREE ? j != u / Hkv : I[j] != cache_rows[u / Hkv]) continue;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        qj.push_back(j);
        qh.push_back(h);
      }
      last[u] = std::max(last[u], TREE ? vlast[j] : L[j]);
    }
    start[u + 1] = int64_t(qj.size());
  }
  const int64_t nq = int64_t(qj.size()), ps = hd + 2;
  // the queries, scaled; over an int8 cache with VNNI also as codes for the integer scores (query_codes_vnni)
  std::vector<float> qsc(nq * hd);
  std::vector<int64_t> qlast(nq);
  for (int64_t i = 0; i < nq; ++i) {
    const float* src = Q + qj[i] * qs0 + qh[i] * qs1;
    for (int64_t d = 0; d < hd; ++d) qsc[i * hd + d] = src[d] * scale;
    qlast[i] = TREE ? vlast[qj[i]] : L[qj[i]];
  }
  std::vector<int8_t> codes;
  std::vector<const int8_t*> qcodes;
  if constexpr (std::is_same_v<T, int8_t>) {
    if (int8_scores()) {
      const int64_t qb = query_code_bytes(hd);
      codes.resize(nq * qb);
      qcodes.resize(nq);
      for (int64_t i = 0; i < nq; ++i) {
        query_codes_vnni(qsc.data() + i * hd, hd, codes.data() + i * qb);
        qcodes[i] = codes.data() + i * qb;
      }
    }
  }
  // key ranges per group at fixed offsets (kKeyRange keys each), not sized by the call: a query then sums the same
  // keys in the same order whichever other queries (positions, rows) share its call
  int64_t longest = 0;
  for (int64_t u = 0; u < G; ++u) longest = std::max(longest, last[u] + 1);
  const int64_t span = kKeyRange, splits = std::max<int64_t>(1, (longest + span - 1) / span);
  std::vector<float> part(splits * nq * ps);
  // with ACC: every range's softmax numerators kept (query i of range sp at ex + (sp * nq + i) * span, its range's
  // k1 - k0 values), then scaled by the merged softmax and added to ACC: the weights come from this pass
  std::vector<float> ex(ACC ? splits * nq * span : 0);
  at::parallel_for(0, G * splits, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch;
    std::vector<const float*> qp;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t u = t / splits, sp = t % splits, n = start[u + 1] - start[u];
      const int64_t k0 = sp * span, k1 = std::min(last[u] + 1, k0 + span);
      float* pt = part.data() + (sp * nq + start[u]) * ps;
      if (k1 <= k0) {  // no key of this range is seen by the group
        for (int64_t i = 0; i < n; ++i) {
          pt[i * ps] = -INFINITY;
          std::fill_n(pt + i * ps + 1, hd + 1, 0.f);
        }
        continue;
      }
      float* s = nullptr;
      if (ACC) {
        s = ex.data() + (sp * nq + start[u]) * span;
      } else {
        scratch.resize(n * (k1 - k0));
        s = scratch.data();
      }
      qp.resize(n);
      for (int64_t i = 0; i < n; ++i) qp[i] = qsc.data() + (start[u] + i) * hd;
      const int64_t node = u / Hkv, row = TREE ? I[node] : cache_rows[node], kv = row * rs + (u % Hkv) * hs;
      Next next{nullptr, nullptr, 0};  // this thread's next range (its keys' slots in order: not a tree's)
      if (!TREE && t + 1 < t1) {
        const int64_t nu = (t + 1) / splits, n0 = ((t + 1) % splits) * span;
        const int64_t n1 = std::min(last[nu] + 1, n0 + span);
        const int64_t nkv = cache_rows[nu / Hkv] * rs + (nu % Hkv) * hs + n0 * ew;
        if (n1 > n0)
          next = {reinterpret_cast<const char*>(KC + nkv), reinterpret_cast<const char*>(VC + nkv),
                  int64_t((n1 - n0) * ew * sizeof(T))};
      }
      group_avx512(qp.data(), qlast.data() + start[u], n, KC + kv, VC + kv, k0, k1, hd, s, pt,
                   TREE ? vmap.data() + vstart[node] : nullptr, TREE ? TREE->base[node] : 0,
                   qcodes.empty() ? nullptr : qcodes.data() + start[u], next.k ? &next : nullptr);
    }
  });
  // merge the ranges: o = sum_s acc_s e^(m_s - M) / sum_s z_s e^(m_s - M), M = max_s m_s
  std::vector<float> qm(ACC ? nq : 0), qz(ACC ? nq : 0);  // per query: M and the merged sum z
  for (int64_t i = 0; i < nq; ++i) {
    float M = -INFINITY;
    for (int64_t sp = 0; sp < splits; ++sp) M = std::max(M, part[(sp * nq + i) * ps]);
    float* o = O + qj[i] * H * hd + qh[i] * hd;
    std::fill_n(o, hd, 0.f);
    float z = 0.f;
    for (int64_t sp = 0; sp < splits; ++sp) {
      const float* pt = part.data() + (sp * nq + i) * ps;
      if (pt[1] == 0.f) continue;
      const float w = splits == 1 ? 1.f : std::exp(pt[0] - M);
      z += w * pt[1];
      for (int64_t d = 0; d < hd; ++d) o[d] += w * pt[2 + d];
    }
    const float iz = 1.f / z;
    for (int64_t d = 0; d < hd; ++d) o[d] *= iz;
    if (ACC) {
      qm[i] = M;
      qz[i] = z;
    }
  }
  if (!ACC) return;
  // ACC[row, g, k] += the weight each query of the group gave key k: e^(s - m_s) e^(m_s - M) / z, one task per
  // group (its ACC row), its queries in order
  at::parallel_for(0, G, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      float* acc = ACC + (cache_rows[u / Hkv] * Hkv + u % Hkv) * C;
      for (int64_t i = start[u]; i < start[u + 1]; ++i)
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t k0 = sp * span, kn = std::min(qlast[i] + 1, k0 + span) - k0;
          const float* pt = part.data() + (sp * nq + i) * ps;
          if (kn <= 0 || pt[1] == 0.f) continue;
          const float w = std::exp(pt[0] - qm[i]) / qz[i];
          // the range's values of query i: stride k1 - k0 of its group's call
          const int64_t gk = std::min(last[u] + 1, k0 + span) - k0;
          const float* e = ex.data() + (sp * nq + start[u]) * span + (i - start[u]) * gk;
          for (int64_t k = 0; k < kn; ++k) acc[k0 + k] += e[k] * w;
        }
    }
  });
}
#endif

template <class T>
void attend_t(const float* Q, int64_t qs0, int64_t qs1, const int64_t* I, const int64_t* L, int64_t m, int64_t H,
              const T* KC, const T* VC, int64_t Hkv, int64_t C, int64_t hd, float scale, int64_t isa, float* O,
              float* ACC, const Tree* TREE) {
  TORCH_CHECK(!(TREE && ACC), "fbs attention kernel: a token tree's pass keeps no accumulated attention");
  auto head = head_scalar<T>;
#ifdef FBS_X86
  if (isa == fbs::kIsaAvx512 && hd % 64 == 0 && hd <= kMaxHd) {
    attend_grouped(Q, qs0, qs1, I, L, m, H, KC, VC, Hkv, C, hd, scale, O, ACC, TREE);
    return;
  }
  if (isa == fbs::kIsaAvx512 && hd % 16 == 0 && hd <= kMaxHd)
    head = static_cast<void (*)(const float*, const T*, const T*, int64_t, int64_t, float, float*, float*,
                                const Visible*)>(head_avx512);
  else if (isa >= fbs::kIsaAvx2 && hd % 8 == 0 && hd <= kMaxHd)
    head = static_cast<void (*)(const float*, const T*, const T*, int64_t, int64_t, float, float*, float*,
                                const Visible*)>(head_avx2);
#endif
  const int64_t ew = Entry<T>::width(hd), rs = Hkv * C * ew, hs = C * ew, group = H / Hkv;
  if (!ACC) {
    at::parallel_for(0, m * H, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> p(C);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t j = t / H, h = t % H;
        const int64_t kv = I[j] * rs + (h / group) * hs;
        const Visible vis = TREE ? Visible{TREE->bits[j], TREE->base[j]} : Visible{0, 0};
        head(Q + j * qs0 + h * qs1, KC + kv, VC + kv, L[j] + 1, hd, scale, p.data(), O + j * H * hd + h * hd,
             TREE ? &vis : nullptr);
      }
    });
    return;
  }
  // with ACC: one task per (cache row, KV head), which owns that ACC row; each head's softmax numerators (left in
  // p by the head kernel) divided by their sum are its weights
  std::vector<int64_t> cache_rows;
  for (int64_t j = 0; j < m; ++j)
    if (std::find(cache_rows.begin(), cache_rows.end(), I[j]) == cache_rows.end()) cache_rows.push_back(I[j]);
  at::parallel_for(0, int64_t(cache_rows.size()) * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(C);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = cache_rows[t / Hkv], g = t % Hkv, kv = r * rs + g * hs;
      float* acc = ACC + (r * Hkv + g) * C;
      for (int64_t j = 0; j < m; ++j) {
        if (I[j] != r) continue;
        const int64_t n = L[j] + 1;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          head(Q + j * qs0 + h * qs1, KC + kv, VC + kv, n, hd, scale, p.data(), O + j * H * hd + h * hd, nullptr);
          float z = 0.f;
          for (int64_t k = 0; k < n; ++k) z += p[k];
          const float iz = 1.f / z;
          for (int64_t k = 0; k < n; ++k) acc[k] += p[k] * iz;
        }
      }
    }
  });
}
}  // namespace

void attend(const float* Q, int64_t qs0, int64_t qs1, const int64_t* I, const int64_t* L, int64_t m, int64_t H,
            const void* KC, const void* VC, at::ScalarType kt, int64_t Hkv, int64_t C, int64_t hd, float scale,
            int64_t isa, float* O, float* ACC, const Tree* TREE) {
  with_kv_type(kt, "fbs attention kernel", [&](auto t) {
    using T = decltype(t);
    attend_t(Q, qs0, qs1, I, L, m, H, static_cast<const T*>(KC), static_cast<const T*>(VC), Hkv, C, hd, scale, isa, O,
             ACC, TREE);
  });
}
}  // namespace fbs_attn

bool attention_int8_scores(std::optional<bool> on) {
  if (on) fbs_attn::g_int8_scores.store(*on);
  return fbs_attn::int8_scores();
}

at::Tensor attend_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                      const at::Tensor& vc, const at::Tensor& idx, const at::Tensor& slots, double scale, int64_t isa,
                      const std::optional<at::Tensor>& acc, const std::optional<at::Tensor>& kf) {
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(-1) == 1 && t->device().is_cpu(),
                "fbs attention kernel: q, k, v 4-d fp32 CPU tensors with a unit last stride");
  fbs_attn::check_kv_type(kc.scalar_type(), "fbs attention kernel");
  TORCH_CHECK(kc.dim() == 4 && kc.device().is_cpu() && kc.is_contiguous() && vc.is_contiguous() &&
                  kc.sizes() == vc.sizes() && kc.scalar_type() == vc.scalar_type(),
              "fbs attention kernel: caches (B, Hkv, C, W) contiguous CPU tensors of one shape and dtype");
  TORCH_CHECK(idx.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "fbs attention kernel: int64 rows");
  const int64_t b = q.size(0), H = q.size(1), hd = q.size(3), Hkv = kc.size(1), C = kc.size(2);
  TORCH_CHECK(H % Hkv == 0 && k.size(1) == Hkv && kc.size(3) == fbs_attn::entry_width(kc.scalar_type(), hd),
              "fbs attention kernel: head shapes (a cache entry is hd values; int8: hd codes and a 4-byte scale)");
  const int64_t* I = idx.data_ptr<int64_t>();
  const int64_t* L = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(I[i] >= 0 && I[i] < kc.size(0) && L[i] >= 0 && L[i] < C, "fbs attention kernel: slot out of range");
  const float* KF = fbs_attn::key_factors(kf, Hkv, hd, "fbs attention kernel");
  fbs_attn::write_kv(k.data_ptr<float>(), k.stride(0), k.stride(1), v.data_ptr<float>(), v.stride(0), v.stride(1), b, I,
                     L, kc.data_ptr(), vc.data_ptr(), kc.scalar_type(), Hkv, C, hd, KF);
  float* ACC = acc ? fbs_attn::acc_data(*acc, kc, "fbs attention kernel") : nullptr;
  auto out = at::empty({b, 1, H * hd}, q.options());
  const float* Q = q.data_ptr<float>();
  int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  std::vector<float> qk;  // with key factors: the queries multiplied by them, (b, H * hd)
  if (KF) {
    qk.resize(b * H * hd);
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t h = 0; h < H; ++h) std::copy_n(Q + i * qs0 + h * qs1, hd, qk.data() + (i * H + h) * hd);
      fbs_attn::scale_queries(qk.data() + i * H * hd, KF, H, Hkv, hd);
    }
    Q = qk.data();
    qs0 = H * hd;
    qs1 = hd;
  }
  fbs_attn::attend(Q, qs0, qs1, I, L, b, H, kc.data_ptr(), vc.data_ptr(), kc.scalar_type(), Hkv, C, hd, float(scale),
                   isa, out.data_ptr<float>(), ACC);
  return out;
}
