"""Optional native (C++) kernels of the engine's eager one-token step, built on first use.

Four kernels, one extension:

* **Gate logits** (:func:`gate_logits`). A skip gate's logit is a few hundred flops
  (:func:`fbs.fused._gate_logit`), but in eager PyTorch it is a dozen operator dispatches plus a host read, which
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

// Skip-gate logits of b rows, one token each (fbs.fused._gate_logit):
//   h = y[:, off:off+G] (absent when G_y == 0) + terms
//       + w_rel * log(eps + ||x - x_prev|| / max(||x_prev||, 1e-6))   (x_prev given)
//       + rel_term                                                      (else, when given)
//       + w_prev * prev_skip                                            (when given)
//   logit = out_b + sum_j out_w[j] * silu(h[j])
// Every tensor is fp32 on the CPU with a unit stride in its last dimension; rows may be strided (views).
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
  for (int64_t i = 0; i < b; ++i) {
    const float* ti = T + i * terms.stride(0);
    for (int64_t j = 0; j < G; ++j) h[j] = ti[j];
    if (Y) {
      const float* yi = Y + i * y.stride(0) + off;
      for (int64_t j = 0; j < G; ++j) h[j] = yi[j] + h[j];
    }
    if (P && WR) {
      const float* xi = X + i * x.stride(0);
      const float* pi = P + i * x_prev->stride(0);
      double su = 0.0, sp = 0.0;
      for (int64_t j = 0; j < d; ++j) {
        const double diff = double(xi[j]) - double(pi[j]);
        su += diff * diff;
        sp += double(pi[j]) * double(pi[j]);
      }
      const float u = float(std::sqrt(su)), up = std::max(float(std::sqrt(sp)), 1e-6f);
      const float r = std::log(float(eps) + u / up);
      for (int64_t j = 0; j < G; ++j) h[j] += r * WR[j];
    } else if (RT) {
      for (int64_t j = 0; j < G; ++j) h[j] += RT[j];
    }
    if (PS && WP) {
      const float s = PS[i * prev_skip->stride(0)];
      for (int64_t j = 0; j < G; ++j) h[j] += s * WP[j];
    }
    double acc = 0.0;
    for (int64_t j = 0; j < G; ++j) acc += double(OW[j]) * double(h[j] / (1.0f + std::exp(-h[j])));
    out[i] = acc + out_b;
  }
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
  const float* X = x.data_ptr<float>();
  const int8_t* P = p.data_ptr<int8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>());
  float* Y = y.data_ptr<float>();
  const int64_t nc = Kp / kChunk, tile_bytes = kNB * Kp;
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
  float* KC = kc.data_ptr<float>();
  float* VC = vc.data_ptr<float>();
  const int64_t rs = Hkv * C * hd, hs = C * hd;  // cache row and head strides
  for (int64_t i = 0; i < b; ++i)
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t at_ = I[i] * rs + g * hs + L[i] * hd;
      std::copy_n(k.data_ptr<float>() + i * k.stride(0) + g * k.stride(1), hd, KC + at_);
      std::copy_n(v.data_ptr<float>() + i * v.stride(0) + g * v.stride(1), hd, VC + at_);
    }
  auto out = at::empty({b, 1, H * hd}, q.options());
  float* O = out.data_ptr<float>();
  const float* Q = q.data_ptr<float>();
  const int64_t group = H / Hkv;
  auto head = fbs_attn::head_scalar;
#ifdef FBS_X86
  if (isa == 2 && hd % 16 == 0 && hd <= fbs_attn::kMaxHd) head = fbs_attn::head512;
  else if (isa >= 1 && hd % 8 == 0 && hd <= fbs_attn::kMaxHd) head = fbs_attn::head256;
#endif
  at::parallel_for(0, b * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(C);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / H, h = t % H;
      const int64_t kv = I[i] * rs + (h / group) * hs;
      head(Q + i * q.stride(0) + h * q.stride(1), KC + kv, VC + kv, L[i] + 1, hd, float(scale), p.data(),
           O + i * H * hd + h * hd);
    }
  });
  return out;
}
"""

_NORM_SOURCE = r"""
// HF's Llama/Qwen RMSNorm of fp32 rows: w * (x * rsqrt(mean(x^2) + eps)), the statistic accumulated in fp32.
namespace fbs_norm {
__attribute__((target_clones("avx512f", "avx2", "default")))
float sumsq(const float* x, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += x[d] * x[d];
  return s;
}
__attribute__((target_clones("avx512f", "avx2", "default")))
void scale(const float* x, const float* w, float r, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] = w[d] * (x[d] * r);
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
  for (int64_t i = 0; i < rows; ++i) {
    const float r = 1.0f / std::sqrt(fbs_norm::sumsq(X + i * d, d) / float(d) + float(eps));
    fbs_norm::scale(X + i * d, W, r, Y + i * d, d);
  }
  return y;
}
"""

_SOURCE = _GATE_SOURCE + _INT8_SOURCE + _ATTN_SOURCE + _NORM_SOURCE
_FUNCTIONS = ["gate_logits", "int8_linear", "int8_isa", "attend_one", "rms_norm"]

_lock = threading.Lock()
_module = None
_failed: str | None = None


def enabled() -> bool:
    """Native kernels are wanted: ``FBS_NATIVE`` is unset or not ``0``."""
    return os.environ.get("FBS_NATIVE", "1") != "0"


def _build_dir() -> Path:
    from .models import cache_root

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
                _module = load_inline("fbs_native", cpp_sources=_SOURCE, functions=_FUNCTIONS,
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
    """Per row of a one-token step, the logit :func:`fbs.fused._gate_logit` computes, as Python floats.

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
    """A one-token step's attention over the static cache (what :func:`fbs.fused._block_step` does with index
    writes and SDPA over the masked buffers): writes each row's ``k``/``v`` (b, Hkv, 1, hd) at ``slots`` (b,) of
    cache rows ``idx`` (b,) in ``kc``/``vc`` (B, Hkv, C, hd), then attends ``q`` (b, H, 1, hd) over slots
    0..slot only (GQA). Returns (b, 1, H * hd) fp32, the heads side by side as the O projection reads them."""
    return _module.attend_one(q, k, v, kc, vc, idx, slots, scale, _isa_code())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm ``w * (x * rsqrt(mean(x^2) + eps))`` of fp32 rows (x contiguous, w (d,)), in one call."""
    return _module.rms_norm(x.contiguous(), w, eps)
