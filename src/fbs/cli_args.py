"""The command-line options every ``fbs`` command shares: which model to load.

    add_model_arguments(parser)   --model, --checkpoint, --fresh, --tau, --kv-policy and the two loading opt-outs
    load_from_args(args)          the model those options ask for (:func:`fbs.model.loading.load_fbs`)

Below the commands (``fbs.cli`` and the ``cli`` modules of serve, train, eval, ...), above the model, so the
model's loading knows nothing of argparse.
"""

from __future__ import annotations

import argparse

from .model import loading
from .model.bases import DEFAULT_BASE
from .model.causal_lm import FBSForCausalLM


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options that choose a model: base, checkpoint or shipped weights or fresh modules, tau, KV policy."""
    p.add_argument("--model", default=DEFAULT_BASE,
                   help="base model: a bundled name (smollm2-135m, qwen2.5-coder-0.5b) or an HF directory")
    p.add_argument("--checkpoint", help="FBS checkpoint directory (default: the weights shipped for --model)")
    p.add_argument("--fresh", action="store_true", help="ignore shipped weights: untrained FBS modules")
    p.add_argument("--tau", type=float, help="skip threshold (default: the checkpoint's operating point)")
    p.add_argument("--kv-policy", choices=("hole", "project"), help="KV cache policy for skipped layers")
    p.add_argument("--no-base-check", action="store_true",
                   help="load a checkpoint (or Kangaroo adapter) that records no base-model fingerprint, or "
                        "another base's (unsafe)")
    p.add_argument("--no-integrity-check", action="store_true",
                   help="load a checkpoint whose weights files do not match (or lack) its sha256 record (unsafe)")


def load_from_args(args: argparse.Namespace) -> FBSForCausalLM:
    """The model :func:`add_model_arguments`' options ask for."""
    overrides = {k: v for k, v in (("tau", args.tau), ("kv_policy", args.kv_policy)) if v is not None}
    if getattr(args, "no_base_check", False):
        overrides["check_base"] = False
    if getattr(args, "no_integrity_check", False):
        overrides["check_integrity"] = False
    return loading.load_fbs(args.model, args.checkpoint, shipped=not args.fresh, **overrides)


def add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """The linear BIOS probe's options (``fbs probe`` and ``fbs eval segatron``): the hidden-state layer, the corpus
    splits and sizes it trains and is scored on, and its optimizer."""
    p.add_argument("--layer", type=int, default=None, help="hidden_states index (default: num_hidden_layers // 2)")
    p.add_argument("--train-split", default="validation")
    p.add_argument("--eval-split", default="test")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--train-seqs", type=int, default=256, help="probe training sequences (0 = all)")
    p.add_argument("--eval-seqs", type=int, default=64, help="evaluation sequences (0 = all)")
    p.add_argument("--idiom-items", type=int, default=200, help="idiom-recognition items (0 to skip)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
