"""Corpus builder, weak-label pass, and the packed token stream for training.

``build_corpus`` reads the offline sources, keeps documents of at least ``min_tokens`` tokens,
removes exact and near duplicates (> 0.7), splits train/validation/test by document with a seeded
hash, and writes ``{split}.jsonl`` plus ``manifest.json``. ``label_corpus`` adds
``{split}.bios.jsonl`` with the character-level weak chunks of every Chinese document.
:class:`PackedBlocks` streams fixed-length token blocks with BIOS labels aligned to them.

Every output is JSON with sorted keys in a deterministic order, and no timestamps: building twice
from the same sources gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fbs.data.bios import (Q0, IdiomLexicon, Segmenter, SegmentFilter, Span, align_chunks, han_token_share,
                           weak_chunks)
from fbs.data.dedup import DedupConfig, Deduplicator
from fbs.data.metrics import IGNORE_INDEX, LABELS, O
from fbs.data.sources import (ARCHIVES, DEFAULT_BUNDLE_CHARS, DEFAULT_SOURCES, SOURCES, Document, SourceError,
                              read_source, sha256_file)

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
FORMAT = "fbs-corpus/1"
Progress = Callable[..., Iterable]  # e.g. tqdm: progress(iterable, desc=..., total=...)


def _no_progress(it: Iterable, **_: Any) -> Iterable:
    return it


# --- tokenizer adapter ------------------------------------------------------------------------


class Encoding(NamedTuple):
    ids: list[int]
    offsets: list[tuple[int, int]]


def encode_batch(tokenizer: Any, texts: Sequence[str]) -> list[Encoding]:
    """Token ids and character offsets of ``texts`` with no special tokens added.

    Accepts an HF fast tokenizer (uses its Rust backend directly: no length warnings) or a raw
    ``tokenizers.Tokenizer``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "encode_batch"):
        encs = backend.encode_batch(list(texts), add_special_tokens=False)
        return [Encoding(list(e.ids), [tuple(o) for o in e.offsets]) for e in encs]
    out = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    return [Encoding(list(i), [tuple(o) for o in m]) for i, m in zip(out["input_ids"], out["offset_mapping"])]


def separator_id(tokenizer: Any) -> int:
    """Token placed between packed documents: the tokenizer's EOS token."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id; pass sep_token_id explicitly")
    return int(eos)


# --- build -----------------------------------------------------------------------------------


@dataclass
class CorpusConfig:
    """How a corpus is built. Each default lives here once."""

    sources: tuple[str, ...] = DEFAULT_SOURCES
    min_tokens: int = 512  # paper 3.1.2: keep documents of length >= 512
    near_dup_threshold: float = 0.7  # paper 3.1.2: drop similarity > 0.7
    num_perm: int = 128
    shingle: int = 5
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    seed: int = 0
    bundle_chars: int = DEFAULT_BUNDLE_CHARS  # short-record sources are bundled to this size
    max_docs_per_source: int | None = None  # cap for quick builds; None reads everything

    def __post_init__(self):
        self.sources = tuple(self.sources)
        for name in self.sources:
            if name not in SOURCES:
                raise ValueError(f"unknown source {name!r}; choose from {', '.join(SOURCES)}")
        if not 0 <= self.val_fraction + self.test_fraction < 1:
            raise ValueError("val_fraction + test_fraction must be in [0, 1)")
        if not 0 < self.near_dup_threshold <= 1:
            raise ValueError("near_dup_threshold must be in (0, 1]")


def split_of(key: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    """Deterministic split of a document from a seeded hash of its key (stable as the corpus grows)."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "validation"
    return "train"


def dumps(obj: Any) -> str:
    """Canonical JSON: sorted keys, UTF-8 text, no spaces after separators."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _batched(it: Iterable, n: int) -> Iterator[list]:
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


@dataclass
class SourceStats:
    documents_read: int = 0
    too_short: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0
    kept: int = 0
    tokens_kept: int = 0


def _source_info(name: str) -> dict:
    spec = SOURCES.get(name)
    if spec is None:
        return {"origin": "in-memory documents", "license": "unknown"}
    info = {"origin": spec.origin, "license": spec.license, "lang": spec.lang}
    for arc in ARCHIVES.values():
        if arc.requirement in spec.origin:
            info["archive"] = {"file": arc.filename, "sha256": arc.sha256}
    return info


def build_corpus(
    out_dir: str | Path,
    tokenizer: Any,
    tokenizer_name: str,
    config: CorpusConfig = CorpusConfig(),
    documents: Iterable[Document] | None = None,
    progress: Progress = _no_progress,
    **source_kwargs: Any,
) -> dict:
    """Build the corpus into ``out_dir`` and return the manifest (also written as ``manifest.json``).

    ``documents`` replaces the configured sources (tests, custom corpora). ``source_kwargs`` are
    passed to the source readers (e.g. ``root`` for the archive cache).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if documents is None:
        documents = _read_sources(config, **source_kwargs)
    stats: dict[str, SourceStats] = {}
    dedup = Deduplicator(DedupConfig(config.near_dup_threshold, config.num_perm, config.shingle))
    files = {s: open(out / f"{s}.jsonl", "w", encoding="utf-8", newline="\n") for s in SPLITS}
    split_counts = {s: Counter() for s in SPLITS}
    split_tokens = {s: Counter() for s in SPLITS}
    seen_keys: set[str] = set()
    try:
        for batch in _batched(progress(documents, desc="documents", unit="doc"), 64):
            encs = encode_batch(tokenizer, [d.text for d in batch])
            for doc, enc in zip(batch, encs):
                if doc.key in seen_keys:
                    raise SourceError(f"document key {doc.key!r} occurs twice; document ids must be unique per source")
                seen_keys.add(doc.key)
                st = stats.setdefault(doc.source, SourceStats())
                st.documents_read += 1
                n_tok = len(enc.ids)
                if n_tok < config.min_tokens:
                    st.too_short += 1
                    continue
                hit = dedup.check(doc.key, doc.text)
                if hit is not None:
                    if hit[0] == "exact":
                        st.exact_duplicates += 1
                    else:
                        st.near_duplicates += 1
                    logger.debug("drop %s: %s duplicate of %s", doc.key, *hit)
                    continue
                split = split_of(doc.key, config.seed, config.val_fraction, config.test_fraction)
                rec = {"id": doc.key, "source": doc.source, "lang": doc.lang, "n_tokens": n_tok, "text": doc.text}
                files[split].write(dumps(rec) + "\n")
                st.kept += 1
                st.tokens_kept += n_tok
                split_counts[split][doc.lang] += 1
                split_tokens[split][doc.lang] += n_tok
    finally:
        for f in files.values():
            f.close()
    total_kept = sum(st.kept for st in stats.values())
    if total_kept == 0:
        read = sum(st.documents_read for st in stats.values())
        raise SourceError(
            f"empty corpus: {read} documents read, none kept (min_tokens={config.min_tokens}); "
            "lower --min-tokens, add sources, or check that the sources are not empty"
        )
    manifest = {
        "format": FORMAT,
        "config": asdict(config),
        "tokenizer": tokenizer_name,
        "sources": {name: {**_source_info(name), **asdict(st)} for name, st in sorted(stats.items())},
        "splits": {s: {"file": f"{s}.jsonl", "sha256": sha256_file(out / f"{s}.jsonl"),
                       "documents": dict(sorted(split_counts[s].items())),
                       "tokens": dict(sorted(split_tokens[s].items()))} for s in SPLITS},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
    logger.info("corpus: %d documents kept in %s", total_kept, out)
    return manifest


def _read_sources(config: CorpusConfig, **kwargs: Any) -> Iterator[Document]:
    for name in config.sources:
        n = 0
        for doc in read_source(name, bundle_chars=config.bundle_chars, **kwargs):
            if config.max_docs_per_source is not None and n >= config.max_docs_per_source:
                break
            n += 1
            yield doc


def read_split(corpus_dir: str | Path, split: str) -> Iterator[dict]:
    """Records of one split file, with a clear error for a missing file or a malformed line."""
    path = Path(corpus_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise SourceError(f"{path} not found: build the corpus first with `fbs data build --out {Path(corpus_dir)}`")
    from ..jsonl import iter_records

    with open(path, encoding="utf-8") as f:
        for n, rec in iter_records(f, str(path), SourceError, "rebuild the corpus"):
            if not {"id", "lang", "text"} <= rec.keys():
                raise SourceError(f"{path}:{n}: a record needs the fields id, lang and text")
            yield rec


# --- weak labels -----------------------------------------------------------------------------


@dataclass
class LabelStats:
    documents: int = 0
    chunks_seg: int = 0
    chunks_idiom: int = 0
    # token-level statistics, filled only when a tokenizer is given
    tokens: int = 0
    label_counts: dict[str, int] = field(default_factory=lambda: {c: 0 for c in LABELS})
    chunks_dropped: int = 0
    touching: int = 0
    covered: int = 0
    han_share_sum: float = 0.0

    def summary(self) -> dict:
        tot = max(self.tokens, 1)
        return {
            "documents": self.documents,
            "chunks": {"seg": self.chunks_seg, "idiom": self.chunks_idiom},
            "tokens": self.tokens,
            "label_share": {c: self.label_counts[c] / tot for c in LABELS},
            "chunks_dropped": self.chunks_dropped,
            "coverage_q": self.covered / self.touching if self.touching else 1.0,
            "han_tokens_in_chunks": self.han_share_sum / self.documents if self.documents else 0.0,
        }


def label_corpus(
    corpus_dir: str | Path,
    segmenter: Segmenter | None,
    lexicon: IdiomLexicon | None,
    tokenizer: Any = None,
    segment_filter: SegmentFilter = SegmentFilter(),
    splits: Sequence[str] = SPLITS,
    progress: Progress = _no_progress,
) -> dict:
    """Write ``{split}.bios.jsonl`` (weak character chunks of each Chinese document) and label stats.

    With a ``tokenizer``, also aligns the chunks to its tokens to report the B/I/O/S shares and the
    coverage q; the stored chunks themselves are tokenizer-independent.
    """
    corpus_dir = Path(corpus_dir)
    report: dict[str, Any] = {"splits": {}}
    for split in splits:
        st = LabelStats()
        path = corpus_dir / f"{split}.bios.jsonl"
        docs = [r for r in read_split(corpus_dir, split) if r["lang"] == "zh"]
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for rec in progress(docs, desc=f"label {split}", unit="doc"):
                chunks = weak_chunks(rec["text"], segmenter, lexicon, segment_filter)
                f.write(dumps({"id": rec["id"], "chunks": [[s.start, s.end, s.kind] for s in chunks]}) + "\n")
                st.documents += 1
                st.chunks_seg += sum(s.kind == "seg" for s in chunks)
                st.chunks_idiom += sum(s.kind == "idiom" for s in chunks)
                if tokenizer is not None:
                    _add_token_stats(st, rec["text"], chunks, tokenizer)
        report["splits"][split] = {"file": path.name, "sha256": sha256_file(path), **st.summary()}
    report["tokenizer_stats"] = tokenizer is not None
    (corpus_dir / "labels.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return report


def _add_token_stats(st: LabelStats, text: str, chunks: Sequence[Span], tokenizer: Any) -> None:
    enc = encode_batch(tokenizer, [text])[0]
    al = align_chunks(chunks, enc.offsets)
    st.tokens += len(al.labels)
    for y in al.labels:
        st.label_counts[LABELS[y]] += 1
    st.chunks_dropped += al.n_dropped
    st.touching += al.n_touching
    st.covered += al.n_covered
    st.han_share_sum += han_token_share(al.labels, enc.offsets, text)


def label_statistics(corpus_dir: str | Path, tokenizer: Any, split: str, block_size: int = 512, q0: float = Q0,
                     progress: Progress = _no_progress) -> dict:
    """Token-level statistics of an already labelled split under any tokenizer (no re-segmentation).

    The stored chunks are character spans, so a second model's tokenizer only needs the alignment:
    B/I/O/S shares, dropped chunks and coverage q over the Chinese documents, and the per-block coverage
    of ``block_size``-token training blocks with the share of blocks below ``q0`` (the ones the CE/CTC
    switch of appendix D.2.4 trains with CTC).
    """
    chunks = read_chunks(corpus_dir, split)
    if chunks is None:
        raise SourceError(f"split {split!r} of {corpus_dir} has no labels: run `fbs data label --corpus {corpus_dir}`")
    st = LabelStats()
    for rec in progress([r for r in read_split(corpus_dir, split) if r["lang"] == "zh"], desc=f"align {split}",
                        unit="doc"):
        st.documents += 1
        _add_token_stats(st, rec["text"], chunks.get(rec["id"], []), tokenizer)
    qs = [b.coverage for b in PackedBlocks(corpus_dir, split, tokenizer, block_size=block_size, langs=("zh",))]
    blocks = {"block_size": block_size, "blocks": len(qs), "q0": q0,
              "q_min": min(qs) if qs else None, "q_mean": sum(qs) / len(qs) if qs else None,
              "below_q0": sum(q < q0 for q in qs) / len(qs) if qs else None}
    summary = st.summary()
    del summary["chunks"]  # counted by `fbs data label`; this pass does not separate segment and idiom chunks
    return {**summary, "per_block": blocks}


def read_chunks(corpus_dir: str | Path, split: str) -> dict[str, list[tuple[int, int]]] | None:
    """``{doc id: [(start, end), ...]}`` from ``{split}.bios.jsonl``, or None if the split is unlabelled."""
    path = Path(corpus_dir) / f"{split}.bios.jsonl"
    if not path.is_file():
        return None
    out = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                out[rec["id"]] = [(int(s), int(e)) for s, e, _ in rec["chunks"]]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise SourceError(f"{path}:{n}: malformed label record ({exc}); rerun `fbs data label`") from exc
    return out


# --- packed stream ---------------------------------------------------------------------------


class Block(NamedTuple):
    """One training block: ``index`` counts blocks from the start of the split's stream."""

    index: int
    input_ids: torch.Tensor  # (T,) int64
    bios_labels: torch.Tensor  # (T,) int64, -100 where there is no weak label
    coverage: float  # alignment coverage q of the block's labelled tokens (1.0 if none touch a chunk)


class PackedBlocks(torch.utils.data.IterableDataset):
    """Fixed-length token blocks over the documents of one split, in file order, EOS between documents.

    Deterministic and resumable: ``start=k`` skips exactly the first ``k`` blocks, so a training loop
    that has consumed ``k`` blocks resumes with block ``k``. With several DataLoader workers, worker
    ``w`` of ``W`` yields the blocks whose index is ``w`` modulo ``W``. The trailing partial block is
    dropped.
    """

    def __init__(
        self,
        corpus_dir: str | Path,
        split: str,
        tokenizer: Any,
        block_size: int = 512,
        start: int = 0,
        langs: Sequence[str] | None = None,
        sep_token_id: int | None = None,
        with_labels: bool = True,
    ):
        super().__init__()
        if block_size < 1 or start < 0:
            raise ValueError("block_size must be >= 1 and start >= 0")
        self.corpus_dir, self.split, self.tokenizer = Path(corpus_dir), split, tokenizer
        self.block_size, self.start = block_size, start
        self.langs = tuple(langs) if langs is not None else None
        self.sep = separator_id(tokenizer) if sep_token_id is None else sep_token_id
        self.chunks = read_chunks(self.corpus_dir, split) if with_labels else None

    def _token_stream(self) -> Iterator[tuple[list[int], list[int], list[bool], list[bool]]]:
        """Per document: ids, labels, touched and covered flags (separator appended)."""
        for rec in read_split(self.corpus_dir, self.split):
            if self.langs is not None and rec["lang"] not in self.langs:
                continue
            enc = encode_batch(self.tokenizer, [rec["text"]])[0]
            n = len(enc.ids)
            chunks = self.chunks.get(rec["id"]) if self.chunks is not None else None
            if chunks is None:
                labels, touched, covered = [IGNORE_INDEX] * n, [False] * n, [False] * n
            else:
                al = align_chunks(chunks, enc.offsets)
                labels, touched = al.labels, al.touched
                covered = [t and y != O for t, y in zip(al.touched, al.labels)]
            yield enc.ids + [self.sep], labels + [IGNORE_INDEX], touched + [False], covered + [False]

    def __iter__(self) -> Iterator[Block]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        T = self.block_size
        ids: list[int] = []
        labels: list[int] = []
        touched: list[bool] = []
        covered: list[bool] = []
        index = 0
        for d_ids, d_lab, d_t, d_c in self._token_stream():
            ids += d_ids
            labels += d_lab
            touched += d_t
            covered += d_c
            while len(ids) >= T:
                if index >= self.start and (index - self.start) % nw == wid:
                    n_t = sum(touched[:T])
                    yield Block(index, torch.tensor(ids[:T], dtype=torch.long),
                                torch.tensor(labels[:T], dtype=torch.long),
                                sum(covered[:T]) / n_t if n_t else 1.0)
                del ids[:T], labels[:T], touched[:T], covered[:T]
                index += 1


def collate_blocks(blocks: Sequence[Block]) -> dict[str, torch.Tensor]:
    """Stack blocks into a batch: input_ids (B, T), bios_labels (B, T), coverage (B,), index (B,)."""
    return {
        "input_ids": torch.stack([b.input_ids for b in blocks]),
        "bios_labels": torch.stack([b.bios_labels for b in blocks]),
        "coverage": torch.tensor([b.coverage for b in blocks], dtype=torch.float),
        "index": torch.tensor([b.index for b in blocks], dtype=torch.long),
    }


def pack(docs: list[list[int]], block_size: int, sep: int) -> torch.Tensor:
    """Concatenate documents with ``sep`` after each and cut into full blocks: (N, block_size)."""
    flat = [t for d in docs for t in (*d, sep)]
    n = len(flat) // block_size
    return torch.tensor(flat[: n * block_size], dtype=torch.long).view(n, block_size)
