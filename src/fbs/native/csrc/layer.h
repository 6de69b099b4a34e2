// A whole decoder layer of the eager native step (fbs.engine.fused.FusedOps.native_run), so that a run of layers is
// one call (run_layers) instead of some forty ATen dispatches per layer. A step's rows are one token of each of b
// sequences, or T consecutive positions of one or more sequences (their rows consecutive, sharing a cache row):
// each row attends over its cache row up to its own slot, so positions of one sequence attend causally.
//   xn = RMSNorm_1(x);  y = xn @ [W_k; W_v; A]^T (+ b)       K, V and, on gated layers, the gate's hidden columns
//   gated: logit = gate(y's gate columns, terms, relative update, previous skip) (gate.h); skip and run by the
//          skip rule (skip.h: threshold per row, batch policy), or the caller's run list (ungated layers)
//   K/V (K rotated) written at each row's slot for the rows that run, and for every row when write_skipped
//   rows that run: h = x + O(attention(RoPE(Q xn)));  out = h + down(silu(gate(hn)) * up(hn)), hn = RMSNorm_2(h)
//   rows that skip: out = x
// Weights in one of the packed formats of packed.h; activations, norms, biases and caches fp32.
#pragma once

#include <tuple>

#include "common.h"
#include "attention.h"
#include "chunk.h"
#include "packed.h"
#include "paw.h"

namespace fbs_layer {
using fbs_packed::Packed;

// What one call shares across its layers: rows, rotary tables (b, hd), cache rows, decision rule.
struct Step {
  int64_t b;
  const float *cos, *sin;
  const int64_t* idx;
  int64_t isa, policy;
  bool write_skipped;
  const double* thresholds;  // per row (gated layers)
};

// What a decode step's PAW / CH layers read and write (run_layers): the rows' preview summary zlow (b, R), per row
// k of a PAW layer and the boundary flag of a CH layer (left as they are where the row does not run it), the CH
// layer's chunk state.
struct Extras {
  float* zlow = nullptr;
  int64_t* k = nullptr;
  int64_t* bound = nullptr;
  const fbs_chunk::State* chunk = nullptr;
  // a verifier's pass: per step row, the chunk state of its cache row right after its token (closed (b, C, R),
  // n_closed (b), open_sum (b, R), open_count (b)), or null
  const fbs_chunk::State* trail = nullptr;
};

struct Layer {
  int64_t d, heads, nkv, hd, inter;
  float eps, scale;
  at::Tensor ln1, ln2, kvg_b, q_b;  // biases undefined when absent
  Packed kvg, q, o, gu, dn;
  // gate (gated layers): offset and width of its columns in y, its index among the gated layers (which terms are
  // its own), w_rel, w_prev and rel_first = w_rel log(1 + 1e-3) (undefined when unused), out
  bool gated = false;
  int64_t g_off = 0, g_w = 0, G = 0, g_index = 0;
  at::Tensor w_rel, w_prev, rel_first, out_w;
  float out_b = 0.f, g_eps = 1e-3f;
  // PAW / CH on this layer (set_paw / set_chunk; one-token decode steps, run_layers): what they add to the state of
  // the rows that run between attention and the FFN, as fbs.model.layer.layer_step adds it. term_w / term_b: the
  // gates' preview terms of zlow (all gated layers' hidden pre-activations, T of them) that a PAW layer renews for
  // the layers after it (undefined when the gates do not read zlow).
  std::shared_ptr<const fbs_paw::Weights> paw;
  at::Tensor term_w, term_b;
  std::shared_ptr<const fbs_chunk::Weights> ch;

  Layer(int64_t d_, int64_t heads_, int64_t nkv_, int64_t hd_, int64_t inter_, double eps_, double scale_,
        at::Tensor ln1_, const Packed& kvg_, std::optional<at::Tensor> kvg_b_, const Packed& q_,
        std::optional<at::Tensor> q_b_, const Packed& o_, at::Tensor ln2_, const Packed& gu_, const Packed& dn_);
  void set_gate(int64_t index, int64_t off, int64_t width, std::optional<at::Tensor> w_rel_,
                std::optional<at::Tensor> w_prev_, std::optional<at::Tensor> rel_first_, at::Tensor out_w_,
                double out_b_, double g_eps_);
  void set_paw(const at::Tensor& w_window, const at::Tensor& b_window, int64_t fixed_k, int64_t k_max,
               const at::Tensor& w_query, const at::Tensor& mix, const at::Tensor& bias, const at::Tensor& keys_t,
               const at::Tensor& other, double head_scale, int64_t top_k, const at::Tensor& emb,
               const at::Tensor& conv_w, const at::Tensor& conv_b, const at::Tensor& w_down, const at::Tensor& w_up,
               std::optional<at::Tensor> term_w_, std::optional<at::Tensor> term_b_);
  void set_chunk(const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key,
                 const at::Tensor& w_query, const at::Tensor& w_out, double scale, int64_t label_i);
  void mm(const float* X, int64_t M, const Packed& w, float* Y, int64_t isa) const;
  // H (m, d) += PAW's z and CH's c of the running rows sel (XN their normalized inputs, all b rows), writing zlow,
  // k and the boundary flags of those rows to ex; CH's chunk states advance for them
  void extras(const Step& st, const float* XN, const std::vector<int64_t>& sel, float* H, const Extras& ex) const;
  // K (rotated) and V of the rows flagged in write, at their slots; Y: the K/V(+gate) product (b, kvg.n)
  // (KF: the cache's key factors (Hkv, hd) or null, fbs_attn::key_factors: keys stored divided by them)
  void write_kv(const Step& st, const float* Y, const bool* write, at::Tensor& kc, at::Tensor& vc,
                const int64_t* SL, const float* KF = nullptr) const;
  // H (m, d) = X[sel] + O(attention(RoPE(Q XN[sel]))) over each row's cache prefix (its K/V already written);
  // tree (null: none): row i's token-tree visibility (fbs_attn::Tree, indexed by step row); KF: as write_kv's (the
  // queries are multiplied by them)
  void attention_rows(const Step& st, const float* X, const float* XN, const std::vector<int64_t>& sel,
                      const at::Tensor& kc, const at::Tensor& vc, const int64_t* SL, float* H, float* acc = nullptr,
                      const fbs_attn::Tree* tree = nullptr, const float* KF = nullptr) const;
  // H (m, d) += down(silu(gate(hn)) * up(hn)), hn = RMSNorm_2(H), in place
  void ffn_rows(float* H, int64_t m, int64_t isa) const;
  // Each row's cache slot from the given ones (SL): consecutive rows that share a cache row are consecutive
  // positions of one sequence and take consecutive slots among the rows that write.
  std::vector<int64_t> slots(const Step& st, const int64_t* SL, const bool* write, const at::Tensor& kc) const;
  // One layer for the step's b rows: reads X (b, d), writes OUT (b, d) (a skipped row's input copied) unless no
  // row runs (then OUT is not touched); returns the number of rows that ran. Gated (terms not null): the
  // decision from terms (row i at terms + i * t_stride), x_prev (null: no previous layer, the constant
  // rel_first), ps (per row 1.0 where the previous layer was skipped; null: none was) and the step's thresholds
  // and policy; else run_in. Fills logits (gated), skip and run (b each). acc: as attention_rows' (the rows that
  // run add their attention weights), or null.
  // ex: the step's PAW / CH state (layers with PAW or CH need it; under write_skipped a CH layer's skipped rows
  // still join its chunk cache, as fbs.engine.cache.CacheContext.chunk_write does).
  int64_t step(const Step& st, const float* X, float* OUT, at::Tensor& kc, at::Tensor& vc, const int64_t* SL,
               const float* terms, int64_t t_stride, const float* x_prev, const float* ps, const bool* run_in,
               double* logits, bool* skip, bool* run, float* acc = nullptr, const float* KF = nullptr,
               const Extras* ex = nullptr) const;
};

// Consecutive layers of one step in one call. Per layer: its caches, its rows' slots (slots[k * b + i]), gated or
// not (gated: terms row i of the gate is zterms[i, 0, index * G : (index + 1) * G]); not gated: run flags
// runs[k * b + i], or every row runs when runs is empty. x_prev / prev_skip: the previous layer's input and
// skip flags per row (x_prev None: no previous layer; prev_skip empty: no row skipped it). Returns
// (x out, input of the last layer, logits, skip, run), the last three flat (layers * b; logits NaN where no gate
// ran). x out is the input of the last layer itself when no row ran it. accs: empty, or per layer its accumulated
// attention (B, Hkv, C) fp32, to which the rows that run the layer add their attention weights (H2O).
// Layers with PAW / CH (one token per row): zlow (b, R) the step's preview summary, written in place by the PAW
// layers' running rows; chunks: the four ChunkState tensors (closed, n_closed, open_sum, open_count) of each CH
// layer, in order. After a PAW layer that a row ran (and has term_w) the gate terms of the layers after it are
// zlow's, returned as the sixth element (b, 1, T) (else undefined); the last two: per layer and row the PAW layer's
// k and the CH layer's boundary flag (-1 where none). trail: also return, per CH layer, its chunk state after each
// row's token (four tensors: closed (b, C, R), n_closed (b), open_sum (b, R), open_count (b)), as a verifier logs it.
std::tuple<at::Tensor, at::Tensor, std::vector<double>, std::vector<bool>, std::vector<bool>, at::Tensor,
           std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>>
run_layers(const std::vector<Layer*>& layers, const at::Tensor& x, const std::optional<at::Tensor>& x_prev,
           const std::vector<double>& prev_skip, const std::optional<at::Tensor>& zterms, const at::Tensor& cos,
           const at::Tensor& sin, const std::vector<at::Tensor>& kcs, const std::vector<at::Tensor>& vcs,
           const at::Tensor& idx, const std::vector<int64_t>& slots, const std::vector<bool>& gated,
           const std::vector<bool>& runs, const std::vector<double>& thresholds, int64_t policy, bool write_skipped,
           const std::vector<at::Tensor>& accs, const std::vector<at::Tensor>& kfs, int64_t isa,
           const std::optional<at::Tensor>& zlow, const std::vector<at::Tensor>& chunks, bool trail);

// The two halves of a layer for every row, around what PAW / CH add in between (their layers of the native int8
// step): attend_layer writes the K/V of xn = RMSNorm_1(x) at the rows' slots and returns h = x + O(attention);
// ffn_layer returns h + FFN(h). attend_layer's ``acc`` (B, Hkv, C) fp32, when given, receives the attention weights
// (fbs_attn::attend's ACC, from the same pass: a cache policy that keeps accumulated attention, H2O).
// tree_bits / tree_base ((b,) int64 each, or none): a verifier's token tree, row i seeing the keys before slot
// tree_base[i] and, of the next 64 slots, those whose bit of tree_bits[i] is set (fbs_attn::Tree).
at::Tensor attend_layer(const Layer& L, const at::Tensor& x, const at::Tensor& xn, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc, const at::Tensor& idx,
                        const at::Tensor& slots, const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                        const std::optional<at::Tensor>& acc, int64_t isa,
                        const std::optional<at::Tensor>& tree_bits = std::nullopt,
                        const std::optional<at::Tensor>& tree_base = std::nullopt,
                        const std::optional<at::Tensor>& kf = std::nullopt);
at::Tensor ffn_layer(const Layer& L, const at::Tensor& h, int64_t isa);
}  // namespace fbs_layer
