// The causal prompt attention (causal.h): the keys transposed once per KV head, the query blocks paired early with
// late and split across threads, the ATen entry.
#include "causal.h"

#include <ATen/Parallel.h>

bool causal_available() {
#ifdef FBS_X86
  return fbs::best_isa() >= fbs::kIsaAvx512;
#else
  return false;
#endif
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  using namespace fbs_causal;
  TORCH_CHECK(causal_available(), "fbs causal attention: needs AVX-512 (check fbs.native.status())");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->dim() == 4 && t->stride(3) == 1,
                "fbs causal attention: q, k, v must be 4-d fp32 CPU tensors with a unit last stride");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && S >= T && k.size(3) == hd && Hkv > 0 && H % Hkv == 0,
              "fbs causal attention: k and v (B, Hkv, S >= T, hd) with H a multiple of Hkv, got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(hd % 16 == 0 && hd <= 256, "fbs causal attention: head dim a multiple of 16 up to 256, got ", hd);
  auto out = at::empty({B, T, H, hd}, q.options());
  if (T == 0) return out;
#ifdef FBS_X86
  // keys transposed per (row, KV head): (hd, Tp) zero padded, the row stride one line more than the keys (a stride
  // of 2 KB would put a key block's 64 rows in a few L1 sets)
  // the queries are the last T of the S keys' positions: query p sees keys 0 .. off + p
  const int64_t G = H / Hkv, off = S - T, Tp = (S + kKeys - 1) / kKeys * kKeys + 16, nb = (T + kQueryPos - 1) / kQueryPos;
  std::vector<float> Kt(B * Hkv * hd * Tp, 0.f);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const float* kk = k.data_ptr<float>() + (s / Hkv) * k.stride(0) + (s % Hkv) * k.stride(1);
      float* kt = Kt.data() + s * hd * Tp;
      for (int64_t t = 0; t < S; ++t)
        for (int64_t d = 0; d < hd; ++d) kt[d * Tp + t] = kk[t * k.stride(2) + d];
    }
  });
  // tasks: (row, KV head, block pair i: blocks i and nb - 1 - i), each about the same number of keys
  const int64_t pairs = (nb + 1) / 2, tasks = B * Hkv * pairs;
  const float sc = float(scale);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> Q(kQueryPos * G * hd);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = t / pairs, i = t % pairs, b = s / Hkv, g = s % Hkv;
      const float* vv = v.data_ptr<float>() + b * v.stride(0) + g * v.stride(1);
      auto run = [&](int64_t blk) {
        const int64_t p0 = blk * kQueryPos, p1 = std::min(T, p0 + kQueryPos);
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t h = 0; h < G; ++h) {
            const float* src = q.data_ptr<float>() + b * q.stride(0) + (g * G + h) * q.stride(1) + p * q.stride(2);
            float* dst = Q.data() + ((p - p0) * G + h) * hd;
            for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * sc;
          }
        block_avx512(Q.data(), G, off + p0, off + p1, Kt.data() + s * hd * Tp, Tp, vv, v.stride(2), hd,
                     out.data_ptr<float>() + (b * T + p0) * H * hd + g * G * hd, H * hd);
      };
      run(i);
      if (nb - 1 - i != i) run(nb - 1 - i);
    }
  });
#endif
  return out;
}
