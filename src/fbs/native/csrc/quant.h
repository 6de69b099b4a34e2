// Weight x activation products with the activations quantized to int8 per 32-value block (like llama.cpp's q8_0)
// and integer dot products: u8 x s8 VNNI (vpdpbusd) on AVX-512, maddubs on AVX2.
//
// Weight kinds, all repacked once at load into tiles of 16 output channels (fbs.native.quant_pack), each tile one
// linear stream over K in blocks of 32; within a block, 8 groups of 4 consecutive k, each group [channel 0..15][4]:
//   kI8Channel  int8 values, one fp32 scale per output channel (passed separately):       512 B per tile-block
//   kQ8Block    int8 values and an fp16 scale per (channel, block) (GGUF Q8_0):             512 + 32 B
//   kQ4Block    4-bit values q in [0, 15], fp16 scale d and min m per (channel, block), w = d q + m (GGUF Q4_1):
//               4 x 64 B of nibbles (byte j of vector v: low nibble group 2v, high nibble group 2v + 1), 32 B d,
//               32 B m                                                                        256 + 64 B
// Activations (quantize): q = round(x / d) with d = max|x| / 127 per block, and per block ds = d * sum(q); per row
// c = 128 * sum_b ds_b (the correction of the u8 offset the VNNI path gives signed weights).
#pragma once

#include <functional>

#include "common.h"

#ifdef FBS_X86
#include <immintrin.h>
#endif

namespace fbs_quant {
constexpr int64_t kBlock = 32, kTile = 16;
constexpr int64_t kI8Channel = 0, kQ8Block = 1, kQ4Block = 2;

// Bytes of one tile-block of a weight kind.
int64_t block_bytes(int64_t kind);

// Quantized activation rows: q (M, Kp) int8, d and ds (M, Kp / 32) fp32, c (M,) fp32.
struct Act {
  const int8_t* q;
  const float* d;
  const float* ds;
  const float* c;
  int64_t M, Kp;
};

// x (M, K) fp32 with row stride ldx -> the buffers of an Act (Kp = K rounded up to 32, zero tail).
void quantize(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* d, float* ds, float* c);

// Y (M, N) (row stride ldy) = dequantized activations @ W^T, W packed as kind (S: per-channel scales of kI8Channel,
// padded to whole tiles), tiles split across threads. after (optional): called by each thread with the columns
// [j0, j1) it computed (j0 a multiple of kTile), once they are in Y.
void mm(const Act& a, const uint8_t* P, const float* S, int64_t kind, int64_t N, float* Y, int64_t ldy, int64_t isa,
        const std::function<void(int64_t, int64_t)>* after = nullptr);

#ifdef FBS_X86
// How far ahead (in tile-blocks) a tile's loop asks for its weight stream in L2. One core's hardware prefetchers keep
// too few DRAM reads in flight for this stream: a whole block asked for 16 blocks (5-9 KB) ahead made one-token q4
// decoding 13 % faster (VNNI path), paired in one process over 8 rounds; 32 and 64 blocks measured the same.
constexpr int64_t kPrefetchL2 = 16;

// The software prefetches of a tile loop at block p (bb bytes a block): lines 0, 2, 4 (and 6 for the 8-bit kinds) of
// the next-but-one block into L1 (the adjacent-line prefetcher takes the others), the block kPrefetchL2 ahead into L2.
inline void prefetch_stream(const uint8_t* p, int64_t bb) {
  const int64_t l1 = bb > 320 ? 4 : 3;
  for (int64_t i = 0; i < l1; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 2 * bb + 128 * i), _MM_HINT_T0);
  for (int64_t o = 0; o < bb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchL2 * bb + o), _MM_HINT_T1);
}

// quantize for K a multiple of 32 with AVX-512 (arch/x86/quant_vnni512.cpp): the same values, 16 lanes at a time.
void quantize_avx512(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* d, float* ds, float* c);
// One tile (channels n0..n0+15) for all rows of a, per instruction set (arch/x86/quant_*.cpp).
void tile_vnni512(const Act& a, const uint8_t* p, const float* S, int64_t kind, float* Y, int64_t ldy, int64_t N,
                  int64_t n0);
void tile_avx2(const Act& a, const uint8_t* p, const float* S, int64_t kind, float* Y, int64_t ldy, int64_t N,
               int64_t n0);
// Several rows for the VNNI kernels (a prompt, a batch, a verified draft): groups of kManyRows rows interleaved per block, so that one pointer
// reaches every row of a group: q (G, Kb, kManyRows, 32) int8, d and ds (G, Kb, kManyRows) fp32, the last group's
// missing rows zero (G = ceil(M / kManyRows)).
constexpr int64_t kManyRows = 8;
struct Rows8 {
  const int8_t* q;
  const float* d;
  const float* ds;
  int64_t M, Kb;
};
// The fewest rows for which mm() takes the many-row kernel (a prompt, not a decode step), and the rows it runs
// over every tile before the next (their codes stay in L2 across the tiles); a multiple of kManyRows.
constexpr int64_t kManyMin = 16, kManyChunk = 64;
// The fewest rows for which the VNNI kernels read the activations from Rows8 groups (tile_rows8_vnni512); fewer rows
// take tile()'s own loop, one tile a call. In place (the default model's full-depth passes, q4 + q8 head, s32, 2
// alternated runs): 2 / 4 positions cost 1.09-1.11x / 1.36-1.37x a one-position pass this way, against 1.19-1.22x /
// 1.48-1.49x through Rows8; at 8 rows Rows8 stays ahead (B = 8 step 10.7-10.9 ms against 11.2-11.5).
constexpr int64_t kRows8Min = 5;
// nt (1 or 2) consecutive tiles of kind (kQ4Block or kQ8Block; p the first, tb bytes apart; channels n0 ..) for all
// rows of a (kRows8Min to kManyMin - 1), one tile at a time: tile()'s arithmetic, the rows read from Rows8 groups (one
// pointer per 8 rows instead of one per row: measured 1.13-1.18x faster at 8 rows, DRAM-cold weights). Each row's
// result is bit for bit tile()'s.
void tile_rows8_vnni512(const Rows8& a, const uint8_t* p, int64_t kind, int64_t nt, int64_t tb, float* Y, int64_t ldy,
                        int64_t N, int64_t n0);
// nt (1 or 2) consecutive tiles of kind (kQ4Block or kQ8Block; p the first, tb bytes apart; channels n0 ..) for rows
// m0 .. m1 - 1 (m0 a multiple of kManyRows) of a: the weights unpacked once into the bytes vpdpbusd reads, then every
// kManyRows rows stream that copy from L1, each activation broadcast feeding both tiles. Each row's result is bit
// for bit tile()'s (the same integer sums, the same fp32 updates in the same order).
void tile_many_vnni512(const Rows8& a, const uint8_t* p, int64_t kind, int64_t nt, int64_t tb, float* Y, int64_t ldy,
                       int64_t N, int64_t n0, int64_t m0, int64_t m1);
#endif
}  // namespace fbs_quant

// The instruction set of the quantized products here: fbs::kIsaAvx512Vnni, kIsaAvx2 or kIsaNone.
int64_t quant_isa();
// x (M, K) fp32 -> [q (M, Kp) int8, d (M, Kb), ds (M, Kb), c (M,)]: the activation quantization, for tests.
std::vector<at::Tensor> quant_activations(const at::Tensor& x);
// x (M, K) fp32 @ W^T with W packed as kind (fbs.native.quant_pack), N output channels -> (M, N) fp32.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& scales,
                        int64_t kind, int64_t n, int64_t isa);
