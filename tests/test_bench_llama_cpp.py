"""llama.cpp as the anchor of `fbs bench`: llama-bench's JSON and llama-perplexity's output parsed (outputs captured
from the real binaries in tests/data/llama_cpp), the command lines built from the protocol, the system under the
harness with a recorded runner, and the unavailable path."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from fbs.bench import llama_cpp
from fbs.bench.harness import BenchConfig, measure, measure_interleaved
from fbs.bench.llama_cpp import (LlamaBenchSystem, ToolRun, bench_commands, parse_bench_json, parse_perplexity,
                                 read_flags)

DATA = Path(__file__).parent / "data" / "llama_cpp"
PP_JSON = (DATA / "llama_bench_pp.json").read_text()  # llama-bench -p 16 -n 0 -d 0 -t 2 -r 2 -o json, Q4_1
TG_JSON = (DATA / "llama_bench_tg.json").read_text()  # llama-bench -p 0 -n 8 -d 16 -t 2 -r 2 -o json, Q4_1
PPL_OUT = (DATA / "llama_perplexity_q4_1.txt").read_text()  # llama-perplexity -f GPL-2 -c 512 -t 1 --chunks 2


def test_bench_json_parsed_with_its_own_statistics():
    """The captured outputs: test shapes as requested, and avg_ts / stddev_ts are llama-bench's mean and sample std
    of samples_ts, each sample being tokens / samples_ns (checked against the raw numbers)."""
    (pp,), (tg,) = parse_bench_json(PP_JSON), parse_bench_json(TG_JSON)
    assert (pp.n_prompt, pp.n_gen, pp.n_depth, pp.n_threads) == (16, 0, 0, 2)
    assert (tg.n_prompt, tg.n_gen, tg.n_depth) == (0, 8, 16)
    for t in (pp, tg):
        assert len(t.samples_ns) == len(t.samples_ts) == 2
        assert [t.tokens / (ns / 1e9) for ns in t.samples_ns] == pytest.approx(t.samples_ts, rel=1e-5)
        assert statistics.fmean(t.samples_ts) == pytest.approx(t.avg_ts, rel=1e-5)
        assert statistics.stdev(t.samples_ts) == pytest.approx(t.stddev_ts, rel=2e-3, abs=2e-6)
        assert t.info["model_type"] == "llama 256M Q4_1" and t.info["type_k"] == "f16"


def test_bench_json_errors_name_the_problem():
    with pytest.raises(ValueError, match="not JSON.*-o json"):
        parse_bench_json("| model | size |")
    rec = json.loads(PP_JSON)[0]
    del rec["samples_ns"]
    with pytest.raises(ValueError, match=r"lacks \['samples_ns'\]"):
        parse_bench_json(json.dumps([rec]))


def test_commands_map_the_protocol():
    cfg = BenchConfig(prompt_len=512, new_tokens=128, threads=2)
    pp, tg = bench_commands(Path("/b/llama-bench"), Path("/m/x.Q4_0.gguf"), cfg, threads=2, reps=5)
    flags = lambda cmd: dict(zip(cmd[1::2], cmd[2::2]))  # noqa: E731
    assert pp[0] == tg[0] == "/b/llama-bench"
    assert flags(pp) == {"-m": "/m/x.Q4_0.gguf", "-p": "512", "-n": "0", "-d": "0", "-t": "2", "-r": "5", "-o": "json"}
    assert flags(tg) == {"-m": "/m/x.Q4_0.gguf", "-p": "0", "-n": "128", "-d": "512", "-t": "2", "-r": "5",
                         "-o": "json"}
    # llama.cpp's int8 KV cache: q8_0 keys and values, with the flash attention a quantized V cache needs
    pp, tg = bench_commands(Path("/b/llama-bench"), Path("/m/x.Q4_0.gguf"), cfg, threads=2, reps=5, kv_type="q8_0")
    for cmd in (pp, tg):
        assert {k: flags(cmd)[k] for k in ("-ctk", "-ctv", "-fa")} == {"-ctk": "q8_0", "-ctv": "q8_0", "-fa": "1"}
    with pytest.raises(ValueError, match="unknown llama.cpp KV cache type 'q4_0'"):
        bench_commands(Path("/b/llama-bench"), Path("/m/x.gguf"), cfg, threads=2, reps=5, kv_type="q4_0")


def test_llama_cpp_systems_once_per_kv_type():
    from fbs.bench.runner import RunSpec, build_systems

    spec = RunSpec(systems=("llama-cpp-q4_0",), llama_kv_types=("f16", "q8_0"))
    from types import SimpleNamespace

    hf = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2))  # llama.cpp systems read nothing of it
    systems = build_systems(hf, None, None, spec)
    assert [(s.name, s.params["kv_type"], s.params["flash_attn"]) for s in systems] == [
        ("llama-cpp-q4_0", "f16", False), ("llama-cpp-q4_0-kvq8_0", "q8_0", True)]
    with pytest.raises(ValueError, match="llama_kv_types must be distinct names from f16, q8_0"):
        RunSpec(systems=("llama-cpp-q4_0",), llama_kv_types=("q4_0",))


class RecordedRunner:
    """Stands in for the subprocess: answers llama-bench with the captured JSON (shapes rewritten to the request),
    ``--version`` with its real first line; records every command."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, cmd: list[str]) -> ToolRun:
        self.calls.append(cmd)
        if cmd[-1] == "--version":
            return ToolRun("", "version: 0.5.0-dev (build 1, commit 0c1e570)\n", 0, 5.0)
        f = dict(zip(cmd[1::2], cmd[2::2]))
        rec = json.loads(PP_JSON if f["-n"] == "0" else TG_JSON)[0]
        reps = int(f["-r"])
        rec.update(n_prompt=int(f["-p"]), n_gen=int(f["-n"]), n_depth=int(f["-d"]), n_threads=int(f["-t"]),
                   samples_ns=(rec["samples_ns"] * reps)[:reps], samples_ts=(rec["samples_ts"] * reps)[:reps])
        return ToolRun(json.dumps([rec]), "", 0, 120.0 if f["-n"] == "0" else 130.0)


@pytest.fixture
def fake_root(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "models").mkdir()
    exe = tmp_path / "bin" / "llama-bench"
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    (tmp_path / "bin" / "flags.txt").write_text("GGML_AVX512:BOOL=ON\nGGML_AMX_INT8:BOOL=OFF\n")
    (tmp_path / "models" / "smollm2-135m.Q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
    return tmp_path


def test_under_the_harness_sequential_and_interleaved(fake_root):
    """Sequential: one call pair with -r <runs>; interleaved: one -r 1 pair per warm-up and measured round. Prefill is
    the pp sample, decode the tg sample scaled to N-1 of its N tokens, total their sum, peak RSS the child's."""
    (pp,), (tg,) = parse_bench_json(PP_JSON), parse_bench_json(TG_JSON)
    prompts = torch.zeros(1, 16, dtype=torch.long)
    cfg = BenchConfig(prompt_len=16, new_tokens=8, warmup=1, runs=2, num_prompts=1)
    run = RecordedRunner()
    sys_ = LlamaBenchSystem("Q4_1", root=fake_root, n_threads=2, runner=run)
    assert sys_.name == "llama-cpp-q4_1" and sys_.unavailable(1) == ""
    res = measure(sys_, prompts, cfg)
    assert res.status == "ok", res.note
    bench = [c for c in run.calls if c[-1] != "--version"]
    assert [dict(zip(c[1::2], c[2::2]))["-r"] for c in bench] == ["2", "2"]
    assert res.prefill_s.runs == pytest.approx([ns / 1e9 for ns in pp.samples_ns])
    assert res.decode_s.runs == pytest.approx([ns / 1e9 * 7 / 8 for ns in tg.samples_ns])
    assert res.total_s.runs == pytest.approx([a + b for a, b in zip(res.prefill_s.runs, res.decode_s.runs)])
    assert res.peak_rss_mb == 130.0 and res.rss_before_mb is None and res.outputs is None
    facts = res.probe["llama_cpp"]
    assert facts["build_flags"] == {"GGML_AVX512": "ON", "GGML_AMX_INT8": "OFF"}
    assert facts["version"].startswith("version: 0.5.0-dev") and facts["model_bytes"] == 64
    assert facts["model_sha256"] == hashlib.sha256(b"GGUF" + bytes(60)).hexdigest()

    run2 = RecordedRunner()
    sys2 = LlamaBenchSystem("Q4_1", root=fake_root, n_threads=2, runner=run2)
    (res2,) = measure_interleaved([sys2], prompts, cfg)
    bench = [c for c in run2.calls if c[-1] != "--version"]
    assert len(bench) == 2 * (cfg.warmup + cfg.runs)
    assert {dict(zip(c[1::2], c[2::2]))["-r"] for c in bench} == {"1"}
    assert res2.interleaved and len(res2.decode_s.runs) == 2


def test_record_reports_llama_bench_rates(fake_root):
    """decode_tok_s is llama-bench's tg rate (N tokens over the tg time) and prefill_tok_s its pp rate."""
    from fbs.bench.report import result_record

    (pp,), (tg,) = parse_bench_json(PP_JSON), parse_bench_json(TG_JSON)
    sys_ = LlamaBenchSystem("Q4_1", root=fake_root, n_threads=2, runner=RecordedRunner())
    res = measure(sys_, torch.zeros(1, 16, dtype=torch.long),
                  BenchConfig(prompt_len=16, new_tokens=8, warmup=0, runs=2, num_prompts=1))
    rec = result_record(res, 8, None, None, None, prompt_len=16)
    assert rec["decode_tok_s"] == pytest.approx(statistics.median(tg.samples_ts), rel=1e-5)
    assert rec["prefill_tok_s"] == pytest.approx(statistics.median(pp.samples_ts), rel=1e-5)
    assert rec["llama_cpp"]["tg_avg_ts"] == pytest.approx(tg.avg_ts, rel=1e-5)
    assert rec["llama_cpp"]["pp_avg_ts"] == pytest.approx(pp.avg_ts, rel=1e-5)
    assert "llama_cpp" not in rec["probe"]


def test_unavailable_names_the_build_script(tmp_path, monkeypatch):
    monkeypatch.setenv("FBS_LLAMA_CPP_DIR", str(tmp_path / "nowhere"))
    sys_ = LlamaBenchSystem("Q8_0")
    assert sys_.root == tmp_path / "nowhere"
    reason = sys_.unavailable(1)
    assert "llama-bench is not built" in reason and "scripts/build_llama_cpp.sh" in reason
    res = measure(sys_, torch.zeros(1, 4, dtype=torch.long), BenchConfig(prompt_len=4, new_tokens=2, warmup=0,
                                                                           runs=1, num_prompts=1))
    assert res.status == "unavailable" and "scripts/build_llama_cpp.sh" in res.note


def test_missing_format_and_batch_size(fake_root):
    assert "no F16 GGUF of smollm2-135m" in LlamaBenchSystem("F16", root=fake_root).unavailable(1)
    assert "batch size 1 only" in LlamaBenchSystem("Q4_1", root=fake_root).unavailable(4)
    with pytest.raises(ValueError, match="unknown llama.cpp format 'Q5_K'"):
        LlamaBenchSystem("Q5_K")


def test_install_dir_follows_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("FBS_LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("FBS_CACHE_DIR", str(tmp_path))
    assert llama_cpp.install_dir() == tmp_path / "llama.cpp" / llama_cpp.LLAMA_CPP_VERSION


def test_a_failing_tool_fails_the_row_not_the_run(fake_root):
    def broken(cmd):
        return ToolRun("", "version: x\n" if cmd[-1] == "--version" else "error: failed to load model\n",
                       0 if cmd[-1] == "--version" else 1, 1.0)

    res = measure(LlamaBenchSystem("Q4_1", root=fake_root, runner=broken), torch.zeros(1, 4, dtype=torch.long),
                  BenchConfig(prompt_len=4, new_tokens=2, warmup=0, runs=1, num_prompts=1))
    assert res.status == "failed" and "failed to load model" in res.note


def test_alias_expands_to_every_format():
    from fbs.bench.runner import RunSpec

    spec = RunSpec(systems=("llama-cpp",))
    assert [g for g in ("llama-cpp-q4_1", "llama-cpp-q4_k_m", "llama-cpp-q8_0", "llama-cpp-q4_0", "llama-cpp-f16",
                        "fbs-full") if spec.wants(g)] == ["llama-cpp-q4_1", "llama-cpp-q4_k_m", "llama-cpp-q8_0",
                                                          "llama-cpp-q4_0", "llama-cpp-f16"]
    with pytest.raises(ValueError, match="aliases: llama-cpp = llama-cpp-q4_1"):
        RunSpec(systems=("llama-cpp-q5",))


def test_each_base_gets_the_formats_made_for_it():
    """The shipped file's own format first (SmolLM2's Q4_1, Qwen2.5-Coder's Q4_K_M), then the requantized ones."""
    from fbs.bench.llama_cpp import llama_bench_systems

    assert [s.name for s in llama_bench_systems("smollm2-135m")] == [
        "llama-cpp-q4_1", "llama-cpp-q8_0", "llama-cpp-q4_0", "llama-cpp-f16"]
    assert [s.name for s in llama_bench_systems("qwen2.5-coder-0.5b")] == [
        "llama-cpp-q4_k_m", "llama-cpp-q8_0", "llama-cpp-q4_0"]


def test_perplexity_output_parsed():
    """The captured output: final estimate, chunk count and context; the per-chunk NLLs recovered from the running
    estimates average back to the final PPL (equal chunks)."""
    r = parse_perplexity(PPL_OUT)
    assert (r.ppl, r.ppl_err, r.n_chunks, r.n_ctx) == (15.66, 1.78827, 2, 512)
    assert r.running == (14.9216, 15.66)
    assert r.scored_tokens == 2 * 255
    nll = r.chunk_nll()
    assert nll[0] == pytest.approx(math.log(14.9216))
    assert math.exp(sum(nll) / 2) == pytest.approx(r.ppl, rel=1e-4)


def test_perplexity_errors_name_the_problem():
    with pytest.raises(ValueError, match="tokenizes to only 300 tokens.*longer text"):
        parse_perplexity("perplexity: the data file you provided tokenizes to only 300 tokens\n")
    with pytest.raises(ValueError, match="Final estimate"):
        parse_perplexity(PPL_OUT.replace("Final estimate", "Finale"))


def test_flags_file_parsed(tmp_path):
    f = tmp_path / "flags.txt"
    f.write_text("GGML_AVX512:BOOL=ON\nGGML_NATIVE:BOOL=OFF\n\n")
    assert read_flags(f) == {"GGML_AVX512": "ON", "GGML_NATIVE": "OFF"}


def test_tool_peak_memory_is_the_childs_own():
    """A child that holds 200 MB reports about 200 MB: its own high-water mark, not this (larger) process's, which
    the kernel's rusage of a forked child would include."""
    import sys

    run = llama_cpp.run_tool([sys.executable, "-c", "x = bytearray(200 * 2**20); import time; time.sleep(0.3)"])
    assert run.returncode == 0
    assert 200 <= run.peak_rss_mb < 260


def test_a_non_bundled_base_has_no_formats(fake_root):
    reason = LlamaBenchSystem("Q4_1", base="/data/my-hf-model", root=fake_root).unavailable(1)
    assert "no llama.cpp GGUF for /data/my-hf-model" in reason and "build_llama_cpp.sh" in reason


@pytest.mark.slow
def test_real_llama_bench_under_the_harness():
    """The real build (skipped without it): tiny pp / tg through the harness, rates as llama-bench reports them."""
    sys_ = LlamaBenchSystem("Q4_0", n_threads=1)
    if sys_.unavailable(1):
        pytest.skip(sys_.unavailable(1))
    res = measure(sys_, torch.zeros(1, 8, dtype=torch.long),
                  BenchConfig(prompt_len=8, new_tokens=4, warmup=0, runs=2, num_prompts=1))
    assert res.status == "ok", res.note
    assert len(res.decode_s.runs) == 2 and min(res.decode_s.runs) > 0 and res.peak_rss_mb > 20
    assert len(res.probe["llama_cpp"]["model_sha256"]) == 64


BATCHED_JSONL = (DATA / "llama_batched_bench.jsonl").read_text()  # the command of test_batched_command, Q4_1


def test_batched_command():
    cmd = llama_cpp.batched_command(Path("/b/llama-batched-bench"), Path("/m/x.Q4_1.gguf"), 16, 4, [1, 2], 2)
    assert cmd[0] == "/b/llama-batched-bench"
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    # each of the largest batch's sequences its own prompt and cache share (16 + 4 positions): -c 2 x 20
    assert {k: flags[k] for k in ("-m", "-c", "-npp", "-ntg", "-npl", "-t", "-tb")} == {
        "-m": "/m/x.Q4_1.gguf", "-c": "40", "-npp": "16", "-ntg": "4", "-npl": "1,2", "-t": "2", "-tb": "2"}
    assert "-no-kvu" in cmd and "-pps" not in cmd and cmd[-2:] == ["--output-format", "jsonl"]
    q8 = llama_cpp.batched_command(Path("/b/x"), Path("/m/x.gguf"), 512, 32, [1, 8], 2, kv_type="q8_0")
    assert q8[-6:] == ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    assert dict(zip(q8[1::2], q8[2::2]))["-c"] == str(8 * 544)
    with pytest.raises(ValueError, match="unknown llama.cpp KV cache type"):
        llama_cpp.batched_command(Path("/b/x"), Path("/m/x.gguf"), 16, 4, [1], 2, kv_type="q4_0")


def test_batched_jsonl_parsed_as_seconds_per_step():
    """The captured output's records, by hand: B = 1 took t_tg 0.037707 s for its 4 steps, B = 2 0.052187 s."""
    got = llama_cpp.parse_batched_jsonl("llama_batched_bench: log line\n" + BATCHED_JSONL)
    assert got == pytest.approx({1: 0.037707 / 4, 2: 0.052187 / 4}, rel=1e-12)
    with pytest.raises(ValueError, match="no llama-batched-bench JSONL record"):
        llama_cpp.parse_batched_jsonl("|    PP |     TG |    B |")
    with pytest.raises(ValueError, match=r"lacks \['t_tg'\]"):
        llama_cpp.parse_batched_jsonl('{"pl": 1, "tg": 4}')
