// RMSNorm rows (norm.h). dot and scale are compiled per instruction set and chosen at load (target_clones).
#include "norm.h"

namespace fbs_norm {
__attribute__((target_clones("avx512f", "avx2", "default"))) float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int k = 0; k < 16; ++k) acc[k] += a[j + k] * b[j + k];
  float s = 0.f;
  for (; j < n; ++j) s += a[j] * b[j];
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

namespace {
inline float sumsq(const float* x, int64_t n) { return dot(x, x, n); }

__attribute__((target_clones("avx512f", "avx2", "default"))) void scale(const float* x, const float* w, float r,
                                                                        float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] = w[d] * (x[d] * r);
}
}  // namespace

void rows(const float* x, const float* w, float eps, float* y, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const float r = 1.0f / std::sqrt(sumsq(x + i * d, d) / float(d) + eps);
    scale(x + i * d, w, r, y + i * d, d);
  }
}
}  // namespace fbs_norm

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
                  w.is_contiguous() && x.device().is_cpu() && x.size(-1) == w.numel(),
              "fbs norm kernel: contiguous fp32 CPU rows and a matching weight");
  const int64_t d = w.numel(), rows = x.numel() / std::max<int64_t>(d, 1);
  auto y = at::empty_like(x);
  fbs_norm::rows(x.data_ptr<float>(), w.data_ptr<float>(), float(eps), y.data_ptr<float>(), rows, d);
  return y;
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
                  w.is_contiguous() && x.device().is_cpu() && w.dim() == 2 && x.size(-1) == w.size(1),
              "fbs linear_rows: contiguous fp32 CPU rows (..., k) and a weight (n, k)");
  TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == w.size(0)),
              "fbs linear_rows: the bias must be fp32 (n,)");
  const int64_t n = w.size(0), k = w.size(1), m = x.numel() / std::max<int64_t>(k, 1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto y = at::empty(shape, x.options());
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>(), *B = b.has_value() ? b->data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j)  // one weight row at a time, for every input row while it is in cache
    for (int64_t i = 0; i < m; ++i) Y[i * n + j] = fbs_norm::dot(W + j * k, X + i * k, k) + (B ? B[j] : 0.f);
  return y;
}
