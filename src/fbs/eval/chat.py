"""Free-running generation quality (``fbs eval chat``): does a skipping model still answer like the base model?

Teacher-forced perplexity does not see errors that compound over a free-running answer. This
evaluation decodes held-out instruction prompts with each system and compares the answers with the base
model's:

* prompts: the held-out Alpaca demo prompts of :mod:`fbs.data.chat` (80 English + 40 Chinese, never trained
  on), rendered with the model's chat template (:func:`fbs.data.chat.render_prompt`);
* decoding: greedy, at most ``max_new_tokens`` (256) new tokens, through the engine
  (``model.generate``, batches of ``batch_size`` prompts) at the system's tau; the base model is a fresh
  FBS decoded with ``force_compute=True`` (exactly the base model), "full depth" is a checkpoint with
  ``force_compute=True``;
* per answer (the generated tokens; a final EOS token is not part of the answer):
  ``eos`` (generation ended with an EOS token, not at the length limit), ``loop`` (a repeated token
  8-gram, :func:`fbs.eval.textmetrics.has_repeated_ngram`), ``stuck`` (no EOS and the answer ends in an
  exact cycle: :func:`fbs.eval.textmetrics.tail_period` of its last 96 tokens), ``length`` (tokens), ``rouge_l`` (token
  ROUGE-L F-measure against the base model's answer to the same prompt) and ``base_nll``: the base model's
  mean per-token NLL of the answer's tokens *and of its final EOS when it has one*, teacher-forced with the
  prompt as context (a judge-free plausibility score: how likely the base model finds the answer, including
  where it stops);
* per system: means over answers, 95% bootstrap CIs over prompts (:func:`fbs.eval.stats.bootstrap_ci`), the
  paired bootstrap against the base model (:func:`fbs.eval.stats.paired_bootstrap`), a per-language
  breakdown, and from the decode traces the skip ratio (skipped / all (token, layer) pairs of the decoded
  tokens, pooled over answers) and TFLOPs(rel) (token-weighted mean of the engine's per-call values).

The base model's answers (with their NLL) are cached in a JSON file keyed by item id and checked against the
base model's fingerprint, ``max_new_tokens`` and the rendered prompt, so later runs reuse them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..data.chat import ChatItem, render_prompt
from .stats import bootstrap_ci, paired_bootstrap
from .textmetrics import CYCLE_WINDOW, LOOP_N, has_repeated_ngram, rouge_l, tail_period

logger = logging.getLogger(__name__)

MAX_NEW_TOKENS = 256
BATCH_SIZE = 8
#: padded tokens per teacher-forced scoring batch (logits take tokens x vocab x 4 bytes)
SCORE_BATCH_TOKENS = 1024
#: the `make demo` prompt; its answer is shown next to the samples (not part of the metrics)
DEMO_PROMPT = "Explain in two sentences why the sky is blue."
METRICS = ("eos", "loop", "stuck", "length", "rouge_l", "base_nll")
CACHE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class ChatSystem:
    """One system of the comparison. ``kind``: base | full | tau | control (full depth of a second checkpoint) |
    reference (the base model decoded with other engine weights, e.g. int8: how far answers move when nothing
    but rounding changes, the floor of the answer-level metrics)."""

    name: str
    kind: str
    model_key: str               # systems with the same key share one loaded model
    tau: float | None = None     # None: every layer runs (force_compute)
    checkpoint: str | None = None
    weights: str | None = None   # engine weights (fp32 | bf16 | int8); None: the engine's default
    kv_dtype: str | None = None  # the KV cache's storage (fp32 | fp16 | bf16); None: the engine's default
    prefill: str | None = None   # the prompt's products (fp32 | int8); None: the engine's default


@dataclasses.dataclass
class Answer:
    id: str
    lang: str
    tokens: list[int]            # generated ids without the final EOS
    eos: bool                    # generation stopped at an EOS token
    skipped: int                 # skipped (token, layer) pairs in the decode trace
    pairs: int                   # all (token, layer) pairs in the decode trace
    text: str = ""
    base_nll: float | None = None


@dataclasses.dataclass
class DecodeStats:
    tokens: int = 0              # decoded tokens (trace-valid), the weight of the per-call TFLOPs
    tflops_rel: float = 0.0      # token-weighted sums until finalized
    tflops_rel_exact: float = 0.0
    seconds: float = 0.0

    def add(self, trace, seconds: float) -> None:
        n = int(trace.valid.sum())
        self.tokens += n
        self.tflops_rel += n * float(trace.tflops_rel)
        self.tflops_rel_exact += n * float(trace.tflops_rel_exact)
        self.seconds += seconds

    def to_dict(self) -> dict:
        """Token-weighted means; None when nothing was decoded here (answers read from the cache)."""
        n = self.tokens
        return {"decoded_tokens": n, "tflops_rel": self.tflops_rel / n if n else None,
                "tflops_rel_exact": self.tflops_rel_exact / n if n else None, "decode_s": self.seconds}


def eos_ids(model, tokenizer) -> list[int]:
    """The EOS ids the engine stops at: the base model's generation config, else the tokenizer's."""
    gen = getattr(getattr(model.base.hf, "generation_config", None), "eos_token_id", None)
    if gen is None:
        gen = getattr(tokenizer, "eos_token_id", None)
    if gen is None:
        raise ValueError("neither the model's generation config nor the tokenizer defines an EOS token")
    return sorted({gen} if isinstance(gen, int) else set(gen))


# ---------------------------------------------------------------------------- decoding
@torch.no_grad()
def generate_answers(model, tokenizer, items: Sequence[ChatItem], prompts: Sequence[list[int]], tau: float | None,
                     eos: Sequence[int], max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = BATCH_SIZE,
                     progress: Callable[[int], None] | None = None,
                     weights: str | None = None, kv_dtype: str | None = None,
                     prefill: str | None = None) -> tuple[list[Answer], DecodeStats]:
    """Greedy answers of ``model`` to ``prompts`` (token ids), ``batch_size`` prompts per engine call, in order;
    ``tau=None`` runs every layer (``force_compute``); ``weights``: the engine's weight format; ``kv_dtype``: the
    KV cache's storage; ``prefill``: the prompt's products."""
    model.eval()
    kw = {"force_compute": True} if tau is None else {"tau": float(tau)}
    if weights is not None:
        kw["weights"] = weights
    if kv_dtype is not None:
        kw["kv_dtype"] = kv_dtype
    if prefill is not None:
        kw["prefill"] = prefill
    answers, stats, eos_set = [], DecodeStats(), set(eos)
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        res = model.generate(chunk, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos),
                             tokenizer=tokenizer, **kw)
        tr = res.trace
        stats.add(tr, res.timings.get("total_s", 0.0))
        n_layers = tr.executed.shape[-1]
        for r, new in enumerate(res.new_tokens):
            valid = tr.valid[r]
            pairs = int(valid.sum()) * n_layers
            executed = int((tr.executed[r] & valid.unsqueeze(-1)).sum())
            ended = bool(new) and new[-1] in eos_set
            toks = list(new[:-1]) if ended else list(new)
            it = items[start + r]
            answers.append(Answer(it.id, it.lang, toks, ended, pairs - executed, pairs,
                                  tokenizer.decode(toks, skip_special_tokens=True).strip()))
        if progress is not None:
            progress(len(chunk))
    return answers, stats


@torch.no_grad()
def answer_nll(base_model, prompts: Sequence[list[int]], answers: Sequence[Answer], eos: Sequence[int],
               batch_tokens: int = SCORE_BATCH_TOKENS) -> list[float]:
    """Mean NLL under ``base_model`` (every layer) of each answer's tokens (+ its EOS if it ended with one),
    teacher-forced with the prompt as context. Rows are packed longest first into right-padded batches of at
    most ``batch_tokens`` padded tokens."""
    base_model.eval()
    eos_tok = min(eos)
    rows = []
    for p, a in zip(prompts, answers):
        target = a.tokens + ([eos_tok] if a.eos else [])
        if not target:
            raise ValueError(f"answer {a.id} has no token to score")
        rows.append((list(p), target))
    order = sorted(range(len(rows)), key=lambda i: -(len(rows[i][0]) + len(rows[i][1])))
    out = [0.0] * len(rows)
    i = 0
    while i < len(order):
        width = len(rows[order[i]][0]) + len(rows[order[i]][1]) - 1
        batch = order[i:i + max(1, batch_tokens // width)]
        i += len(batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, k in enumerate(batch):
            full = (rows[k][0] + rows[k][1])[:-1]
            ids[j, :len(full)] = torch.tensor(full)
            mask[j, :len(full)] = 1
        logits = base_model(ids, attention_mask=mask, gate_mode="off").logits
        for j, k in enumerate(batch):
            p, t = rows[k]
            lp = torch.log_softmax(logits[j, len(p) - 1:len(p) - 1 + len(t)].float(), dim=-1)
            out[k] = float(-lp.gather(-1, torch.tensor(t)[:, None]).mean())
    return out


# ---------------------------------------------------------------------------- base-answer cache
def _prompt_sha(prompt: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()[:16]


def _cache_header(base_model, max_new_tokens: int) -> dict:
    return {"format": CACHE_FORMAT, "base_model": base_model.config.base_model,
            "base_fingerprint": base_model.config.base_fingerprint, "max_new_tokens": max_new_tokens}


def read_base_cache(path: str | Path | None, base_model, max_new_tokens: int) -> dict[str, dict]:
    """Cached base answers by item id (empty when the file is missing or made for another base / length)."""
    if path is None or not Path(path).is_file():
        return {}
    data = json.loads(Path(path).read_text())
    head = _cache_header(base_model, max_new_tokens)
    if any(data.get(k) != v for k, v in head.items()):
        logger.warning("%s was made for %s; not reusing it", path, {k: data.get(k) for k in head})
        return {}
    return data.get("items", {})


def write_base_cache(path: str | Path, base_model, max_new_tokens: int, entries: dict[str, dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = read_base_cache(path, base_model, max_new_tokens)
    data = _cache_header(base_model, max_new_tokens) | {"items": old | entries}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=False))
    os.replace(tmp, path)


def base_answers(base_model, tokenizer, items: Sequence[ChatItem], prompts: Sequence[list[int]],
                 eos: Sequence[int], cache: str | Path | None, max_new_tokens: int = MAX_NEW_TOKENS,
                 batch_size: int = BATCH_SIZE, progress=None) -> tuple[list[Answer], DecodeStats]:
    """The base model's answers with their NLL, from ``cache`` where it has them (same rendered prompt),
    generated (and added to the cache) otherwise."""
    have = read_base_cache(cache, base_model, max_new_tokens)
    todo = [i for i, (it, p) in enumerate(zip(items, prompts))
            if have.get(it.id, {}).get("prompt_sha") != _prompt_sha(p)]
    stats = DecodeStats()
    if todo:
        new, stats = generate_answers(base_model, tokenizer, [items[i] for i in todo], [prompts[i] for i in todo],
                                      None, eos, max_new_tokens, batch_size, progress)
        nll = answer_nll(base_model, [prompts[i] for i in todo], new, eos)
        entries = {}
        for i, a, v in zip(todo, new, nll):
            a.base_nll = v
            entries[a.id] = dataclasses.asdict(a) | {"prompt_sha": _prompt_sha(prompts[i])}
        have = have | entries
        if cache is not None:
            write_base_cache(cache, base_model, max_new_tokens, entries)
    elif progress is not None:
        progress(len(items))
    fields = {f.name for f in dataclasses.fields(Answer)}
    return [Answer(**{k: v for k, v in have[it.id].items() if k in fields}) for it in items], stats


# ---------------------------------------------------------------------------- metrics
def per_item_metrics(answers: Sequence[Answer], base: Sequence[Answer]) -> dict[str, list[float]]:
    """Per-answer values of :data:`METRICS` (ROUGE-L against the base model's answer to the same prompt)."""
    if [a.id for a in answers] != [b.id for b in base]:
        raise ValueError("answers and base answers must be for the same items in the same order")
    return {
        "eos": [float(a.eos) for a in answers],
        "loop": [float(has_repeated_ngram(a.tokens, LOOP_N)) for a in answers],
        "stuck": [float(not a.eos and tail_period(a.tokens, CYCLE_WINDOW) is not None) for a in answers],
        "length": [float(len(a.tokens)) for a in answers],
        "rouge_l": [rouge_l(a.tokens, b.tokens) for a, b in zip(answers, base)],
        "base_nll": [float(a.base_nll) for a in answers],
    }


#: metric -> higher is better (for the paired bootstrap's p-value); length has no better direction
_ORIENTATION = {"eos": True, "loop": False, "stuck": False, "rouge_l": True, "base_nll": False}


def summarize(values: dict[str, list[float]], base_values: dict[str, list[float]], seed: int = 0) -> dict:
    """Mean, 95% bootstrap CI and (except length) the paired bootstrap against the base model, per metric."""
    out = {}
    for m in METRICS:
        x = np.asarray(values[m])
        lo, hi = bootstrap_ci(x, seed=seed)
        row = {"value": float(x.mean()), "ci": [lo, hi]}
        if m in _ORIENTATION:
            row["vs_base"] = paired_bootstrap(x, base_values[m], higher_is_better=_ORIENTATION[m], seed=seed).to_dict()
        out[m] = row
    return out


def system_record(system: ChatSystem, answers: Sequence[Answer], base: Sequence[Answer], stats: DecodeStats,
                  seed: int = 0) -> dict:
    """Everything about one system: summary, per-language summaries, decode cost, per-item answers."""
    values = per_item_metrics(answers, base)
    base_values = per_item_metrics(base, base)
    langs = sorted({a.lang for a in answers})
    per_lang = {}
    for lang in langs:
        idx = [i for i, a in enumerate(answers) if a.lang == lang]
        pick = lambda v: {m: [v[m][i] for i in idx] for m in METRICS}  # noqa: E731
        per_lang[lang] = {"n": len(idx), **summarize(pick(values), pick(base_values), seed)}
    skipped, pairs = sum(a.skipped for a in answers), sum(a.pairs for a in answers)
    cost = stats.to_dict()
    if system.kind == "base" and cost["tflops_rel"] is None:  # answers from the cache: every layer ran
        cost["tflops_rel"] = 1.0
    return {
        **dataclasses.asdict(system), "n": len(answers),
        "skip_ratio": skipped / pairs if pairs else 0.0, **cost,
        "metrics": summarize(values, base_values, seed), "per_lang": per_lang,
        "items": [dataclasses.asdict(a) | {m: values[m][i] for m in ("loop", "stuck", "rouge_l")}
                  for i, a in enumerate(answers)],
    }


# ---------------------------------------------------------------------------- the run
def run_chat_eval(base_model, tokenizer, items: Sequence[ChatItem], systems: Sequence[ChatSystem],
                  loaders: dict[str, Callable[[], object]], *, max_new_tokens: int = MAX_NEW_TOKENS,
                  batch_size: int = BATCH_SIZE, base_cache: str | Path | None = None, seed: int = 0,
                  demo_prompt: str | None = DEMO_PROMPT, progress: bool = True,
                  on_system: Callable[[dict], None] | None = None) -> dict:
    """Decode ``items`` with every system and score the answers against the base model's.

    ``systems[i].model_key`` names a loader in ``loaders`` (``"base"`` is ``base_model`` itself); a model is
    loaded when the first system needing it runs and dropped after the last one. ``on_system`` receives each
    system's record as soon as it is done (the CLI rewrites its report then)."""
    from tqdm.auto import tqdm

    eos = eos_ids(base_model, tokenizer)
    prompts = [render_prompt(tokenizer, it) for it in items]
    demo = ChatItem("demo", "en", demo_prompt, "", "") if demo_prompt else None
    demo_prompt_ids = render_prompt(tokenizer, demo) if demo else None
    bar = tqdm(total=len(items) * len(systems), desc="chat", unit="prompt", disable=not progress)
    base, base_stats = base_answers(base_model, tokenizer, items, prompts, eos, base_cache, max_new_tokens,
                                    batch_size, bar.update)
    records, demos = [], {}
    last_use = {s.model_key: i for i, s in enumerate(systems)}
    loaded: dict[str, object] = {"base": base_model}
    for i, sysm in enumerate(systems):
        bar.set_postfix_str(sysm.name)
        if sysm.model_key not in loaded:
            loaded[sysm.model_key] = loaders[sysm.model_key]()
        model = loaded[sysm.model_key]
        if sysm.kind == "base":
            answers, stats = base, base_stats
        else:
            answers, stats = generate_answers(model, tokenizer, items, prompts, sysm.tau, eos, max_new_tokens,
                                              batch_size, bar.update, sysm.weights, sysm.kv_dtype, sysm.prefill)
            for a, v in zip(answers, answer_nll(base_model, prompts, answers, eos)):
                a.base_nll = v
        if demo is not None:
            (d,), _ = generate_answers(model, tokenizer, [demo], [demo_prompt_ids], sysm.tau, eos, max_new_tokens, 1,
                                       weights=sysm.weights, kv_dtype=sysm.kv_dtype, prefill=sysm.prefill)
            demos[sysm.name] = d.text
        rec = system_record(sysm, answers, base, stats, seed)
        records.append(rec)
        if on_system is not None:
            on_system(rec)
        if last_use[sysm.model_key] == i and sysm.model_key != "base":
            del loaded[sysm.model_key]
    bar.close()
    return {"systems": records, "demo": {"prompt": demo_prompt, "answers": demos} if demo else None,
            "prompts": [{"id": it.id, "lang": it.lang, "prompt": it.prompt} for it in items],
            "max_new_tokens": max_new_tokens, "batch_size": batch_size, "loop_n": LOOP_N, "cycle_window": CYCLE_WINDOW,
            "eos_ids": eos, "seed": seed}


# ---------------------------------------------------------------------------- reports
def _pct(m: dict) -> str:
    return f"{100 * m['value']:.1f} [{100 * m['ci'][0]:.1f}, {100 * m['ci'][1]:.1f}]"


def _delta_pct(m: dict) -> str:
    v = m.get("vs_base")
    if v is None:
        return "–"
    return (f"{100 * v['delta']:+.1f} [{100 * v['ci_low']:+.1f}, {100 * v['ci_high']:+.1f}]"
            + (" *" if v["significant"] else ""))


_COLUMNS = ("system", "tau", "n", "EOS % [95% CI]", "Δ EOS vs base", "loop % [95% CI]", "Δ loop vs base",
            "stuck % [95% CI]", "Δ stuck vs base", "mean length", "ROUGE-L vs base [95% CI]", "base NLL", "Skip %",
            "TFLOPs(rel)")


def _table(rows: Sequence[tuple[dict, dict, int]]) -> list[str]:
    """rows: (system record, its metrics (all prompts or one language), number of prompts)."""
    out = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for rec, m, n in rows:
        cells = [rec["name"], "–" if rec["tau"] is None else f"{rec['tau']:.2f}", str(n)]
        for k in ("eos", "loop", "stuck"):
            cells += [_pct(m[k]), "–" if rec["kind"] == "base" else _delta_pct(m[k])]
        rl = m["rouge_l"]
        cells += [f"{m['length']['value']:.1f}", f"{rl['value']:.3f} [{rl['ci'][0]:.3f}, {rl['ci'][1]:.3f}]",
                  f"{m['base_nll']['value']:.3f}", f"{100 * rec['skip_ratio']:.1f}",
                  "–" if rec["tflops_rel"] is None else f"{rec['tflops_rel']:.3f}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _quote(text: str, limit: int) -> str:
    text = text if len(text) <= limit else text[:limit] + " …"
    return "> " + (text.replace("\n", "\n> ") if text else "(empty)")


def markdown(result: dict, samples: int = 4, sample_chars: int = 600) -> str:
    """Summary table, one table per language, the demo prompt's answers, and ``samples`` prompts per language
    with every system's answer."""
    recs = result["systems"]
    lines = ["## All prompts", ""] + _table([(r, r["metrics"], r["n"]) for r in recs])
    langs = sorted({lang for r in recs for lang in r["per_lang"]})
    for lang in langs:
        lines += ["", f"## {lang}", ""] + _table([(r, r["per_lang"][lang], r["per_lang"][lang]["n"]) for r in recs
                                                  if lang in r["per_lang"]])
    window = result.get("cycle_window", CYCLE_WINDOW)
    lines += ["", f"EOS: the answer ended with an EOS token within {result['max_new_tokens']} new tokens; loop: a "
              f"token {result['loop_n']}-gram occurs twice in the answer; stuck: no EOS and the last {window} "
              f"tokens repeat with a period of at most {window // 2}; length in tokens (EOS excluded); ROUGE-L: "
              "token LCS F-measure against the base model's answer; base NLL: the base model's mean per-token NLL "
              "of the answer (+ EOS), prompt as context. Δ: paired bootstrap against the base model "
              "(percentage points, 95% CI, * p < 0.01). Skip % and TFLOPs(rel): the decode traces."]
    if result.get("demo"):
        lines += ["", "## The `make demo` prompt", "", f"**Prompt:** {result['demo']['prompt']}", ""]
        for name, text in result["demo"]["answers"].items():
            lines += [f"**{name}:**", "", _quote(text, sample_chars), ""]
    by_id = [{it["id"]: it for it in r["items"]} for r in recs]
    prompts = {p["id"]: p for p in result["prompts"]}
    lines += ["", "## Sample answers", ""]
    for lang in langs:
        for pid in [p["id"] for p in result["prompts"] if p["lang"] == lang][:samples]:
            lines += [f"### {pid}", "", "**Prompt:**", "", _quote(prompts[pid]["prompt"], sample_chars), ""]
            for r, items in zip(recs, by_id):
                it = items[pid]
                flags = ("EOS" if it["eos"] else "no EOS") + (", loop" if it["loop"] else "") + \
                    (", stuck" if it["stuck"] else "")
                lines += [f"**{r['name']}** ({len(it['tokens'])} tokens, {flags}, ROUGE-L {it['rouge_l']:.2f}):", "",
                          _quote(it["text"], sample_chars), ""]
    return "\n".join(lines) + "\n"
