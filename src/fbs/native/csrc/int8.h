// int8 weight-only products y (M, N) = x (M, K) @ (q * s)^T, fp32 activations and accumulation.
// Packed weights (fbs.native.int8_pack): K padded to Kp (a multiple of 16) with zeros, N to a multiple of 4;
// tile t holds channels 4t..4t+3 as [chunk c of K][channel i][16 bytes]: one tile is one linear stream.
#pragma once

#include "common.h"

namespace fbs_int8 {
constexpr int64_t kNB = 4, kChunk = 16, kPrefetch = 512;  // tile height, K chunk, prefetch distance in bytes

// Y (M, N) = X (M, Kp) @ (q * s)^T over packed weights P with instruction set isa, tiles split across threads.
void mm(const float* X, int64_t M, int64_t Kp, const int8_t* P, const uint16_t* S, int64_t N, float* Y, int64_t isa);

#ifdef FBS_X86
// One tile (channels n0..n0+3) for all M rows of X, per instruction set (arch/x86/int8_*.cpp); nc = Kp / 16.
void tile_rows_avx512(const float* X, int64_t M, int64_t Kp, const int8_t* p, int64_t nc, const uint16_t* S, float* Y,
                      int64_t N, int64_t n0);
void tile_rows_avx2(const float* X, int64_t M, int64_t Kp, const int8_t* p, int64_t nc, const uint16_t* S, float* Y,
                    int64_t N, int64_t n0);
#endif
}  // namespace fbs_int8

int64_t int8_isa();

// x (M, Kp) fp32 contiguous (zero-padded to Kp), p packed int8, s (N,) bf16 -> (M, N) fp32
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& p, const at::Tensor& s, int64_t isa);
