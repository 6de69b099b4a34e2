// Skip-gate logits of b rows, one token each (gate.h). Every tensor is fp32 on the CPU with a unit stride in its
// last dimension; rows may be strided (views).
#include "gate.h"

namespace fbs_gate {
double row(const float* terms, const float* y, const float* x, const float* x_prev, const float* rel_term, float ps,
           bool has_ps, const float* w_rel, const float* w_prev, const float* out_w, float out_b, float eps, int64_t d,
           int64_t G, float* h) {
  for (int64_t j = 0; j < G; ++j) h[j] = terms[j];
  if (y)
    for (int64_t j = 0; j < G; ++j) h[j] = y[j] + h[j];
  if (x_prev && w_rel) {  // fp32 norms, as torch.linalg.vector_norm computes them, in 16 independent lanes
    float au[16] = {0.f}, ap[16] = {0.f};
    int64_t j = 0;
    for (; j + 16 <= d; j += 16)
      for (int k = 0; k < 16; ++k) {
        const float diff = x[j + k] - x_prev[j + k];
        au[k] += diff * diff;
        ap[k] += x_prev[j + k] * x_prev[j + k];
      }
    float su = 0.f, sp = 0.f;
    for (; j < d; ++j) {
      const float diff = x[j] - x_prev[j];
      su += diff * diff;
      sp += x_prev[j] * x_prev[j];
    }
    for (int k = 0; k < 16; ++k) {
      su += au[k];
      sp += ap[k];
    }
    const float u = std::sqrt(su), up = std::max(std::sqrt(sp), 1e-6f);
    const float r = std::log(eps + u / up);
    for (int64_t j = 0; j < G; ++j) h[j] += r * w_rel[j];
  } else if (rel_term) {
    for (int64_t j = 0; j < G; ++j) h[j] += rel_term[j];
  }
  if (has_ps && w_prev)
    for (int64_t j = 0; j < G; ++j) h[j] += ps * w_prev[j];
  double acc = 0.0;
  for (int64_t j = 0; j < G; ++j) acc += double(out_w[j]) * double(h[j] / (1.0f + std::exp(-h[j])));
  return acc + out_b;
}
}  // namespace fbs_gate

std::vector<double> gate_logits(const at::Tensor& y, int64_t off, int64_t gy, const at::Tensor& terms,
                                const at::Tensor& x, const std::optional<at::Tensor>& x_prev,
                                const std::optional<at::Tensor>& rel_term, const std::optional<at::Tensor>& prev_skip,
                                const std::optional<at::Tensor>& w_rel, const std::optional<at::Tensor>& w_prev,
                                const at::Tensor& out_w, double out_b, double eps) {
  for (const at::Tensor* t : {&y, &terms, &x, &out_w})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(-1) == 1, "fbs gate kernel: fp32, unit last stride");
  for (const auto* t : {&x_prev, &rel_term, &prev_skip, &w_rel, &w_prev})
    TORCH_CHECK(!*t || ((*t)->scalar_type() == at::kFloat && (*t)->stride(-1) == 1),
                "fbs gate kernel: fp32, unit last stride");
  const int64_t b = x.size(0), d = x.size(-1), G = out_w.size(0);
  const float* T = terms.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  const float* OW = out_w.data_ptr<float>();
  const float* Y = gy > 0 ? y.data_ptr<float>() : nullptr;
  const float* P = x_prev ? x_prev->data_ptr<float>() : nullptr;
  const float* RT = rel_term ? rel_term->data_ptr<float>() : nullptr;
  const float* PS = prev_skip ? prev_skip->data_ptr<float>() : nullptr;
  const float* WR = w_rel ? w_rel->data_ptr<float>() : nullptr;
  const float* WP = w_prev ? w_prev->data_ptr<float>() : nullptr;
  std::vector<double> out(b);
  std::vector<float> h(G);
  for (int64_t i = 0; i < b; ++i)
    out[i] = fbs_gate::row(T + i * terms.stride(0), Y ? Y + i * y.stride(0) + off : nullptr, X + i * x.stride(0),
                           P ? P + i * x_prev->stride(0) : nullptr, RT, PS ? PS[i * prev_skip->stride(0)] : 0.f,
                           PS != nullptr, WR, WP, OW, float(out_b), float(eps), d, G, h.data());
  return out;
}
