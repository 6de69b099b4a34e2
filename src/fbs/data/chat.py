"""Chat-formatted instruction data: the Alpaca demo sets shipped in the ``llamafactory==0.9.5`` sdist.

Two uses, one deterministic split:

* **training** (skip distillation, docs/train.md): conversations rendered with the base model's chat
  template. The answer is the base model's own greedy answer where one was generated (on-policy
  distillation: the student learns to stay on the base's trajectory while it skips), else the data set's
  reference answer.
* **held-out prompts** for ``fbs eval chat``: never trained on. ``HELDOUT`` items per language are chosen
  by a seeded hash of their ids, so every run and every machine holds out the same prompts.

Files written by ``fbs data chat`` (JSON lines, one :class:`ChatItem` per line): ``train.jsonl`` (with
``base_answer`` for the first ``--answers`` items) and ``heldout.jsonl``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .sources import SourceError, fetch_archive

logger = logging.getLogger(__name__)

FILES = {"en": "data/alpaca_en_demo.json", "zh": "data/alpaca_zh_demo.json"}
HELDOUT = {"en": 80, "zh": 40}
SPLIT_SEED = 0


@dataclasses.dataclass
class ChatItem:
    id: str                       # "alpaca_en/17"
    lang: str                     # "en" | "zh"
    instruction: str
    input: str
    reference: str                # the data set's answer
    base_answer: str | None = None  # the base model's greedy answer (training items, when generated)

    @property
    def prompt(self) -> str:
        return self.instruction if not self.input else f"{self.instruction}\n\n{self.input}"

    @property
    def answer(self) -> str:
        """What a training conversation shows: the base's own answer if there is one, else the reference."""
        return self.base_answer if self.base_answer is not None else self.reference


def load_items(langs: Iterable[str] = ("en", "zh"), root: Path | None = None) -> list[ChatItem]:
    """Every Alpaca demo item of ``langs``, in file order."""
    items = []
    with tarfile.open(fetch_archive("llamafactory", root)) as tar:
        members = {m.name.split("/", 1)[-1]: m for m in tar.getmembers() if m.isfile()}
        for lang in langs:
            if lang not in FILES:
                raise ValueError(f"unknown language {lang!r}; available: {sorted(FILES)}")
            member = members.get(FILES[lang])
            if member is None:
                raise SourceError(f"{FILES[lang]} is missing from the llamafactory archive")
            for i, rec in enumerate(json.load(tar.extractfile(member))):
                items.append(ChatItem(f"alpaca_{lang}/{i}", lang, rec["instruction"], rec.get("input", ""),
                                      rec["output"]))
    return items


def _rank(item_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{item_id}".encode()).hexdigest()


def split(items: list[ChatItem], heldout: dict[str, int] | None = None,
          seed: int = SPLIT_SEED) -> tuple[list[ChatItem], list[ChatItem]]:
    """(train, held-out): per language the ``heldout[lang]`` items with the smallest seeded hash are held out."""
    heldout = HELDOUT if heldout is None else heldout
    held_ids = set()
    for lang, n in heldout.items():
        ranked = sorted((it for it in items if it.lang == lang), key=lambda it: _rank(it.id, seed))
        held_ids |= {it.id for it in ranked[:n]}
    return [it for it in items if it.id not in held_ids], [it for it in items if it.id in held_ids]


# ---------------------------------------------------------------------------- rendering
def render_user_turn(tokenizer, text: str) -> list[int]:
    """The user turn ``text`` under the tokenizer's chat template, ending where the assistant's answer starts."""
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:  # an HF tokenizer without one
        raise ValueError("the chat, code and summarise prompts need a tokenizer with a chat template; this model's "
                         "has none (fbs bench: use --prompt-set text)")
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def render_prompt(tokenizer, item: ChatItem) -> list[int]:
    """Token ids of the item's user turn under the chat template, ending where the assistant starts."""
    return render_user_turn(tokenizer, item.prompt)


#: The code-edit instructions (``fbs bench --prompt-set code`` and the code prompts of ``fbs data drafts``): each
#: asks for an answer that copies its input function.
CODE_INSTRUCTIONS = {
    "mbpp": "Add type hints and a docstring to this Python function. Reply with the whole function.",
    "humaneval": "Add a short comment above each step of this Python function. Reply with the whole function.",
}


def fence(code: str) -> str:
    """``code`` as a fenced Python block (line ends normalised, trailing spaces and blank edge lines dropped)."""
    lines = [line.rstrip() for line in code.replace("\r\n", "\n").replace("\r", "\n").strip("\n").split("\n")]
    return "```python\n" + "\n".join(lines) + "\n```"


def render_conversation(tokenizer, item: ChatItem) -> list[int]:
    """Token ids of the whole conversation (user turn + ``item.answer``) under the chat template."""
    msgs = [{"role": "user", "content": item.prompt}, {"role": "assistant", "content": item.answer}]
    return list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))


def chat_blocks(items: list[ChatItem], tokenizer, block_size: int) -> torch.Tensor:
    """Conversations packed into (N, block_size) blocks (EOS between conversations)."""
    from .corpus import pack

    docs = [render_conversation(tokenizer, it) for it in items]
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return pack(docs, block_size, sep)


# ---------------------------------------------------------------------------- base answers
@torch.no_grad()
def base_answers(model, tokenizer, items: list[ChatItem], max_new_tokens: int = 160, batch_size: int = 8,
                 progress: Callable | None = None) -> list[str]:
    """Greedy answers of ``model`` run at full depth (for a fresh FBS model: exactly the base model)."""
    out: list[str] = []
    batches = range(0, len(items), batch_size)
    for start in (progress(batches, desc="base answers", unit="batch") if progress else batches):
        chunk = items[start:start + batch_size]
        res = model.generate([render_prompt(tokenizer, it) for it in chunk], max_new_tokens=max_new_tokens,
                             force_compute=True, tokenizer=tokenizer)
        out += [tokenizer.decode(t, skip_special_tokens=True).strip() for t in res.new_tokens]
    return out


# ---------------------------------------------------------------------------- files
def write_items(path: str | Path, items: list[ChatItem]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(dataclasses.asdict(it), ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_items(path: str | Path) -> list[ChatItem]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; create it with `fbs data chat --out {path.parent}`")
    items = []
    fields = {f.name for f in dataclasses.fields(ChatItem)}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                if set(rec) - fields or not {"id", "lang", "instruction", "reference"} <= set(rec):
                    raise ValueError(f"fields {sorted(rec)}")
                items.append(ChatItem(**rec))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{n} is not a chat item ({e})") from None
    return items
