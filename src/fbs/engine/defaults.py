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

Prefill: fp32 GEMMs (the HF modules') in every format. The int8 prefill (:mod:`fbs.engine.prefill`, 1.7x faster
at 512 tokens) passes the perplexity tolerance under q4 (+0.22 %, ``results/prefill_ppl.json``) but moves
free-running answers far beyond q4's own rounding (ROUGE-L against the fp32 base 0.43 vs 0.67,
``results/chat_prefill_int8.md``; docs/eval.md, "Default prefill"): it stays an option (``prefill="int8"``).
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
#: how a prompt's products run (``prefill`` / ``--prefill``; fbs.engine.prefill): fp32 (the HF modules' GEMMs), int8
#: (per-token int8 activations), blocks (the decode format's own block kernels), or ``auto`` (:func:`default_prefill`)
PREFILL = ("fp32", "int8", "blocks")
PREFILL_CHOICES = (AUTO, *PREFILL)
#: formats whose default prefill is int8: none (module doc)
INT8_PREFILL: tuple[str, ...] = ()


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


def default_prefill(weights: str) -> str:
    """The prompt products ``prefill="auto"`` stands for under ``weights`` (already resolved): int8 under
    :data:`INT8_PREFILL` (none), fp32 (the HF modules' GEMMs) otherwise."""
    return "int8" if weights in INT8_PREFILL else "fp32"


def resolve_prefill(prefill: str, weights: str) -> str:
    """``auto`` -> :func:`default_prefill` of ``weights``; any other value unchanged."""
    return default_prefill(weights) if prefill == AUTO else prefill


def resolve_weights(weights: str | None) -> str | None:
    """``auto`` -> :func:`default_weights`; any other value (None: the engine's own default) unchanged."""
    return default_weights() if weights == AUTO else weights
