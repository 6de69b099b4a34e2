"""Atomic, pickle-free training checkpoints: safetensors for tensors, JSON for everything else.

A checkpoint is a directory ``step-{step:08d}`` holding

* ``trainable.safetensors``  the trainable parameters by name (``model.named_parameters()``),
* ``optimizer.safetensors``  the optimizer's per-parameter tensors, keyed ``{index}.{name}``,
* ``rng.safetensors``        torch CPU (and CUDA) RNG states plus named ``torch.Generator`` states,
* ``trainer_state.json``     step, data position, optimizer param groups, Python RNG state, config, the
                             size and sha256 of each ``.safetensors`` file (verified on load), and the
                             :func:`fbs.provenance.provenance` of the run (commit, machine, versions).

It is written into a temporary sibling and renamed into place, then ``latest`` (a one-line file naming
the directory) is replaced atomically, so a crash at any moment leaves the previous checkpoint intact.
Under ``torch.distributed`` only rank 0 writes (parameters and optimizer state are replicated under DDP);
a call on another rank is refused, so two writers can never race on one directory. Leftovers of a writer
that died (``.tmp-*``, ``.old-*``) are removed by the next save.
The learning-rate schedule is a pure function of the step, so it needs no state of its own.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..model.checkpoint import CheckpointError
from ..model.bases import sha256_file, sha256_record
from ..provenance import provenance

logger = logging.getLogger(__name__)

LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    # JSON turned tuples (betas) into lists; restore them so the groups equal the saved ones
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in meta["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(root: str | os.PathLike, step: int, params: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any],
                    rng: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically and prune all but the newest ``keep``.

    ``rng`` is a :func:`capture_rng` snapshot taken when the step began, so a checkpoint written on an
    interrupt in the middle of a step resumes exactly at that step's start."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        raise RuntimeError(f"save_checkpoint called on rank {torch.distributed.get_rank()}: only rank 0 writes "
                           "checkpoints")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:  # a writer died mid-save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in params.items()}, str(tmp / "trainable.safetensors"))
    opt_tensors, opt_meta = _optimizer_tensors(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file(rng["tensors"], str(tmp / "rng.safetensors"))
    state = {**trainer_state, "step": step, "optimizer": opt_meta, "python_random": rng["python"],
             "files": sha256_record(tmp), "provenance": provenance()}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # re-saving the same step (e.g. interrupt right after a periodic save)
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _write_latest(root, final.name)
    _fsync_dir(root)
    _prune(root, keep)
    logger.info("saved checkpoint %s", final)
    return final


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Snapshot of every RNG the trainer uses: torch CPU/CUDA, the named generators, Python's random."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    for name, g in (generators or {}).items():
        tensors[f"gen.{name}"] = g.get_state()
    return {"tensors": tensors, "python": _py_random_state()}


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / LATEST)


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in steps[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    root = Path(root)
    f = root / LATEST
    if not f.is_file():
        return None
    path = root / f.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


def load_checkpoint(path: str | os.PathLike, named_params: dict[str, torch.nn.Parameter],
                    optimizer: torch.optim.Optimizer, generators: dict[str, torch.Generator] | None = None,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Restore parameters, optimizer and RNG states in place; returns the trainer state dict.

    A damaged checkpoint (malformed state, a file whose size or sha256 differs from the recorded one, an
    unreadable safetensors file) or one of another trainable set raises :class:`fbs.model.checkpoint.CheckpointError`."""
    path = Path(path)
    state = _read_state(path)
    params = _read_tensors(path / "trainable.safetensors")
    missing, unexpected = sorted(set(named_params) - set(params)), sorted(set(params) - set(named_params))
    shapes = [f"{k}: checkpoint {tuple(params[k].shape)}, model {tuple(p.shape)}" for k, p in named_params.items()
              if k in params and params[k].shape != p.shape]
    if missing or unexpected or shapes:
        raise CheckpointError(f"checkpoint {path} does not match the trainable set: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}, shape mismatches {shapes[:5]} (same model, "
                              "trainable and lora settings needed to resume; or start a new out_dir)")
    with torch.no_grad():
        for k, p in named_params.items():
            p.copy_(params[k].to(p.device, p.dtype))
    _load_optimizer(optimizer, _read_tensors(path / "optimizer.safetensors"), state["optimizer"])
    if restore_rng:
        rng = _read_tensors(path / "rng.safetensors")
        torch.set_rng_state(rng["torch"])
        if torch.cuda.is_available():
            cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
            if cuda:
                torch.cuda.set_rng_state_all(cuda)
        for name, g in (generators or {}).items():
            if f"gen.{name}" in rng:
                g.set_state(rng[f"gen.{name}"])
        random.setstate(_to_tuple(state["python_random"]))
    return state


def _read_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of the checkpoint at ``path``, after checking its tensor files against the sizes
    and sha256s it records (checkpoints written before the record existed are not checked)."""
    state_file = path / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
        files = state.get("files", {})
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{state_file} is missing or malformed ({e!r}); resume from an earlier checkpoint "
                              f"(point {path.parent / LATEST} at it) or start a new out_dir") from e
    for name, rec in sorted(files.items()):
        f = path / name
        if not f.is_file() or f.stat().st_size != rec["bytes"] or sha256_file(f) != rec["sha256"]:
            raise CheckpointError(f"{f} is missing, truncated or modified (its size or sha256 differs from "
                                  f"{state_file.name}); resume from an earlier checkpoint (point "
                                  f"{path.parent / LATEST} at it) or start a new out_dir")
    return state


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, FileNotFoundError) as e:
        raise CheckpointError(f"{file} is missing or not a readable safetensors file ({e}); resume from an earlier "
                              "checkpoint or start a new out_dir") from e


def _py_random_state() -> list:
    v, internal, gauss = random.getstate()
    return [v, list(internal), gauss]


def _to_tuple(s: list) -> tuple:
    return (s[0], tuple(s[1]), s[2])
