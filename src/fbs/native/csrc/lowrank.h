// The two halves of a weight's low-rank delta Y += (X A^T) Bt (packed.h), the factors stored in fp16: the dot
// products t = A x of a row, and t's sum over Bt's rows added to a range of output columns. Per instruction set
// (arch/x86/lowrank_x86.cpp: AVX-512, AVX2 + F16C), a portable loop otherwise. Every result is the same whatever
// rows or columns share the call.
#pragma once

#include <c10/util/Half.h>

#include "common.h"

namespace fbs_lowrank {
constexpr int64_t kCols = 16;  // output columns whose sums stay in registers; the row ranges are per kCols columns

// T[m, i] = A_i . X_m for the r rows of A (r, k) and the M rows of X (M, k); T's rows ldt apart (>= r)
void dots(const c10::Half* A, const float* X, int64_t M, int64_t r, int64_t k, float* T, int64_t ldt, int64_t isa);
// Y[m, j] += sum_i T[m, i] Bt[i, j] for the M rows of T (M, r) and Y (row stride ld) and the columns [j0, j1) of Bt
// (row stride ld), j0 a multiple of kCols; per kCols columns c only Bt's rows [rows[2c], rows[2c + 1]) (the others
// are zero there), summed in order, added once
void add(const float* T, int64_t M, int64_t r, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1,
         const int32_t* rows, float* Y, int64_t isa);

#ifdef FBS_X86
void dots_avx512(const c10::Half* A, const float* X, int64_t M, int64_t r, int64_t k, float* T, int64_t ldt);
void add_avx512(const float* T, int64_t M, int64_t r, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1,
                const int32_t* rows, float* Y);
void dots_avx2(const c10::Half* A, const float* x, int64_t r, int64_t k, float* t);
void add_avx2(const float* t, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1, const int32_t* rows, float* y);
#endif
}  // namespace fbs_lowrank
