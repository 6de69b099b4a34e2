// A prompt's causal self-attention (GQA) in one pass, flash style: each query block's keys in blocks of kKeys, with
// a running max and sum per query (online softmax), so no (T, T) score matrix is ever stored.
//   out[b, t, h, :] = softmax(scale q[b, h, t] . k[b, g(h), 0..S-T+t]) @ v[b, g(h), 0..S-T+t],   g(h) = h / (H / Hkv)
// (S keys, the T queries at the last T positions: S = T for a fresh prompt)
// Tasks are (row, KV head, a pair of query blocks: one early, one late, so that every task reads about as many keys);
// the query heads of a KV head share each key and value load. fp32 throughout, hd a multiple of 16 (<= 256). Each
// output is computed once, by one task, in an order fixed by the shapes alone: the result does not depend on the
// thread count.
#pragma once

#include "common.h"

namespace fbs_causal {
constexpr int64_t kQueryPos = 16;  // query positions per block (times the query heads of one KV head)
constexpr int64_t kKeys = 64;      // keys per block: 4 registers of scores per query

#ifdef FBS_X86
// One task: query positions p0 .. p1 - 1 (key positions: query p sees keys 0 .. p) of the G heads of one KV head. Q: G * (p1 - p0) query rows of hd floats,
// already multiplied by the scale, row (p - p0) * G + i for head i; Kt: the KV head's keys transposed, (hd, Tp)
// with Tp >= p1 rounded up to kKeys (zero padded); V (>= p1, hd) rows ldv apart; O: head i of position p at
// O + (p - p0) * ldp + i * hd.
void block_avx512(const float* Q, int64_t G, int64_t p0, int64_t p1, const float* Kt, int64_t Tp, const float* V,
                  int64_t ldv, int64_t hd, float* O, int64_t ldp);
#endif
}  // namespace fbs_causal

// q (B, H, T, hd), k and v (B, Hkv, S, hd), S >= T, fp32 CPU tensors, any strides with a unit last one -> the causal
// attention (B, T, H, hd) contiguous, the queries at the last T of the S positions (query p sees keys 0 .. S - T + p:
// a prompt chunk after S - T earlier entries). See fbs.native.causal_attention.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
// Whether causal_attention runs here (AVX-512 and the native build).
bool causal_available();
