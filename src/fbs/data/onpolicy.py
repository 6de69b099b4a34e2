"""On-policy draft data: the verifier's own greedy answers to chat and code-edit prompts (``fbs data drafts``).

A draft (Medusa heads, an EAGLE layer, a distilled draft model) is accepted when it predicts what the verifier
itself will write, so it learns best from the verifier's own outputs on the kind of prompt it will serve (Medusa-2's
self-distillation; EAGLE trains on fixed chat data, and a model this small answers unlike any data set). The prompts:

* ``chat``: the Alpaca demo *training* items of :mod:`fbs.data.chat` (the held-out prompts of ``fbs eval chat`` and
  ``fbs bench --prompt-set chat`` are never used), English and Chinese;
* ``code``: functions of the Python standard library of the running interpreter (top-level functions of 4 to 40
  lines, found with :mod:`ast`), each with one of the two code-edit instructions of
  ``fbs bench --prompt-set code`` (:data:`fbs.data.chat.CODE_INSTRUCTIONS`; that set's MBPP / HumanEval
  items are never used), chosen by a seeded hash of the function's id.

Every prompt is rendered with the model's chat template and answered greedily at full depth (no skipping) in the
engine's default decode format, in batches; each finished batch is appended to ``sequences.jsonl`` (one line per
item: ``id``, ``kind``, ``prompt_len``, ``ids`` = prompt + answer), so an interrupted run resumes where it stopped.
``meta.json`` records the prompts' sources, the answer budget, the counts, the wall time and the provenance.
:func:`sequence_blocks` packs the sequences into training blocks (EOS between sequences).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch

SEQUENCES = "sequences.jsonl"
META = "meta.json"
MIN_LINES, MAX_LINES = 4, 40


def _rank(key: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def stdlib_functions(root: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """(id, source) of every top-level function of ``MIN_LINES``..``MAX_LINES`` lines in the standard library
    at ``root`` (default: the running interpreter's), sorted by id; tests and private packages are left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3") for part in rel.split("/")):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and MIN_LINES <= node.end_lineno - node.lineno + 1 <= MAX_LINES:
                seg = ast.get_source_segment(src, node)
                if seg:
                    out.append((f"stdlib/{rel}:{node.name}", textwrap.dedent(seg)))
    return out


def prompts(tokenizer, langs: tuple[str, ...] = ("en", "zh"), code_items: int = 800, seed: int = 0,
            chat_items: int | None = None,
            max_prompt_tokens: int = 512, stdlib_root: str | os.PathLike | None = None) -> list[dict]:
    """The prompts of the module docstring: ``{"id", "kind", "ids"}``, chat items first, then code edits; a prompt
    longer than ``max_prompt_tokens`` under the template is left out. ``chat_items``: at most this many chat
    prompts (a seeded sample; default all). ``stdlib_root``: another source tree for the
    code prompts (default: the running interpreter's standard library)."""
    from .chat import CODE_INSTRUCTIONS, fence, load_items, render_prompt, render_user_turn, split

    out = []
    if langs:
        train, _ = split(load_items(langs))
        if chat_items is not None:  # a seeded sample, in hash order
            train = sorted(train, key=lambda it: _rank(it.id, seed))[:chat_items]
        out += [{"id": it.id, "kind": "chat", "ids": render_prompt(tokenizer, it)} for it in train]
    if code_items:
        funcs = sorted(stdlib_functions(stdlib_root), key=lambda f: _rank(f[0], seed))
        kinds = sorted(CODE_INSTRUCTIONS)
        n = 0
        for fid, src in funcs:
            if n == code_items:
                break
            kind = kinds[int(_rank(fid, seed + 1), 16) % len(kinds)]
            ids = render_user_turn(tokenizer, f"{CODE_INSTRUCTIONS[kind]}\n\n{fence(src)}")
            if len(ids) <= max_prompt_tokens:
                out.append({"id": fid, "kind": "code", "ids": ids})
                n += 1
    return [p for p in out if len(p["ids"]) <= max_prompt_tokens]


def read_sequences(out_dir: str | os.PathLike) -> list[dict]:
    path = Path(out_dir) / SEQUENCES
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; create it with `fbs data drafts --out {Path(out_dir)}`")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if f.read().strip():  # a torn last line is what a crash leaves; anything else is damage
                    raise ValueError(f"{path}:{n} is not JSON; delete the file and rerun `fbs data drafts`")
    return rows


def build(model, out_dir: str | os.PathLike, items: list[dict], max_new_tokens: int = 256, batch_size: int = 8,
          progress: Callable | None = None, meta: dict | None = None) -> dict:
    """Answer ``items`` (from :func:`prompts`) greedily at full depth with ``model`` and append them to
    ``out_dir/sequences.jsonl``; items already there are skipped (resume). Returns (and writes) ``meta.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SEQUENCES
    have = read_sequences(out_dir) if path.is_file() else []
    done = {r["id"] for r in have}
    if path.is_file():  # drop a torn last line before appending
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in have), encoding="utf-8")
        tmp.replace(path)
    todo = [it for it in items if it["id"] not in done]
    # similar lengths together: a batch's prompts are padded to its longest
    todo.sort(key=lambda it: len(it["ids"]))
    t0 = time.perf_counter()
    starts = range(0, len(todo), batch_size)
    with open(path, "a", encoding="utf-8") as f:
        for start in (progress(starts, desc="answers", unit="batch") if progress else starts):
            chunk = todo[start:start + batch_size]
            res = model.generate([it["ids"] for it in chunk], max_new_tokens=max_new_tokens, force_compute=True,
                                 weights="auto", tokenizer=getattr(model, "tokenizer", None))
            for it, new in zip(chunk, res.new_tokens):
                new = [int(t) for t in new]
                f.write(json.dumps({"id": it["id"], "kind": it["kind"], "prompt_len": len(it["ids"]),
                                    "ids": it["ids"] + new}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
    rows = read_sequences(out_dir)
    prev = json.loads((out_dir / META).read_text()) if (out_dir / META).is_file() else {}
    from ..provenance import provenance

    info = {"provenance": provenance(), **(meta or {}), "max_new_tokens": max_new_tokens, "batch_size": batch_size,
            "sequences": len(rows), "by_kind": {k: sum(r["kind"] == k for r in rows) for k in ("chat", "code")},
            "answer_tokens": sum(len(r["ids"]) - r["prompt_len"] for r in rows),
            "tokens": sum(len(r["ids"]) for r in rows),
            "wall_s": prev.get("wall_s", 0.0) + time.perf_counter() - t0}
    tmp = out_dir / (META + ".tmp")
    tmp.write_text(json.dumps(info, indent=1, ensure_ascii=False))
    tmp.replace(out_dir / META)
    return info


def is_sequence_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / SEQUENCES).is_file()


def sequence_blocks(out_dir: str | os.PathLike, block_size: int, eval_blocks: int, sep: int,
                    max_train_blocks: int | None = None):
    """The sequences packed into (N, block_size) blocks with ``sep`` between them: a
    :class:`fbs.train.data.BlockData`-like pair (train, eval). The held-out blocks come from the sequences whose id
    hashes lowest, so adding sequences never moves one from training into evaluation silently."""
    rows = sorted(read_sequences(out_dir), key=lambda r: _rank(r["id"], 7))
    from .corpus import pack

    need, held, cut = eval_blocks * block_size, 0, 0
    while cut < len(rows) and held < need + block_size:
        held += len(rows[cut]["ids"]) + 1
        cut += 1
    ev = pack([r["ids"] for r in rows[:cut]], block_size, sep)[:eval_blocks]
    train = pack([r["ids"] for r in rows[cut:]], block_size, sep)
    if max_train_blocks is not None:
        train = train[:max_train_blocks]
    if len(train) == 0 or len(ev) < eval_blocks:
        raise ValueError(f"{out_dir}: too few sequences for {eval_blocks} held-out blocks and a training block of "
                         f"{block_size} tokens; generate more with `fbs data drafts`")
    return train, ev
