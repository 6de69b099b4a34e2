// One new token per row attends over its cache prefix (GQA), after writing its own K/V at its slot:
//   kc[idx[i], g, slot[i]] = k[i, g, 0];  vc likewise
//   out[i, 0, h*hd:(h+1)*hd] = softmax(scale * q[i, h] . kc[idx[i], g(h), 0..slot[i]]) @ vc[idx[i], g(h), 0..slot[i]]
// with g(h) = h / (H / Hkv). Queries, new K/V and the output fp32; the caches contiguous (B, Hkv, C, W) in fp32,
// fp16 or bf16 (W = hd; a half-precision cache: entries rounded to nearest even when written, converted to fp32
// in registers when read, every sum in fp32), or int8 (W = hd + 4: an entry's hd codes, then its fp32 scale;
// Entry<int8_t>); every tensor's last dimension unit-strided.
// With AVX-512 and hd a multiple of 64, the queries that read the same cached K/V (the heads of one KV head, and
// the positions of one sequence in a multi-token step) are one group: each cached key and value is loaded once
// for all of them. A group's keys are split into ranges of kKeyRange keys at fixed offsets (tasks for every thread
// at any context), each range giving partial softmax sums that are merged (max-shifted) at the end, in range order.
// The ranges do not depend on the call, so a query's output is bit-identical whether it runs alone (a one-token
// step), with other positions of its sequence (a verifier's multi-token step) or with other rows (a batch). A token
// tree's node is its own group, over virtual slots: the keys before the round at their slots, then the round's keys
// it sees (its ancestors and itself) at the next slots, as the kept path holds them once compacted; so its ranges,
// and its output, are those of the chain root..node and of one-token decoding, bit for bit.
// Over an int8 cache with AVX-512 VNNI (int8_scores) the grouped kernel scores in integers: each query as two int8
// codes per value (query_codes_vnni), each block of 16 keys transposed once so that one vpdpbusd adds 4 products
// for all 16; the softmax and the V sums stay fp32.
// Otherwise one task per (row, query head): scores, softmax, weighted sum of V; SIMD over the head dimension.
#pragma once

#include "common.h"

namespace fbs_attn {
constexpr int64_t kMaxHd = 256;
constexpr int64_t kKeyRange = 128;  // keys per range of the grouped kernel

// p[0..n) = exp(p - max p) in place; *z = their sum
inline void softmax_(float* p, int64_t n, float* z) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, p[j]);
  float s = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = std::exp(p[j] - m);
    s += p[j];
  }
  *z = s;
}

// A cache's elements are float, at::Half (fp16), at::BFloat16 (bf16) or int8_t: scalar types kFloat, kHalf,
// kBFloat16, kChar; any other fails here with an error naming ``who``.
void check_kv_type(at::ScalarType t, const char* who);

// One cached entry (a key or a value of one token and KV head) of element type T: hd values, value d = e[d] * scale.
// fp32 / fp16 / bf16 entries are the values (scale 1, a constant the compiler folds away). An int8 entry (kv_dtype
// int8) is its hd codes followed by its scale, an fp32 in native byte order (4 bytes): the codes round(x / scale)
// with scale = max |x| / 127 over the entry (fbs_rowquant::quantize_row's rule; fbs.engine.cache.kv_store is the
// PyTorch side). So a slot of the cache is Entry<T>::width(hd) elements, and an entry moves as one row (eviction,
// rollback, a row's copy) with its scale.
template <class T>
struct Entry {
  static constexpr int64_t extra = 0;
  static int64_t width(int64_t hd) { return hd; }
  static float scale(const T*, int64_t) { return 1.f; }
};
template <>
struct Entry<int8_t> {
  static constexpr int64_t extra = 4;
  static int64_t width(int64_t hd) { return hd + extra; }
  static float scale(const int8_t* e, int64_t hd) {
    float s;
    std::memcpy(&s, e + hd, 4);
    return s;
  }
};
// Entry<T>::width(hd) for the cache's scalar type kt (checked)
int64_t entry_width(at::ScalarType kt, int64_t hd);

// f(T{}) for the element type T of scalar type kt (check_kv_type's, an error naming ``who`` otherwise)
template <class F>
void with_kv_type(at::ScalarType kt, const char* who, F&& f) {
  check_kv_type(kt, who);
  switch (kt) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: f(int8_t{}); break;
  }
}

// A token tree's visibility in a verifier's one pass over its nodes (fbs.engine.speculative): query j sees every key
// before slot base[j] and, among slots base[j] .. base[j] + 63, those whose bit (slot - base[j]) of bits[j] is set
// (the node's ancestors and itself); never a key past its own slot. A masked key's softmax weight is exactly 0.
struct Tree {
  const uint64_t* bits;
  const int64_t* base;
};
// One query's part of a Tree: whether it sees key (slot) k
struct Visible {
  uint64_t bits;
  int64_t base;
  bool operator()(int64_t k) const { return k < base || (k - base < 64 && ((bits >> (k - base)) & 1)); }
};
// One query head q (hd) over n cached keys K and values V (n entries): o (hd) = softmax(scale q . K) @ V; p: n floats
// of scratch. vis (null: every key): a token tree's node sees only the keys vis marks (the others' weights exactly
// 0, the visible keys' arithmetic that of the same kernel over them alone). Portable, and per instruction set
// (arch/x86/attention_*.cpp: hd a multiple of 16 or 8, <= kMaxHd).
template <class T>
void head_scalar(const float* q, const T* K, const T* V, int64_t n, int64_t hd, float scale, float* p, float* o,
                 const Visible* vis);
#ifdef FBS_X86
// Overloads per cache element type: float, at::Half, at::BFloat16, int8_t (FBS_KV_OVERLOADS).
#define FBS_KV_OVERLOADS(DECL) DECL(float) DECL(at::Half) DECL(at::BFloat16) DECL(int8_t)
#define FBS_HEAD_DECL(T)                                                                                     \
  void head_avx512(const float* q, const T* K, const T* V, int64_t n, int64_t hd, float scale, float* p, float* o, \
                   const Visible* vis);                                                                         \
  void head_avx2(const float* q, const T* K, const T* V, int64_t n, int64_t hd, float scale, float* p, float* o,   \
                 const Visible* vis);
// A group of nq queries (q[i], hd floats each, already multiplied by the softmax scale) over keys k0 .. k1 - 1 of
// one cached K/V head (K, V: C entries), query i seeing keys up to last[i] only (hd a multiple of 64). Per query its
// partial softmax: part[i] = (m, z, acc[hd]) with m the largest score seen, z = sum exp(s - m) and
// acc = sum exp(s - m) v (m = -inf, z = 0, acc = 0 when it sees none of these keys). s: nq * (k1 - k0) floats of
// scratch. (arch/x86/attention_avx512.cpp)
// map (null: none): the keys are virtual slots; slot k >= km is read from the cache's slot map[k - km] (a token
// tree's node: the round's keys it sees, its ancestors and itself, in order, as its chain will hold them).
// qq (null: none; int8 caches only): the queries' codes (query_codes_vnni), scored in integers against the int8 keys.
// next: the K and V bytes the calling thread reads next (its next range), asked for in L2 while this range is
// scored, or null.
struct Next {
  const char* k;
  const char* v;
  int64_t bytes;
};
#define FBS_GROUP_DECL(T)                                                                                       \
  void group_avx512(const float* const* q, const int64_t* last, int64_t nq, const T* K, const T* V, int64_t k0, \
                    int64_t k1, int64_t hd, float* s, float* part, const int64_t* map, int64_t km,              \
                    const int8_t* const* qq, const Next* next);
FBS_KV_OVERLOADS(FBS_HEAD_DECL)
FBS_KV_OVERLOADS(FBS_GROUP_DECL)
// Integer scores over an int8 cache (AVX-512 VNNI): a query (hd floats, hd a multiple of 64, already scaled) as two
// int8 codes per value and a scale per 32 values, q = s hi + (s / 254) lo with s = max |q| / 127 over the 32,
// hi = round(q / s), lo = round((q - s hi) 254 / s): within s / 508 of q (about 1.5e-5 of the block's largest
// value), so a score differs from the fp32 one by rounding of that order. out: query_code_bytes(hd) bytes (hi codes,
// lo codes, then per block s, s / 254 and the offsets -128 sum hi, -128 sum lo as int32).
inline int64_t query_code_bytes(int64_t hd) { return 2 * hd + 16 * (hd / 32); }
void query_codes_vnni(const float* q, int64_t hd, int8_t* out);
#undef FBS_HEAD_DECL
#undef FBS_GROUP_DECL
#endif

// K/V of b rows (row i, KV head g at K + i * ks0 + g * ks1, hd floats) written at slot L[i] of cache row I[i] of
// KC / VC, whose elements are of type kt (rounded to nearest even when half; int8: Entry<int8_t>). KF (Hkv, hd), or
// null: the key factors; each key is stored divided by its head's (fbs.engine.quant.key_factors).
void write_kv(const float* K, int64_t ks0, int64_t ks1, const float* V, int64_t vs0, int64_t vs1, int64_t b,
              const int64_t* I, const int64_t* L, void* KC, void* VC, at::ScalarType kt, int64_t Hkv, int64_t C,
              int64_t hd, const float* KF = nullptr);
// The key factors of a cache (fbs.engine.quant.key_factors: powers of two, (Hkv, 1, hd) fp32): keys are stored
// divided by them and queries attend multiplied by them (the same products q . k, exactly). Checked; null if none.
const float* key_factors(const std::optional<at::Tensor>& kf, int64_t hkv, int64_t hd, const char* who);
// A key of hd values as its cache stores it before rounding: divided by its KV head's factors f (hd), into out.
void divide_key(const float* k, const float* f, int64_t hd, float* out);
// Queries of H heads (hd each, side by side) multiplied by their KV head's key factors KF (Hkv, hd), in place.
void scale_queries(float* q, const float* KF, int64_t H, int64_t Hkv, int64_t hd);
// One entry of n fp32 values stored at dst as an entry of type kt (Entry: entry_width(kt, n) elements)
void store(const float* src, int64_t n, void* dst, at::ScalarType kt);

// An accumulated-attention buffer's data, checked: (B, Hkv, C) contiguous fp32 on the CPU, the shape of the cache kc
// (B, Hkv, C, W); otherwise an error naming ``who``.
float* acc_data(const at::Tensor& acc, const at::Tensor& kc, const char* who);

// m queries (row j, head h at Q + j * qs0 + h * qs1) attend over slots 0..L[j] of cache row I[j] (GQA); O (m, H * hd),
// the heads side by side; KC / VC of element type kt. ACC (B, Hkv, C) fp32, or null: each query's attention weights
// (softmax(scale q . K) over slots 0..L[j]) are added to ACC[I[j], g(h), slot], summed over the queries and the
// query heads of each KV head: what a cache policy that keeps accumulated attention reads (H2O,
// fbs.engine.kvpolicy.attend_scored). The weights are the softmax numerators of this same pass, kept per key range
// and scaled by the merged softmax (no second pass over the keys); tasks are then per (cache row, KV head).
// TREE (null: none): the queries' token-tree visibility (Tree, indexed by query j); not with ACC.
void attend(const float* Q, int64_t qs0, int64_t qs1, const int64_t* I, const int64_t* L, int64_t m, int64_t H,
            const void* KC, const void* VC, at::ScalarType kt, int64_t Hkv, int64_t C, int64_t hd, float scale,
            int64_t isa, float* O, float* ACC = nullptr, const Tree* TREE = nullptr);
}  // namespace fbs_attn

namespace fbs_attn {
// Whether an int8 cache's scores are integer products (query_codes_vnni): the CPU has AVX-512 BW and VNNI and they
// are not turned off (attention_int8_scores(false), fbs.native.int8_scores).
bool int8_scores();
}  // namespace fbs_attn
// Turns the integer scores on or off (on given), then returns int8_scores(). See fbs.native.int8_scores.
bool attention_int8_scores(std::optional<bool> on);

// See fbs.native.attend_one.
at::Tensor attend_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                      const at::Tensor& vc, const at::Tensor& idx, const at::Tensor& slots, double scale, int64_t isa,
                      const std::optional<at::Tensor>& acc, const std::optional<at::Tensor>& kf);
