"""Loading an FBS model, in one place: a checkpoint, the weights shipped for a bundled base, or fresh modules.

The CLI, the benchmark, evaluation, RL and training all build their model through :func:`load_fbs`;
``FBSForCausalLM.from_pretrained`` is :func:`load_checkpoint`. A checkpoint holds the FBS modules
(``fbs_model.safetensors`` + ``fbs_config.json``) and, after Stage-1, what training changed in the backbone:
LoRA adapters (merged into the weights at load, :mod:`fbs.model.lora`) and trained backbone tensors.

Public entry points:
    shipped_checkpoint(base, variant=None)      the FBS weights shipped in the package for a bundled base, or None
    shipped_variants(base)                      the names of the other shipped weights for that base
    choose_checkpoint(base, checkpoint, shipped)  the checkpoint load_fbs uses (None: fresh modules)
    load_fbs(base, checkpoint, shipped=..., config=..., **overrides)   -> FBSForCausalLM
    load_checkpoint(path, base, tokenizer, check_base=True, check_integrity=True, **overrides) -> FBSForCausalLM
    verify_checkpoint(path)                     the weights files match the checkpoint's integrity record
    changes_backbone(path)                      the checkpoint changes backbone weights (adapters, tensors)

The command-line options that choose a model are :mod:`fbs.cli_args`'s.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torch import nn

from .config import FBSConfig
from .causal_lm import FBSForCausalLM
from .checkpoint import CONFIG_NAME, STRUCTURAL, CheckpointError, changes_backbone, verify_checkpoint  # noqa: F401
from .checkpoint import load_checkpoint as _load_checkpoint
from .bases import DEFAULT_BASE

logger = logging.getLogger(__name__)

#: Trained FBS weights shipped in the package: ``fbs-<bundled base name>`` is the default of that base, shipped only
#: for weights whose default operating point passes the paper's rule in the default weight format (``fbs eval
#: operating-point``); without it the default is a fresh FBS, whose zero-initialised modules leave the base model's
#: outputs unchanged. ``fbs-<base>-<variant>`` are other shipped weights, chosen with ``--checkpoint <variant>``
#: (e.g. ``stage1``: the Stage-1 recipe's model).
ASSETS = Path(__file__).parents[1] / "assets"


def _base_name(base) -> str | None:
    if isinstance(base, nn.Module):
        return getattr(base, "fbs_base_name", None)
    return None if base is None else str(base)


def shipped_checkpoint(base, variant: str | None = None) -> Path | None:
    """The trained FBS weights shipped in the package for a bundled base model (name or loaded instance): its
    default, or the shipped ``variant`` (see :data:`ASSETS`)."""
    name = _base_name(base)
    path = ASSETS / (f"fbs-{name}" if variant is None else f"fbs-{name}-{variant}")
    return path if name and (path / CONFIG_NAME).is_file() else None


def shipped_variants(base) -> list[str]:
    """The variant names of the weights shipped for ``base`` besides its default."""
    name = _base_name(base)
    if not name:
        return []
    prefix = f"fbs-{name}-"
    return sorted(p.name[len(prefix):] for p in ASSETS.glob(prefix + "*") if (p / CONFIG_NAME).is_file())


def choose_checkpoint(base, checkpoint: str | os.PathLike | None = None, shipped: bool = True) -> Path | None:
    """``checkpoint`` if given (a directory, or the name of a variant shipped for ``base`` when no such directory
    exists), else the shipped default for ``base`` (unless ``shipped=False``), else None."""
    if checkpoint is not None:
        path = Path(checkpoint)
        if path.exists():
            return path
        variant = shipped_checkpoint(base, str(checkpoint)) if os.sep not in str(checkpoint) else None
        if variant is None:
            names = shipped_variants(base)
            raise CheckpointError(f"checkpoint {checkpoint} does not exist: pass the directory that save_pretrained "
                                  "or a training export wrote" + (f", or one of the weights shipped for "
                                                                  f"{_base_name(base)}: {', '.join(names)}" if names
                                                                  else ""))
        return variant
    return shipped_checkpoint(base) if shipped else None


def load_checkpoint(path: str | os.PathLike, base=None, tokenizer=None, *, check_base: bool = True,
                    check_integrity: bool = True, **overrides) -> FBSForCausalLM:
    """Load an FBS checkpoint onto its base model; see :func:`fbs.model.checkpoint.load_checkpoint`."""
    return _load_checkpoint(FBSForCausalLM, path, base=base, tokenizer=tokenizer, check_base=check_base,
                            check_integrity=check_integrity, **overrides)


def load_fbs(base=DEFAULT_BASE, checkpoint: str | os.PathLike | None = None, *, shipped: bool = True,
             config: FBSConfig | None = None, tokenizer=None, check_base: bool = True, check_integrity: bool = True,
             **overrides) -> FBSForCausalLM:
    """The FBS model over ``base`` (bundled name, HF directory or HF model instance).

    From ``checkpoint`` if given; else from the weights shipped for a bundled base unless ``shipped=False``;
    else fresh modules built from ``config`` (default ``FBSConfig()``; ignored when a checkpoint is loaded).
    ``overrides`` (tau, kv_policy, never_skip_*) apply in every case; ``check_base`` / ``check_integrity``
    as in :func:`load_checkpoint`.
    """
    ckpt = choose_checkpoint(base, checkpoint, shipped)
    if ckpt is not None:
        logger.info("loading FBS checkpoint %s", ckpt)
        return load_checkpoint(ckpt, base=base, tokenizer=tokenizer, check_base=check_base,
                               check_integrity=check_integrity, **overrides)
    return FBSForCausalLM.from_base(base, config=(config or FBSConfig()).replace(**overrides), tokenizer=tokenizer)
