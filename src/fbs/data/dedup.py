"""Exact and near-duplicate removal (paper 3.1.2: "deduplicate samples with similarity > 0.7").

Near duplicates are found with MinHash LSH (``datasketch``) over character 5-gram shingles of the
normalised text, which treats English, Chinese and code alike. A document is a near duplicate when
the MinHash estimate of its Jaccard similarity with an earlier kept document exceeds the threshold;
the earlier document (in corpus order) is kept, so the result is deterministic.
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

_WS = re.compile(r"\s+")


class HasText(Protocol):
    key: str
    text: str


def normalize(text: str) -> str:
    """NFKC, lower case, collapsed whitespace: what "the same text" means for deduplication."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def exact_key(text: str) -> str:
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()


def shingles(text: str, n: int = 5) -> set[bytes]:
    """Set of character ``n``-grams of the normalised text (the whole text if shorter)."""
    t = normalize(text)
    if len(t) <= n:
        return {t.encode("utf-8")}
    return {t[i:i + n].encode("utf-8") for i in range(len(t) - n + 1)}


def jaccard(a: str, b: str, n: int = 5) -> float:
    """Exact Jaccard similarity of the shingle sets (for tests and diagnostics)."""
    sa, sb = shingles(a, n), shingles(b, n)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


@dataclass(frozen=True)
class DedupConfig:
    threshold: float = 0.7  # drop when estimated Jaccard similarity is strictly above this
    num_perm: int = 128
    shingle: int = 5
    seed: int = 1


@dataclass
class DedupStats:
    seen: int = 0
    exact: int = 0
    near: int = 0


class Deduplicator:
    """Streaming filter: :meth:`check` returns ``None`` for a new document or the key it duplicates."""

    def __init__(self, config: DedupConfig = DedupConfig()):
        try:
            from datasketch import MinHash, MinHashLSH
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "near-duplicate removal needs datasketch: run `scripts/install_data_deps.sh .venv/bin/python` "
                "or `pip install datasketch==2.0.0`"
            ) from exc
        self.config = config
        self._minhash = MinHash
        self._lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
        self._exact: dict[str, str] = {}
        self._sketches: dict[str, object] = {}
        self.stats = DedupStats()

    def _sketch(self, text: str):
        m = self._minhash(num_perm=self.config.num_perm, seed=self.config.seed)
        m.update_batch(sorted(shingles(text, self.config.shingle)))
        return m

    def check(self, key: str, text: str) -> tuple[str, str] | None:
        """Register ``key`` if it is new; else return ``("exact" | "near", key_of_the_kept_original)``."""
        self.stats.seen += 1
        ek = exact_key(text)
        if ek in self._exact:
            self.stats.exact += 1
            return "exact", self._exact[ek]
        sketch = self._sketch(text)
        best: tuple[float, str] | None = None
        for other in sorted(self._lsh.query(sketch)):
            sim = sketch.jaccard(self._sketches[other])
            if sim > self.config.threshold and (best is None or sim > best[0]):
                best = (sim, other)
        if best is not None:
            self.stats.near += 1
            return "near", best[1]
        self._exact[ek] = key
        self._sketches[key] = sketch
        self._lsh.insert(key, sketch)
        return None


def deduplicate(docs: Iterable[HasText], config: DedupConfig = DedupConfig()) -> Iterator[HasText]:
    """Yield the documents of ``docs`` that are neither exact nor near duplicates of an earlier one."""
    dd = Deduplicator(config)
    for doc in docs:
        hit = dd.check(doc.key, doc.text)
        if hit is None:
            yield doc
        else:
            logger.debug("drop %s: %s duplicate of %s", doc.key, *hit)
