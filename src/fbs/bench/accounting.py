"""Compute accounting for decoding: what ran, in multiply-accumulates (MACs), relative to plain decoding.

Two relative measures are reported for every system (DESIGN.md §5, paper appendix B.3):

* ``tflops_rel`` — the paper's Eq. (tflops-rel): executed decoder-layer invocations over decode steps,
  divided by the invocations of plain decoding. Every layer counts the same (``FLOPs_l`` is constant for a
  homogeneous decoder), so this is a ratio of counts.
* ``tflops_rel_exact`` — executed MACs over plain decoding's MACs for the same decode steps, counting the
  attention term that grows with the context (``2·h_q·d_head`` MACs per attended key), the K/V projections
  that the ``project`` policy runs for skipped layers, the LM head, draft-model and verification compute of
  speculative methods, and the PAW/CH/SG overhead reported by the FBS engine.

"Decode" means every token at position ``>= prompt_len``; the prompt's own forward (prefill) is excluded
from both, as in the paper's Eq., where T counts decode steps.

Public entry points:
    LayerCost.from_config(hf_config)       per-token MACs of one decoder layer and of the LM head
    InvocationCounter(model, prompt_len)   forward hooks counting what an HF model actually ran
    baseline_decode_macs(cost, ...)        MACs of plain greedy decoding (the denominator)
    skip_trace_macs(cost, executed, ...)   MACs of a layer-skipping run given its executed mask
"""

from __future__ import annotations

import dataclasses
import logging

import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Per-token MACs of one decoder layer (Llama/Qwen family: GQA attention + SwiGLU FFN) and the LM head."""

    attn_proj: int  # q, k, v, o projections
    kv_proj: int  # k and v projections only: what `project` runs for a skipped layer
    ffn: int  # gate, up, down
    per_key: int  # QK^T and AV per attended key, summed over query heads
    lm_head: int  # hidden -> vocabulary
    num_layers: int
    weight_bytes_per_layer: int  # bytes of one layer's weights (norms included)
    kv_bytes_per_key: int  # bytes of one cached token's K and V in one layer
    lm_head_bytes: int
    dtype_bytes: int = 4

    @classmethod
    def from_config(cls, cfg, dtype_bytes: int = 4) -> "LayerCost":
        d = cfg.hidden_size
        hq = cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or hq
        hd = getattr(cfg, "head_dim", None) or d // hq
        ffn = cfg.intermediate_size
        q_o = 2 * d * hq * hd
        kv = 2 * d * hkv * hd
        ffn_macs = 3 * d * ffn
        weights = q_o + kv + ffn_macs + 2 * d  # matrices + two RMSNorm vectors
        return cls(
            attn_proj=q_o + kv,
            kv_proj=kv,
            ffn=ffn_macs,
            per_key=2 * hq * hd,
            lm_head=d * cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            weight_bytes_per_layer=weights * dtype_bytes,
            kv_bytes_per_key=2 * hkv * hd * dtype_bytes,
            lm_head_bytes=d * cfg.vocab_size * dtype_bytes,
            dtype_bytes=dtype_bytes,
        )

    @property
    def dense(self) -> int:
        """Context-independent MACs of one layer for one token."""
        return self.attn_proj + self.ffn

    def layer_macs(self, ctx_len: int) -> int:
        """MACs of one layer for one token attending ``ctx_len`` keys (itself included)."""
        return self.dense + self.per_key * ctx_len


def baseline_decode_macs(cost: LayerCost, prompt_len: int, new_tokens: int, batch: int = 1) -> tuple[int, int]:
    """(layer invocations, MACs) of plain greedy decoding after the prompt's forward.

    Tokens at positions prompt_len .. prompt_len+new_tokens-2 are fed back (the last generated token is never
    fed), each attends position+1 keys in every layer and produces one LM-head row.
    """
    steps = max(new_tokens - 1, 0)
    keys = sum(prompt_len + i + 1 for i in range(steps))
    invocations = steps * cost.num_layers * batch
    macs = batch * (steps * (cost.num_layers * cost.dense + cost.lm_head) + cost.num_layers * cost.per_key * keys)
    return invocations, macs


def skip_trace_macs(
    cost: LayerCost,
    executed: torch.Tensor,
    prompt_len: int,
    kv_policy: str = "project",
    overhead_macs_per_token: float = 0.0,
    entry_positions: torch.Tensor | None = None,
) -> tuple[int, int]:
    """(executed layer invocations, MACs) of a layer-skipping decode from its (B, S, L) executed mask.

    ``executed[b, s, l]`` says whether layer l ran for the s-th decode-step token of row b, whose position is
    ``prompt_len + s`` unless ``entry_positions`` (S,) says otherwise. Under ``hole`` a skipped layer writes no
    K/V, so later tokens of that layer attend fewer keys; under ``project`` it still computes and stores K/V.
    """
    B, S, L = executed.shape
    ex = executed.bool()
    pos = entry_positions if entry_positions is not None else torch.arange(S) + prompt_len
    macs = 0
    for b in range(B):
        for l in range(L):
            col = ex[b, :, l]
            if kv_policy == "hole":
                # keys held by layer l when step s runs: the prompt + earlier executed steps + itself
                stored = torch.cumsum(col.long(), 0)
                keys = int((prompt_len + stored)[col].sum())
            else:
                keys = int((pos[col] + 1).sum())
            n_exec = int(col.sum())
            macs += n_exec * cost.dense + keys * cost.per_key
            if kv_policy == "project":
                macs += int((~col).sum()) * cost.kv_proj
    macs += B * S * (cost.lm_head + overhead_macs_per_token)
    return int(ex.sum()), int(macs)


class InvocationCounter:
    """Forward hooks on an HF causal LM's decoder layers and LM head that count the decode work that ran.

    Counts every call, including draft passes that reuse the model's own layers (early-exit self-speculation),
    and derives speculative statistics from the passes through the last layer (target passes only):
    ``m_t`` candidate tokens verified in pass t = decode-position tokens in the pass, minus the already
    committed token it starts from. Use as a context manager around one untimed generate call.

    ``prompt_len=None`` learns it from the first pass (its positions 0 .. T-1 are the prompt): for a separate
    draft model whose prompt is the target's re-encoded under another tokenizer (universal assisted generation).
    """

    def __init__(self, model, prompt_len: int | None):
        self.model = model
        self.prompt_len = prompt_len
        self.layers = list(model.model.layers)
        L = len(self.layers)
        self.dec_tokens = [0] * L
        self.dec_keys = [0] * L
        self.lm_rows = 0
        self.candidates: list[int] = []  # m_t of every target pass (prompt pass included)
        self._last_pos: torch.Tensor | None = None
        self._batch = 1
        self._handles: list = []

    def __enter__(self) -> "InvocationCounter":
        for idx, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(idx), with_kwargs=True))
        self._handles.append(self.model.lm_head.register_forward_pre_hook(self._lm_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _layer_hook(self, idx: int):
        last = len(self.layers) - 1

        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            B, q = hidden.shape[:2]
            pos = kwargs.get("position_ids")
            if pos is None:  # transformers always passes them for Llama-family models; be explicit if not
                raise RuntimeError("decoder layer called without position_ids; cannot attribute decode work")
            pos = pos[0] if pos.dim() == 2 else pos  # rows share positions: prompts have equal length
            if self.prompt_len is None:  # the first pass is the prompt's
                self.prompt_len = int(pos.max()) + 1
            dec = pos >= self.prompt_len
            n_dec = int(dec.sum())
            self.dec_tokens[idx] += B * n_dec
            self.dec_keys[idx] += B * int((pos[dec] + 1).sum())
            if idx == 0:
                self._last_pos, self._batch = pos, B
            if idx == last:  # one target pass; it starts from a committed token unless it is the prompt pass
                starts_committed = bool(pos.min() >= self.prompt_len)
                self.candidates.append(n_dec - int(starts_committed))
            return None

        return hook

    def _lm_hook(self, module, args):
        rows = args[0].shape[1]
        if self._last_pos is not None:
            self.lm_rows += self._batch * int((self._last_pos[-rows:] >= self.prompt_len).sum())
        return None

    def decode_macs(self, cost: LayerCost) -> int:
        layer = sum(t * cost.dense + k * cost.per_key for t, k in zip(self.dec_tokens, self.dec_keys))
        return layer + self.lm_rows * cost.lm_head

    @property
    def invocations(self) -> int:
        return sum(self.dec_tokens)


def speculative_ratios(candidates: list[int], new_tokens: int) -> dict[str, float | int | None]:
    """Paper appendix B.4 ratios from the candidate counts m_t of every target pass, given N new tokens.

    Each target pass (the prompt pass included) commits its accepted candidates plus one token of its own, so
    with K passes the accepted total is sum a_t = N - K. Plain decoding has m_t = 0 everywhere and no ratio.
    """
    return speculative_ratios_from_counts(len(candidates), sum(candidates), new_tokens)


def speculative_ratios_from_counts(passes: float, proposed: float, new_tokens: int) -> dict[str, float | None]:
    """The same ratios from (mean) pass and proposal counts; pooled over prompts when given means."""
    accepted = max(new_tokens - passes, 0)
    return {
        "passes": passes,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,  # Eq. (accept)
        # Eq. (verify-advance) with v_t = a_t + 1 committed and m_t + 1 attempted per pass
        "verified_advance_ratio": new_tokens / (proposed + passes) if proposed else None,
        "tokens_per_pass": new_tokens / passes if passes else None,
    }
