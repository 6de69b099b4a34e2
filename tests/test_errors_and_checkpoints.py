"""Bad input gets a clear error; checkpoints round-trip and refuse a different base model."""

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import fbs_tiny, randomize, tiny_config, tiny_hf
from fbs import CheckpointError, ConfigError, FBSConfig, FBSForCausalLM, UnsupportedArchitectureError
from fbs.model.bases import BaseModelError, resolve_base


def test_unsupported_architecture_names_what_is_supported():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*llama, mistral, qwen2, qwen3"):
        FBSForCausalLM.from_base(gpt2)


def test_prompt_longer_than_context():
    model = fbs_tiny()
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        model.generate(torch.zeros(1, 120, dtype=torch.long), max_new_tokens=16)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_empty_prompt():
    model = fbs_tiny()
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate([[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty"):
        model(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("field,value,msg", [
    ("k_max", 0, "k_max"), ("tau", 1.5, "tau"), ("kv_policy", "drop", "kv_policy"),
    ("paw_compression", "max", "paw_compression"), ("gate_input", "future", "gate_input"),
    ("fixed_k", 99, "fixed_k"), ("preview_top_k", 0, "preview_top_k"),
])
def test_invalid_config_values(field, value, msg):
    with pytest.raises(ConfigError, match=msg):
        FBSConfig(**{field: value})


def test_layer_index_out_of_range():
    with pytest.raises(ConfigError, match="out of range"):
        FBSForCausalLM.from_base(tiny_hf(), config=tiny_config(paw_layers=(9,)))


def test_nan_weights_rejected():
    hf = tiny_hf()
    with torch.no_grad():
        hf.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        FBSForCausalLM.from_base(hf)


def test_missing_base_path():
    with pytest.raises(BaseModelError, match="neither a bundled name"):
        resolve_base("/nonexistent/model")


def test_checkpoint_roundtrip_and_wrong_base(tmp_path):
    model = randomize(fbs_tiny(seed=0))
    ids = torch.randint(0, 255, (1, 16), generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fbs_config.json", "fbs_manifest.json", "fbs_model.safetensors"]
    loaded = FBSForCausalLM.from_pretrained(tmp_path, base=model.base.hf).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    other = tiny_hf(seed=1)
    with pytest.raises(CheckpointError, match="fingerprint"):
        FBSForCausalLM.from_pretrained(tmp_path, base=other)
    # inference-time overrides are allowed, structural ones are not
    assert FBSForCausalLM.from_pretrained(tmp_path, base=model.base.hf, tau=0.8).config.tau == 0.8
    with pytest.raises(CheckpointError, match="structural"):
        FBSForCausalLM.from_pretrained(tmp_path, base=model.base.hf, k_max=4)


def test_malformed_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not an FBS checkpoint"):
        FBSForCausalLM.from_pretrained(tmp_path, base=tiny_hf())
    model = fbs_tiny()
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "fbs_config.json").read_text())
    cfg["warp_drive"] = True
    (tmp_path / "fbs_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown FBSConfig fields"):
        FBSForCausalLM.from_pretrained(tmp_path, base=model.base.hf)


def test_skip_plan_on_never_skip_layer_is_rejected():
    model = fbs_tiny()
    plan = torch.zeros(model.num_layers, dtype=torch.bool)
    plan[0] = True
    with pytest.raises(ValueError, match="never-skip"):
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, skip_plan=plan)
