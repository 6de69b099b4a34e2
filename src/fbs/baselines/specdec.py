"""Speculative decoding with a separate draft model (Leviathan et al. 2023; Chen et al. 2023): the student.

SmolLM2-135M has no smaller sibling with its tokenizer, so the draft is distilled from it: a student of a few of
the target's layers (evenly spaced, first and last included: "every k-th layer"), with the target's embeddings,
final norm and LM head, trained by KL to the target (``fbs train draft-model``, :mod:`fbs.train.draft_model`).
It is a plain HF causal LM of the target's family, saved as an HF directory (``model.safetensors`` +
``config.json``) plus :data:`INFO_NAME` (the layers it copied, the target's base fingerprint, the training recipe)
and the integrity record of FBS checkpoints (:data:`fbs.model.checkpoint.MANIFEST_NAME`).

Decoding: ``model.generate(ids, draft="specdec", draft_options={"model": student})`` (any HF causal LM with the
target's vocabulary works), or ``{"path": DIR}`` (loaded and checked by :func:`load_draft_model`);
``fbs generate --draft specdec --draft-path DIR``.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import torch

INFO_NAME = "draft_model.json"
TRAIN_HINT = "train one with `fbs train draft-model --out-dir DIR`"


def student_layers(num_layers: int, keep: int) -> list[int]:
    """``keep`` of ``num_layers`` layer indices, evenly spaced with the first and the last."""
    if not 1 <= keep <= num_layers:
        raise ValueError(f"a student keeps 1..{num_layers} layers, got {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def student_from_target(target, keep: int):
    """An HF causal LM of the target's family with ``keep`` of its decoder layers (copied, see
    :func:`student_layers`), its embeddings, final norm and LM head. ``target``: an FBSForCausalLM (its backbone is
    copied) or an HF causal LM. Returns (student, copied layer indices)."""
    hf = getattr(getattr(target, "base", None), "hf", target)
    layers = student_layers(hf.config.num_hidden_layers, keep)
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    student = type(hf)(cfg)
    sd = hf.state_dict()
    out = {}
    for k, v in student.state_dict().items():
        src = k
        parts = k.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            parts[i + 1] = str(layers[int(parts[i + 1])])
            src = ".".join(parts)
        out[k] = sd[src].detach().clone()
    student.load_state_dict(out)
    return student.to(next(hf.parameters()).dtype).eval(), layers


def save_draft_model(student, path: str | os.PathLike, info: dict) -> Path:
    """Write the student (HF safetensors), :data:`INFO_NAME` and the integrity record atomically into ``path``."""
    from ..model.checkpoint import MANIFEST_NAME, write_manifest

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-") as tmp:
        student.save_pretrained(tmp, safe_serialization=True)
        Path(tmp, INFO_NAME).write_text(json.dumps(info, indent=1))
        names = [f.name for f in Path(tmp).iterdir() if f.name != MANIFEST_NAME]
        for name in names:
            os.replace(os.path.join(tmp, name), path / name)
    write_manifest(path)
    return path


def load_draft_model(path: str | os.PathLike, target=None, check_base: bool = True):
    """The student saved in ``path``. With ``target`` (an FBSForCausalLM), refuse a student trained for another
    base model (its base fingerprint) unless ``check_base=False``. Every refusal is a
    :class:`fbs.model.CheckpointError` whose message names the command that makes a good one."""
    from transformers import AutoModelForCausalLM

    from ..model.checkpoint import MANIFEST_NAME, manifest_of
    from ..model.errors import CheckpointError

    path = Path(path)
    info_file = path / INFO_NAME
    if not info_file.is_file():
        raise CheckpointError(f"{path} holds no draft model ({INFO_NAME} missing); {TRAIN_HINT}")
    info = json.loads(info_file.read_text())
    record = path / MANIFEST_NAME
    if not record.is_file() or json.loads(record.read_text())["files"] != manifest_of(path)["files"]:
        raise CheckpointError(f"the weights in {path} do not match their integrity record {MANIFEST_NAME}; copy the "
                              f"directory again or {TRAIN_HINT}")
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if target is not None:
        fp = getattr(target.config, "base_fingerprint", None)
        if check_base and info.get("base_fingerprint") != fp:
            raise CheckpointError(f"the draft model in {path} was distilled from another base model (fingerprint "
                                  f"{info.get('base_fingerprint')}, this model's base has {fp}); {TRAIN_HINT}")
        student = student.to(target.base.embedding_weight.device)
    return student


def draft_factory(session, model=None, path=None, check_base: bool = True):
    """``specdec`` with a model object or a saved student (``path``)."""
    from ..engine.drafts import ModelDraft

    if model is None and path is not None:
        model = load_draft_model(path, session.dec.m, check_base)
    return ModelDraft(session, model)
