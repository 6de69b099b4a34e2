"""FBSForCausalLM: a pretrained decoder plus PAW, CH and SG, with one parallel forward.

The parallel forward serves training (soft mixture with straight-through gates), teacher-forced
evaluation under skipping (thresholded or planned gates) and the equivalence tests. Decoding lives in
:mod:`fbs.engine`; both run the same per-layer pieces of :class:`fbs.model.hf_adapter.BaseDecoder`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from .checkpoint import (BACKBONE_NAME, CONFIG_NAME, MANIFEST_NAME, WEIGHTS_NAME, CheckpointError,  # noqa: F401
                         load_checkpoint, write_manifest)
from .config import FBSConfig
from .hf_adapter import BaseDecoder
from .chunk import ChunkHead
from .layer import HFOps, Mix, SequenceContext, layer_step, next_gate_inputs
from .gate import SkipGates, straight_through
from .preview import ParafoveaWindow, default_preview_ids

logger = logging.getLogger(__name__)

GateMode = Literal["off", "soft", "threshold", "plan"]
@dataclasses.dataclass
class FBSOutput:
    """Everything the training losses and analyses need from one parallel forward.

    P = number of PAW layers, C = number of CH layers, L = number of decoder layers.
    """

    logits: torch.Tensor                      # (B, T, V)
    gate_probs: torch.Tensor                  # (B, T, L) skip probabilities, 0 for never-skip layers
    skips: torch.Tensor                       # (B, T, L) applied skip decisions (straight-through in soft mode)
    preview_logits: torch.Tensor | None       # (P, B, T, k_max, N+1)
    window_k: torch.Tensor | None             # (P, B, T) k~ = k_max sigmoid(s)
    window_weights: torch.Tensor | None       # (P, B, T, k_max) window weights applied
    bios_logits: torch.Tensor | None          # (C, B, T, 4)
    chunk_boundary: torch.Tensor | None       # (C, B, T) bool
    chunk_states: torch.Tensor | None         # (C, B, T, Rc) open-chunk state per token
    token_chunk_states: torch.Tensor | None   # (C, B, T, Rc) token projection in chunk space
    hidden_states: tuple[torch.Tensor, ...] | None = None  # L+1 tensors (B, T, d) when requested
    layer_updates: torch.Tensor | None = None  # (B, T, L) soft mode: relative update of each skippable unit, run or not

    @property
    def window_k_hard(self) -> torch.Tensor | None:
        return None if self.window_k is None else torch.floor(self.window_k).long()


@dataclasses.dataclass
class SkipTraining:
    """Extra controls of the ``soft`` gate mode for skip-tolerance training (docs/train.md, "skip distillation").

    All tensors are (B, T, L); entries of layers that are not gated and positions before ``gate_from`` are ignored.
    """

    force_skip: torch.Tensor | None = None
    """bool: pairs skipped whatever the gate says (random layer dropout)."""
    probe: torch.Tensor | None = None
    """zeros with ``requires_grad``, added to each pair's mixture weight g. After ``backward`` its ``.grad`` is
    dL/dg = <dL/dh', h - f(h)>: the first-order change of the loss if the pair were skipped (computed) more."""
    straight_through: bool = True
    """Pass dL/dg to the gate probability (appendix E.2). False: the mixture weight is the hard decision only,
    so gates learn from their own losses (targets, budget) and nothing else."""
    detach_gate_inputs: bool = False
    """Gates read detached states, so gate losses never reach the backbone."""


class FBSForCausalLM(nn.Module):
    """A pretrained Llama/Qwen2/Qwen3/Mistral decoder with FBS modules. Build with :meth:`from_base`."""

    def __init__(self, hf_model: nn.Module, config: FBSConfig | None = None, tokenizer=None):
        super().__init__()
        self.base = BaseDecoder(hf_model)
        spec = self.base.spec
        cfg = (config or FBSConfig()).replace()
        if cfg.preview_vocab_size >= spec.vocab_size:
            cfg = cfg.replace(preview_vocab_size=spec.vocab_size - 1)
        self.config = cfg
        self.layers_cfg = cfg.resolve(spec.num_layers)
        self.tokenizer = tokenizer
        d = spec.hidden_size
        self.paw = nn.ModuleDict({str(l): ParafoveaWindow(cfg, d) for l in self.layers_cfg.paw})
        self.ch = nn.ModuleDict({str(l): ChunkHead(cfg, d) for l in self.layers_cfg.ch})
        self.gates = SkipGates(cfg, d, self.layers_cfg.gated)
        special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
        ids = default_preview_ids(spec.vocab_size, cfg.preview_vocab_size, special)
        self.register_buffer("preview_ids", ids, persistent=True)
        self.register_buffer("preview_index", self._index_of(ids, spec.vocab_size), persistent=False)
        dtype = self.base.embedding_weight.dtype
        self.paw.to(dtype), self.ch.to(dtype), self.gates.to(dtype)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_base(cls, base, config: FBSConfig | None = None, tokenizer=None,
                  dtype: torch.dtype = torch.float32) -> "FBSForCausalLM":
        """``base``: an HF causal-LM instance, a local HF directory, or a bundled name (``"smollm2-135m"``)."""
        from .bases import base_fingerprint, load_base

        if isinstance(base, nn.Module):
            hf, name = base, getattr(base, "fbs_base_name", None) or getattr(base.config, "_name_or_path", None)
        else:
            hf, tok = load_base(base, dtype=dtype)
            tokenizer, name = tokenizer or tok, hf.fbs_base_name
        for p in hf.parameters():
            if not torch.isfinite(p).all():
                raise ValueError("the base model has NaN or infinite weights; it cannot be used as an FBS base")
        cfg = (config or FBSConfig()).replace(base_model=name, base_fingerprint=base_fingerprint(hf))
        return cls(hf, cfg, tokenizer)

    @staticmethod
    def _index_of(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        index = torch.full((vocab_size,), len(ids), dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        return index

    def set_preview_vocab(self, ids: torch.Tensor) -> None:
        """Replace the preview vocabulary (e.g. by corpus frequency). Only before training the horizon heads."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.preview_ids.device)
        if ids.shape != self.preview_ids.shape or len(set(ids.tolist())) != len(ids):
            raise ValueError(f"need {self.preview_ids.numel()} distinct token ids, got shape {tuple(ids.shape)}")
        self.preview_ids.copy_(ids)
        self.preview_index.copy_(self._index_of(ids.cpu(), self.base.spec.vocab_size).to(ids.device))

    # ------------------------------------------------------------------ helpers
    @property
    def num_layers(self) -> int:
        return self.base.spec.num_layers

    def fbs_parameters(self):
        """Parameters added by FBS (PAW, CH, SG)."""
        for mod in (self.paw, self.ch, self.gates):
            yield from mod.parameters()

    def inert(self) -> bool:
        """Whether the FBS modules leave the base model's computation exactly as it is: every PAW's and CH's output
        projection is zero (each adds exactly 0 to the token state) and every gate's output layer is zero (its logit
        is its bias whatever its inputs, PAW's preview among them). A fresh FBS is inert (zero-initialised outputs);
        training makes it not."""
        def zero(t):
            return t is None or not bool(t.detach().any())

        return (all(zero(m.up.weight) and zero(m.up.bias) for m in self.paw.values())
                and all(zero(m.out.weight) and zero(m.out.bias) for m in self.ch.values())
                and all(zero(o.weight) for o in self.gates.out.values()))

    def decode_view(self) -> "FBSForCausalLM":
        """The model a decode runs (:class:`fbs.engine.decoder.Decoder`): this one, or, where it has PAW or CH modules
        and they are :meth:`inert`, a view of the same base and gates without them, so that a decode does not compute
        what adds nothing (PAW's horizon heads, CH's chunk attention: a quarter of a SmolLM2 decode step). Tokens and
        logits are the same (the gates' logits are their biases either way); the trace then has no PAW / CH entries.
        Made once per state of the FBS weights (training them makes the model itself the view again)."""
        if not len(self.paw) and not len(self.ch):
            return self
        stamp = tuple((p.data_ptr(), p._version) for p in self.fbs_parameters())
        memo = self.__dict__.get("_decode_view")
        if memo is not None and memo[0] == stamp:
            return memo[1]
        view = self
        if self.inert():
            view = FBSForCausalLM(self.base.hf, self.config.replace(paw_layers=(), ch_layers=()), self.tokenizer)
            view.to(self.preview_ids.device)
            view.preview_ids.copy_(self.preview_ids)
            view.preview_index.copy_(self.preview_index)
            view.gates = self.gates  # shared: the same modules, not copies
            view.training = self.training
            if view.layers_cfg.gated != self.layers_cfg.gated:
                view = self
        self.__dict__["_decode_view"] = (stamp, view)  # not a submodule: outside state_dict and parameters()
        return view

    def param_counts(self) -> dict:
        seen, base = set(), 0
        for p in self.base.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                base += p.numel()
        added = sum(p.numel() for p in self.fbs_parameters())
        parts = {name: sum(p.numel() for p in mod.parameters()) for name, mod in
                 (("paw", self.paw), ("ch", self.ch), ("sg", self.gates))}
        return {"base": base, "added": added, "added_fraction": added / base, **{f"added_{k}": v for k, v in parts.items()}}

    def preview_vocab(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Preview-vocabulary embeddings E_V (N, d) and each PAW layer's head keys P(E_V) (N, R)."""
        emb = self.base.embedding_weight[self.preview_ids]
        return emb, {k: paw.vocab_proj(emb) for k, paw in self.paw.items()}

    def preview_targets(self, input_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Labels (B, T, k_max) for the preview heads: class of token x_{t+r}, ``ignore_index`` past the end."""
        b, t = input_ids.shape
        k = self.config.k_max
        cls = self.preview_index[input_ids]  # (B, T)
        out = torch.full((b, t, k), ignore_index, dtype=torch.long, device=input_ids.device)
        for r in range(1, k + 1):
            if r < t:
                out[:, : t - r, r - 1] = cls[:, r:]
        return out

    # ------------------------------------------------------------------ parallel forward
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                gate_mode: GateMode | None = None, tau: float | None = None, skip_plan: torch.Tensor | None = None,
                kv_policy: str | None = None, gate_from: int = 0, soft_window: bool | None = None,
                bios_labels: torch.Tensor | None = None, output_hidden_states: bool = False,
                generator: torch.Generator | None = None, soft_sample: str = "bernoulli",
                skip_training: SkipTraining | None = None, mixer=None) -> FBSOutput:
        """Run all positions at once.

        gate_mode: ``off`` (compute every layer), ``soft`` (straight-through Bernoulli gates with the soft
        mixture; default in training; ``soft_sample="threshold"`` makes the hard gate 1[p > tau] instead of a
        Bernoulli sample), ``threshold`` (skip where p > tau; default in eval), ``plan`` (skip
        where ``skip_plan`` (B, T, L) or (L,) is True). Gates apply to positions >= ``gate_from`` (the
        prompt is prefilled with every layer at decode time). Hard modes honour ``kv_policy``: ``hole``
        hides a skipped token's K/V (and chunk update) at that layer from later tokens; ``project`` keeps them.
        ``attention_mask`` (B, T): 1 for tokens, 0 for padding (left or right).
        ``skip_training`` adds forced skips, a gradient probe and gradient routing to ``soft`` mode.
        ``mixer`` (a baseline's router, :mod:`fbs.baselines`): ``mixer.route(l, x, xn, gated_pos)`` returns a
        :class:`fbs.model.layer.Route` for the layers it decides (None: the gates / ``gate_mode`` decide), and
        ``mixer.observe(l, x, out)`` sees every layer's :class:`fbs.model.layer.LayerOut`.
        """
        if input_ids.dim() != 2 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty (batch, seq) tensor, got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        spec, cfg = self.base.spec, self.config
        if t > spec.max_positions:
            raise ValueError(f"sequence of {t} tokens exceeds the model's context of {spec.max_positions}")
        mode = gate_mode or ("soft" if self.training else "threshold")
        if soft_sample not in ("bernoulli", "threshold"):
            raise ValueError(f"soft_sample must be 'bernoulli' or 'threshold', got {soft_sample!r}")
        tau = cfg.tau if tau is None else tau
        policy = kv_policy or cfg.kv_policy
        soft_window = self.training if soft_window is None else soft_window
        dev = input_ids.device

        x = self.base.embed(input_ids)
        if attention_mask is None:
            positions = torch.arange(t, device=dev).expand(b, t)
            keymask = None
        else:
            keymask = attention_mask.bool()
            positions = (keymask.long().cumsum(1) - 1).clamp_min(0)
        cos, sin = self.base.rope(x, positions)
        emb_v, keys_v = self.preview_vocab() if len(self.paw) else (None, {})
        ctx = SequenceContext(self.base, cos, sin, keymask, policy, soft_window, emb_v, keys_v, bios_labels)
        ops = HFOps(self.base)
        gated_pos = (torch.arange(t, device=dev) >= gate_from).expand(b, t)
        plan = self._expand_plan(skip_plan, b, t) if mode == "plan" else None
        st = skip_training or SkipTraining()
        if st != SkipTraining() and mode != "soft":
            raise ValueError("skip_training applies to gate_mode='soft' only")

        zlow = x.new_zeros(b, t, cfg.preview_rank)
        rel = x.new_ones(b, t)
        prev_skip = None  # hard skip of the previous layer (gate input with gate_prev_skip); None = zeros
        probs = x.new_zeros(b, t, spec.num_layers)
        skips = x.new_zeros(b, t, spec.num_layers)
        updates = x.new_zeros(b, t, spec.num_layers) if mode == "soft" else None
        prev_logits, win_k, win_w, bios, bounds, cstates, tstates = [], [], [], [], [], [], []
        hidden = [x] if output_hidden_states else None

        for l in range(spec.num_layers):
            xn = ops.norm1(l, x)
            skip, g = None, None  # skip: hard bool (B,T); g: float mixture weight
            routed = None if mixer is None else mixer.route(l, x, xn, gated_pos)
            if routed is not None:  # a baseline's router decides this layer
                skip = routed.mix.skip
                probs[..., l], skips[..., l] = routed.p, skip.to(x.dtype)
            elif l in self.layers_cfg.gated:
                gin = (xn.detach(), rel.detach(), zlow.detach()) if st.detach_gate_inputs else (xn, rel, zlow)
                p = self.gates.prob(l, *gin, prev_skip)
                probs[..., l] = p
                if mode == "soft":
                    force = st.force_skip[..., l] if st.force_skip is not None else None
                    g = straight_through(p, generator, tau if soft_sample == "threshold" else None, force,
                                         st.straight_through)
                    if st.probe is not None:
                        g = g + st.probe[..., l]
                    g = g * gated_pos
                    skips[..., l] = g
                elif mode != "off":
                    skip = ((p > tau) if mode == "threshold" else plan[..., l]) & gated_pos
                    skips[..., l] = skip.to(x.dtype)
            elif mode == "plan" and bool(plan[..., l].any()):
                raise ValueError(f"skip_plan skips layer {l}, which is a never-skip layer {self.layers_cfg.never_skip}")

            mix = routed.mix if routed is not None else Mix(cfg.skip_granularity, skip, g)
            out = layer_step(self, ops, l, x, ctx, mix, xn=xn, zlow=zlow)
            if mixer is not None:
                mixer.observe(l, x, out)
            if updates is not None and out.update is not None:
                updates[..., l] = out.update
            if out.paw is not None:
                prev_logits.append(out.paw.logits), win_k.append(out.paw.k_soft), win_w.append(out.paw.weights)
            if out.ch is not None:
                bios.append(out.ch.bios_logits), bounds.append(out.ch.boundary)
                cstates.append(out.ch.chunk_state), tstates.append(out.ch.token_state)
            hard = skip if g is None else g.detach() > 0.5
            rel, prev_skip = next_gate_inputs(out.x, x, hard)
            x, zlow = out.x, out.zlow
            if hidden is not None:
                hidden.append(x)

        stack = lambda xs: torch.stack(xs) if xs else None  # noqa: E731
        return FBSOutput(
            logits=self.base.head(x), gate_probs=probs, skips=skips,
            preview_logits=stack(prev_logits), window_k=stack(win_k), window_weights=stack(win_w),
            bios_logits=stack(bios), chunk_boundary=stack(bounds), chunk_states=stack(cstates),
            token_chunk_states=stack(tstates), hidden_states=tuple(hidden) if hidden is not None else None,
            layer_updates=updates,
        )

    def _expand_plan(self, plan: torch.Tensor | None, b: int, t: int) -> torch.Tensor:
        if plan is None:
            raise ValueError("gate_mode='plan' needs skip_plan, a bool tensor of shape (L,), (T, L) or (B, T, L)")
        plan = torch.as_tensor(plan, dtype=torch.bool, device=self.preview_ids.device)
        if plan.shape[-1] != self.num_layers:
            raise ValueError(f"skip_plan's last dimension must be the {self.num_layers} layers, got {tuple(plan.shape)}")
        return plan.expand(b, t, self.num_layers)

    # ------------------------------------------------------------------ decoding
    def generate(self, input_ids, **kwargs):
        """KV-cached decoding with true layer skipping; see :func:`fbs.engine.generate`. ``weights="auto"``: the
        default format of :func:`fbs.engine.defaults.default_weights`, with its KV cache storage unless ``kv_dtype``
        says otherwise (without ``weights``: fused fp32)."""
        from ..engine import generate

        return generate(self, input_ids, **_resolve_auto(kwargs))

    def stream(self, input_ids, **kwargs):
        """Yield one :class:`fbs.engine.StepOutput` per generated token; see :func:`fbs.engine.stream`
        (``weights="auto"`` as in :meth:`generate`)."""
        from ..engine import stream

        return stream(self, input_ids, **_resolve_auto(kwargs))

    # ------------------------------------------------------------------ checkpoints
    def fbs_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"paw.{k}": v for k, v in self.paw.state_dict().items()}
        sd.update({f"ch.{k}": v for k, v in self.ch.state_dict().items()})
        sd.update({f"gates.{k}": v for k, v in self.gates.state_dict().items()})
        sd["preview_ids"] = self.preview_ids
        return {k: v.detach().contiguous().cpu() for k, v in sd.items()}

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Write the FBS-only weights (safetensors), config (JSON) and integrity record (:data:`MANIFEST_NAME`:
        size and sha256 of each weights file in ``path``) atomically into ``path``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-") as tmp:
            save_file(self.fbs_state_dict(), os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
            Path(tmp, CONFIG_NAME).write_text(self.config.to_json())
            for name in (WEIGHTS_NAME, CONFIG_NAME):
                os.replace(os.path.join(tmp, name), path / name)
        write_manifest(path)  # last: until it is replaced, an old record refuses the new weights loudly
        return path

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, base=None, tokenizer=None, *, check_base: bool = True,
                        check_integrity: bool = True, **overrides) -> "FBSForCausalLM":
        """Load an FBS checkpoint onto its base model (``base`` defaults to the name recorded in it).

        ``base`` may be a name, a directory or an HF model instance; an instance is copied when the checkpoint
        changes backbone weights, so the caller's model is never modified. ``overrides`` replace inference-time
        config fields (tau, kv_policy, never_skip_*). The checkpoint's weights files are verified against its
        integrity record and its base fingerprint against the base; ``check_integrity=False`` /
        ``check_base=False`` turn these checks off. See :func:`fbs.model.checkpoint.load_checkpoint`."""
        return load_checkpoint(cls, path, base=base, tokenizer=tokenizer, check_base=check_base,
                               check_integrity=check_integrity, **overrides)

    def configure(self, **changes) -> None:
        """Change inference-time settings (tau, kv_policy, never_skip_*) in place, re-validated."""
        self.config = self.config.replace(**changes)
        resolved = self.config.resolve(self.num_layers)
        if set(resolved.gated) - set(self.layers_cfg.gated):
            raise ValueError("never-skip layers can only be widened after construction (gates exist only for "
                             f"layers {self.layers_cfg.gated})")
        self.layers_cfg = resolved


def _resolve_auto(kwargs: dict) -> dict:
    """``weights="auto"`` -> the default format (:func:`fbs.engine.defaults.resolve_weights`), and then, unless the
    call names them, that format's default KV cache storage (``kv_dtype="auto"``) and prefill (``prefill="auto"``)."""
    from ..engine.defaults import AUTO, resolve_weights

    if kwargs.get("weights") == AUTO:
        kwargs = {"kv_dtype": AUTO, "prefill": AUTO, **kwargs, "weights": resolve_weights(AUTO)}
    return kwargs
