// The FFN's activation: out = silu(g) * u = g / (1 + exp(-g)) * u, over n floats.
#pragma once

#include "common.h"

namespace fbs_act {
// exp computed as 2^n * p(r) (x = n ln2 + r, |r| <= ln2 / 2, Cephes' expf polynomial; clamped to the float range),
// written without library calls so that the loop vectorizes per instruction set; the layer tests hold it to the
// PyTorch step's FFN within float rounding.
void silu_mul(const float* g, const float* u, float* out, int64_t n);
}  // namespace fbs_act
