// The weight formats of a native layer (packed.h): construction checks and the product dispatch.
#include "packed.h"

#include <ATen/Parallel.h>

#include "int8.h"
#include "lowrank.h"
#include "norm.h"
#include "quant.h"

namespace fbs_packed {
namespace {
constexpr int64_t kParallelLowrank = 16384;  // r x k from which A's dot products are split over the threads

// T (M, r) = X (M, k) A^T: the first half of w's low-rank delta, each row's sums in the same order whatever M is
void lowrank_t(const Packed& w, const float* X, int64_t M, float* T, int64_t isa) {
  const int64_t r = w.la.size(0);
  const c10::Half* A = w.la_h;
  const auto dots = [&](int64_t i0, int64_t i1) {  // rows i0 .. i1 - 1 of A: those columns of T
    fbs_lowrank::dots(A + i0 * w.k, X, M, i1 - i0, w.k, T + i0, r, isa);
  };
  if (at::get_num_threads() > 1 && !at::in_parallel_region() && r * w.k >= kParallelLowrank)
    at::parallel_for(0, r, 4, dots);
  else
    dots(0, r);
}

// Y[:, j0:j1] += T Bt[:, j0:j1]: the second half, for the columns a thread of the product computed
void lowrank_add(const Packed& w, const float* T, int64_t M, float* Y, int64_t j0, int64_t j1, int64_t isa) {
  const int64_t r = w.la.size(0);
  fbs_lowrank::add(T, M, r, w.lbt_h, w.n, j0, j1, w.lrows.data(), Y, isa);
}
}  // namespace

void Packed::set_lowrank(at::Tensor a, at::Tensor bt) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat && a.is_contiguous() &&
                  bt.is_contiguous() && a.device().is_cpu() && bt.device().is_cpu() && a.dim() == 2 && bt.dim() == 2 &&
                  a.size(0) == bt.size(0) && a.size(1) == k && bt.size(1) == n,
              "fbs packed weight: a low-rank delta needs contiguous fp32 CPU A (r, ", k, ") and scale * B^T (r, ", n,
              "), got ", a.sizes(), " and ", bt.sizes());
  la = a.to(at::kHalf).contiguous();
  lbt = bt.to(at::kHalf).contiguous();
  la_h = la.data_ptr<at::Half>();
  lbt_h = lbt.data_ptr<at::Half>();
  TORCH_CHECK(la.to(at::kFloat).equal(a) && lbt.to(at::kFloat).equal(bt),
              "fbs packed weight: the low-rank factors must be fp16 values (fbs.engine.quant.Weight rounds them)");
  // per kCols columns, the rows of Bt that are not all zero there (first to last)
  const int64_t r = bt.size(0), chunks = (n + fbs_lowrank::kCols - 1) / fbs_lowrank::kCols;
  const float* B = bt.data_ptr<float>();
  lrows.assign(2 * chunks, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    int32_t lo = int32_t(r), hi = 0;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = c * fbs_lowrank::kCols; j < std::min(n, (c + 1) * fbs_lowrank::kCols); ++j)
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
  // the delta's first half before the product (T, M x r), its second half by the product's threads, each on the
  // columns it computed (no second pass over Y, no second split over the threads)
  thread_local std::vector<float> t;
  const float* T = nullptr;
  if (la.defined()) {
    t.resize(M * la.size(0));
    lowrank_t(*this, X, M, t.data(), isa);
    T = t.data();
  }
  if (kind == kInt8F32) {
    fbs_int8::mm(X, M, k, p.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>()), n, Y,
                 isa);
    if (T) lowrank_add(*this, T, M, Y, 0, n, isa);
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
  const std::function<void(int64_t, int64_t)> delta = [&](int64_t j0, int64_t j1) {
    lowrank_add(*this, T, M, Y, j0, j1, qisa);
  };
  fbs_quant::mm(a, p.data_ptr<uint8_t>(), s.defined() ? s.data_ptr<float>() : nullptr, kind, n, Y, n, qisa,
                T ? &delta : nullptr);
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
