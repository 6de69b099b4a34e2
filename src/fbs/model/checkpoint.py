"""An FBS checkpoint on disk, read in one place: its file names, the config, the FBS modules' weights and what
Stage-1 changed in the backbone (LoRA adapters merged at load, :mod:`fbs.model.lora`, and trained tensors).

:func:`load_checkpoint` builds the model with the class it is given (``FBSForCausalLM.from_pretrained`` passes
its own), so this module does not import the model.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from .config import FBSConfig
from .lora import ADAPTERS_NAME, DEFAULT_TARGETS, load_adapters, merge_adapters

logger = logging.getLogger(__name__)

CONFIG_NAME = "fbs_config.json"
WEIGHTS_NAME = "fbs_model.safetensors"
BACKBONE_NAME = "backbone_trainable.safetensors"  # Stage-1 trained backbone tensors (not adapters)


class CheckpointError(ValueError):
    """An FBS checkpoint is missing, malformed or made for another base model."""


#: Config fields that fix tensor shapes or wiring: a trained checkpoint's values cannot be overridden.
STRUCTURAL = frozenset({"k_max", "paw_layers", "ch_layers", "preview_vocab_size", "preview_rank", "chunk_rank",
                        "gate_rank", "gate_width", "gate_input", "gate_prev_skip", "paw_compression",
                        "paw_conv_groups"})


def changes_backbone(path: str | os.PathLike) -> bool:
    """The checkpoint at ``path`` changes backbone weights: LoRA adapters or trained backbone tensors."""
    path = Path(path)
    return (path / ADAPTERS_NAME).is_file() or (path / BACKBONE_NAME).is_file()


def _read_config(path: Path) -> FBSConfig:
    cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_file.is_file() or not w_file.is_file():
        raise CheckpointError(f"{path} is not an FBS checkpoint: expected {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        return FBSConfig.from_dict(json.loads(cfg_file.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file} is malformed: {e}") from e


def load_checkpoint(cls, path: str | os.PathLike, base=None, tokenizer=None, **overrides):
    """Load an FBS checkpoint onto its base model (``base`` defaults to the name recorded in it).

    ``base`` may be a name, a directory or an HF model instance. An instance is shared (no copy) unless the
    checkpoint changes backbone weights (Stage-1 adapters or trained tensors): then the model works on a
    deep copy, so the caller's model keeps computing the base model. Adapters are merged into the weights
    (no decode overhead). ``overrides`` replace inference-time config fields (tau, kv_policy, never_skip_*).
    ``cls``: the model class (:class:`fbs.model.causal_lm.FBSForCausalLM`), built with ``cls.from_base``."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = _read_config(path)
    bad = sorted(set(overrides) & STRUCTURAL)
    if bad:
        raise CheckpointError(f"cannot override structural fields {bad} when loading a trained checkpoint")
    if isinstance(base, nn.Module) and changes_backbone(path):
        # FBS calls the base's own modules: applying adapters or trained tensors to the caller's model would
        # silently change it (e.g. a benchmark's HF baseline running this checkpoint's adapters).
        logger.info("%s changes the backbone: loading it onto a copy of the given base model", path)
        base = copy.deepcopy(base)
    model = cls.from_base(base if base is not None else cfg.base_model, config=cfg, tokenizer=tokenizer)
    if cfg.base_fingerprint and model.config.base_fingerprint != cfg.base_fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was trained on base {cfg.base_model!r} (fingerprint {cfg.base_fingerprint}), "
            f"but the given base has fingerprint {model.config.base_fingerprint}; load it with the base it was made for"
        )
    w_file = path / WEIGHTS_NAME
    missing, unexpected = _load_fbs_state(model, load_file(w_file))
    if missing or unexpected:
        raise CheckpointError(f"{w_file} does not match the config: missing {missing}, unexpected {unexpected}")
    _apply_backbone_deltas(model, path)
    if overrides:
        model.configure(**overrides)
    return model


def _load_fbs_state(model, sd: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load PAW, CH, SG weights and the preview vocabulary; returns (missing, unexpected) keys."""
    missing, unexpected = [], []
    if "preview_ids" in sd:
        model.set_preview_vocab(sd.pop("preview_ids"))
    else:
        missing.append("preview_ids")
    for prefix, mod in (("paw.", model.paw), ("ch.", model.ch), ("gates.", model.gates)):
        part = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        res = mod.load_state_dict(part, strict=False)
        missing += [prefix + k for k in res.missing_keys]
        unexpected += [prefix + k for k in res.unexpected_keys]
    unexpected += [k for k in sd if not k.startswith(("paw.", "ch.", "gates."))]
    return missing, unexpected


def _apply_backbone_deltas(model, path: Path) -> None:
    """Apply what Stage-1 trained in the backbone, if the checkpoint has it: LoRA adapters
    (``adapters.safetensors``, merged into the weights) and other trained backbone tensors
    (``backbone_trainable.safetensors``). Only called on a base the model owns."""
    from safetensors.torch import load_file

    meta = model.config.extra.get("stage1", {})
    if (path / ADAPTERS_NAME).is_file():
        load_adapters(model, path, meta.get("lora_rank", 8), meta.get("lora_alpha", 16.0),
                      tuple(meta.get("lora_targets", ())) or DEFAULT_TARGETS)
        merge_adapters(model.base.layers)
    backbone = path / BACKBONE_NAME
    if backbone.is_file():
        res = model.load_state_dict(load_file(str(backbone)), strict=False)
        if res.unexpected_keys:
            raise CheckpointError(f"{backbone} has unknown tensors {res.unexpected_keys[:5]}")
