"""``fbs train ablations`` on a tiny random decoder: each variant's model is what its name says, a 2-step run of
two variants makes the table, a rerun trains and scores nothing again, an interrupted variant resumes, bad names
and incoherent variants are clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from fbs import FBSForCausalLM
from fbs.cli import main
from fbs.eval.sweep import HeldoutDoc
from fbs.train import ablations, stage1
from fbs.train.ablations import (AblationError, EvalSettings, parse_variants, run_ablations, variant,
                                 variant_config)

from conftest import tiny_hf
from test_train_stage1 import tiny_data, tiny_train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def recipe(tmp_path, **kw):
    base = dict(max_steps=2, save_every=1, eval_taus=(), eval_at_start=False, skip_every=2, lambda_compute=0.0)
    cfg = tiny_train_config(tmp_path, **{**base, **kw})
    # gates that start near p = 0.27: tau 0.2 skips at once, so the skip columns are not all zero
    return cfg.with_overrides(["fbs.gate_init_bias=-1.0"])


def model_of(cfg) -> FBSForCausalLM:
    return FBSForCausalLM.from_base(tiny_hf(), config=cfg.fbs_config())


def held_texts(n: int = 3, t: int = 16) -> dict:
    g = torch.Generator().manual_seed(5)
    return {name: [HeldoutDoc(f"{name}{i}", ("en", "zh", "code")[i % 3], torch.randint(0, 200, (t,), generator=g))
                   for i in range(n)] for name in ("ood", "in")}


SETTINGS = EvalSettings(taus=(0.9, 0.2), texts=("ood", "in"), target_skip=0.2, gate_from=4, batch_size=2,
                        calib_tol=0.05, calib_iters=4)


def test_each_variant_is_what_it_claims(tmp_path):
    rec = recipe(tmp_path)
    cfgs = {v.name: variant_config(rec, v, tmp_path / "abl") for v in parse_variants(
        ",".join(ablations.DEFAULT_VARIANTS) + ",gate-both,fixedk3,no-paw")}
    assert set(cfgs) == {*ablations.DEFAULT_VARIANTS, "gate-both", "fixedk3"}  # no-paw is -paw, listed once
    assert cfgs["-paw"].out_dir == str(tmp_path / "abl" / "no-paw") and cfgs["kmax5"].out_dir.endswith("kmax5")

    full = model_of(cfgs["full"])
    assert len(full.paw) == 1 and len(full.ch) == 1 and full.gates.use_preview and full.gates.use_residual
    assert full.layers_cfg.gated and cfgs["full"].skip_every == rec.skip_every

    no_paw = model_of(cfgs["-paw"])
    assert len(no_paw.paw) == 0 and len(no_paw.ch) == 1 and cfgs["-paw"].lambda_paw == 0
    assert not no_paw.gates.use_preview and no_paw.gates.use_residual  # the gates see the residual only

    no_ch = model_of(cfgs["-ch"])
    assert len(no_ch.ch) == 0 and len(no_ch.paw) == 1
    assert cfgs["-ch"].lambda_bios == 0 and cfgs["-ch"].lambda_align == 0

    no_sg = model_of(cfgs["-sg"])
    assert no_sg.layers_cfg.gated == () and len(no_sg.gates.hidden) == 0 and len(no_sg.paw) == 1
    c = cfgs["-sg"]
    assert c.skip_every == 0 and c.lambda_gate == c.lambda_distill == c.lambda_compute == 0

    for k in (5, 9, 25):
        m = model_of(cfgs[f"kmax{k}"])
        assert m.config.k_max == k and m.paw["1"].k_max == k and m.paw["1"].horizon_mix.shape[0] == k
    assert cfgs["fixedk3"].fbs_config().fixed_k == 3

    gr, gp = model_of(cfgs["gate-residual"]), model_of(cfgs["gate-preview"])
    width = gr.config.gate_rank + 1  # residual projection + log relative update, no preview
    assert not gr.gates.use_preview and gr.gates.hidden["1"].in_features == width
    assert gp.gates.resid_proj is None and gp.gates.hidden["1"].in_features == gp.config.preview_rank
    assert model_of(cfgs["gate-both"]).gates.hidden["1"].in_features == width + gp.config.preview_rank


def test_unknown_and_incoherent_variants_are_clear_errors(tmp_path, capsys):
    with pytest.raises(AblationError, match="unknown variant 'kmax'.*kmaxN"):
        parse_variants("full,kmax")
    with pytest.raises(AblationError, match="no variant"):
        parse_variants(" , ")
    assert variant("NO-CH").name == "-ch"
    # a preview-reading gate with no PAW layer is refused, not trained on a zero input
    rec = recipe(tmp_path, fbs={**recipe(tmp_path).fbs, "paw_layers": []})
    with pytest.raises(AblationError, match="gate-preview: gate_input=preview reads the PAW preview"):
        variant_config(rec, variant("gate-preview"), tmp_path)
    with pytest.raises(AblationError, match="kmax99"):
        variant_config(recipe(tmp_path), variant("kmax99"), tmp_path)
    cfg = tmp_path / "r.yaml"
    cfg.write_text("max_steps: 2\n")
    assert main(["train", "ablations", "--config", str(cfg), "--out-dir", str(tmp_path / "o"),
                 "--variants", "full,bogus"]) == 2
    assert "unknown variant 'bogus'" in capsys.readouterr().err


def test_two_variants_make_the_table_and_a_rerun_skips_them(tmp_path, monkeypatch):
    rec = recipe(tmp_path)
    out = tmp_path / "abl"
    texts = held_texts()
    logs: list[str] = []
    report = run_ablations(rec, parse_variants("full,-sg"), out, SETTINGS, data=tiny_data(), texts=texts,
                           base_fn=tiny_hf, log=logs.append)
    assert [r["variant"] for r in report["variants"]] == ["full", "-sg"]
    for r in report["variants"]:
        assert r["train"]["steps"] == 2 and r["train"]["tokens"] == 2 * rec.batch_tokens and r["train"]["wall_s"] > 0
        assert (out / r["dir"] / "final" / "fbs_config.json").is_file()
        for name in ("ood", "in"):
            e = r["eval"]["texts"][name]
            assert [x["tau"] for x in e["taus"]] == [0.9, 0.2] and e["full"]["skip_ratio"] == 0
    full, no_sg = (r["eval"] for r in report["variants"])
    assert full["texts"]["ood"]["taus"][1]["skip_ratio"] > 0 and full["wall_s"] > 0
    assert full["calibration"]["text"] == "ood" and full["texts"]["in"]["matched"]["kind"] == "matched"
    # no gates: every tau is the full-depth pass, and there is nothing to match
    e = no_sg["texts"]["ood"]
    assert all(x["skip_ratio"] == 0 and x["ppl"] == e["full"]["ppl"] for x in e["taus"]) and e["matched"] is None
    assert no_sg["calibration"] is None
    md = (out / "ablations.md").read_text()
    assert json.loads((out / "ablations.json").read_text())["variants"][1]["variant"] == "-sg"
    assert "| full |" in md and "| -sg |" in md and "| base |" in md and "no gates" in md
    assert "## OOD held-out text" in md and "## In-domain held-out text" in md and "tau 0.2: Skip % / PPL" in md

    def boom(*a, **k):
        raise AssertionError("a finished variant was trained or scored again")

    monkeypatch.setattr(stage1, "train", boom)
    monkeypatch.setattr(ablations, "evaluate_variant", boom)
    logs.clear()
    again = run_ablations(rec, parse_variants("full,-sg"), out, SETTINGS, texts=texts, base_fn=tiny_hf,
                          log=logs.append)
    assert again["variants"] == report["variants"]
    assert sum("not retrained" in line for line in logs) == 2
    assert (out / "ablations.md").read_text() == md
    # --eval-only lists what is not trained, and a finished run of another recipe is refused before training
    only = run_ablations(rec, parse_variants("full,kmax5"), out, SETTINGS, train=False, texts=texts, base_fn=tiny_hf,
                         log=logs.append)
    assert only["variants"][1]["train"] is None and "not trained" in (out / "ablations.md").read_text()
    with pytest.raises(AblationError, match="another recipe.*max_steps: 2 -> 3"):
        run_ablations(rec.with_overrides(["max_steps=3"]), parse_variants("full"), out, SETTINGS, texts=texts,
                      base_fn=tiny_hf, log=logs.append)


def test_an_interrupted_variant_resumes_from_its_checkpoint(tmp_path):
    rec = recipe(tmp_path, max_steps=4, save_every=2)
    out = tmp_path / "abl"
    v = variant("-paw")
    cfg = variant_config(rec, v, out)
    data = tiny_data()
    first = stage1.Trainer(cfg, data, base=tiny_hf())
    first.run(stop_after=2)  # the checkpoint of step 2, then "killed"
    logs: list[str] = []
    report = run_ablations(rec, [v], out, EvalSettings(taus=(0.5,), texts=("ood",), target_skip=None, gate_from=4),
                           data=data, texts={"ood": held_texts()["ood"]}, base_fn=tiny_hf, log=logs.append)
    assert any("resuming from step-" in line for line in logs)
    t = report["variants"][0]["train"]
    assert t["steps"] == 4 and t["tokens"] == 4 * rec.batch_tokens
    log = [json.loads(line) for line in (out / "no-paw" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "lm" in r] == [1, 2, 3, 4]  # steps 3 and 4 came from the resumed session



def test_cli_settings_and_driver_defaults(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(ablations, "run_ablations", lambda recipe, variants, out, settings, **kw: seen.update(
        recipe=recipe, variants=variants, out=out, settings=settings, **kw))
    cfg = tmp_path / "r.yaml"
    cfg.write_text("max_steps: 160\neval_taus: [0.9, 0.7, 0.5]\neval_every: 40\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    assert main(["train", "ablations", "--config", str(cfg), "--data", str(corpus), "--out-dir", str(tmp_path / "o"),
                 "--max-steps", "30", "--variants=-paw,kmax5", "--set", "eval_at_start=true"]) == 0
    r, s = seen["recipe"], seen["settings"]
    assert r.max_steps == 30 and r.eval_every == 0 and r.eval_taus == () and r.eval_at_start  # --set wins
    assert [v.name for v in seen["variants"]] == ["-paw", "kmax5"] and seen["train"] and seen["resume"]
    assert s.taus == (0.9, 0.7, 0.5, 0.3) and s.texts == ("ood", "in") and s.corpus == str(corpus)
    assert main(["train", "ablations", "--config", str(cfg), "--out-dir", str(tmp_path / "o"), "--eval-only",
                 "--target-skip", "0", "--taus", "0.5"]) == 0
    s = seen["settings"]
    assert s.texts == ("ood",) and s.target_skip is None and s.taus == (0.5,) and not seen["train"]
