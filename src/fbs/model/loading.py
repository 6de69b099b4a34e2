"""Loading an FBS model, in one place: a checkpoint, the weights shipped for a bundled base, or fresh modules.

The CLI, the benchmark, evaluation, RL and training all build their model through :func:`load_fbs`;
``FBSForCausalLM.from_pretrained`` is :func:`load_checkpoint`. A checkpoint holds the FBS modules
(``fbs_model.safetensors`` + ``fbs_config.json``) and, after Stage-1, what training changed in the backbone:
LoRA adapters (merged into the weights at load, :mod:`fbs.model.lora`) and trained backbone tensors.

Public entry points:
    shipped_checkpoint(base)                    the FBS weights shipped in the package for a bundled base, or None
    choose_checkpoint(base, checkpoint, shipped)  the checkpoint load_fbs uses (None: fresh modules)
    load_fbs(base, checkpoint, shipped=..., config=..., **overrides)   -> FBSForCausalLM
    load_checkpoint(path, base, tokenizer, **overrides)                -> FBSForCausalLM
    changes_backbone(path)                      the checkpoint changes backbone weights (adapters, tensors)
    add_model_arguments(parser) / load_from_args(args)   the model options shared by every ``fbs`` command
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from .config import FBSConfig
from .lora import ADAPTERS_NAME, DEFAULT_TARGETS, load_adapters, merge_adapters
from .causal_lm import BACKBONE_NAME, CONFIG_NAME, WEIGHTS_NAME, CheckpointError, FBSForCausalLM
from .bases import DEFAULT_BASE

logger = logging.getLogger(__name__)

#: Trained FBS weights shipped in the package, one directory ``fbs-<bundled base name>`` each.
ASSETS = Path(__file__).parents[1] / "assets"

#: Config fields that fix tensor shapes or wiring: a trained checkpoint's values cannot be overridden.
STRUCTURAL = frozenset({"k_max", "paw_layers", "ch_layers", "preview_vocab_size", "preview_rank", "chunk_rank",
                        "gate_rank", "gate_width", "gate_input", "gate_prev_skip", "paw_compression",
                        "paw_conv_groups"})


def _base_name(base) -> str | None:
    if isinstance(base, nn.Module):
        return getattr(base, "fbs_base_name", None)
    return None if base is None else str(base)


def shipped_checkpoint(base) -> Path | None:
    """The trained FBS weights shipped in the package for a bundled base model (name or loaded instance)."""
    name = _base_name(base)
    path = ASSETS / f"fbs-{name}"
    return path if name and (path / CONFIG_NAME).is_file() else None


def choose_checkpoint(base, checkpoint: str | os.PathLike | None = None, shipped: bool = True) -> Path | None:
    """``checkpoint`` if given, else the shipped weights for ``base`` (unless ``shipped=False``), else None."""
    if checkpoint is not None:
        return Path(checkpoint)
    return shipped_checkpoint(base) if shipped else None


def load_fbs(base=DEFAULT_BASE, checkpoint: str | os.PathLike | None = None, *, shipped: bool = True,
             config: FBSConfig | None = None, tokenizer=None, **overrides) -> FBSForCausalLM:
    """The FBS model over ``base`` (bundled name, HF directory or HF model instance).

    From ``checkpoint`` if given; else from the weights shipped for a bundled base unless ``shipped=False``;
    else fresh modules built from ``config`` (default ``FBSConfig()``; ignored when a checkpoint is loaded).
    ``overrides`` (tau, kv_policy, never_skip_*) apply in every case.
    """
    ckpt = choose_checkpoint(base, checkpoint, shipped)
    if ckpt is not None:
        logger.info("loading FBS checkpoint %s", ckpt)
        return load_checkpoint(ckpt, base=base, tokenizer=tokenizer, **overrides)
    return FBSForCausalLM.from_base(base, config=(config or FBSConfig()).replace(**overrides), tokenizer=tokenizer)


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


def load_checkpoint(path: str | os.PathLike, base=None, tokenizer=None, **overrides) -> FBSForCausalLM:
    """Load an FBS checkpoint onto its base model (``base`` defaults to the name recorded in it).

    ``base`` may be a name, a directory or an HF model instance. An instance is shared (no copy) unless the
    checkpoint changes backbone weights (Stage-1 adapters or trained tensors): then the model works on a
    deep copy, so the caller's model keeps computing the base model. Adapters are merged into the weights
    (no decode overhead). ``overrides`` replace inference-time config fields (tau, kv_policy, never_skip_*)."""
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
    model = FBSForCausalLM.from_base(base if base is not None else cfg.base_model, config=cfg, tokenizer=tokenizer)
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


def _load_fbs_state(model: FBSForCausalLM, sd: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
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


def _apply_backbone_deltas(model: FBSForCausalLM, path: Path) -> None:
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


# --------------------------------------------------------------------------- command-line options


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options that choose a model: base, checkpoint or shipped weights or fresh modules, tau, KV policy."""
    p.add_argument("--model", default=DEFAULT_BASE,
                   help="base model: a bundled name (smollm2-135m, qwen2.5-coder-0.5b) or an HF directory")
    p.add_argument("--checkpoint", help="FBS checkpoint directory (default: the weights shipped for --model)")
    p.add_argument("--fresh", action="store_true", help="ignore shipped weights: untrained FBS modules")
    p.add_argument("--tau", type=float, help="skip threshold (default: the checkpoint's operating point)")
    p.add_argument("--kv-policy", choices=("hole", "project"), help="KV cache policy for skipped layers")


def load_from_args(args: argparse.Namespace) -> FBSForCausalLM:
    """The model :func:`add_model_arguments`' options ask for."""
    overrides = {k: v for k, v in (("tau", args.tau), ("kv_policy", args.kv_policy)) if v is not None}
    return load_fbs(args.model, args.checkpoint, shipped=not args.fresh, **overrides)
