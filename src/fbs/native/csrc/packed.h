// One weight matrix of a native layer in the format its products stream (fbs.engine.quant.Weight builds it):
//   kInt8F32   the int8 kernel's layout (int8.h): int8 per output channel with bf16 scales, fp32 activations
//   the block-quantized kinds of quant.h (kI8Channel, kQ8Block, kQ4Block): activations quantized to int8 per
//   32-value block inside each product, integer dot products (VNNI on AVX-512, maddubs on AVX2)
// Layer::mm calls Packed::mm: the one place a layer's product picks its kernel.
// A weight may carry a low-rank delta applied apart from its packed part, Y += (X A^T) Bt (set_lowrank): a LoRA
// adapter kept off the quantized base weight, so that the base keeps its own blocks (a GGUF's exact ones). Its
// factors are stored in fp16 (lowrank.h), the sums in fp32.
#pragma once

#include "common.h"

namespace fbs_packed {
constexpr int64_t kInt8F32 = -1;  // the block kinds are fbs_quant::kI8Channel .. kQ4Block (0 .. 2)

struct Packed {
  int64_t kind = kInt8F32, n = 0, k = 0;
  at::Tensor p, s;     // packed bytes; scales (kInt8F32: (n,) bf16; kI8Channel: fp32 padded to whole tiles; else none)
  at::Tensor la, lbt;  // the low-rank delta (undefined when none): A (r, k) and Bt (r, n), fp16, the scale in Bt
  std::vector<int32_t> lrows;  // per 16 columns of Bt, the range [lo, hi) of its rows that are not all zero there
  const c10::Half *la_h = nullptr, *lbt_h = nullptr;  // la's and lbt's values (read per product and row, unchecked)
  // Y (M, n) = X (M, k) @ W^T, X with row stride k, Y with row stride n; isa: the step's instruction-set code
  // (kIsaAvx512 or kIsaAvx2; the block kinds take VNNI where the CPU has it unless the step asks for AVX2)
  void mm(const float* X, int64_t M, float* Y, int64_t isa) const;
  // Add the delta scale * B A (B (n, r), A (r, k)) apart: a (r, k) and bt = scale * B^T (r, n), fp32 contiguous
  // tensors whose values are fp16 values (checked; stored as fp16).
  void set_lowrank(at::Tensor a, at::Tensor bt);
  // mm of x (M, k) fp32 contiguous (checked) into a new (M, n) tensor: the product a native layer computes
  at::Tensor linear(const at::Tensor& x, int64_t isa) const;
};

// A Packed from its tensors, checked against (n, k): kind kInt8F32 needs k a multiple of 16.
Packed make(int64_t kind, at::Tensor p, std::optional<at::Tensor> s, int64_t n, int64_t k);
}  // namespace fbs_packed
