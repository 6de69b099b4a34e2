"""The adaptive-depth baselines in ``fbs eval`` (fbs.eval.adaptive): the baseline sweep and task scoring against a
hand loop through the engine's cached decoding (prefill the prompt, feed every true token through ``decode_step``),
the bytes and MACs a skipped pair saves against the tiny model's parameter counts, and the commands."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_hf
from fbs.baselines import FFNSkipLLM, ffn_skip_model
from fbs.engine import start
from fbs.eval.adaptive import AdaptiveSystem, FFNSkipScorer, FlexiDepthScorer, run_baseline_sweep
from fbs.eval.sweep import HeldoutDoc, score
from test_baselines import PROMPT, RULE, loud_ffns, median_cosine, random_flexidepth
from test_eval_scoring import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

GATE_FROM = 6


def _docs(lens=(22, 22, 19, 22), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [HeldoutDoc(f"d{i}", "en" if i % 2 else "zh", torch.randint(1, 250, (n,), generator=g))
            for i, n in enumerate(lens)]


def ffn_scorer(layers: int = 8, rule: dict = RULE) -> FFNSkipScorer:
    host = loud_ffns(ffn_skip_model(tiny_hf(layers=layers)))
    # a threshold that skips about a fifth of the blocks, from other tokens than the scored ones (a scored cosine
    # equal to the threshold would be a near-tie that fp32 rounding decides)
    return FFNSkipScorer(host, FFNSkipLLM(threshold=median_cosine(host, PROMPT) - 0.02, **rule))


def cli_ffn_scorer() -> FFNSkipScorer:
    """What the commands build: the rule's default knobs (cold first 2 and last 6 layers, warm-up 4), so 12 layers."""
    return ffn_scorer(layers=12, rule={})


def flexi_scorer(route_prompt: bool = False) -> FlexiDepthScorer:
    return FlexiDepthScorer(random_flexidepth(), tau=0.5, route_prompt=route_prompt)


SCORERS = {"ffn-skipllm": ffn_scorer, "flexidepth": flexi_scorer,
           "flexidepth-routed": lambda: flexi_scorer(route_prompt=True)}


def decode_by_hand(scorer, prompt: list[int], fed: list[int]):
    """Cached decoding with the scorer's engine policy: prefill ``prompt``, feed ``fed`` one token at a time.
    Returns the next-token log-probabilities after the prompt and after each fed token, and per fed token the
    layers (or FFN blocks) it skipped."""
    dec = start(scorer.model, [prompt], None, None,
                 dict(max_new_tokens=len(fed) + 1, ignore_eos=True, skip_policy=scorer.policy()))
    with torch.inference_mode():
        logps = [torch.log_softmax(torch.stack(dec.prefill()).float(), -1)[0]]
        skipped = []
        for step, t in enumerate(fed):
            logps.append(torch.log_softmax(dec.decode_step(step, [t]).float(), -1)[0])
            skipped.append(sum(not ran for ran in dec.rec.executed[0][step]))
    return logps, skipped


@pytest.mark.parametrize("which", sorted(SCORERS))
def test_baseline_sweep_scores_what_cached_decoding_computes(which):
    scorer = SCORERS[which]()
    docs = _docs()
    s = score(scorer.model, docs, name=which, batch_size=3, gate_from=GATE_FROM, method=scorer, kind="tau")
    L = scorer.model.num_layers
    for d, nll, skipped, pairs in zip(docs, s.nll, s.skipped, s.pairs):
        ids = d.input_ids.tolist()
        # the block's decoded tokens: prompt = its first GATE_FROM, then ids[GATE_FROM .. T-2] fed back
        logps, skips = decode_by_hand(scorer, ids[:GATE_FROM], ids[GATE_FROM:-1])
        want = -sum(float(lp[t]) for lp, t in zip(logps, ids[GATE_FROM:])) / (len(ids) - GATE_FROM)
        assert nll == pytest.approx(want, abs=1e-4)
        assert skipped == sum(skips) and pairs == (len(ids) - 1 - GATE_FROM) * L
    assert 0.05 < s.skip_ratio < 0.6  # the method engaged, and not everywhere


@pytest.mark.parametrize("which", sorted(SCORERS))
def test_task_scoring_is_the_engine_decoding_the_continuation(which):
    scorer = SCORERS[which]()
    system = AdaptiveSystem(scorer, ByteTokenizer())
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(1, 250, (n,), generator=g).tolist(), torch.randint(1, 250, (k,), generator=g).tolist())
             for n, k in ((7, 9), (12, 8), (3, 1), (5, 10))]
    scores = system.score_tokens(pairs)
    engine_skipped = 0
    for (ctx, cont), sc in zip(pairs, scores):
        logps, skips = decode_by_hand(scorer, ctx, cont[:-1])
        assert sc.logprob == pytest.approx(sum(float(lp[t]) for lp, t in zip(logps, cont)), abs=1e-4)
        engine_skipped += sum(skips)
    cost = system.cost_counters()  # the decoded positions are the continuation tokens but the last
    assert cost["scored_pairs"] == (8 + 7 + 0 + 9) * scorer.model.num_layers
    assert cost["scored_skipped"] == engine_skipped > 0
    d = system.describe()
    assert d["kind"] == "adaptive" and d["method"] == scorer.method
    json.dumps(d)
    # generation runs the engine with the same policy
    new = system.generate_ids(torch.tensor([pairs[1][0]]), 6, stop=[], eos=[])
    ref = scorer.model.generate(torch.tensor([pairs[1][0]]), max_new_tokens=6, ignore_eos=True,
                                skip_policy=scorer.policy())
    assert new == ref.new_tokens[0] and system.cost_counters()["decoded_tokens"] > 0


def _numel(*mods) -> int:
    return sum(p.numel() for m in mods for p in m.parameters())


def _weights(*mods) -> int:
    return sum(m.weight.numel() for m in mods)


def test_ffn_skipllm_bytes_and_macs_are_the_ffn_parameters_by_hand():
    scorer = ffn_scorer()
    hf = scorer.model.base.hf
    layers, L = hf.model.layers, len(hf.model.layers)
    layer = _numel(layers[0])
    full = L * layer + _numel(hf.model.norm) + hf.lm_head.weight.numel()  # fp32: 4 bytes each, on both sides
    mlp, attn = _numel(layers[0].mlp), _numel(layers[0].self_attn)
    block = mlp + _numel(layers[0].post_attention_layernorm)  # a skipped FFN block reads neither its MLP nor its norm
    docs = _docs()
    res = run_baseline_sweep(scorer, docs, [scorer.value, 1.0], progress=False, gate_from=GATE_FROM)
    row = res["rows"][2]
    skipped = sum(res["per_document"][f"{row['system']}@{row['tau']}"]["skipped"])
    tokens = sum(len(d.input_ids) - 1 - GATE_FROM for d in docs)
    assert skipped > 0 and row["skip_ratio"] == skipped / (tokens * L)
    # each skipped block saves its FFN block's weights, nothing else: the parameter-count ratio
    assert row["bytes_rel"] == pytest.approx(1 - skipped * block / (tokens * full), rel=1e-9)
    assert row["tflops_rel"] == pytest.approx(1 - skipped * mlp / (tokens * L * (mlp + attn)), rel=1e-9)
    assert res["rows"][3]["skip_ratio"] == 0 and res["rows"][3]["bytes_rel"] == 1.0  # threshold 1: nothing skipped


def test_flexidepth_saving_keeps_kv_and_adapter_and_adds_the_routers_by_hand():
    scorer = flexi_scorer()
    fd, hf = scorer.fd, scorer.model.base.hf
    layers, L = hf.model.layers, len(hf.model.layers)
    lay = layers[0]
    full = L * _numel(lay) + _numel(hf.model.norm) + hf.lm_head.weight.numel()
    routed = list(fd.layer_ids)
    router, adapter = fd.routers[str(routed[0])], fd.adapters[str(routed[0])]
    kept = _numel(lay.self_attn.k_proj, lay.self_attn.v_proj, lay.input_layernorm) + _numel(adapter)
    dense = _weights(lay.self_attn.q_proj, lay.self_attn.k_proj, lay.self_attn.v_proj, lay.self_attn.o_proj,
                     lay.mlp.gate_proj, lay.mlp.up_proj, lay.mlp.down_proj)
    kept_macs = _weights(lay.self_attn.k_proj, lay.self_attn.v_proj) + _weights(adapter.gate, adapter.up, adapter.down)
    router_macs = _weights(router.down, router.up, router.head)
    docs = _docs()
    res = run_baseline_sweep(scorer, docs, [0.5], progress=False, gate_from=GATE_FROM)
    full_row, row = res["rows"][1], res["rows"][2]
    skipped = sum(res["per_document"][f"{row['system']}@{row['tau']}"]["skipped"])
    tokens = sum(len(d.input_ids) - 1 - GATE_FROM for d in docs)
    assert skipped > 0
    per_token_routers = len(routed) * _numel(router)
    assert row["bytes_rel"] == pytest.approx(
        1 - skipped * (_numel(lay) - kept) / (tokens * full) + per_token_routers / full, rel=1e-9)
    assert row["tflops_rel"] == pytest.approx(
        1 - skipped * (dense - kept_macs) / (tokens * L * dense) + len(routed) * router_macs / (L * dense), rel=1e-9)
    # nothing skipped: the routers still run (and scale the FFNs, so it is not the base model)
    assert full_row["kind"] == "full" and full_row["skip_ratio"] == 0
    assert full_row["bytes_rel"] == pytest.approx(1 + per_token_routers / full, rel=1e-9)
    assert full_row["ppl"] != res["rows"][0]["ppl"]


def test_baseline_sweep_rows_and_a_joint_pareto_plot(tmp_path):
    from conftest import fbs_tiny, randomize
    from fbs.eval.plots import pareto_plots
    from fbs.eval.sweep import run_sweep

    scorer = ffn_scorer()
    docs = _docs()
    res = run_baseline_sweep(scorer, docs, [1.0, scorer.value, -1.0], progress=False, gate_from=GATE_FROM)
    rows = res["rows"]
    assert [r["kind"] for r in rows] == ["base", "full", "tau", "tau", "tau"]
    assert [r["method"] for r in rows] == ["base"] + ["ffn-skipllm"] * 4
    assert rows[1]["ppl"] == rows[0]["ppl"] and rows[1]["skip_ratio"] == 0  # nothing skipped is the base model
    assert rows[2]["skip_ratio"] == 0 and rows[2]["ppl"] == pytest.approx(rows[0]["ppl"], rel=1e-5)
    assert 0 < rows[3]["skip_ratio"] < rows[4]["skip_ratio"]
    assert rows[3]["threshold"] == rows[3]["tau"] == scorer.value and rows[3]["knob"] == "threshold"
    assert res["skip_unit"] == "FFN blocks" and res["baseline"]["rule"]["warmup"] == RULE["warmup"]
    json.dumps(res)
    fbs = run_sweep(randomize(fbs_tiny(), gate_bias=0.0), fbs_tiny(), docs, taus=[0.5], progress=False,
                    gate_from=GATE_FROM)
    paths = pareto_plots([("FBS", {"texts": {"ood": fbs}}), ("FFN-SkipLLM", {"texts": {"ood": res}})],
                         tmp_path / "p", x="bytes")
    assert [p.name for p in paths] == ["p_ood_bytes.png"] and paths[0].stat().st_size > 1000


def test_flexidepth_routing_the_prompt_changes_the_score_and_is_recorded():
    docs = _docs()
    full, routed = flexi_scorer(), flexi_scorer(route_prompt=True)
    a = run_baseline_sweep(full, docs, [0.5], progress=False, gate_from=GATE_FROM)
    b = run_baseline_sweep(routed, docs, [0.5], progress=False, gate_from=GATE_FROM)
    assert a["rows"][2]["route_prompt"] is False and b["rows"][2]["route_prompt"] is True
    assert a["rows"][0]["ppl"] == b["rows"][0]["ppl"] and a["rows"][2]["ppl"] != b["rows"][2]["ppl"]


# ---------------------------------------------------------------------------- the commands
def _patch_base(monkeypatch, hf):
    import fbs.model.bases

    monkeypatch.setattr(fbs.model.bases, "load_base", lambda name: (hf, ByteTokenizer()))


def test_sweep_command_for_both_baselines(tmp_path, monkeypatch, capsys):
    from fbs.cli import main
    from fbs.eval import cli as eval_cli

    docs = _docs()
    monkeypatch.setattr(eval_cli, "_sweep_texts", lambda args, tok: {"ood": docs})
    scorer = cli_ffn_scorer()
    _patch_base(monkeypatch, scorer.model.base.hf)
    out = tmp_path / "ffn.json"
    common = ["--text", "ood", "--gate-from", str(GATE_FROM), "--no-progress", "--no-plot", "--threads", "1"]
    assert main(["eval", "sweep", "--baseline", "ffn-skipllm", "--ffn-skip-thresholds", f"1.0,{scorer.value!r}",
                 "--out", str(out), *common]) == 0
    res = json.loads(out.read_text())
    rows = res["texts"]["ood"]["rows"]
    assert res["baseline"] == "ffn-skipllm" and [r["kind"] for r in rows] == ["base", "full", "tau", "tau"]
    direct = run_baseline_sweep(scorer, docs, [1.0, scorer.value], progress=False, gate_from=GATE_FROM)["rows"]
    assert [r["ppl"] for r in rows] == pytest.approx([r["ppl"] for r in direct], rel=1e-9)
    assert rows[3]["skip_ratio"] == direct[3]["skip_ratio"] > 0 and res["rows"] == rows
    assert "threshold=" in out.with_suffix(".md").read_text() and "FFN blocks" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--ffn-skip-thresholds, not --taus"):
        main(["eval", "sweep", "--baseline", "ffn-skipllm", "--taus", "0.5", *common])
    with pytest.raises(SystemExit, match="--flexidepth goes with"):
        main(["eval", "sweep", "--flexidepth", "x", *common])
    with pytest.raises(SystemExit, match="--control"):
        main(["eval", "sweep", "--baseline", "ffn-skipllm", "--control", "x", *common])

    fd = random_flexidepth()
    ckpt = fd.save_pretrained(tmp_path / "fd")
    _patch_base(monkeypatch, fd.host.base.hf)
    out = tmp_path / "fd.json"
    assert main(["eval", "sweep", "--baseline", "flexidepth", "--flexidepth", str(ckpt), "--taus", "0.5,0.7",
                 "--flexidepth-prompt", "routed", "--out", str(out), *common]) == 0
    res = json.loads(out.read_text())
    rows = res["texts"]["ood"]["rows"]
    assert [(r["kind"], r["tau"]) for r in rows] == [("base", None), ("full", None), ("tau", 0.5), ("tau", 0.7)]
    assert all(r["route_prompt"] for r in rows[1:]) and res["baseline_config"]["checkpoint"] == str(ckpt)
    want = run_baseline_sweep(FlexiDepthScorer(fd, route_prompt=True), docs, [0.5], progress=False,
                              gate_from=GATE_FROM)["rows"][2]
    assert rows[2]["ppl"] == pytest.approx(want["ppl"], rel=1e-9) and rows[2]["skip_ratio"] == want["skip_ratio"]


def test_run_command_scores_tasks_with_a_baseline(tmp_path, monkeypatch):
    from fbs.cli import main
    from fbs.eval import tasks as T
    from fbs.eval.datasets import MCExample
    from fbs.eval.report import cost_summary, load_record

    items = [MCExample(f"toy/{i}", (f"item {i}: the quick brown",) * 2, (" fox jumps over", " cat sleeps in"),
                       gold=i % 2) for i in range(4)]
    monkeypatch.setitem(T.TASKS, "toy", T.TaskSpec("toy", "mc", lambda: items, "toy"))
    scorer = cli_ffn_scorer()
    _patch_base(monkeypatch, scorer.model.base.hf)
    out = tmp_path / "ffn.json"
    argv = ["eval", "run", "--tasks", "toy", "--no-progress", "--threads", "1"]
    assert main(argv + ["--system", "ffn-skipllm", "--ffn-skip-threshold", repr(scorer.value), "--out", str(out)]) == 0
    rec = load_record(out)
    assert rec["system"]["kind"] == "adaptive" and rec["system"]["threshold"] == scorer.value
    cost = rec["tasks"]["toy"].details["cost"]
    assert cost["scored_pairs"] > 0 and 0 < cost["scored_skipped"] < cost["scored_pairs"]
    assert cost_summary(rec)["scored_skip"] == cost["scored_skipped"] / cost["scored_pairs"]
    direct = T.run_multiple_choice(AdaptiveSystem(scorer, ByteTokenizer()), items, "toy", len(items))
    assert rec["tasks"]["toy"].per_example == direct.per_example  # the command scores as the system does
    with pytest.raises(SystemExit, match="--tau"):
        main(argv + ["--system", "ffn-skipllm", "--tau", "0.5", "--out", str(out)])
    with pytest.raises(SystemExit, match="--checkpoint"):
        main(argv + ["--system", "flexidepth", "--checkpoint", "x", "--out", str(out)])

    fd = random_flexidepth()
    ckpt = fd.save_pretrained(tmp_path / "fd")
    _patch_base(monkeypatch, fd.host.base.hf)
    for prompt in ("full", "routed"):
        out = tmp_path / f"fd_{prompt}.json"
        assert main(argv + ["--system", "flexidepth", "--flexidepth", str(ckpt), "--tau", "0.5",
                            "--flexidepth-prompt", prompt, "--out", str(out)]) == 0
        rec = load_record(out)
        assert rec["system"]["method"] == "flexidepth" and rec["system"]["tau"] == 0.5
        assert rec["system"]["route_prompt"] is (prompt == "routed")
        assert rec["tasks"]["toy"].details["cost"]["scored_skipped"] > 0


def test_bench_runs_flexidepth_at_several_taus(tmp_path):
    """`fbs bench --flexidepth-taus`: one flexidepth-tau<t> row per tau (the latency points of FlexiDepth's front)."""
    from fbs.bench.harness import BenchConfig
    from fbs.bench.runner import RunSpec, run

    class Tok:
        all_special_ids: list[int] = []

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1 + b % 250 for b in text.encode()]}

    fd = random_flexidepth()
    ckpt = fd.save_pretrained(tmp_path / "fd")
    bench = BenchConfig(prompt_len=16, new_tokens=8, warmup=0, runs=1, num_prompts=1)
    spec = RunSpec(base="/no/such/tiny-model", systems=("hf-greedy", "flexidepth"), flexidepth=str(ckpt),
                   flexidepth_taus=(0.3, 0.7), machine_mb=8, matmul_n=128)
    rows = {r["system"]: r for r in run(spec, bench, model=fd.host.base.hf, tok=Tok())["results"]}
    assert set(rows) == {"hf-greedy", "flexidepth-tau0.3", "flexidepth-tau0.7"}
    low, high = rows["flexidepth-tau0.3"], rows["flexidepth-tau0.7"]
    assert low["status"] == high["status"] == "ok" and low["params"]["route_prompt"] is True
    assert low["params"]["tau"] == 0.3 and low["method_ratio"] < high["method_ratio"]  # skip where g <= tau
