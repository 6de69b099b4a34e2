// Block-quantized activation products (quant.h): activation quantization, the threaded loop over tiles, ATen entries.
#include "quant.h"

#include <ATen/Parallel.h>

namespace fbs_quant {
int64_t block_bytes(int64_t kind) { return kind == kI8Channel ? 512 : kind == kQ8Block ? 512 + 32 : 256 + 64; }

void quantize(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* d, float* ds, float* c) {
#ifdef FBS_X86
  static const bool wide = fbs::best_isa() >= fbs::kIsaAvx512;
  if (wide && K % kBlock == 0) {
    quantize_avx512(x, M, K, ldx, q, d, ds, c);
    return;
  }
#endif
  const int64_t Kp = (K + kBlock - 1) / kBlock * kBlock, Kb = Kp / kBlock;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    double cc = 0.0;
    for (int64_t b = 0; b < Kb; ++b) {
      const int64_t k0 = b * kBlock, k1 = std::min(K, k0 + kBlock);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xm[k]));
      const float db = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t k = k0; k < k0 + kBlock; ++k) {
        const int8_t v = k < k1 ? int8_t(std::nearbyint(xm[k] * inv)) : 0;  // |v| <= 127: no clamp needed
        q[m * Kp + k] = v;
        sum += v;
      }
      d[m * Kb + b] = db;
      ds[m * Kb + b] = db * float(sum);
      cc += double(db) * double(sum);
    }
    c[m] = float(128.0 * cc);
  }
}

void mm(const Act& a, const uint8_t* P, const float* S, int64_t kind, int64_t N, float* Y, int64_t ldy, int64_t isa) {
#ifdef FBS_X86
  const int64_t T = (N + kTile - 1) / kTile, tile = (a.Kp / kBlock) * block_bytes(kind);
  const auto run = isa == fbs::kIsaAvx512Vnni ? tile_vnni512 : tile_avx2;
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) run(a, P + t * tile, S, kind, Y, ldy, N, t * kTile);
  });
#endif
}
}  // namespace fbs_quant

int64_t quant_isa() {
#ifdef FBS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni") &&
      __builtin_cpu_supports("fma"))
    return fbs::kIsaAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return fbs::kIsaAvx2;
#endif
  return fbs::kIsaNone;
}

std::vector<at::Tensor> quant_activations(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "fbs quantized products: x must be an (M, K) fp32 CPU tensor with unit last stride");
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + 31) / 32 * 32, Kb = Kp / 32;
  auto q = at::empty({M, Kp}, x.options().dtype(at::kChar));
  auto d = at::empty({M, Kb}, x.options()), ds = at::empty({M, Kb}, x.options()), c = at::empty({M}, x.options());
  fbs_quant::quantize(x.data_ptr<float>(), M, K, x.stride(0), q.data_ptr<int8_t>(), d.data_ptr<float>(),
                      ds.data_ptr<float>(), c.data_ptr<float>());
  return {q, d, ds, c};
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& scales,
                        int64_t kind, int64_t n, int64_t isa) {
  using namespace fbs_quant;
  TORCH_CHECK(kind >= kI8Channel && kind <= kQ4Block, "fbs quantized products: unknown weight kind ", kind);
  TORCH_CHECK(
      (isa == fbs::kIsaAvx2 && quant_isa() != fbs::kIsaNone) || (isa == fbs::kIsaAvx512Vnni && quant_isa() == isa),
      "fbs quantized products: instruction set ", isa, " not available here");
  auto qa = quant_activations(x);
  const int64_t M = x.size(0), Kp = qa[0].size(1), T = (n + kTile - 1) / kTile;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == T * (Kp / kBlock) * block_bytes(kind),
              "fbs quantized products: packed size ", packed.numel(), " does not match N = ", n, ", K = ", x.size(1));
  const float* S = nullptr;
  if (kind == kI8Channel) {
    TORCH_CHECK(
        scales && scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->numel() == T * kTile,
        "fbs quantized products: per-channel weights need (N padded to 16,) fp32 scales");
    S = scales->data_ptr<float>();
  }
  auto y = at::empty({M, n}, x.options());
  const Act a{
      qa[0].data_ptr<int8_t>(), qa[1].data_ptr<float>(), qa[2].data_ptr<float>(), qa[3].data_ptr<float>(), M, Kp};
  mm(a, packed.data_ptr<uint8_t>(), S, kind, n, y.data_ptr<float>(), n, isa);
  return y;
}
