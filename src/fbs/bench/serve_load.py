"""``fbs bench serve``: a bounded load test of ``fbs serve`` on loopback.

For every FBS mode (``skip``: the model's tau; ``full``: ``force_compute``, every layer runs) and every client
count, that many client threads send streamed greedy completions (fixed prompts of ``prompt_len`` token ids,
exactly ``max_tokens`` new tokens: ``ignore_eos``) until ``requests`` have been sent or the cell's time limit
has passed. Per request: time to first token (send -> first text chunk), per-token latency
((last chunk - first chunk) / (tokens - 1)), the token count the usage reports, and any error. Per cell:
throughput (generated tokens / wall time from the first send to the last answer), p50/p99 of both latencies,
errors, requests that came back short ("lost" tokens) and the mean FBS skip ratio / TFLOPs(rel).

The server is either the one at ``--url`` (loopback addresses only) or one this command starts as a
subprocess on a free loopback port and stops at the end. Nothing here times a unit test: this is a command
that prints a table and writes JSON (docs/serve.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import math
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

MODES = {"skip": {}, "full": {"force_compute": True}}


@dataclasses.dataclass
class LoadConfig:
    """The load test's knobs; each default lives here only."""

    clients: tuple[int, ...] = (1, 4, 8)
    modes: tuple[str, ...] = ("skip", "full")
    requests: int = 32              # per (mode, clients) cell
    max_tokens: int = 64            # generated per request, exactly (ignore_eos)
    prompt_len: int = 128           # prompt token ids per request
    num_prompts: int = 8            # distinct prompts, cycled
    warmup: int = 2                 # unmeasured requests per mode before its cells
    time_limit_s: float = 300.0     # per cell: no request is sent after it (those in flight finish)
    request_timeout_s: float = 600.0
    batch_policy: str | None = None  # None: the server's default

    def __post_init__(self):
        if not self.clients or min(self.clients) < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be from {', '.join(MODES)}, got {self.modes}")
        for name in ("requests", "max_tokens", "prompt_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.time_limit_s <= 0 or self.warmup < 0:
            raise ValueError("time_limit_s must be > 0 and warmup >= 0")


def require_loopback(url: str) -> str:
    """``url`` unchanged if its host is a loopback address; the load test sends traffic nowhere else."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"the load test only targets loopback addresses (127.0.0.0/8, ::1, localhost), got {host!r}")
    return url


# --------------------------------------------------------------------------- one request, one cell
@dataclasses.dataclass
class Sample:
    ok: bool
    ttft_s: float = math.nan
    per_token_s: float = math.nan
    tokens: int = 0
    skip_ratio: float = math.nan
    tflops_rel: float = math.nan
    error: str = ""
    end: float = 0.0


def one_request(client, model: str, prompt: list[int], cfg: LoadConfig, extra: dict) -> Sample:
    """A streamed completion; timestamps each text chunk on arrival."""
    body = {"ignore_eos": True, **extra}
    if cfg.batch_policy:
        body["batch_policy"] = cfg.batch_policy
    t0 = time.perf_counter()
    first = last = None
    use = None
    try:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=cfg.max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=body)
        for ch in stream:
            now = time.perf_counter()
            if ch.choices and ch.choices[0].text:
                first = now if first is None else first
                last = now
            if ch.usage is not None:
                use = ch.usage
    except Exception as e:  # noqa: BLE001 - every failure is a counted error
        return Sample(False, error=f"{type(e).__name__}: {e}", end=time.perf_counter())
    end = time.perf_counter()
    if use is None or first is None:
        return Sample(False, error="no usage chunk or no text in the stream", end=end)
    fbs = (use.model_extra or {}).get("fbs") or {}
    n = use.completion_tokens
    return Sample(True, first - t0, (last - first) / (n - 1) if n > 1 else math.nan, n,
                  fbs.get("skip_ratio", math.nan), fbs.get("tflops_rel", math.nan), end=end)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q  # linear interpolation between closest ranks
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def run_cell(url: str, model: str, prompts: list[list[int]], clients: int, mode: str, cfg: LoadConfig,
             count: int | None = None) -> dict:
    """``clients`` threads share ``count`` (default ``cfg.requests``) requests; none is sent after the limit."""
    import openai

    count = cfg.requests if count is None else count
    lock = threading.Lock()
    issued = [0]
    samples: list[Sample] = []
    start = time.perf_counter()
    stop_at = start + cfg.time_limit_s

    def client_loop():
        client = openai.OpenAI(base_url=url, api_key="fbs", max_retries=0, timeout=cfg.request_timeout_s)
        while True:
            with lock:
                if issued[0] >= count or time.perf_counter() > stop_at:
                    return
                i = issued[0]
                issued[0] += 1
            s = one_request(client, model, prompts[i % len(prompts)], cfg, MODES[mode])
            with lock:
                samples.append(s)

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [s for s in samples if s.ok]
    wall = (max(s.end for s in samples) - start) if samples else math.nan
    tokens = sum(s.tokens for s in ok)
    return {
        "mode": mode, "clients": clients, "requests": len(samples), "not_sent": count - len(samples),
        "errors": len(samples) - len(ok), "short": sum(s.tokens != cfg.max_tokens for s in ok),
        "tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall if wall and wall > 0 else math.nan,
        "requests_per_s": len(ok) / wall if wall and wall > 0 else math.nan,
        "ttft_p50_s": _pct([s.ttft_s for s in ok], 0.5), "ttft_p99_s": _pct([s.ttft_s for s in ok], 0.99),
        "per_token_p50_s": _pct([s.per_token_s for s in ok], 0.5),
        "per_token_p99_s": _pct([s.per_token_s for s in ok], 0.99),
        "skip_ratio": _mean([s.skip_ratio for s in ok]), "tflops_rel": _mean([s.tflops_rel for s in ok]),
        "error_messages": sorted({s.error for s in samples if not s.ok})[:5],
    }


def run_load(url: str, model: str, prompts: list[list[int]], cfg: LoadConfig, progress=None) -> list[dict]:
    """Every (mode, clients) cell, modes outermost; ``cfg.warmup`` unmeasured requests open each mode."""
    cells = []
    for mode in cfg.modes:
        if cfg.warmup:
            run_cell(url, model, prompts, 1, mode, cfg, count=cfg.warmup)
        for c in cfg.clients:
            cell = run_cell(url, model, prompts, c, mode, cfg)
            cells.append(cell)
            if progress:
                progress(cell)
    return cells


def speedups(cells: list[dict]) -> dict:
    """Throughput at the most clients over one client, per mode, and skip over full per client count."""
    by = {(c["mode"], c["clients"]): c["throughput_tok_s"] for c in cells}
    out = {}
    for mode in dict.fromkeys(c["mode"] for c in cells):
        counts = sorted(c for m, c in by if m == mode)
        if len(counts) > 1 and by[(mode, counts[0])] > 0:
            out[f"{mode}: {counts[-1]} clients / {counts[0]}"] = by[(mode, counts[-1])] / by[(mode, counts[0])]
    for (m, c), v in by.items():
        if m == "skip" and by.get(("full", c)):
            out[f"skip / full at {c} clients"] = v / by[("full", c)]
    return out


def render(doc: dict) -> str:
    ms = lambda x: "–" if x is None or math.isnan(x) else f"{1000 * x:.1f}"  # noqa: E731
    lines = ["| mode | clients | requests | errors | short | tok/s | req/s | TTFT p50 ms | TTFT p99 ms | "
             "per-token p50 ms | per-token p99 ms | skip | TFLOPs(rel) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cells"]:
        lines.append(f"| {c['mode']} | {c['clients']} | {c['requests']}"
                     f"{' (+' + str(c['not_sent']) + ' not sent)' if c['not_sent'] else ''} | {c['errors']} | "
                     f"{c['short']} | {c['throughput_tok_s']:.1f} | {c['requests_per_s']:.2f} | "
                     f"{ms(c['ttft_p50_s'])} | "
                     f"{ms(c['ttft_p99_s'])} | {ms(c['per_token_p50_s'])} | {ms(c['per_token_p99_s'])} | "
                     f"{100 * c['skip_ratio']:.1f}% | {c['tflops_rel']:.3f} |")
    lines += [""] + [f"- throughput {k}: {v:.2f}x" for k, v in doc["speedups"].items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the server under test
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only (require_loopback)
        return json.loads(r.read())


class ServerProcess:
    """``fbs serve`` in a subprocess on a free loopback port, stopped (terminated) on exit."""

    def __init__(self, serve_args: list[str], startup_timeout_s: float):
        self.port = _free_port()
        self.cmd = [sys.executable, "-m", "fbs.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "warning", *serve_args]
        self.timeout = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fbs serve exited with code {self.proc.returncode}: {shlex.join(self.cmd)}")
            try:
                _get(f"http://127.0.0.1:{self.port}/health", timeout=2.0)
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"fbs serve did not answer within {self.timeout:g} s") from None
                time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------- the command
def _prompts(model_arg: str, cfg: LoadConfig) -> list[list[int]]:
    """The benchmark's prompts (windows of CPython's bundled reference text) under the model's tokenizer."""
    from fbs.bench.harness import build_prompts
    from fbs.model.bases import load_tokenizer

    return build_prompts(load_tokenizer(model_arg), cfg.num_prompts, cfg.prompt_len).tolist()


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        cfg = LoadConfig(clients=args.clients, modes=args.modes, requests=args.requests, max_tokens=args.max_tokens,
                         prompt_len=args.prompt_len, num_prompts=args.num_prompts, warmup=args.warmup,
                         time_limit_s=args.time_limit, batch_policy=args.batch_policy)
        if args.url:
            require_loopback(args.url)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = _prompts(args.model, cfg)
    serve_args = ["--model", str(args.model), "--max-concurrent", str(max(cfg.clients)),
                  "--max-tokens", str(cfg.max_tokens), "--context-length", str(cfg.prompt_len + cfg.max_tokens)]
    serve_args += ["--checkpoint", args.checkpoint] if args.checkpoint else []
    serve_args += ["--fresh"] if args.fresh else []
    serve_args += ["--threads", str(args.threads)] if args.threads else []
    serve_args += ["--weights", args.weights] if args.weights else []

    def progress(cell):
        print(f"  {cell['mode']:>4} x {cell['clients']} clients: {cell['throughput_tok_s']:.1f} tok/s, "
              f"{cell['errors']} errors", flush=True)

    server = None if args.url else ServerProcess(serve_args, args.startup_timeout)
    if server is not None:
        print(f"starting: {shlex.join(server.cmd)}", flush=True)
        server.__enter__()
    try:
        url = args.url or server.url
        model = args.served_model_name or _get(url.rstrip("/") + "/models")["data"][0]["id"]
        status_url = url.rstrip("/") + "/fbs/status"
        cells = run_load(url, model, prompts, cfg, progress)
        status = _get(status_url)
    finally:
        if server is not None:
            server.__exit__()
    from fbs.provenance import provenance

    doc = {"command": shlex.join(sys.argv), "url": url, "model": model, "server_started": server is not None,
           "server_args": serve_args if server is not None else None, "config": dataclasses.asdict(cfg),
           "cells": cells, "speedups": speedups(cells), "server_status": status,
           "errors": sum(c["errors"] for c in cells), "provenance": provenance()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(doc, indent=2))
    table = render(doc)
    (out / "serve.md").write_text(f"    {doc['command']}\n\n{table}\n")
    print(table)
    print(f"json: {out / 'serve.json'}\nmarkdown: {out / 'serve.md'}")
    return 1 if doc["errors"] else 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _strs(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..engine.fused import WEIGHTS  # the engine and torch only when the parser is built

    from fbs.model.bases import DEFAULT_BASE

    d = LoadConfig()
    p.add_argument("--url", help="an fbs serve already running on loopback, e.g. http://127.0.0.1:8000/v1 "
                                 "(default: start one as a subprocess on a free port)")
    p.add_argument("--model", default=DEFAULT_BASE, help="base model (prompts are tokenized with its tokenizer)")
    p.add_argument("--checkpoint", help="FBS checkpoint for the started server (default: the shipped weights)")
    p.add_argument("--fresh", action="store_true", help="the started server uses untrained FBS modules")
    p.add_argument("--served-model-name", help="model id to request (default: the server's first model)")
    p.add_argument("--weights", choices=WEIGHTS, help="decode weights of the started server")
    p.add_argument("--threads", type=int, help="torch threads of the started server")
    p.add_argument("--clients", type=_ints, default=d.clients, help="concurrent clients, comma list (default 1,4,8)")
    p.add_argument("--modes", type=_strs, default=d.modes,
                   help="skip (the model's tau) and/or full (force_compute), comma list")
    p.add_argument("--requests", type=int, default=d.requests, help="requests per (mode, clients) cell")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="new tokens per request, exactly")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens per request")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured requests before each mode")
    p.add_argument("--time-limit", type=float, default=d.time_limit_s,
                   help="seconds per cell after which no request is sent")
    p.add_argument("--batch-policy", choices=("gather", "all", "majority"), help="sent with every request")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for the started server (the first run converts the bundled model)")
    p.add_argument("--out-dir", default="bench-results", help="where serve.json and serve.md go")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="bounded loopback load test of fbs serve",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench_serve)
