// Row quantization and the int8 GEMM's scaling (rowquant.h): loops compiled per instruction set (target_clones),
// rows split across threads.
#include "rowquant.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace fbs_rowquant {
__attribute__((target_clones("avx512f", "avx2", "default"))) float quantize_row(const float* x, int64_t k,
                                                                               int8_t* q) {
  float m = 0.f;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < k; ++i) m = std::max(m, std::fabs(x[i]));
  const float s = m > 0.f ? m / 127.f : 1.f;
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) q[i] = int8_t(std::nearbyint(x[i] / s));
  return s;
}
}  // namespace fbs_rowquant

namespace {
// the product and the bias add rounded apart, as the reference's mul_ / add_ (no fused multiply-add)
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("fp-contract=off"))) void scale_row(
    const int32_t* a, float sx, const float* sw, const float* b, int64_t n, float* y) {
  if (b) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = float(a[j]) * sx * sw[j] + b[j];
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = float(a[j]) * sx * sw[j];
  }
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "fbs quantize_rows: x (M, K) contiguous fp32 CPU");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto s = at::empty({M, 1}, x.options());
  const float* X = x.data_ptr<float>();
  int8_t* Q = q.data_ptr<int8_t>();
  float* S = s.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) S[r] = fbs_rowquant::quantize_row(X + r * K, K, Q + r * K);
  });
  return {q, s};
}

at::Tensor scale_rows(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous() && acc.device().is_cpu(),
              "fbs scale_rows: acc (M, N) contiguous int32 CPU");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.numel() == M &&
                  sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.numel() == N,
              "fbs scale_rows: sx (M, 1) and sw (N,) contiguous fp32");
  const float* B = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "fbs scale_rows: bias (N,) contiguous fp32");
    B = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, acc.options().dtype(at::kFloat));
  const int32_t* A = acc.data_ptr<int32_t>();
  const float *SX = sx.data_ptr<float>(), *SW = sw.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) scale_row(A + r * N, SX[r], SW, B, N, Y + r * N);
  });
  return y;
}
