"""What the evaluation commands share: threads and seed, the checkpoint a command reads, the chat items."""

from __future__ import annotations

from pathlib import Path


def setup_runtime(args) -> None:
    """``--threads`` and the global seed (appendix B.1)."""
    import torch

    from fbs.eval.report import seed_everything

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)


def checkpoint_path(args) -> Path | None:
    from fbs.model.loading import choose_checkpoint

    return choose_checkpoint(args.model, args.checkpoint, shipped=not args.fresh)


def chat_items(args):
    from fbs.data.chat import load_items, read_items, split

    items = read_items(args.items) if args.items else split(load_items())[1]
    if args.limit:
        count: dict[str, int] = {}
        kept = []
        for it in items:
            count[it.lang] = count.get(it.lang, 0) + 1
            if count[it.lang] <= args.limit:
                kept.append(it)
        items = kept
    return items
