"""The benchmark document: produced end to end on a tiny model, validated against the keys docs/bench.md lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fbs import FBSConfig, FBSForCausalLM, native
from fbs.bench import report
from fbs.bench.harness import BenchConfig
from fbs.bench.runner import RunSpec, run, write_outputs

DOC = Path(__file__).resolve().parents[1] / "docs" / "bench.md"
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=96, tie_word_embeddings=True,
           eos_token_id=255, bos_token_id=0, pad_token_id=0)


class ByteTokenizer:
    all_special_ids: list[int] = []

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + b % 250 for b in text.encode()]}


def documented_keys(section: str) -> set[str]:
    """Backticked keys in the first column of the table under the markdown heading ``section``."""
    text = DOC.read_text()
    start = text.index(section)
    body = text[start + len(section):]
    nxt = re.search(r"^#{1,4} ", body, flags=re.M)
    body = body[: nxt.start()] if nxt else body
    return set(re.findall(r"^\| `([a-z_0-9]+)` \|", body, flags=re.M))


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG)).eval()
    cfg = FBSConfig(k_max=4, preview_vocab_size=48, preview_top_k=8, preview_rank=16, chunk_rank=16,
                    chunk_cache_size=4, gate_rank=8, gate_width=8, paw_layers=(0,), ch_layers=(3,),
                    never_skip_first=1, never_skip_last=1)
    fbs = FBSForCausalLM.from_base(model, config=cfg).eval()
    spec = RunSpec(base="/no/such/tiny-model",
                   systems=("hf-greedy", "prompt-lookup", "assisted", "llama-cpp", "fbs-full", "fbs-tau", "fbs-plan"),
                   taus=(0.5,), plans=(0.25,), batch_sizes=(1, 2), long_context=(64, 128), long_runs=1,
                   long_warmup=0, machine_mb=8, matmul_n=128)
    bench = BenchConfig(prompt_len=16, new_tokens=6, warmup=0, runs=2, num_prompts=2)
    doc = run(spec, bench, command="test", model=model, tok=ByteTokenizer(), fbs_model=fbs)
    out = tmp_path_factory.mktemp("bench")
    paths = write_outputs(doc, out)
    return json.loads(paths["json"].read_text()), paths


def test_document_matches_the_documented_schema(document):
    doc, _ = document
    report.validate(doc)
    assert doc["schema"] == report.SCHEMA_VERSION
    assert set(doc) == documented_keys("### Top level") == set(report.TOP_KEYS)
    for rec in doc["results"]:
        assert set(rec) == documented_keys("### `results[]`") == set(report.RESULT_KEYS)
    assert doc["long_context"]
    for rec in doc["long_context"]:
        assert set(rec) == documented_keys("### `long_context[]`") == set(report.LONG_KEYS)


def test_document_contents(document):
    doc, paths = document
    by = {(r["system"], r["batch_size"]): r for r in doc["results"]}
    base = by[("hf-greedy", 1)]
    assert base["tflops_rel"] == pytest.approx(1.0) and base["token_match_pct"] == 100.0
    assert base["speedup"] == pytest.approx(1.0)
    assert by[("hf-assisted", 1)]["status"] == "unavailable"
    assert by[("hf-prompt-lookup", 2)]["status"] == "unavailable"  # transformers: batch 1 only
    assert by[("fbs-full-compute", 2)]["layer_skip_ratio"] == 0.0
    assert doc["environment"]["native"] == native.status()  # what the FBS systems ran with, recorded
    plan = next(r for (name, b), r in by.items() if name.startswith("fbs-plan") and b == 1)
    assert plan["tflops_rel"] == pytest.approx(0.75)  # 1 of 4 layers skipped on every decode step
    full = by[("fbs-full-compute", 1)]
    assert base["bytes_rel"] == 1.0 and full["bytes_rel"] > 1.0  # full depth plus the FBS modules' weights
    assert plan["bytes_rel"] < full["bytes_rel"] and plan["skip_saving"]["reference"] == "fbs-full-compute"
    assert plan["skip_saving"]["predicted"] == pytest.approx(1 - plan["bytes_rel"] / full["bytes_rel"])
    assert full["skip_saving"] is None and base["skip_saving"] is None
    for fmt in ("q4_1", "q8_0", "q4_0", "f16"):  # the llama-cpp alias: no GGUF for a model that is not bundled
        row = by[(f"llama-cpp-{fmt}", 1)]
        assert row["status"] == "unavailable" and "GGUF" in row["note"] and "build_llama_cpp.sh" in row["note"]
    assert {r["prompt_len"] for r in doc["long_context"]} == {64, 90}  # 128 clipped to 96 - 6 positions
    assert {r["system"] for r in doc["long_context"]} == {"hf-greedy", "fbs-full-compute", "fbs-tau0.5"}
    assert "| hf-greedy | 1 |" in paths["markdown"].read_text()
    assert paths["plot"] is None or paths["plot"].stat().st_size > 0


def test_validate_names_missing_keys():
    with pytest.raises(ValueError, match="results\\[0\\] lacks 'tflops_rel'"):
        report.validate({"schema": report.SCHEMA_VERSION, **{k: None for k in report.TOP_KEYS if k != "schema"},
                         "results": [{k: None for k in report.RESULT_KEYS if k != "tflops_rel"}],
                         "long_context": []})


def test_cli_registers_bench_with_paper_defaults():
    from fbs.bench.cli import cmd_bench
    from fbs.cli import build_parser

    args = build_parser().parse_args(["bench", "--batch-sizes", "1,4,8", "--taus", "0.6,0.8"])
    assert args.func is cmd_bench
    assert (args.prompt_len, args.new_tokens, args.warmup, args.runs) == (512, 128, 20, 50)
    assert args.batch_sizes == (1, 4, 8) and args.taus == (0.6, 0.8) and args.systems == ("all",)


def test_run_spec_rejects_unknown_systems():
    with pytest.raises(ValueError, match="unknown systems"):
        RunSpec(systems=("hf-greedy", "hydra"))
