"""Optional native (C++) kernels of the engine's eager one-token step: a thin Python face over ``csrc/``.

The sources, one file per concern (``csrc/``; per-ISA code under ``csrc/arch/x86/``, bindings in
``bindings.cpp``):

* ``gate.cpp``: **gate logits** (:func:`gate_logits`). A skip gate's logit is a few hundred flops
  (:func:`fbs.engine.fused._gate_logit`), but in eager PyTorch it is a dozen operator dispatches plus a host read;
  the kernel computes the same logits in one call and returns them as Python floats.
* ``int8.cpp`` + ``arch/x86/int8_avx512.cpp`` / ``int8_avx2.cpp``: **int8 weight-only products for a few rows**
  (:func:`int8_linear`): ``x (M, K) fp32 @ (q * s)^T`` with q (N, K) int8 and s (N,) bf16 per-channel scales, as
  ``torch._weight_int8pack_mm`` computes it but with fp32 activations, over weights repacked once
  (:func:`int8_pack`) so that each thread reads one linear stream: tiles of 4 output channels, K in 16-byte
  chunks, channel-interleaved, with software prefetch. The instruction set is chosen at run time; without AVX2
  (not x86) the PyTorch op stays in use.
* ``attention.cpp`` + ``arch/x86/attention_*.cpp``: **one-query attention** (:func:`attend_one`): each row's new
  K/V written at its slot and its query attending over that row's filled prefix only (a token tree's node: over
  its ancestors among the round's slots, :func:`tree_bits`). Cache entries fp32, fp16, bf16 or int8 with a scale
  per entry (csrc/attention.h, ``Entry``). fp32 decoding keeps SDPA (HF's op, so that fp32 stays bit-faithful).
* ``norm.cpp``: **RMSNorm** (:func:`rms_norm`) in one call, and **row-independent fp32 products**
  (:func:`linear_rows`) for the small modules (PAW) the engine runs outside a native layer.
* ``layer.cpp``: **a whole decoder layer** (:class:`NativeLayer`, built by :class:`fbs.engine.fused.FusedOps` per
  layer): RMSNorm, the fused K/V(+gate) product, the gate's logit and the skip decision (``skip.h``, the rule of
  :mod:`fbs.model.skip`), the cache writes, and attention and FFN of the rows that run; on a one-token decode step
  also PAW's and CH's steps between them (``set_paw`` / ``set_chunk``), the gates after PAW reading its new summary.
* ``packed.cpp``: **the weight formats a native layer streams** (:func:`packed_weight`): int8 with fp32
  activations (``int8.cpp``) or the block-quantized kinds with int8 activations (``quant.cpp``,
  :mod:`fbs.native.quant`); every product of a layer goes through it.
* ``lowrank.cpp`` + ``arch/x86/lowrank_x86.cpp``: **a LoRA delta kept apart from a weight's blocks**, its factors in
  fp16: the dot products before a product, the sums added by the product's own threads on their columns.
* ``chunk.cpp``: **the chunk head's online step** (:func:`chunk_step`), in place on the engine's chunk state.
* ``paw.cpp``: **PAW's decode step** (:func:`paw_step`): window, horizon heads, top-K expectation, conv and pool,
  down and up of each row in one call.
* ``evict.cpp``: **H2O's one-token eviction** (:func:`h2o_evict`), in place on the cache, its scores and positions.
* ``rowquant.cpp``: **a prompt's int8 products around the int8 GEMM** (:func:`quantize_rows`, :func:`scale_rows`):
  activations quantized per row, the int32 sums scaled back (:mod:`fbs.engine.prefill`).

The extension is built with ``torch.utils.cpp_extension.load`` the first time it is needed, once per machine:
the build lives under ``$FBS_CACHE_DIR/native/fbs-<hash>`` (default ``~/.cache/fbs/native``), the hash taken over
the sources, the generated policy header and the torch version; a new build starts from the newest earlier one,
so that only the changed files recompile. The build writes ``skip_policy.h`` from
:data:`fbs.model.skip.BATCH_POLICIES` into a directory keyed by its text, so the C++ policy codes are the Python
table's. The
kernels are used only where they compute what the PyTorch ops compute up to float rounding: CPU, fp32
activations, eager (a ``torch.compile``d step keeps the PyTorch ops in its graph). Without a C++ toolchain (with
OpenMP), or with ``FBS_NATIVE=0``, the engine keeps the PyTorch ops; nothing else changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.bases import cache_root
from ..model.chunk import LABEL_I
from ..model.preview import PreviewOut
from ..model.skip import policy_header

logger = logging.getLogger(__name__)

#: The extension's C++ sources (package data): one file per kernel, per-ISA files under ``arch/``, the bindings.
CSRC = Path(__file__).parent / "csrc"
#: The header the build generates from :data:`fbs.model.skip.BATCH_POLICIES` (the native layer's policy codes).
POLICY_HEADER = "skip_policy.h"


def sources() -> list[Path]:
    """The ``.cpp`` files the extension is built from, in a fixed order."""
    return sorted(CSRC.rglob("*.cpp"))


def _source_digest() -> str:
    """Hash of every C++ source and header, the generated policy header and the torch version: one build each."""
    h = hashlib.sha256()
    for path in sorted(CSRC.rglob("*")):
        if path.suffix in (".cpp", ".h"):
            h.update(str(path.relative_to(CSRC)).encode())
            h.update(path.read_bytes())
    h.update(policy_header().encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:12]


_lock = threading.Lock()
_module = None
_failed: str | None = None


def enabled() -> bool:
    """Native kernels are wanted: ``FBS_NATIVE`` is unset or not ``0``."""
    return os.environ.get("FBS_NATIVE", "1") != "0"


def build_key() -> str:
    """The name of this source tree's build (``fbs-<hash of the sources, the policy header and torch>``): what a
    record names to tie its numbers to the kernels that produced them."""
    return f"fbs-{_source_digest()}"


def _build_dir() -> Path:
    return cache_root() / "native" / build_key()


def _gen_dir() -> Path:
    """The directory of the generated policy header, keyed by its text (an include path that stays the same across
    source changes, so that the compile commands do too)."""
    text = policy_header()
    path = cache_root() / "native" / f"gen-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    header = path / POLICY_HEADER
    if not header.is_file() or header.read_text() != text:
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{POLICY_HEADER}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, header)
    return path


def _seed(path: Path) -> None:
    """Start a new build directory from the newest earlier build of these sources (objects, ninja's log and
    dependency records, modification times kept), so that ninja recompiles only the files that changed."""
    earlier = [p for p in path.parent.glob("fbs-*") if p != path and (p / "build.ninja").is_file()
               and (p / "fbs_native.so").is_file()]
    if not earlier or path.exists():
        return
    newest = max(earlier, key=lambda p: (p / "fbs_native.so").stat().st_mtime)
    try:
        shutil.copytree(newest, path, ignore=shutil.ignore_patterns("*.so", "*.lock", "lock"))
    except OSError as e:  # a full build instead
        logger.info("could not reuse the earlier native build %s (%s)", newest, e)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(lock: Path):
    """An exclusive lock on the file ``lock`` between processes, released by the OS if its holder dies (a killed
    build leaves no stale lock behind, unlike the lock file torch's build leaves in the build directory)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import_built(path: Path):
    """The finished build of these exact sources, imported without asking ninja (the build key is a hash of the
    sources' contents, so checkouts at other paths with the same sources share it instead of rebuilding it); None
    when there is none yet."""
    so = path / "fbs_native.so"
    if not so.is_file():
        return None
    import torch  # noqa: F401  the extension links against torch's libraries

    spec = importlib.util.spec_from_file_location("fbs_native", so)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as e:  # a partial or foreign file: build it again
        logger.info("could not import the native build %s (%s); rebuilding", so, e)
        return None
    return mod


def _configured(mod):
    """``mod`` with the process-wide switches the environment sets: ``FBS_INT8_SCORES=0`` turns the integer
    attention scores off (:func:`int8_scores`)."""
    if mod is not None and os.environ.get("FBS_INT8_SCORES", "1") == "0":
        mod.attention_int8_scores(False)
    return mod


def module():
    """The compiled extension, building it on first use; None when disabled or the build failed (logged once)."""
    global _module, _failed
    if not enabled() or _failed is not None:
        return None
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load

                path = _build_dir()
                _module = _configured(_import_built(path))
                if _module is not None:
                    return _module
                with _exclusive(path.parent / f".{path.name}.lock"):
                    if not (path / "fbs_native.so").exists():  # a pause the user should see explained
                        print(f"fbs: building the native kernels in {path} (once per machine)", file=sys.stderr)
                        _seed(path)
                    path.mkdir(parents=True, exist_ok=True)
                    # torch's own lock file there is stale when present: a build that holds it holds ours too
                    (path / "lock").unlink(missing_ok=True)
                    _module = _configured(load("fbs_native", sources=[str(p) for p in sources()],
                                               extra_include_paths=[str(_gen_dir())],
                                               extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                               build_directory=str(path), verbose=False))
            except Exception as e:  # no compiler, no ninja, a read-only cache ...: the PyTorch ops stay in use
                _failed = f"{type(e).__name__}: {e}"
                logger.warning("native kernels unavailable, using PyTorch ops (%s)", _failed.splitlines()[0])
    return _module


def build_probe(name: str, source: Path, cflags: list[str]):
    """A measurement probe (``scripts/probe_*.cpp``, which includes library sources as they are), built with
    ``torch.utils.cpp_extension`` and linked against this build of the library, whose functions it calls; exits
    with a message when the native kernels are not available here."""
    from torch.utils.cpp_extension import load

    lib = module()
    if lib is None:
        raise SystemExit("the native kernels are not available here (fbs info says why)")
    so = Path(lib.__file__)
    return load(name, sources=[str(source)], extra_cflags=cflags,
                extra_ldflags=[f"-L{so.parent}", f"-l:{so.name}", f"-Wl,-rpath,{so.parent}"], verbose=False)


def status() -> dict:
    """What the engine runs with, for records (builds nothing): enabled, loaded, the int8 kernel's instruction set
    (None when not loaded or without AVX2), and the build error if the build failed."""
    isa = int8_isa() if _module is not None else None
    scores = bool(_module.attention_int8_scores(None)) if _module is not None else False
    return {"enabled": enabled(), "loaded": _module is not None, "int8_isa": isa, "int8_scores": scores,
            "build_error": _failed}


def gate_args(gate: tuple) -> tuple:
    """The fused gate tuple (w_rel, w_prev, out_w (G,), out_b (1,), eps) as :func:`gate_logits` takes it (the
    scalars as Python floats, read once)."""
    w_rel, w_prev, out_w, out_b, eps = gate
    dense = lambda t: None if t is None else t.contiguous()  # noqa: E731  (e.g. w_rel is a column of a weight)
    return dense(w_rel), dense(w_prev), dense(out_w), float(out_b), float(eps)


def gate_logits(y: torch.Tensor, off: int, gy: int, terms: torch.Tensor, x: torch.Tensor,
                x_prev: torch.Tensor | None, rel_term: torch.Tensor | None, prev_skip: torch.Tensor | None,
                args: tuple) -> list[float]:
    """Per row of a one-token step, the logit :func:`fbs.engine.fused._gate_logit` computes, as Python floats.

    ``y`` (b, 1, W): the fused K/V(+gate) matmul's output, whose columns ``off:off + gy`` are the gate's input
    projection (``gy`` 0: the gate has none); ``terms`` (b, 1, G): its bias and preview term; ``args``:
    :func:`gate_args`. Every tensor fp32 on the CPU with a unit last stride (the kernel checks; the engine's
    residual stream and fused outputs are); the caller checks that :func:`module` is not None."""
    w_rel, w_prev, out_w, out_b, eps = args
    return _module.gate_logits(y, off, gy, terms, x, x_prev, rel_term, prev_skip, w_rel, w_prev, out_w, out_b, eps)


# --------------------------------------------------------------------------- int8 weight-only products
INT8_TILE, INT8_CHUNK = 4, 16  # the packed layout's tile height (output channels) and K chunk (bytes)
_ISA_NAMES = {2: "avx512", 1: "avx2"}


def int8_isa() -> str | None:
    """The instruction set :func:`int8_linear` runs with here ("avx512" or "avx2"; ``FBS_NATIVE_ISA=avx2`` asks
    for the narrower one), or None: no native int8 kernel (disabled, no build, or no AVX2)."""
    mod = module()
    best = mod.int8_isa() if mod is not None else 0
    if best == 2 and os.environ.get("FBS_NATIVE_ISA", "").lower() == "avx2":
        best = 1
    return _ISA_NAMES.get(best)


def int8_pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> the 1-D packed layout :func:`int8_linear` reads (tiles of 4 channels, K in 16-byte chunks,
    channel-interleaved; zero padding to whole tiles and chunks). :func:`int8_unpack` inverts it exactly."""
    n, k = q.shape
    tn, kc = -(-n // INT8_TILE), -(-k // INT8_CHUNK)
    padded = torch.zeros(tn * INT8_TILE, kc * INT8_CHUNK, dtype=torch.int8, device=q.device)
    padded[:n, :k] = q
    return padded.view(tn, INT8_TILE, kc, INT8_CHUNK).transpose(1, 2).contiguous().view(-1)


def int8_unpack(p: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The (N, K) int8 matrix of a :func:`int8_pack` ed one."""
    tn, kc = -(-n // INT8_TILE), -(-k // INT8_CHUNK)
    return p.view(tn, kc, INT8_TILE, INT8_CHUNK).transpose(1, 2).reshape(tn * INT8_TILE, kc * INT8_CHUNK)[:n, :k]


def int8_linear(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x (..., K) @ (q * s)^T`` for packed ``p`` (:func:`int8_pack`) and (N,) bf16 scales ``s``, in x's dtype
    (computed in fp32). The caller checks :func:`int8_isa` (the engine does once, when it packs the weights)."""
    k, n = x.shape[-1], s.shape[0]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if k % INT8_CHUNK:
        x2 = F.pad(x2, (0, INT8_CHUNK - k % INT8_CHUNK))
    y = _module.int8_linear(x2.contiguous(), p, s, _isa_code()).view(*x.shape[:-1], n)
    return y if y.dtype == x.dtype else y.to(x.dtype)


#: the packed-weight kind of :func:`int8_pack` ed weights (``csrc/packed.h``); the block kinds are
#: :data:`fbs.native.quant.KINDS`
INT8_F32 = -1


def packed_weight(kind: int, p: torch.Tensor, s: torch.Tensor | None, n: int, k: int):
    """One (n, k) weight as a native layer streams it (:class:`PackedWeight`, ``csrc/packed.h``): ``kind``
    :data:`INT8_F32` (``p`` from :func:`int8_pack`, ``s`` its (n,) bf16 scales) or a block kind of
    :data:`fbs.native.quant.KINDS` (``p`` from :func:`fbs.native.quant.pack`; ``s`` the fp32 scales of ``i8``)."""
    return _module.PackedWeight(kind, p, s, n, k)


_isa_memo: dict[str, int] = {}


def _isa_code() -> int:
    """:func:`int8_isa` as the kernel's code, looked up once per ``FBS_NATIVE_ISA`` value (it is read per matmul)."""
    key = os.environ.get("FBS_NATIVE_ISA", "")
    code = _isa_memo.get(key)
    if code is None:
        code = _isa_memo[key] = {"avx512": 2, "avx2": 1}.get(int8_isa(), 0)
    return code


# --------------------------------------------------------------------------- one-query attention
def int8_scores(on: bool | None = None) -> bool:
    """Whether attention over an int8 KV cache scores in integers here (AVX-512 VNNI): each query, per 32 values,
    as two int8 codes, q = s hi + (s / 254) lo with s = max |q| / 127, hi = round(q / s), lo = round((q - s hi) 254
    / s), within s / 508 of q; one ``vpdpbusd`` adds 4 products for 16 keys, and the sums are exact. ``on`` turns it
    on or off for the process (off: fp32 products of the decoded keys, as on CPUs without VNNI). False without the
    native kernels."""
    mod = module()
    if mod is None:
        return False
    return bool(mod.attention_int8_scores(on))


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               idx: torch.Tensor, slots: torch.Tensor, scale: float,
               acc: torch.Tensor | None = None, kf: torch.Tensor | None = None) -> torch.Tensor:
    """A one-token step's attention over the static cache (what :func:`fbs.engine.fused._block_step` does with index
    writes and SDPA over the masked buffers): writes each row's ``k``/``v`` (b, Hkv, 1, hd) at ``slots`` (b,) of
    cache rows ``idx`` (b,) in ``kc``/``vc`` (B, Hkv, C, hd), then attends ``q`` (b, H, 1, hd) over slots
    0..slot only (GQA). Returns (b, 1, H * hd) fp32, the heads side by side as the O projection reads them.
    ``acc`` (B, Hkv, C) fp32: each query's attention weights are added to it, summed over the query heads of each KV
    head (H2O's accumulated attention), from the same pass over the keys. ``kf`` (Hkv, 1, hd) contiguous fp32: keys are
    stored divided by it and queries attend multiplied by it (:func:`fbs.engine.quant.key_factors`)."""
    return _module.attend_one(q, k, v, kc, vc, idx, slots, scale, _isa_code(), acc, kf)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm ``w * (x * rsqrt(mean(x^2) + eps))`` of fp32 rows (x contiguous, w (d,)), in one call."""
    return _module.rms_norm(x.contiguous(), w, eps)


def linear_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` of fp32 rows in which a row's result does not depend on the other rows of the call
    (torch's GEMM blocks by the row count, so one row and the same row among T differ by float rounding). The
    engine's small products use it, so that verifying T drafted positions at once gives each position the logits
    that decoding it alone gives, bit for bit."""
    return _module.linear_rows(x.contiguous(), w.contiguous(), None if b is None else b.contiguous())


# --------------------------------------------------------------------------- the chunk head's online step
def chunk_step(head, xn: torch.Tensor, rows: torch.Tensor, state, attend: bool = True):
    """:meth:`fbs.model.chunk.ChunkHead.step` of one token per row in one call, on rows ``rows`` (b,) of the
    full :class:`fbs.model.chunk.ChunkState` ``state`` in place (no select / assign copies). Returns (c (b, 1, d)
    or None, bios logits (b, 1, 4), start (b,) bool) as the PyTorch step does. fp32 CPU."""
    c, logits, start = _module.chunk_step(xn.contiguous(), rows, state.closed, state.n_closed, state.open_sum,
                                          state.open_count, head.bios.weight, head.bios.bias, head.key.weight,
                                          head.query.weight, head.out.weight, head.scale, LABEL_I, attend)
    return (c if attend else None), logits, torch.tensor(start, dtype=torch.bool)


# --------------------------------------------------------------------------- PAW's decode step
def paw_weights(paw, keys: torch.Tensor, emb: torch.Tensor) -> tuple | None:
    """The arguments :func:`paw_step` passes for the :class:`fbs.model.preview.ParafoveaWindow` ``paw`` with its
    head keys ``keys`` (N, R) and the preview embeddings ``emb`` (N, d) (``FBSForCausalLM.preview_vocab``), made once
    per decoder; None where the kernel does not compute that module (a compression other than the depthwise conv,
    not fp32 on the CPU)."""
    d = emb.shape[1]
    conv = getattr(paw, "conv", None)
    if (paw.compression != "conv" or conv is None or conv.groups != d or conv.bias is None
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (emb, keys, conv.weight))):
        return None
    mix = paw.horizon_mix.detach()
    k_max, r = mix.shape[0], mix.shape[1]
    flat = lambda t: t.detach().contiguous()  # noqa: E731
    return (flat(paw.window.weight.view(-1)), flat(paw.window.bias.view(1)),
            -1 if paw.fixed_k is None else int(paw.fixed_k), k_max, flat(paw.query.weight),
            mix.transpose(1, 2).reshape(k_max * r, r).contiguous(), flat(paw.horizon_bias), flat(keys.t()),
            flat(paw.other_logit), float(paw.head_scale), int(paw.top_k), flat(emb), flat(conv.weight.view(d, 3).t()),
            flat(conv.bias), flat(paw.down.weight), flat(paw.up.weight))


def paw_step(weights: tuple, xn: torch.Tensor) -> PreviewOut:
    """:meth:`fbs.model.preview.ParafoveaWindow.forward` with the hard window (decoding) of the rows ``xn`` (..., d)
    in one call, ``weights`` from :func:`paw_weights`: each row computes its own window only, so a row's preview does
    not depend on the other rows of the call. ``logits`` is None (the engine reads ``z``, ``zlow`` and ``k_hard``)."""
    x = xn.contiguous()
    z, zlow, k_soft, k_hard, window = _module.paw_step(x, weights[0], weights[1], weights[2], weights[3], *weights[4:])
    return PreviewOut(z, zlow, None, k_soft, k_hard, window)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x (M, K) fp32 -> (q (M, K) int8, s (M, 1) fp32): s = max |x| / 127 per row (1 for a zero row), q = round(x / s)
    to nearest even, in one pass (:func:`fbs.engine.prefill.int8_linear`'s reference, bit for bit); None without the
    extension or for inputs it does not take (non-CPU)."""
    mod = module()
    if mod is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return mod.quantize_rows(x.contiguous())


def scale_rows(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """acc (M, N) int32 -> float(acc) * sx[m] * sw[n] (+ bias[n]) fp32 (M, N), in one pass; None where
    :func:`quantize_rows` is."""
    mod = module()
    if mod is None or acc.device.type != "cpu":
        return None
    return mod.scale_rows(acc, sx, sw, bias)


def h2o_evict(kc: torch.Tensor, vc: torch.Tensor, acc: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor,
              old: torch.Tensor, heavy: int, budget: int) -> bool:
    """:meth:`fbs.engine.kvpolicy.H2O._evict` in place in one call (``csrc/evict.h``); False (nothing done) when the
    extension is not loaded or the tensors are not the contiguous CPU tensors it takes."""
    mod = module()
    if mod is None or not all(t.device.type == "cpu" and t.is_contiguous() for t in (kc, vc, acc, pos)):
        return False
    mod.h2o_evict(kc, vc, acc, pos, idx, old, heavy, budget)
    return True


def run_layers(layers: list, x: torch.Tensor, x_prev: torch.Tensor | None, prev_skip: list[float],
               zterms: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, kcs: list, vcs: list,
               idx: torch.Tensor, slots: list[int], gated: list[bool], runs: list[bool], thresholds: list[float],
               policy: int, write_skipped: bool, accs: list | None = None, kfs: list | None = None,
               zlow: torch.Tensor | None = None, chunks: list | None = None, trail: bool = False):
    """Consecutive :class:`NativeLayer` s of a one-token step in one call (see
    :meth:`fbs.engine.fused.FusedOps.native_run`, which books the cache entries it writes). ``accs``: per layer its
    accumulated attention (B, Hkv, C) fp32, to which the rows that run the layer add their attention weights (H2O),
    from the attention's own pass. ``kfs``: per layer the factors its keys are stored divided by (as
    :func:`attend_one`'s ``kf``), or None. Layers with PAW / CH (:meth:`NativeLayer.set_paw` / ``set_chunk``):
    ``zlow`` (b, R) the step's preview summary, written in place; ``chunks`` each CH layer's
    :class:`fbs.model.chunk.ChunkState`, in order. Returns (x', the last layer's input, logits, skip, run, the gate
    terms after the last PAW layer that ran (b, 1, T) or None, per layer and row PAW's k and CH's boundary (-1:
    none), with ``trail`` per CH layer its state after each row's token (closed, n_closed, open_sum, open_count: b rows
    each; else empty))."""
    kfs = [] if kfs is None or all(f is None for f in kfs) else list(kfs)
    flat = [t for st in chunks or () for t in (st.closed, st.n_closed, st.open_sum, st.open_count)]
    out = _module.run_layers(layers, x, x_prev, prev_skip, zterms, cos, sin, kcs, vcs, idx, slots, gated, runs,
                             thresholds, policy, write_skipped, accs or [], kfs, _isa_code(), zlow, flat, trail)
    return out


def attend_layer(layer, x: torch.Tensor, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                 vc: torch.Tensor, idx: torch.Tensor, slots: torch.Tensor, kv=None,
                 acc: torch.Tensor | None = None, tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                 kf: torch.Tensor | None = None) -> torch.Tensor:
    """The attention half of an :class:`NativeLayer` for every row: K/V of ``xn`` (RMSNorm_1(x)), or ``kv`` (rotated
    K, V (b, Hkv, 1, hd) when already projected), written at ``slots`` of cache rows ``idx``, then
    x + O(attention) over each row's prefix (PAW / CH add to it next). ``acc`` (B, Hkv, C) fp32, the cache's shape:
    each query's attention weights are added to it, summed over the query heads of each KV head (H2O's accumulated
    attention, as :func:`fbs.engine.kvpolicy.attend_scored` adds them). ``tree`` (bits, base), (b,) int64 each: a
    verifier's token tree, row i seeing the slots before ``base[i]`` and, of the 64 from it, those whose bit of
    ``bits[i]`` is set (its ancestors and itself; :func:`tree_bits` makes them). ``kf``: as :func:`attend_one`'s (a
    given ``kv``'s K is stored divided by it too)."""
    k, v = (None, None) if kv is None else kv
    bits, base = (None, None) if tree is None else tree
    return _module.attend_layer(layer, x, xn, cos, sin, kc, vc, idx, slots, k, v, acc, _isa_code(), bits, base, kf)


#: nodes a native token-tree pass handles per row (one bit each in an int64)
TREE_NODES = 64


def tree_bits(mask: torch.Tensor) -> torch.Tensor:
    """(b, t, t) bool ancestor masks (node j sees node m where ``mask[i, j, m]``), t <= :data:`TREE_NODES` -> (b * t,)
    int64: bit m of row i, node j's value set where ``mask[i, j, m]`` (two's complement for bit 63)."""
    b, t, _ = mask.shape
    if t > TREE_NODES:
        raise ValueError(f"a native token-tree pass takes at most {TREE_NODES} nodes per row, got {t}")
    weights = torch.tensor([1 << m if m < 63 else -(1 << 63) for m in range(t)], dtype=torch.long)
    return (mask.to(torch.long) * weights).sum(-1).reshape(b * t)


def ffn_layer(layer, h: torch.Tensor) -> torch.Tensor:
    """The FFN half of an :class:`NativeLayer`: h + down(silu(gate(hn)) * up(hn)), hn = RMSNorm_2(h)."""
    return _module.ffn_layer(layer, h, _isa_code())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """A prompt's causal self-attention, q (B, H, T, hd), k and v (B, Hkv, S, hd) with S >= T (the queries are the
    last T of the S positions: S - T earlier entries, then the prompt or chunk itself), fp32 (any strides with a unit
    last one; GQA when Hkv < H) -> softmax(scale q k^T, causal) v as (B, H, T, hd), a view of a (B, T, H, hd)
    contiguous result (what the output projection reads), in one flash-style pass (``csrc/causal.h``); None where it
    does not run (no native build, no AVX-512, head dim not a multiple of 16 up to 256, not fp32 CPU tensors)."""
    mod = module()
    hd = q.shape[-1]
    if mod is None or not mod.causal_available() or hd % 16 or hd > 256 or q.requires_grad \
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (q, k, v)):
        return None
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        q, k, v = (t.contiguous() for t in (q, k, v))
    return mod.causal_attention(q, k, v, float(scale)).transpose(1, 2)
