"""fbs.model.loading: which weights load_fbs picks (checkpoint > shipped > fresh), overrides, the CLI options, and the
LoRA merge done by the core alone."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from fbs import FBSConfig, FBSForCausalLM
from fbs import cli_args
from fbs.model import loading
from fbs.model.checkpoint import write_manifest
from fbs.model.lora import ADAPTERS_NAME, LoRALinear, add_adapters

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
           eos_token_id=255, bos_token_id=0, pad_token_id=0)
SMALL = dict(k_max=4, preview_vocab_size=48, preview_top_k=8, preview_rank=16, chunk_rank=16, chunk_cache_size=4,
             gate_rank=8, gate_width=8, paw_layers=(0,), ch_layers=(3,), never_skip_first=1, never_skip_last=1)


def tiny_hf(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CFG)).eval()


def test_fresh_modules_from_config_with_overrides():
    m = loading.load_fbs(tiny_hf(), shipped=False, config=FBSConfig(**SMALL), tau=0.7, kv_policy="hole")
    assert (m.config.tau, m.config.kv_policy, m.config.k_max) == (0.7, "hole", 4)


def test_shipped_weights_are_found_by_name_or_loaded_instance(tmp_path):
    path = loading.shipped_checkpoint("smollm2-135m", "stage1")
    assert path is not None and (path / "fbs_config.json").is_file()
    hf = tiny_hf()
    assert loading.shipped_checkpoint(hf, "stage1") is None  # an instance without a bundled name
    hf.fbs_base_name = "smollm2-135m"
    assert loading.shipped_checkpoint(hf, "stage1") == path
    assert loading.shipped_checkpoint("no-such-model") is None
    # no default weights ship for SmolLM2 (none passes the operating-point rule in the default format): fresh
    assert loading.shipped_checkpoint("smollm2-135m") is None
    assert loading.choose_checkpoint("smollm2-135m") is None
    assert loading.choose_checkpoint("smollm2-135m", "stage1") == path
    assert loading.choose_checkpoint("smollm2-135m", shipped=False) is None
    assert loading.choose_checkpoint("smollm2-135m", tmp_path) == tmp_path


def test_shipped_variants_by_name_and_a_missing_checkpoint_names_them(tmp_path, monkeypatch):
    assets = tmp_path / "assets"
    for name in ("fbs-m", "fbs-m-stage1", "fbs-m-other", "fbs-n-stage1"):
        (assets / name).mkdir(parents=True)
        (assets / name / "fbs_config.json").write_text("{}")
    (assets / "fbs-m-broken").mkdir()  # no config: not a shipped checkpoint
    monkeypatch.setattr(loading, "ASSETS", assets)
    assert loading.shipped_variants("m") == ["other", "stage1"]
    assert loading.shipped_checkpoint("m") == assets / "fbs-m"
    assert loading.shipped_checkpoint("m", "stage1") == assets / "fbs-m-stage1"
    assert loading.choose_checkpoint("m", "stage1") == assets / "fbs-m-stage1"
    # a directory of that name wins over the shipped variant
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stage1").mkdir()
    assert loading.choose_checkpoint("m", "stage1") == Path("stage1")
    with pytest.raises(loading.CheckpointError, match=r"checkpoint nope does not exist: .* shipped for m: other, "
                                                      r"stage1"):
        loading.choose_checkpoint("m", "nope")
    with pytest.raises(loading.CheckpointError, match=r"checkpoint /no/such/dir does not exist: pass the directory"):
        loading.choose_checkpoint("m", "/no/such/dir")


def _checkpoint_with_adapters(tmp_path):
    """An FBS checkpoint plus LoRA adapters with non-zero B, written with the core's pieces only."""
    model = FBSForCausalLM.from_base(tiny_hf(), config=FBSConfig(**SMALL)).eval()
    add_adapters(model.base.layers, rank=4, alpha=8.0, targets=("q_proj", "down_proj"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_b" in n:
                p.normal_(0, 0.05)
    model.config = model.config.replace(extra={"stage1": {"lora_rank": 4, "lora_alpha": 8.0,
                                                          "lora_targets": ["q_proj", "down_proj"]}})
    model.save_pretrained(tmp_path)
    save_file({k: v.detach().contiguous() for k, v in model.named_parameters() if "lora_" in k},
              str(tmp_path / ADAPTERS_NAME))
    write_manifest(tmp_path)  # the adapters were added after save_pretrained recorded the weights files
    return model


def test_checkpoint_adapters_merged_on_a_private_copy(tmp_path):
    adapted = _checkpoint_with_adapters(tmp_path)
    caller = tiny_hf()
    before = {k: v.clone() for k, v in caller.state_dict().items()}
    loaded = loading.load_fbs(caller, tmp_path, tau=0.9)  # a checkpoint wins over anything shipped
    ids = torch.randint(1, 200, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, gate_mode="off").logits, adapted(ids, gate_mode="off").logits)
    assert loaded.config.tau == 0.9
    assert not any(isinstance(m, LoRALinear) for m in loaded.modules())  # merged: no decode overhead
    assert all(torch.equal(before[k], v) for k, v in caller.state_dict().items())  # caller's model untouched
    assert loading.changes_backbone(tmp_path)


def test_structural_override_refused(tmp_path):
    FBSForCausalLM.from_base(tiny_hf(), config=FBSConfig(**SMALL)).save_pretrained(tmp_path)
    with pytest.raises(loading.CheckpointError, match="structural"):
        loading.load_checkpoint(tmp_path, base=tiny_hf(), k_max=2)
    assert not loading.changes_backbone(tmp_path)


def test_command_line_options(monkeypatch):
    calls = []
    monkeypatch.setattr(loading, "load_fbs", lambda *a, **kw: calls.append((a, kw)))
    p = argparse.ArgumentParser()
    cli_args.add_model_arguments(p)
    cli_args.load_from_args(p.parse_args(["--model", "some/dir", "--fresh", "--tau", "0.8"]))
    cli_args.load_from_args(p.parse_args(["--checkpoint", "ck", "--kv-policy", "hole"]))
    assert calls == [(("some/dir", None), {"shipped": False, "tau": 0.8}),
                     (("smollm2-135m", "ck"), {"shipped": True, "kv_policy": "hole"})]
