"""A FlexiDepth-style router (Luo, Wang and Yan, "Adaptive Layer-skipping in Pre-trained LLMs", COLM 2025).

Each routed layer l gets a light router and a light adapter; the pretrained weights stay frozen. For a token
with layer input x and xn = RMSNorm_1(x) (the layer's own input norm):

    g   = sigmoid(Router(xn)),  Router(z) = W_r W_up RMSNorm(tanh(W_down z)) + b   (d_r = d / 16)
    g > tau (0.5):  full path   h = x + Attn(xn),  out = h + g MLP(RMSNorm_2(h))
    g <= tau:       skip path   out = x + (1 - g) Adapter(RMSNorm_2(x)),  Adapter a SwiGLU of width d_ff / 16

A skipped token runs no query, no attention and no FFN, but its K and V are still computed from xn and cached,
so later tokens see it (the paper's KV-preserving attention skipping: the ``project`` KV policy). The gate
scales the path taken, which is how the language-model loss reaches the router. Training adds the paper's
layer-skipping loss L_skip = mean_t (sum_l g_t^l)^2 (squared, so tokens that use many layers pay more):
L = L_lm + alpha L_skip (alpha = 1e-3 in the paper). By default the latter half of the layers is routed, as
the paper does for Llama-3-8B (the first half always runs).

Departures from the paper, all configurable: the router's last linear has a bias initialized to +3
(g = 0.95: a fresh router computes nearly everything, as fresh FBS gates do; the paper initializes randomly
and trains for 3 epochs of Tulu-v2) and the adapter's output projection starts at zero (a fresh skip path is
the plain residual); position 0 (the attention sink) is never routed (``route_from``, as FBS's ``gate_from``).

One implementation serves training, teacher-forced evaluation and decoding: the routers feed
:func:`fbs.model.layer.layer_step` through :class:`fbs.model.layer.Mix`'s ``ffn_scale`` and ``bypass`` hooks, in the
parallel forward (``mixer=``) and in the engine (``skip_policy=``, prompt included), so the parallel form
equals cached decoding (tested).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..model.layer import COMPUTE, LayerOut, Mix, Route
from ..model.causal_lm import FBSForCausalLM
from .host import host_model

CONFIG_NAME = "flexidepth_config.json"
WEIGHTS_NAME = "flexidepth.safetensors"


class FlexiDepthError(ValueError):
    """A FlexiDepth config or checkpoint is invalid, or made for another base model."""


@dataclasses.dataclass
class FlexiDepthConfig:
    """Router and adapter layout; every default is defined here only."""

    layers: tuple[int, ...] | None = None
    """Routed layers (negative = from the end); None = the latter half (the paper: last 16 of Llama-3-8B's 32)."""
    tau: float = 0.5
    """A token takes the full path of a routed layer when g > tau."""
    router_reduction: int = 16
    """Router bottleneck d_r = hidden_size / router_reduction."""
    adapter_reduction: int = 16
    """Adapter width = intermediate_size / adapter_reduction."""
    router_init_bias: float = 3.0
    """Initial router output bias: sigmoid(3) = 0.95, fresh routers compute nearly every token."""
    route_from: int = 1
    """Positions before this are never routed (full layers, no gate scaling), in training and decoding."""
    base_model: str | None = None
    """Name or path of the base model (filled in by FlexiDepth.from_base)."""
    base_fingerprint: str | None = None
    """Content hash of the base weights; a checkpoint refuses to load onto other weights."""

    def __post_init__(self) -> None:
        if self.layers is not None:
            self.layers = tuple(int(x) for x in self.layers)
        if not 0.0 <= self.tau <= 1.0:
            raise FlexiDepthError(f"tau must be in [0, 1], got {self.tau}")
        if self.router_reduction < 1 or self.adapter_reduction < 1:
            raise FlexiDepthError("router_reduction and adapter_reduction must be >= 1")
        if self.route_from < 0:
            raise FlexiDepthError(f"route_from must be >= 0, got {self.route_from}")

    def resolve(self, num_layers: int) -> tuple[int, ...]:
        """The routed layers as sorted absolute indices."""
        if self.layers is None:
            return tuple(range(num_layers // 2, num_layers))
        out = set()
        for i in self.layers:
            j = i + num_layers if i < 0 else i
            if not 0 <= j < num_layers:
                raise FlexiDepthError(f"layer {i} is out of range for a base model with {num_layers} layers")
            out.add(j)
        return tuple(sorted(out))


class Router(nn.Module):
    """(..., d) normalized layer input -> (...) logit of taking the full path."""

    def __init__(self, hidden_size: int, reduction: int, init_bias: float):
        super().__init__()
        r = max(1, hidden_size // reduction)
        self.down = nn.Linear(hidden_size, r, bias=False)
        self.norm = nn.RMSNorm(r, eps=1e-6)
        self.up = nn.Linear(r, hidden_size, bias=False)
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.constant_(self.head.bias, init_bias)

    def forward(self, xn: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(self.norm(torch.tanh(self.down(xn))))).squeeze(-1)

    def macs(self) -> int:
        return 2 * self.down.in_features * self.down.out_features + self.head.in_features


class Adapter(nn.Module):
    """A narrow SwiGLU FFN, (..., d) -> (..., d); the output projection starts at zero."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.gate = nn.Linear(hidden_size, width, bias=False)
        self.up = nn.Linear(hidden_size, width, bias=False)
        self.down = nn.Linear(width, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, hn: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(hn)) * self.up(hn))

    def macs(self) -> int:
        return 3 * self.gate.in_features * self.gate.out_features


class FlexiDepthOutput(NamedTuple):
    logits: torch.Tensor   # (B, T, V)
    gates: torch.Tensor    # (B, T, n) g of each routed layer (in the autograd graph); 1 where not routed
    skips: torch.Tensor    # (B, T, n) bool: the token took the skip path
    routed: torch.Tensor   # (B, T) bool: positions the routers decided


class FlexiDepth(nn.Module):
    """Routers and adapters over a frozen base decoder, run by the FBS engine's model (:func:`host_model`)."""

    def __init__(self, host: FBSForCausalLM, config: FlexiDepthConfig | None = None):
        super().__init__()
        if host.config.kv_policy != "project" or host.config.skip_granularity != "layer":
            raise FlexiDepthError("FlexiDepth skips whole layers and keeps their K/V: the host model needs "
                                  "kv_policy='project', skip_granularity='layer'")
        self.host = host
        self.config = config or FlexiDepthConfig()
        spec = host.base.spec
        self.layer_ids = self.config.resolve(spec.num_layers)
        d, width = spec.hidden_size, max(1, spec.intermediate_size // self.config.adapter_reduction)
        cfg = self.config
        self.routers = nn.ModuleDict({str(l): Router(d, cfg.router_reduction, cfg.router_init_bias)
                                      for l in self.layer_ids})
        self.adapters = nn.ModuleDict({str(l): Adapter(d, width) for l in self.layer_ids})
        dtype = host.base.embedding_weight.dtype
        self.routers.to(dtype), self.adapters.to(dtype)

    @classmethod
    def from_base(cls, base, config: FlexiDepthConfig | None = None, tokenizer=None) -> "FlexiDepth":
        """``base``: an HF causal LM instance or a bundled name / HF directory; fresh routers and adapters."""
        from ..model.bases import base_fingerprint

        host = host_model(base, tokenizer, kv_policy="project", skip_granularity="layer")
        hf = host.base.hf
        cfg = dataclasses.replace(config or FlexiDepthConfig(), base_model=host.config.base_model,
                                  base_fingerprint=base_fingerprint(hf))
        return cls(host, cfg)

    @property
    def tokenizer(self):
        return self.host.tokenizer

    @property
    def num_layers(self) -> int:
        return self.host.num_layers

    def flexidepth_parameters(self):
        """The trainable parameters: routers and adapters."""
        yield from self.routers.parameters()
        yield from self.adapters.parameters()

    # ---- the two paths ---------------------------------------------------------------------------------
    def gate(self, l: int, xn: torch.Tensor) -> torch.Tensor:
        """(B, T) probability g of the full path at routed layer l, from xn = RMSNorm_1(x)."""
        return torch.sigmoid(self.routers[str(l)](xn))

    def skip_path(self, l: int, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """x + (1 - g) Adapter(RMSNorm_2(x)) for (B, T, d) states and their (B, T) gates."""
        return x + (1 - g).unsqueeze(-1) * self.adapters[str(l)](self.host.base.norm2(l, x))

    def layer_mix(self, l: int, g: torch.Tensor, routed: torch.Tensor, tau: float) -> Mix:
        """Layer l's :class:`fbs.model.layer.Mix` for (B, T) gates g at the ``routed`` positions."""
        return Mix("layer", skip=routed & (g <= tau), ffn_scale=torch.where(routed, g, torch.ones_like(g)),
                   bypass=lambda layer, x: self.skip_path(layer, x, g))

    # ---- parallel forward (training, teacher-forced evaluation) ----------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                tau: float | None = None, route_from: int | None = None) -> FlexiDepthOutput:
        mixer = _ParallelRun(self, self.config.tau if tau is None else tau)
        start = self.config.route_from if route_from is None else route_from
        out = self.host(input_ids, attention_mask, gate_mode="off", gate_from=start, mixer=mixer)
        gates = torch.stack([mixer.gates[l] for l in self.layer_ids], dim=-1)
        idx = torch.tensor(self.layer_ids, device=input_ids.device)
        return FlexiDepthOutput(out.logits, gates, out.skips.index_select(-1, idx).bool(), mixer.routed)

    # ---- decoding -----------------------------------------------------------------------------------
    def policy(self, tau: float | None = None, route_prompt: bool = True) -> "FlexiDepthPolicy":
        return FlexiDepthPolicy(self, self.config.tau if tau is None else tau, route_prompt)

    def generate(self, input_ids, tau: float | None = None, **kwargs):
        """Cached decoding with the routers deciding (``fbs.engine.generate`` options); the prompt is routed too."""
        return self.host.generate(input_ids, skip_policy=self.policy(tau), **kwargs)

    def overhead(self, trace) -> tuple[int, int]:
        """What the routers and adapters did in an engine trace, which the FBS cost model does not price:
        (MACs, parameters read). Every generated token runs every router; a skipped pair runs its layer's
        adapter. Per decode step each router's parameters are read once, an adapter's when some row skipped."""
        valid = trace.valid.bool()                                              # (B, N)
        routed = list(self.layer_ids)
        skipped = ~trace.executed[..., routed].bool() & valid.unsqueeze(-1)     # (B, N, n)
        routers = [self.routers[str(l)] for l in routed]
        adapters = [self.adapters[str(l)] for l in routed]
        macs = int(valid.sum()) * sum(r.macs() for r in routers)
        macs += sum(int(n) * a.macs() for n, a in zip(skipped.sum(dim=(0, 1)).tolist(), adapters))
        count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
        steps = int(valid.any(0).sum())
        params = steps * sum(count(r) for r in routers)
        params += sum(int(n) * count(a) for n, a in zip(skipped.any(0).sum(0).tolist(), adapters))
        return macs, params

    # ---- checkpoints --------------------------------------------------------------------------------
    def flexidepth_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"routers.{k}": v for k, v in self.routers.state_dict().items()}
        sd.update({f"adapters.{k}": v for k, v in self.adapters.state_dict().items()})
        return {k: v.detach().contiguous().cpu() for k, v in sd.items()}

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Routers, adapters (safetensors) and config (JSON), written atomically into ``path``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-") as tmp:
            save_file(self.flexidepth_state_dict(), os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
            Path(tmp, CONFIG_NAME).write_text(json.dumps(dataclasses.asdict(self.config), indent=2, sort_keys=True))
            for name in (WEIGHTS_NAME, CONFIG_NAME):
                os.replace(os.path.join(tmp, name), path / name)
        return path

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, base=None, tokenizer=None, *,
                        check_base: bool = True) -> "FlexiDepth":
        """Load a checkpoint onto ``base`` (default: the base model recorded in it); refuses other weights, and a
        checkpoint that records no base fingerprint unless ``check_base=False``."""
        from safetensors.torch import load_file

        from ..model.bases import base_fingerprint

        path = Path(path)
        if not (path / CONFIG_NAME).is_file():
            raise FlexiDepthError(f"{path} is not a FlexiDepth checkpoint (no {CONFIG_NAME})")
        cfg = FlexiDepthConfig(**json.loads((path / CONFIG_NAME).read_text()))
        if base is None:
            if cfg.base_model is None:
                raise FlexiDepthError(f"{path} records no base model; pass base=")
            base = cfg.base_model
        if check_base and cfg.base_fingerprint is None:
            raise FlexiDepthError(f"{path} records no base_fingerprint in {CONFIG_NAME}, so nothing shows it belongs "
                                  "to the given base model; restore the config saved with the weights, or load with "
                                  "check_base=False only if you know the base is the right one")
        model = cls.from_base(base, cfg, tokenizer)
        if check_base and base_fingerprint(model.host.base.hf) != cfg.base_fingerprint:
            raise FlexiDepthError(f"{path} was trained on other base weights (fingerprint {cfg.base_fingerprint}); "
                                  "load it with the base it was made for")
        state = load_file(str(path / WEIGHTS_NAME))
        model.routers.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("routers.")})
        model.adapters.load_state_dict({k[9:]: v for k, v in state.items() if k.startswith("adapters.")})
        return model.eval()


def skip_loss(out: FlexiDepthOutput) -> torch.Tensor:
    """The paper's layer-skipping loss: mean over routed tokens of (sum over routed layers of g)^2."""
    used = out.gates.sum(-1)                           # (B, T) layers a token uses, softly
    return used.square()[out.routed].mean() if bool(out.routed.any()) else used.new_zeros(())


class _ParallelRun:
    """The routers over (B, T) positions at once (``FBSForCausalLM.forward(mixer=)``); keeps each layer's g."""

    def __init__(self, model: FlexiDepth, tau: float):
        self.m, self.tau = model, tau
        self.layers = set(model.layer_ids)
        self.gates: dict[int, torch.Tensor] = {}
        self.routed: torch.Tensor | None = None

    def route(self, l: int, x: torch.Tensor, xn: torch.Tensor, allowed: torch.Tensor) -> Route | None:
        self.routed = allowed
        if l not in self.layers:
            return None
        g = self.m.gate(l, xn)
        self.gates[l] = torch.where(allowed, g, torch.ones_like(g))
        mix = self.m.layer_mix(l, g, allowed, self.tau)
        return Route(mix, (1 - g) * allowed)

    def observe(self, l: int, x: torch.Tensor, out: LayerOut) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class FlexiDepthPolicy:
    """The engine's ``skip_policy``: the routers decide per token and layer, the prompt included (prefill) unless
    ``route_prompt=False`` (the prompt then runs every layer in full, as FBS prefills it; the parallel form of that
    is ``FlexiDepth.forward(route_from=<prompt length>)``). Rows that skip write their K/V (``project``) and take the
    adapter path; the trace's ``gate_p`` is 1 - g."""

    model: FlexiDepth
    tau: float = 0.5
    route_prompt: bool = True

    def start(self, decoder) -> "_DecodeRun":
        if decoder.policy != "project" or decoder.granularity != "layer":
            raise FlexiDepthError("FlexiDepth decodes with kv_policy='project' and whole-layer skipping")
        return _DecodeRun(self.model, self.tau, decoder.dev, self.route_prompt)

    def overhead(self, trace) -> tuple[int, int]:
        """(MACs, parameters read) of the routers and adapters in a decode trace (:meth:`FlexiDepth.overhead`)."""
        return self.model.overhead(trace)

    def to_dict(self) -> dict:
        cfg = self.model.config
        return {"method": "flexidepth", "tau": self.tau, "layers": list(self.model.layer_ids),
                "route_from": cfg.route_from, "route_prompt": self.route_prompt,
                "router_reduction": cfg.router_reduction, "adapter_reduction": cfg.adapter_reduction}


class _DecodeRun:
    def __init__(self, model: FlexiDepth, tau: float, device, route_prompt: bool = True):
        self.m, self.tau, self.dev, self.route_prompt = model, tau, device, route_prompt
        self.layers = set(model.layer_ids)
        self.g: torch.Tensor | None = None  # (b,) gates of the step's rows at the current layer

    def prefill_mix(self, l: int, x: torch.Tensor, positions: torch.Tensor) -> Mix:
        if l not in self.layers or not self.route_prompt:
            return COMPUTE  # an unrouted position runs the full layer, unscaled (layer_mix where routed is False)
        g = self.m.gate(l, self.m.host.base.norm1(l, x))
        return self.m.layer_mix(l, g, positions >= self.m.config.route_from, self.tau)

    def decide(self, l: int, step: int, rows: list[int], x: torch.Tensor, pre) -> tuple[list[bool], list[float] | None]:
        if l not in self.layers:
            return [False] * len(rows), None
        logit = self.m.routers[str(l)](pre.xn)[:, 0]                  # (b,)
        self.g = torch.sigmoid(logit)
        skip, logits = torch.stack([(self.g <= self.tau).to(logit.dtype), logit]).tolist()  # one host read
        return [s > 0.5 for s in skip], [-v for v in logits]  # recorded as skip logits: gate_p = 1 - g

    def mix(self, l: int, sel: list[int]) -> Mix:
        if l not in self.layers:
            return COMPUTE
        g = self.g[torch.tensor(sel, device=self.dev)] if len(sel) != len(self.g) else self.g
        return Mix("layer", ffn_scale=g.unsqueeze(-1))

    def bypass(self, l: int, skipped: list[int], x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor(skipped, device=self.dev)
        return new.index_copy(0, idx, self.m.skip_path(l, x[idx], self.g[idx].unsqueeze(-1)))

    def observe(self, l: int, run: list[bool], out: LayerOut) -> None:
        pass
