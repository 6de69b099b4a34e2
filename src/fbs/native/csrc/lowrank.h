// The two halves of a weight's low-rank delta Y += (X A^T) Bt (packed.h), the factors stored in fp16: the dot
// products t = A x of a row, and t's sum over Bt's rows added to a range of output columns. Per instruction set
// (arch/x86/lowrank_x86.cpp: AVX-512, AVX2 + F16C), a portable loop otherwise. Every result is the same whatever
// rows or columns share the call.
#pragma once

#include <c10/util/Half.h>

#include "common.h"

namespace fbs_lowrank {
constexpr int64_t kCols = 16;  // output columns whose sums stay in registers; the row ranges are per kCols columns

// t[i] = A_i . x for the r rows of A (r, k)
void dots(const c10::Half* A, const float* x, int64_t r, int64_t k, float* t, int64_t isa);
// y[j] += sum_i t[i] Bt[i, j] for the columns [j0, j1) of Bt (row stride ld), j0 a multiple of kCols; per kCols
// columns c only Bt's rows [rows[2c], rows[2c + 1]) (the others are zero there), summed in order, added once
void add(const float* t, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1, const int32_t* rows, float* y,
         int64_t isa);

#ifdef FBS_X86
void dots_avx512(const c10::Half* A, const float* x, int64_t r, int64_t k, float* t);
void add_avx512(const float* t, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1, const int32_t* rows, float* y);
void dots_avx2(const c10::Half* A, const float* x, int64_t r, int64_t k, float* t);
void add_avx2(const float* t, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1, const int32_t* rows, float* y);
#endif
}  // namespace fbs_lowrank
