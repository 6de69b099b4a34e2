"""The engine's default weight format, decided in this one place (``fbs generate``, ``fbs serve``, the API's
``weights="auto"``).

Rule: the fastest format whose held-out perplexity lies within :data:`PPL_TOLERANCE` of fp32's, on a CPU where that
format's native kernels run; fp32 where none of them does. :data:`QUALIFYING` lists the formats that meet the
tolerance, fastest first (the measurements behind the list are in docs/eval.md, "Default weight format", and
``results/llama_cpp_ppl.json``: the base model, which is what the default runs (no FBS weights ship as the default,
docs/eval.md, "Operating point"); ``tests/test_operating_point.py`` checks the list against that record).
``--weights fp32`` (or any explicit format) is always honoured as given.
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


def resolve_weights(weights: str | None) -> str | None:
    """``auto`` -> :func:`default_weights`; any other value (None: the engine's own default) unchanged."""
    return default_weights() if weights == AUTO else weights
