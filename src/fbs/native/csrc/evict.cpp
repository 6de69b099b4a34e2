// H2O's one-token eviction in place (evict.h): a few hundred bytes moved per (row, KV head), where the PyTorch
// version spends about twenty tensor operations per layer and step.
#include "evict.h"

#include "attention.h"

void h2o_evict(at::Tensor& kc, at::Tensor& vc, at::Tensor& acc, at::Tensor& pos, const at::Tensor& idx,
               const at::Tensor& old, int64_t h, int64_t budget) {
  fbs_attn::check_kv_type(kc.scalar_type(), "fbs H2O eviction");
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes() &&
                  kc.scalar_type() == vc.scalar_type() && kc.device().is_cpu(),
              "fbs H2O eviction: caches (B, Hkv, C, W) contiguous CPU tensors of one shape and dtype");
  // an entry moves as one row of W elements (an int8 entry with its scale: attention.h, Entry)
  const int64_t B = kc.size(0), Hkv = kc.size(1), C = kc.size(2), W = kc.size(3);
  TORCH_CHECK(acc.scalar_type() == at::kFloat && pos.scalar_type() == at::kLong && acc.is_contiguous() &&
                  pos.is_contiguous() && acc.sizes() == at::IntArrayRef({B, Hkv, C}) && acc.sizes() == pos.sizes(),
              "fbs H2O eviction: acc (fp32) and pos (int64) must be (B, Hkv, C) contiguous");
  TORCH_CHECK(idx.scalar_type() == at::kLong && old.scalar_type() == at::kLong && idx.numel() == old.numel(),
              "fbs H2O eviction: idx and old int64 of one length");
  TORCH_CHECK(h >= 0 && h < budget && budget < C, "fbs H2O eviction: need 0 <= h < budget < capacity");
  const int64_t es = kc.element_size(), row = W * es;
  auto* K = static_cast<char*>(kc.data_ptr());
  auto* V = static_cast<char*>(vc.data_ptr());
  float* A = acc.data_ptr<float>();
  int64_t* P = pos.data_ptr<int64_t>();
  const int64_t* I = idx.data_ptr<int64_t>();
  const int64_t* O = old.data_ptr<int64_t>();
  auto move = [&](int64_t base, int64_t src, int64_t dst) {
    if (src == dst) return;
    std::memcpy(K + (base + dst) * row, K + (base + src) * row, row);
    std::memcpy(V + (base + dst) * row, V + (base + src) * row, row);
    A[base + dst] = A[base + src];
    P[base + dst] = P[base + src];
  };
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(I[i] >= 0 && I[i] < B && O[i] >= h && O[i] < budget, "fbs H2O eviction: row or ring slot out of range");
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t base = (I[i] * Hkv + g) * C;
      const float* a = A + base;
      int64_t victim = O[i];
      if (h > 0) {
        int64_t w = 0;
        for (int64_t s = 1; s < h; ++s)
          if (a[s] < a[w]) w = s;
        if (!(a[O[i]] < a[w])) victim = w;
      }
      move(base, O[i], victim);
      move(base, budget, O[i]);
      A[base + budget] = 0.f;
    }
  }
}
