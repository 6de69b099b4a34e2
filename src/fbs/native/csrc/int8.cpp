// int8 weight-only products (int8.h): the instruction-set choice, the threaded loop over tiles, the ATen entry.
#include "int8.h"

#include <ATen/Parallel.h>

namespace fbs {
int64_t best_isa() {
#ifdef FBS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return kIsaAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kIsaAvx2;
#endif
  return kIsaNone;
}
}  // namespace fbs

namespace fbs_int8 {
void mm(const float* X, int64_t M, int64_t Kp, const int8_t* P, const uint16_t* S, int64_t N, float* Y, int64_t isa) {
#ifdef FBS_X86
  const int64_t T = (N + kNB - 1) / kNB, nc = Kp / kChunk, tile_bytes = kNB * Kp;
  const auto tile_rows = isa == fbs::kIsaAvx512 ? tile_rows_avx512 : tile_rows_avx2;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tile_rows(X, M, Kp, P + t * tile_bytes, nc, S, Y, N, t * kNB);
  });
#endif
}
}  // namespace fbs_int8

int64_t int8_isa() { return fbs::best_isa(); }

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& p, const at::Tensor& s, int64_t isa) {
  using namespace fbs_int8;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "fbs int8 kernel: x must be a contiguous (M, K) fp32 CPU tensor");
  TORCH_CHECK(p.scalar_type() == at::kChar && p.dim() == 1 && p.is_contiguous(),
              "fbs int8 kernel: packed int8 weights");
  TORCH_CHECK(s.scalar_type() == at::kBFloat16 && s.dim() == 1 && s.is_contiguous(),
              "fbs int8 kernel: (N,) bf16 scales");
  const int64_t M = x.size(0), Kp = x.size(1), N = s.size(0), T = (N + kNB - 1) / kNB;
  TORCH_CHECK(Kp % kChunk == 0 && p.numel() == T * kNB * Kp, "fbs int8 kernel: packed size ", p.numel(),
              " does not match N = ", N, ", padded K = ", Kp);
  TORCH_CHECK(isa >= fbs::kIsaAvx2 && isa <= fbs::best_isa(), "fbs int8 kernel: instruction set ", isa,
              " not available here");
  auto y = at::empty({M, N}, x.options());
  mm(x.data_ptr<float>(), M, Kp, p.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>()), N,
     y.data_ptr<float>(), isa);
  return y;
}
