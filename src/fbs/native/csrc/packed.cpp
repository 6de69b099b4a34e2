// The weight formats of a native layer (packed.h): construction checks and the product dispatch.
#include "packed.h"

#include <ATen/Parallel.h>

#include "int8.h"
#include "norm.h"
#include "quant.h"

namespace fbs_packed {
namespace {
constexpr int64_t kCols = 16;                // output columns a low-rank pass keeps in registers
constexpr int64_t kParallelLowrank = 16384;  // r x n from which a delta's columns are split over the threads

// y (n) += sum_i t[i] B[i] (B: r rows of n values, row stride ld), per column the sum over i in order, then added
// once: B's r rows are read once, y once. rows: per kCols columns the range [lo, hi) of the rows that are not all
// zero there (a delta stacked from several adapters is block-diagonal); the rows outside add exact zeros, skipped.
__attribute__((target_clones("avx512f", "avx2", "default"))) void add_lowrank(const float* t, const float* B,
                                                                              int64_t ld, int64_t n,
                                                                              const int32_t* rows, float* y) {
  typedef float v16 __attribute__((vector_size(4 * kCols)));  // kCols floats (GCC's generic vectors)
  int64_t j = 0;
  for (; j + kCols <= n; j += kCols, rows += 2) {
    v16 acc = {}, b, yv;
    for (int64_t i = rows[0]; i < rows[1]; ++i) {
      std::memcpy(&b, B + i * ld + j, sizeof b);
      acc += t[i] * b;
    }
    std::memcpy(&yv, y + j, sizeof yv);
    yv += acc;
    std::memcpy(y + j, &yv, sizeof yv);
  }
  for (; j < n; ++j) {
    float acc = 0.f;
    for (int64_t i = rows[0]; i < rows[1]; ++i) acc += t[i] * B[i * ld + j];
    y[j] += acc;
  }
}

// Y (M, n) += (X (M, k) A^T) Bt: the low-rank delta of a weight; a row's sums in the same order whatever M is. A
// wide factor is split over the threads: A's rows (q + k + v: 24 x 576) or Bt's columns (gate + up: 16 x 3,072); each
// sum is the same whichever part it falls in.
void lowrank(const Packed& w, const float* X, int64_t M, float* Y) {
  const int64_t r = w.la.size(0);
  const float* A = w.la.data_ptr<float>();
  const float* Bt = w.lbt.data_ptr<float>();
  const int32_t* rows = w.lrows.data();
  const bool threads = at::get_num_threads() > 1 && !at::in_parallel_region();
  thread_local std::vector<float> t;
  t.resize(M * r);
  float* T = t.data();
  const auto dots = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t m = 0; m < M; ++m) T[m * r + i] = fbs_norm::dot(X + m * w.k, A + i * w.k, w.k);
  };
  if (threads && r * w.k >= kParallelLowrank)
    at::parallel_for(0, r, 4, dots);
  else
    dots(0, r);
  if (threads && w.n * r >= kParallelLowrank) {
    at::parallel_for(0, (w.n + kCols - 1) / kCols, 32, [&](int64_t c0, int64_t c1) {
      const int64_t j0 = c0 * kCols, j1 = std::min(w.n, c1 * kCols);
      for (int64_t m = 0; m < M; ++m) add_lowrank(T + m * r, Bt + j0, w.n, j1 - j0, rows + 2 * c0, Y + m * w.n + j0);
    });
    return;
  }
  for (int64_t m = 0; m < M; ++m) add_lowrank(T + m * r, Bt, w.n, w.n, rows, Y + m * w.n);
}
}  // namespace

void Packed::set_lowrank(at::Tensor a, at::Tensor bt) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat && a.is_contiguous() &&
                  bt.is_contiguous() && a.device().is_cpu() && bt.device().is_cpu() && a.dim() == 2 && bt.dim() == 2 &&
                  a.size(0) == bt.size(0) && a.size(1) == k && bt.size(1) == n,
              "fbs packed weight: a low-rank delta needs contiguous fp32 CPU A (r, ", k, ") and scale * B^T (r, ", n,
              "), got ", a.sizes(), " and ", bt.sizes());
  la = a;
  lbt = bt;
  // per kCols columns, the rows of Bt that are not all zero there (first to last)
  const int64_t r = bt.size(0), chunks = (n + kCols - 1) / kCols;
  const float* B = bt.data_ptr<float>();
  lrows.assign(2 * chunks, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    int32_t lo = int32_t(r), hi = 0;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = c * kCols; j < std::min(n, (c + 1) * kCols); ++j)
        if (B[i * n + j] != 0.f) {
          lo = std::min(lo, int32_t(i));
          hi = std::max(hi, int32_t(i + 1));
        }
    lrows[2 * c] = lo < hi ? lo : 0;
    lrows[2 * c + 1] = lo < hi ? hi : 0;
  }
}

Packed make(int64_t kind, at::Tensor p, std::optional<at::Tensor> s, int64_t n, int64_t k) {
  using namespace fbs_quant;
  TORCH_CHECK(n > 0 && k > 0 && p.dim() == 1 && p.is_contiguous() && p.device().is_cpu(),
              "fbs packed weight: a 1-D contiguous CPU tensor of packed bytes and positive (n, k)");
  Packed w{kind, n, k, p, at::Tensor()};
  if (kind == kInt8F32) {
    TORCH_CHECK(k % fbs_int8::kChunk == 0, "fbs packed weight: int8 input width ", k, " is not a multiple of 16");
    TORCH_CHECK(s && s->scalar_type() == at::kBFloat16 && s->is_contiguous() && s->numel() == n,
                "fbs packed weight: int8 needs (n,) bf16 scales");
    TORCH_CHECK(
        p.scalar_type() == at::kChar && p.numel() == (n + fbs_int8::kNB - 1) / fbs_int8::kNB * fbs_int8::kNB * k,
        "fbs packed weight: int8 packed size ", p.numel(), " does not match (", n, ", ", k, ")");
    w.s = *s;
    return w;
  }
  TORCH_CHECK(kind >= kI8Channel && kind <= kQ4Block, "fbs packed weight: unknown kind ", kind);
  const int64_t tiles = (n + kTile - 1) / kTile, kb = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(p.scalar_type() == at::kByte && p.numel() == tiles * kb * block_bytes(kind),
              "fbs packed weight: packed size ", p.numel(), " does not match (", n, ", ", k, ") of kind ", kind);
  if (kind == kI8Channel) {
    TORCH_CHECK(s && s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == tiles * kTile,
                "fbs packed weight: per-channel int8 needs fp32 scales padded to whole tiles of 16");
    w.s = *s;
  }
  return w;
}

void Packed::mm(const float* X, int64_t M, float* Y, int64_t isa) const {
  if (kind == kInt8F32) {
    fbs_int8::mm(X, M, k, p.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>()), n, Y,
                 isa);
    if (la.defined()) lowrank(*this, X, M, Y);
    return;
  }
  using namespace fbs_quant;
  static const int64_t best = quant_isa();
  const int64_t qisa = isa == fbs::kIsaAvx2 ? fbs::kIsaAvx2 : best;
  TORCH_CHECK(qisa != fbs::kIsaNone, "fbs packed weight: this CPU has no kernel for the block-quantized products");
  const int64_t Kp = (k + kBlock - 1) / kBlock * kBlock, Kb = Kp / kBlock;
  // the quantized activations of this product (the threads of the product read the caller's buffers)
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, ds, c;
  q.resize(M * Kp);
  d.resize(M * Kb);
  ds.resize(M * Kb);
  c.resize(M);
  quantize(X, M, k, k, q.data(), d.data(), ds.data(), c.data());
  const Act a{q.data(), d.data(), ds.data(), c.data(), M, Kp};
  fbs_quant::mm(a, p.data_ptr<uint8_t>(), s.defined() ? s.data_ptr<float>() : nullptr, kind, n, Y, n, qisa);
  if (la.defined()) lowrank(*this, X, M, Y);
}

at::Tensor Packed::linear(const at::Tensor& x, int64_t isa) const {
  TORCH_CHECK(
      x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous() && x.dim() == 2 && x.size(1) == k,
      "fbs packed weight: linear needs contiguous fp32 CPU rows (M, ", k, "), got ", x.sizes());
  auto y = at::empty({x.size(0), n}, x.options());
  mm(x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), isa);
  return y;
}
}  // namespace fbs_packed
