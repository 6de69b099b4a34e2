"""The model a baseline runs on: the FBS engine's model over a base decoder, with no FBS module in it.

No PAW, no CH and no skip gate (every layer is a never-skip layer of the FBS config), so the only thing that
skips is the baseline's own policy (``DecodeOptions.skip_policy`` in the engine, ``mixer=`` in the parallel
forward). The base weights are shared, not copied: timings compare like with like.
"""

from __future__ import annotations

from torch import nn

from ..model.config import FBSConfig
from ..model.causal_lm import FBSForCausalLM


def host_model(base, tokenizer=None, **config) -> FBSForCausalLM:
    """``base``: an HF causal LM instance or a bundled name / HF directory. ``config``: FBSConfig fields
    (``skip_granularity``, ``kv_policy``). Returns the model in eval mode."""
    if not isinstance(base, nn.Module):
        from ..model.bases import load_base

        base, tok = load_base(base)
        tokenizer = tokenizer or tok
    layers = base.config.num_hidden_layers
    cfg = FBSConfig(paw_layers=(), ch_layers=(), never_skip_first=layers, never_skip_last=0, **config)
    return FBSForCausalLM.from_base(base, config=cfg, tokenizer=tokenizer).eval()
