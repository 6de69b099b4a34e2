"""Whole-layer skipping in the engine against oracles outside the library.

* ``hole``: a plan that skips layers S at every decoded position is HF's own model with those decoder layers
  deleted, decoding from the full model's prompt cache (the engine prefills the prompt with every layer; a token
  that skips a layer writes no K/V there, so the deleted layers' prompt entries are never read again). A plan over
  every position, prompt included (the parallel forward), is the deleted model outright, under either policy.
* ``hole`` and ``project``: a plan per decode step, and threshold gates that skip different layers in each batch
  row, against :class:`Reference`, a float64 decoder written here from the HF modules: a skipped (token, layer)
  keeps its state, and under ``project`` the layer still stores the K/V of that unchanged state.

The FBS modules are fresh (PAW and CH add exactly zero: their output projections start at zero), so the decoder
is the HF model's. Every family (Llama, Qwen2, Qwen3, Mistral) runs through the HF modules (``weights="hf"``), the
fused fp32 copies and the native int8 step; for int8 the weights are first rounded to values the int8 format
stores exactly, so the oracles run on the very weights the int8 kernels read. Each test also checks that the skip
it verifies moves the logits by far more than its tolerance, so an engine that ran a skipped layer would fail.
"""

import copy
import functools

import pytest
import torch
from torch import nn
from transformers import MistralConfig, MistralForCausalLM
from transformers.models.llama.modeling_llama import rotate_half

from conftest import FAMILIES, VOCAB, int8_exact_, require_native, tiny_config, tiny_hf
from fbs import FBSForCausalLM
from fbs.engine.fused import decode_ops

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest on a shared machine

ALL_FAMILIES = sorted(FAMILIES) + ["mistral"]
# the engine's weights in the per-step tests: the fused copies and native int8 by default, the HF modules themselves
# with the slow tests (the hole test runs all three by default)
ENGINE_WEIGHTS = ["fp32", "int8", pytest.param("hf", marks=pytest.mark.slow)]
LAYERS = 6
PROMPTS = [torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (11, 6, 3)]
N_NEW = 8
DELETED = (2, 3)  # gated layers of tiny_config (layers 0 and 5 are never skipped)
TOL = 1e-5        # logits, absolute: float32 rounding against float32 / float64 oracles
GAP = 100 * TOL   # the least change the verified skips make to the logits


def base_model(family: str, int8: bool = False, seed: int = 0) -> nn.Module:
    """A tiny random HF decoder of ``family``; ``int8``: its Linear weights made exactly representable in int8."""
    if family == "mistral":
        torch.manual_seed(seed)
        cfg = MistralConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128,
                            tie_word_embeddings=True, eos_token_id=VOCAB - 1, bos_token_id=0, pad_token_id=0,
                            sliding_window=None)
        hf = MistralForCausalLM(cfg).eval()
    else:
        hf = tiny_hf(family, LAYERS, seed)
    if int8:
        int8_exact_(hf)
    return hf


def fbs_model(hf: nn.Module, weights: str, **cfg) -> FBSForCausalLM:
    model = FBSForCausalLM.from_base(hf, config=tiny_config(**cfg)).eval()
    if weights == "int8":  # the native int8 step, on exactly the HF weights
        require_native("avx2")
        ops = decode_ops(model, "int8")
        assert ops.native_packed
        if hf.config.model_type != "qwen3":  # Qwen3's per-head norms keep the per-op step (native products)
            assert sum(n is not None for n in ops.native_layers) >= 3
        for l, layer in enumerate(hf.model.layers):
            assert torch.equal(ops.layers[l].q.dequantized(), layer.self_attn.q_proj.weight)
            assert torch.equal(ops.layers[l].down.dequantized(), layer.mlp.down_proj.weight)
        assert torch.equal(ops.head_w.dequantized(), hf.lm_head.weight)
    return model


# --------------------------------------------------------------------------- oracle 1: HF without those layers
def without_layers(hf: nn.Module, deleted) -> nn.Module:
    """A copy of the HF model with decoder layers ``deleted`` removed (layer indices and config renumbered)."""
    keep = [l for l in range(hf.config.num_hidden_layers) if l not in deleted]
    small = copy.deepcopy(hf)
    small.model.layers = nn.ModuleList([small.model.layers[l] for l in keep])
    for i, layer in enumerate(small.model.layers):
        layer.self_attn.layer_idx = i
    small.config.num_hidden_layers = len(keep)
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = [small.config.layer_types[l] for l in keep]
    return small


@torch.no_grad()
def hf_greedy(hf: nn.Module, prompt: list[int], n_new: int, deleted=()) -> tuple[list[int], torch.Tensor]:
    """HF's own greedy decoding: the prompt through the whole model; each new token through the model without
    layers ``deleted``, attending to the prompt's K/V at the layers it keeps. Returns (tokens, logits (n_new, V))."""
    keep = [l for l in range(hf.config.num_hidden_layers) if l not in deleted]
    small = without_layers(hf, deleted)
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    cache.layers = [cache.layers[l] for l in keep]
    logits = [out.logits[0, -1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(n_new - 1):
        logits.append(small(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


# --------------------------------------------------------------------------- oracle 2: a decoder written here
class Reference:
    """Greedy cached decoding from the HF modules of a float64 copy of the model, one token at a time.

    The prompt runs every layer (HF's forward, whose cache gives each layer's entries); then per layer a list of
    (K, V) entries, each rotated at its own position. A decoded token that skips a layer keeps its state; under
    ``project`` the layer still stores K/V of that state (RMSNorm_1, K/V projections, Qwen3's per-head norm,
    RoPE), under ``hole`` nothing."""

    def __init__(self, hf: nn.Module):
        self.m = copy.deepcopy(hf).double()
        c = hf.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // self.heads

    @torch.no_grad()
    def greedy(self, prompt: list[int], n_new: int, skip, policy: str) -> tuple[list[int], torch.Tensor]:
        """``skip(step, layer)``: decode step ``step`` (the one that consumes generated token ``step``) skips
        ``layer``. Returns (tokens, logits (n_new, V))."""
        out = self.m(torch.tensor([prompt]), use_cache=True)  # the prompt: HF's forward, every layer
        caches = [(list(c.keys[0].transpose(0, 1)), list(c.values[0].transpose(0, 1)))  # T entries (Hkv, hd)
                  for c in out.past_key_values.layers]
        logits = out.logits[0, -1]
        tokens, scores = [], []
        for s in range(n_new):
            scores.append(logits)
            tokens.append(int(logits.argmax()))
            if s + 1 < n_new:
                logits = self._token(tokens[-1], len(prompt) + s, caches, lambda l, s=s: skip(s, l), policy)
        return tokens, torch.stack(scores).float()

    def _heads(self, proj: nn.Module, norm: nn.Module | None, xn: torch.Tensor, n: int) -> torch.Tensor:
        y = proj(xn).view(n, self.hd)  # (n, hd)
        return y if norm is None else norm(y)

    def _token(self, tok: int, pos: int, caches, skip, policy: str) -> torch.Tensor:
        m = self.m.model
        x = m.embed_tokens(torch.tensor([tok]))                          # (1, d)
        cos, sin = (t[0] for t in m.rotary_emb(x, torch.tensor([[pos]])))  # (1, hd)
        rope = lambda y: y * cos + rotate_half(y) * sin                   # noqa: E731  (HF's rotation)
        for l, layer in enumerate(m.layers):
            attn = layer.self_attn
            xn = layer.input_layernorm(x)
            k = rope(self._heads(attn.k_proj, getattr(attn, "k_norm", None), xn, self.kv_heads))  # (Hkv, hd)
            v = self._heads(attn.v_proj, None, xn, self.kv_heads)
            skipped = skip(l)
            if not skipped or policy == "project":
                caches[l][0].append(k)
                caches[l][1].append(v)
            if skipped:
                continue
            q = rope(self._heads(attn.q_proj, getattr(attn, "q_norm", None), xn, self.heads))        # (H, hd)
            group = self.heads // self.kv_heads
            keys = torch.stack(caches[l][0]).repeat_interleave(group, 1)   # (n, H, hd)
            vals = torch.stack(caches[l][1]).repeat_interleave(group, 1)
            p = (torch.einsum("hd,nhd->hn", q, keys) * attn.scaling).softmax(-1)
            h = x + attn.o_proj(torch.einsum("hn,nhd->hd", p, vals).reshape(1, -1))
            x = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.m.lm_head(m.norm(x))[0]


@functools.lru_cache(maxsize=None)
def reference(family: str, int8: bool, seed: int) -> Reference:
    """The :class:`Reference` of ``base_model(family, int8, seed)``, made once per session."""
    return Reference(base_model(family, int8=int8, seed=seed))


def _check_rows(res, expected, tol=TOL) -> None:
    """The engine's tokens and per-step logits of every row against the oracle's (tokens, logits)."""
    for r, (tokens, logits) in enumerate(expected):
        assert res.new_tokens[r] == tokens, f"row {r}"
        err = (res.scores[r] - logits).abs().max().item()
        assert err < tol, f"row {r}: logits differ by {err:.2e}"


# --------------------------------------------------------------------------- the oracles themselves
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_reference_decoder_is_hf(family):
    """The hand-written decoder agrees with HF's own: full depth, and ``hole`` skips of every decoded token = the
    model without those layers (so what it computes under ``project`` rests on checked parts)."""
    hf = base_model(family)
    ref = Reference(hf)
    prompt = PROMPTS[0]
    for deleted in ((), DELETED):
        tokens, logits = hf_greedy(hf, prompt, N_NEW, deleted)
        got_tokens, got = ref.greedy(prompt, N_NEW, lambda s, l: l in deleted, "hole")
        assert got_tokens == tokens and (got - logits).abs().max() < TOL


# --------------------------------------------------------------------------- hole: HF without those layers
@pytest.mark.parametrize("weights", ["hf", "fp32", "int8"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_hole_plan_on_every_decoded_token_is_hf_without_those_layers(family, weights):
    """Rows of three lengths, layers 2 and 3 skipped at every decode step under ``hole``: each row's tokens and
    logits are those of HF's model without layers 2 and 3 decoding from the full model's prompt cache."""
    hf = base_model(family, int8=weights == "int8")
    model = fbs_model(hf, weights)
    plan = torch.zeros(LAYERS, dtype=torch.bool)
    plan[list(DELETED)] = True
    res = model.generate(PROMPTS, max_new_tokens=N_NEW, ignore_eos=True, output_scores=True, skip_plan=plan,
                         kv_policy="hole", weights=weights)
    tr = res.trace
    assert tr.valid[:, :-1].all() and torch.equal(tr.executed[:, :-1], ~plan.expand(3, N_NEW - 1, -1))
    assert torch.equal(tr.kv_written[:, :-1], tr.executed[:, :-1])  # hole: a skipped token writes nothing
    _check_rows(res, [hf_greedy(hf, p, N_NEW, DELETED) for p in PROMPTS])
    full = hf_greedy(hf, PROMPTS[0], 2)[1]
    assert (full[1] - res.scores[0][1]).abs().max() > GAP  # running layers 2 and 3 would fail the check


@pytest.mark.parametrize("policy", ["hole", "project"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_plan_on_every_position_is_hf_without_those_layers(family, policy):
    """The parallel forward with layers 2 and 3 skipped at every position, prompt included: no token computes
    them, so under either policy the logits are HF's without those layers (padding-free rows of equal length)."""
    hf = base_model(family)
    model = fbs_model(hf, "fp32")
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2], PROMPTS[1] + PROMPTS[1][:5] + PROMPTS[2]])
    plan = torch.zeros(LAYERS, dtype=torch.bool)
    plan[list(DELETED)] = True
    with torch.no_grad():
        out = model(ids, gate_mode="plan", skip_plan=plan, kv_policy=policy).logits
        ref = without_layers(hf, DELETED)(ids).logits
        full = hf(ids).logits
    assert (out - ref).abs().max() < TOL
    assert (full - ref).abs().max() > GAP


# --------------------------------------------------------------------------- both policies: the reference
def _step_plan(seed: int) -> torch.Tensor:
    """(N_NEW, L) a different set of skipped gated layers at each decode step (step 0 skips one at least)."""
    plan = torch.rand(N_NEW, LAYERS, generator=torch.Generator().manual_seed(seed)) < 0.5
    plan[:, [0, LAYERS - 1]] = False
    plan[0, 2] = True
    return plan


_REFERENCE: dict = {}


def _reference_rows(family: str, int8: bool, policy: str, plan: torch.Tensor) -> list:
    """Reference.greedy of every prompt under ``plan`` (shared by the tests that use the same weights)."""
    key = (family, int8, policy, tuple(plan.flatten().tolist()))
    if key not in _REFERENCE:
        ref = reference(family, int8, 0)
        _REFERENCE[key] = [ref.greedy(p, N_NEW, lambda s, l: bool(plan[s, l]), policy) for p in PROMPTS]
    return _REFERENCE[key]


@pytest.mark.parametrize("policy", ["hole", "project"])
@pytest.mark.parametrize("weights", ENGINE_WEIGHTS)
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_step_plan_equals_the_reference(family, weights, policy):
    """A (N, L) plan (other layers skipped at each step), rows of three lengths: tokens and logits of the
    float64 reference under the same policy. The two policies' references differ by far more than the tolerance
    (a skipped token's K/V matter to later tokens), and so do skipping and not skipping."""
    int8 = weights == "int8"
    hf = base_model(family, int8=int8)
    model = fbs_model(hf, weights)
    plan = _step_plan(seed=len(family))
    res = model.generate(PROMPTS, max_new_tokens=N_NEW, ignore_eos=True, output_scores=True, skip_plan=plan,
                         kv_policy=policy, weights=weights)
    tr = res.trace
    assert torch.equal(tr.executed[:, :-1], ~plan[:-1].expand(3, -1, -1))
    assert tr.kv_written[:, :-1].all() if policy == "project" else torch.equal(tr.kv_written, tr.executed)
    expected = _reference_rows(family, int8, policy, plan)
    _check_rows(res, expected)
    other = _reference_rows(family, int8, {"hole": "project", "project": "hole"}[policy], plan)
    assert max((a[1] - b[1]).abs().max() for a, b in zip(expected, other)) > GAP
    full = hf_greedy(hf, PROMPTS[0], 2)[1]
    assert (full[1] - res.scores[0][1]).abs().max() > GAP


def _random_gates_(model: FBSForCausalLM, seed: int) -> FBSForCausalLM:
    """Gates that skip about half the time, in patterns that differ between rows (PAW and CH stay fresh: zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.gates.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for lin in model.gates.out.values():
            lin.weight.mul_(10)
            lin.bias.zero_()
    return model


@pytest.mark.parametrize("policy", ["hole", "project"])
@pytest.mark.parametrize("weights", ENGINE_WEIGHTS)
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_rows_that_skip_different_layers_equal_the_reference(family, weights, policy):
    """Threshold gates under ``gather``: each row skips its own layers at each step (in the int8 step the decisions
    are made inside the native layer calls). Every row equals the reference run with that row's executed pattern."""
    int8 = weights == "int8"
    hf = base_model(family, int8=int8, seed=1)
    model = _random_gates_(fbs_model(hf, weights, gate_prev_skip=True), seed=0)
    res = model.generate(PROMPTS, max_new_tokens=N_NEW, ignore_eos=True, output_scores=True, kv_policy=policy,
                         weights=weights, batch_policy="gather")
    ex = res.trace.executed[:, :-1]
    assert 0.2 < res.trace.skip_ratio < 0.6
    assert not torch.equal(ex[0], ex[1]) and not torch.equal(ex[1], ex[2]) and not torch.equal(ex[0], ex[2])
    ref = reference(family, int8, 1)
    expected = [ref.greedy(p, N_NEW, lambda s, l, r=r: not bool(ex[r, s, l]), policy) for r, p in enumerate(PROMPTS)]
    _check_rows(res, expected)
    rows_swapped = ref.greedy(PROMPTS[0], N_NEW, lambda s, l: not bool(ex[1, s, l]), policy)[1]
    assert (rows_swapped - expected[0][1]).abs().max() > GAP  # another row's pattern would fail the check


def test_engine_refuses_a_per_row_plan():
    """A skip plan is one for every row, (L,) or (N, L); a (B, N, L) tensor is refused by name, not misread."""
    model = fbs_model(base_model("llama"), "fp32")
    plan = torch.zeros(3, N_NEW, LAYERS, dtype=torch.bool)
    plan[0, 1:5, 2] = True
    with pytest.raises(ValueError, match=r"skip_plan must be \(L,\) or \(N, L\)"):
        model.generate(PROMPTS, max_new_tokens=N_NEW, ignore_eos=True, skip_plan=plan)
