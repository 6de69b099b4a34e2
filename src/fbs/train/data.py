"""Token blocks for Stage-1: a deterministic, resumable order over a tensor of packed blocks.

Sources: the corpus built by ``fbs data build`` (:class:`fbs.data.corpus.PackedBlocks`, train and
validation splits, with BIOS weak labels), or the English ``wiki_demo`` text (documents split into
train / held-out by document, no BIOS labels). Any (N, T) tensor of token ids works too.

Order: epoch e visits the blocks in ``randperm(N, seed + e)``. Global position p (blocks consumed
since the start, across processes) maps to block ``perm_{p // N}[p % N]``, so the order depends on
the step alone and a resumed run reads exactly the blocks the uninterrupted run would have read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from ..data.corpus import pack

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100


class BlockData(NamedTuple):
    train_ids: torch.Tensor             # (N, T) int64
    train_bios: torch.Tensor | None     # (N, T) int64, -100 = no label; None when the source has none
    eval_ids: torch.Tensor              # (M, T)
    eval_bios: torch.Tensor | None      # (M, T)


class Batch(NamedTuple):
    input_ids: torch.Tensor            # (B, T)
    bios_labels: torch.Tensor | None   # (B, T)
    positions: torch.Tensor            # (B,) global positions (for logs and tests)


def wiki_demo_blocks(tokenizer, block_size: int, eval_blocks: int) -> BlockData:
    """wiki_demo articles, tokenized; the last articles (at least ``eval_blocks`` blocks) are held out."""
    from ..data.sources import read_source

    texts = [d.text for d in read_source("wiki_demo")]
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    need, cut = eval_blocks * block_size, len(docs)
    held = 0
    while cut > 1 and held < need + block_size:
        cut -= 1
        held += len(docs[cut]) + 1
    train, ev = pack(docs[:cut], block_size, sep), pack(docs[cut:], block_size, sep)[:eval_blocks]
    if len(ev) < eval_blocks or len(train) == 0:
        raise ValueError(f"wiki_demo is too small for {eval_blocks} held-out blocks of {block_size} tokens")
    logger.info("wiki_demo: %d train blocks, %d held-out blocks of %d tokens", len(train), len(ev), block_size)
    return BlockData(train, None, ev, None)


def corpus_blocks(corpus_dir: str | Path, tokenizer, block_size: int, eval_blocks: int,
                  max_train_blocks: int | None = None) -> BlockData:
    """Blocks of a corpus built by ``fbs data build`` / ``fbs data label`` (train + validation splits)."""
    from ..data.corpus import PackedBlocks

    def take(split: str, limit: int | None):
        ids, labs = [], []
        for blk in PackedBlocks(corpus_dir, split, tokenizer, block_size=block_size):
            ids.append(blk.input_ids), labs.append(blk.bios_labels)
            if limit is not None and len(ids) >= limit:
                break
        if not ids:
            raise ValueError(f"{corpus_dir}: split {split!r} has no full block of {block_size} tokens")
        ids, labs = torch.stack(ids), torch.stack(labs)
        return ids, (labs if bool((labs != IGNORE_INDEX).any()) else None)

    tr, trb = take("train", max_train_blocks)
    ev, evb = take("validation", eval_blocks)
    return BlockData(tr, trb, ev, evb)


def top_tokens(blocks: torch.Tensor, n: int, vocab_size: int) -> torch.Tensor:
    """The ``n`` most frequent token ids of ``blocks`` (ties and unseen tokens broken by lower id)."""
    counts = torch.bincount(blocks.flatten(), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) / (2 * vocab_size)  # prefer low ids on ties
    return counts.topk(n).indices.sort().values


class BlockOrder:
    """Deterministic block order; caches one permutation per epoch."""

    def __init__(self, n_blocks: int, seed: int):
        self.n, self.seed = n_blocks, seed
        self._perm: tuple[int, torch.Tensor] | None = None

    def __call__(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g))
        return int(self._perm[1][offset])


def micro_batch(data: BlockData, order: BlockOrder, micro_index: int, size: int, rank: int = 0,
                world: int = 1) -> Batch:
    """Micro-batch ``micro_index`` of process ``rank``: global positions ((m * world + rank) * size) + [0, size)."""
    start = (micro_index * world + rank) * size
    pos = torch.arange(start, start + size)
    idx = torch.tensor([order(int(p)) for p in pos])
    bios = data.train_bios[idx] if data.train_bios is not None else None
    return Batch(data.train_ids[idx], bios, pos)
