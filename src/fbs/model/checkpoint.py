"""An FBS checkpoint on disk, read in one place: its file names, its integrity record, the config, the FBS
modules' weights and what Stage-1 changed in the backbone (LoRA adapters merged at load, :mod:`fbs.model.lora`,
and trained tensors).

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

from .bases import sha256_file, sha256_record
from .config import FBSConfig
from .errors import CheckpointError, read_tensors
from .lora import ADAPTERS_NAME, DEFAULT_TARGETS, load_adapters, merge_adapters

logger = logging.getLogger(__name__)

CONFIG_NAME = "fbs_config.json"
WEIGHTS_NAME = "fbs_model.safetensors"
BACKBONE_NAME = "backbone_trainable.safetensors"  # Stage-1 trained backbone tensors (not adapters)
#: The integrity record of a checkpoint: size and sha256 of each of its weights files (``*.safetensors``).
MANIFEST_NAME = "fbs_manifest.json"

#: Config fields that fix tensor shapes or wiring: a trained checkpoint's values cannot be overridden.
STRUCTURAL = frozenset({"k_max", "paw_layers", "ch_layers", "preview_vocab_size", "preview_rank", "chunk_rank",
                        "gate_rank", "gate_width", "gate_input", "gate_prev_skip", "paw_compression",
                        "paw_conv_groups"})


def manifest_of(path: str | os.PathLike) -> dict:
    """The integrity record of the checkpoint directory ``path``: every ``*.safetensors`` file in it with its
    size in bytes and sha256."""
    return {"format": "fbs-manifest/1", "files": sha256_record(path)}


def write_manifest(path: str | os.PathLike) -> Path:
    """Record the size and sha256 of every weights file of the checkpoint at ``path`` (atomically, replacing any
    earlier record). Call it after adding or changing a weights file (adapters, backbone tensors) so the
    checkpoint loads: :func:`load_checkpoint` refuses weights files the record does not vouch for."""
    path = Path(path)
    tmp = path / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest_of(path), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / MANIFEST_NAME)
    return path / MANIFEST_NAME


def save_module_dir(path: str | os.PathLike, state: dict[str, torch.Tensor], info: dict, weights_name: str,
                    config_name: str) -> Path:
    """Write a small trained module (a draft head or layer): its tensors as safetensors and ``info`` as JSON beside
    them, both replaced atomically, then the integrity record (:func:`write_manifest`)."""
    import tempfile

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-") as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, os.path.join(tmp, weights_name),
                  metadata={"format": "pt"})
        Path(tmp, config_name).write_text(json.dumps(info, indent=1))
        for name in (weights_name, config_name):
            os.replace(os.path.join(tmp, name), path / name)
    write_manifest(path)
    return path


def read_module_dir(path: str | os.PathLike, weights_name: str, config_name: str, what: str,
                    hint: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(info, tensors) of a directory :func:`save_module_dir` wrote. A missing file or weights that the integrity
    record does not vouch for raise :class:`CheckpointError` naming ``what`` the directory should hold and ``hint``."""
    path = Path(path)
    if not (path / config_name).is_file() or not (path / weights_name).is_file():
        raise CheckpointError(f"{path} holds no {what} ({config_name}, {weights_name}); {hint}")
    record = path / MANIFEST_NAME
    if not record.is_file() or json.loads(record.read_text())["files"] != manifest_of(path)["files"]:
        raise CheckpointError(f"the weights in {path} do not match their integrity record {MANIFEST_NAME}; copy "
                              f"the directory again or {hint}")
    return json.loads((path / config_name).read_text()), read_tensors(path / weights_name, hint)


def changes_backbone(path: str | os.PathLike) -> bool:
    """The checkpoint at ``path`` changes backbone weights: LoRA adapters or trained backbone tensors."""
    path = Path(path)
    return (path / ADAPTERS_NAME).is_file() or (path / BACKBONE_NAME).is_file()


def _read_config(path: Path) -> FBSConfig:
    cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_file.is_file() or not w_file.is_file():
        raise CheckpointError(f"{path} is not an FBS checkpoint: expected {CONFIG_NAME} and {WEIGHTS_NAME}; pass the "
                              "directory that save_pretrained (or a training export) wrote")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}): the file is damaged or was edited by hand; "
                              "restore the config saved with the weights") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file} holds a JSON {type(raw).__name__}, not an object of FBSConfig fields; "
                              "restore the config saved with the weights")
    try:
        return FBSConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file} is malformed: {e}; restore the config saved with the weights") from e


def _integrity_fix(path: Path) -> str:
    return (f"if you trust the files, record them with `python -c \"from fbs.model.checkpoint import write_manifest; "
            f"write_manifest('{path}')\"` or load with check_integrity=False (CLI: --no-integrity-check)")


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Refuse a checkpoint whose weights files do not match its integrity record (:data:`MANIFEST_NAME`,
    written by ``save_pretrained`` and :func:`write_manifest`): a file listed there that is missing, of
    another size (truncated) or with another sha256 (modified), a weights file the loader reads that is not
    listed, or no record at all. Raises :class:`CheckpointError`."""
    path = Path(path)
    record = path / MANIFEST_NAME
    if not record.is_file():
        raise CheckpointError(f"{path} has no integrity record ({MANIFEST_NAME}), so its weights cannot be verified "
                              f"(it was saved before checkpoints recorded sha256s, or the record was deleted); "
                              f"{_integrity_fix(path)}")
    try:
        files = json.loads(record.read_text())["files"]
        expected = {name: (int(r["bytes"]), str(r["sha256"])) for name, r in files.items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{record} is malformed ({e!r}); {_integrity_fix(path)}") from e
    unlisted = [n for n in (WEIGHTS_NAME, ADAPTERS_NAME, BACKBONE_NAME) if (path / n).is_file() and n not in expected]
    if unlisted:
        raise CheckpointError(f"{path}: weights files {unlisted} are not in its integrity record ({MANIFEST_NAME}): "
                              f"they were added or renamed after the checkpoint was saved; {_integrity_fix(path)}")
    for name, (size, digest) in sorted(expected.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing but listed in {MANIFEST_NAME}: the checkpoint was copied "
                                  "incompletely; copy the whole directory again")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f} is truncated or damaged: {f.stat().st_size} bytes, the integrity record says "
                                  f"{size}; copy or download the checkpoint again")
        actual = sha256_file(f)
        if actual != digest:
            raise CheckpointError(f"{f} was modified after it was saved: sha256 {actual}, the integrity record says "
                                  f"{digest}; restore the original file (or {_integrity_fix(path)})")


def _check_base(path: Path, cfg: FBSConfig, fingerprint: str | None) -> None:
    """The checkpoint records the fingerprint of the base it was trained on, and the given base's ``fingerprint``
    equals it (None: the base is not loaded yet; only the record is checked)."""
    optout = "load with check_base=False (CLI: --no-base-check) only if you know the base is the right one"
    if not cfg.base_fingerprint:
        raise CheckpointError(
            f"checkpoint {path} records no base_fingerprint in {CONFIG_NAME}, so nothing shows it belongs to the "
            f"given base model; restore the config saved with the weights, or {optout}")
    if fingerprint is not None and fingerprint != cfg.base_fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was trained on base {cfg.base_model!r} (fingerprint {cfg.base_fingerprint}), "
            f"but the given base has fingerprint {fingerprint}; load it with the base it was made for, or {optout}"
        )


def _check_tensors(file: Path, sd: dict[str, torch.Tensor], model) -> None:
    """The tensors in ``file`` are exactly the FBS modules the config builds, with their shapes."""
    want = {k: tuple(v.shape) for k, v in model.fbs_state_dict().items()}
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    shapes = [f"{k}: file {tuple(sd[k].shape)}, model {want[k]}" for k in sorted(set(want) & set(sd))
              if tuple(sd[k].shape) != want[k]]
    if missing or unexpected or shapes:
        problems = [f"missing tensors {missing}" if missing else "", f"unexpected tensors {unexpected}" if unexpected
                    else "", f"shape mismatches [{'; '.join(shapes)}]" if shapes else ""]
        raise CheckpointError(
            f"{file} does not match the modules that {CONFIG_NAME} and the base model build: "
            f"{', '.join(p for p in problems if p)}; the config was changed after saving or the weights belong to "
            "another checkpoint: restore the config saved with these weights")


def load_checkpoint(cls, path: str | os.PathLike, base=None, tokenizer=None, *, check_base: bool = True,
                    check_integrity: bool = True, **overrides):
    """Load an FBS checkpoint onto its base model (``base`` defaults to the name recorded in it).

    ``base`` may be a name, a directory or an HF model instance. An instance is shared (no copy) unless the
    checkpoint changes backbone weights (Stage-1 adapters or trained tensors): then the model works on a
    deep copy, so the caller's model keeps computing the base model. Adapters are merged into the weights
    (no decode overhead). ``overrides`` replace inference-time config fields (tau, kv_policy, never_skip_*).

    Refused with :class:`CheckpointError`: a malformed config; weights files that do not match the integrity
    record (:func:`verify_checkpoint`; ``check_integrity=False`` skips it); a checkpoint without a base
    fingerprint or with another base's (``check_base=False`` skips this check); missing, unexpected or
    misshapen tensors; unreadable safetensors files. ``cls``: the model class
    (:class:`fbs.model.causal_lm.FBSForCausalLM`), built with ``cls.from_base``."""
    path = Path(path)
    cfg = _read_config(path)
    bad = sorted(set(overrides) & STRUCTURAL)
    if bad:
        raise CheckpointError(f"cannot override structural fields {bad} when loading a trained checkpoint")
    if check_integrity:
        verify_checkpoint(path)
    else:
        logger.warning("%s: integrity check skipped (check_integrity=False)", path)
    if check_base:
        _check_base(path, cfg, None)  # a checkpoint without a fingerprint is refused before any base is loaded
    else:
        logger.warning("%s: base-model check skipped (check_base=False)", path)
    if isinstance(base, nn.Module) and changes_backbone(path):
        # FBS calls the base's own modules: applying adapters or trained tensors to the caller's model would
        # silently change it (e.g. a benchmark's HF baseline running this checkpoint's adapters).
        logger.info("%s changes the backbone: loading it onto a copy of the given base model", path)
        base = copy.deepcopy(base)
    if base is None and not cfg.base_model:
        raise CheckpointError(f"checkpoint {path} records no base_model in {CONFIG_NAME}; pass the base model "
                              "it was trained on (base=...; CLI: --model)")
    model = cls.from_base(base if base is not None else cfg.base_model, config=cfg, tokenizer=tokenizer)
    if check_base:
        _check_base(path, cfg, model.config.base_fingerprint)
    w_file = path / WEIGHTS_NAME
    sd = read_tensors(w_file)
    _check_tensors(w_file, sd, model)
    missing, unexpected = _load_fbs_state(model, sd)
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
    meta = model.config.extra.get("stage1", {})
    if (path / ADAPTERS_NAME).is_file():
        load_adapters(model, path, meta.get("lora_rank", 8), meta.get("lora_alpha", 16.0),
                      tuple(meta.get("lora_targets", ())) or DEFAULT_TARGETS)
        merge_adapters(model.base.layers)
    backbone = path / BACKBONE_NAME
    if backbone.is_file():
        sd, own = read_tensors(backbone), model.state_dict()
        unknown = sorted(set(sd) - set(own))
        shapes = [f"{k}: file {tuple(v.shape)}, model {tuple(own[k].shape)}" for k, v in sorted(sd.items())
                  if k in own and v.shape != own[k].shape]
        if unknown or shapes:
            raise CheckpointError(f"{backbone} does not fit this backbone: unknown tensors {unknown[:5]}, shape "
                                  f"mismatches {shapes[:5]}; it was trained on another base model: load the "
                                  "checkpoint with the base it was made for")
        model.load_state_dict(sd, strict=False)
