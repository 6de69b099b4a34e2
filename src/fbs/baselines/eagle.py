"""EAGLE-2 (Li et al. 2024) on the frozen FBS model: one decoder layer that extrapolates the target's features.

The draft layer reads, at position i, the target's feature f_i (its last layer's output, before the final norm)
and the embedding of the token at i + 1, and predicts the feature f_{i+1}; the model's own final norm and LM head
turn a predicted feature into the distribution of the token at i + 2::

    x_i = W_fc [f_i; e(t_{i+1})]                           W_fc (d, 2d)
    h_i = x_i + O(Attn(RMSNorm(x_i)))                      causal GQA with the model's RoPE and head shapes
    f^_{i+1} = h_i + MLP(RMSNorm(h_i))                     SwiGLU of the model's FFN width

The backbone, embeddings, final norm and LM head stay frozen and shared. Training (``fbs train eagle``,
:mod:`fbs.train.eagle`): smooth-L1 regression to f_{i+1} plus KL to the target's next-token distribution at i + 1,
on the frozen model's features at full depth. Decoding (:class:`fbs.engine.drafts.EagleDraft`): EAGLE-2's dynamic
draft tree, expanded where the draft is most confident, verified in one pass with a tree attention mask.

Deviation from the paper: the layer starts from the target's last decoder layer (attention, FFN, norms) and
W_fc from [I, I] (the sum of the two inputs) instead of random weights, so that a short CPU run starts somewhere
useful; the paper's feature noise augmentation is left out.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..model.hf_adapter import apply_rope
from .medusa import take_shortlist, with_shortlist

CONFIG_NAME = "eagle.json"
WEIGHTS_NAME = "eagle.safetensors"
TRAIN_HINT = "train one with `fbs train eagle --out-dir DIR`"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class EagleLayer(nn.Module):
    """The EAGLE draft layer: ``W_fc`` over [feature; token embedding], then one pre-norm decoder layer."""

    #: the reduced draft vocabulary (token ids) whose rows of the LM head the draft scores at decode, or None (all)
    shortlist: torch.Tensor | None = None

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 bias: bool = False, eps: float = 1e-6):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.scaling = eps, head_dim ** -0.5
        d = hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.norm_in = nn.Parameter(torch.ones(d))
        self.norm_mid = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, d, bias=False)
        self.gate_proj = nn.Linear(d, intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, d, bias=False)

    @property
    def shape(self) -> dict:
        return {"hidden_size": self.norm_in.numel(), "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.gate_proj.out_features,
                "bias": self.q_proj.bias is not None, "eps": self.eps}

    @classmethod
    def for_model(cls, model) -> "EagleLayer":
        """A layer for the FBS ``model``, started from its last decoder layer and W_fc = [I, I]."""
        spec, base = model.base.spec, model.base
        last = base.layers[spec.num_layers - 1]
        mlp = last.mlp
        eps = float(getattr(last.input_layernorm, "variance_epsilon", getattr(last.input_layernorm, "eps", 1e-6)))
        layer = cls(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, mlp.gate_proj.out_features,
                    bias=spec.attn_bias, eps=eps)
        with torch.no_grad():
            eye = torch.eye(spec.hidden_size)
            layer.fc.weight.copy_(torch.cat([eye, eye], 1))
            layer.norm_in.copy_(last.input_layernorm.weight)
            layer.norm_mid.copy_(last.post_attention_layernorm.weight)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                src, dst = getattr(last.self_attn, name), getattr(layer, name)
                dst.weight.copy_(src.weight)
                if dst.bias is not None and src.bias is not None:
                    dst.bias.copy_(src.bias)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer, name).weight.copy_(getattr(mlp, name).weight)
        return layer.to(base.embedding_weight.dtype)

    def _heads(self, proj: nn.Linear, xn: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = xn.shape
        return proj(xn).view(b, t, n, self.head_dim).transpose(1, 2)  # (B, n, T, hd)

    def forward(self, f: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None):
        """Features ``f`` and next-token embeddings ``e`` (B, T, d) at the rotary tables' positions -> (predicted
        next features (B, T, d), the T new keys and values (B, Hkv, T, hd)). ``past`` (keys, values) come first
        in attention; ``mask`` (B, 1, T, n_past + T) bool says what each new entry sees (default: every past key
        and the new ones causally)."""
        b, t, _ = f.shape
        x = self.fc(torch.cat([f, e], -1))
        xn = _rms(x, self.norm_in, self.eps)
        q = apply_rope(self._heads(self.q_proj, xn, self.num_heads), cos, sin)
        k = apply_rope(self._heads(self.k_proj, xn, self.num_kv_heads), cos, sin)
        v = self._heads(self.v_proj, xn, self.num_kv_heads)
        kk, vv = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        gqa = self.num_kv_heads != self.num_heads
        if mask is None and past is None:
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=self.scaling, enable_gqa=gqa)
        else:
            if mask is None:
                n = kk.shape[2]
                mask = (torch.arange(n, device=q.device) <= (n - t + torch.arange(t, device=q.device))[:, None])
                mask = mask[None, None]
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
        h = x + self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        hn = _rms(h, self.norm_mid, self.eps)
        return h + self.down_proj(F.silu(self.gate_proj(hn)) * self.up_proj(hn)), k, v

    # ---- files -----------------------------------------------------------------
    def save(self, path: str | os.PathLike, base_fingerprint: str | None, meta: dict | None = None,
             dtype: torch.dtype | None = None) -> Path:
        """Write the weights (safetensors, in ``dtype`` if given), the JSON of the shape, the base fingerprint and
        ``meta``, and the integrity record, atomically."""
        from ..model.checkpoint import save_module_dir

        info = {"shape": self.shape, "base_fingerprint": base_fingerprint, **(meta or {})}
        if self.shortlist is not None:
            info["shortlist"] = int(self.shortlist.numel())
        state = {k: v.to(dtype or v.dtype) for k, v in self.state_dict().items()}
        return save_module_dir(path, with_shortlist(state, self), info, WEIGHTS_NAME, CONFIG_NAME)

    @classmethod
    def load(cls, path: str | os.PathLike, model=None, check_base: bool = True) -> "EagleLayer":
        """The layer saved in ``path``; with ``model``, refuse one of other shapes or (unless ``check_base=False``)
        trained on another base model. Every refusal is a :class:`fbs.model.CheckpointError` naming the fix."""
        from ..model.checkpoint import read_module_dir
        from ..model.errors import CheckpointError

        info, tensors = read_module_dir(path, WEIGHTS_NAME, CONFIG_NAME, "EAGLE layer", TRAIN_HINT)
        layer = cls(**info["shape"])
        layer.load_state_dict({k: v.float() for k, v in take_shortlist(tensors, layer).items()})
        if model is not None:
            spec = model.base.spec
            have = (layer.norm_in.numel(), layer.num_heads, layer.num_kv_heads, layer.head_dim)
            want = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
            if have != want:
                raise CheckpointError(f"the EAGLE layer in {path} has (hidden, heads, kv heads, head dim) {have}, the "
                                      f"model {want}; {TRAIN_HINT}")
            fp = getattr(model.config, "base_fingerprint", None)
            if check_base and info.get("base_fingerprint") != fp:
                raise CheckpointError(f"the EAGLE layer in {path} was trained on another base model (fingerprint "
                                      f"{info.get('base_fingerprint')}, this model's base has {fp}); {TRAIN_HINT}")
            layer = layer.to(model.base.embedding_weight.device, model.base.embedding_weight.dtype)
        return layer.eval()


def draft_factory(session, layer=None, path=None, check_base: bool = True, depth: int | None = None, topk: int = 4,
                  nodes: int = 16, shortlist: bool = True):
    """``eagle`` with a layer module, a saved one (``path``), or the one shipped for the model's base
    (:func:`fbs.baselines.medusa.shipped_draft`); the tree's ``depth``, ``topk`` and ``nodes`` go to
    :class:`fbs.engine.drafts.EagleDraft`."""
    from ..engine.drafts import EagleDraft
    from .medusa import shipped_draft

    if layer is None:
        path = path if path is not None else shipped_draft("eagle", session.dec.m)
        if path is not None:
            layer = EagleLayer.load(path, session.dec.m, check_base)
    return EagleDraft(session, layer, depth=depth, topk=topk, nodes=nodes, shortlist=shortlist)
