"""FFN-SkipLLM (Jaiswal et al., EMNLP 2024): training-free, per-token skipping of FFN blocks on cosine saturation.

The paper observes that in the middle layers the residual state entering an FFN block and the state leaving it
(h and h + FFN(h)) become nearly identical as a token moves up the stack, and skips FFN blocks once that
similarity saturates. Attention always runs, so every layer still writes the token's K/V from its true state
and the KV cache needs no repair. Our reading of the rule, per generated token:

* layers in the *cold* regions (the first ``cold_first`` and last ``cold_last``) always run their FFN;
* the first ``warmup`` generated tokens run every FFN (the paper's warm-up: the first tokens decode at full
  depth);
* in the hot region, after a computed FFN block whose cosine(h, h + FFN(h)) exceeds ``threshold``, the next
  ``span`` hot FFN blocks are skipped (``span=0``: every remaining hot block, the paper's greedy skipping);
  then the next computed block is tested again. A skipped block is never tested (its input equals its output).

It runs on the FBS engine at ``skip_granularity="ffn"`` (:func:`ffn_skip_model`): a skipped block calls none of
the FFN's weights for that token. :class:`FFNSkipLLM` is the engine's ``skip_policy``; :meth:`FFNSkipLLM.mixer`
is the same rule for the parallel forward (teacher-forced evaluation; it equals cached decoding, tested).
The share of FFN blocks skipped is the trace's ``skip_ratio`` (over every layer of every generated token).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..model.layer import COMPUTE, LayerOut, Mix, Route
from .host import host_model


@dataclasses.dataclass(frozen=True)
class FFNSkipLLM:
    """The rule's knobs; an instance is the engine's ``skip_policy`` (``model.generate(ids, skip_policy=...)``)."""

    threshold: float = 0.986
    """Cosine similarity between an FFN block's input and output above which the next blocks are skipped.
    Model-specific: SmolLM2-135M's FFN cosines sit just below 1 in every layer but the first and last, so small
    changes of the threshold move the skipped share a lot; the default puts SmolLM2-135M in the paper's skip regime
    (the shares per threshold are in docs/eval.md)."""
    span: int = 0
    """Hot FFN blocks skipped after a saturated one; 0 = all remaining hot blocks of the token (greedy)."""
    warmup: int = 4
    """Generated tokens decoded with every FFN block before skipping starts."""
    cold_first: int = 2
    """First layers whose FFN always runs (the same never-skip set as FBS's defaults)."""
    cold_last: int = 6
    """Last layers whose FFN always runs."""

    def __post_init__(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in [-1, 1], got {self.threshold}")
        if min(self.span, self.warmup, self.cold_first, self.cold_last) < 0:
            raise ValueError("span, warmup, cold_first and cold_last must be >= 0")

    def hot(self, num_layers: int) -> list[bool]:
        """Per layer: may its FFN be skipped."""
        return [self.cold_first <= l < num_layers - self.cold_last for l in range(num_layers)]

    def to_dict(self) -> dict:
        return {"method": "ffn-skipllm", **dataclasses.asdict(self)}

    # ---- the engine's policy --------------------------------------------------------------------------
    def start(self, decoder) -> "_DecodeRun":
        if decoder.granularity != "ffn":
            raise ValueError("FFN-SkipLLM skips FFN blocks only: build the model with ffn_skip_model() "
                             "(skip_granularity='ffn')")
        return _DecodeRun(self, decoder.L, decoder.B, decoder.dev)

    # ---- the parallel forward -------------------------------------------------------------------------
    def mixer(self, num_layers: int) -> "_ParallelRun":
        """The rule over all positions at once, for ``FBSForCausalLM.forward(..., mixer=..., gate_from=g)``:
        positions >= g may skip (pass the first decoded position + ``warmup`` to match decoding)."""
        return _ParallelRun(self, num_layers)


def ffn_skip_model(base, tokenizer=None):
    """The engine's model over ``base`` for FFN-SkipLLM: FFN granularity, no FBS modules (:func:`host_model`)."""
    return host_model(base, tokenizer, skip_granularity="ffn")


def saturation(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """cos(h, out) over the hidden dimension: (..., d) -> (...)."""
    return F.cosine_similarity(h.float(), out.float(), dim=-1)


class _DecodeRun:
    """Per-generate state: how many hot FFN blocks each row still skips for the token being decoded."""

    def __init__(self, rule: FFNSkipLLM, num_layers: int, batch: int, device):
        self.rule, self.dev = rule, device
        self.hot = rule.hot(num_layers)
        self.left = [0] * batch  # > 0: blocks still to skip; -1: every remaining hot block; 0: compute
        self.rows: list[int] = []
        self.warm: list[bool] = []  # per step row: still in the warm-up (never skips, never arms)

    def prefill_mix(self, l: int, x: torch.Tensor, positions: torch.Tensor) -> Mix:
        return COMPUTE  # the prompt's forward runs every FFN

    def decide(self, l: int, step, rows: list[int], x, pre) -> tuple[list[bool], None]:
        if l == 0:  # a new token per row (``step``: its index among the generated tokens, one or one per row)
            steps = [step] * len(rows) if isinstance(step, int) else list(step)
            self.rows, self.warm = rows, [s < self.rule.warmup for s in steps]
            for r in rows:
                self.left[r] = 0
        if not self.hot[l]:
            return [False] * len(rows), None
        skip = []
        for r in rows:
            n = self.left[r]
            skip.append(n != 0)
            if n > 0:
                self.left[r] = n - 1
        return skip, None

    def mix(self, l: int, sel: list[int]) -> Mix:
        if len(sel) == len(self.rows) and not self._observed(l):
            return Mix("ffn")  # every row runs and no cosine is needed: the engine's whole-block path
        # explicit rows even when all run, so the step returns h (the FFN's input) for the cosine
        return Mix("ffn", ffn_rows=torch.tensor(sel, device=self.dev, dtype=torch.long))

    def _observed(self, l: int) -> bool:
        return self.hot[l] and not all(self.warm)

    def bypass(self, l: int, skipped: list[int], x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return new

    def observe(self, l: int, run: list[bool], out: LayerOut) -> None:
        if not self._observed(l) or not any(run):
            return
        cos = saturation(out.h[:, -1], out.x[:, -1]).tolist()  # the layer's one host read
        for i, r in enumerate(self.rows):
            if run[i] and not self.warm[i] and cos[i] > self.rule.threshold:
                self.left[r] = self.rule.span or -1


class _ParallelRun:
    """The same rule as :class:`_DecodeRun` for (B, T) positions at once (``FBSForCausalLM.forward(mixer=)``)."""

    def __init__(self, rule: FFNSkipLLM, num_layers: int):
        self.rule, self.hot = rule, rule.hot(num_layers)
        self.left: torch.Tensor | None = None
        self.skip: torch.Tensor | None = None
        self.allowed: torch.Tensor | None = None

    def route(self, l: int, x: torch.Tensor, xn: torch.Tensor, allowed: torch.Tensor) -> Route | None:
        if l == 0:
            self.left = torch.zeros(allowed.shape, dtype=torch.long, device=x.device)
            self.allowed = allowed
        self.skip = None
        if not self.hot[l]:
            return None
        skip = allowed & (self.left != 0)
        self.left = torch.where(skip & (self.left > 0), self.left - 1, self.left)
        self.skip = skip
        return Route(Mix("ffn", skip=skip), skip.to(x.dtype))

    def observe(self, l: int, x: torch.Tensor, out: LayerOut) -> None:
        if self.skip is None:
            return
        saturated = self.allowed & ~self.skip & (saturation(out.h, out.x) > self.rule.threshold)
        self.left = torch.where(saturated, torch.full_like(self.left, self.rule.span or -1), self.left)
