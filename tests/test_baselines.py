"""Adaptive-depth baselines on the FBS engine (issue 16): FFN-SkipLLM and the FlexiDepth-style router.

Oracles: HF forward hooks (what each layer's modules really computed), the FFN-SkipLLM rule replayed by hand
from the cosines the hooks saw, the parallel forward against cached decoding, and the frozen backbone's
weights before and after training.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import VOCAB, recorded_fused_calls, tiny_hf
from fbs.baselines import FFNSkipLLM, FlexiDepth, FlexiDepthConfig, ffn_skip_model, host_model, skip_loss
from fbs.baselines.flexidepth import FlexiDepthError
from fbs.train.flexidepth import FlexiDepthTrainConfig, Trainer, step_loss
from fbs.train.data import BlockData

PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))
PROMPTS = [torch.randint(0, 255, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 12, 12)]
RULE = dict(warmup=2, cold_first=1, cold_last=1)


def loud_ffns(model, scale: float = 6.0):
    """Scale every MLP's output so FFN blocks change the residual visibly (random tiny models barely move it)."""
    with torch.no_grad():
        for layer in model.base.layers:
            layer.mlp.down_proj.weight.mul_(scale)
    return model


def ffn_model(family: str = "llama", layers: int = 8):
    return loud_ffns(ffn_skip_model(tiny_hf(family, layers)))


def median_cosine(model, ids) -> float:
    """The median cos(h, h + FFN(h)) over the hot layers of a full-depth parallel pass: a threshold that splits."""
    hs, outs = {}, {}  # the FFN's input h enters post_attention_layernorm, its update leaves mlp
    hooks = []
    for l, layer in enumerate(model.base.layers):
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, l=l: hs.__setitem__(l, a[0].detach())))
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, l=l: outs.__setitem__(l, o.detach())))
    try:
        with torch.no_grad():
            model(ids, gate_mode="off")
    finally:
        for h in hooks:
            h.remove()
    cos = [F.cosine_similarity(hs[l], hs[l] + outs[l], dim=-1).flatten()
           for l in range(RULE["cold_first"], model.num_layers - RULE["cold_last"])]
    return torch.cat(cos).median().item()


# ------------------------------------------------------------------------------------------------ FFN-SkipLLM
def record_ffn_calls(model):
    """Per layer, the cos(h, h + MLP(h)) of every one-token (decode) FFN call, from HF hooks: the FFN's input h
    enters post_attention_layernorm, its update leaves mlp."""
    h_in: dict[int, torch.Tensor] = {}
    cos: dict[int, list[float]] = {l: [] for l in range(model.num_layers)}
    attn: dict[int, int] = {l: 0 for l in range(model.num_layers)}

    def pre(l):
        return lambda m, a: h_in.__setitem__(l, a[0].detach())

    def post(l):
        def hook(m, a, out):
            if out.shape[1] == 1:
                cos[l].append(F.cosine_similarity(h_in[l], h_in[l] + out, dim=-1).item())
        return hook

    def q(l):
        return lambda m, a, out: attn.__setitem__(l, attn[l] + (out.shape[1] == 1))

    hooks = []
    for l, layer in enumerate(model.base.layers):
        hooks += [layer.post_attention_layernorm.register_forward_pre_hook(pre(l)),
                  layer.mlp.register_forward_hook(post(l)), layer.self_attn.q_proj.register_forward_hook(q(l))]
    return cos, attn, hooks


def replay(rule: FFNSkipLLM, cos: dict[int, list[float]], steps: int, layers: int) -> torch.Tensor:
    """The rule by hand, from the cosines the FFN calls produced: (steps, layers) bool skipped."""
    used = {l: 0 for l in range(layers)}
    skipped = torch.zeros(steps, layers, dtype=torch.bool)
    for s in range(steps):
        left = 0
        for l in range(layers):
            hot = rule.cold_first <= l < layers - rule.cold_last and s >= rule.warmup
            if hot and left != 0:
                skipped[s, l] = True
                left -= 1 if left > 0 else 0
                continue
            c = cos[l][used[l]]  # the FFN ran: its call is the next one recorded at this layer
            used[l] += 1
            if hot and c > rule.threshold:
                left = rule.span or -1
    assert all(used[l] == len(cos[l]) for l in range(layers))  # every recorded call was accounted for
    return skipped


@pytest.mark.parametrize("span", [0, 1])
def test_ffn_skip_follows_the_cosine_rule_and_skipped_blocks_do_no_ffn_work(span):
    model = ffn_model()
    rule = FFNSkipLLM(threshold=median_cosine(model, PROMPT), span=span, **RULE)
    cos, attn, hooks = record_ffn_calls(model)
    try:
        res = model.generate(PROMPT, max_new_tokens=14, ignore_eos=True, skip_policy=rule, weights="hf")
    finally:
        for h in hooks:
            h.remove()
    tr = res.trace
    n = int(tr.valid[0].sum())
    expected = replay(rule, cos, n, model.num_layers)
    assert torch.equal(~tr.executed[0, :n], expected)
    assert 0 < int(expected.sum()) < n * (model.num_layers - 2)  # the rule engaged, and not everywhere
    assert all(len(cos[l]) == int(tr.executed[0, :n, l].sum()) for l in range(model.num_layers))  # MLP calls
    assert all(attn[l] == n for l in range(model.num_layers))  # attention ran for every token at every layer
    assert tr.kv_written[0, :n].all() and tr.skip_granularity == "ffn"
    assert not expected[: rule.warmup].any() and not expected[:, 0].any() and not expected[:, -1].any()


def test_ffn_skip_through_the_fused_weights_calls_no_ffn_for_a_skipped_block():
    from fbs.engine.fused import decode_ops

    model = ffn_model()
    rule = FFNSkipLLM(threshold=median_cosine(model, PROMPT), **RULE)
    ops = decode_ops(model, "fp32")
    with recorded_fused_calls(ops) as seen:
        res = model.generate(PROMPT, max_new_tokens=14, ignore_eos=True, skip_policy=rule)
    tr = res.trace
    n = int(tr.valid[0].sum())
    decode = [(name, l) for name, l, t in seen if t == 1]
    for l in range(model.num_layers):
        ran = int(tr.executed[0, :n, l].sum())
        assert decode.count(("ffn", l)) + decode.count(("block", l)) == ran
        assert decode.count(("attention", l)) + decode.count(("block", l)) == n
    assert tr.skip_ratio > 0


def test_ffn_skip_parallel_form_equals_cached_decoding():
    model = ffn_model("qwen3")
    rule = FFNSkipLLM(threshold=median_cosine(model, PROMPT), span=2, **RULE)
    res = model.generate(PROMPTS, max_new_tokens=12, ignore_eos=True, output_scores=True, skip_policy=rule)
    assert res.trace.skip_ratio > 0
    for r, p in enumerate(PROMPTS):
        seq = torch.tensor([p + res.new_tokens[r]])[:, :-1]
        t0, n = len(p), int(res.trace.valid[r].sum())
        with torch.no_grad():
            out = model(seq, gate_mode="off", gate_from=t0 + rule.warmup, mixer=rule.mixer(model.num_layers))
        assert torch.equal(out.skips[0, t0:t0 + n].bool(), ~res.trace.executed[r, :n])
        assert (out.logits[0, t0 - 1:] - res.scores[r]).abs().max() < 1e-4


def test_ffn_skip_threshold_one_is_plain_greedy_and_policy_excludes_a_plan():
    model = ffn_model()
    res = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, skip_policy=FFNSkipLLM(threshold=1.0))
    ref = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, force_compute=True)
    assert res.new_tokens == ref.new_tokens and res.trace.skip_ratio == 0
    with pytest.raises(ValueError, match="skip_policy and skip_plan"):
        model.generate(PROMPT, max_new_tokens=2, skip_policy=FFNSkipLLM(),
                       skip_plan=torch.zeros(model.num_layers, dtype=torch.bool))
    fbs_layer = FlexiDepth.from_base(tiny_hf()).host  # whole-layer granularity
    with pytest.raises(ValueError, match="FFN-SkipLLM skips FFN blocks only"):
        fbs_layer.generate(PROMPT, max_new_tokens=2, skip_policy=FFNSkipLLM())


# ------------------------------------------------------------------------------------------------ FlexiDepth
def random_flexidepth(family: str = "llama", layers: int = 6, seed: int = 3, routed=(2, 3, 4, 5),
                      hf=None) -> FlexiDepth:
    """Routers and adapters with random weights and no bias, so about half the routed pairs skip."""
    hf = tiny_hf(family, layers) if hf is None else hf
    fd = FlexiDepth.from_base(hf, FlexiDepthConfig(layers=routed, router_init_bias=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fd.flexidepth_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for r in fd.routers.values():
            r.head.bias.zero_()
    return fd.eval()


@pytest.mark.parametrize("weights", ["hf", "fp32"])
def test_flexidepth_parallel_form_equals_cached_decoding(family, weights):
    fd = random_flexidepth(family)
    res = fd.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, output_scores=True, weights=weights)
    tr, routed = res.trace, list(fd.layer_ids)
    assert 0.1 < tr.skip_ratio < 0.6
    assert tr.kv_written[tr.valid].all()  # a skipped layer still wrote the token's K/V
    for r, p in enumerate(PROMPTS):
        seq = torch.tensor([p + res.new_tokens[r]])[:, :-1]
        t0, n = len(p), int(tr.valid[r].sum())
        with torch.no_grad():
            out = fd(seq)
        assert torch.equal(out.skips[0, t0:t0 + n], ~tr.executed[r, :n][:, routed])
        assert (out.logits[0, t0 - 1:] - res.scores[r]).abs().max() < 1e-4
        assert torch.allclose(tr.gate_p[r, :n][:, routed], 1 - out.gates[0, t0:t0 + n], atol=1e-5)
        assert not tr.executed[r, :n].logical_not()[:, [0, 1]].any()  # unrouted layers always ran


def test_flexidepth_skipped_layer_projects_kv_and_runs_only_the_adapter():
    fd = random_flexidepth()
    l = fd.layer_ids[0]
    layer, calls = fd.host.base.layers[l], {"q": 0, "k": 0, "mlp": 0, "adapter": 0}
    mods = (("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj), ("mlp", layer.mlp),
            ("adapter", fd.adapters[str(l)]))
    hooks = [m.register_forward_hook(lambda mod, a, o, key=key: calls.__setitem__(key, calls[key] + (o.shape[1] == 1)))
             for key, m in mods]
    try:
        res = fd.generate(PROMPT, max_new_tokens=16, ignore_eos=True, weights="hf")
    finally:
        for h in hooks:
            h.remove()
    n = int(res.trace.valid[0].sum())
    ran = int(res.trace.executed[0, :n, l].sum())
    assert 0 < ran < n
    assert calls == {"q": ran, "k": n, "mlp": ran, "adapter": n - ran}


def test_flexidepth_skip_loss_is_the_squared_layer_count():
    g = torch.tensor([[[0.9, 0.2], [0.5, 0.5], [1.0, 1.0]]])     # (B=1, T=3, n=2)
    routed = torch.tensor([[False, True, True]])
    out = type("Out", (), {"gates": g, "routed": routed})
    assert skip_loss(out).item() == pytest.approx((1.0 ** 2 + 2.0 ** 2) / 2)


def fixed_batch_trainer(fd: FlexiDepth, **kw) -> Trainer:
    block = torch.randint(0, VOCAB - 1, (1, 32), generator=torch.Generator().manual_seed(7))
    data = BlockData(block.repeat(4, 1), None, block.repeat(2, 1), None)  # every micro-batch is the same batch
    cfg = FlexiDepthTrainConfig(block_size=32, micro_batch_size=2, batch_tokens=128, lr=1e-2, warmup_frac=0.0,
                                min_lr_ratio=1.0, alpha=1e-2, max_steps=20, progress=False, **kw)
    return Trainer(cfg, data, fd)


def test_flexidepth_gradient_reaches_routers_and_adapters_only_and_the_loss_falls(one_thread):
    fd = random_flexidepth()
    trainer = fixed_batch_trainer(fd)
    base = {k: v.clone() for k, v in fd.host.state_dict().items()}
    ids = trainer.data.train_ids[:2]
    step_loss(fd, ids, trainer.cfg.alpha).total.backward()
    for name, p in fd.named_parameters():
        if name.startswith(("routers.", "adapters.")):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None and not p.requires_grad, name
    fd.zero_grad(set_to_none=True)
    logs = [trainer.train_step() for _ in range(20)]
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.3 and logs[-1]["lm"] < logs[0]["lm"] - 0.3  # measured: -0.54
    assert all(torch.equal(v, base[k]) for k, v in fd.host.state_dict().items())  # the backbone did not move
    assert set(trainer.params) == {n for n, _ in fd.named_parameters() if n.startswith(("routers.", "adapters."))}


def test_flexidepth_training_run_resumes_exports_and_loads(tmp_path, one_thread):
    fd = random_flexidepth()
    trainer = fixed_batch_trainer(fd)
    from fbs.train.flexidepth import train

    cfg = dataclasses.replace(trainer.cfg, out_dir=str(tmp_path / "run"), max_steps=3, save_every=2, eval_every=0)
    summary = train(cfg, data=trainer.data, model=fd)
    assert summary["steps"] == 3 and Path(summary["final"], "flexidepth.safetensors").is_file()
    assert {"ppl", "ppl_base", "skip_ratio"} <= set(summary["eval"])
    loaded = FlexiDepth.from_pretrained(summary["final"], base=fd.host.base.hf)
    for (k, v), (k2, v2) in zip(fd.flexidepth_state_dict().items(), loaded.flexidepth_state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    with pytest.raises(FlexiDepthError, match="other base weights"):
        FlexiDepth.from_pretrained(summary["final"], base=tiny_hf(seed=9))
    # a config without its base fingerprint is refused, unless the caller opts out
    cfg_file = Path(summary["final"], "flexidepth_config.json")
    raw = json.loads(cfg_file.read_text())
    raw["base_fingerprint"] = None
    cfg_file.write_text(json.dumps(raw))
    with pytest.raises(FlexiDepthError, match="records no base_fingerprint.*check_base=False"):
        FlexiDepth.from_pretrained(summary["final"], base=fd.host.base.hf)
    unchecked = FlexiDepth.from_pretrained(summary["final"], base=fd.host.base.hf, check_base=False)
    assert all(torch.equal(v, v2) for v, v2 in zip(fd.flexidepth_state_dict().values(),
                                                    unchecked.flexidepth_state_dict().values()))
    more = dataclasses.replace(cfg, max_steps=4)  # rerunning continues from the last checkpoint (step 3)
    again = train(more, data=trainer.data, model=random_flexidepth(seed=11))
    assert again["steps"] == 4


# ------------------------------------------------------------------------------------------------ bench, imports
def test_bench_runs_both_baselines_with_their_skip_shares(tmp_path):
    from fbs.bench.harness import BenchConfig
    from fbs.bench.runner import RunSpec, run

    class ByteTokenizer:
        all_special_ids: list[int] = []

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1 + b % 250 for b in text.encode()]}

    # 10 layers: FFN-SkipLLM's default cold regions (first 2, last 6) leave layers 2-3 hot; louder FFNs
    hf = loud_ffns(ffn_skip_model(tiny_hf(layers=10))).base.hf
    ckpt = random_flexidepth(hf=hf).save_pretrained(tmp_path / "fd")
    bench = BenchConfig(prompt_len=16, new_tokens=8, warmup=0, runs=1, num_prompts=2)
    spec = RunSpec(base="/no/such/tiny-model", systems=("hf-greedy", "fbs-full", "ffn-skipllm", "flexidepth"),
                   ffn_skip_thresholds=(1.0, -1.0), flexidepth=str(ckpt), machine_mb=8, matmul_n=128)
    rows = {r["system"]: r for r in run(spec, bench, model=hf, tok=ByteTokenizer(), fbs_model=host_model(hf))["results"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["fbs-full-compute"]["tflops_rel"] == 1.0 and rows["fbs-full-compute"]["token_match_pct"] == 100.0
    never, always = rows["ffn-skipllm-t1"], rows["ffn-skipllm-t-1"]
    assert never["method_ratio"] == 0 and never["token_match_pct"] == 100.0  # nothing skipped: plain greedy
    assert always["method_ratio_kind"] == "ffn_skip" and always["layer_skip_ratio"] == 0 and always["method_ratio"] > 0
    assert always["tflops_rel_exact"] < never["tflops_rel_exact"]
    flexi = rows["flexidepth-tau0.5"]
    assert flexi["family"] == "adaptive" and flexi["method_ratio_kind"] == "layer_skip" and flexi["method_ratio"] > 0
    assert flexi["tflops_rel"] == pytest.approx(1 - flexi["layer_skip_ratio"])
    missing = {r["system"]: r for r in run(dataclasses.replace(spec, systems=("flexidepth",), flexidepth=None), bench,
                                           model=hf, tok=ByteTokenizer())["results"]}
    assert missing["flexidepth"]["status"] == "unavailable" and "fbs train flexidepth" in missing["flexidepth"]["note"]


def test_baselines_import_only_the_core():
    from test_import_graph import PKG, imported_names, upward

    for path in sorted((PKG / "baselines").glob("*.py")):
        if path.name.startswith("train_"):
            continue  # the training recipe builds on fbs.train; only the CLI imports it
        module = "fbs.baselines" + ("" if path.name == "__init__.py" else f".{path.stem}")
        assert not upward(imported_names(path.read_text(), module, path.name == "__init__.py")), path.name
