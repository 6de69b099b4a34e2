"""The engine's default weight format and KV cache storage, decided in this one place (``fbs generate``,
``fbs serve``, the API's ``weights="auto"``, ``kv_dtype="auto"``).

Rule: the fastest format whose held-out perplexity lies within :data:`PPL_TOLERANCE` of fp32's, on a CPU where that
format's native kernels run; fp32 where none of them does. :data:`QUALIFYING` lists the formats that meet the
tolerance, fastest first (the measurements behind the list are in docs/eval.md, "Default weight format", and
``results/llama_cpp_ppl.json``: the base model, which is what the default runs (no FBS weights ship as the default,
docs/eval.md, "Operating point"); ``tests/test_operating_point.py`` checks the list against that record).
``--weights fp32`` (or any explicit format) is always honoured as given.

KV cache: the quantized formats store it as int8 entries with key factors (:func:`default_kv_dtype`; codes and a scale
per entry, keys divided by per-channel powers of two, :func:`fbs.engine.quant.key_factors`): about a quarter of fp32's
bytes, held-out PPL within 0.1 % of the fp32 cache on SmolLM2 (q4, q8, int8) and Qwen2.5-Coder (int8 weights), free-
running chat not different from the fp16 cache (docs/eval.md, "Default KV cache"); fp32 and bf16 weights keep a cache
of their own dtype (fp32 stays bit-faithful to HF).

Prefill (:func:`default_prefill`): under the quantized formats, bf16 GEMMs on a CPU with AMX-BF16 tiles (where
oneDNN's bf16 GEMM measured 6x its fp32 GEMM; the prompt's keys about 3x closer to the fp32 prefill's than the
blocks prefill's; PPL and free-running chat in docs/eval.md, "Default prefill"); fp32 GEMMs (the HF modules')
elsewhere and under fp32 / bf16 weights (``--weights fp32`` stays bit-faithful to HF). The int8 and blocks prefills
move free-running answers beyond q4's own rounding (ROUGE-L against the fp32 base 0.43 / 0.60 vs 0.67): options.
"""

from __future__ import annotations

from typing import Mapping

#: relative held-out PPL increase over fp32 a default format may cost
PPL_TOLERANCE = 0.005
#: formats within the tolerance, fastest first; each needs its native kernels to be the default
QUALIFYING = ("q4", "q8", "int8")
#: the value of ``--weights`` / ``weights=`` that asks for :func:`default_weights`
AUTO = "auto"
#: what runs when no qualifying format has its kernels on this machine
FALLBACK = "fp32"
#: the KV cache storages (``kv_dtype``; their torch dtypes: :data:`fbs.engine.cache.KV_DTYPES`), and what
#: ``kv_dtype`` / ``--kv-dtype`` accept: one of them or ``auto`` (:func:`default_kv_dtype`)
KV_STORAGE = ("fp32", "fp16", "bf16", "int8")
KV_DTYPE_CHOICES = (AUTO, *KV_STORAGE)
#: how a prompt's products run (``prefill`` / ``--prefill``; fbs.engine.prefill): fp32 (the HF modules' GEMMs), bf16
#: (bf16 GEMMs), int8 (per-token int8 activations), blocks (the decode format's own block kernels), or ``auto``
#: (:func:`default_prefill`)
PREFILL = ("fp32", "bf16", "int8", "blocks")
PREFILL_CHOICES = (AUTO, *PREFILL)
#: the CPU flag under which the quantized formats' default prefill is bf16 (module doc): AMX's bf16 tiles
BF16_PREFILL_FLAG = "amx_bf16"


def default_weights(kernels: Mapping[str, str | None] | None = None) -> str:
    """The default format for a machine whose native kernels per format are ``kernels`` (format -> description, or
    None where the PyTorch ops run; default: :func:`fbs.engine.quant.native_kernels`, which builds the native
    extension on first use)."""
    if kernels is None:
        from .quant import native_kernels

        kernels = native_kernels()
    for fmt in QUALIFYING:
        if kernels.get(fmt):
            return fmt
    return FALLBACK


def default_kv_dtype(weights: str) -> str:
    """The KV cache storage ``kv_dtype="auto"`` stands for under ``weights`` (already resolved): int8 (with key
    factors) for the quantized formats (:data:`QUALIFYING`), fp32 (the weights' own compute dtype) otherwise."""
    return "int8" if weights in QUALIFYING else "fp32"


def resolve_kv_dtype(kv_dtype: str, weights: str) -> str:
    """``auto`` -> :func:`default_kv_dtype` of ``weights``; any other value unchanged."""
    return default_kv_dtype(weights) if kv_dtype == AUTO else kv_dtype


def default_prefill(weights: str, cpu_flags: tuple[str, ...] | None = None) -> str:
    """The prompt products ``prefill="auto"`` stands for under ``weights`` (already resolved) on a CPU with
    ``cpu_flags`` (default: this one's, :func:`fbs.provenance.cpu_info`): bf16 under the quantized formats
    (:data:`QUALIFYING`) where the CPU has :data:`BF16_PREFILL_FLAG`, fp32 (the HF modules' GEMMs) otherwise."""
    if weights not in QUALIFYING:
        return "fp32"
    if cpu_flags is None:
        from ..provenance import cpu_info

        cpu_flags = cpu_info()[1]
    return "bf16" if BF16_PREFILL_FLAG in cpu_flags else "fp32"


def resolve_prefill(prefill: str, weights: str) -> str:
    """``auto`` -> :func:`default_prefill` of ``weights`` on this CPU; any other value unchanged."""
    return default_prefill(weights) if prefill == AUTO else prefill


def resolve_weights(weights: str | None) -> str | None:
    """``auto`` -> :func:`default_weights`; any other value (None: the engine's own default) unchanged."""
    return default_weights() if weights == AUTO else weights
