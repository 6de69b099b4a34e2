"""The one module that knows transformers' internals.

It wraps a pretrained Hugging Face decoder (Llama / Qwen2 / Qwen3 / Mistral family: pre-norm, RoPE, GQA,
SwiGLU) and exposes the pieces of one decoder layer as plain functions over tensors, so the FBS model and
the decoding engine can run, skip or partially run a layer without going through HF's forward, masks or
cache classes. The HF submodules themselves are called (``q_proj``, ``mlp`` ...), so weights are shared
with the HF model and forward hooks on them see every call.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedArchitectureError(ValueError):
    """The base model is not a decoder family FBS supports."""


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """Shape facts about the base decoder, used by the FBS modules and by FLOP accounting."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    tie_word_embeddings: bool
    qk_norm: bool
    attn_bias: bool


def decoder_spec(hf_config) -> DecoderSpec:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"base model type {model_type!r} is not supported; FBS supports decoder-only models of type "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (pre-norm, RoPE, GQA, SwiGLU)"
        )
    layer_types = getattr(hf_config, "layer_types", None) or []
    window = getattr(hf_config, "sliding_window", None)
    # what HF's modules run: Qwen2/Qwen3 attend per layer_types (built from use_sliding_window); HF's Mistral
    # attends within sliding_window whenever it is set (use_sliding_window does not switch it off)
    mistral_window = model_type == "mistral" and window is not None and window < hf_config.max_position_embeddings
    if mistral_window or any(t != "full_attention" for t in layer_types):
        fix = ("a Mistral config without sliding_window (null, or at least max_position_embeddings)"
               if model_type == "mistral" else "use_sliding_window=False and only full_attention layer_types")
        raise UnsupportedArchitectureError(
            f"{model_type} checkpoint uses sliding-window attention (window {window}); FBS supports full "
            f"causal attention only — load a checkpoint with {fix}"
        )
    heads = hf_config.num_attention_heads
    return DecoderSpec(
        model_type=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        intermediate_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_positions=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        attn_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, hd); cos/sin: (B, T, hd)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)
    return x * cos + _rotate_half(x) * sin


class BaseDecoder(nn.Module):
    """A pretrained HF causal LM seen as embed -> layers -> norm -> head, with per-layer pieces."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.spec = decoder_spec(hf_model.config)
        self.hf = hf_model
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.scaling = self.spec.head_dim ** -0.5
        self._rope_table: tuple | None = None  # (cos, sin) (n, hd) of positions 0..n-1, or None (see rope)

    # ---- whole-model pieces -------------------------------------------------
    @property
    def embedding_weight(self) -> torch.Tensor:
        """(V, d) input embedding matrix (tied with the LM head in SmolLM2 / Qwen2.5-0.5B)."""
        return self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (B, T, hd) for integer positions (B, T).

        With HF's default rotary type (cos / sin of position x frequency, nothing that depends on the sequence length)
        they are rows of one table of positions 0..n-1, made by the rotary module itself (grown by doubling): each
        entry is one product and its cos / sin, so a row has the bits of the module's own call for that position
        (tests/test_model_equivalence.py checks it), and a decode step reads two rows instead of dispatching the
        module's dozen ops."""
        if getattr(self.rotary, "rope_type", None) != "default" or positions.numel() == 0:
            return self.rotary(x, positions)
        table = self._rope_table
        n = int(positions.max()) + 1
        if table is None or table[0].shape[0] < n or table[0].dtype != x.dtype or table[0].device != x.device:
            size = max(n, 1024, 2 * (0 if table is None else table[0].shape[0]))
            with torch.no_grad():
                cos, sin = self.rotary(x, torch.arange(size, device=x.device).view(1, size))
            table = self._rope_table = (cos[0], sin[0])
        return table[0][positions], table[1][positions]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    # ---- one layer's pieces -------------------------------------------------
    def norm1(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].input_layernorm(x)

    def norm2(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].post_attention_layernorm(x)

    def _heads(self, proj: nn.Module, norm: nn.Module | None, xn: torch.Tensor) -> torch.Tensor:
        b, t, _ = xn.shape
        y = proj(xn).view(b, t, -1, self.spec.head_dim)  # (B, T, heads, hd)
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)  # (B, heads, T, hd)

    def query(self, layer: int, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.layers[layer].self_attn
        q = self._heads(attn.q_proj, getattr(attn, "q_norm", None), xn)
        return apply_rope(q, cos, sin)  # (B, H, T, hd)

    def key_value(self, layer: int, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """RoPE-rotated keys and values (B, Hkv, T, hd) of normalized layer inputs ``xn``."""
        attn = self.layers[layer].self_attn
        k = apply_rope(self._heads(attn.k_proj, getattr(attn, "k_norm", None), xn), cos, sin)
        v = self._heads(attn.v_proj, None, xn)
        return k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        """Scaled dot-product attention with GQA; mask is bool (B, 1, Tq, Tk), True = attend."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=self.scaling,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def attn_out(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """(B, H, T, hd) attention output -> (B, T, d)."""
        b, _, t, _ = o.shape
        return self.layers[layer].self_attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].mlp(x)


class DecodeCallCounter:
    """Forward pre-hooks on an HF causal LM's decoder layers and LM head counting the decode work that ran
    (the benchmark prices the counts with :meth:`fbs.engine.flops.LayerCost.counted_macs`).

    Counts every call, including draft passes that reuse the model's own layers (early-exit self-speculation),
    and derives speculative statistics from the passes through the last layer (target passes only):
    ``m_t`` candidate tokens verified in pass t = decode-position tokens in the pass, minus the already
    committed token it starts from. Use as a context manager around one untimed ``generate`` call.

    ``prompt_len=None`` learns it from the first pass (its positions 0 .. T-1 are the prompt): for a separate
    draft model whose prompt is the target's re-encoded under another tokenizer (universal assisted generation).
    """

    def __init__(self, model: nn.Module, prompt_len: int | None):
        self.model = model
        self.prompt_len = prompt_len
        self.layers = list(model.model.layers)
        L = len(self.layers)
        self.dec_tokens = [0] * L  # per layer: decode-position tokens processed
        self.dec_keys = [0] * L    # per layer: keys those tokens attended (position + 1 each)
        self.lm_rows = 0           # decode-position rows through the LM head
        self.candidates: list[int] = []  # m_t of every target pass (prompt pass included)
        self._last_pos: torch.Tensor | None = None
        self._batch = 1
        self._handles: list = []

    def __enter__(self) -> "DecodeCallCounter":
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
            B = hidden.shape[0]
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

    @property
    def invocations(self) -> int:
        return sum(self.dec_tokens)
