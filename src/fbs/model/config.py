"""FBSConfig: every knob of the FBS modules, validated once, each default defined here and only here."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Literal

Compression = Literal["conv", "mean", "linear", "none"]
GateInput = Literal["residual", "preview", "both"]
KVPolicy = Literal["hole", "project"]
SkipGranularity = Literal["layer", "ffn"]


class ConfigError(ValueError):
    """An FBSConfig field has an invalid value."""


@dataclass
class FBSConfig:
    """Configuration of the PAW, CH and SG modules added to a pretrained decoder.

    Layer indices are 0-based. Negative indices count from the last layer (-1 = last), resolved
    against the base model in :meth:`resolve`.
    """

    # ---- PAW: parafovea-attention window (paper §2.2, appendix C.1-C.2) ----
    k_max: int = 15
    """Largest lookahead span; k(t) = floor(k_max * sigmoid(s_t)) lies in {0..k_max}."""
    paw_layers: tuple[int, ...] = (1,)
    """Layers that carry PAW. The preview z_t of the most recent PAW layer also feeds every later gate.
    One early, never-skipped layer keeps PAW within the overhead budget (DESIGN.md §3); the paper's
    literal reading is every layer."""
    preview_vocab_size: int = 1024
    """Size of the restricted preview vocabulary (top-N frequent tokens, plus one 'other' class)."""
    preview_top_k: int = 32
    """Top-K support of each horizon distribution used for the expectation embedding E^T p."""
    preview_rank: int = 64
    """Width of the low-rank space shared by the horizon heads."""
    paw_compression: Compression = "conv"
    """Preview compression (appendix C.5): grouped conv (kernel 3) + pool, mean pool, linear pool, none."""
    paw_conv_groups: int = 0
    """Groups of the 1-D conv over horizons; 0 means depthwise (groups = hidden size)."""
    fixed_k: int | None = None
    """Fixed-k ablation (appendix C.3): disable the window predictor and use k(t) = fixed_k."""
    window_gamma: float = 4.0
    """Sharpness gamma of the soft window weights w_r = sigmoid(gamma (k~ - r + 0.5)) used in training."""
    window_init_bias: float = 0.0
    """Initial predictor logit s; sigmoid(0) * 15 = 7.5, close to the paper's matched average k of 8."""

    # ---- CH: chunk head (paper §2.3, appendix D) ----
    ch_layers: tuple[int, ...] = (-6,)
    """Layers that carry CH (default: the first of the last six layers, never skipped by default)."""
    chunk_rank: int = 64
    """Width of chunk states and of the token-to-chunk attention."""
    chunk_cache_size: int = 64
    """Most recent closed chunks a token attends to (older chunks are evicted)."""

    # ---- SG: skip gate (paper §2.4, appendix E) ----
    gate_width: int = 32
    """Hidden width of each layer's gate MLP."""
    gate_rank: int = 32
    """Width of the shared projections of the residual state and of the preview fed to the gates."""
    gate_input: GateInput = "both"
    """What the gate sees (appendix E.5): residual signal, preview, or both."""
    gate_prev_skip: bool = False
    """Give each gate the explicit input "the previous layer was skipped for this token" (1.0 / 0.0). Without
    it, a gate after a skipped layer sees only a zero relative update, an input full-depth passes never show."""
    gate_init_bias: float = -4.0
    """Initial gate logit: sigmoid(-4) = 0.018, so fresh gates compute at any tau >= 0.02."""
    tau: float = 0.5
    """Skip threshold at inference: layer l is skipped for token t when p > tau."""
    kv_policy: KVPolicy = "project"
    """What a skipped layer writes to its KV cache for the skipped token (DESIGN.md §2)."""
    skip_granularity: SkipGranularity = "layer"
    """What a gate's "skip" removes: the whole layer, or only its FFN ("ffn": attention, PAW, CH and K/V run
    exactly; the gate still decides before the layer, from the same inputs). DESIGN.md §7b compares the two."""
    never_skip_first: int = 2
    """The first layers are never skipped (appendix E.9 default: 2)."""
    never_skip_last: int = 6
    """The last layers are never skipped (appendix E.9 default: 6)."""
    never_skip_layers: tuple[int, ...] = ()
    """Additional layers that are never skipped."""

    # ---- bookkeeping ----
    base_model: str | None = None
    """Name or path of the base model (filled in by from_base)."""
    base_fingerprint: str | None = None
    """Content hash of the base weights; a checkpoint refuses to load onto other weights."""
    extra: dict = field(default_factory=dict)
    """Free-form metadata (training recipe, operating point); not interpreted by the model."""

    def __post_init__(self) -> None:
        for name in ("paw_layers", "ch_layers", "never_skip_layers"):
            setattr(self, name, tuple(int(x) for x in getattr(self, name)))
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)
        check(1 <= self.k_max <= 64, f"k_max must be in [1, 64], got {self.k_max}")
        check(self.preview_vocab_size >= 2, f"preview_vocab_size must be >= 2, got {self.preview_vocab_size}")
        check(1 <= self.preview_top_k <= self.preview_vocab_size + 1,
              f"preview_top_k must be in [1, preview_vocab_size + 1], got {self.preview_top_k}")
        for name in ("preview_rank", "chunk_rank", "gate_width", "gate_rank", "chunk_cache_size"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        check(self.paw_compression in ("conv", "mean", "linear", "none"),
              f"paw_compression must be conv|mean|linear|none, got {self.paw_compression!r}")
        check(self.paw_conv_groups >= 0, f"paw_conv_groups must be >= 0, got {self.paw_conv_groups}")
        check(self.fixed_k is None or 0 <= self.fixed_k <= self.k_max,
              f"fixed_k must be None or in [0, k_max={self.k_max}], got {self.fixed_k}")
        check(self.window_gamma > 0, f"window_gamma must be > 0, got {self.window_gamma}")
        check(self.gate_input in ("residual", "preview", "both"),
              f"gate_input must be residual|preview|both, got {self.gate_input!r}")
        check(0.0 <= self.tau <= 1.0, f"tau must be in [0, 1], got {self.tau}")
        check(self.kv_policy in ("hole", "project"), f"kv_policy must be 'hole' or 'project', got {self.kv_policy!r}")
        check(self.skip_granularity in ("layer", "ffn"),
              f"skip_granularity must be 'layer' or 'ffn', got {self.skip_granularity!r}")
        check(self.never_skip_first >= 0 and self.never_skip_last >= 0, "never_skip_first/last must be >= 0")
        check(len(set(self.paw_layers)) == len(self.paw_layers), f"paw_layers has duplicates: {self.paw_layers}")
        check(len(set(self.ch_layers)) == len(self.ch_layers), f"ch_layers has duplicates: {self.ch_layers}")

    # ------------------------------------------------------------------
    def resolve(self, num_layers: int) -> "ResolvedLayers":
        """Turn possibly negative layer indices into sorted absolute ones for a base with ``num_layers``."""
        def absolute(idx: tuple[int, ...], what: str) -> tuple[int, ...]:
            out = []
            for i in idx:
                j = i + num_layers if i < 0 else i
                if not 0 <= j < num_layers:
                    raise ConfigError(f"{what} index {i} is out of range for a base model with {num_layers} layers")
                out.append(j)
            return tuple(sorted(set(out)))

        never = set(range(min(self.never_skip_first, num_layers)))
        never |= set(range(max(0, num_layers - self.never_skip_last), num_layers))
        never |= set(absolute(self.never_skip_layers, "never_skip_layers"))
        return ResolvedLayers(
            paw=absolute(self.paw_layers, "paw_layers"),
            ch=absolute(self.ch_layers, "ch_layers"),
            never_skip=tuple(sorted(never)),
            gated=tuple(i for i in range(num_layers) if i not in never),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "FBSConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown FBSConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    def replace(self, **changes) -> "FBSConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ResolvedLayers:
    """Absolute layer indices derived from an FBSConfig for one base model."""

    paw: tuple[int, ...]
    ch: tuple[int, ...]
    never_skip: tuple[int, ...]
    gated: tuple[int, ...]
