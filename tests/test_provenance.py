"""Provenance of records: the fields, the commit against git itself, the dirty flag in a scratch repository, and
one writer of each family (bench document, eval record, training checkpoint and metadata) carrying them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

import fbs
from fbs import native
from fbs import provenance as prov

pytestmark = pytest.mark.usefixtures("one_thread")

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git_head(root: Path) -> str:
    """The oracle: what git itself says HEAD is."""
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def assert_provenance(d: dict) -> None:
    """Every field, with its type, and the values this process can check independently."""
    assert set(prov.FIELDS) <= set(d)
    assert isinstance(d["git_commit"], str) and re.fullmatch(r"[0-9a-f]{40}", d["git_commit"])
    assert d["git_commit"] == git_head(Path(fbs.__file__).parent)
    assert isinstance(d["git_dirty"], bool)
    assert d["fbs_version"] is None or isinstance(d["fbs_version"], str)
    assert isinstance(d["cpu"], str) and d["cpu"]
    assert isinstance(d["cpu_flags"], list) and all(isinstance(f, str) for f in d["cpu_flags"])
    assert d["logical_cpus"] == os.cpu_count()
    assert d["torch_threads"] == 1  # the one_thread fixture: read when the record is written
    assert isinstance(d["torch_interop_threads"], int) and d["torch_interop_threads"] >= 1
    assert d["torch"] == torch.__version__ and d["transformers"] == transformers.__version__
    assert isinstance(d["python"], str) and re.fullmatch(r"\d+\.\d+\.\d+.*", d["python"])
    assert re.fullmatch(r"fbs-[0-9a-f]{12}", d["native_build"])
    assert set(d["native"]) >= {"enabled", "loaded", "int8_isa", "build_error"}


@needs_git
def test_fields_and_the_commit_git_reports():
    d = prov.provenance()
    assert_provenance(d)
    assert d["native_build"] == native._build_dir().name == native.build_key()  # the extension's build directory: sources + torch
    json.dumps(d)  # every value serializes as it is


def test_cpu_flags_are_the_isa_flags_proc_cpuinfo_lists():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines()
    flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
    model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    wanted = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni"}
    expected = {f for f in flags if f in wanted or f.startswith("amx_")}
    cpu, got = prov.cpu_info()
    assert cpu == model and set(got) == expected and len(got) == len(expected)
    assert "sse2" not in got  # only the flags that choose kernels


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


@pytest.fixture
def scratch_repo(tmp_path):
    """A git repository holding a copy of this package's provenance module, committed."""
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    shutil.copy(prov.__file__, root / "pkg" / "provenance.py")
    _git(root, "init", "-q")
    _git(root, "add", "pkg/provenance.py")
    _git(root, "commit", "-q", "-m", "one")
    return root


@needs_git
def test_dirty_flag_follows_tracked_files(scratch_repo):
    module = scratch_repo / "pkg" / "provenance.py"
    assert prov.source_root(module) == scratch_repo.resolve()
    assert prov.git_state(scratch_repo) == (git_head(scratch_repo), False)
    (scratch_repo / "pkg" / "untracked.py").write_text("x = 1\n")
    assert prov.git_state(scratch_repo)[1] is False  # untracked files do not make the tree dirty
    assert prov.dirty_files(scratch_repo) == []
    module.write_text(module.read_text() + "\n# edited\n")
    assert prov.git_state(scratch_repo) == (git_head(scratch_repo), True)
    assert prov.dirty_files(scratch_repo) == ["pkg/provenance.py"]  # which file: code or a document
    _git(scratch_repo, "commit", "-q", "-am", "two")
    assert prov.git_state(scratch_repo) == (git_head(scratch_repo), False)
    assert prov.dirty_files(scratch_repo) == []


def test_outside_git_or_without_git_the_fields_are_null(tmp_path, monkeypatch):
    loose = tmp_path / "venv" / "site-packages" / "fbs" / "provenance.py"  # installed from a wheel into a venv
    loose.parent.mkdir(parents=True)
    loose.write_text("")
    (tmp_path / ".git").mkdir()  # ... that sits inside a checkout: the checkout's commit is not the wheel's code
    assert prov.source_root(loose) is None
    assert prov.source_root(tmp_path / "venv" / "x.py") == tmp_path.resolve()
    monkeypatch.setattr(prov, "source_root", lambda start=None: None)
    d = prov.provenance()
    assert d["git_commit"] is None and d["git_dirty"] is None and d["git_dirty_files"] is None
    assert d["fbs_version"] == prov.package_version("fbs") and d["fbs_version"]  # identifies the code instead
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable: the run goes on, the fields are null
    assert prov.git_state(Path(fbs.__file__).parent) == (None, None)


# ------------------------------------------------------------------------------------------- writers


@needs_git
def test_bench_document_records_provenance(tmp_path):
    from fbs.bench.harness import BenchConfig
    from fbs.bench.runner import RunSpec, run, write_outputs
    from transformers import LlamaConfig, LlamaForCausalLM
    from test_bench_report import CFG, ByteTokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG)).eval()
    spec = RunSpec(base="/no/such/tiny-model", systems=("hf-greedy",), batch_sizes=(1,), long_context=(),
                   machine_mb=8, matmul_n=64)
    doc = run(spec, BenchConfig(prompt_len=8, new_tokens=3, warmup=0, runs=1, num_prompts=1), command="test",
              model=model, tok=ByteTokenizer())
    written = json.loads(write_outputs(doc, tmp_path)["json"].read_text())
    assert_provenance(written["environment"])


@needs_git
def test_eval_record_records_provenance(tmp_path, monkeypatch):
    from fbs.cli import main
    from fbs.eval import tasks as T
    from fbs.eval.datasets import MCExample
    from fbs.eval.report import load_record
    from test_eval_adaptive import _patch_base, cli_ffn_scorer

    items = [MCExample(f"toy/{i}", ("the quick brown",) * 2, (" fox", " cat"), gold=i % 2) for i in range(2)]
    monkeypatch.setitem(T.TASKS, "toy", T.TaskSpec("toy", "mc", lambda: items, "toy"))
    scorer = cli_ffn_scorer()
    _patch_base(monkeypatch, scorer.model.base.hf)
    out = tmp_path / "run.json"
    assert main(["eval", "run", "--tasks", "toy", "--no-progress", "--threads", "1", "--system", "ffn-skipllm",
                 "--out", str(out)]) == 0
    rec = load_record(out)
    assert_provenance(rec["runtime"])
    assert rec["runtime"]["seed"] == 42 and "numpy" in rec["runtime"]["versions"]


@needs_git
def test_training_checkpoint_and_metadata_record_provenance(tmp_path):
    from fbs.train.stage1 import META_NAME, Trainer, export
    from conftest import tiny_hf
    from test_train_stage1 import tiny_data, tiny_train_config

    cfg = tiny_train_config(tmp_path, max_steps=1, save_every=1)
    tr = Trainer(cfg, tiny_data(), base=tiny_hf())
    tr.run()
    states = sorted((tmp_path / "run").rglob("trainer_state.json"))
    assert states, "the run saved no checkpoint"
    assert_provenance(json.loads(states[-1].read_text())["provenance"])
    meta = json.loads((export(tr.model, cfg, tmp_path / "final") / META_NAME).read_text())
    assert_provenance(meta["provenance"])


@needs_git
def test_operating_point_record_records_provenance(tmp_path, monkeypatch):
    from fbs.cli import main
    from fbs.eval import operating_point as op
    from conftest import fbs_tiny
    from test_eval_chat import ChatByteTokenizer
    from test_operating_point import _ood_docs

    base = fbs_tiny(seed=1)
    monkeypatch.setattr(op, "load_models", lambda args: (base, ChatByteTokenizer(), lambda: fbs_tiny(seed=1)))
    monkeypatch.setattr(op, "load_ood_docs", lambda tokenizer, args: _ood_docs(n=2))
    out = tmp_path / "op"
    assert main(["eval", "operating-point", "--checkpoint", "CKPT", "--taus", "full", "--families", "ood",
                 "--gate-from", "4", "--threads", "1", "--out-dir", str(out)]) == 0
    rec = json.loads((out / "operating_point.json").read_text())
    assert_provenance(rec["provenance"])
    assert_provenance(rec["runtime"])


#: Modules that write JSON without calling provenance() themselves, and why (a record writer must call provenance()
#: or a function that includes it: fbs.eval.report.runtime_info, fbs.bench.harness.environment).
NOT_RECORDS = {
    "scripts/bench_ab.py": "A/B record: each side's provenance is copied from its own tree's `fbs bench` environment",
    "scripts/ship_checkpoint.py": "the shipped checkpoint's config",
    "src/fbs/baselines/flexidepth.py": "checkpoint config; the training record is fbs.train.flexidepth's",
    "src/fbs/baselines/kangaroo.py": "adapter config; `fbs train kangaroo` passes provenance in its meta",
    "src/fbs/baselines/segatron.py": "checkpoint config and manifest; the training record is fbs.train.segatron's",
    "src/fbs/baselines/specdec.py": "draft config; fbs.train.draft_model passes provenance in its info",
    "src/fbs/data/chat.py": "data (chat conversations)",
    "src/fbs/data/cli.py": "data (corpus statistics, labels)",
    "src/fbs/data/corpus.py": "data (corpus splits and manifest)",
    "src/fbs/eval/chat.py": "the base answers' cache (the chat record is written by fbs.eval.cli with runtime_info)",
    "src/fbs/eval/lm_eval_backend.py": "task data for lm-eval",
    "src/fbs/eval/ood.py": "the OOD block cache",
    "src/fbs/eval/sweep.py": "a calibrated tau written into a checkpoint config",
    "src/fbs/eval/tasks.py": "protocol subset ids",
    "src/fbs/model/bases.py": "converted base model files",
    "src/fbs/model/checkpoint.py": "checkpoint manifest, draft configs (their trainers record provenance in meta)",
    "src/fbs/train/speculative.py": "skip set; fbs.train.cli passes provenance in its meta",
}


def test_every_record_writer_carries_provenance():
    """Every module of the package and of scripts/ that writes JSON either puts provenance in it (calls
    provenance(), runtime_info() or environment()) or is a known non-record writer; a new writer fails here."""
    root = Path(__file__).resolve().parents[1]
    writes = re.compile(r"json\.dump\(|\.write_text\(\s*json\.dumps|\.write\(\s*json\.dumps")
    carries = re.compile(r"\b(provenance|runtime_info|environment)\(")
    files = sorted((root / "src" / "fbs").rglob("*.py")) + sorted((root / "scripts").glob("*.py"))
    missing, stale = [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if not writes.search(text):
            if rel in NOT_RECORDS:
                stale.append(rel)
            continue
        if rel not in NOT_RECORDS and not carries.search(text):
            missing.append(rel)
    assert not missing, f"JSON writers without provenance: {missing}"
    assert not stale, f"NOT_RECORDS lists modules that no longer write JSON: {stale}"
