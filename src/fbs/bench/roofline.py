"""Roofline of one decode step: the fastest a machine could decode, from bytes moved and FLOPs done.

A decode step of a batch of B rows must at least read the weights of every layer that runs (once for the
batch), the K/V cache those layers attend to (per row), and the LM head; and it must do 2·MACs FLOPs per
row. With a measured memory bandwidth BW and matmul throughput P:

    t_step >= max(bytes / BW, flops / P),   roofline tok/s = B / t_step

evaluated at the mean decode context (prompt + N/2). On CPUs, fp32 decode of small models is far on the
bandwidth side, so skipping a layer saves its weight bytes almost one for one. A system's *fraction of
roofline* is its measured decode tok/s over the baseline roofline (the same bound for every system, so that
the fractions compare), and, for layer-skipping systems, also over its own skip-adjusted roofline.

Public entry points:
    measure_machine(size_mb, repeats)   -> MachinePeaks (bandwidth: streaming read, copy, GEMV; fp32 matmul)
    decode_roofline(cost, peaks, ...)   -> dict with bytes, FLOPs, bound and tok/s of one decode step
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from fbs.engine.flops import WEIGHT_FORMATS, LayerCost, WeightFormat, step_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class MachinePeaks:
    read_gbs: float  # streaming read (sum over a large fp32 tensor)
    copy_gbs: float  # bytes read + written by a large copy
    gemv_gbs: float  # weight bytes per second of a large fp32 matrix-vector product (decode's kernel)
    matmul_gflops: float  # fp32 square matmul
    threads: int

    @property
    def bandwidth_gbs(self) -> float:
        """Best measured read bandwidth: the ceiling that decoding's weight reads can reach."""
        return max(self.read_gbs, self.gemv_gbs)


def _best_time(fn, repeats: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: page faults, thread pool, kernel selection
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure_machine(size_mb: int = 256, repeats: int = 5, matmul_n: int = 2048,
                    device: torch.device | str = "cpu") -> MachinePeaks:
    """Measure bandwidth and matmul throughput (best of ``repeats``) on the current torch thread setting.

    ``size_mb`` must be well above the last-level cache. Takes a few seconds at the defaults.
    """
    device = torch.device(device)
    n = size_mb * 2**20 // 4
    a = torch.rand(n, device=device)
    b = torch.empty_like(a)
    nbytes = a.numel() * 4
    read = nbytes / _best_time(lambda: a.sum(), repeats, device) / 1e9
    copy = 2 * nbytes / _best_time(lambda: b.copy_(a), repeats, device) / 1e9
    side = int((n // 1) ** 0.5)
    w = a[: side * side].view(side, side)
    x = torch.rand(side, device=device)
    gemv = side * side * 4 / _best_time(lambda: torch.mv(w, x), repeats, device) / 1e9
    del a, b, w
    m1, m2 = (torch.rand(matmul_n, matmul_n, device=device) for _ in range(2))
    mm = 2 * matmul_n**3 / _best_time(lambda: m1 @ m2, repeats, device) / 1e9
    peaks = MachinePeaks(read_gbs=read, copy_gbs=copy, gemv_gbs=gemv, matmul_gflops=mm,
                         threads=torch.get_num_threads())
    logger.info("machine: read %.1f GB/s, copy %.1f GB/s, gemv %.1f GB/s, matmul %.1f GFLOP/s (%d threads)",
                read, copy, gemv, mm, peaks.threads)
    return peaks


#: llama.cpp's GGUF tensor types as byte formats: the type's bytes per weight (scales, and mins for Q4_1, included),
#: the LM head in Q8_0 for the 4-bit types (as SmolLM2's GGUFs store it), its default K/V cache in f16 (the layers'
#: norm vectors, f32 in the files, are priced at 2 bytes too: well under 0.1 % of a step's bytes).
GGUF_FORMATS: dict[str, WeightFormat] = {
    "F16": WeightFormat("F16", weight=2, scale=0, activation=2),
    "Q8_0": WeightFormat("Q8_0", weight=1 + 2 / 32, scale=0, activation=2),
    "Q4_1": WeightFormat("Q4_1", weight=0.5 + 4 / 32, scale=0, activation=2, head="q8"),
    "Q4_0": WeightFormat("Q4_0", weight=0.5 + 2 / 32, scale=0, activation=2, head="q8"),
}


def system_format(params: dict) -> WeightFormat | None:
    """The byte format a bench system decodes in, from its params: ``weights`` (the engine's formats; fp32 when
    absent) or a llama.cpp ``format``; None for a format without a byte model."""
    if "format" in params:
        return GGUF_FORMATS.get(str(params["format"]).upper())
    return WEIGHT_FORMATS.get(params.get("weights", "fp32"))


def decode_roofline(cost: LayerCost, peaks: MachinePeaks, prompt_len: int, new_tokens: int, batch: int = 1,
                    executed_fraction: float = 1.0, kv_policy: str = "project",
                    overhead_macs_per_token: float = 0.0, weights: str = "fp32",
                    kv_dtype: str | None = None) -> dict[str, float]:
    """Lower bound on one decode step's time, at the mean decode context, for a given executed-layer fraction.

    Bytes are :func:`fbs.engine.flops.step_bytes` (weights once per step for the batch, K/V per row in ``kv_dtype``'s
    storage; skipped layers read nothing under ``hole`` and their K/V projection weights under ``project``), FLOPs
    are 2 x MACs per row.
    """
    L = cost.num_layers
    ctx = prompt_len + new_tokens / 2
    run = executed_fraction * L
    total_bytes = step_bytes(cost, ctx, run, kv_policy, batch, weights, kv_dtype)
    macs_row = run * cost.layer_macs(int(ctx)) + cost.lm_head + overhead_macs_per_token
    if kv_policy == "project":
        macs_row += (L - run) * cost.kv_proj
    flops = 2 * macs_row * batch
    t_mem = total_bytes / (peaks.bandwidth_gbs * 1e9)
    t_cmp = flops / (peaks.matmul_gflops * 1e9)
    t = max(t_mem, t_cmp)
    return {
        "context": ctx,
        "bytes_per_step": total_bytes,
        "flops_per_step": flops,
        "bound": "memory" if t_mem >= t_cmp else "compute",
        "step_s": t,
        "tok_s": batch / t,
    }
