// H2O's one-token eviction (fbs.engine.kvpolicy.H2O._evict), in place, for each row i of idx and each KV head g:
//   the victim is the slot of the lowest accumulated score among the heavy hitters (slots 0 .. h - 1) and the ring
//   slot old[i] (the oldest recent entry, which leaves the window), the first of equal minima in that order (as
//   torch.argmin over cat(heavy, old)); slot old[i] moves to the victim's slot, then the new entry (slot `budget`)
//   moves to slot old[i], in kc / vc (B, Hkv, C, hd; fp32, fp16 or bf16), acc (B, Hkv, C) fp32 and pos
//   (B, Hkv, C) int64; the new entry's slot starts at score 0.
#pragma once

#include "common.h"

void h2o_evict(at::Tensor& kc, at::Tensor& vc, at::Tensor& acc, at::Tensor& pos, const at::Tensor& idx,
               const at::Tensor& old, int64_t h, int64_t budget);
