// The skip gate's logit of one token (the reference is fbs.model.gate.SkipGates; the fused arithmetic is
// fbs.engine.fused._gate_logit):
//   h = y[off:off+G] (absent when the gate has no input columns) + terms
//       + w_rel * log(eps + ||x - x_prev|| / max(||x_prev||, 1e-6))   (x_prev given)
//       + rel_term                                                      (else, when given)
//       + w_prev * prev_skip                                            (when given)
//   logit = out_b + sum_j out_w[j] * silu(h[j])
#pragma once

#include "common.h"

namespace fbs_gate {
// One row's logit; h is scratch of G floats. y: the row's gate columns (null: none); x_prev null: the relative
// update is rel_term (or absent when null); has_ps: prev_skip ps applies.
double row(const float* terms, const float* y, const float* x, const float* x_prev, const float* rel_term, float ps,
           bool has_ps, const float* w_rel, const float* w_prev, const float* out_w, float out_b, float eps, int64_t d,
           int64_t G, float* h);
}  // namespace fbs_gate

// Per row of a one-token step, the gate logit (see fbs.native.gate_logits).
std::vector<double> gate_logits(const at::Tensor& y, int64_t off, int64_t gy, const at::Tensor& terms,
                                const at::Tensor& x, const std::optional<at::Tensor>& x_prev,
                                const std::optional<at::Tensor>& rel_term, const std::optional<at::Tensor>& prev_skip,
                                const std::optional<at::Tensor>& w_rel, const std::optional<at::Tensor>& w_prev,
                                const at::Tensor& out_w, double out_b, double eps);
