"""Where a record's numbers came from: code version, machine and software stack, in one dict.

Every record ``fbs bench``, ``fbs eval`` and the training recipes write carries :func:`provenance`, so a number
can be tied to the commit that produced it and to the machine it ran on. Nothing here fails a run: a missing
``git``, an unreadable ``/proc/cpuinfo`` or an unbuilt native extension yield ``None`` fields.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

#: CPU flags that decide which kernels (ours, PyTorch's oneDNN, llama.cpp's) can run.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni")
#: Prefix of the AMX flags (amx_tile, amx_int8, amx_bf16, ...), all recorded.
ISA_PREFIX = "amx_"
#: Keys of :func:`provenance`, each always present.
FIELDS = ("fbs_version", "git_commit", "git_dirty", "git_dirty_files", "cpu", "cpu_flags", "logical_cpus",
          "torch_threads", "torch_interop_threads", "python", "torch", "transformers", "native_build", "native")
#: ``git_dirty_files`` lists at most this many paths (then "...")
DIRTY_FILES_MAX = 40

GIT_TIMEOUT_S = 10


def source_root(start: str | os.PathLike | None = None) -> Path | None:
    """The git work tree the ``fbs`` package is imported from (the first parent of ``start`` holding ``.git``),
    or None when it is not in one (installed from a wheel). An installed copy under ``site-packages`` is not the
    tree's code even when a virtualenv sits inside a checkout, so the search stops there."""
    path = Path(start if start is not None else __file__).resolve()
    for parent in (path, *path.parents):
        if parent.name in ("site-packages", "dist-packages"):
            return None
        if (parent / ".git").exists():
            return parent
    return None


def _git(root: Path, *args: str) -> str | None:
    """stdout of ``git args`` in ``root``, or None when git is missing, fails or hangs."""
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def dirty_files(root: Path | None = None) -> list[str] | None:
    """The tracked files of ``root`` (default: :func:`source_root`) that differ from HEAD, as paths in the tree (at
    most :data:`DIRTY_FILES_MAX`, then "..."); untracked files do not count. None outside a git tree or without git.
    What a dirty record's reader needs to know: whether the code differed from the commit, or only documents."""
    root = source_root() if root is None else root
    status = None if root is None else _git(root, "status", "--porcelain", "--untracked-files=no")
    if status is None:
        return None
    paths = [line[3:] for line in status.splitlines() if line.strip()]
    return paths[:DIRTY_FILES_MAX] + (["..."] if len(paths) > DIRTY_FILES_MAX else [])


def _head_and_changes(root: Path | None = None) -> tuple[str | None, list[str] | None]:
    """(HEAD commit, :func:`dirty_files`) of ``root`` (default: :func:`source_root`); (None, None) outside a git
    tree or without git."""
    root = source_root() if root is None else root
    if root is None:
        return None, None
    head = _git(root, "rev-parse", "HEAD")
    return (head.strip() or None) if head else None, dirty_files(root)


def git_state(root: Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD commit, dirty) of ``root`` (default: :func:`source_root`). Dirty: a tracked file differs from HEAD
    (:func:`dirty_files`). (None, None) outside a git tree or without git."""
    head, changed = _head_and_changes(root)
    return head, None if changed is None else bool(changed)


@functools.lru_cache(maxsize=1)
def cpu_info() -> tuple[str, tuple[str, ...]]:
    """(model name, the ISA flags of :data:`ISA_FLAGS` and AMX this CPU reports), from ``/proc/cpuinfo`` on Linux;
    elsewhere the platform's processor name and no flags."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = [f for f in ISA_FLAGS if f in flags] + sorted(f for f in flags if f.startswith(ISA_PREFIX))
    return model or platform.processor() or platform.machine(), tuple(wanted)


def package_version(pkg: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def native_info() -> tuple[str | None, dict]:
    """(build key of the native kernels: the name of the extension's build directory, a hash of its sources and
    the torch version; what the engine runs with now, :func:`fbs.native.status`). Builds nothing."""
    from fbs import native

    try:
        key = native.build_key()
    except Exception:  # the key is a record field, never a reason to stop a run
        key = None
    return key, native.status()


def provenance() -> dict[str, Any]:
    """The facts that tie a record to its code and machine (keys: :data:`FIELDS`). ``git_commit`` is None
    when the package is not imported from a git tree; ``fbs_version`` identifies it then."""
    import transformers

    commit, changed = _head_and_changes()  # one `git status` for the flag and the list
    cpu, flags = cpu_info()
    build, native = native_info()
    return {"fbs_version": package_version("fbs"), "git_commit": commit,
            "git_dirty": None if changed is None else bool(changed), "git_dirty_files": changed,
            "cpu": cpu, "cpu_flags": list(flags), "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "native_build": build, "native": native}
