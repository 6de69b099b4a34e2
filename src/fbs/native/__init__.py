"""Optional native (C++) kernels of the engine's eager one-token step, built on first use.

Six kernels, one extension:

* **Gate logits** (:func:`gate_logits`). A skip gate's logit is a few hundred flops
  (:func:`fbs.engine.fused._gate_logit`), but in eager PyTorch it is a dozen operator dispatches plus a host read, which
  on a CPU cost more than the arithmetic by two orders of magnitude: about 20 us per gated layer, several percent
  of an int8 decode step. The kernel computes the same logits in one call and returns them as Python floats (the
  layer's one host read included).
* **int8 weight-only matrix products for a few rows** (:func:`int8_linear`), the int8 engine's decode matmuls:
  ``x (M, K) fp32 @ (q * s)^T`` with q (N, K) int8 and s (N,) bf16 per-channel scales, as
  ``torch._weight_int8pack_mm`` computes it, but with fp32 activations (that op rounds them to bf16) and about
  twice its speed on a CPU, because the weights are repacked once (:func:`int8_pack`) so that each thread reads
  one linear stream, with software prefetch: tiles of 4 output channels, K in 16-byte chunks, channel-interleaved.
  On this project's 2-core AVX-512 machine a SmolLM2 decode step's products (128 MB of int8 weights) take 5.1 ms
  against 10.9 ms (26 against 12 GB/s; ``scripts/gemv_floor.py --formats int8,int8-native``). AVX-512 and AVX2
  code paths, chosen at run time; without either (not x86) the PyTorch op stays in use.
* **One-query attention** (:func:`attend_one`) of the native int8 step: each row's new K/V written at its slot
  and its query attending over that row's filled prefix only, in one call, instead of two index writes and SDPA
  over the whole masked static cache. fp32 decoding keeps SDPA (HF's op, so that fp32 stays bit-faithful).
* **RMSNorm** (:func:`rms_norm`) of the native int8 step: one call instead of six ATen ops (fp32 keeps them).
* **A whole decoder layer** (:class:`Int8Layer`, built by :class:`fbs.engine.fused.FusedOps` per layer without PAW / CH)
  of the native int8 step: RMSNorm, the fused K/V(+gate) product, the gate's logit and the skip decision under the
  batch policy, the cache writes, and attention and FFN of the rows that run, in one call from Python instead of
  some forty operator dispatches and a host read. A skipped row's state is untouched; only the rows that run
  are multiplied (a batch row that skips a layer saves its share of the products and its attention).
* **The chunk head's online step** (:func:`chunk_step`) of the native int8 step, in place on the engine's chunk
  state (the PyTorch step is some thirty small ops, a host read and two copies of the state).

The extension is compiled with ``torch.utils.cpp_extension.load_inline`` the first time it is needed (about
40 s, once per machine: the build is cached under ``$FBS_CACHE_DIR/native``, default ``~/.cache/fbs/native``). It
is used only where it computes what the PyTorch ops compute up to float rounding: CPU, fp32 activations, eager
(a ``torch.compile``d step keeps the PyTorch ops in its graph). Without a C++ toolchain (with OpenMP), or with
``FBS_NATIVE=0``, the engine keeps the PyTorch ops; nothing else changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_GATE_SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

// Skip-gate logits of b rows, one token each (fbs.engine.fused._gate_logit):
//   h = y[:, off:off+G] (absent when G_y == 0) + terms
//       + w_rel * log(eps + ||x - x_prev|| / max(||x_prev||, 1e-6))   (x_prev given)
//       + rel_term                                                      (else, when given)
//       + w_prev * prev_skip                                            (when given)
//   logit = out_b + sum_j out_w[j] * silu(h[j])
// Every tensor is fp32 on the CPU with a unit stride in its last dimension; rows may be strided (views).
// One row's logit; h is scratch of G floats. y: the row's gate columns (null: none); x_prev null: the relative
// update is rel_term (or absent when null); has_ps: prev_skip ps applies
namespace fbs_gate {
inline double row(const float* terms, const float* y, const float* x, const float* x_prev, const float* rel_term,
                  float ps, bool has_ps, const float* w_rel, const float* w_prev, const float* out_w, float out_b,
                  float eps, int64_t d, int64_t G, float* h) {
  for (int64_t j = 0; j < G; ++j) h[j] = terms[j];
  if (y) for (int64_t j = 0; j < G; ++j) h[j] = y[j] + h[j];
  if (x_prev && w_rel) {  // fp32 norms, as torch.linalg.vector_norm computes them, in 16 independent lanes
    float au[16] = {0.f}, ap[16] = {0.f};
    int64_t j = 0;
    for (; j + 16 <= d; j += 16)
      for (int k = 0; k < 16; ++k) {
        const float diff = x[j + k] - x_prev[j + k];
        au[k] += diff * diff;
        ap[k] += x_prev[j + k] * x_prev[j + k];
      }
    float su = 0.f, sp = 0.f;
    for (; j < d; ++j) { const float diff = x[j] - x_prev[j]; su += diff * diff; sp += x_prev[j] * x_prev[j]; }
    for (int k = 0; k < 16; ++k) { su += au[k]; sp += ap[k]; }
    const float u = std::sqrt(su), up = std::max(std::sqrt(sp), 1e-6f);
    const float r = std::log(eps + u / up);
    for (int64_t j = 0; j < G; ++j) h[j] += r * w_rel[j];
  } else if (rel_term) {
    for (int64_t j = 0; j < G; ++j) h[j] += rel_term[j];
  }
  if (has_ps && w_prev) for (int64_t j = 0; j < G; ++j) h[j] += ps * w_prev[j];
  double acc = 0.0;
  for (int64_t j = 0; j < G; ++j) acc += double(out_w[j]) * double(h[j] / (1.0f + std::exp(-h[j])));
  return acc + out_b;
}
}  // namespace fbs_gate

std::vector<double> gate_logits(const at::Tensor& y, int64_t off, int64_t gy, const at::Tensor& terms,
                                const at::Tensor& x, const std::optional<at::Tensor>& x_prev,
                                const std::optional<at::Tensor>& rel_term, const std::optional<at::Tensor>& prev_skip,
                                const std::optional<at::Tensor>& w_rel, const std::optional<at::Tensor>& w_prev,
                                const at::Tensor& out_w, double out_b, double eps) {
  for (const at::Tensor* t : {&y, &terms, &x, &out_w})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(-1) == 1, "fbs gate kernel: fp32, unit last stride");
  for (const auto* t : {&x_prev, &rel_term, &prev_skip, &w_rel, &w_prev})
    TORCH_CHECK(!*t || ((*t)->scalar_type() == at::kFloat && (*t)->stride(-1) == 1),
                "fbs gate kernel: fp32, unit last stride");
  const int64_t b = x.size(0), d = x.size(-1), G = out_w.size(0);
  const float* T = terms.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  const float* OW = out_w.data_ptr<float>();
  const float* Y = gy > 0 ? y.data_ptr<float>() : nullptr;
  const float* P = x_prev ? x_prev->data_ptr<float>() : nullptr;
  const float* RT = rel_term ? rel_term->data_ptr<float>() : nullptr;
  const float* PS = prev_skip ? prev_skip->data_ptr<float>() : nullptr;
  const float* WR = w_rel ? w_rel->data_ptr<float>() : nullptr;
  const float* WP = w_prev ? w_prev->data_ptr<float>() : nullptr;
  std::vector<double> out(b);
  std::vector<float> h(G);
  for (int64_t i = 0; i < b; ++i)
    out[i] = fbs_gate::row(T + i * terms.stride(0), Y ? Y + i * y.stride(0) + off : nullptr, X + i * x.stride(0),
                           P ? P + i * x_prev->stride(0) : nullptr, RT, PS ? PS[i * prev_skip->stride(0)] : 0.f,
                           PS != nullptr, WR, WP, OW, float(out_b), float(eps), d, G, h.data());
  return out;
}
"""

_INT8_SOURCE = r"""
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <string>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FBS_X86 1
#endif

// int8 weight-only products y (M, N) = x (M, K) @ (q * s)^T, fp32 activations and accumulation.
// Packed weights (fbs.native.int8_pack): K padded to Kp (a multiple of 16) with zeros, N to a multiple of 4;
// tile t holds channels 4t..4t+3 as [chunk c of K][channel i][16 bytes]: one tile is one linear stream.
namespace fbs_int8 {
constexpr int64_t kNB = 4, kChunk = 16, kPrefetch = 512;  // prefetch distance in bytes (measured: 256-512 best)

inline float bf16(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }

#ifdef FBS_X86
template <int MB>
__attribute__((target("avx512f,fma"))) void tile512(const float* X, int64_t Kp, const int8_t* p, int64_t nc,
                                                     const uint16_t* S, float* Y, int64_t N, int64_t n0) {
  __m512 a[kNB][MB];
  for (int i = 0; i < kNB; ++i) for (int m = 0; m < MB; ++m) a[i][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c, p += kNB * kChunk) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
    __m512 w[kNB];
    for (int i = 0; i < kNB; ++i)
      w[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * kChunk))));
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(X + m * Kp + c * kChunk);
      for (int i = 0; i < kNB; ++i) a[i][m] = _mm512_fmadd_ps(w[i], xv, a[i][m]);
    }
  }
  for (int i = 0; i < kNB && n0 + i < N; ++i)
    for (int m = 0; m < MB; ++m) Y[m * N + n0 + i] = _mm512_reduce_add_ps(a[i][m]) * bf16(S[n0 + i]);
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MB>
__attribute__((target("avx2,fma"))) void tile256(const float* X, int64_t Kp, const int8_t* p, int64_t nc,
                                                  const uint16_t* S, float* Y, int64_t N, int64_t n0) {
  __m256 a[kNB][MB];
  for (int i = 0; i < kNB; ++i) for (int m = 0; m < MB; ++m) a[i][m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < nc; ++c, p += kNB * kChunk) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256 w[kNB];
      for (int i = 0; i < kNB; ++i)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i * kChunk + 8 * h))));
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_loadu_ps(X + m * Kp + c * kChunk + 8 * h);
        for (int i = 0; i < kNB; ++i) a[i][m] = _mm256_fmadd_ps(w[i], xv, a[i][m]);
      }
    }
  }
  for (int i = 0; i < kNB && n0 + i < N; ++i)
    for (int m = 0; m < MB; ++m) Y[m * N + n0 + i] = hsum256(a[i][m]) * bf16(S[n0 + i]);
}
#endif

// 2: AVX-512, 1: AVX2 + FMA, 0: neither (the caller keeps the PyTorch op)
int64_t best_isa() {
#ifdef FBS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

// Y (M, N) = X (M, Kp) @ (q * s)^T over packed weights P, tiles split across threads
void mm(const float* X, int64_t M, int64_t Kp, const int8_t* P, const uint16_t* S, int64_t N, float* Y, int64_t isa) {
  const int64_t T = (N + kNB - 1) / kNB, nc = Kp / kChunk, tile_bytes = kNB * Kp;
#ifdef FBS_X86
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* pt = P + t * tile_bytes;
      for (int64_t m = 0; m < M;) {  // activation rows in blocks of up to 4 (AVX2: 2) per pass over the tile
        const float* xm = X + m * Kp;
        float* ym = Y + m * N;
        const int64_t left = M - m;
        if (isa == 2) {
          if (left >= 4) { tile512<4>(xm, Kp, pt, nc, S, ym, N, t * kNB); m += 4; }
          else if (left >= 2) { tile512<2>(xm, Kp, pt, nc, S, ym, N, t * kNB); m += 2; }
          else { tile512<1>(xm, Kp, pt, nc, S, ym, N, t * kNB); m += 1; }
        } else {
          if (left >= 2) { tile256<2>(xm, Kp, pt, nc, S, ym, N, t * kNB); m += 2; }
          else { tile256<1>(xm, Kp, pt, nc, S, ym, N, t * kNB); m += 1; }
        }
      }
    }
  });
#endif
}
}  // namespace fbs_int8

int64_t int8_isa() { return fbs_int8::best_isa(); }

// x (M, Kp) fp32 contiguous (zero-padded to Kp), p packed int8, s (N,) bf16 -> (M, N) fp32
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& p, const at::Tensor& s, int64_t isa) {
  using namespace fbs_int8;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "fbs int8 kernel: x must be a contiguous (M, K) fp32 CPU tensor");
  TORCH_CHECK(p.scalar_type() == at::kChar && p.dim() == 1 && p.is_contiguous(), "fbs int8 kernel: packed int8 weights");
  TORCH_CHECK(s.scalar_type() == at::kBFloat16 && s.dim() == 1 && s.is_contiguous(), "fbs int8 kernel: (N,) bf16 scales");
  const int64_t M = x.size(0), Kp = x.size(1), N = s.size(0), T = (N + kNB - 1) / kNB;
  TORCH_CHECK(Kp % kChunk == 0 && p.numel() == T * kNB * Kp, "fbs int8 kernel: packed size ", p.numel(),
              " does not match N = ", N, ", padded K = ", Kp);
  TORCH_CHECK(isa >= 1 && isa <= best_isa(), "fbs int8 kernel: instruction set ", isa, " not available here");
  auto y = at::empty({M, N}, x.options());
  fbs_int8::mm(x.data_ptr<float>(), M, Kp, p.data_ptr<int8_t>(),
               reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>()), N, y.data_ptr<float>(), isa);
  return y;
}
"""

_ATTN_SOURCE = r"""
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// One new token per row attends over its cache prefix (GQA), after writing its own K/V at its slot:
//   kc[idx[i], g, slot[i]] = k[i, g, 0];  vc likewise
//   out[i, 0, h*hd:(h+1)*hd] = softmax(scale * q[i, h] . kc[idx[i], g(h), 0..slot[i]]) @ vc[idx[i], g(h), 0..slot[i]]
// with g(h) = h / (H / Hkv). fp32; every tensor's last dimension unit-strided, caches contiguous (B, Hkv, C, hd).
// One task per (row, query head): scores, softmax, weighted sum of V; SIMD over the head dimension.
namespace fbs_attn {
constexpr int64_t kMaxHd = 256;

inline void softmax_(float* p, int64_t n, float* z) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, p[j]);
  float s = 0.f;
  for (int64_t j = 0; j < n; ++j) { p[j] = std::exp(p[j] - m); s += p[j]; }
  *z = s;
}

void head_scalar(const float* q, const float* K, const float* V, int64_t n, int64_t hd, float scale, float* p,
                 float* o) {
  for (int64_t j = 0; j < n; ++j) {
    float a = 0.f;
    for (int64_t d = 0; d < hd; ++d) a += q[d] * K[j * hd + d];
    p[j] = a * scale;
  }
  float z;
  softmax_(p, n, &z);
  for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < hd; ++d) o[d] += p[j] * V[j * hd + d];
  for (int64_t d = 0; d < hd; ++d) o[d] /= z;
}

#ifdef FBS_X86
__attribute__((target("avx512f,fma"))) void head512(const float* q, const float* K, const float* V, int64_t n,
                                                     int64_t hd, float scale, float* p, float* o) {
  const int64_t nc = hd / 16;
  __m512 qv[kMaxHd / 16], acc[kMaxHd / 16];
  for (int64_t c = 0; c < nc; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), _mm512_set1_ps(scale));
  for (int64_t j = 0; j < n; ++j) {
    const float* k = K + j * hd;
    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    for (int64_t c = 1; c < nc; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);
    p[j] = _mm512_reduce_add_ps(a);
  }
  float z;
  softmax_(p, n, &z);
  for (int64_t c = 0; c < nc; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 w = _mm512_set1_ps(p[j]);
    const float* v = V + j * hd;
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), acc[c]);
  }
  const __m512 iz = _mm512_set1_ps(1.0f / z);
  for (int64_t c = 0; c < nc; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], iz));
}

__attribute__((target("avx2,fma"))) void head256(const float* q, const float* K, const float* V, int64_t n,
                                                  int64_t hd, float scale, float* p, float* o) {
  const int64_t nc = hd / 8;
  __m256 qv[kMaxHd / 8], acc[kMaxHd / 8];
  for (int64_t c = 0; c < nc; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * c), _mm256_set1_ps(scale));
  for (int64_t j = 0; j < n; ++j) {
    const float* k = K + j * hd;
    __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
    for (int64_t c = 1; c < nc; ++c) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k + 8 * c), a);
    p[j] = fbs_int8::hsum256(a);
  }
  float z;
  softmax_(p, n, &z);
  for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    const float* v = V + j * hd;
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
  }
  const __m256 iz = _mm256_set1_ps(1.0f / z);
  for (int64_t c = 0; c < nc; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], iz));
}
#endif

// K/V of b rows (row i, KV head g at K + i * ks0 + g * ks1, hd floats) written at slot L[i] of cache row I[i]
void write_kv(const float* K, int64_t ks0, int64_t ks1, const float* V, int64_t vs0, int64_t vs1, int64_t b,
              const int64_t* I, const int64_t* L, float* KC, float* VC, int64_t Hkv, int64_t C, int64_t hd) {
  const int64_t rs = Hkv * C * hd, hs = C * hd;  // cache row and head strides
  for (int64_t i = 0; i < b; ++i)
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t at_ = I[i] * rs + g * hs + L[i] * hd;
      std::copy_n(K + i * ks0 + g * ks1, hd, KC + at_);
      std::copy_n(V + i * vs0 + g * vs1, hd, VC + at_);
    }
}

// m queries (row j, head h at Q + j * qs0 + h * qs1) attend over slots 0..L[j] of cache row I[j] (GQA), one task
// per (row, head); O (m, H * hd), the heads side by side
void attend(const float* Q, int64_t qs0, int64_t qs1, const int64_t* I, const int64_t* L, int64_t m, int64_t H,
            const float* KC, const float* VC, int64_t Hkv, int64_t C, int64_t hd, float scale, int64_t isa,
            float* O) {
  auto head = head_scalar;
#ifdef FBS_X86
  if (isa == 2 && hd % 16 == 0 && hd <= kMaxHd) head = head512;
  else if (isa >= 1 && hd % 8 == 0 && hd <= kMaxHd) head = head256;
#endif
  const int64_t rs = Hkv * C * hd, hs = C * hd, group = H / Hkv;
  at::parallel_for(0, m * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(C);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j = t / H, h = t % H;
      const int64_t kv = I[j] * rs + (h / group) * hs;
      head(Q + j * qs0 + h * qs1, KC + kv, VC + kv, L[j] + 1, hd, scale, p.data(), O + j * H * hd + h * hd);
    }
  });
}
}  // namespace fbs_attn

at::Tensor attend_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                      const at::Tensor& vc, const at::Tensor& idx, const at::Tensor& slots, double scale,
                      int64_t isa) {
  for (const at::Tensor* t : {&q, &k, &v, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(-1) == 1 && t->device().is_cpu(),
                "fbs attention kernel: 4-d fp32 CPU tensors with a unit last stride");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes(), "fbs attention kernel: caches");
  TORCH_CHECK(idx.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "fbs attention kernel: int64 rows");
  const int64_t b = q.size(0), H = q.size(1), hd = q.size(3), Hkv = kc.size(1), C = kc.size(2);
  TORCH_CHECK(H % Hkv == 0 && k.size(1) == Hkv && kc.size(3) == hd, "fbs attention kernel: head shapes");
  const int64_t* I = idx.data_ptr<int64_t>();
  const int64_t* L = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(I[i] >= 0 && I[i] < kc.size(0) && L[i] >= 0 && L[i] < C, "fbs attention kernel: slot out of range");
  fbs_attn::write_kv(k.data_ptr<float>(), k.stride(0), k.stride(1), v.data_ptr<float>(), v.stride(0), v.stride(1), b,
                     I, L, kc.data_ptr<float>(), vc.data_ptr<float>(), Hkv, C, hd);
  auto out = at::empty({b, 1, H * hd}, q.options());
  fbs_attn::attend(q.data_ptr<float>(), q.stride(0), q.stride(1), I, L, b, H, kc.data_ptr<float>(),
                   vc.data_ptr<float>(), Hkv, C, hd, float(scale), isa, out.data_ptr<float>());
  return out;
}
"""

_NORM_SOURCE = r"""
// HF's Llama/Qwen RMSNorm of fp32 rows: w * (x * rsqrt(mean(x^2) + eps)), the statistic accumulated in fp32.
namespace fbs_norm {
// a . b with 16 independent lanes (vectorized without reassociating a single sum; the last lanes' order differs
// from a serial sum by float rounding only)
__attribute__((target_clones("avx512f", "avx2", "default")))
float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int k = 0; k < 16; ++k) acc[k] += a[j + k] * b[j + k];
  float s = 0.f;
  for (; j < n; ++j) s += a[j] * b[j];
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}
inline float sumsq(const float* x, int64_t n) { return dot(x, x, n); }
__attribute__((target_clones("avx512f", "avx2", "default")))
void scale(const float* x, const float* w, float r, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] = w[d] * (x[d] * r);
}

// HF's RMSNorm of n rows of d floats: y = w * (x * rsqrt(mean(x^2) + eps))
void rows(const float* x, const float* w, float eps, float* y, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const float r = 1.0f / std::sqrt(sumsq(x + i * d, d) / float(d) + eps);
    scale(x + i * d, w, r, y + i * d, d);
  }
}
}  // namespace fbs_norm

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
              w.is_contiguous() && x.device().is_cpu() && x.size(-1) == w.numel(),
              "fbs norm kernel: contiguous fp32 CPU rows and a matching weight");
  const int64_t d = w.numel(), rows = x.numel() / std::max<int64_t>(d, 1);
  auto y = at::empty_like(x);
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  fbs_norm::rows(X, W, float(eps), Y, rows, d);
  return y;
}
"""

_CHUNK_SOURCE = r"""
// CH's online step (fbs.model.chunk.ChunkHead.step) for rows `rows` of a ChunkState, in place, one token each:
//   logits = W_bios xn + b;  kt = W_key xn;  start = argmax(logits) != I or the row has no open chunk
//   start closes the open chunk (its mean enters the ring of closed chunks) and opens one with kt, else kt joins
//   attend: q = W_query xn; the token attends (softmax, scaled) over the filled ring slots and its open chunk's
//   mean; c = W_out (that mixture).  Returns (c (b, 1, d) or an undefined tensor, bios logits (b, 1, 4), start).

std::tuple<at::Tensor, at::Tensor, std::vector<bool>> chunk_step(
    const at::Tensor& xn, const at::Tensor& rows, at::Tensor& closed, at::Tensor& n_closed, at::Tensor& open_sum,
    at::Tensor& open_count, const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key,
    const at::Tensor& w_query, const at::Tensor& w_out, double scale, int64_t label_i, bool attend) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&xn, &closed, &open_sum, &w_bios, &b_bios, &w_key,
                                                                       &w_query, &w_out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "fbs chunk kernel: contiguous fp32 CPU tensors");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&rows, &n_closed, &open_count})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "fbs chunk kernel: int64 rows and counts");
  const int64_t b = rows.numel(), d = xn.size(-1), C = closed.size(1), R = closed.size(2), nl = w_bios.size(0);
  TORCH_CHECK(xn.numel() == b * d && w_key.size(0) == R && w_key.size(1) == d && w_query.sizes() == w_key.sizes() &&
              w_out.size(0) == d && w_out.size(1) == R && w_bios.size(1) == d && b_bios.numel() == nl,
              "fbs chunk kernel: shapes");
  const int64_t* RW = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(RW[i] >= 0 && RW[i] < closed.size(0), "fbs chunk kernel: row out of range");
  const float* X = xn.data_ptr<float>();
  float* CL = closed.data_ptr<float>();
  int64_t* NC = n_closed.data_ptr<int64_t>();
  float* OS = open_sum.data_ptr<float>();
  int64_t* OC = open_count.data_ptr<int64_t>();
  auto logits = at::empty({b, 1, nl}, xn.options());
  float* LG = logits.data_ptr<float>();
  at::Tensor c = attend ? at::empty({b, 1, d}, xn.options()) : at::Tensor();
  std::vector<bool> start(b);
  std::vector<float> kt(R), q(R), open(R), mixed(R), p(C + 1);
  for (int64_t i = 0; i < b; ++i) {
    const float* x = X + i * d;
    const int64_t r = RW[i];
    int64_t best = 0;
    for (int64_t k = 0; k < nl; ++k) {
      LG[i * nl + k] = fbs_norm::dot(w_bios.data_ptr<float>() + k * d, x, d) + b_bios.data_ptr<float>()[k];
      if (LG[i * nl + k] > LG[i * nl + best]) best = k;
    }
    for (int64_t j = 0; j < R; ++j) kt[j] = fbs_norm::dot(w_key.data_ptr<float>() + j * d, x, d);
    start[i] = best != label_i || OC[r] == 0;
    float* os = OS + r * R;
    if (start[i] && OC[r] > 0) {
      float* slot = CL + (r * C + NC[r] % C) * R;
      for (int64_t j = 0; j < R; ++j) slot[j] = os[j] / float(OC[r]);
      NC[r] += 1;
    }
    if (start[i]) { std::copy_n(kt.data(), R, os); OC[r] = 1; }
    else { for (int64_t j = 0; j < R; ++j) os[j] += kt[j]; OC[r] += 1; }
    if (!attend) continue;
    for (int64_t j = 0; j < R; ++j) q[j] = fbs_norm::dot(w_query.data_ptr<float>() + j * d, x, d);
    for (int64_t j = 0; j < R; ++j) open[j] = os[j] / float(OC[r]);
    const int64_t nv = std::min<int64_t>(NC[r], C);
    const float* ring = CL + r * C * R;
    float mx = -INFINITY;
    for (int64_t j = 0; j < nv; ++j) { p[j] = fbs_norm::dot(ring + j * R, q.data(), R) * float(scale); mx = std::max(mx, p[j]); }
    p[nv] = fbs_norm::dot(q.data(), open.data(), R) * float(scale);
    mx = std::max(mx, p[nv]);
    float z = 0.f;
    for (int64_t j = 0; j <= nv; ++j) { p[j] = std::exp(p[j] - mx); z += p[j]; }
    for (int64_t k = 0; k < R; ++k) mixed[k] = p[nv] / z * open[k];
    for (int64_t j = 0; j < nv; ++j) {
      const float a = p[j] / z;
      for (int64_t k = 0; k < R; ++k) mixed[k] += a * ring[j * R + k];
    }
    float* ci = c.data_ptr<float>() + i * d;
    for (int64_t k = 0; k < d; ++k) ci[k] = fbs_norm::dot(w_out.data_ptr<float>() + k * R, mixed.data(), R);
  }
  return {c, logits, start};
}
"""

_LAYER_SOURCE = r"""
#include <pybind11/stl.h>
#include <tuple>

// A whole decoder layer of the eager int8 one-token step natively (fbs.engine.fused.FusedOps.native_run), so that a layer
// costs a share of one call (run_layers: a run of layers per call) instead of some forty ATen dispatches:
//   xn = RMSNorm_1(x);  y = xn @ [W_k; W_v; A]^T (+ b)       K, V and, on gated layers, the gate's hidden columns
//   gated: logit = gate(y's gate columns, terms, relative update, previous skip); skip = logit > threshold(row)
//   run = skip decision under the batch policy (0 gather: rows that do not skip, 1 all: every row unless all
//         skip, 2 majority: every row unless more than half skip), or the caller's run list (ungated layers)
//   K/V (K rotated) written at each row's slot for the rows that run, and for every row when write_skipped
//   rows that run: h = x + O(attention(RoPE(Q xn)));  out = h + down(silu(gate(hn)) * up(hn)), hn = RMSNorm_2(h)
//   rows that skip: out = x
// Weights are int8 packed for fbs_int8 (K a multiple of 16), activations, norms, biases and caches fp32.
namespace fbs_layer {
struct Packed {
  at::Tensor p, s;
  int64_t n = 0, kp = 0;
  const int8_t* P() const { return p.data_ptr<int8_t>(); }
  const uint16_t* S() const { return reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>()); }
};

Packed packed(const at::Tensor& p, const at::Tensor& s, int64_t k) {
  TORCH_CHECK(p.scalar_type() == at::kChar && p.dim() == 1 && p.is_contiguous() && s.scalar_type() == at::kBFloat16 &&
              s.dim() == 1 && s.is_contiguous(), "fbs native layer: packed int8 weights and (N,) bf16 scales");
  TORCH_CHECK(k % fbs_int8::kChunk == 0, "fbs native layer: input width ", k, " is not a multiple of 16");
  const int64_t n = s.size(0);
  TORCH_CHECK(p.numel() == (n + fbs_int8::kNB - 1) / fbs_int8::kNB * fbs_int8::kNB * k,
              "fbs native layer: packed size does not match (", n, ", ", k, ")");
  return Packed{p, s, n, k};
}

const float* fp32(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu() && t.numel() == n,
              "fbs native layer: ", what, " must be a contiguous fp32 CPU tensor of ", n, " elements");
  return t.data_ptr<float>();
}

// x (hd) rotated in place: x * cos + roll(x, hd / 2) * sin_signed (fbs.engine.fused._rope)
void rope(float* x, const float* c, const float* s, int64_t hd) {
  float t[256];
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < hd; ++j) t[j] = x[j] * c[j] + x[j < half ? j + half : j - half] * s[j];
  std::copy_n(t, hd, x);
}

// What one call shares across its layers: rows, rotary tables (b, hd), cache rows, decision rule.
struct Step {
  int64_t b;
  const float *cos, *sin;
  const int64_t* idx;
  int64_t isa, policy;
  bool write_skipped;
  const double* thresholds;  // per row (gated layers)
};

struct Layer {
  int64_t d, heads, nkv, hd, inter;
  float eps, scale;
  at::Tensor ln1, ln2, kvg_b, q_b;  // biases undefined when absent
  Packed kvg, q, o, gu, dn;
  // gate (gated layers): offset and width of its columns in y, its index among the gated layers (which terms are
  // its own), w_rel, w_prev and rel_first = w_rel log(1 + 1e-3) (undefined when unused), out
  bool gated = false;
  int64_t g_off = 0, g_w = 0, G = 0, g_index = 0;
  at::Tensor w_rel, w_prev, rel_first, out_w;
  float out_b = 0.f, g_eps = 1e-3f;

  Layer(int64_t d_, int64_t heads_, int64_t nkv_, int64_t hd_, int64_t inter_, double eps_, double scale_,
        at::Tensor ln1_, at::Tensor kvg_p, at::Tensor kvg_s, std::optional<at::Tensor> kvg_b_, at::Tensor q_p,
        at::Tensor q_s, std::optional<at::Tensor> q_b_, at::Tensor o_p, at::Tensor o_s, at::Tensor ln2_,
        at::Tensor gu_p, at::Tensor gu_s, at::Tensor dn_p, at::Tensor dn_s)
      : d(d_), heads(heads_), nkv(nkv_), hd(hd_), inter(inter_), eps(float(eps_)), scale(float(scale_)), ln1(ln1_),
        ln2(ln2_) {
    TORCH_CHECK(hd <= 256 && hd % 2 == 0 && heads % nkv == 0, "fbs native layer: head shapes");
    fp32(ln1, d, "ln1");
    fp32(ln2, d, "ln2");
    kvg = packed(kvg_p, kvg_s, d);
    q = packed(q_p, q_s, d);
    o = packed(o_p, o_s, heads * hd);
    gu = packed(gu_p, gu_s, d);
    dn = packed(dn_p, dn_s, inter);
    TORCH_CHECK(kvg.n >= 2 * nkv * hd && q.n == heads * hd && o.n == d && gu.n == 2 * inter && dn.n == d,
                "fbs native layer: weight shapes do not match the layer");
    if (kvg_b_) { kvg_b = *kvg_b_; fp32(kvg_b, kvg.n, "the K/V bias"); }
    if (q_b_) { q_b = *q_b_; fp32(q_b, q.n, "the Q bias"); }
  }

  void set_gate(int64_t index, int64_t off, int64_t width, std::optional<at::Tensor> w_rel_,
                std::optional<at::Tensor> w_prev_, std::optional<at::Tensor> rel_first_, at::Tensor out_w_,
                double out_b_, double g_eps_) {
    G = out_w_.numel();
    fp32(out_w_, G, "the gate's output weight");
    TORCH_CHECK(width == 0 || (width == G && off + width <= kvg.n), "fbs native layer: gate columns");
    gated = true; g_index = index; g_off = off; g_w = width; out_w = out_w_; out_b = float(out_b_);
    g_eps = float(g_eps_);
    if (w_rel_) { w_rel = *w_rel_; fp32(w_rel, G, "w_rel"); }
    if (w_prev_) { w_prev = *w_prev_; fp32(w_prev, G, "w_prev"); }
    if (rel_first_) { rel_first = *rel_first_; fp32(rel_first, G, "rel_first"); }
  }

  void mm(const float* X, int64_t M, const Packed& w, float* Y, int64_t isa) const {
    fbs_int8::mm(X, M, w.kp, w.P(), w.S(), w.n, Y, isa);
  }

  // K (rotated) and V of the rows flagged in write, at their slots; Y: the K/V(+gate) product (b, kvg.n)
  void write_kv(const Step& st, const float* Y, const bool* write, at::Tensor& kc, at::Tensor& vc,
                const int64_t* SL) const {
    const int64_t nk = kvg.n, w = nkv * hd, C = kc.size(2), rs = nkv * C * hd, hs = C * hd;
    float* KC = kc.data_ptr<float>();
    float* VC = vc.data_ptr<float>();
    for (int64_t i = 0; i < st.b; ++i) {
      if (!write[i]) continue;
      for (int64_t g = 0; g < nkv; ++g) {
        float* kd = KC + st.idx[i] * rs + g * hs + SL[i] * hd;
        std::copy_n(Y + i * nk + g * hd, hd, kd);
        rope(kd, st.cos + i * hd, st.sin + i * hd, hd);
        std::copy_n(Y + i * nk + w + g * hd, hd, VC + st.idx[i] * rs + g * hs + SL[i] * hd);
      }
    }
  }

  // H (m, d) = X[sel] + O(attention(RoPE(Q XN[sel]))) over each row's cache prefix (its K/V already written)
  void attention_rows(const Step& st, const float* X, const float* XN, const std::vector<int64_t>& sel,
                      const at::Tensor& kc, const at::Tensor& vc, const int64_t* SL, float* H) const {
    const int64_t m = sel.size(), qw = heads * hd, C = kc.size(2);
    std::vector<float> xs(m * d), qv(m * qw), att(m * qw);
    for (int64_t j = 0; j < m; ++j) std::copy_n(XN + sel[j] * d, d, xs.data() + j * d);
    mm(xs.data(), m, q, qv.data(), st.isa);
    const float* QB = q_b.defined() ? q_b.data_ptr<float>() : nullptr;
    for (int64_t j = 0; j < m; ++j) {
      float* qj = qv.data() + j * qw;
      if (QB) for (int64_t c = 0; c < qw; ++c) qj[c] += QB[c];
      for (int64_t hh = 0; hh < heads; ++hh) rope(qj + hh * hd, st.cos + sel[j] * hd, st.sin + sel[j] * hd, hd);
    }
    std::vector<int64_t> rows(m), lens(m);  // each query's cache row and last slot
    for (int64_t j = 0; j < m; ++j) { rows[j] = st.idx[sel[j]]; lens[j] = SL[sel[j]]; }
    fbs_attn::attend(qv.data(), qw, hd, rows.data(), lens.data(), m, heads, kc.data_ptr<float>(), vc.data_ptr<float>(),
                     nkv, C, hd, scale, st.isa, att.data());
    mm(att.data(), m, o, H, st.isa);
    for (int64_t j = 0; j < m; ++j) {
      const float* xi = X + sel[j] * d;
      float* hj = H + j * d;
      for (int64_t c = 0; c < d; ++c) hj[c] += xi[c];
    }
  }

  // H (m, d) += down(silu(gate(hn)) * up(hn)), hn = RMSNorm_2(H), in place
  void ffn_rows(float* H, int64_t m, int64_t isa) const {
    std::vector<float> hn(m * d), ff(m * 2 * inter), act(m * inter), dv(m * d);
    fbs_norm::rows(H, ln2.data_ptr<float>(), eps, hn.data(), m, d);
    mm(hn.data(), m, gu, ff.data(), isa);
    for (int64_t j = 0; j < m; ++j) {
      const float* gj = ff.data() + j * 2 * inter;
      float* aj = act.data() + j * inter;
      for (int64_t c = 0; c < inter; ++c) aj[c] = gj[c] / (1.0f + std::exp(-gj[c])) * gj[inter + c];
    }
    mm(act.data(), m, dn, dv.data(), isa);
    for (int64_t c = 0; c < m * d; ++c) H[c] += dv[c];
  }

  // One layer for the step's b rows: reads X (b, d), writes OUT (b, d) (a skipped row's input copied) unless no
  // row runs (then OUT is not touched); returns the number of rows that ran. Gated (terms not null): the
  // decision from terms (row i at terms + i * t_stride), x_prev (null: no previous layer, the constant
  // rel_first), ps (per row 1.0 where the previous layer was skipped; null: none was) and the step's thresholds
  // and policy; else run_in. Fills logits (gated), skip and run (b each).
  int64_t step(const Step& st, const float* X, float* OUT, at::Tensor& kc, at::Tensor& vc, const int64_t* SL,
               const float* terms, int64_t t_stride, const float* x_prev, const float* ps, const bool* run_in,
               double* logits, bool* skip, bool* run) const {
    const int64_t b = st.b, nk = kvg.n, C = kc.size(2);
    for (int64_t i = 0; i < b; ++i)
      TORCH_CHECK(st.idx[i] >= 0 && st.idx[i] < kc.size(0) && SL[i] >= 0 && SL[i] < C,
                  "fbs native layer: slot out of range");
    std::vector<float> xn(b * d), y(b * nk);
    fbs_norm::rows(X, ln1.data_ptr<float>(), eps, xn.data(), b, d);
    mm(xn.data(), b, kvg, y.data(), st.isa);
    if (kvg_b.defined()) {
      const float* B = kvg_b.data_ptr<float>();
      for (int64_t i = 0; i < b; ++i) for (int64_t j = 0; j < nk; ++j) y[i * nk + j] += B[j];
    }
    if (terms != nullptr) {
      TORCH_CHECK(gated, "fbs native layer: gate inputs for a layer without a gate");
      std::vector<float> hv(G);
      const float* WR = w_rel.defined() ? w_rel.data_ptr<float>() : nullptr;
      const float* RF = rel_first.defined() ? rel_first.data_ptr<float>() : nullptr;
      const float* WP = w_prev.defined() ? w_prev.data_ptr<float>() : nullptr;
      int64_t n_skip = 0;
      for (int64_t i = 0; i < b; ++i) {
        logits[i] = fbs_gate::row(terms + i * t_stride, g_w > 0 ? y.data() + i * nk + g_off : nullptr, X + i * d,
                                  x_prev ? x_prev + i * d : nullptr, x_prev ? nullptr : RF, ps ? ps[i] : 0.f,
                                  ps != nullptr, WR, WP, out_w.data_ptr<float>(), out_b, g_eps, d, G, hv.data());
        skip[i] = logits[i] > st.thresholds[i];
        n_skip += skip[i];
      }
      for (int64_t i = 0; i < b; ++i)
        run[i] = st.policy == 0 ? !skip[i] : st.policy == 1 ? n_skip < b : 2 * n_skip <= b;
    } else {
      for (int64_t i = 0; i < b; ++i) { run[i] = run_in[i]; skip[i] = !run_in[i]; }
    }
    std::unique_ptr<bool[]> write(new bool[b]);
    for (int64_t i = 0; i < b; ++i) write[i] = run[i] || st.write_skipped;
    write_kv(st, y.data(), write.get(), kc, vc, SL);
    std::vector<int64_t> sel;
    for (int64_t i = 0; i < b; ++i) if (run[i]) sel.push_back(i);
    const int64_t m = sel.size();
    if (m == 0) return 0;
    std::vector<float> h(m * d);  // the running rows, compacted
    attention_rows(st, X, xn.data(), sel, kc, vc, SL, h.data());
    ffn_rows(h.data(), m, st.isa);
    for (int64_t i = 0; i < b; ++i) if (!run[i]) std::copy_n(X + i * d, d, OUT + i * d);
    for (int64_t j = 0; j < m; ++j) std::copy_n(h.data() + j * d, d, OUT + sel[j] * d);
    return m;
  }
};

Step make_step(const at::Tensor& x, int64_t d, int64_t hd, const at::Tensor& cos, const at::Tensor& sin,
               const at::Tensor& idx, int64_t isa, int64_t policy, bool write_skipped,
               const std::vector<double>& thresholds) {
  TORCH_CHECK(isa >= 1 && isa <= fbs_int8::best_isa(), "fbs native layer: instruction set ", isa, " not available");
  const int64_t b = x.size(0);
  fp32(x, b * d, "x");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.numel() == b,
              "fbs native layer: (b,) int64 cache rows");
  TORCH_CHECK(thresholds.empty() || (int64_t)thresholds.size() == b, "fbs native layer: one threshold per row");
  return Step{b, fp32(cos, b * hd, "cos"), fp32(sin, b * hd, "sin"), idx.data_ptr<int64_t>(), isa, policy,
              write_skipped, thresholds.data()};
}

void check_cache(const Layer& L, const at::Tensor& kc, const at::Tensor& vc) {
  TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_contiguous() &&
              vc.is_contiguous() && kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(1) == L.nkv &&
              kc.size(3) == L.hd, "fbs native layer: KV caches (B, Hkv, C, hd) fp32, contiguous");
}

// Consecutive layers of one step in one call. Per layer: its caches, its rows' slots (slots[k * b + i]), gated or
// not (gated: terms row i of the gate is zterms[i, 0, index * G : (index + 1) * G]); not gated: run flags
// runs[k * b + i], or every row runs when runs is empty. x_prev / prev_skip: the previous layer's input and
// skip flags per row (x_prev None: no previous layer; prev_skip empty: no row skipped it). Returns
// (x out, input of the last layer, logits, skip, run), the last three flat (layers * b; logits NaN where no gate
// ran). x out is the input of the last layer itself when no row ran it.
std::tuple<at::Tensor, at::Tensor, std::vector<double>, std::vector<bool>, std::vector<bool>> run_layers(
    const std::vector<Layer*>& layers, const at::Tensor& x, const std::optional<at::Tensor>& x_prev,
    const std::vector<double>& prev_skip, const std::optional<at::Tensor>& zterms, const at::Tensor& cos,
    const at::Tensor& sin, const std::vector<at::Tensor>& kcs, const std::vector<at::Tensor>& vcs,
    const at::Tensor& idx, const std::vector<int64_t>& slots, const std::vector<bool>& gated,
    const std::vector<bool>& runs, const std::vector<double>& thresholds, int64_t policy, bool write_skipped,
    int64_t isa) {
  const int64_t n = layers.size();
  TORCH_CHECK(n > 0 && (int64_t)kcs.size() == n && (int64_t)vcs.size() == n && (int64_t)gated.size() == n,
              "fbs native layers: one cache pair and gate flag per layer");
  const Layer& L0 = *layers[0];
  const Step st = make_step(x, L0.d, L0.hd, cos, sin, idx, isa, policy, write_skipped, thresholds);
  const int64_t b = st.b, d = L0.d;
  TORCH_CHECK((int64_t)slots.size() == n * b && (runs.empty() || (int64_t)runs.size() == n * b),
              "fbs native layers: slots (and runs) per layer and row");
  TORCH_CHECK(prev_skip.empty() || (int64_t)prev_skip.size() == b, "fbs native layers: prev_skip per row");
  const float* Z = nullptr;
  int64_t z_stride = 0;
  if (zterms) {
    TORCH_CHECK(zterms->scalar_type() == at::kFloat && zterms->is_contiguous() && zterms->size(0) == b,
                "fbs native layers: gate terms (b, 1, n * G) fp32, contiguous");
    Z = zterms->data_ptr<float>();
    z_stride = zterms->size(-1);
  }
  const float* XP0 = x_prev ? fp32(*x_prev, b * d, "x_prev") : nullptr;
  std::vector<double> logits(n * b, std::nan("")), ps(prev_skip.begin(), prev_skip.end());
  std::vector<float> psf(b);
  std::vector<bool> skip_out(n * b), run_out(n * b);
  std::unique_ptr<bool[]> sk(new bool[b]), rn(new bool[b]), all_run(new bool[b]);
  for (int64_t i = 0; i < b; ++i) all_run[i] = true;
  at::Tensor cur = x, prev = x_prev ? *x_prev : at::Tensor();
  for (int64_t k = 0; k < n; ++k) {
    const Layer& L = *layers[k];
    TORCH_CHECK(L.d == d, "fbs native layers: layer widths differ");
    at::Tensor kc = kcs[k], vc = vcs[k];
    check_cache(L, kc, vc);
    const float* terms = nullptr;
    if (gated[k]) {
      TORCH_CHECK(Z != nullptr && L.gated && (L.g_index + 1) * L.G <= z_stride && !thresholds.empty(),
                  "fbs native layers: a gated layer needs its gate, the step's terms and thresholds");
      terms = Z + L.g_index * L.G;
    }
    std::unique_ptr<bool[]> given;
    if (!gated[k]) {
      given.reset(new bool[b]);
      for (int64_t i = 0; i < b; ++i) given[i] = runs.empty() ? true : bool(runs[k * b + i]);
    }
    for (int64_t i = 0; i < b; ++i) psf[i] = ps.empty() ? 0.f : float(ps[i]);
    at::Tensor out = at::empty_like(cur);
    const int64_t m = L.step(st, cur.data_ptr<float>(), out.data_ptr<float>(), kc, vc, slots.data() + k * b, terms,
                             z_stride, prev.defined() ? prev.data_ptr<float>() : nullptr,
                             ps.empty() ? nullptr : psf.data(), given.get(), logits.data() + k * b, sk.get(),
                             rn.get());
    bool every = true;
    for (int64_t i = 0; i < b; ++i) {
      skip_out[k * b + i] = sk[i];
      run_out[k * b + i] = rn[i];
      every = every && rn[i];
    }
    if (every) ps.clear();
    else { ps.assign(b, 0.0); for (int64_t i = 0; i < b; ++i) ps[i] = rn[i] ? 0.0 : 1.0; }
    prev = cur;
    if (m > 0) cur = out;  // else the layer's output is its input, the same tensor
  }
  return {cur, prev, logits, skip_out, run_out};
}
}  // namespace fbs_layer

namespace fbs_layer {
const std::vector<double> kNoThresholds;

// The two halves of a layer for every row, around what PAW / CH add in between (their layers of the native int8
// step): attend_layer writes the K/V of xn = RMSNorm_1(x) at the rows' slots and returns h = x + O(attention);
// ffn_layer returns h + FFN(h).
at::Tensor attend_layer(const Layer& L, const at::Tensor& x, const at::Tensor& xn, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc, const at::Tensor& idx,
                        const at::Tensor& slots, const std::optional<at::Tensor>& k,
                        const std::optional<at::Tensor>& v, int64_t isa) {
  const Step st = make_step(x, L.d, L.hd, cos, sin, idx, isa, 0, true, kNoThresholds);
  const int64_t b = st.b, nk = L.kvg.n;
  const float* XN = fp32(xn, b * L.d, "xn");
  check_cache(L, kc, vc);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == b,
              "fbs native layer: (b,) int64 slots");
  const int64_t* SL = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(st.idx[i] >= 0 && st.idx[i] < kc.size(0) && SL[i] >= 0 && SL[i] < kc.size(2),
                "fbs native layer: slot out of range");
  std::vector<int64_t> sel(b);
  for (int64_t i = 0; i < b; ++i) sel[i] = i;
  if (k && v) {  // K (rotated) and V already projected (a gated layer's pre step): (b, Hkv, 1, hd), rows strided
    for (const at::Tensor* t : {&*k, &*v})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->size(0) == b && t->size(1) == L.nkv &&
                  t->size(3) == L.hd && t->stride(3) == 1, "fbs native layer: K / V (b, Hkv, 1, hd) fp32");
    fbs_attn::write_kv(k->data_ptr<float>(), k->stride(0), k->stride(1), v->data_ptr<float>(), v->stride(0),
                       v->stride(1), b, st.idx, SL, kc.data_ptr<float>(), vc.data_ptr<float>(), L.nkv, kc.size(2), L.hd);
  } else {
    std::vector<float> y(b * nk);
    L.mm(XN, b, L.kvg, y.data(), isa);
    if (L.kvg_b.defined()) {
      const float* B = L.kvg_b.data_ptr<float>();
      for (int64_t i = 0; i < b; ++i) for (int64_t j = 0; j < nk; ++j) y[i * nk + j] += B[j];
    }
    std::unique_ptr<bool[]> write(new bool[b]);
    for (int64_t i = 0; i < b; ++i) write[i] = true;
    L.write_kv(st, y.data(), write.get(), kc, vc, SL);
  }
  at::Tensor h = at::empty_like(x);
  L.attention_rows(st, x.data_ptr<float>(), XN, sel, kc, vc, SL, h.data_ptr<float>());
  return h;
}

at::Tensor ffn_layer(const Layer& L, const at::Tensor& h, int64_t isa) {
  TORCH_CHECK(isa >= 1 && isa <= fbs_int8::best_isa(), "fbs native layer: instruction set ", isa, " not available");
  const int64_t b = h.numel() / L.d;
  fp32(h, b * L.d, "h");
  at::Tensor out = h.clone();
  L.ffn_rows(out.data_ptr<float>(), b, isa);
  return out;
}
}  // namespace fbs_layer

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gate_logits", &gate_logits);
  m.def("int8_linear", &int8_linear);
  m.def("int8_isa", &int8_isa);
  m.def("attend_one", &attend_one);
  m.def("rms_norm", &rms_norm);
  m.def("chunk_step", &chunk_step);
  pybind11::class_<fbs_layer::Layer>(m, "Int8Layer")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor,
                          at::Tensor, std::optional<at::Tensor>, at::Tensor, at::Tensor, std::optional<at::Tensor>,
                          at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>())
      .def("set_gate", &fbs_layer::Layer::set_gate);
  m.def("run_layers", &fbs_layer::run_layers);
  m.def("attend_layer", &fbs_layer::attend_layer);
  m.def("ffn_layer", &fbs_layer::ffn_layer);
}
"""

_SOURCE = _GATE_SOURCE + _INT8_SOURCE + _ATTN_SOURCE + _NORM_SOURCE + _CHUNK_SOURCE + _LAYER_SOURCE

_lock = threading.Lock()
_module = None
_failed: str | None = None


def enabled() -> bool:
    """Native kernels are wanted: ``FBS_NATIVE`` is unset or not ``0``."""
    return os.environ.get("FBS_NATIVE", "1") != "0"


def _build_dir() -> Path:
    from ..model.bases import cache_root

    digest = hashlib.sha256((_SOURCE + torch.__version__).encode()).hexdigest()[:12]
    return cache_root() / "native" / f"fbs-{digest}"


def module():
    """The compiled extension, building it on first use; None when disabled or the build failed (logged once)."""
    global _module, _failed
    if not enabled() or _failed is not None:
        return None
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load_inline

                path = _build_dir()
                path.mkdir(parents=True, exist_ok=True)
                if not (path / "fbs_native.so").exists():  # a pause the user should see explained
                    print(f"fbs: building the native kernels in {path} (once per machine, ~40 s)", file=sys.stderr)
                _module = load_inline("fbs_native", cpp_sources=_SOURCE,  # binds its own functions (PYBIND11_MODULE)
                                      extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                      build_directory=str(path), verbose=False)
            except Exception as e:  # no compiler, no ninja, a read-only cache ...: the PyTorch ops stay in use
                _failed = f"{type(e).__name__}: {e}"
                logger.warning("native kernels unavailable, using PyTorch ops (%s)", _failed.splitlines()[0])
    return _module


def status() -> dict:
    """What the engine runs with, for records (builds nothing): enabled, loaded, the int8 kernel's instruction set
    (None when not loaded or without AVX2), and the build error if the build failed."""
    isa = int8_isa() if _module is not None else None
    return {"enabled": enabled(), "loaded": _module is not None, "int8_isa": isa, "build_error": _failed}


def gate_args(gate: tuple) -> tuple:
    """The fused gate tuple (w_rel, w_prev, out_w (G,), out_b (1,), eps) as :func:`gate_logits` takes it (the
    scalars as Python floats, read once)."""
    w_rel, w_prev, out_w, out_b, eps = gate
    dense = lambda t: None if t is None else t.contiguous()  # noqa: E731  (e.g. w_rel is a column of a weight)
    return dense(w_rel), dense(w_prev), dense(out_w), float(out_b), float(eps)


def gate_logits(y: torch.Tensor, off: int, gy: int, terms: torch.Tensor, x: torch.Tensor,
                x_prev: torch.Tensor | None, rel_term: torch.Tensor | None, prev_skip: torch.Tensor | None,
                args: tuple) -> list[float]:
    """Per row of a one-token step, the logit :func:`fbs.engine.fused._gate_logit` computes, as Python floats.

    ``y`` (b, 1, W): the fused K/V(+gate) matmul's output, whose columns ``off:off + gy`` are the gate's input
    projection (``gy`` 0: the gate has none); ``terms`` (b, 1, G): its bias and preview term; ``args``:
    :func:`gate_args`. Every tensor fp32 on the CPU with a unit last stride (the kernel checks; the engine's
    residual stream and fused outputs are); the caller checks that :func:`module` is not None."""
    w_rel, w_prev, out_w, out_b, eps = args
    return _module.gate_logits(y, off, gy, terms, x, x_prev, rel_term, prev_skip, w_rel, w_prev, out_w, out_b, eps)


# --------------------------------------------------------------------------- int8 weight-only products
INT8_TILE, INT8_CHUNK = 4, 16  # the packed layout's tile height (output channels) and K chunk (bytes)
_ISA_NAMES = {2: "avx512", 1: "avx2"}


def int8_isa() -> str | None:
    """The instruction set :func:`int8_linear` runs with here ("avx512" or "avx2"; ``FBS_NATIVE_ISA=avx2`` asks
    for the narrower one), or None: no native int8 kernel (disabled, no build, or no AVX2)."""
    mod = module()
    best = mod.int8_isa() if mod is not None else 0
    if best == 2 and os.environ.get("FBS_NATIVE_ISA", "").lower() == "avx2":
        best = 1
    return _ISA_NAMES.get(best)


def int8_pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> the 1-D packed layout :func:`int8_linear` reads (tiles of 4 channels, K in 16-byte chunks,
    channel-interleaved; zero padding to whole tiles and chunks). :func:`int8_unpack` inverts it exactly."""
    n, k = q.shape
    tn, kc = -(-n // INT8_TILE), -(-k // INT8_CHUNK)
    padded = torch.zeros(tn * INT8_TILE, kc * INT8_CHUNK, dtype=torch.int8, device=q.device)
    padded[:n, :k] = q
    return padded.view(tn, INT8_TILE, kc, INT8_CHUNK).transpose(1, 2).contiguous().view(-1)


def int8_unpack(p: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The (N, K) int8 matrix of a :func:`int8_pack` ed one."""
    tn, kc = -(-n // INT8_TILE), -(-k // INT8_CHUNK)
    return p.view(tn, kc, INT8_TILE, INT8_CHUNK).transpose(1, 2).reshape(tn * INT8_TILE, kc * INT8_CHUNK)[:n, :k]


def int8_linear(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x (..., K) @ (q * s)^T`` for packed ``p`` (:func:`int8_pack`) and (N,) bf16 scales ``s``, in x's dtype
    (computed in fp32). The caller checks :func:`int8_isa` (the engine does once, when it packs the weights)."""
    k, n = x.shape[-1], s.shape[0]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if k % INT8_CHUNK:
        x2 = F.pad(x2, (0, INT8_CHUNK - k % INT8_CHUNK))
    y = _module.int8_linear(x2.contiguous(), p, s, _isa_code()).view(*x.shape[:-1], n)
    return y if y.dtype == x.dtype else y.to(x.dtype)


_isa_memo: dict[str, int] = {}


def _isa_code() -> int:
    """:func:`int8_isa` as the kernel's code, looked up once per ``FBS_NATIVE_ISA`` value (it is read per matmul)."""
    key = os.environ.get("FBS_NATIVE_ISA", "")
    code = _isa_memo.get(key)
    if code is None:
        code = _isa_memo[key] = {"avx512": 2, "avx2": 1}.get(int8_isa(), 0)
    return code


# --------------------------------------------------------------------------- one-query attention
def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               idx: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """A one-token step's attention over the static cache (what :func:`fbs.engine.fused._block_step` does with index
    writes and SDPA over the masked buffers): writes each row's ``k``/``v`` (b, Hkv, 1, hd) at ``slots`` (b,) of
    cache rows ``idx`` (b,) in ``kc``/``vc`` (B, Hkv, C, hd), then attends ``q`` (b, H, 1, hd) over slots
    0..slot only (GQA). Returns (b, 1, H * hd) fp32, the heads side by side as the O projection reads them."""
    return _module.attend_one(q, k, v, kc, vc, idx, slots, scale, _isa_code())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm ``w * (x * rsqrt(mean(x^2) + eps))`` of fp32 rows (x contiguous, w (d,)), in one call."""
    return _module.rms_norm(x.contiguous(), w, eps)


# --------------------------------------------------------------------------- the chunk head's online step
def chunk_step(head, xn: torch.Tensor, rows: torch.Tensor, state, attend: bool = True):
    """:meth:`fbs.model.chunk.ChunkHead.step` of one token per row in one call, on rows ``rows`` (b,) of the
    full :class:`fbs.model.chunk.ChunkState` ``state`` in place (no select / assign copies). Returns (c (b, 1, d)
    or None, bios logits (b, 1, 4), start (b,) bool) as the PyTorch step does. fp32 CPU."""
    from ..model.chunk import LABEL_I

    c, logits, start = _module.chunk_step(xn.contiguous(), rows, state.closed, state.n_closed, state.open_sum,
                                          state.open_count, head.bios.weight, head.bios.bias, head.key.weight,
                                          head.query.weight, head.out.weight, head.scale, LABEL_I, attend)
    return (c if attend else None), logits, torch.tensor(start, dtype=torch.bool)


def run_layers(layers: list, x: torch.Tensor, x_prev: torch.Tensor | None, prev_skip: list[float],
               zterms: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, kcs: list, vcs: list,
               idx: torch.Tensor, slots: list[int], gated: list[bool], runs: list[bool], thresholds: list[float],
               policy: int, write_skipped: bool):
    """Consecutive :class:`Int8Layer` s of a one-token step in one call (see
    :meth:`fbs.engine.fused.FusedOps.native_run`, which books the cache entries it writes)."""
    return _module.run_layers(layers, x, x_prev, prev_skip, zterms, cos, sin, kcs, vcs, idx, slots, gated, runs,
                              thresholds, policy, write_skipped, _isa_code())


def attend_layer(layer, x: torch.Tensor, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                 vc: torch.Tensor, idx: torch.Tensor, slots: torch.Tensor, kv=None) -> torch.Tensor:
    """The attention half of an :class:`Int8Layer` for every row: K/V of ``xn`` (RMSNorm_1(x)), or ``kv`` (rotated
    K, V (b, Hkv, 1, hd) when already projected), written at ``slots`` of cache rows ``idx``, then
    x + O(attention) over each row's prefix (PAW / CH add to it next)."""
    k, v = (None, None) if kv is None else kv
    return _module.attend_layer(layer, x, xn, cos, sin, kc, vc, idx, slots, k, v, _isa_code())


def ffn_layer(layer, h: torch.Tensor) -> torch.Tensor:
    """The FFN half of an :class:`Int8Layer`: h + down(silu(gate(hn)) * up(hn)), hn = RMSNorm_2(h)."""
    return _module.ffn_layer(layer, h, _isa_code())
