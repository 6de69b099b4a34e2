// The low-rank delta's halves (lowrank.h) with AVX-512 and with AVX2 + F16C: fp16 factors widened by the one
// conversion instruction, fp32 FMAs.
#include "../../lowrank.h"

#ifdef FBS_X86
#include "avx2.h"
#include "avx512.h"

namespace fbs_lowrank {
void add_any(const float* t, const c10::Half* Bt, int64_t ld, int64_t j0, int64_t j1, const int32_t* rows, float* y);

// Blocks of RB rows of A against MB rows of X, RB x MB accumulators (independent FMA chains; each fp16 value of A
// widened once for the MB rows): each (row of A, row of X) summed in the order it would be alone, so that the result
// depends neither on r nor on M.
template <int RB, int MB>
__attribute__((target("avx512f,fma"))) void dots_block512(const c10::Half* A, const float* X, int64_t k, float* T,
                                                          int64_t ldt) {
  __m512 acc[RB][MB];
  for (int i = 0; i < RB; ++i)
    for (int m = 0; m < MB; ++m) acc[i][m] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    __m512 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_loadu_ps(X + m * k + j);
    for (int i = 0; i < RB; ++i) {
      const __m512 a = fbs_x86::load16(A + i * k + j);
      for (int m = 0; m < MB; ++m) acc[i][m] = _mm512_fmadd_ps(a, xv[m], acc[i][m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < RB; ++i) {
      float s = _mm512_reduce_add_ps(acc[i][m]);
      for (int64_t l = j; l < k; ++l) s += float(A[i * k + l]) * X[m * k + l];
      T[m * ldt + i] = s;
    }
}

template <int MB>
__attribute__((target("avx512f,fma"))) void dots_rows512(const c10::Half* A, const float* X, int64_t r, int64_t k,
                                                         float* T, int64_t ldt) {
  int64_t i = 0;
  for (; i + 4 <= r; i += 4) dots_block512<4, MB>(A + i * k, X, k, T + i, ldt);
  for (; i < r; ++i) dots_block512<1, MB>(A + i * k, X, k, T + i, ldt);
}

__attribute__((target("avx512f,fma"))) void dots_avx512(const c10::Half* A, const float* X, int64_t M, int64_t r,
                                                        int64_t k, float* T, int64_t ldt) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dots_rows512<4>(A, X + m * k, r, k, T + m * ldt, ldt);
  switch (M - m) {
    case 3: dots_rows512<3>(A, X + m * k, r, k, T + m * ldt, ldt); break;
    case 2: dots_rows512<2>(A, X + m * k, r, k, T + m * ldt, ldt); break;
    case 1: dots_rows512<1>(A, X + m * k, r, k, T + m * ldt, ldt); break;
    default: break;
  }
}

// MB rows of T and Y over the columns [j0, j1): each fp16 value of Bt widened once for the MB rows, each row's sums in
// the order it would take alone
template <int MB>
__attribute__((target("avx512f,fma"))) void add_rows512(const float* T, int64_t r, const c10::Half* Bt, int64_t ld,
                                                        int64_t j0, int64_t j1, const int32_t* rows, float* Y) {
  int64_t j = j0;
  for (; j + kCols <= j1; j += kCols) {
    const int32_t* rr = rows + 2 * (j / kCols);
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t i = rr[0]; i < rr[1]; ++i) {
      const __m512 b = fbs_x86::load16(Bt + i * ld + j);
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(T[m * r + i]), b, acc[m]);
    }
    for (int m = 0; m < MB; ++m)
      _mm512_storeu_ps(Y + m * ld + j, _mm512_add_ps(_mm512_loadu_ps(Y + m * ld + j), acc[m]));
  }
  for (int m = 0; m < MB; ++m) add_any(T + m * r, Bt, ld, j, j1, rows, Y + m * ld);
}

__attribute__((target("avx512f,fma"))) void add_avx512(const float* T, int64_t M, int64_t r, const c10::Half* Bt,
                                                       int64_t ld, int64_t j0, int64_t j1, const int32_t* rows,
                                                       float* Y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) add_rows512<4>(T + m * r, r, Bt, ld, j0, j1, rows, Y + m * ld);
  switch (M - m) {
    case 3: add_rows512<3>(T + m * r, r, Bt, ld, j0, j1, rows, Y + m * ld); break;
    case 2: add_rows512<2>(T + m * r, r, Bt, ld, j0, j1, rows, Y + m * ld); break;
    case 1: add_rows512<1>(T + m * r, r, Bt, ld, j0, j1, rows, Y + m * ld); break;
    default: break;
  }
}

template <int R>
__attribute__((target("avx2,fma,f16c"))) void dots_rows256(const c10::Half* A, const float* x, int64_t k, float* t) {
  __m256 acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
    for (int i = 0; i < R; ++i) {
      acc0[i] = _mm256_fmadd_ps(fbs_x86::load8(A + i * k + j), x0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(fbs_x86::load8(A + i * k + j + 8), x1, acc1[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float s = fbs_x86::hsum256(_mm256_add_ps(acc0[i], acc1[i]));
    for (int64_t l = j; l < k; ++l) s += float(A[i * k + l]) * x[l];
    t[i] = s;
  }
}

__attribute__((target("avx2,fma,f16c"))) void dots_avx2(const c10::Half* A, const float* x, int64_t r, int64_t k,
                                                        float* t) {
  int64_t i = 0;
  for (; i + 4 <= r; i += 4) dots_rows256<4>(A + i * k, x, k, t + i);
  for (; i < r; ++i) dots_rows256<1>(A + i * k, x, k, t + i);
}

__attribute__((target("avx2,fma,f16c"))) void add_avx2(const float* t, const c10::Half* Bt, int64_t ld, int64_t j0,
                                                       int64_t j1, const int32_t* rows, float* y) {
  int64_t j = j0;
  for (; j + kCols <= j1; j += kCols) {
    const int32_t* rr = rows + 2 * (j / kCols);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = rr[0]; i < rr[1]; ++i) {
      const __m256 ti = _mm256_set1_ps(t[i]);
      acc0 = _mm256_fmadd_ps(ti, fbs_x86::load8(Bt + i * ld + j), acc0);
      acc1 = _mm256_fmadd_ps(ti, fbs_x86::load8(Bt + i * ld + j + 8), acc1);
    }
    _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), acc0));
    _mm256_storeu_ps(y + j + 8, _mm256_add_ps(_mm256_loadu_ps(y + j + 8), acc1));
  }
  add_any(t, Bt, ld, j, j1, rows, y);
}
}  // namespace fbs_lowrank
#endif
