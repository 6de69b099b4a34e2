// Shared by every kernel of the fbs native extension: ATen, the x86 switch and the instruction-set codes.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define FBS_X86 1
#endif

namespace fbs {
// Instruction-set codes the Python side passes (fbs.native._ISA_NAMES, fbs.native.quant.ISA_NAMES): 2 AVX-512 +
// FMA, 1 AVX2 + FMA, 3 AVX-512 with BW and VNNI (the block-quantized products, quant.h), 0 none of them (the
// caller keeps the PyTorch ops).
constexpr int64_t kIsaNone = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Vnni = 3;

// The best instruction set of this CPU.
int64_t best_isa();

// A bf16 bit pattern as fp32 (exact).
inline float bf16(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace fbs
