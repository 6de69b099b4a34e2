"""The ``fbs`` command line end to end through ``fbs.cli.main`` on a tiny model saved to disk (an HF directory
with a one-character-per-id tokenizer and chat template, and an FBS checkpoint over it): ``info``, ``generate``,
``serve``, ``bench``, ``bench serve``, ``data build / label / stats / chat``, ``probe``, ``eval make-tasks``,
``eval pareto``, ``eval segatron``, ``eval long-context``, ``train stage1 / stage2 / stage2-report / stage2-accept /
flexidepth / segatron / kangaroo / draft-search / draft-model / medusa / eagle``; ``info`` / ``generate`` on the real
SmolLM2 (slow). The other commands (``eval run / compare /
table / merge / sweep / group-b / chat / mechanism / ch / ch-table / safety / list``, ``analyze``,
``bench recompute``, ``train ablations``) run end to end in their own modules' tests.

Oracles: the in-memory model the files were written from, through the API (``model.generate`` on the prompt ids
built by hand from the chat template; full-depth output for lossless decoding), HF's own perplexity, and
hand-computed counts. With one character per token id, equal text means equal tokens.
"""

from __future__ import annotations

import io
import json
import sys
import types
import urllib.request
from pathlib import Path

import pytest
import torch

from fbs.cli import main
from fbs.engine.defaults import default_prefill
from fbs.engine.quant import FORMATS

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
from test_serve import char_tokenizer, tiny_model  # noqa: E402  (the served tiny model and its tokenizer)

PROMPT = "Where do rivers go?"
TEMPLATE = "<|user|>{}\n<|assistant|>"  # test_serve's chat template for one user message
NEW = 24


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama (random, with gates that skip) saved as an HF directory plus an FBS checkpoint; the model
    object itself is the oracle. One torch thread for the module (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("cli")
    model = tiny_model(positions=256)
    model.base.hf.save_pretrained(root / "base")
    model.tokenizer.save_pretrained(root / "base")
    model.save_pretrained(root / "ckpt")
    try:
        yield types.SimpleNamespace(model=model, base=str(root / "base"), ckpt=str(root / "ckpt"),
                                    args=["--model", str(root / "base"), "--checkpoint", str(root / "ckpt")])
    finally:
        torch.set_num_threads(threads)


def chat_ids(text: str = PROMPT) -> list[int]:
    return char_tokenizer()(TEMPLATE.format(text))["input_ids"]


def api_text(model, ids, **opts) -> tuple[object, str]:
    """The API's output with the CLI's default weight format, KV cache storage and prefill (``auto``) unless the
    options name them."""
    opts.setdefault("weights", "auto")
    opts.setdefault("kv_dtype", "auto")
    opts.setdefault("prefill", "auto")
    res = model.generate([ids], **opts)
    return res, model.tokenizer.decode(res.new_tokens[0], skip_special_tokens=True)


def run_cli(capsys, argv, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# --------------------------------------------------------------------------- fbs info
def test_info_json_counts_and_config(saved, capsys):
    code, out, _ = run_cli(capsys, ["info", *saved.args, "--json"])
    assert code == 0
    info = json.loads(out)
    m = saved.model
    base = sum(p.numel() for p in {p.data_ptr(): p for p in m.base.hf.parameters()}.values())  # tied: once
    paw, ch, sg = (sum(p.numel() for p in mod.parameters()) for mod in (m.paw, m.ch, m.gates))
    assert info["base"] == base and (info["added_paw"], info["added_ch"], info["added_sg"]) == (paw, ch, sg)
    assert info["added"] == paw + ch + sg and info["added_fraction"] == pytest.approx((paw + ch + sg) / base)
    cfg = info["config"]
    assert cfg["base_fingerprint"] == m.config.base_fingerprint and cfg["tau"] == m.config.tau
    assert cfg["paw_layers"] == [1] and cfg["ch_layers"] == [3] and cfg["k_max"] == 6
    from fbs.engine.defaults import default_kv_dtype, default_weights

    assert info["default_weights"] == default_weights(info["native_kernels"])
    assert info["default_kv_dtype"] == default_kv_dtype(info["default_weights"])

    code, out, _ = run_cli(capsys, ["info", *saved.args, "--tau", "0.25", "--kv-policy", "hole"])
    assert code == 0
    rows = dict(line.split("  ", 1) for line in out.splitlines())
    assert rows["PAW layers"].strip() == "(1,)" and rows["CH layers"].strip() == "(3,)"
    assert rows["tau / KV policy"].strip() == "0.25 / hole" and rows["base parameters"].strip() == f"{base:,}"


def test_missing_checkpoint_is_a_clear_error(saved, capsys, tmp_path):
    code, out, err = run_cli(capsys, ["info", "--model", saved.base, "--checkpoint", str(tmp_path / "none")])
    assert code == 2 and out == ""
    assert f"checkpoint {tmp_path / 'none'} does not exist: pass the directory that save_pretrained" in err
    (tmp_path / "empty").mkdir()  # a directory that is not a checkpoint
    code, out, err = run_cli(capsys, ["info", "--model", saved.base, "--checkpoint", str(tmp_path / "empty")])
    assert code == 2 and "is not an FBS checkpoint: expected fbs_config.json and fbs_model.safetensors" in err


# --------------------------------------------------------------------------- fbs generate
def test_generate_from_stdin_json_and_trace_equal_the_api(saved, capsys, monkeypatch):
    ref, text = api_text(saved.model, chat_ids(), max_new_tokens=NEW)
    code, out, _ = run_cli(capsys, ["generate", *saved.args, "--max-new-tokens", str(NEW), "--json", "--trace"],
                           stdin=PROMPT, monkeypatch=monkeypatch)
    assert code == 0
    doc = json.loads(out)
    assert doc["text"] == text and doc["new_tokens"] == len(ref.new_tokens[0])
    assert 0 < doc["skip_ratio"] == pytest.approx(ref.trace.skip_ratio)
    assert doc["tflops_rel"] == pytest.approx(ref.trace.tflops_rel) and doc["tflops_rel"] < 1
    assert doc["tau"] == saved.model.config.tau and doc["kv_policy"] == saved.model.config.kv_policy
    want = ref.trace.to_dict()
    for key in ("executed", "intended_skip", "window_k", "chunk_boundary", "context_len"):
        assert doc["trace"][key] == want[key], key
    torch.testing.assert_close(torch.tensor(doc["trace"]["gate_p"]), torch.tensor(want["gate_p"]))
    code, out, _ = run_cli(capsys, ["generate", *saved.args, "--max-new-tokens", str(NEW), "--json"],
                           stdin=PROMPT, monkeypatch=monkeypatch)
    assert "trace" not in json.loads(out)  # --trace adds it


def test_generate_options_reach_the_engine(saved, capsys):
    """The prompt as an argument, raw text (no chat template), tau / KV policy / force-compute / never-skip,
    seeded sampling (temperature, top-k, top-p), min-new-tokens, structure protection and a validator."""
    raw = char_tokenizer()(PROMPT)["input_ids"]
    tok = saved.model.tokenizer
    cases = [(["--no-chat-template", "--tau", "0.3", "--kv-policy", "hole"], raw, dict(tau=0.3, kv_policy="hole")),
             (["--force-compute"], chat_ids(), dict(force_compute=True)),
             (["--do-sample", "--seed", "3", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9",
               "--min-new-tokens", "5"], chat_ids(),
              dict(do_sample=True, seed=3, temperature=0.7, top_k=20, top_p=0.9, min_new_tokens=5)),
             (["--protect-structure"], chat_ids(), dict(protect_structure=True, tokenizer=tok)),
             (["--validator", "json"], chat_ids(), dict(validator="json", tokenizer=tok)),
             (["--never-skip", "2", "--never-skip", "3"], chat_ids(), dict(never_skip=(2, 3)))]
    for argv, ids, opts in cases:
        ref, text = api_text(saved.model, ids, max_new_tokens=NEW, **opts)
        code, out, _ = run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json", *argv])
        doc = json.loads(out)
        assert code == 0 and doc["text"] == text, argv
        assert doc["skip_ratio"] == pytest.approx(ref.trace.skip_ratio), argv
        assert doc["fallback"] == ref.trace.fallback[0], argv
    assert doc["fallback"] is False and json.loads(run_cli(capsys, [
        "generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json", "--validator", "json"])[1])["fallback"]
    assert doc["skip_ratio"] < json.loads(run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens",
                                                           str(NEW), "--json"])[1])["skip_ratio"]


@pytest.mark.parametrize("kv, budget", [("streaming", 12), ("h2o", 12), ("snapkv", 36)])
def test_generate_kv_cache_flags_equal_the_api(saved, capsys, kv, budget):
    """``--kv-cache`` / ``--kv-budget``: the API's tokens under the same policy (the chat prompt is longer than the
    budget: entries are evicted), the policy in the JSON summary; a policy without a budget is a clear error."""
    ids = chat_ids("Where do all the rivers of the world go in the end?")
    assert len(ids) > budget
    ref, text = api_text(saved.model, ids, max_new_tokens=NEW, kv_cache=kv, kv_budget=budget)
    code, out, _ = run_cli(capsys, ["generate", "Where do all the rivers of the world go in the end?", *saved.args,
                                    "--max-new-tokens", str(NEW), "--json", "--kv-cache", kv, "--kv-budget",
                                    str(budget)])
    doc = json.loads(out)
    assert code == 0 and doc["text"] == text and (doc["kv_cache"], doc["kv_budget"]) == (kv, budget)
    assert doc["skip_ratio"] == pytest.approx(ref.trace.skip_ratio)
    code, _, err = run_cli(capsys, ["generate", PROMPT, *saved.args, "--kv-cache", kv])
    assert code == 2 and "needs kv_budget" in err


def test_eval_run_kv_cache_flags_reach_generation(saved):
    """``fbs eval run --system fbs --kv-cache h2o --kv-budget 10``: generation tasks decode under the policy (the
    system generates what the API does); other systems refuse the flag."""
    from fbs.cli import build_parser
    from fbs.eval.cli import build_system

    argv = ["eval", "run", "--system", "fbs", *saved.args, "--kv-cache", "h2o", "--kv-budget", "10"]
    system = build_system(build_parser().parse_args(argv))
    assert system.generate_kwargs == {"kv_cache": "h2o", "kv_budget": 10} and "kv-cache=h2o:10" in system.name
    ids = chat_ids()
    got = system.generate_ids(torch.tensor([ids]), NEW, stop=())
    ref = saved.model.generate([ids], max_new_tokens=NEW, kv_cache="h2o", kv_budget=10,
                               eos_token_id=system.eos_ids(), pad_token_id=system.pad_id).new_tokens[0]
    assert got == [t for t in ref if t not in system.eos_ids()][:len(got)] and len(got) > 0
    with pytest.raises(ValueError, match="--system fbs"):
        build_system(build_parser().parse_args(["eval", "run", "--system", "base", "--model", saved.base,
                                                "--kv-cache", "h2o", "--kv-budget", "10"]))


def test_generate_stop_string_ends_at_the_string(saved, capsys):
    """``--stop``: generation ends with the token that completes the stop string; oracle: the output without
    stop strings, cut by hand after the string's first occurrence."""
    _, full = api_text(saved.model, chat_ids(), max_new_tokens=NEW, ignore_eos=True)
    stop = full[9:11]
    want = full[:full.find(stop) + len(stop)]
    assert len(want) < len(full)
    code, out, _ = run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json",
                                    "--stop", stop, "--stop", "never-there"])
    doc = json.loads(out)
    assert code == 0 and doc["text"] == want and doc["new_tokens"] == len(want)


def test_engine_stop_strings_stop_at_the_string(saved):
    """``stop_strings`` in the engine: the tokens are the greedy ones up to the token that completes the first
    stop string to occur, for each row of a batch, a stop string longer than 16 tokens included; without a
    tokenizer it is refused."""
    model, tok = saved.model, saved.model.tokenizer
    prompts = [chat_ids(), chat_ids("Name a colour."), chat_ids("Count to ten")]
    full = model.generate(prompts, max_new_tokens=40, ignore_eos=True)
    texts = [tok.decode(t) for t in full.new_tokens]
    stops = [texts[0][20:23], texts[1][5:7], texts[2][4:28]]
    res = model.generate(prompts, max_new_tokens=40, ignore_eos=True, stop_strings=stops, tokenizer=tok)
    for r, text in enumerate(texts):
        ends = [text.find(s) + len(s) for s in stops if s in text]
        cut = min(ends) if ends else len(text)
        assert res.new_tokens[r] == full.new_tokens[r][:cut], r
    assert len(res.new_tokens[1]) < 40 and len(res.new_tokens[2]) == 28  # the cases stop early, row 2 at 28 tokens
    bare = type(model).from_base(model.base.hf, config=model.config)
    with pytest.raises(ValueError, match=r"stop_strings need a tokenizer \(pass tokenizer=\)"):
        bare.generate(prompts, max_new_tokens=4, stop_strings=stops)


def test_generate_stream_prints_the_non_streamed_text(saved, capsys):
    argv = ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW)]
    code, plain, _ = run_cli(capsys, argv)
    assert code == 0
    code, streamed, _ = run_cli(capsys, argv + ["--stream"])
    assert code == 0
    ref, want = api_text(saved.model, chat_ids(), max_new_tokens=NEW)
    text, summary = plain.rsplit("\n[", 1)
    assert text == want and summary.startswith(f"{len(ref.new_tokens[0])} tokens | decode")
    text, summary = streamed.rsplit("\n[", 1)
    assert text == want and summary.startswith(f"{len(ref.new_tokens[0])} tokens in ")


@pytest.mark.parametrize("weights", ("hf",) + FORMATS)
def test_generate_weights_equal_the_api(saved, capsys, weights):
    if weights == "fp32-onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("needs torch built with oneDNN")
    from fbs.engine.defaults import default_kv_dtype, default_prefill

    # the CLI's auto KV cache and prefill, as the API names them
    auto = {} if weights == "hf" else dict(kv_dtype=default_kv_dtype(weights), prefill=default_prefill(weights))
    ref, text = api_text(saved.model, chat_ids(), max_new_tokens=NEW, weights=weights, **auto)
    code, out, _ = run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json",
                                    "--weights", weights])
    doc = json.loads(out)
    assert code == 0 and doc["text"] == text and doc["new_tokens"] == len(ref.new_tokens[0])
    assert doc["skip_ratio"] == pytest.approx(ref.trace.skip_ratio)


def test_generate_rejects_an_empty_prompt(saved, capsys, monkeypatch):
    code, out, err = run_cli(capsys, ["generate", *saved.args], stdin="  \n", monkeypatch=monkeypatch)
    assert code == 2 and out == "" and "empty prompt (pass it as an argument or on stdin)" in err


# --------------------------------------------------------------------------- fbs serve
def test_serve_wires_its_options_into_the_app(saved, capsys, monkeypatch):
    """``fbs serve`` with every option: the app it would run (captured instead of binding the port) serves under
    the given name with the given limits, defaults and model settings; the output of a request equals the API's
    with those settings."""
    import openai

    import fbs.serve.app
    from fbs.serve.app import ServerThread

    captured = {}
    monkeypatch.setattr(fbs.serve.app, "run", lambda app, host, port, log_level, scheduler=None: captured.update(
        app=app, host=host, port=port, log_level=log_level, scheduler=scheduler))
    threads = torch.get_num_threads()
    try:
        code, out, _ = run_cli(capsys, [
            "serve", *saved.args, "--served-model-name", "tiny", "--max-concurrent", "2", "--max-queue", "5",
            "--timeout", "90", "--max-tokens", "40", "--context-length", "100", "--batch-policy", "majority",
            "--weights", "int8", "--threads", "2", "--tau", "0.4", "--kv-policy", "hole", "--host", "127.0.0.2",
            "--port", "8123", "--log-level", "warning"])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    assert out.strip() == ("fbs serve: tiny (tau 0.4, kv hole, batch policy majority, weights int8, KV cache int8, "
                           f"prefill {default_prefill('int8')}, 2 slots, "
                           "context 100 tokens) at http://127.0.0.2:8123/v1")
    assert (captured["host"], captured["port"], captured["log_level"]) == ("127.0.0.2", 8123, "warning")
    assert captured["scheduler"] is captured["app"].state.scheduler  # the engine runs in serve's main thread
    with ServerThread(captured["app"]) as srv:
        with urllib.request.urlopen(srv.url + "/models", timeout=30) as r:
            assert json.loads(r.read())["data"] == [{"id": "tiny", "object": "model", "created": 0,
                                                     "owned_by": "fbs", "max_model_len": 100}]
        with urllib.request.urlopen(srv.url + "/fbs/status", timeout=30) as r:
            status = json.loads(r.read())
        assert status["slots"]["max"] == 2 and status["queue"]["max"] == 5
        cl = openai.OpenAI(base_url=srv.url, api_key="-", max_retries=0, timeout=120)
        ids = chat_ids()
        got = cl.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError, match="this server allows at most 40"):
            cl.completions.create(model="tiny", prompt=ids, max_tokens=41)
    ref, text = api_text(saved.model, ids, max_new_tokens=20, ignore_eos=True, tau=0.4, kv_policy="hole",
                         weights="int8", batch_policy="majority")  # kv_dtype auto: int8
    assert got.choices[0].text == text
    fbs_usage = got.usage.model_extra["fbs"]
    assert fbs_usage["tau"] == 0.4 and fbs_usage["kv_policy"] == "hole" and fbs_usage["kv_dtype"] == "int8"
    assert fbs_usage["skip_ratio"] == pytest.approx(ref.trace.skip_ratio)


# --------------------------------------------------------------------------- fbs bench, fbs bench serve
def test_bench_quick_writes_its_table_and_json(saved, capsys, monkeypatch, tmp_path):
    """The smallest benchmark (HF greedy, FBS full depth and at one tau; 8-token prompts, 4 new tokens, --quick):
    bench.json and bench.md are written and printed; each FBS row's token and exact match against HF greedy are
    those of the API's outputs on the benchmark's prompts (the checkpoint's PAW and CH change the full-depth
    model, so they are not 100 %). The machine's peak measurements (a 256 MB stream and a 2048^2 matmul) are
    replaced by fixed numbers: they are not what this test checks and would load the shared machine."""
    import fbs.bench.runner
    from fbs.bench.harness import build_prompts, match_rates
    from fbs.bench.roofline import MachinePeaks

    monkeypatch.setattr(fbs.bench.runner, "measure_machine",
                        lambda *a, **k: MachinePeaks(read_gbs=10.0, copy_gbs=10.0, gemv_gbs=10.0,
                                                     matmul_gflops=100.0, threads=1))
    out_dir = tmp_path / "bench"
    code, out, _ = run_cli(capsys, ["bench", *saved.args, "--systems", "hf-greedy,fbs-full,fbs-tau", "--taus", "0.4",
                                    "--prompt-len", "8", "--new-tokens", "4", "--num-prompts", "2", "--quick",
                                    "--out-dir", str(out_dir)])
    assert code == 0
    doc = json.loads((out_dir / "bench.json").read_text())
    rows = {r["system"]: r for r in doc["results"]}
    assert {"hf-greedy", "fbs-full-compute", "fbs-tau0.4"} <= set(rows), sorted(rows)
    assert all(r["status"] == "ok" for r in rows.values())
    m = saved.model
    prompts = build_prompts(m.tokenizer, 2, 8)
    greedy = torch.cat([m.base.hf.generate(p[None], attention_mask=torch.ones(1, 8, dtype=torch.long), max_new_tokens=4,
                                           min_new_tokens=4, do_sample=False, pad_token_id=0)[:, 8:] for p in prompts])
    for name, opts in (("fbs-full-compute", dict(force_compute=True)), ("fbs-tau0.4", dict(tau=0.4))):
        api = torch.tensor(m.generate(prompts, max_new_tokens=4, ignore_eos=True, **opts).new_tokens)
        assert (rows[name]["token_match_pct"], rows[name]["exact_match_pct"]) == match_rates(api, greedy), name
    assert rows["hf-greedy"]["exact_match_pct"] == 100.0 and rows["fbs-tau0.4"]["layer_skip_ratio"] > 0
    assert doc["protocol"]["warmup"] == 1 and doc["protocol"]["runs"] == 3
    assert doc["protocol"]["prompt_len"] == 8 and doc["protocol"]["new_tokens"] == 4
    assert len(rows["hf-greedy"]["latency_ms"]["total"]["runs"]) == 3
    table = (out_dir / "bench.md").read_text()
    assert table in out and all(name in table for name in rows)
    assert f"json: {out_dir / 'bench.json'}" in out


def test_bench_kv_cache_rows_equal_the_api(saved, capsys, monkeypatch, tmp_path):
    """``fbs bench --kv-cache full,streaming --kv-budget 6``: each FBS system once per policy (8-token prompts, so
    the policy evicts); each row's token and exact match against HF greedy are those of the API's outputs under its
    policy; a policy without a budget is refused."""
    import fbs.bench.runner
    from fbs.bench.harness import build_prompts, match_rates
    from fbs.bench.roofline import MachinePeaks

    monkeypatch.setattr(fbs.bench.runner, "measure_machine",
                        lambda *a, **k: MachinePeaks(read_gbs=10.0, copy_gbs=10.0, gemv_gbs=10.0,
                                                     matmul_gflops=100.0, threads=1))
    out_dir = tmp_path / "bench"
    code, _, _ = run_cli(capsys, ["bench", *saved.args, "--systems", "hf-greedy,fbs-full", "--kv-cache",
                                  "full,streaming", "--kv-budget", "6", "--prompt-len", "8", "--new-tokens", "6",
                                  "--num-prompts", "2", "--quick", "--out-dir", str(out_dir)])
    assert code == 0
    rows = {r["system"]: r for r in json.loads((out_dir / "bench.json").read_text())["results"]}
    assert set(rows) == {"hf-greedy", "fbs-full-compute", "fbs-full-compute-streaming6"}
    assert rows["fbs-full-compute-streaming6"]["params"]["kv_cache"] == "streaming"
    m = saved.model
    prompts = build_prompts(m.tokenizer, 2, 8)
    greedy = torch.cat([m.base.hf.generate(p[None], attention_mask=torch.ones(1, 8, dtype=torch.long), max_new_tokens=6,
                                           min_new_tokens=6, do_sample=False, pad_token_id=0)[:, 8:] for p in prompts])
    for name, opts in (("fbs-full-compute", {}), ("fbs-full-compute-streaming6", dict(kv_cache="streaming",
                                                                                        kv_budget=6))):
        api = torch.tensor(m.generate(prompts, max_new_tokens=6, ignore_eos=True, force_compute=True,
                                      **opts).new_tokens)
        assert (rows[name]["token_match_pct"], rows[name]["exact_match_pct"]) == match_rates(api, greedy), name
    code, _, err = run_cli(capsys, ["bench", *saved.args, "--systems", "fbs-full", "--kv-cache", "h2o",
                                    "--out-dir", str(tmp_path / "x")])
    assert code == 2 and "kv_budget" in err


def test_bench_serve_against_a_running_server(saved, capsys, tmp_path):
    """``fbs bench serve --url``: every request of every cell is answered in full; serve.json and serve.md are
    written; the server's counters agree with the cells."""
    from fbs.serve.app import ServerThread, create_app
    from fbs.serve.batcher import Limits

    app = create_app(saved.model, saved.model.tokenizer, "tiny", Limits(max_concurrent=2, context_length=64))
    out_dir = tmp_path / "load"
    with ServerThread(app) as srv:
        code, out, _ = run_cli(capsys, ["bench", "serve", "--url", srv.url, "--model", saved.base, "--clients", "1,2",
                                        "--modes", "skip,full", "--requests", "3", "--max-tokens", "5",
                                        "--prompt-len", "8", "--num-prompts", "2", "--warmup", "0",
                                        "--out-dir", str(out_dir)])
    assert code == 0
    doc = json.loads((out_dir / "serve.json").read_text())
    assert doc["model"] == "tiny" and doc["errors"] == 0 and not doc["server_started"]
    assert [(c["mode"], c["clients"]) for c in doc["cells"]] == [("skip", 1), ("skip", 2), ("full", 1), ("full", 2)]
    assert all(c["requests"] == 3 and c["tokens"] == 15 for c in doc["cells"])
    assert doc["server_status"]["counts"]["completed"] == 12
    assert doc["server_status"]["counts"]["generated_tokens"] == 60
    assert (out_dir / "serve.md").read_text().strip().endswith(out.split("json: ")[0].strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_serve_starts_its_own_server(saved, capsys, tmp_path):
    """Without ``--url``, ``fbs bench serve`` starts ``fbs serve`` as a subprocess with its options, loads it and
    stops it; every request is answered in full."""
    out_dir = tmp_path / "load"
    code, _, err = run_cli(capsys, ["bench", "serve", *saved.args, "--threads", "1", "--clients", "1,2", "--modes",
                                    "skip", "--requests", "2", "--max-tokens", "3", "--prompt-len", "8",
                                    "--num-prompts", "2", "--warmup", "0", "--out-dir", str(out_dir)])
    assert code == 0, err
    doc = json.loads((out_dir / "serve.json").read_text())
    assert doc["server_started"] and doc["errors"] == 0 and doc["model"] == "base"
    assert doc["server_args"][:4] == ["--model", saved.base, "--max-concurrent", "2"]
    assert "--checkpoint" in doc["server_args"] and saved.ckpt in doc["server_args"]
    assert [c["tokens"] for c in doc["cells"]] == [6, 6] and doc["server_status"]["counts"]["completed"] == 4


def test_bench_serve_refuses_a_remote_url(capsys):
    code, _, err = run_cli(capsys, ["bench", "serve", "--url", "http://10.1.2.3:8000/v1"])
    assert code == 2 and "only targets loopback addresses" in err


# --------------------------------------------------------------------------- the real SmolLM2
@pytest.mark.slow
def test_smollm2_info_and_generate_equal_the_api(capsys, monkeypatch):
    """The bundled model with its default FBS (fresh modules: the base): ``info --json`` and ``generate`` (chat template from stdin,
    --json, --stream) equal the API's ``load_fbs`` model."""
    from fbs.model.loading import load_fbs

    model = load_fbs("smollm2-135m").eval()
    code, out, _ = run_cli(capsys, ["info", "--json"])
    info = json.loads(out)
    assert code == 0 and info["base"] == 134_515_008 and info["config"]["tau"] == model.config.tau
    assert info["added"] == model.param_counts()["added"]
    tok = model.tokenizer
    text = "Name three primary colours."
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False)
    ref = model.generate([list(ids)], max_new_tokens=20, tokenizer=tok, weights="auto")
    want = tok.decode(ref.new_tokens[0], skip_special_tokens=True)
    code, out, _ = run_cli(capsys, ["generate", "--max-new-tokens", "20", "--json"], stdin=text,
                           monkeypatch=monkeypatch)
    doc = json.loads(out)
    assert code == 0 and doc["text"] == want and doc["new_tokens"] == len(ref.new_tokens[0])
    # the default is a fresh FBS (no shipped weights pass the operating-point rule): the base, nothing skipped
    assert doc["skip_ratio"] == ref.trace.skip_ratio == 0
    code, out, _ = run_cli(capsys, ["generate", text, "--max-new-tokens", "20", "--stream"])
    assert code == 0 and out.rsplit("\n[", 1)[0] == want


# --------------------------------------------------------------------------- fbs data, fbs train (drafts), lossless
def test_data_build_writes_the_corpus(saved, capsys, tmp_path):
    """``data build`` of the offline standard-library source: the options reach the manifest, every record's
    token count is its character count (one character per token), and the splits hold what was kept."""
    out = tmp_path / "corpus"
    code, text, _ = run_cli(capsys, ["data", "build", "--out", str(out), "--tokenizer", saved.base, "--sources",
                                     "py_stdlib", "--max-docs-per-source", "6", "--min-tokens", "50",
                                     "--val-fraction", "0.3", "--test-fraction", "0.2"])
    assert code == 0 and f"corpus written to {out}" in text
    manifest = json.loads((out / "manifest.json").read_text())
    st = manifest["sources"]["py_stdlib"]
    assert manifest["tokenizer"] == saved.base and st["documents_read"] == 6
    assert (manifest["config"]["min_tokens"], manifest["config"]["val_fraction"]) == (50, 0.3)
    assert st["kept"] + st["too_short"] + st["exact_duplicates"] + st["near_duplicates"] == 6
    records = [json.loads(line) for s in ("train", "validation", "test")
               for line in (out / f"{s}.jsonl").read_text().splitlines()]
    assert len(records) == st["kept"] > 0 and all(r["n_tokens"] == len(r["text"]) >= 50 for r in records)
    assert sum(r["n_tokens"] for r in records) == st["tokens_kept"]
    assert f"{'py_stdlib':<15}{6:>8}" in text


ZH = ["他做事一丝不苟，我们工作认真。" * 5, "我们坚持解放思想，实事求是。" * 5, "今天天气很好，我们去公园散步。" * 5]


@pytest.fixture(scope="module")
def zh_corpus(saved, tmp_path_factory):
    """A corpus of three Chinese documents and an English one (built in-process), labelled by ``fbs data label``
    (pkuseg, no idiom lexicon); returns its directory and the command's JSON report."""
    import contextlib

    pytest.importorskip("datasketch")
    pytest.importorskip("pkuseg")
    from fbs.data.corpus import CorpusConfig, build_corpus
    from fbs.data.sources import Document

    path = tmp_path_factory.mktemp("zh")
    docs = [Document("zh", f"z{i}", "zh", t) for i, t in enumerate(ZH)] + [Document("en", "e", "en", "plain text " * 9)]
    build_corpus(path, char_tokenizer(), "char", CorpusConfig(min_tokens=20, val_fraction=0, test_fraction=0),
                 documents=docs)
    stats = ["data", "stats", "--corpus", str(path), "--tokenizer", saved.base, "--splits", "train"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        refused = main(stats)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["data", "label", "--corpus", str(path), "--tokenizer", saved.base, "--no-idioms", "--splits", "train"])
    assert code == 0
    return types.SimpleNamespace(path=path, report=json.loads(out.getvalue()), refused=(refused, err.getvalue()))


def test_data_label_and_stats_of_a_chinese_corpus(saved, zh_corpus, capsys, tmp_path):
    """``data label`` then ``data stats``: the statistics count the Chinese documents' characters, and their
    B/I/O shares are those of the chunk spans the label command wrote (a span of n characters is one B and
    n - 1 I, the rest O); before labelling, the corpus is refused with the fix."""
    path = zh_corpus.path
    code, err = zh_corpus.refused
    assert code == 2 and f"has no labels: run `fbs data label --corpus {path}`" in err
    assert zh_corpus.report["splits"]["train"]["documents"] == 3
    code, _, _ = run_cli(capsys, ["data", "stats", "--corpus", str(path), "--tokenizer", saved.base, "--splits",
                                  "train", "--block-size", "32", "--out", str(tmp_path / "stats.json")])
    assert code == 0
    got = json.loads((tmp_path / "stats.json").read_text())["splits"]["train"]
    spans = [c for line in (path / "train.bios.jsonl").read_text().splitlines() for c in json.loads(line)["chunks"]]
    n = sum(map(len, ZH))
    assert got["tokens"] == n and got["coverage_q"] == 1.0 and spans
    b = sum(1 for s, e, _ in spans if e - s > 1)
    i = sum(e - s - 1 for s, e, _ in spans)
    single = sum(1 for s, e, _ in spans if e - s == 1)
    share = got["label_share"]
    assert share == pytest.approx({"B": b / n, "I": i / n, "S": single / n, "O": (n - b - i - single) / n})
    assert got["per_block"]["block_size"] == 32 and got["per_block"]["blocks"] == n // 32


def test_probe_on_the_labelled_corpus(saved, zh_corpus, capsys, tmp_path):
    """``fbs probe`` of the saved base on the labelled corpus: the options reach the record (default layer: half
    the decoder's depth; sequence counts and lengths), and the F1 scores are scores."""
    out = tmp_path / "probe.json"
    code, text, _ = run_cli(capsys, ["probe", "--model", saved.base, "--corpus", str(zh_corpus.path), "--train-split",
                                     "train", "--eval-split", "train", "--seq-len", "16", "--train-seqs", "6",
                                     "--eval-seqs", "4", "--idiom-items", "0", "--epochs", "1", "--batch-size", "4",
                                     "--threads", "1", "--out", str(out)])
    assert code == 0 and text.startswith("layer 3: BIOS-F1 ")
    rec = json.loads(out.read_text())
    assert rec["layer"] == 3 and rec["seq_len"] == 16 and rec["model"] == saved.base
    assert (rec["n_train_sequences"], rec["n_eval_sequences"]) == (6, 4)
    assert 80 < rec["n_train_tokens"] <= 6 * 16  # the labelled tokens of six 16-token blocks (separators are not)
    assert 0 <= rec["bios"]["bios_f1"] <= 1 and set(rec["bios"]["per_class_f1"]) <= set("BIOS")


def test_data_chat_splits_the_items(capsys, tmp_path):
    from fbs.data import chat

    code, out, _ = run_cli(capsys, ["data", "chat", "--out", str(tmp_path), "--answers", "0", "--langs", "en"])
    assert code == 0
    read = lambda name: [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    train, held = read("train.jsonl"), read("heldout.jsonl")
    ids = lambda rows: {r["id"] for r in rows}  # noqa: E731
    assert ids(train) | ids(held) == {it.id for it in chat.load_items(["en"])} and not ids(train) & ids(held)
    assert f"{len(train)} training items (0 with the base model's answer), {len(held)} held-out prompts" in out


def test_lossless_generate_equals_full_depth(saved, capsys, tmp_path):
    """``--lossless``, ``--draft-layers`` and ``--kangaroo`` (an adapter trained by ``train kangaroo`` on a corpus
    from ``data build``): the text is the full-depth model's (``force_compute``), whatever drafts it."""
    ref, text = api_text(saved.model, chat_ids(), max_new_tokens=NEW, force_compute=True)
    gated = api_text(saved.model, chat_ids(), max_new_tokens=NEW)[1]
    assert gated != text  # the skipping model alone writes something else: the verifier is needed
    corpus, adapter = tmp_path / "corpus", tmp_path / "kangaroo"
    assert run_cli(capsys, ["data", "build", "--out", str(corpus), "--tokenizer", saved.base, "--sources", "py_stdlib",
                            "--max-docs-per-source", "6", "--val-fraction", "0.5", "--test-fraction", "0"])[0] == 0
    code, out, err = run_cli(capsys, ["train", "kangaroo", *saved.args, "--data", str(corpus), "--block-size", "32",
                                      "--eval-blocks", "2", "--max-train-blocks", "8", "--exit-layer", "2", "--steps",
                                      "3", "--batch-size", "2", "--out-dir", str(adapter), "--no-progress"])
    assert code == 0 and f"adapter saved to {adapter}" in out, err
    meta = json.loads((adapter / "kangaroo.json").read_text())
    assert meta["shape"]["exit_layer"] == 2 and meta["base_fingerprint"] == saved.model.config.base_fingerprint
    for argv in (["--lossless"], ["--draft-layers", "2,3", "--draft-tokens", "3"], ["--kangaroo", str(adapter)]):
        code, out, _ = run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json",
                                        *argv])
        doc = json.loads(out)
        assert code == 0 and doc["text"] == text and doc["new_tokens"] == len(ref.new_tokens[0]), argv
        assert doc["speculative"]["proposed"] > 0, argv


def test_draft_sources_by_name_and_their_training_commands(saved, capsys, tmp_path):
    """``generate --draft NAME`` for prompt lookup, lookahead, a distilled draft model (``train draft-model``),
    Medusa heads (``train medusa``; tree and chain) and EAGLE's layer (``train eagle``), trained on a corpus from
    ``data build``: the text is full depth's, and
    ``--json`` reports the draft's statistics. A missing artifact names the command that makes it."""
    ref, text = api_text(saved.model, chat_ids(), max_new_tokens=NEW, force_compute=True)
    corpus, student, heads = tmp_path / "corpus", tmp_path / "student", tmp_path / "medusa"
    assert run_cli(capsys, ["data", "build", "--out", str(corpus), "--tokenizer", saved.base, "--sources", "py_stdlib",
                            "--max-docs-per-source", "6", "--val-fraction", "0.5", "--test-fraction", "0"])[0] == 0
    common = [*saved.args, "--data", str(corpus), "--block-size", "32", "--eval-blocks", "2", "--max-train-blocks",
              "8", "--steps", "3", "--batch-size", "2", "--warmup", "1", "--checkpoint-every", "2", "--no-progress"]
    code, out, err = run_cli(capsys, ["train", "draft-model", *common, "--layers", "2", "--out-dir", str(student)])
    assert code == 0 and f"draft-model saved to {student}" in out, err
    info = json.loads((student / "draft_model.json").read_text())
    assert info["layers"] == [0, saved.model.num_layers - 1] and info["training"]["steps_done"] == 3
    assert info["base_fingerprint"] == saved.model.config.base_fingerprint and info["command"] == "fbs train draft-model"
    assert (student / "checkpoints" / "latest").is_file()
    code, out, err = run_cli(capsys, ["train", "medusa", *common, "--heads", "2", "--out-dir", str(heads)])
    assert code == 0 and f"medusa saved to {heads}" in out, err
    eagle = tmp_path / "eagle"
    code, out, err = run_cli(capsys, ["train", "eagle", *common, "--max-minutes", "30", "--out-dir", str(eagle)])
    assert code == 0 and f"eagle saved to {eagle}" in out, err
    assert json.loads((eagle / "eagle.json").read_text())["training"]["steps_done"] == 3
    for argv in (["--draft", "prompt-lookup", "--draft-option", "max_ngram=2"],
                 ["--draft", "lookahead", "--draft-option", "ngram=3", "--draft-tokens", "5"],
                 ["--draft", "specdec", "--draft-path", str(student)],
                 ["--draft", "medusa", "--draft-path", str(heads)], ["--draft", "fbs"],
                 ["--draft", "medusa", "--draft-path", str(heads), "--draft-option", "tree=chain"],
                 ["--draft", "eagle", "--draft-path", str(eagle), "--draft-option", "topk=2"]):
        code, out, err = run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json",
                                          *argv])
        assert code == 0, (argv, err)
        doc = json.loads(out)
        assert doc["text"] == text and doc["draft"] == argv[1], argv
        assert doc["verify_passes"] == doc["speculative"]["passes"] and doc["tokens_per_s"] > 0
        st = doc["speculative"]
        assert doc["mean_accepted_tokens"] == pytest.approx(st["accepted"] / (st["passes"] - 1))
    code, _, err = run_cli(capsys, ["generate", PROMPT, *saved.args, "--draft", "specdec", "--draft-path",
                                    str(tmp_path / "none")])
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "fbs train draft-model" in errors[0]
    code, _, err = run_cli(capsys, ["generate", PROMPT, *saved.args, "--draft", "medusa"])
    assert code == 2 and "fbs train medusa" in err
    code, _, err = run_cli(capsys, ["generate", PROMPT, *saved.args, "--draft", "eagle"])
    assert code == 2 and "fbs train eagle" in err


def test_on_policy_draft_data_and_a_feature_cached_bf16_eagle_run(saved, capsys, tmp_path):
    """``data drafts`` records the model's own greedy answers (oracle: the API's full-depth decode of each prompt);
    ``train eagle --data DIR --feature-cache --bf16`` trains on them, writes the features once and decodes
    losslessly."""
    from fbs.data import onpolicy

    data, eagle = tmp_path / "drafts", tmp_path / "eagle"
    code, out, err = run_cli(capsys, ["data", "drafts", *saved.args, "--out", str(data), "--langs", "en",
                                      "--chat-items", "6", "--code-items", "0", "--max-new-tokens", "24",
                                      "--batch-size", "4"])
    assert code == 0 and "6 sequences (6 chat, 0 code)" in out and f"--data {data}" in out, err
    rows = onpolicy.read_sequences(data)
    for r in rows[:2]:
        prompt = r["ids"][:r["prompt_len"]]
        alone = saved.model.generate([prompt], max_new_tokens=24, force_compute=True, weights="auto")
        assert r["ids"][r["prompt_len"]:] == [int(t) for t in alone.new_tokens[0]]
    meta = json.loads((data / "meta.json").read_text())
    assert meta["sequences"] == 6 and meta["command"].startswith("fbs data drafts") and "git" in json.dumps(meta)
    code, out, err = run_cli(capsys, ["train", "eagle", *saved.args, "--data", str(data), "--block-size", "32",
                                      "--eval-blocks", "1", "--steps", "3", "--batch-size", "2", "--warmup", "1",
                                      "--feature-cache", "--bf16", "--regression", "normed", "--shortlist", "50",
                                      "--no-progress", "--out-dir", str(eagle)])
    assert code == 0 and f"eagle saved to {eagle}" in out, err
    saved_info = json.loads((eagle / "eagle.json").read_text())
    rec = saved_info["training"]
    assert rec["recipe"]["feature_cache"] and rec["recipe"]["bf16"] and rec["steps_done"] == 3
    assert rec["regression"] == "normed" and saved_info["shortlist"] == 50
    assert (eagle / "features.safetensors").is_file()
    ref, text = api_text(saved.model, chat_ids(), max_new_tokens=NEW, force_compute=True)
    code, out, err = run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json",
                                      "--draft", "eagle", "--draft-path", str(eagle)])
    assert code == 0 and json.loads(out)["text"] == text, err


def test_draft_search_writes_a_skip_set_that_decodes_losslessly(saved, capsys, tmp_path):
    corpus, out_json = tmp_path / "corpus", tmp_path / "set.json"
    assert run_cli(capsys, ["data", "build", "--out", str(corpus), "--tokenizer", saved.base, "--sources", "py_stdlib",
                            "--max-docs-per-source", "6", "--val-fraction", "0.5", "--test-fraction", "0"])[0] == 0
    code, out, _ = run_cli(capsys, ["train", "draft-search", *saved.args, "--data", str(corpus), "--block-size", "32",
                                    "--eval-blocks", "2", "--prompts", "2", "--prompt-len", "16", "--new-tokens", "6",
                                    "--max-layers", "2", "--out", str(out_json), "--no-progress"])
    assert code == 0 and f"skip set saved to {out_json}" in out
    found = json.loads(out_json.read_text())
    assert found["prompts"] == 2 and found["evaluated"] >= 1 and 0 <= found["acceptance"] <= 1
    assert set(found["layers"]) <= set(saved.model.layers_cfg.gated)
    _, text = api_text(saved.model, chat_ids(), max_new_tokens=NEW, force_compute=True)
    code, out, _ = run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json",
                                    "--draft-layers", str(out_json)])
    assert code == 0 and json.loads(out)["text"] == text


# --------------------------------------------------------------------------- fbs eval make-tasks / pareto
def test_eval_make_tasks_writes_the_run_selection(capsys, monkeypatch, tmp_path):
    """``eval make-tasks``: the JSONL holds the items ``fbs eval run`` selects (same limit and seed) with their
    context, options and gold answer; the YAML points at it; the usage line names the task."""
    from fbs.eval import tasks as T
    from fbs.eval.datasets import MCExample

    items = [MCExample(f"toy/{i}", (f"Q{i}: ",) * 3, ("a", "b", "c"), gold=i % 3) for i in range(10)]
    monkeypatch.setitem(T.TASKS, "toy", T.TaskSpec("toy", "mc", lambda: items, "toy"))
    code, out, _ = run_cli(capsys, ["eval", "make-tasks", "--out-dir", str(tmp_path), "--tasks", "toy", "--limit", "4",
                                    "--seed", "7"])
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "toy.jsonl").read_text().splitlines()]
    want = T.select(items, 4, 7)
    assert rows == [{"id": ex.id, "context": ex.contexts[0], "choices": list(ex.continuations), "gold": ex.gold}
                    for ex in want] and len(rows) == 4
    assert str(tmp_path / "toy.jsonl") in (tmp_path / "fbs_toy.yaml").read_text()
    assert out.strip().endswith(f"--include_path {tmp_path} --tasks fbs_toy")


def test_eval_pareto_plots_sweeps(capsys, tmp_path):
    """``eval pareto`` of two sweep files (``run_sweep`` rows of a tiny model): one PNG per held-out text; as
    many labels as files, else a clear error."""
    from test_eval_sweep import _docs

    from conftest import fbs_tiny, randomize
    from fbs.eval.sweep import run_sweep

    res = run_sweep(randomize(fbs_tiny(), gate_bias=0.0), fbs_tiny(), _docs(), taus=[0.9, 0.5], progress=False,
                    gate_from=2)
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"texts": {"in": res, "ood": res}}))
    files = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    code, out, _ = run_cli(capsys, ["eval", "pareto", *files, "--labels", "A,B", "--out-prefix", str(tmp_path / "p")])
    assert code == 0
    pngs = [tmp_path / "p_in.png", tmp_path / "p_ood.png"]
    assert out.split() == [w for p in pngs for w in ("wrote", str(p))]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    with pytest.raises(SystemExit, match="1 labels for 2 sweep files"):
        main(["eval", "pareto", *files, "--labels", "A", "--out-prefix", str(tmp_path / "q")])


# --------------------------------------------------------------------------- fbs train stage1
def test_train_stage1_then_stage2_report_and_acceptance(saved, capsys, tmp_path):
    """``train stage1`` on the saved base with a YAML recipe, ``--set`` and ``--max-steps``: two steps logged, the
    config used, the final export is a checkpoint of that base (``fbs info`` reads it), and a rerun resumes after
    the last step instead of training again. ``train stage2`` from that export on a prompt pool file: two PPO steps
    whose logged reward is compute term minus quality penalty, an export; ``train stage2-report`` tables them;
    ``train stage2-accept`` with one grid point of one step writes its report, whose verdict says one step is
    too few."""
    import dataclasses

    import yaml

    from conftest import tiny_config
    from fbs.rl.pool import PoolItem

    corpus = tmp_path / "corpus"
    assert run_cli(capsys, ["data", "build", "--out", str(corpus), "--tokenizer", saved.base, "--sources", "py_stdlib",
                            "--max-docs-per-source", "6", "--val-fraction", "0.5", "--test-fraction", "0"])[0] == 0
    recipe = dict(fbs=dataclasses.asdict(tiny_config()), trainable="adapters", block_size=32, eval_blocks=2,
                  batch_tokens=128, micro_batch_size=2, lr=3e-3, fbs_lr=1e-2, eval_every=0, save_every=1,
                  tensorboard=False, lora_rank=4, skip_every=2)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    argv = ["train", "stage1", "--config", str(tmp_path / "recipe.yaml"), "--model", saved.base, "--data", str(corpus),
            "--out-dir", str(run), "--max-steps", "2", "--set", "fbs.tau=0.45", "--set", "threads=1", "--no-progress"]
    threads = torch.get_num_threads()
    try:
        code, out, err = run_cli(capsys, argv)
        assert code == 0, err
        assert f"exported to {run}/final" in out
        trained = [r["step"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if "lm" in r]
        assert trained == [1, 2]
        used = json.loads((run / "train_config.json").read_text())
        assert (used["max_steps"], used["lr"], used["fbs"]["tau"], used["model"]) == (2, 3e-3, 0.45, saved.base)
        cfg = json.loads((run / "final" / "fbs_config.json").read_text())
        assert cfg["base_fingerprint"] == saved.model.config.base_fingerprint and cfg["paw_layers"] == [1]
        code, out, _ = run_cli(capsys, ["info", "--model", saved.base, "--checkpoint", str(run / "final"), "--json"])
        assert code == 0 and json.loads(out)["config"]["base_fingerprint"] == cfg["base_fingerprint"]
        log_lines = (run / "log.jsonl").read_text()
        code, _, err = run_cli(capsys, argv)
        assert code == 0, err
        assert (run / "log.jsonl").read_text().count('"lm":') == log_lines.count('"lm":') == 2  # nothing retrained

        pool, rl = tmp_path / "pool.jsonl", tmp_path / "stage2"
        items = [PoolItem(f"t/{i}", "mmlu", f"Q{i}?", ("x", "y", "z", "w"), i % 4, f"Q{i}?\nA. x\nB. y\n",
                          f"Answer: {'ABCD'[i % 4]}. {'xyzw'[i % 4]}") for i in range(4)]
        pool.write_text("".join(json.dumps(it.to_dict()) + "\n" for it in items))
        code, out, err = run_cli(capsys, ["train", "stage2", "--init-from", str(run / "final"), "--pool", str(pool),
                                          "--out-dir", str(rl), "--max-steps", "2", "--batch-size", "2",
                                          "--max-new-tokens", "4", "--threads", "1", "--no-progress"])
        assert code == 0, err
        assert json.loads(out)["steps"] == 2
        log = [json.loads(x) for x in (rl / "log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == [0, 1]
        assert all(r["reward"] == pytest.approx(r["compute_term"] - r["quality_penalty"], abs=1e-6) for r in log)
        assert (rl / "final" / "fbs_model.safetensors").is_file()
        code, out, _ = run_cli(capsys, ["train", "stage2-report", str(rl), "--out-dir", str(tmp_path / "report")])
        assert code == 0 and f"## {rl}: reward decomposition over 2 PPO steps" in out
        assert (tmp_path / "report" / "stage2_report.md").read_text() in out

        accept = tmp_path / "accept"
        code, out, err = run_cli(capsys, [
            "train", "stage2-accept", "--init-from", str(run / "final"), "--out-dir", str(accept),
            "--config", str(Path(__file__).parents[1] / "configs" / "stage2_smollm2.yaml"), "--set", f"pool={pool}",
            "--set", "batch_size=2", "--set", "max_new_tokens=4", "--set", "threads=1", "--set", "progress=false",
            "--grid", "0.1:0.1", "--steps", "1", "--corpus", str(corpus), "--split", "validation", "--per-lang", "2",
            "--max-tokens", "64", "--taus", "0.5", "--gate-from", "8", "--resamples", "20", "--threads", "1"])
        assert code == 0, err
        doc = json.loads((accept / "acceptance.json").read_text())
        assert doc["primary_tau"] == 0.5 and [r["run"] for r in doc["results"]] == [str(accept / "a0.1_b0.1")]
        assert doc["verdict"].startswith("inconclusive") and "1 steps per grid point are below the 30" in doc["verdict"]
        assert len((accept / "a0.1_b0.1" / "log.jsonl").read_text().splitlines()) == 1
        assert (accept / "acceptance.md").read_text() in out
    finally:
        torch.set_num_threads(threads)


def test_train_flexidepth_reports_the_base_perplexity(saved, capsys, tmp_path):
    """``train flexidepth`` on the saved (frozen) base: two steps, an export, and the printed base PPL is HF's own
    perplexity on the held-out blocks (exp of the mean next-token NLL over every position)."""
    import math

    import yaml

    from fbs.train.data import corpus_blocks

    corpus = tmp_path / "corpus"
    assert run_cli(capsys, ["data", "build", "--out", str(corpus), "--tokenizer", saved.base, "--sources", "py_stdlib",
                            "--max-docs-per-source", "6", "--val-fraction", "0.5", "--test-fraction", "0"])[0] == 0
    recipe = dict(block_size=32, eval_blocks=2, batch_tokens=128, micro_batch_size=2, eval_every=0, save_every=1,
                  threads=1)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    threads = torch.get_num_threads()
    try:
        code, out, err = run_cli(capsys, ["train", "flexidepth", "--config", str(tmp_path / "recipe.yaml"), "--model",
                                          saved.base, "--data", str(corpus), "--out-dir", str(tmp_path / "run"),
                                          "--max-steps", "2", "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    summary = json.loads(out[:out.rindex("}") + 1])
    assert summary["steps"] == 2 and summary["final"] == str(tmp_path / "run" / "final")
    ids = corpus_blocks(corpus, char_tokenizer(), 32, 2).eval_ids
    with torch.no_grad():
        logits = saved.model.base.hf(ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert summary["eval"]["ppl_base"] == pytest.approx(math.exp(nll.item()), rel=1e-4)
    assert f"base {summary['eval']['ppl_base']:.2f}" in out and f"exported to {summary['final']}" in out
    from fbs.baselines.flexidepth import CONFIG_NAME, WEIGHTS_NAME

    assert all((Path(summary["final"]) / name).is_file() for name in (CONFIG_NAME, WEIGHTS_NAME))


def test_train_segatron_resumes_and_eval_segatron_scores_it(saved, zh_corpus, capsys, tmp_path):
    """``train segatron`` on the saved base: two steps, then a rerun with ``--max-steps 3`` resumes (no second
    step-0 evaluation, one more step), and the step-0 PPL is the base's (fresh tables are zero). ``eval segatron``
    of the export: the probe record is one ``fbs eval ch-table`` accepts, and each PPL row is the API's own
    perplexity of that model on the probe's evaluation blocks."""
    import math

    import yaml

    from fbs.baselines.segatron import Segatron
    from fbs.data.probe import corpus_sequences
    from fbs.eval.ch_table import load_ch_record

    corpus = tmp_path / "corpus"
    assert run_cli(capsys, ["data", "build", "--out", str(corpus), "--tokenizer", saved.base, "--sources", "py_stdlib",
                            "--max-docs-per-source", "6", "--val-fraction", "0.5", "--test-fraction", "0"])[0] == 0
    recipe = dict(block_size=32, eval_blocks=2, batch_tokens=128, micro_batch_size=2, eval_every=0, save_every=1,
                  threads=1, segatron=dict(max_paragraphs=4, max_sentences=8, max_tokens=16))
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    argv = ["train", "segatron", "--config", str(tmp_path / "recipe.yaml"), "--model", saved.base, "--data",
            str(corpus), "--out-dir", str(tmp_path / "run"), "--no-progress"]
    threads = torch.get_num_threads()
    try:
        code, out, err = run_cli(capsys, [*argv, "--max-steps", "2"])
        assert code == 0, err
        code, out, err = run_cli(capsys, [*argv, "--max-steps", "3"])
        assert code == 0, err
    finally:
        torch.set_num_threads(threads)
    summary = json.loads(out[:out.rindex("}") + 1])
    assert summary["steps"] == 3 and summary["tokens"] == 3 * 128
    assert f"exported to {summary['final']}" in out and "3 steps / 384 tokens" in out
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 2, 3, 3]  # run 1: eval 0, steps 1-2, eval 2; run 2: step 3, eval 3
    assert log[0]["ppl"] == log[0]["ppl_base"]

    probe, ppl = tmp_path / "probe.json", tmp_path / "ppl.json"
    code, text, err = run_cli(capsys, [
        "eval", "segatron", "--segatron", summary["final"], "--model", saved.base, "--corpus", str(zh_corpus.path),
        "--train-split", "train", "--eval-split", "train", "--seq-len", "16", "--train-seqs", "6", "--eval-seqs", "4",
        "--idiom-items", "0", "--epochs", "1", "--batch-size", "4", "--threads", "1", "--probe-out", str(probe),
        "--ppl-out", str(ppl), "--ppl-models", "segatron,base", "--resamples", "50", "--no-progress"])
    assert code == 0, err
    rec = load_ch_record(probe)
    assert rec.data["layer"] == 3 and rec.data["predictor"] == "linear probe (Segatron)" and rec.n_blocks == 4
    doc = json.loads(ppl.read_text())
    blocks = torch.tensor([ids for ids, _ in corpus_sequences(zh_corpus.path, "train", char_tokenizer(), 16, 4, 1)])
    model = Segatron.from_pretrained(summary["final"], saved.base)
    with torch.no_grad():
        for row, logits in zip(doc["ppl"]["rows"], (model(blocks).logits, saved.model.base.hf(blocks).logits)):
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                    blocks[:, 1:].reshape(-1))
            assert row["ppl"] == pytest.approx(math.exp(nll.item()), rel=1e-5), row["label"]
            assert row["ci_low"] <= row["ppl"] <= row["ci_high"]
    assert [r["label"] for r in doc["ppl"]["rows"]] == ["segatron", "base"] and "| segatron |" in text


def test_eval_long_context_scores_the_saved_model(saved, capsys, tmp_path):
    """``eval long-context`` on the saved model, two systems in this process (the full command, resuming and the
    per-system processes: tests/test_longctx.py): rows for both, the full cache allocated to the request, the
    policy's to its budget, and the FBS system skipping."""
    words = ("river", "stone", "light", "green", "north")
    docs = tmp_path / "doc.txt"
    docs.write_text(" ".join(words[i * 7 % 5] + ("." if i % 9 == 0 else "") for i in range(80)))
    out = tmp_path / "lc.json"
    code, text, _ = run_cli(capsys, ["eval", "long-context", *saved.args, "--systems", "base,fbs+streaming",
                                     "--lengths", "180", "--kv-budget", "40", "--ppl-tokens", "16", "--depths", "0.5",
                                     "--qa-items", "0", "--docs", str(docs), "--work-dir", str(tmp_path / "w"),
                                     "--out", str(out), "--in-process"])
    assert code == 0 and "| fbs+streaming |" in text
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["base"]["kv_capacity_slots"] == 180 and rows["fbs+streaming"]["kv_capacity_slots"] == 41
    assert rows["base"]["skip_ratio"] == 0 and rows["fbs+streaming"]["skip_ratio"] > 0


def test_eval_tolerance_profile_and_plot(saved, capsys, tmp_path):
    """``eval tolerance`` on the saved base with one share, two masks and whole layers: the options and the
    model's facts reach the JSON (parameters counted by hand), a markdown table is written next to it, and with
    one character per token each kind's nats per character is the log of its perplexity; ``--plot`` of the
    profile prints it and draws the scaling plot."""
    import math

    out = tmp_path / "tol.json"
    threads = torch.get_num_threads()
    try:
        code, text, err = run_cli(capsys, ["eval", "tolerance", "--model", saved.base, "--docs-per-kind", "1",
                                           "--shares", "0.2", "--baseline-shares", "0.2", "--masks", "oracle,static",
                                           "--units", "layer", "--threads", "1", "--out", str(out), "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    doc = json.loads(out.read_text())
    opts = doc["options"]
    assert (opts["shares"], opts["baseline_shares"], opts["masks"], opts["units"]) == ([0.2], [0.2],
                                                                                      ["oracle", "static"], ["layer"])
    hf = saved.model.base.hf
    assert doc["layers"] == 6 and doc["hidden_size"] == 64
    assert doc["params"] == sum(p.numel() for p in {p.data_ptr(): p for p in hf.parameters()}.values())
    assert all(d["scored_tokens"] == d["scored_chars"] for d in doc["texts"]["docs"])
    for kind, res in doc["base_by_kind"].items():
        assert res["nats_per_char"] == pytest.approx(math.log(res["ppl"]), rel=1e-6), kind
    assert {(r["mask"], r["unit"]) for r in doc["rows"]} >= {("oracle", "layer"), ("static", "layer")}
    assert out.with_suffix(".md").is_file() and f"wrote {out} and {out.with_suffix('.md')}" in text
    code, text, _ = run_cli(capsys, ["eval", "tolerance", "--plot", str(out), "--plot-out", str(tmp_path / "s.png")])
    assert code == 0 and text.strip().endswith(f"wrote {tmp_path / 's.png'}")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- every command has a test
def test_every_command_is_run_by_a_test():
    """Each leaf command of the ``fbs`` parser appears at the head of an argv list in some test
    (``["eval", "merge", ...``), or its handler is called directly; a new command without a test fails here."""
    import argparse
    import re

    from fbs.cli import build_parser

    def leaves(parser, path=()):
        func = parser.get_default("func")
        if func is not None:
            yield path, func
        for action in parser._actions:  # argparse has no public accessor for sub-parsers
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from leaves(sub, path + (name,))

    texts = [p.read_text() for p in Path(__file__).parent.glob("test_*.py")]
    commands = dict(leaves(build_parser()))
    assert len(commands) > 30 and ("eval", "run") in commands and ("serve",) in commands
    missing = []
    for path, func in commands.items():
        head = re.compile(r"\[\s*" + r",\s*".join(re.escape(f'"{w}"') for w in path) + r"\s*[,\]]")
        if not any(head.search(t) or f"{func.__name__}(" in t for t in texts):
            missing.append(" ".join(path))
    assert not missing, f"commands without a test: {missing}"
