// Block-quantized activation products (quant.h): activation quantization, the threaded loop over tiles, ATen entries.
#include "quant.h"

#include <ATen/Parallel.h>

namespace fbs_quant {
int64_t block_bytes(int64_t kind) { return kind == kI8Channel ? 512 : kind == kQ8Block ? 512 + 32 : 256 + 64; }

void quantize(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* d, float* ds, float* c) {
  if (M >= kManyMin && at::get_num_threads() > 1 && !at::in_parallel_region()) {  // a prompt: rows split across threads
    const int64_t Kp = (K + kBlock - 1) / kBlock * kBlock, Kb = Kp / kBlock;
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      quantize(x + m0 * ldx, m1 - m0, K, ldx, q + m0 * Kp, d + m0 * Kb, ds + m0 * Kb, c + m0);
    });
    return;
  }
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

void mm(const Act& a, const uint8_t* P, const float* S, int64_t kind, int64_t N, float* Y, int64_t ldy, int64_t isa,
        const std::function<void(int64_t, int64_t)>* after) {
#ifdef FBS_X86
  const int64_t T = (N + kTile - 1) / kTile, tile = (a.Kp / kBlock) * block_bytes(kind);
  // VNNI, several rows: the rows interleaved per 8 (Rows8, one pointer per group); a prompt's rows (>= kManyMin) take
  // the many-row path, a few rows (kRows8Min .. kManyMin - 1: a batch, a long verified draft) the decode tile over
  // Rows8 (threads split by pairs of tiles); fewer rows (a short draft) tile()'s own loop below
  const bool few = a.M < kManyMin;
  if (isa == fbs::kIsaAvx512Vnni && (kind == kQ4Block || kind == kQ8Block) && a.M >= kRows8Min) {
    const int64_t Kb = a.Kp / kBlock, G = (a.M + kManyRows - 1) / kManyRows, gs = Kb * kManyRows;
    std::vector<int8_t> q(G * gs * kBlock, 0);
    std::vector<float> d(G * gs, 0.f), ds(G * gs, 0.f);
    at::parallel_for(0, a.M, kManyRows, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t o = (r / kManyRows) * gs + r % kManyRows;
        for (int64_t b = 0; b < Kb; ++b) {
          std::memcpy(q.data() + (o + b * kManyRows) * kBlock, a.q + r * a.Kp + b * kBlock, kBlock);
          d[o + b * kManyRows] = a.d[r * Kb + b];
          ds[o + b * kManyRows] = a.ds[r * Kb + b];
        }
      }
    });
    const Rows8 rows{q.data(), d.data(), ds.data(), a.M, Kb};
    if (few) {
      const int64_t pairs = (T + 1) / 2;  // tiles two at a time (the last alone when T is odd)
      at::parallel_for(0, pairs, 2, [&](int64_t p0, int64_t p1) {
        for (int64_t i = p0; i < p1; ++i)
          tile_rows8_vnni512(rows, P + 2 * i * tile, kind, std::min<int64_t>(2, T - 2 * i), tile, Y, ldy, N,
                             2 * i * kTile);
        if (after) (*after)(2 * p0 * kTile, std::min(N, 2 * p1 * kTile));
      });
      return;
    }
    const int64_t pairs = (T + 1) / 2;  // tiles two at a time (the last alone when T is odd)
    at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t m0 = 0; m0 < a.M; m0 += kManyChunk)
        for (int64_t i = p0; i < p1; ++i)
          tile_many_vnni512(rows, P + 2 * i * tile, kind, std::min<int64_t>(2, T - 2 * i), tile, Y, ldy, N,
                            2 * i * kTile, m0, std::min(a.M, m0 + kManyChunk));
      if (after) (*after)(2 * p0 * kTile, std::min(N, 2 * p1 * kTile));
    });
    return;
  }
  const auto run = isa == fbs::kIsaAvx512Vnni ? tile_vnni512 : tile_avx2;
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) run(a, P + t * tile, S, kind, Y, ldy, N, t * kTile);
    if (after) (*after)(t0 * kTile, std::min(N, t1 * kTile));
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
