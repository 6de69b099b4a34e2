// A measurement probe, not part of the library: the compute cost of the native q4 decode tiles (quant_vnni512.cpp,
// included as it is) per 16-channel x 32-input block, for 1 to 8 rows, one thread, on weights that stay in L2 (a
// few tiles timed over and over), so that no memory time hides in it. tile(): rows 1-8 through tile_vnni512 (the
// path of 1-4 rows in the engine); Rows8: tile_rows8_vnni512 (5-15 rows). scripts/probe_tiles.py builds and runs it.
#include "../src/fbs/native/csrc/arch/x86/quant_vnni512.cpp"

#include <chrono>
#include <random>

namespace probe {
using namespace fbs_quant;

// [rows, ns per tile-block through tile(), through Rows8 (0 below kRows8Min)] for rows 1..8
at::Tensor probe_tiles(int64_t k, int64_t tiles, int64_t reps) {
  TORCH_CHECK(k % kBlock == 0 && tiles > 0 && reps > 0, "probe: k a multiple of 32, positive tiles and reps");
  const int64_t Kb = k / kBlock, tb = Kb * block_bytes(kQ4Block), N = tiles * kTile;
  std::mt19937 g(0);
  std::vector<uint8_t> P(tiles * tb);
  for (auto& b : P) b = uint8_t(g());
  const uint16_t h = 0x211F;  // fp16 0.01: every block's scale and min
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < Kb; ++b)
      for (int c = 0; c < 32; ++c) std::memcpy(&P[t * tb + b * 320 + 256 + 2 * c], &h, 2);
  auto out = at::zeros({8, 3}, at::kDouble);
  const auto time = [&](const std::function<void()>& f) {
    double best = 1e30;
    for (int64_t r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best / double(tiles * Kb) * 1e9;
  };
  for (int64_t M = 1; M <= 8; ++M) {
    std::vector<int8_t> q(M * k);
    for (auto& v : q) v = int8_t(int(g() % 255) - 127);
    std::vector<float> d(M * Kb, 0.01f), ds(M * Kb, 0.5f), c(M, 1.f), Y(M * N);
    const Act a{q.data(), d.data(), ds.data(), c.data(), M, k};
    out[M - 1][0] = double(M);
    out[M - 1][1] = time([&] {
      for (int64_t t = 0; t < tiles; ++t) tile_vnni512(a, P.data() + t * tb, nullptr, kQ4Block, Y.data(), N, N, t * kTile);
    });
    if (M >= kRows8Min) {  // the activations in one Rows8 group (rows interleaved per block)
      std::vector<int8_t> q8(Kb * kManyRows * kBlock, 0);
      std::vector<float> d8(Kb * kManyRows, 0.f), ds8(Kb * kManyRows, 0.f);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < Kb; ++b) {
          std::memcpy(&q8[(b * kManyRows + r) * kBlock], &q[r * k + b * kBlock], kBlock);
          d8[b * kManyRows + r] = d[r * Kb + b];
          ds8[b * kManyRows + r] = ds[r * Kb + b];
        }
      const Rows8 rows{q8.data(), d8.data(), ds8.data(), M, Kb};
      out[M - 1][2] = time([&] {
        for (int64_t t = 0; t < tiles; ++t) tile_rows8_vnni512(rows, P.data() + t * tb, kQ4Block, 1, tb, Y.data(), N, N, t * kTile);
      });
    }
  }
  return out;
}
}  // namespace probe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe_tiles", &probe::probe_tiles); }
