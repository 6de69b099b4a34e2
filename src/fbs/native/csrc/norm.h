// HF's Llama/Qwen RMSNorm of fp32 rows: w * (x * rsqrt(mean(x^2) + eps)), the statistic accumulated in fp32;
// the dot product the chunk head shares, and row-independent fp32 products built on it.
#pragma once

#include "common.h"

namespace fbs_norm {
// a . b with 16 independent lanes (vectorized without reassociating a single sum; the last lanes' order differs
// from a serial sum by float rounding only)
float dot(const float* a, const float* b, int64_t n);

// HF's RMSNorm of n rows of d floats: y = w * (x * rsqrt(mean(x^2) + eps))
void rows(const float* x, const float* w, float eps, float* y, int64_t n, int64_t d);
}  // namespace fbs_norm

// See fbs.native.rms_norm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// y = x w^T (+ b) of fp32 rows x (..., k), w (n, k), b (n,) or undefined: every output is one fbs_norm::dot, so a
// row's result does not depend on how many rows share the call (see fbs.native.linear_rows).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);
