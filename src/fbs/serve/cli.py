"""``fbs serve``: the OpenAI-compatible server (docs/serve.md). Only this module (and the load test's command, fbs.bench.serve_load) prints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..engine.defaults import AUTO, KV_DTYPE_CHOICES, PREFILL_CHOICES, resolve_kv_dtype, resolve_prefill, resolve_weights
from ..engine.fused import WEIGHTS
from ..cli_args import add_model_arguments, load_from_args
from .batcher import Limits


def served_name(model_arg) -> str:
    """The model id clients use: the bundled name, or the directory's name."""
    return Path(str(model_arg)).name


def _need_server_deps() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as e:
        raise SystemExit(f"fbs serve needs {e.name}: pip install -e '.[serve]' (make test installs it)") from e


def cmd_serve(args: argparse.Namespace) -> int:
    _need_server_deps()
    import torch

    from .app import create_app, run

    if args.threads:
        torch.set_num_threads(args.threads)
    limits = Limits(max_concurrent=args.max_concurrent, max_queue=args.max_queue, timeout_s=args.timeout,
                    max_tokens=args.max_tokens, context_length=args.context_length)
    model = load_from_args(args).eval()
    name = args.served_model_name or served_name(args.model)
    weights = resolve_weights(args.weights)
    app = create_app(model, model.tokenizer, name, limits,
                     defaults={"batch_policy": args.batch_policy, "weights": weights,
                               "kv_dtype": args.kv_dtype, "prefill": args.prefill})
    cfg, context = model.config, min(limits.context_length, model.base.spec.max_positions)
    print(f"fbs serve: {name} (tau {cfg.tau}, kv {cfg.kv_policy}, batch policy {args.batch_policy}, "
          f"weights {weights}, KV cache {resolve_kv_dtype(args.kv_dtype, weights)}, "
          f"prefill {resolve_prefill(args.prefill, weights)}, {limits.max_concurrent} slots, "
          f"context {context} tokens) at http://{args.host}:{args.port}/v1", flush=True)
    run(app, args.host, args.port, args.log_level, scheduler=app.state.scheduler)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Limits()
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the --model name)")
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent, help="requests decoded at once (slots)")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting for a slot; more get 429")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds from arrival to the last token (408)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="largest max_tokens a request may ask for")
    p.add_argument("--context-length", type=int, default=d.context_length,
                   help="prompt + max_tokens per request, capped by the model's positions; each slot's KV cache "
                        "holds this many tokens")
    p.add_argument("--batch-policy", choices=("gather", "all", "majority"), default="gather",
                   help="default batch policy (requests may set their own): gather keeps every request's output "
                        "independent of the others; majority decides per layer for the batch (faster at B > 1)")
    p.add_argument("--weights", choices=(AUTO,) + WEIGHTS, default=AUTO,
                   help="decode weights (engine option); auto: the fastest format within 0.5 %% of fp32's held-out "
                        "PPL whose native kernels run here, else fp32 (fbs.engine.defaults)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default=AUTO,
                   help="default KV cache storage (requests may set their own): fp32, fp16, bf16, int8 (codes and "
                        "a scale per entry), or auto: int8 under the quantized weights, else fp32 (fbs.engine.defaults)")
    p.add_argument("--prefill", choices=PREFILL_CHOICES, default=AUTO,
                   help="default for how a prompt's products run (requests may set their own): fp32, blocks (the "
                        "q4 / q8 decode kernels) or int8 (an int8 GEMM); auto: each weight format's default "
                        "(fbs.engine.defaults)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=cmd_serve)


if __name__ == "__main__":
    from ..cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
