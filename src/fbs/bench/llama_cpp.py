"""llama.cpp's own tools as the anchor of ``fbs bench``: ``llama-bench`` timings and ``llama-perplexity`` scores.

The binaries and the model's formats come from ``scripts/build_llama_cpp.sh``: ``$FBS_LLAMA_CPP_DIR``, else
``$FBS_CACHE_DIR/llama.cpp/<version>`` (default ``~/.cache/fbs``), holding ``bin/{llama-bench,llama-perplexity}``,
``bin/flags.txt`` (the instruction-set switches of the build) and ``models/<base>.<FORMAT>.gguf``.

The paper protocol maps onto ``llama-bench`` as two tests per call pair (``-o json``):
    prefill = ``-p <prompt_len> -n 0 -d 0``: the prompt from an empty context, as our prefill;
    decode  = ``-p 0 -n <new_tokens> -d <prompt_len>``: N tokens after prompt_len tokens of context.
``llama-bench`` feeds random token ids and times only the model's forward passes (no sampling). Its decode
time covers N tokens; ours covers the N-1 after the first, so a run's decode time is scaled to N-1 tokens at
the measured rate, and ``decode_tok_s`` is llama-bench's own tg rate.

Public entry points:
    install_dir()                     where the build lives
    LlamaBenchSystem                  one GGUF format as a bench system (interface of ``fbs.bench.systems``)
    llama_bench_systems(base)         the four formats' systems
    bench_commands(...)               the two llama-bench command lines of one measurement
    parse_bench_json(text)            llama-bench's JSON output as BenchTests
    batched_command(...)              a llama-batched-bench command line: B sequences decoding together
    parse_batched_jsonl(text)         its JSONL output: per B, seconds per decode step
    parse_perplexity(text)            llama-perplexity's final estimate and per-chunk running PPL
    build_facts(root, model)          version, build flags and the model file's sha256
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from fbs.bench.harness import BenchConfig, GenOutput

#: The llama-cpp-python release whose vendored llama.cpp source the build script compiles.
LLAMA_CPP_VERSION = "0.3.36"
#: GGUF formats the build script makes for each bundled base: the shipped file's own format first, then the others
#: requantized from it (``llama-quantize --allow-requantize``).
MODEL_FORMATS = {"smollm2-135m": ("Q4_1", "Q8_0", "Q4_0", "F16"),
                 "qwen2.5-coder-0.5b": ("Q4_K_M", "Q8_0", "Q4_0")}
#: Every format a llama.cpp bench system can run, in the order the bench reports them.
FORMATS = ("Q4_1", "Q4_K_M", "Q8_0", "Q4_0", "F16")
BUILD_HINT = ("run `bash scripts/build_llama_cpp.sh` (builds llama.cpp's llama-bench / llama-perplexity from the "
              f"llama-cpp-python {LLAMA_CPP_VERSION} sdist and makes the default model's Q4_1, Q8_0, Q4_0 and F16 "
              "files; 10-25 min on 2 cores; FBS_LLAMA_MODELS=\"smollm2-135m qwen2.5-coder-0.5b\" adds Qwen's), or "
              "point FBS_LLAMA_CPP_DIR at such a build")


def formats_for(base: str) -> tuple[str, ...]:
    """The formats made for ``base`` (every format for a base the build script does not know)."""
    return MODEL_FORMATS.get(str(base), FORMATS)


def install_dir() -> Path:
    """``$FBS_LLAMA_CPP_DIR``, else ``$FBS_CACHE_DIR/llama.cpp/<version>`` (default ``~/.cache/fbs``)."""
    env = os.environ.get("FBS_LLAMA_CPP_DIR")
    if env:
        return Path(env).expanduser()
    root = os.environ.get("FBS_CACHE_DIR")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "fbs") / "llama.cpp" / LLAMA_CPP_VERSION


def model_path(root: Path, base: str, fmt: str) -> Path:
    return root / "models" / f"{base}.{fmt}.gguf"


def system_name(fmt: str) -> str:
    return f"llama-cpp-{fmt.lower()}"


# ----------------------------------------------------------------------------------------------- llama-bench


@dataclasses.dataclass(frozen=True)
class BenchTest:
    """One test of a llama-bench JSON output: ``samples_ns`` are the timed repetitions, ``avg_ts`` / ``stddev_ts``
    llama-bench's mean and std of the per-repetition rates (tokens per second)."""

    n_prompt: int
    n_gen: int
    n_depth: int
    n_threads: int
    avg_ts: float
    stddev_ts: float
    samples_ns: tuple[int, ...]
    samples_ts: tuple[float, ...]
    info: dict[str, Any]
    """The record's other fields (build_commit, model_type, type_k, flash_attn, n_batch, ...)."""

    @property
    def tokens(self) -> int:
        return self.n_prompt + self.n_gen


_TEST_KEYS = ("n_prompt", "n_gen", "n_depth", "n_threads", "avg_ts", "stddev_ts", "samples_ns", "samples_ts")


def parse_bench_json(text: str) -> list[BenchTest]:
    """llama-bench's ``-o json`` output (a list of test records) as BenchTests; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON ({e}); was it run with -o json?") from None
    if not isinstance(data, list) or not data:
        raise ValueError("llama-bench JSON must be a non-empty list of test records")
    tests = []
    for i, rec in enumerate(data):
        missing = [k for k in _TEST_KEYS if k not in rec]
        if missing:
            raise ValueError(f"llama-bench test record {i} lacks {missing}: an incompatible llama-bench version")
        if len(rec["samples_ns"]) != len(rec["samples_ts"]) or not rec["samples_ns"]:
            raise ValueError(f"llama-bench test record {i} has no or mismatched samples")
        tests.append(BenchTest(
            n_prompt=int(rec["n_prompt"]), n_gen=int(rec["n_gen"]), n_depth=int(rec["n_depth"]),
            n_threads=int(rec["n_threads"]), avg_ts=float(rec["avg_ts"]), stddev_ts=float(rec["stddev_ts"]),
            samples_ns=tuple(int(x) for x in rec["samples_ns"]), samples_ts=tuple(float(x) for x in rec["samples_ts"]),
            info={k: v for k, v in rec.items() if k not in _TEST_KEYS}))
    return tests


#: llama.cpp's KV cache types a llama-bench system may use (``-ctk`` / ``-ctv``): f16 (its default) or q8_0 (int8
#: blocks of 32 with a scale; a quantized V cache needs flash attention, ``-fa 1``)
KV_TYPES = ("f16", "q8_0")


def bench_commands(binary: Path, model: Path, cfg: BenchConfig, threads: int, reps: int,
                   kv_type: str = "f16") -> tuple[list[str], list[str]]:
    """The prefill and decode llama-bench command lines of the protocol in ``cfg`` (see the module docstring), with
    the KV cache in ``kv_type`` (:data:`KV_TYPES`; other than f16: ``-ctk`` / ``-ctv`` and flash attention)."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown llama.cpp KV cache type {kv_type!r}; choose from {', '.join(KV_TYPES)}")
    common = ["-t", str(threads), "-r", str(reps), "-o", "json"]
    if kv_type != "f16":
        common += ["-ctk", kv_type, "-ctv", kv_type, "-fa", "1"]
    pp = [str(binary), "-m", str(model), "-p", str(cfg.prompt_len), "-n", "0", "-d", "0", *common]
    tg = [str(binary), "-m", str(model), "-p", "0", "-n", str(cfg.new_tokens), "-d", str(cfg.prompt_len), *common]
    return pp, tg


def batched_command(binary: Path, model: Path, context: int, new_tokens: int, batches: list[int], threads: int,
                    kv_type: str = "f16") -> list[str]:
    """``llama-batched-bench``'s command line for B sequences (each B of ``batches``) decoding together: each its own
    ``context``-token prompt (not shared), then ``new_tokens`` steps of one token per sequence; its KV cache split
    evenly over the largest B's sequences (not unified), so a sequence's cache is the same at every B. ``kv_type`` as
    :func:`bench_commands`'s."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown llama.cpp KV cache type {kv_type!r}; choose from {', '.join(KV_TYPES)}")
    if not batches or min(batches) < 1 or context < 1 or new_tokens < 1:
        raise ValueError("batched bench: positive batch sizes, context and new tokens")
    cmd = [str(binary), "-m", str(model), "-c", str(max(batches) * (context + new_tokens)), "-b", "2048", "-ub", "512",
           "-npp", str(context), "-ntg", str(new_tokens), "-npl", ",".join(map(str, batches)), "-t", str(threads),
           "-tb", str(threads), "-no-kvu", "--output-format", "jsonl"]
    if kv_type != "f16":
        cmd += ["-ctk", kv_type, "-ctv", kv_type, "-fa", "on"]
    return cmd


def parse_batched_jsonl(text: str) -> dict[int, float]:
    """``llama-batched-bench --output-format jsonl``'s records (other lines ignored) as seconds per decode step for
    each batch size: ``t_tg / tg`` (``t_tg``: the time of its ``tg`` steps of ``pl`` tokens each). ValueError naming
    what is wrong when there is none or a record lacks a field."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        missing = [k for k in ("pl", "tg", "t_tg") if k not in rec]
        if missing:
            raise ValueError(f"llama-batched-bench record lacks {missing}: an incompatible version")
        out[int(rec["pl"])] = float(rec["t_tg"]) / int(rec["tg"])
    if not out:
        raise ValueError("no llama-batched-bench JSONL record in its output; was it run with --output-format jsonl?")
    return out


@dataclasses.dataclass(frozen=True)
class ToolRun:
    """A finished subprocess: its output, exit code and peak resident memory."""

    stdout: str
    stderr: str
    returncode: int
    peak_rss_mb: float


def _vm_hwm_kb(pid: int) -> int | None:
    """The process's resident high-water mark (``VmHWM``), None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run_tool(cmd: list[str], poll_s: float = 0.05) -> ToolRun:
    """Run ``cmd`` to completion. Its peak RSS is the child's own ``VmHWM``, read every ``poll_s`` while it runs
    (the kernel's rusage of a child counts this process's memory too: it was forked from it); 0 without /proc."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)  # returns once the child has exec'd
        peak_kb = 0
        while True:
            peak_kb = max(peak_kb, _vm_hwm_kb(proc.pid) or 0)
            try:
                proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                continue
        out.seek(0)
        err.seek(0)
        return ToolRun(out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace"),
                       proc.returncode, peak_kb / 1024)


def outputs_from_tests(pp: BenchTest, tg: BenchTest, new_tokens: int, peak_rss_mb: float | None) -> list[GenOutput]:
    """One GenOutput per repetition: prefill = the pp sample, decode = the tg sample scaled to N-1 tokens, total =
    their sum (no output ids: llama-bench generates none)."""
    if len(pp.samples_ns) != len(tg.samples_ns):
        raise ValueError(f"llama-bench ran {len(pp.samples_ns)} prefill and {len(tg.samples_ns)} decode repetitions")
    scale = (new_tokens - 1) / new_tokens
    outs = []
    for p_ns, t_ns in zip(pp.samples_ns, tg.samples_ns):
        pre, dec = p_ns / 1e9, scale * t_ns / 1e9
        outs.append(GenOutput(None, pre, dec, total_s=pre + dec, peak_rss_mb=peak_rss_mb))
    return outs


def read_flags(path: Path) -> dict[str, str]:
    """``bin/flags.txt`` (CMakeCache lines ``GGML_AVX512:BOOL=ON``) as {switch: value}."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"(\w+):\w+=(.*)", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


#: sha256 of model files already hashed, keyed by (path, mtime, size): the F16 file takes a while
_SHA256: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _SHA256:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _SHA256[key] = h.hexdigest()
    return _SHA256[key]


def build_facts(root: Path, model: Path, runner: Callable[[list[str]], ToolRun] = run_tool) -> dict[str, Any]:
    """What decides llama.cpp's numbers besides the machine: its version, build switches and the model file."""
    version = runner([str(root / "bin" / "llama-bench"), "--version"])
    text = (version.stdout + version.stderr).strip()
    flags = root / "bin" / "flags.txt"
    return {"source": f"llama-cpp-python=={LLAMA_CPP_VERSION} sdist, vendor/llama.cpp",
            "version": text.splitlines()[0] if text else "", "build_flags": read_flags(flags) if flags.exists() else {},
            "model_file": model.name, "model_sha256": file_sha256(model), "model_bytes": model.stat().st_size}


@dataclasses.dataclass
class LlamaBenchSystem:
    """One GGUF format of the base model timed by llama.cpp's ``llama-bench`` (the interface of
    ``fbs.bench.systems``). Each ``generate`` is one repetition (``-r 1``: one interleaved round);
    ``generate_runs`` is the sequential protocol, all repetitions in one call pair after llama-bench's own warm-up.
    The probe runs nothing timed: it records :func:`build_facts`. No output ids (llama-bench decodes random
    tokens), so no token match; batch 1 only. ``runner`` runs a command (tests pass a double)."""

    fmt: str
    base: str = "smollm2-135m"
    root: Path | None = None
    kv_type: str = "f16"  # llama.cpp's KV cache type (KV_TYPES); q8_0 adds -kvq8_0 to the name
    n_threads: int | None = None  # None: torch's thread count (the benchmark's --threads)
    runner: Callable[[list[str]], ToolRun] = run_tool
    family: str = "external"
    ratio_kind: str | None = None
    max_runs: int | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown llama.cpp format {self.fmt!r}; choose from {', '.join(FORMATS)}")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"unknown llama.cpp KV cache type {self.kv_type!r}; choose from {', '.join(KV_TYPES)}")
        self.root = Path(self.root) if self.root is not None else install_dir()
        self.name = system_name(self.fmt) + ("" if self.kv_type == "f16" else f"-kv{self.kv_type}")
        self._facts: dict[str, Any] | None = None

    @property
    def model(self) -> Path:
        return model_path(self.root, self.base, self.fmt)

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "llama-bench"

    @property
    def threads(self) -> int:
        return self.n_threads or torch.get_num_threads()

    @property
    def params(self) -> dict[str, Any]:
        return {"format": self.fmt, "gguf": self.model.name, "n_threads": self.threads, "tool": "llama-bench",
                "prefill": "pp<prompt_len> at depth 0", "decode": "tg<new_tokens> at depth <prompt_len>",
                "kv_type": self.kv_type, "flash_attn": self.kv_type != "f16"}

    def unavailable(self, batch_size: int) -> str:
        if Path(self.base).name != self.base:  # an HF directory: the build script makes a bundled model's formats
            return f"no llama.cpp GGUF for {self.base}: the formats are made for bundled models; {BUILD_HINT}"
        if not os.access(self.binary, os.X_OK):
            return f"llama.cpp's llama-bench is not built in {self.root}: {BUILD_HINT}"
        if not self.model.exists():
            return f"no {self.fmt} GGUF of {self.base} at {self.model}: {BUILD_HINT}"
        if batch_size != 1:
            return "llama-bench times one sequence: batch size 1 only"
        return ""

    def _measure(self, prompt_len: int, new_tokens: int, reps: int) -> list[GenOutput]:
        cfg = BenchConfig(prompt_len=prompt_len, new_tokens=new_tokens)
        tests, peak = [], 0.0
        for cmd in bench_commands(self.binary, self.model, cfg, self.threads, reps, self.kv_type):
            run = self.runner(cmd)
            if run.returncode != 0:
                tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise RuntimeError(f"{' '.join(cmd)} exited with {run.returncode}: {tail}")
            tests += parse_bench_json(run.stdout)
            peak = max(peak, run.peak_rss_mb)
        pp = next((t for t in tests if t.n_prompt == prompt_len and t.n_gen == 0 and t.n_depth == 0), None)
        tg = next((t for t in tests if t.n_gen == new_tokens and t.n_prompt == 0 and t.n_depth == prompt_len), None)
        if pp is None or tg is None:
            raise RuntimeError(f"llama-bench did not report pp{prompt_len} at depth 0 and tg{new_tokens} at depth "
                               f"{prompt_len}: got {[(t.n_prompt, t.n_gen, t.n_depth) for t in tests]}")
        return outputs_from_tests(pp, tg, new_tokens, peak)

    def generate(self, input_ids: torch.Tensor, new_tokens: int, probe: bool = False) -> GenOutput:
        if input_ids.shape[0] != 1:
            raise ValueError(f"{self.name} runs batch size 1 only, got {input_ids.shape[0]} rows")
        if probe:
            if self._facts is None:
                self._facts = build_facts(self.root, self.model, self.runner)
            return GenOutput(None, 0.0, 0.0, stats={"llama_cpp": self._facts, "layer_skip_ratio": None,
                                                    "method_ratio": None})
        return self._measure(input_ids.shape[1], new_tokens, 1)[0]

    def generate_runs(self, input_ids: torch.Tensor, new_tokens: int, runs: int) -> list[GenOutput]:
        if input_ids.shape[0] != 1:
            raise ValueError(f"{self.name} runs batch size 1 only, got {input_ids.shape[0]} rows")
        return self._measure(input_ids.shape[1], new_tokens, runs)


def llama_bench_systems(base: str, formats: tuple[str, ...] | None = None) -> list[LlamaBenchSystem]:
    return [LlamaBenchSystem(fmt, base) for fmt in (formats_for(base) if formats is None else formats)]


def rates(prefill_runs: list[float], decode_runs: list[float], prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """llama-bench's statistics from a row's runs (seconds; decode scaled to N-1 tokens): mean and sample std of
    the per-run prefill (pp) and decode (tg) rates in tokens/s, as llama-bench's avg_ts / stddev_ts."""
    pp = [prompt_len / s for s in prefill_runs if s > 0]
    tg = [(new_tokens - 1) / s for s in decode_runs if s > 0]

    def mean_std(xs):
        if not xs:
            return None, None
        m = sum(xs) / len(xs)
        return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)

    (pa, ps), (ta, ts) = mean_std(pp), mean_std(tg)
    return {"pp_avg_ts": pa, "pp_stddev_ts": ps, "tg_avg_ts": ta, "tg_stddev_ts": ts, "samples": len(tg)}


# ----------------------------------------------------------------------------------------------- llama-perplexity


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """llama-perplexity's result: the final estimate with its +/- (std error), the running PPL after each chunk
    (``[i]ppl`` on its output), and the chunk count and context it reported."""

    ppl: float
    ppl_err: float
    running: tuple[float, ...]
    n_chunks: int
    n_ctx: int

    @property
    def scored_tokens(self) -> int:
        """Tokens scored: per chunk, the second half of the context after its first token (n_ctx - n_ctx/2 - 1)."""
        return self.n_chunks * (self.n_ctx - self.n_ctx // 2 - 1)

    def chunk_nll(self) -> list[float]:
        """Mean NLL of each chunk, from the running estimates (every chunk scores the same number of tokens)."""
        logs = [math.log(p) for p in self.running]
        return [(i + 1) * logs[i] - i * logs[i - 1] if i else logs[0] for i in range(len(logs))]


def parse_perplexity(text: str) -> PerplexityResult:
    """llama-perplexity's stdout and stderr (in any order) parsed; ValueError naming what is missing."""
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
    header = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", text)
    if final is None or header is None:
        short = re.search(r"tokenizes to only (\d+) tokens", text)
        if short:
            raise ValueError(f"the text tokenizes to only {short.group(1)} tokens: llama-perplexity needs at least "
                             "two contexts' worth; pass a longer text")
        raise ValueError("llama-perplexity output lacks its 'calculating perplexity over N chunks' line or its "
                         "'Final estimate' (did it fail? see its stderr)")
    running = tuple(float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", text))
    n_chunks = int(header.group(1))
    if len(running) != n_chunks:
        raise ValueError(f"llama-perplexity reported {n_chunks} chunks but {len(running)} running estimates")
    return PerplexityResult(float(final.group(1)), float(final.group(2)), running, n_chunks, int(header.group(2)))


def perplexity_command(root: Path, model: Path, text_file: Path, n_ctx: int, threads: int,
                       token_dump: Path | None = None) -> list[str]:
    """``llama-perplexity -f text -c n_ctx -t threads``; ``token_dump`` also writes the scored chunks' token ids
    (and log-probabilities) to that file (``--kl-divergence-base``), to compare tokenizations."""
    cmd = [str(root / "bin" / "llama-perplexity"), "-m", str(model), "-f", str(text_file), "-c", str(n_ctx),
           "-t", str(threads)]
    return cmd + (["--kl-divergence-base", str(token_dump)] if token_dump is not None else [])


def read_token_dump(path: Path) -> tuple[int, list[int]]:
    """(n_ctx, token ids of the scored chunks) from a ``--kl-divergence-base`` file: ``_logits_``, then int32
    n_ctx, n_vocab, n_chunk and n_chunk * n_ctx int32 token ids (the log-probabilities after them are skipped)."""
    import struct

    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity --kl-divergence-base file")
        n_ctx, _n_vocab, n_chunk = struct.unpack("<iii", f.read(12))
        ids = struct.unpack(f"<{n_chunk * n_ctx}i", f.read(4 * n_chunk * n_ctx))
    return n_ctx, list(ids)
