// One-query attention over the static KV cache (attention.h): the portable head, the K/V write, the threaded
// dispatch over (row, head), and the ATen entry.
#include "attention.h"

#include <ATen/Parallel.h>

namespace fbs_attn {
void head_scalar(const float* q, const float* K, const float* V, int64_t n, int64_t hd, float scale, float* p,
                 float* o) {
  for (int64_t j = 0; j < n; ++j) {
    float a = 0.f;
    for (int64_t d = 0; d < hd; ++d) a += q[d] * K[j * hd + d];
    p[j] = a * scale;
  }
  float z;
  softmax_(p, n, &z);
  for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < hd; ++d) o[d] += p[j] * V[j * hd + d];
  for (int64_t d = 0; d < hd; ++d) o[d] /= z;
}

void write_kv(const float* K, int64_t ks0, int64_t ks1, const float* V, int64_t vs0, int64_t vs1, int64_t b,
              const int64_t* I, const int64_t* L, float* KC, float* VC, int64_t Hkv, int64_t C, int64_t hd) {
  const int64_t rs = Hkv * C * hd, hs = C * hd;  // cache row and head strides
  for (int64_t i = 0; i < b; ++i)
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t at_ = I[i] * rs + g * hs + L[i] * hd;
      std::copy_n(K + i * ks0 + g * ks1, hd, KC + at_);
      std::copy_n(V + i * vs0 + g * vs1, hd, VC + at_);
    }
}

void attend(const float* Q, int64_t qs0, int64_t qs1, const int64_t* I, const int64_t* L, int64_t m, int64_t H,
            const float* KC, const float* VC, int64_t Hkv, int64_t C, int64_t hd, float scale, int64_t isa, float* O) {
  auto head = head_scalar;
#ifdef FBS_X86
  if (isa == fbs::kIsaAvx512 && hd % 16 == 0 && hd <= kMaxHd)
    head = head_avx512;
  else if (isa >= fbs::kIsaAvx2 && hd % 8 == 0 && hd <= kMaxHd)
    head = head_avx2;
#endif
  const int64_t rs = Hkv * C * hd, hs = C * hd, group = H / Hkv;
  at::parallel_for(0, m * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(C);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j = t / H, h = t % H;
      const int64_t kv = I[j] * rs + (h / group) * hs;
      head(Q + j * qs0 + h * qs1, KC + kv, VC + kv, L[j] + 1, hd, scale, p.data(), O + j * H * hd + h * hd);
    }
  });
}
}  // namespace fbs_attn

at::Tensor attend_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                      const at::Tensor& vc, const at::Tensor& idx, const at::Tensor& slots, double scale, int64_t isa) {
  for (const at::Tensor* t : {&q, &k, &v, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(-1) == 1 && t->device().is_cpu(),
                "fbs attention kernel: 4-d fp32 CPU tensors with a unit last stride");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes(), "fbs attention kernel: caches");
  TORCH_CHECK(idx.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "fbs attention kernel: int64 rows");
  const int64_t b = q.size(0), H = q.size(1), hd = q.size(3), Hkv = kc.size(1), C = kc.size(2);
  TORCH_CHECK(H % Hkv == 0 && k.size(1) == Hkv && kc.size(3) == hd, "fbs attention kernel: head shapes");
  const int64_t* I = idx.data_ptr<int64_t>();
  const int64_t* L = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(I[i] >= 0 && I[i] < kc.size(0) && L[i] >= 0 && L[i] < C, "fbs attention kernel: slot out of range");
  fbs_attn::write_kv(k.data_ptr<float>(), k.stride(0), k.stride(1), v.data_ptr<float>(), v.stride(0), v.stride(1), b, I,
                     L, kc.data_ptr<float>(), vc.data_ptr<float>(), Hkv, C, hd);
  auto out = at::empty({b, 1, H * hd}, q.options());
  fbs_attn::attend(q.data_ptr<float>(), q.stride(0), q.stride(1), I, L, b, H, kc.data_ptr<float>(),
                   vc.data_ptr<float>(), Hkv, C, hd, float(scale), isa, out.data_ptr<float>());
  return out;
}
