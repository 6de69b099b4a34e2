"""Optional native (C++) kernels of the engine's eager one-token step, built on first use.

A skip gate's logit is a few hundred flops (:func:`fbs.fused._gate_logit`), but in eager PyTorch it is a dozen
operator dispatches plus a host read, which on a CPU cost more than the arithmetic by two orders of magnitude:
about 20 us per gated layer, several percent of an int8 decode step. :func:`gate_logits` computes the same
logits in one call and returns them as Python floats (the layer's one host read included).

The kernel is compiled with ``torch.utils.cpp_extension.load_inline`` the first time it is needed (about 30 s,
once per machine: the build is cached under ``$FBS_CACHE_DIR/native``, default ``~/.cache/fbs/native``). It is
used only where it computes exactly what the PyTorch ops compute up to float rounding: CPU, fp32 activations,
eager (a ``torch.compile``d step fuses the gate's ops itself). Without a C++ toolchain, or with
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

logger = logging.getLogger(__name__)

_SOURCE = r"""
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

_lock = threading.Lock()
_module = None
_failed: str | None = None


def enabled() -> bool:
    """Native kernels are wanted: ``FBS_NATIVE`` is unset or not ``0``."""
    return os.environ.get("FBS_NATIVE", "1") != "0"


def _build_dir() -> Path:
    from .models import cache_root

    digest = hashlib.sha256((_SOURCE + torch.__version__).encode()).hexdigest()[:12]
    return cache_root() / "native" / f"gate-{digest}"


def gate_module():
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
                if not (path / "fbs_native_gate.so").exists():  # a pause the user should see explained
                    print(f"fbs: building the native gate kernel in {path} (once per machine, ~30 s)", file=sys.stderr)
                _module = load_inline("fbs_native_gate", cpp_sources=_SOURCE, functions=["gate_logits"],
                                      extra_cflags=["-O3"], build_directory=str(path), verbose=False)
            except Exception as e:  # no compiler, no ninja, a read-only cache ...: the PyTorch ops stay in use
                _failed = f"{type(e).__name__}: {e}"
                logger.warning("native gate kernel unavailable, using PyTorch ops (%s)", _failed.splitlines()[0])
    return _module


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
    residual stream and fused outputs are); the caller checks that :func:`gate_module` is not None."""
    w_rel, w_prev, out_w, out_b, eps = args
    return _module.gate_logits(y, off, gy, terms, x, x_prev, rel_term, prev_skip, w_rel, w_prev, out_w, out_b, eps)
