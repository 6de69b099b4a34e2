// The low-rank delta's halves (lowrank.h): dispatch, and the portable loops (which also take every column tail).
#include "lowrank.h"

namespace fbs_lowrank {
namespace {
void dots_any(const c10::Half* A, const float* x, int64_t r, int64_t k, float* t) {
  for (int64_t i = 0; i < r; ++i) {
    float acc[kCols] = {0.f};
    int64_t j = 0;
    for (; j + kCols <= k; j += kCols)
      for (int64_t l = 0; l < kCols; ++l) acc[l] += float(A[i * k + j + l]) * x[j + l];
    float s = 0.f;
    for (; j < k; ++j) s += float(A[i * k + j]) * x[j];
    for (int64_t l = 0; l < kCols; ++l) s += acc[l];
    t[i] = s;
  }
}
}  // namespace

// the columns [j0, j1) one at a time (a tail, or CPUs without the vector kernels)
void add_any(const float* t, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1, const int32_t* rows, float* y) {
  for (int64_t j = j0; j < j1; ++j) {
    const int32_t* rr = rows + 2 * (j / kCols);
    float acc = 0.f;
    for (int64_t i = rr[0]; i < rr[1]; ++i) acc += t[i] * float(Bt[i * ld + j]);
    y[j] += acc;
  }
}

void dots(const c10::Half* A, const float* X, int64_t M, int64_t r, int64_t k, float* T, int64_t ldt, int64_t isa) {
#ifdef FBS_X86
  if (isa == fbs::kIsaAvx512 || isa == fbs::kIsaAvx512Vnni) return dots_avx512(A, X, M, r, k, T, ldt);
#endif
  for (int64_t m = 0; m < M; ++m) {
#ifdef FBS_X86
    if (isa == fbs::kIsaAvx2) {
      dots_avx2(A, X + m * k, r, k, T + m * ldt);
      continue;
    }
#endif
    dots_any(A, X + m * k, r, k, T + m * ldt);
  }
}

void add(const float* T, int64_t M, int64_t r, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1,
         const int32_t* rows, float* Y, int64_t isa) {
#ifdef FBS_X86
  if (isa == fbs::kIsaAvx512 || isa == fbs::kIsaAvx512Vnni) return add_avx512(T, M, r, Bt, ld, j0, j1, rows, Y);
#endif
  for (int64_t m = 0; m < M; ++m) {
#ifdef FBS_X86
    if (isa == fbs::kIsaAvx2) {
      add_avx2(T + m * r, Bt, ld, j0, j1, rows, Y + m * ld);
      continue;
    }
#endif
    add_any(T + m * r, Bt, ld, j0, j1, rows, Y + m * ld);
  }
}
}  // namespace fbs_lowrank
