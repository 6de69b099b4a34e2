// A measurement probe, not part of the library: the few-row q4 products of the native kernels (quant_vnni512.cpp,
// included as it is: tile_r8, one tile a call) against an AMX variant (tdpbsud) built here, single-threaded, on
// DRAM-cold weights. scripts/probe_amx.py builds it (torch.utils.cpp_extension), runs it and writes the record.
//
// The AMX variant keeps the library's integer sums and fp32 updates: per 32-input block the q4 nibbles are unpacked
// into a B tile (8 rows of 64 bytes: 16 channels x 4 inputs), the activation codes of the rows (Rows8 layout) are the
// A tile (s8, so tdpbsud: signed A, unsigned B), and the block's int32 sums (a C tile) are stored and scaled as
// tile_r8 does, in the same order: its results are bit for bit the VNNI kernels'. Two channel tiles and two blocks are
// in flight (8 tile registers: A x 2, B x 2, C x 4).
#include "../src/fbs/native/csrc/arch/x86/quant_vnni512.cpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>

namespace probe {
using namespace fbs_quant;

#define PROBE_AMX __attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c,amx-tile,amx-int8")))

struct __attribute__((packed)) TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux: ask for the AMX tile state once per process (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); false if refused.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// tiles 0, 1: A (rows x 32 B); 2, 3: B (8 x 64 B); 4..7: C (rows x 64 B)
PROBE_AMX void configure(int rows) {
  thread_local int current = -1;
  if (current == rows) return;
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t : {0, 1}) c.rows[t] = rows, c.colsb[t] = 32;
  for (int t : {2, 3}) c.rows[t] = 8, c.colsb[t] = 64;
  for (int t : {4, 5, 6, 7}) c.rows[t] = rows, c.colsb[t] = 64;
  asm volatile("" ::: "memory");  // the stores above are read by ldtilecfg, which the compiler does not see
  _tile_loadconfig(&c);
  current = rows;
}

PROBE_AMX inline void unpack(const uint8_t* p, uint8_t* u) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int v = 0; v < 4; ++v) {
    const __m512i raw = _mm512_loadu_si512(p + 64 * v);
    _mm512_store_si512(u + 128 * v, _mm512_and_si512(raw, lo4));
    _mm512_store_si512(u + 128 * v + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4));
  }
}

template <int MB>
PROBE_AMX inline void update(const int32_t* C, const uint8_t* p, const float* d, const float* ds, __m512* af) {
  const __m512 dw = half16(p + 256), mw = half16(p + 288);
  for (int m = 0; m < MB; ++m) {
    af[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C + 16 * m)), _mm512_mul_ps(dw, _mm512_set1_ps(d[m])),
                            af[m]);
    af[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[m]), af[m]);
  }
}

// Two q4 channel tiles (p, p + tb) for the MB rows of Rows8 group 0, channels n0 .. n0 + 31.
template <int MB>
PROBE_AMX void tile_amx(const Rows8& a, const uint8_t* p, int64_t tb, float* Y, int64_t ldy, int64_t n0) {
  const int64_t Kb = a.Kb, bb = 320;
  alignas(64) uint8_t u[2][2][512];
  alignas(64) int32_t C[2][2][16 * 16];
  __m512 af0[MB], af1[MB];
  for (int m = 0; m < MB; ++m) af0[m] = af1[m] = _mm512_setzero_ps();
  const uint8_t* q = p + tb;
  for (int64_t b = 0; b <= Kb; ++b) {
    if (b < Kb) {  // block b's products, issued before block b - 1's sums are read
      prefetch_stream(p + b * bb, bb);
      prefetch_stream(q + b * bb, bb);
      const int e = b & 1;
      unpack(p + b * bb, u[e][0]);
      unpack(q + b * bb, u[e][1]);
      const int8_t* xa = a.q + b * kManyRows * kBlock;
      // the tile registers are immediates of the instructions (the intrinsics paste them into the assembly), so each
      // parity spells its own
      if (e == 0) {
        _tile_loadd(0, xa, 32);
        _tile_loadd(2, u[0][0], 64);
        _tile_zero(4);
        _tile_dpbsud(4, 0, 2);
        _tile_loadd(3, u[0][1], 64);
        _tile_zero(5);
        _tile_dpbsud(5, 0, 3);
      } else {
        _tile_loadd(1, xa, 32);
        _tile_loadd(2, u[1][0], 64);
        _tile_zero(6);
        _tile_dpbsud(6, 1, 2);
        _tile_loadd(3, u[1][1], 64);
        _tile_zero(7);
        _tile_dpbsud(7, 1, 3);
      }
    }
    if (b > 0) {
      const int64_t c = b - 1;
      const int e = c & 1;
      if (e == 0) {
        _tile_stored(4, C[0][0], 64);
        _tile_stored(5, C[0][1], 64);
      } else {
        _tile_stored(6, C[1][0], 64);
        _tile_stored(7, C[1][1], 64);
      }
      update<MB>(C[e][0], p + c * bb, a.d + c * kManyRows, a.ds + c * kManyRows, af0);
      update<MB>(C[e][1], q + c * bb, a.d + c * kManyRows, a.ds + c * kManyRows, af1);
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm512_storeu_ps(Y + m * ldy + n0, af0[m]);
    _mm512_storeu_ps(Y + m * ldy + n0 + 16, af1[m]);
  }
}

// kernel 0: the library's tile_r8, one tile a call; 1: AMX, two tiles a call
template <int MB>
void run(int kernel, const Rows8& a, const uint8_t* P, int64_t T, int64_t tb, float* Y, int64_t N) {
  if (kernel == 0) {
    for (int64_t t = 0; t < T; ++t) tile_r8<MB, false>(a, P + t * tb, Y, N, N, t * kTile, 0);
  } else {
    configure(MB);
    for (int64_t t = 0; t < T; t += 2) tile_amx<MB>(a, P + t * tb, tb, Y, N, t * kTile);
  }
}

void run_rows(int rows, int kernel, const Rows8& a, const uint8_t* P, int64_t T, int64_t tb, float* Y, int64_t N) {
  switch (rows) {
    case 1: run<1>(kernel, a, P, T, tb, Y, N); break;
    case 2: run<2>(kernel, a, P, T, tb, Y, N); break;
    case 4: run<4>(kernel, a, P, T, tb, Y, N); break;
    default: run<8>(kernel, a, P, T, tb, Y, N); break;
  }
}
}  // namespace probe

// For each rows in (1, 2, 4, 8): microseconds per (n, k) q4 product (best of `rounds` passes over `copies` distinct
// weight copies, so that each product reads its weights from DRAM) of the two kernels, and whether the AMX results
// equal the library's bit for bit. Returns rows x [rows, us library, us AMX, equal].
at::Tensor probe_amx(int64_t n, int64_t k, int64_t copies, int64_t rounds) {
  using namespace fbs_quant;
  TORCH_CHECK(n % 32 == 0 && k % 32 == 0, "probe_amx: n and k must be multiples of 32");
  TORCH_CHECK(__builtin_cpu_supports("amx-int8") && probe::amx_permitted(), "probe_amx: this CPU or kernel has no AMX");
  const int64_t Kb = k / kBlock, T = n / kTile, tb = Kb * 320;
  std::vector<uint8_t> W(copies * T * tb);
  for (size_t i = 0; i < W.size(); ++i) W[i] = uint8_t((i * 2654435761u) >> 13);
  for (int64_t c = 0; c < copies * T * Kb; ++c) {  // the fp16 scales and mins: finite values near 2^-4
    uint16_t* h = reinterpret_cast<uint16_t*>(W.data() + c * 320 + 256);
    for (int j = 0; j < 32; ++j) h[j] = uint16_t(0x2C00 + (j * 37) % 256);
  }
  std::vector<int8_t> q(Kb * kManyRows * kBlock);
  for (size_t i = 0; i < q.size(); ++i) q[i] = int8_t(int((i * 7919) % 255) - 127);
  std::vector<float> d(Kb * kManyRows, 0.01f), ds(Kb * kManyRows, 0.5f);
  auto out = at::zeros({4, 4}, at::kDouble);
  std::vector<float> Y[2];
  for (auto& y : Y) y.assign(kManyRows * n, 0.f);
  int r = 0;
  for (int rows : {1, 2, 4, 8}) {
    const Rows8 a{q.data(), d.data(), ds.data(), rows, Kb};
    for (int kernel = 0; kernel < 2; ++kernel) probe::run_rows(rows, kernel, a, W.data(), T, tb, Y[kernel].data(), n);
    const bool equal = std::memcmp(Y[0].data(), Y[1].data(), rows * n * 4) == 0;
    double best[2] = {1e30, 1e30};
    for (int64_t round = 0; round < rounds; ++round)
      for (int kernel = 0; kernel < 2; ++kernel) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t c = 0; c < copies; ++c)
          probe::run_rows(rows, kernel, a, W.data() + c * T * tb, T, tb, Y[kernel].data(), n);
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        best[kernel] = std::min(best[kernel], us / copies);
      }
    auto o = out[r++];
    o[0] = rows;
    for (int kernel = 0; kernel < 2; ++kernel) o[1 + kernel] = best[kernel];
    o[3] = equal ? 1.0 : 0.0;
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe_amx", &probe_amx); }
