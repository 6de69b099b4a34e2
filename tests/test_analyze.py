"""`fbs analyze` (fbs.eval.mechanism.analyze_trace): the appendix G report recomputed from a saved trace without a
model equals the decode run's; the trace reads back to the very arrays analysed; the trace, directory and checkpoint
forms of PATH; format-1 traces (no header) and clear errors for what is not a trace."""

import json
import shutil

import numpy as np
import pytest
import torch

from fbs.cli import main
from fbs.data.bios import IdiomLexicon
from fbs.data.chat import ChatItem, write_items
from fbs.eval import mechanism as mech

from conftest import fbs_tiny, randomize
from test_mechanism import WordTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ITEMS = [ChatItem("alpaca_en/0", "en", "Name a colour.", "", "ref"),
         ChatItem("alpaca_zh/0", "zh", "说一种颜色。", "", "ref")]
DECODE = ["--tau", "0.5", "--max-new-tokens", "12", "--batch-size", "2", "--resamples", "50", "--no-progress"]


def _model():
    model = randomize(fbs_tiny(seed=2), seed=3, gate_bias=0.0)
    with torch.no_grad():  # as test_mechanism's end-to-end run: varied greedy answers
        for p in model.base.parameters():
            p.mul_(8)
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One `fbs eval mechanism` run of the tiny random model: (its --out directory, the items file, model)."""
    root = tmp_path_factory.mktemp("analyze")
    write_items(root / "heldout.jsonl", ITEMS)
    model = _model()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mech, "_load_model", lambda args: (model, WordTokenizer()))
        mp.setattr(mech, "_load_lexicon", lambda args: IdiomLexicon(["一帆风顺"]))
        assert main(["eval", "mechanism", "--items", str(root / "heldout.jsonl"), *DECODE,
                     "--out", str(root / "mech")]) == 0
    return root / "mech", root / "heldout.jsonl", model


def _stats(res: dict) -> dict:
    """A report without what differs between two runs of the same statistics (wall time, provenance)."""
    return {k: v for k, v in res.items() if k not in ("wall_s", "source")}


def test_analyze_trace_equals_the_decode_run(run, tmp_path, capsys):
    out, _, _ = run
    decoded = json.loads((out / "mechanism.json").read_text())
    assert decoded["plots"], "the tiny run should plot something"
    assert main(["analyze", str(out / mech.TRACE_NAME), "--out", str(tmp_path / "a")]) == 0
    res = json.loads((tmp_path / "a" / "mechanism.json").read_text())
    assert _stats(res) == _stats(decoded)  # every statistic, CI, p and q: same resamples and seed (the trace's)
    assert res["source"] == {"trace": str(out / mech.TRACE_NAME), "format": 2, "config_from": "the trace header",
                             "notes": []}
    for name in decoded["plots"]:
        assert (tmp_path / "a" / name).stat().st_size > 0
    md = (tmp_path / "a" / "mechanism.md").read_text()
    assert "Recomputed by `fbs analyze`" in md and "## 5. Skip rate around chunk boundaries" in md
    assert md.replace(md.split("\n\n")[2] + "\n\n", "") == (out / "mechanism.md").read_text()  # only that paragraph
    printed = capsys.readouterr().out
    assert "analysing: k_uncertainty" in printed and "wrote " in printed


def test_analyze_directory_with_other_resamples(run, tmp_path):
    out, _, _ = run
    assert main(["analyze", str(out), "--out", str(tmp_path / "b"), "--resamples", "20", "--seed", "3",
                 "--no-plots", "--no-progress", "--threads", "1"]) == 0
    res = json.loads((tmp_path / "b" / "mechanism.json").read_text())
    assert res["config"]["n_resamples"] == 20 and res["config"]["seed"] == 3 and res["plots"] == []
    assert not list((tmp_path / "b").glob("*.png"))
    decoded = json.loads((out / "mechanism.json").read_text())
    assert res["counts"] == decoded["counts"] and res["layers"] == decoded["layers"]  # no bootstrap in these


def test_trace_reads_back_the_analysed_arrays(tmp_path):
    rng = np.random.default_rng(0)
    n, n_layers = 9, 5
    gate_p = rng.random((n, n_layers)).astype(np.float32)
    gate_p[:, [0, 4]] = np.nan
    t = mech.TokenTable(example=np.repeat([0, 2], [5, 4]), position=np.r_[np.arange(5), np.arange(4)],
                        k=rng.integers(-1, 4, n), surprisal=rng.exponential(size=n) * 1e-6,
                        entropy=rng.random(n), entropy_next=rng.random(n), cls=rng.integers(0, 6, n),
                        idiom=rng.random(n) < 0.3, boundary=rng.integers(-1, 2, n),
                        executed=rng.random((n, n_layers)) < 0.7, gate_p=gate_p,
                        rel_update=(rng.random((n, n_layers)) * 30).astype(np.float32),
                        langs=["en", "zh", "zh"], gated=(1, 2, 3), ch_layers=(3,))
    items = [ChatItem(f"x/{i}", lang, "p", "", "r") for i, lang in enumerate(t.langs)]
    answers = [{"prompt_tokens": 3, "tokens": list(range(10)), "text": "t"} for _ in items]
    config = {"tau": 0.5, "layers": n_layers, "gated": [1, 2, 3], "ch_layers": [3], "n_resamples": 30, "seed": 1}
    mech.write_token_file(tmp_path / mech.TRACE_NAME, config, items, answers, t)
    got = mech.read_trace(tmp_path / mech.TRACE_NAME)
    assert got.version == 2 and got.config == config and got.table.langs == t.langs
    assert [e["analysed"] for e in got.examples] == [5, 0, 4]
    for f in ("example", "position", "k", "surprisal", "entropy", "entropy_next", "cls", "idiom", "boundary",
              "executed", "gate_p", "rel_update"):
        a, b = getattr(got.table, f), getattr(t, f)
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f


def test_analyze_checkpoint_decodes_as_eval_mechanism(run, tmp_path, monkeypatch):
    out, items, model = run
    ckpt = model.save_pretrained(tmp_path / "ckpt")
    seen = {}

    def load(args):
        seen.update(checkpoint=args.checkpoint, fresh=args.fresh, model=args.model)
        return _model(), WordTokenizer()

    monkeypatch.setattr(mech, "_load_model", load)
    monkeypatch.setattr(mech, "_load_lexicon", lambda args: IdiomLexicon(["一帆风顺"]))
    assert main(["analyze", str(ckpt), "--out", str(tmp_path / "c"), "--items", str(items), *DECODE,
                 "--no-plots"]) == 0
    assert seen == {"checkpoint": str(ckpt), "fresh": False, "model": None}
    res, decoded = (json.loads((d / "mechanism.json").read_text()) for d in (tmp_path / "c", out))
    assert res["config"]["checkpoint"] == str(ckpt)
    drop = ("checkpoint", "runtime")  # the load average and the checkpoint path differ
    assert {k: v for k, v in res["config"].items() if k not in drop} == \
        {k: v for k, v in decoded["config"].items() if k not in drop}
    assert res["plots"] == [] and not list((tmp_path / "c").glob("*.png"))
    assert {k: v for k, v in _stats(res).items() if k not in ("config", "plots")} == \
        {k: v for k, v in _stats(decoded).items() if k not in ("config", "plots")}
    assert (tmp_path / "c" / mech.TRACE_NAME).read_text().splitlines()[1:] == \
        (out / mech.TRACE_NAME).read_text().splitlines()[1:]


def _format1(src, dst):
    """The trace of ``src`` as format 1 wrote it: no header line, no gate probabilities."""
    lines = [json.loads(x) for x in src.read_text().splitlines()[1:]]
    for x in lines:
        for t in x["tokens"]:
            del t["gate_p"]
    dst.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_format1_trace_needs_its_mechanism_json(run, tmp_path, capsys):
    out, _, _ = run
    old = tmp_path / "old"
    old.mkdir()
    _format1(out / mech.TRACE_NAME, old / mech.TRACE_NAME)
    assert main(["analyze", str(old), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "lacks tau, layers, gated, ch_layers" in err and "format-1" in err and "mechanism.json" in err
    shutil.copy(out / "mechanism.json", old / "mechanism.json")
    assert main(["analyze", str(old), "--out", str(tmp_path / "y"), "--no-plots", "--no-progress"]) == 0
    res, decoded = (json.loads((d / "mechanism.json").read_text()) for d in (tmp_path / "y", out))
    # the gate statistics come from mechanism.json; with them, the same report
    assert {k: v for k, v in _stats(res).items() if k != "plots"} == \
        {k: v for k, v in _stats(decoded).items() if k != "plots"}
    assert res["source"]["format"] == 1 and res["source"]["config_from"] == str(old / "mechanism.json")
    assert "format-1" in res["source"]["notes"][0]
    # another bootstrap: the pooled gate p test cannot be recomputed and leaves the BH family
    assert main(["analyze", str(old), "--out", str(tmp_path / "z"), "--resamples", "20", "--no-plots",
                 "--no-progress"]) == 0
    res = json.loads((tmp_path / "z" / "mechanism.json").read_text())
    assert res["skip_energy"]["pooled_gate_p"]["value"] is None
    assert res["layers"] == decoded["layers"] and res["fdr"]["tests"] == decoded["fdr"]["tests"] - 1
    # a mechanism.json of other prompts is refused
    other = dict(decoded, examples=decoded["examples"][:1])
    (old / "mechanism.json").write_text(json.dumps(other))
    assert main(["analyze", str(old / mech.TRACE_NAME), "--out", str(tmp_path / "w")]) == 2
    assert "its examples differ" in capsys.readouterr().err


def test_analyze_bad_paths_are_clear_errors(run, tmp_path, capsys):
    out, items, _ = run
    cases = {tmp_path / "nowhere": "does not exist; expected a mechanism trace",
             tmp_path: "holds neither a trace (*_tokens.jsonl) nor an FBS checkpoint",
             items: "not a line of a mechanism trace",
             out / "mechanism.md": "is not a trace file; expected a mechanism trace"}
    for path, message in cases.items():
        assert main(["analyze", str(path), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(path) in err and message in err, err
    assert main(["analyze", str(out), "--out", str(tmp_path / "o"), "--tau", "0.3", "--limit", "1"]) == 2
    assert "--limit, --tau: decode options, for a checkpoint PATH" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
