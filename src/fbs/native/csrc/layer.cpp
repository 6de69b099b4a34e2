// The native decoder layer (layer.h): weights, the per-row pieces, one layer step, runs of layers, the halves.
#include "layer.h"

#include "act.h"
#include "attention.h"
#include "gate.h"
#include "norm.h"
#include "quant.h"
#include "skip.h"

#include <ATen/Parallel.h>

namespace fbs_layer {
namespace {
const float* fp32(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu() && t.numel() == n,
              "fbs native layer: ", what, " must be a contiguous fp32 CPU tensor of ", n, " elements");
  return t.data_ptr<float>();
}

// x (hd) rotated in place: x * cos + roll(x, hd / 2) * sin_signed (fbs.engine.fused._rope)
void rope(float* x, const float* c, const float* s, int64_t hd) {
  float t[256];
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < hd; ++j) t[j] = x[j] * c[j] + x[j < half ? j + half : j - half] * s[j];
  std::copy_n(t, hd, x);
}
}  // namespace

Layer::Layer(int64_t d_, int64_t heads_, int64_t nkv_, int64_t hd_, int64_t inter_, double eps_, double scale_,
             at::Tensor ln1_, const Packed& kvg_, std::optional<at::Tensor> kvg_b_, const Packed& q_,
             std::optional<at::Tensor> q_b_, const Packed& o_, at::Tensor ln2_, const Packed& gu_, const Packed& dn_)
    : d(d_),
      heads(heads_),
      nkv(nkv_),
      hd(hd_),
      inter(inter_),
      eps(float(eps_)),
      scale(float(scale_)),
      ln1(ln1_),
      ln2(ln2_),
      kvg(kvg_),
      q(q_),
      o(o_),
      gu(gu_),
      dn(dn_) {
  TORCH_CHECK(hd <= 256 && hd % 2 == 0 && heads % nkv == 0, "fbs native layer: head shapes");
  fp32(ln1, d, "ln1");
  fp32(ln2, d, "ln2");
  TORCH_CHECK(kvg.k == d && q.k == d && o.k == heads * hd && gu.k == d && dn.k == inter && kvg.n >= 2 * nkv * hd &&
                  q.n == heads * hd && o.n == d && gu.n == 2 * inter && dn.n == d,
              "fbs native layer: weight shapes do not match the layer");
  if (kvg_b_) {
    kvg_b = *kvg_b_;
    fp32(kvg_b, kvg.n, "the K/V bias");
  }
  if (q_b_) {
    q_b = *q_b_;
    fp32(q_b, q.n, "the Q bias");
  }
}

void Layer::set_gate(int64_t index, int64_t off, int64_t width, std::optional<at::Tensor> w_rel_,
                     std::optional<at::Tensor> w_prev_, std::optional<at::Tensor> rel_first_, at::Tensor out_w_,
                     double out_b_, double g_eps_) {
  G = out_w_.numel();
  fp32(out_w_, G, "the gate's output weight");
  TORCH_CHECK(width == 0 || (width == G && off + width <= kvg.n), "fbs native layer: gate columns");
  gated = true;
  g_index = index;
  g_off = off;
  g_w = width;
  out_w = out_w_;
  out_b = float(out_b_);
  g_eps = float(g_eps_);
  if (w_rel_) {
    w_rel = *w_rel_;
    fp32(w_rel, G, "w_rel");
  }
  if (w_prev_) {
    w_prev = *w_prev_;
    fp32(w_prev, G, "w_prev");
  }
  if (rel_first_) {
    rel_first = *rel_first_;
    fp32(rel_first, G, "rel_first");
  }
}

void Layer::set_paw(const at::Tensor& w_window, const at::Tensor& b_window, int64_t fixed_k, int64_t k_max,
                    const at::Tensor& w_query, const at::Tensor& mix, const at::Tensor& bias, const at::Tensor& keys_t,
                    const at::Tensor& other, double head_scale, int64_t top_k, const at::Tensor& emb,
                    const at::Tensor& conv_w, const at::Tensor& conv_b, const at::Tensor& w_down,
                    const at::Tensor& w_up, std::optional<at::Tensor> term_w_, std::optional<at::Tensor> term_b_) {
  auto w = std::make_shared<fbs_paw::Weights>(fbs_paw::make(w_window, b_window, fixed_k, k_max, w_query, mix, bias,
                                                            keys_t, other, head_scale, top_k, emb, conv_w, conv_b,
                                                            w_down, w_up));
  TORCH_CHECK(w->d == d, "fbs native layer: PAW's width ", w->d, " is not the layer's ", d);
  TORCH_CHECK(term_w_.has_value() == term_b_.has_value(), "fbs native layer: term_w and term_b together");
  if (term_w_) {
    TORCH_CHECK(term_w_->dim() == 2 && term_w_->size(1) == w->R, "fbs native layer: the gates' term_w (T, R)");
    term_w = *term_w_;
    fp32(term_w, term_w.numel(), "term_w");
    term_b = *term_b_;
    fp32(term_b, term_w.size(0), "term_b");
  }
  paw = w;
}

void Layer::set_chunk(const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key,
                      const at::Tensor& w_query, const at::Tensor& w_out, double scale, int64_t label_i) {
  auto w = std::make_shared<fbs_chunk::Weights>(fbs_chunk::make(w_bios, b_bios, w_key, w_query, w_out, scale,
                                                                label_i));
  TORCH_CHECK(w->d == d, "fbs native layer: CH's width ", w->d, " is not the layer's ", d);
  ch = w;
}

void Layer::mm(const float* X, int64_t M, const Packed& w, float* Y, int64_t isa) const { w.mm(X, M, Y, isa); }

// H (m, d) += z (PAW), then += c (CH), of the running rows sel, as layer_step adds them (h + z, then + c)
void Layer::extras(const Step& st, const float* XN, const std::vector<int64_t>& sel, float* H,
                   const Extras& ex) const {
  const int64_t m = sel.size();
  std::vector<float> xs(m * d), add(m * d);
  for (int64_t j = 0; j < m; ++j) std::copy_n(XN + sel[j] * d, d, xs.data() + j * d);
  if (paw) {
    TORCH_CHECK(ex.zlow != nullptr, "fbs native layer: a PAW layer needs the step's zlow");
    const int64_t R = paw->R;
    std::vector<float> zl(m * R), ks(m);
    std::vector<int64_t> kh(m);
    fbs_paw::rows(*paw, xs.data(), m, add.data(), zl.data(), ks.data(), kh.data(), nullptr);
    for (int64_t j = 0; j < m; ++j) {
      for (int64_t c = 0; c < d; ++c) H[j * d + c] += add[j * d + c];
      std::copy_n(zl.data() + j * R, R, ex.zlow + sel[j] * R);
      if (ex.k) ex.k[sel[j]] = kh[j];
    }
  }
  if (ch) {
    TORCH_CHECK(ex.chunk != nullptr, "fbs native layer: a CH layer needs its chunk state");
    std::vector<int64_t> rw(m);
    for (int64_t j = 0; j < m; ++j) rw[j] = st.idx[sel[j]];
    std::vector<float> lg(m * ch->nl);
    std::unique_ptr<bool[]> start(new bool[m]);
    if (ex.trail) {  // token by token, the state after each one copied out (a verifier rolls back to one of them)
      const fbs_chunk::State& s = *ex.chunk;
      const fbs_chunk::State& t = *ex.trail;
      const int64_t R = ch->R, C = s.C;
      for (int64_t j = 0; j < m; ++j) {
        fbs_chunk::rows(*ch, s, xs.data() + j * d, rw.data() + j, 1, true, add.data() + j * d, lg.data() + j * ch->nl,
                        start.get() + j);
        const int64_t r = rw[j], i = sel[j];
        std::copy_n(s.closed + r * C * R, C * R, t.closed + i * C * R);
        t.n_closed[i] = s.n_closed[r];
        std::copy_n(s.open_sum + r * R, R, t.open_sum + i * R);
        t.open_count[i] = s.open_count[r];
      }
    } else {
      fbs_chunk::rows(*ch, *ex.chunk, xs.data(), rw.data(), m, true, add.data(), lg.data(), start.get());
    }
    for (int64_t j = 0; j < m; ++j) {
      for (int64_t c = 0; c < d; ++c) H[j * d + c] += add[j * d + c];
      if (ex.bound) ex.bound[sel[j]] = start[j];
    }
  }
}

// K (rotated) and V of the rows flagged in write, at their slots; Y: the K/V(+gate) product (b, kvg.n). The
// rotation is computed in fp32; a half-precision cache stores its result rounded, an int8 one quantized
// (fbs_attn::store).
void Layer::write_kv(const Step& st, const float* Y, const bool* write, at::Tensor& kc, at::Tensor& vc,
                     const int64_t* SL, const float* KF) const {
  const at::ScalarType kt = kc.scalar_type();
  const int64_t ew = fbs_attn::entry_width(kt, hd);  // a slot's elements (attention.h, Entry)
  const int64_t nk = kvg.n, w = nkv * hd, C = kc.size(2), rs = nkv * C * ew, hs = C * ew;
  const int64_t es = kc.element_size();
  char* KC = static_cast<char*>(kc.data_ptr());
  char* VC = static_cast<char*>(vc.data_ptr());
  float kr[256];
  for (int64_t i = 0; i < st.b; ++i) {
    if (!write[i]) continue;
    for (int64_t g = 0; g < nkv; ++g) {
      const int64_t at_ = (st.idx[i] * rs + g * hs + SL[i] * ew) * es;
      std::copy_n(Y + i * nk + g * hd, hd, kr);
      rope(kr, st.cos + i * hd, st.sin + i * hd, hd);
      if (KF) fbs_attn::divide_key(kr, KF + g * hd, hd, kr);
      fbs_attn::store(kr, hd, KC + at_, kt);
      fbs_attn::store(Y + i * nk + w + g * hd, hd, VC + at_, kt);
    }
  }
}

// H (m, d) = X[sel] + O(attention(RoPE(Q XN[sel]))) over each row's cache prefix (its K/V already written)
void Layer::attention_rows(const Step& st, const float* X, const float* XN, const std::vector<int64_t>& sel,
                           const at::Tensor& kc, const at::Tensor& vc, const int64_t* SL, float* H, float* acc,
                           const fbs_attn::Tree* tree, const float* KF) const {
  const int64_t m = sel.size(), qw = heads * hd, C = kc.size(2);
  std::vector<float> xs(m * d), qv(m * qw), att(m * qw);
  for (int64_t j = 0; j < m; ++j) std::copy_n(XN + sel[j] * d, d, xs.data() + j * d);
  mm(xs.data(), m, q, qv.data(), st.isa);
  const float* QB = q_b.defined() ? q_b.data_ptr<float>() : nullptr;
  for (int64_t j = 0; j < m; ++j) {
    float* qj = qv.data() + j * qw;
    if (QB)
      for (int64_t c = 0; c < qw; ++c) qj[c] += QB[c];
    for (int64_t hh = 0; hh < heads; ++hh) rope(qj + hh * hd, st.cos + sel[j] * hd, st.sin + sel[j] * hd, hd);
    if (KF) fbs_attn::scale_queries(qj, KF, heads, nkv, hd);
  }
  std::vector<int64_t> rows(m), lens(m), tbase(tree ? m : 0);  // each query's cache row and last slot (and tree)
  std::vector<uint64_t> tbits(tree ? m : 0);
  for (int64_t j = 0; j < m; ++j) {
    rows[j] = st.idx[sel[j]];
    lens[j] = SL[sel[j]];
    if (tree) {
      tbits[j] = tree->bits[sel[j]];
      tbase[j] = tree->base[sel[j]];
    }
  }
  const fbs_attn::Tree sel_tree{tbits.data(), tbase.data()};
  fbs_attn::attend(qv.data(), qw, hd, rows.data(), lens.data(), m, heads, kc.data_ptr(), vc.data_ptr(),
                   kc.scalar_type(), nkv, C, hd, scale, st.isa, att.data(), acc, tree ? &sel_tree : nullptr);
  mm(att.data(), m, o, H, st.isa);
  for (int64_t j = 0; j < m; ++j) {
    const float* xi = X + sel[j] * d;
    float* hj = H + j * d;
    for (int64_t c = 0; c < d; ++c) hj[c] += xi[c];
  }
}

// H (m, d) += down(silu(gate(hn)) * up(hn)), hn = RMSNorm_2(H), in place
void Layer::ffn_rows(float* H, int64_t m, int64_t isa) const {
  std::vector<float> hn(m * d), ff(m * 2 * inter), act(m * inter), dv(m * d);
  // row-wise steps over row ranges: split across threads for a prompt's rows, each row's values unchanged
  const int64_t grain = m >= fbs_quant::kManyMin ? 8 : m;
  at::parallel_for(0, m, grain, [&](int64_t j0, int64_t j1) {
    fbs_norm::rows(H + j0 * d, ln2.data_ptr<float>(), eps, hn.data() + j0 * d, j1 - j0, d);
  });
  mm(hn.data(), m, gu, ff.data(), isa);
  at::parallel_for(0, m, grain, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float* gj = ff.data() + j * 2 * inter;
      fbs_act::silu_mul(gj, gj + inter, act.data() + j * inter, inter);
    }
  });
  mm(act.data(), m, dn, dv.data(), isa);
  at::parallel_for(0, m, grain, [&](int64_t j0, int64_t j1) {
    for (int64_t c = j0 * d; c < j1 * d; ++c) H[c] += dv[c];
  });
}

// Each row's cache slot. Rows of a step that share a cache row are consecutive positions of one sequence (a
// multi-token step): they take consecutive slots from the first one's given slot, counting only the rows that write
// (under hole a skipped position writes nothing), so that each attends over its own prefix. A one-token step's
// rows each have their own cache row and keep their given slots.
std::vector<int64_t> Layer::slots(const Step& st, const int64_t* SL, const bool* write, const at::Tensor& kc) const {
  std::vector<int64_t> slot(st.b);
  for (int64_t i = 0; i < st.b; ++i) {
    slot[i] = i > 0 && st.idx[i] == st.idx[i - 1] ? slot[i - 1] + write[i - 1] : SL[i];
    TORCH_CHECK(st.idx[i] >= 0 && st.idx[i] < kc.size(0) && slot[i] >= 0 && slot[i] < kc.size(2),
                "fbs native layer: slot out of range");
  }
  return slot;
}

// One layer for the step's b rows: reads X (b, d), writes OUT (b, d) (a skipped row's input copied) unless no
// row runs (then OUT is not touched); returns the number of rows that ran. Gated (terms not null): the
// decision from terms (row i at terms + i * t_stride), x_prev (null: no previous layer, the constant
// rel_first), ps (per row 1.0 where the previous layer was skipped; null: none was) and the step's thresholds
// and policy; else run_in. Fills logits (gated), skip and run (b each).
int64_t Layer::step(const Step& st, const float* X, float* OUT, at::Tensor& kc, at::Tensor& vc, const int64_t* SL,
                    const float* terms, int64_t t_stride, const float* x_prev, const float* ps, const bool* run_in,
                    double* logits, bool* skip, bool* run, float* acc, const float* KF, const Extras* ex) const {
  const int64_t b = st.b, nk = kvg.n;
  TORCH_CHECK((!paw && !ch) || ex != nullptr, "fbs native layer: a PAW / CH layer needs the step's extras");
  std::vector<float> xn(b * d), y(b * nk);
  fbs_norm::rows(X, ln1.data_ptr<float>(), eps, xn.data(), b, d);
  mm(xn.data(), b, kvg, y.data(), st.isa);
  if (kvg_b.defined()) {
    const float* B = kvg_b.data_ptr<float>();
    for (int64_t i = 0; i < b; ++i)
      for (int64_t j = 0; j < nk; ++j) y[i * nk + j] += B[j];
  }
  if (terms != nullptr) {
    TORCH_CHECK(gated, "fbs native layer: gate inputs for a layer without a gate");
    std::vector<float> hv(G);
    const float* WR = w_rel.defined() ? w_rel.data_ptr<float>() : nullptr;
    const float* RF = rel_first.defined() ? rel_first.data_ptr<float>() : nullptr;
    const float* WP = w_prev.defined() ? w_prev.data_ptr<float>() : nullptr;
    int64_t n_skip = 0;
    for (int64_t i = 0; i < b; ++i) {
      logits[i] = fbs_gate::row(terms + i * t_stride, g_w > 0 ? y.data() + i * nk + g_off : nullptr, X + i * d,
                                x_prev ? x_prev + i * d : nullptr, x_prev ? nullptr : RF, ps ? ps[i] : 0.f,
                                ps != nullptr, WR, WP, out_w.data_ptr<float>(), out_b, g_eps, d, G, hv.data());
      skip[i] = fbs_skip::skips(logits[i], st.thresholds[i]);
      n_skip += skip[i];
    }
    for (int64_t i = 0; i < b; ++i) run[i] = fbs_skip::runs(st.policy, skip[i], n_skip, b);
  } else {
    for (int64_t i = 0; i < b; ++i) {
      run[i] = run_in[i];
      skip[i] = !run_in[i];
    }
  }
  std::unique_ptr<bool[]> write(new bool[b]);
  for (int64_t i = 0; i < b; ++i) write[i] = run[i] || st.write_skipped;
  const std::vector<int64_t> slot = slots(st, SL, write.get(), kc);
  write_kv(st, y.data(), write.get(), kc, vc, slot.data(), KF);
  std::vector<int64_t> sel, skipped;
  for (int64_t i = 0; i < b; ++i) (run[i] ? sel : skipped).push_back(i);
  const int64_t m = sel.size();
  if (ch && st.write_skipped && !skipped.empty()) {  // project: a skipped token joins the chunk cache, adds nothing
    const int64_t n = skipped.size();
    std::vector<float> xs(n * d), lg(n * ch->nl);
    std::vector<int64_t> rw(n);
    for (int64_t j = 0; j < n; ++j) {
      std::copy_n(xn.data() + skipped[j] * d, d, xs.data() + j * d);
      rw[j] = st.idx[skipped[j]];
    }
    std::unique_ptr<bool[]> start(new bool[n]);
    fbs_chunk::rows(*ch, *ex->chunk, xs.data(), rw.data(), n, false, nullptr, lg.data(), start.get());
  }
  if (m == 0) return 0;
  std::vector<float> h(m * d);  // the running rows, compacted
  attention_rows(st, X, xn.data(), sel, kc, vc, slot.data(), h.data(), acc, nullptr, KF);
  if (paw || ch) extras(st, xn.data(), sel, h.data(), *ex);
  ffn_rows(h.data(), m, st.isa);
  for (int64_t i = 0; i < b; ++i)
    if (!run[i]) std::copy_n(X + i * d, d, OUT + i * d);
  for (int64_t j = 0; j < m; ++j) std::copy_n(h.data() + j * d, d, OUT + sel[j] * d);
  return m;
}

Step make_step(const at::Tensor& x, int64_t d, int64_t hd, const at::Tensor& cos, const at::Tensor& sin,
               const at::Tensor& idx, int64_t isa, int64_t policy, bool write_skipped,
               const std::vector<double>& thresholds) {
  TORCH_CHECK(isa >= 1 && isa <= fbs::best_isa(), "fbs native layer: instruction set ", isa, " not available");
  const int64_t b = x.size(0);
  fp32(x, b * d, "x");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.numel() == b,
              "fbs native layer: (b,) int64 cache rows");
  TORCH_CHECK(thresholds.empty() || (int64_t)thresholds.size() == b, "fbs native layer: one threshold per row");
  return Step{b,
              fp32(cos, b * hd, "cos"),
              fp32(sin, b * hd, "sin"),
              idx.data_ptr<int64_t>(),
              isa,
              policy,
              write_skipped,
              thresholds.data()};
}

void check_cache(const Layer& L, const at::Tensor& kc, const at::Tensor& vc) {
  fbs_attn::check_kv_type(kc.scalar_type(), "fbs native layer");
  TORCH_CHECK(vc.scalar_type() == kc.scalar_type() && kc.device().is_cpu() && kc.is_contiguous() &&
                  vc.is_contiguous() && kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(1) == L.nkv &&
                  kc.size(3) == fbs_attn::entry_width(kc.scalar_type(), L.hd),
              "fbs native layer: KV caches (B, Hkv, C, W) contiguous CPU tensors of one dtype (W = hd; int8: hd + 4)");
}

// run_layers: its arguments and results are documented at its declaration (layer.h).
std::tuple<at::Tensor, at::Tensor, std::vector<double>, std::vector<bool>, std::vector<bool>, at::Tensor,
           std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>>
run_layers(const std::vector<Layer*>& layers, const at::Tensor& x, const std::optional<at::Tensor>& x_prev,
           const std::vector<double>& prev_skip, const std::optional<at::Tensor>& zterms, const at::Tensor& cos,
           const at::Tensor& sin, const std::vector<at::Tensor>& kcs, const std::vector<at::Tensor>& vcs,
           const at::Tensor& idx, const std::vector<int64_t>& slots, const std::vector<bool>& gated,
           const std::vector<bool>& runs, const std::vector<double>& thresholds, int64_t policy, bool write_skipped,
           const std::vector<at::Tensor>& accs, const std::vector<at::Tensor>& kfs, int64_t isa,
           const std::optional<at::Tensor>& zlow, const std::vector<at::Tensor>& chunks, bool trail) {
  const int64_t n = layers.size();
  TORCH_CHECK(accs.empty() || (int64_t)accs.size() == n, "fbs native layers: accumulated attention per layer");
  TORCH_CHECK(kfs.empty() || (int64_t)kfs.size() == n, "fbs native layers: key factors per layer");
  TORCH_CHECK(n > 0 && (int64_t)kcs.size() == n && (int64_t)vcs.size() == n && (int64_t)gated.size() == n,
              "fbs native layers: one cache pair and gate flag per layer");
  const Layer& L0 = *layers[0];
  const Step st = make_step(x, L0.d, L0.hd, cos, sin, idx, isa, policy, write_skipped, thresholds);
  const int64_t b = st.b, d = L0.d;
  TORCH_CHECK((int64_t)slots.size() == n * b && (runs.empty() || (int64_t)runs.size() == n * b),
              "fbs native layers: slots (and runs) per layer and row");
  TORCH_CHECK(prev_skip.empty() || (int64_t)prev_skip.size() == b, "fbs native layers: prev_skip per row");
  const float* Z = nullptr;
  int64_t z_stride = 0;
  if (zterms) {
    TORCH_CHECK(zterms->scalar_type() == at::kFloat && zterms->is_contiguous() && zterms->size(0) == b,
                "fbs native layers: gate terms (b, 1, n * G) fp32, contiguous");
    Z = zterms->data_ptr<float>();
    z_stride = zterms->size(-1);
  }
  const float* XP0 = x_prev ? fp32(*x_prev, b * d, "x_prev") : nullptr;
  std::vector<double> logits(n * b, std::nan("")), ps(prev_skip.begin(), prev_skip.end());
  std::vector<float> psf(b);
  std::vector<bool> skip_out(n * b), run_out(n * b);
  std::unique_ptr<bool[]> sk(new bool[b]), rn(new bool[b]), all_run(new bool[b]);
  for (int64_t i = 0; i < b; ++i) all_run[i] = true;
  // PAW / CH: the step's zlow, each CH layer's chunk state, the gate terms a PAW layer renews
  std::vector<int64_t> ks(n * b, -1), bounds(n * b, -1);
  std::vector<fbs_chunk::State> states, trails;
  std::vector<at::Tensor> trail_out;
  at::Tensor renewed;
  size_t next_chunk = 0;
  float* ZLOW = nullptr;
  for (int64_t k = 0; k < n; ++k) {
    const Layer& L = *layers[k];
    if (L.paw && !ZLOW) {
      TORCH_CHECK(zlow.has_value(), "fbs native layers: a PAW layer needs the step's zlow");
      ZLOW = const_cast<float*>(fp32(*zlow, b * L.paw->R, "zlow"));
    }
    if (L.ch) {
      TORCH_CHECK(chunks.size() >= 4 * (states.size() + 1), "fbs native layers: four chunk-state tensors per CH layer");
      auto* c = const_cast<at::Tensor*>(chunks.data()) + 4 * states.size();
      states.push_back(fbs_chunk::state(c[0], c[1], c[2], c[3], L.ch->R));
      if (trail) {
        const int64_t C = c[0].size(1), R = L.ch->R;
        at::Tensor t[4] = {at::empty({b, C, R}, c[0].options()), at::empty({b}, c[1].options()),
                           at::empty({b, R}, c[2].options()), at::empty({b}, c[3].options())};
        trails.push_back(fbs_chunk::state(t[0], t[1], t[2], t[3], R));
        trail_out.insert(trail_out.end(), t, t + 4);
      }
    }
  }
  TORCH_CHECK(chunks.size() == 4 * states.size(), "fbs native layers: four chunk-state tensors per CH layer");
  at::Tensor cur = x, prev = x_prev ? *x_prev : at::Tensor();
  for (int64_t k = 0; k < n; ++k) {
    const Layer& L = *layers[k];
    Extras ex;
    if (L.paw || L.ch) {
      ex.zlow = ZLOW;
      ex.k = ks.data() + k * b;
      ex.bound = bounds.data() + k * b;
      ex.chunk = L.ch ? &states[next_chunk] : nullptr;
      ex.trail = L.ch && trail ? &trails[next_chunk] : nullptr;
      next_chunk += L.ch ? 1 : 0;
    }
    TORCH_CHECK(L.d == d, "fbs native layers: layer widths differ");
    at::Tensor kc = kcs[k], vc = vcs[k];
    check_cache(L, kc, vc);
    float* acc = nullptr;
    if (!accs.empty()) acc = fbs_attn::acc_data(accs[k], kc, "fbs native layer");
    const float* KF = kfs.empty() ? nullptr : fbs_attn::key_factors(kfs[k], L.nkv, L.hd, "fbs native layers");
    const float* terms = nullptr;
    if (gated[k]) {
      TORCH_CHECK(Z != nullptr && L.gated && (L.g_index + 1) * L.G <= z_stride && !thresholds.empty(),
                  "fbs native layers: a gated layer needs its gate, the step's terms and thresholds");
      terms = Z + L.g_index * L.G;
    }
    std::unique_ptr<bool[]> given;
    if (!gated[k]) {
      given.reset(new bool[b]);
      for (int64_t i = 0; i < b; ++i) given[i] = runs.empty() ? true : bool(runs[k * b + i]);
    }
    for (int64_t i = 0; i < b; ++i) psf[i] = ps.empty() ? 0.f : float(ps[i]);
    at::Tensor out = at::empty_like(cur);
    const int64_t m = L.step(st, cur.data_ptr<float>(), out.data_ptr<float>(), kc, vc, slots.data() + k * b, terms,
                             z_stride, prev.defined() ? prev.data_ptr<float>() : nullptr,
                             ps.empty() ? nullptr : psf.data(), given.get(), logits.data() + k * b, sk.get(), rn.get(),
                             acc, KF, (L.paw || L.ch) ? &ex : nullptr);
    if (L.paw && m > 0 && L.term_w.defined()) {  // the gates after it read the new zlow
      const int64_t T = L.term_w.size(0), R = L.paw->R;
      TORCH_CHECK(Z == nullptr || z_stride == T, "fbs native layers: gate terms of ", z_stride, " values, PAW's ", T);
      renewed = at::empty({b, 1, T}, x.options());
      float* RT = renewed.data_ptr<float>();
      const float *TW = L.term_w.data_ptr<float>(), *TB = L.term_b.data_ptr<float>();
      for (int64_t i = 0; i < b; ++i)
        for (int64_t t = 0; t < T; ++t) RT[i * T + t] = fbs_norm::dot(TW + t * R, ZLOW + i * R, R) + TB[t];
      Z = RT;
      z_stride = T;
    }
    bool every = true;
    for (int64_t i = 0; i < b; ++i) {
      skip_out[k * b + i] = sk[i];
      run_out[k * b + i] = rn[i];
      every = every && rn[i];
    }
    if (every)
      ps.clear();
    else {
      ps.assign(b, 0.0);
      for (int64_t i = 0; i < b; ++i) ps[i] = rn[i] ? 0.0 : 1.0;
    }
    prev = cur;
    if (m > 0) cur = out;  // else the layer's output is its input, the same tensor
  }
  return {cur, prev, logits, skip_out, run_out, renewed, ks, bounds, trail_out};
}
const std::vector<double> kNoThresholds;

at::Tensor attend_layer(const Layer& L, const at::Tensor& x, const at::Tensor& xn, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc, const at::Tensor& idx,
                        const at::Tensor& slots, const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                        const std::optional<at::Tensor>& acc, int64_t isa,
                        const std::optional<at::Tensor>& tree_bits, const std::optional<at::Tensor>& tree_base,
                        const std::optional<at::Tensor>& kf) {
  const Step st = make_step(x, L.d, L.hd, cos, sin, idx, isa, fbs_skip::kGather, true, kNoThresholds);
  const int64_t b = st.b, nk = L.kvg.n;
  const float* XN = fp32(xn, b * L.d, "xn");
  check_cache(L, kc, vc);
  const float* KF = fbs_attn::key_factors(kf, L.nkv, L.hd, "fbs native layer");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == b,
              "fbs native layer: (b,) int64 slots");
  const int64_t* SL = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(st.idx[i] >= 0 && st.idx[i] < kc.size(0) && SL[i] >= 0 && SL[i] < kc.size(2),
                "fbs native layer: slot out of range");
  std::vector<int64_t> sel(b);
  for (int64_t i = 0; i < b; ++i) sel[i] = i;
  if (k && v) {  // K (rotated) and V already projected (a gated layer's pre step): (b, Hkv, 1, hd), rows strided
    for (const at::Tensor* t : {&*k, &*v})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->size(0) == b && t->size(1) == L.nkv &&
                      t->size(3) == L.hd && t->stride(3) == 1,
                  "fbs native layer: K / V (b, Hkv, 1, hd) fp32");
    fbs_attn::write_kv(k->data_ptr<float>(), k->stride(0), k->stride(1), v->data_ptr<float>(), v->stride(0),
                       v->stride(1), b, st.idx, SL, kc.data_ptr(), vc.data_ptr(), kc.scalar_type(), L.nkv,
                       kc.size(2), L.hd, KF);
  } else {
    std::vector<float> y(b * nk);
    L.mm(XN, b, L.kvg, y.data(), isa);
    if (L.kvg_b.defined()) {
      const float* B = L.kvg_b.data_ptr<float>();
      for (int64_t i = 0; i < b; ++i)
        for (int64_t j = 0; j < nk; ++j) y[i * nk + j] += B[j];
    }
    std::unique_ptr<bool[]> write(new bool[b]);
    for (int64_t i = 0; i < b; ++i) write[i] = true;
    L.write_kv(st, y.data(), write.get(), kc, vc, SL, KF);
  }
  at::Tensor h = at::empty_like(x);
  float* ACC = acc ? fbs_attn::acc_data(*acc, kc, "fbs native layer") : nullptr;
  TORCH_CHECK(tree_bits.has_value() == tree_base.has_value(), "fbs native layer: tree_bits and tree_base together");
  fbs_attn::Tree tree{nullptr, nullptr};
  if (tree_bits) {
    for (const at::Tensor* t : {&*tree_bits, &*tree_base})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == b && t->device().is_cpu(),
                  "fbs native layer: tree_bits / tree_base (b,) contiguous int64");
    tree = {reinterpret_cast<const uint64_t*>(tree_bits->data_ptr<int64_t>()), tree_base->data_ptr<int64_t>()};
  }
  L.attention_rows(st, x.data_ptr<float>(), XN, sel, kc, vc, SL, h.data_ptr<float>(), ACC,
                   tree_bits ? &tree : nullptr, KF);
  return h;
}

at::Tensor ffn_layer(const Layer& L, const at::Tensor& h, int64_t isa) {
  TORCH_CHECK(isa >= 1 && isa <= fbs::best_isa(), "fbs native layer: instruction set ", isa, " not available");
  const int64_t b = h.numel() / L.d;
  fp32(h, b * L.d, "h");
  at::Tensor out = h.clone();
  L.ffn_rows(out.data_ptr<float>(), b, isa);
  return out;
}
}  // namespace fbs_layer
