"""The engine's fused weights (fp32 / bf16 / int8) and the compiled one-token step."""

import pytest
import torch

import fbs.engine.fused
from conftest import fbs_tiny, randomize
from fbs.engine.defaults import default_prefill
from fbs.engine.fused import decode_ops
from fbs.engine.quant import dequantize, quantize_int8

PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("weights", ["fp32", "fp32-onednn"])
@pytest.mark.parametrize("family, policy", [("llama", "project"), ("qwen2", "hole"), ("qwen3", "project")])
def test_fused_fp32_equals_hf_modules(family, policy, weights):
    """Fused K/V + folded gate, fused gate/up, static-cache attention: the same tokens, logits and skips.
    ``fp32-onednn`` (every matrix, LM head included, a packed oneDNN tensor) equals them up to float rounding."""
    if weights == "fp32-onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("needs torch built with oneDNN")
    model = randomize(fbs_tiny(family, seed=1), seed=2)
    if weights == "fp32-onednn":
        ops = decode_ops(model, weights)
        assert ops.head_w.w.is_mkldnn and all(w.kvg.w.is_mkldnn and w.down.w.is_mkldnn for w in ops.layers)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist()]
    kw = dict(max_new_tokens=12, ignore_eos=True, output_scores=True, kv_policy=policy)
    ref = model.generate(prompts, weights="hf", **kw)
    out = model.generate(prompts, weights=weights, **kw)
    assert 0 < ref.trace.skip_ratio < 1
    assert out.new_tokens == ref.new_tokens
    assert torch.equal(out.trace.executed, ref.trace.executed)
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max() < 1e-4
    ok = ~torch.isnan(ref.trace.gate_p)
    assert torch.equal(ok, ~torch.isnan(out.trace.gate_p))
    assert (out.trace.gate_p[ok] - ref.trace.gate_p[ok]).abs().max() < 1e-5


def test_fused_copies_follow_weight_changes():
    model = fbs_tiny()
    ops = decode_ops(model, "fp32")
    assert decode_ops(model, "fp32") is ops  # built once
    before = model.generate(PROMPT, max_new_tokens=6, ignore_eos=True, output_scores=True).scores[0]
    with torch.no_grad():
        model.base.layers[2].mlp.down_proj.weight.mul_(3.0)
    assert decode_ops(model, "fp32") is not ops
    after = model.generate(PROMPT, max_new_tokens=6, ignore_eos=True, output_scores=True).scores[0]
    ref = model.generate(PROMPT, max_new_tokens=6, ignore_eos=True, output_scores=True, weights="hf").scores[0]
    assert (after - before).abs().max() > 1e-3 and (after - ref).abs().max() < 1e-4


def test_int8_quantization_roundtrip():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (48,) and q.abs().max() <= 127
    err = (dequantize(q, s) - w).abs().max(dim=1).values
    assert (err <= w.abs().amax(dim=1) / 127 * 0.51 + 1e-3 * w.abs().amax(dim=1)).all()  # half a step (+ bf16 scale)


def test_int8_logits_near_fp32_and_int8_head_used(family, monkeypatch):
    """int8 weight-only decoding (LM head included): each step's logits lie within 3% of the logits' range of
    the fp32 parallel forward over the same tokens; the decode steps' LM head is the int8 matrix."""
    model = fbs_tiny(family)
    ops = decode_ops(model, "int8")
    head_dtypes = []
    real = fbs.engine.fused.matmul

    def spy(x, w, s):
        if w.data_ptr() == ops.head_w.w.data_ptr():
            head_dtypes.append(w.dtype)
        return real(x, w, s)

    monkeypatch.setattr(fbs.engine.fused, "matmul", spy)
    ids = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(3))
    q8 = model.generate(ids, max_new_tokens=8, ignore_eos=True, output_scores=True, weights="int8",
                        elide_inert=False)  # the ops of this model (its fresh PAW / CH run)
    assert head_dtypes == [torch.int8] * 8  # the prefill's last position and 7 decode steps
    with torch.no_grad():
        ref = model(q8.sequences, gate_mode="off").logits[:, 15:-1]  # fp32, HF modules, same tokens
    for r in range(2):
        err = (q8.scores[r] - ref[r]).abs().max()
        assert 0 < err < 0.03 * (ref[r].max() - ref[r].min())


def test_bf16_weights_run_and_stay_close():
    model = fbs_tiny()
    ref = model.generate(PROMPT, max_new_tokens=4, ignore_eos=True, output_scores=True)
    out = model.generate(PROMPT, max_new_tokens=4, ignore_eos=True, output_scores=True, weights="bf16")
    a, b = ref.scores[0], out.scores[0]
    assert 0 < (a - b).abs().max() < 0.05 * (a.max() - a.min())


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_compiled_graph_count_does_not_grow_with_skip_patterns(weights):
    """The compiled step takes weights and cache buffers as arguments and the skip loop stays in Python: new
    per-token skip patterns reuse the captured graphs (counted at dynamo's level; ``eager`` backend for speed)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = randomize(fbs_tiny(), gate_bias=0.0)
    kw = dict(ignore_eos=True, compile="eager", weights=weights)
    model.generate(PROMPT, max_new_tokens=10, **kw)                                     # gates decide
    model.generate(PROMPT, max_new_tokens=10, force_compute=True, **kw)
    first = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    for policy in ("project", "hole"):
        for _ in range(3):
            plan = torch.rand(10, model.num_layers, generator=g) < 0.5
            plan[:, list(model.layers_cfg.never_skip)] = False
            model.generate(PROMPT, max_new_tokens=10, skip_plan=plan, kv_policy=policy, **kw)
        model.generate(PROMPT, max_new_tokens=10, tau=0.2, kv_policy=policy, **kw)
    assert counters["stats"]["unique_graphs"] == first <= 8


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_compiled_decoding_gives_eager_tokens(weights, monkeypatch):
    """inductor (cpp_wrapper) vs eager fused weights: identical tokens and skips, logits within rounding. A
    compiled int8 step runs torch's int8 op (bf16 activations), so its eager reference does too (no fbs.native)."""
    if weights == "int8":
        monkeypatch.setenv("FBS_NATIVE", "0")
    model = randomize(fbs_tiny(), gate_bias=0.0)
    kw = dict(max_new_tokens=16, ignore_eos=True, output_scores=True, weights=weights)
    eager = model.generate(PROMPT, **kw)
    compiled = model.generate(PROMPT, compile=True, **kw)
    assert compiled.new_tokens == eager.new_tokens
    assert torch.equal(compiled.trace.executed, eager.trace.executed) and eager.trace.skip_ratio > 0
    assert (compiled.scores[0] - eager.scores[0]).abs().max() < 1e-4


def test_bench_runs_each_fbs_system_per_weight_format_and_batch_policy():
    from fbs.bench.runner import RunSpec, build_systems

    model = fbs_tiny()
    spec = RunSpec(systems=("fbs-full", "fbs-tau"), taus=(1.0,), weights=("fp32", "int8"),
                   batch_policies=("gather", "majority"), compile=True)
    systems = build_systems(model.base.hf, None, model, spec)
    pre = default_prefill("int8")  # auto: bf16 on a CPU with AMX-BF16, else fp32 (named where it is not fp32)
    p = "" if pre == "fp32" else f"-{pre}prefill"
    assert [s.name for s in systems] == [
        "fbs-full-compute-compiled", "fbs-full-compute-compiled-majority", f"fbs-full-compute-int8-compiled-kvint8{p}",
        f"fbs-full-compute-int8-compiled-majority-kvint8{p}", "fbs-tau1-compiled", "fbs-tau1-compiled-majority",
        f"fbs-tau1-int8-compiled-kvint8{p}", f"fbs-tau1-int8-compiled-majority-kvint8{p}"]  # kv auto: int8 + key factors
    assert systems[3].knobs == {"force_compute": True, "weights": "int8", "compile": True, "batch_policy": "majority",
                                "kv_dtype": "int8", **({} if pre == "fp32" else {"prefill": pre})}
    with pytest.raises(ValueError, match="weights"):
        RunSpec(weights=("fp16",))
    # prefill choices: fp32 GEMMs keep the name, int8 adds -int8prefill and the knob; auto is this CPU's default
    spec = RunSpec(systems=("fbs-full",), weights=("q4",), prefills=("fp32", "int8", "auto"))
    systems = build_systems(model.base.hf, None, model, spec)
    names = ["fbs-full-compute-q4-kvint8", "fbs-full-compute-q4-kvint8-int8prefill"]
    assert [s.name for s in systems] == names + ([] if pre == "fp32" else [f"fbs-full-compute-q4-kvint8{p}"])
    assert systems[1].knobs["prefill"] == "int8" and "prefill" not in systems[0].knobs
    with pytest.raises(ValueError, match="prefills"):
        RunSpec(prefills=("int4",))


def test_bench_runs_each_fbs_system_eager_and_compiled_side_by_side():
    from fbs.bench.cli import COMPILE_MODES
    from fbs.bench.runner import RunSpec, build_systems

    model = fbs_tiny()
    spec = RunSpec(systems=("hf-greedy", "fbs-full"), weights=("fp32", "hf"), compile=COMPILE_MODES["both"])
    systems = build_systems(model.base.hf, None, model, spec)
    assert [s.name for s in systems] == ["hf-greedy", "fbs-full-compute", "fbs-full-compute-compiled",
                                         "fbs-full-compute-hf"]  # the HF modules are never compiled
    assert [s.knobs.get("compile") for s in systems[1:]] == [False, True, False]
    for bad in ((), (True, True), ("yes",)):
        with pytest.raises(ValueError, match="compile"):
            RunSpec(compile=bad)


@pytest.mark.parametrize("cfg", [dict(gate_prev_skip=True), dict(gate_input="preview"),
                                 dict(gate_input="residual", gate_prev_skip=True)])
def test_gate_inputs_fused_equal_hf_and_parallel(cfg):
    """Every gate input (residual, preview, previous skip) gives the same decisions through the fused gate
    (folded into the K/V matmul) as through the HF modules, and as the parallel forward recomputed each step."""
    model = randomize(fbs_tiny(seed=1, **cfg), seed=2)
    kw = dict(max_new_tokens=10, ignore_eos=True, output_scores=True)
    ref = model.generate(PROMPT, weights="hf", **kw)
    out = model.generate(PROMPT, **kw)
    assert 0 < ref.trace.skip_ratio < 1
    assert out.new_tokens == ref.new_tokens and torch.equal(out.trace.executed, ref.trace.executed)
    seq = PROMPT.clone()
    with torch.no_grad():
        for _ in range(10):
            logits = model(seq, gate_from=PROMPT.shape[1]).logits
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.sequences.tolist() == seq.tolist()



@pytest.mark.parametrize("hd", [64, 128])
def test_one_token_rope_equals_transformers_bit_for_bit(hd):
    """The decode step's rotary embedding (tables once per step, roll instead of rotate_half's slices) is HF's
    ``apply_rotary_pos_emb`` exactly, on random tables (not only valid cos/sin pairs)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from fbs.engine.fused import _rope, _rope_tables

    g = torch.Generator().manual_seed(hd)
    q, k = torch.randn(3, 9, 1, hd, generator=g) * 5, torch.randn(3, 2, 1, hd, generator=g)
    cos, sin = torch.randn(3, 1, hd, generator=g), torch.randn(3, 1, hd, generator=g)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    tables = _rope_tables(cos, sin)
    assert torch.equal(_rope(q, *tables), q_ref) and torch.equal(_rope(k, *tables), k_ref)


def test_native_runs_cut_layers_into_maximal_runs():
    """The native implementation of ``run_layers`` calls the kernel once per maximal run of layers that have a
    native whole-layer step and runs the others one by one: the cut, by hand, for a whole stack and a part."""
    model = fbs_tiny(layers=6)
    ops = decode_ops(model, "fp32")
    n = object()
    ops.native_layers = [n, None, n, n, None, n]
    assert ops._native_runs(range(6)) == ((range(0, 1), True), (range(1, 2), False), (range(2, 4), True),
                                          (range(4, 5), False), (range(5, 6), True))
    assert ops._native_runs(range(3, 5)) == ((range(3, 4), True), (range(4, 5), False))
    ops.native_layers = [None] * 6  # a new list: the cut follows it
    assert ops._native_runs(range(6)) == ((range(0, 6), False),)


@pytest.mark.parametrize("weights", ["hf", "fp32"])
def test_decode_step_runs_its_layers_in_one_ops_call(weights, monkeypatch):
    """Each decode step hands all its layers to one ``ops.run_layers`` call over the step's state; the tokens
    are those of a run without the spy."""
    model = randomize(fbs_tiny(seed=1), seed=2)
    kw = dict(max_new_tokens=5, ignore_eos=True, weights=weights)
    ref = model.generate([PROMPT[0].tolist()], **kw)
    cls = type(decode_ops(model, weights))
    calls, real = [], cls.run_layers

    def spy(self, layers, step):
        calls.append((layers, type(step).__name__))
        return real(self, layers, step)

    monkeypatch.setattr(cls, "run_layers", spy)
    out = model.generate([PROMPT[0].tolist()], **kw)
    assert out.new_tokens == ref.new_tokens
    assert calls == [(range(model.base.spec.num_layers), "DecodeStep")] * 4  # the first token is the prefill's
