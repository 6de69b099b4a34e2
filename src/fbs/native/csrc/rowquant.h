// A prompt's int8 products (fbs.engine.prefill): the activations quantized per row and the int8 GEMM's int32 sums
// scaled back, each in one pass (the arithmetic of fbs.engine.prefill.int8_linear's PyTorch reference, bit for bit).
#pragma once

#include "common.h"

namespace fbs_rowquant {
// x (k) fp32 -> q (k) int8, returns s = max |x| / 127 (1 for a zero row), q = round(x / s) to nearest even: the one
// rule of a prompt's int8 activations and of an int8 KV cache entry (attention.h)
float quantize_row(const float* x, int64_t k, int8_t* q);
}  // namespace fbs_rowquant

// x (M, K) fp32 contiguous -> (q (M, K) int8, s (M, 1) fp32), each row by fbs_rowquant::quantize_row
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x);
// acc (M, N) int32 -> fp32 (M, N): float(acc) * sx[m] * sw[n] (+ bias[n]); sx (M, 1), sw (N,), bias (N,) fp32
at::Tensor scale_rows(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw,
                      const std::optional<at::Tensor>& bias);
