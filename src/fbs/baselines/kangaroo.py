"""Kangaroo's draft head (Liu et al. 2024): the first N decoder layers, one adapter layer, the shared LM head.

The adapter is an attention layer without FFN, as in the paper (one multi-head attention and two
normalizations)::

    h' = h + O(Attn(RMSNorm_in(h)))          GQA with RoPE, the base model's head shapes, its own KV cache
    logits = LM_head(RMSNorm_out(h'))        the base model's LM head, shared and frozen

``h`` is the full model's hidden state after layer N-1 (the input of layer N), so the draft's first N layers
are exactly the full model's and verification resumes at layer N (:mod:`fbs.engine.speculative`). Training distills
the full model's next-token distribution into the adapter (``fbs train kangaroo``,
:func:`fbs.train.speculative.train_kangaroo_adapter`); decoding: ``model.generate(ids, lossless=True,
draft_adapter=KangarooAdapter.load(path, model), draft_stop=0.6)``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..model.hf_adapter import apply_rope

CONFIG_NAME = "kangaroo.json"
WEIGHTS_NAME = "kangaroo.safetensors"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class KangarooAdapter(nn.Module):
    """One attention layer (no FFN) between the full model's layer ``exit_layer - 1`` and its LM head."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, exit_layer: int,
                 bias: bool = False, eps: float = 1e-6):
        super().__init__()
        self.exit_layer, self.num_heads = exit_layer, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.eps, self.scaling = eps, head_dim ** -0.5
        self.norm_in = nn.Parameter(torch.ones(hidden_size))
        self.norm_out = nn.Parameter(torch.ones(hidden_size))
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    @property
    def shape(self) -> dict:
        return {"hidden_size": self.norm_in.numel(), "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "exit_layer": self.exit_layer, "bias": self.q_proj.bias is not None,
                "eps": self.eps}

    @classmethod
    def for_model(cls, model, exit_layer: int) -> "KangarooAdapter":
        """An adapter for the FBS ``model`` exiting after ``exit_layer`` layers, started from the attention and input
        norm of layer ``exit_layer`` (the first layer it stands in for) and from the model's final norm."""
        spec, base = model.base.spec, model.base
        if not 0 < exit_layer < spec.num_layers:
            raise ValueError(f"exit_layer must be in 1..{spec.num_layers - 1}, got {exit_layer}")
        eps = float(getattr(base.norm, "variance_epsilon", getattr(base.norm, "eps", 1e-6)))
        adapter = cls(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, exit_layer,
                      bias=spec.attn_bias, eps=eps)
        layer = base.layers[exit_layer]
        with torch.no_grad():
            adapter.norm_in.copy_(layer.input_layernorm.weight)
            adapter.norm_out.copy_(base.norm.weight)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                src, dst = getattr(layer.self_attn, name), getattr(adapter, name)
                dst.weight.copy_(src.weight)
                if dst.bias is not None and src.bias is not None:
                    dst.bias.copy_(src.bias)
        return adapter.to(base.embedding_weight.dtype)

    # ---- the layer -------------------------------------------------------------
    def _heads(self, proj: nn.Linear, xn: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = xn.shape
        return proj(xn).view(b, t, n, self.head_dim).transpose(1, 2)  # (B, n, T, hd)

    def kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values (B, Hkv, T, hd) of hidden states ``h`` (B, T, d)."""
        xn = _rms(h, self.norm_in, self.eps)
        return apply_rope(self._heads(self.k_proj, xn, self.num_kv_heads), cos, sin), \
            self._heads(self.v_proj, xn, self.num_kv_heads)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend=None) -> torch.Tensor:
        """h (B, T, d) -> h' (B, T, d). ``attend(q, k, v)`` (a KV-cache context during decoding) defaults to causal
        attention over the T positions (training)."""
        b, t, _ = h.shape
        xn = _rms(h, self.norm_in, self.eps)
        q = apply_rope(self._heads(self.q_proj, xn, self.num_heads), cos, sin)
        k, v = self.kv(h, cos, sin)
        if attend is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                               enable_gqa=self.num_kv_heads != self.num_heads)
        else:
            o = attend(q, k, v)
        return h + self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def logits(self, h: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(_rms(h, self.norm_out, self.eps))

    # ---- files -----------------------------------------------------------------
    def save(self, path: str | os.PathLike, base_fingerprint: str | None = None, meta: dict | None = None) -> Path:
        """Write the weights (safetensors) and a JSON of the shape, the base model's fingerprint and ``meta``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        info = {"shape": self.shape, "base_fingerprint": base_fingerprint, **(meta or {})}
        with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-") as tmp:
            save_file(state, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
            Path(tmp, CONFIG_NAME).write_text(json.dumps(info, indent=1))
            for name in (WEIGHTS_NAME, CONFIG_NAME):
                os.replace(os.path.join(tmp, name), path / name)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model=None, check_base: bool = True) -> "KangarooAdapter":
        """Load an adapter; with ``model``, refuse one made for another base model or shape, or one that records no
        base fingerprint unless ``check_base=False``. Every refusal raises :class:`fbs.model.CheckpointError`."""
        from ..model.errors import CheckpointError, read_tensors

        path = Path(path)
        cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not cfg_file.is_file() or not w_file.is_file():
            raise CheckpointError(f"{path} is not a Kangaroo adapter: expected {CONFIG_NAME} and {WEIGHTS_NAME}; pass "
                                  "the directory `fbs train kangaroo --out-dir` wrote")
        try:
            info = json.loads(cfg_file.read_text())
            adapter = cls(**info["shape"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{cfg_file} is malformed ({e!r}); restore the file `fbs train kangaroo` "
                                  "wrote") from e
        sd = read_tensors(w_file, "copy the adapter again or retrain it (fbs train kangaroo)")
        own = {k: tuple(v.shape) for k, v in adapter.state_dict().items()}
        shapes = [f"{k}: file {tuple(v.shape)}, {CONFIG_NAME} {own[k]}" for k, v in sorted(sd.items())
                  if k in own and tuple(v.shape) != own[k]]
        if set(sd) != set(own) or shapes:
            raise CheckpointError(
                f"{w_file} does not match the shape in {CONFIG_NAME}: missing {sorted(set(own) - set(sd))}, "
                f"unexpected {sorted(set(sd) - set(own))}, shape mismatches {shapes}; restore the files "
                "`fbs train kangaroo` wrote together")
        adapter.load_state_dict(sd)
        if model is not None:
            spec, fp = model.base.spec, getattr(model.config, "base_fingerprint", None)
            have = (adapter.norm_in.numel(), adapter.num_heads, adapter.num_kv_heads, adapter.head_dim)
            want = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
            if have != want or adapter.exit_layer >= spec.num_layers:
                raise CheckpointError(
                    f"the adapter in {path} does not fit this model's shapes: adapter (hidden, heads, kv heads, "
                    f"head dim) = {have} exiting after layer {adapter.exit_layer}, model {want} with "
                    f"{spec.num_layers} layers; train an adapter for this model (fbs train kangaroo)")
            optout = "pass check_base=False only if you know it was trained on this base"
            if check_base and not info.get("base_fingerprint"):
                raise CheckpointError(f"the adapter in {path} records no base_fingerprint in {CONFIG_NAME}, so nothing "
                                      f"shows it was trained for this base model; retrain it, or {optout}")
            if check_base and fp != info["base_fingerprint"]:
                raise CheckpointError(
                    f"the adapter in {path} was trained for another base model (fingerprint "
                    f"{info['base_fingerprint']}, this model's base has {fp}); train an adapter for this base "
                    f"(fbs train kangaroo), or {optout}")
            adapter = adapter.to(device=model.base.embedding_weight.device, dtype=model.base.embedding_weight.dtype)
        return adapter.eval()
