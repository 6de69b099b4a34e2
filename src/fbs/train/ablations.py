"""``fbs train ablations``: the paper's module ablations (§4.3; the k_max grid of appendix C.6; the gate inputs of
appendix E.5), each variant trained with one recipe at one budget, then scored by the sweep's decode-faithful PPL.

**Variants** (:func:`variant`; each is a list of ``--set`` overrides on top of the recipe, shown in the table):

* ``full``: the recipe as it is (shipped: PAW at layer 1, CH at layer -6, gates on residual + preview, k_max 15).
* ``-paw``: no PAW layer, hence no preview and no L_preview; the gates see the residual only (``gate_input:
  residual``: the paper's "gate sees only the residual" reading, and the only coherent one: without a PAW layer
  the preview input is a constant zero vector).
* ``-ch``: no CH layer, no L_bios, no L_align.
* ``-sg``: no gates. Every layer is a never-skip layer (``never_skip_first`` beyond any depth, so the model has no
  gated layer), every micro-batch runs full compute (``skip_every: 0``) and the gate losses are off. PAW, CH and
  the LoRA adapters train as in ``full``; its row is full-depth quality at 0% skip at every tau.
* ``kmaxN`` (N in 1..64; the issue's grid is 5, 9, 15, 25): ``fbs.k_max=N``. The recipe's k_max is ``full``.
* ``gate-residual`` / ``gate-preview`` / ``gate-both``: ``fbs.gate_input``. ``gate-both`` is ``full``.
* ``fixedkN``: the fixed-k ablation of appendix C.3 (``fbs.fixed_k=N``), not in the default list.

**Running.** Variant ``v`` trains into ``OUT/<dir>`` (``-paw`` -> ``no-paw``) with :func:`fbs.train.stage1.train`;
a finished variant (``ablation_train.json`` written after its last step) is skipped, an interrupted one resumes
from its last checkpoint (the recipe's ``save_every``). Variants share the loaded training blocks, the seed and so
the block order. The driver turns off the in-training evaluations (``eval_every: 0``, ``eval_at_start: false``,
``eval_taus: []``; they change nothing in the optimization) unless ``--set`` names them.

**Scoring** (:func:`evaluate_variant`, cached in ``OUT/<dir>/ablation_eval.json``): the export, on the held-out
blocks of ``fbs eval sweep`` (OOD text of :mod:`fbs.eval.ood`, in-domain test split of the corpus), by
:func:`fbs.eval.sweep.score`: PPL at full depth, skip % and PPL at each tau of a fixed grid, and at a *matched*
skip ratio: :func:`fbs.eval.sweep.calibrate_tau` finds, per variant, the tau whose skip ratio on the first text is
``target_skip``; both texts are scored at that tau. The base model is scored once (``OUT/base_eval.json``).
``OUT/ablations.json`` and ``OUT/ablations.md`` are rewritten after every variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..provenance import provenance
from .config import TrainConfig

#: ``never_skip_first`` of ``-sg``: deeper than any base, so every layer is a never-skip layer and there is no gate
NO_GATES = 1024
DEFAULT_VARIANTS = ("full", "-paw", "-ch", "-sg", "kmax5", "kmax9", "kmax25", "gate-residual", "gate-preview")
#: in-training evaluations the driver turns off (the sweep scores every variant afterwards)
DRIVER_SETS = ("eval_every=0", "eval_at_start=false", "eval_taus=[]")
#: TrainConfig fields that do not change what a run learns: a finished run is reused whatever their values
NOT_RECIPE = ("out_dir", "progress", "tensorboard", "threads", "eval_every", "eval_at_start", "eval_taus",
              "log_every", "save_every", "keep_checkpoints")
TEXT_NAMES = {"ood": "OOD", "in": "In-domain"}
TRAIN_RECORD = "ablation_train.json"
TIME_RECORD = "ablation_time.json"
EVAL_RECORD = "ablation_eval.json"
BASE_RECORD = "base_eval.json"

_FIXED = {
    "full": ("the recipe as it is", ()),
    "-paw": ("no PAW layer (no preview, no L_preview); gates see the residual only",
             ("fbs.paw_layers=[]", "fbs.gate_input=residual", "lambda_paw=0")),
    "-ch": ("no CH layer (no L_bios, no L_align)", ("fbs.ch_layers=[]", "lambda_bios=0", "lambda_align=0")),
    "-sg": ("no gates: every layer computed, every micro-batch full compute, no gate losses",
            (f"fbs.never_skip_first={NO_GATES}", "skip_every=0", "lambda_gate=0", "lambda_distill=0",
             "lambda_compute=0")),
    "gate-residual": ("gates see the residual only", ("fbs.gate_input=residual",)),
    "gate-preview": ("gates see the PAW preview only", ("fbs.gate_input=preview",)),
    "gate-both": ("gates see residual + preview", ("fbs.gate_input=both",)),
}
_ALIASES = {"no-paw": "-paw", "no-ch": "-ch", "no-sg": "-sg"}
_PATTERNS = ((re.compile(r"kmax(\d+)"), "k_max {n}", "fbs.k_max={n}"),
             (re.compile(r"fixedk(\d+)"), "fixed window k = {n} (no predictor)", "fbs.fixed_k={n}"))


class AblationError(ValueError):
    """A variant name, its configuration or a finished run does not fit the ablation."""


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    overrides: tuple[str, ...]

    @property
    def dirname(self) -> str:
        return "no" + self.name if self.name.startswith("-") else self.name


def variant(name: str) -> Variant:
    """The variant called ``name`` (see the module doc)."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in _FIXED:
        what, sets = _FIXED[key]
        return Variant(key, what, sets)
    for pattern, what, override in _PATTERNS:
        m = pattern.fullmatch(key)
        if m:
            return Variant(key, what.format(n=int(m[1])), (override.format(n=int(m[1])),))
    raise AblationError(f"unknown variant {name!r}; known: {', '.join(_FIXED)}, kmaxN (e.g. kmax5), fixedkN "
                        f"(e.g. fixedk8); -paw/-ch/-sg may be spelt no-paw/no-ch/no-sg")


def parse_variants(spec: str | Sequence[str]) -> list[Variant]:
    """A comma list (or a list) of variant names, in order, each once."""
    names = [n for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    if not names:
        raise AblationError("no variant named")
    out: list[Variant] = []
    for n in names:
        v = variant(n)
        if all(v.name != o.name for o in out):
            out.append(v)
    return out


def variant_config(recipe: TrainConfig, v: Variant, out_dir: str | Path) -> TrainConfig:
    """The recipe with the variant's overrides, trained into ``out_dir/<v.dirname>``; refuses incoherent modules."""
    try:
        cfg = recipe.with_overrides(list(v.overrides))
    except ValueError as e:
        raise AblationError(f"variant {v.name}: {e}") from e
    fbs = cfg.fbs_config()
    if fbs.gate_input != "residual" and not fbs.paw_layers:
        raise AblationError(f"variant {v.name}: gate_input={fbs.gate_input} reads the PAW preview, but there is no PAW "
                            "layer (paw_layers is empty): the preview input would be a constant zero")
    return dataclasses.replace(cfg, out_dir=str(Path(out_dir) / v.dirname))


def config_diff(stored: dict, cfg: TrainConfig) -> list[str]:
    """The recipe fields (not :data:`NOT_RECIPE`) in which ``cfg`` differs from a stored ``TrainConfig.to_dict()``."""
    new = json.loads(json.dumps(cfg.to_dict()))
    keys = sorted((set(stored) | set(new)) - set(NOT_RECIPE))
    return [f"{k}: {stored.get(k)!r} -> {new.get(k)!r}" for k in keys if stored.get(k) != new.get(k)]


@dataclass(frozen=True)
class EvalSettings:
    """What :func:`evaluate_variant` scores; a cached evaluation is reused only under equal settings."""

    taus: tuple[float, ...] = (0.9, 0.7, 0.5, 0.3)
    texts: tuple[str, ...] = ("ood", "in")
    target_skip: float | None = 0.1    # matched skip ratio (share of all pairs), calibrated on texts[0]; None = off
    corpus: str | None = None          # corpus directory of the in-domain text
    split: str = "test"
    per_lang: int = 4                  # in-domain documents per language
    ood_per_kind: int | None = 4       # OOD blocks per kind (en, zh, code)
    max_tokens: int = 512
    gate_from: int = 128               # prompt tokens never gated; later ones are scored
    batch_size: int = 4
    seed: int = 0
    calib_tol: float = 0.005
    calib_iters: int = 8

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------------------- training
def _add_session(run_dir: Path, seconds: float) -> dict:
    """Add one training session's wall time to ``run_dir/ablation_time.json`` (kept across interruptions)."""
    path = run_dir / TIME_RECORD
    rec = _read_json(path) or {"sessions": []}
    rec["sessions"].append(round(seconds, 3))
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(path, rec)
    return rec


def train_variant(v: Variant, cfg: TrainConfig, data: Callable, base_fn: Callable | None, resume: bool,
                  log: Callable[[str], None], head: str) -> dict:
    """Train one variant to ``cfg.max_steps`` (resuming from its checkpoints) and write its record."""
    from . import checkpoint as ckpt
    from . import stage1

    run_dir = Path(cfg.out_dir)
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints") if resume else None
    if not resume and (run_dir / TIME_RECORD).is_file():
        (run_dir / TIME_RECORD).unlink()
    log(f"{head}: training {cfg.max_steps} steps x {cfg.batch_tokens} tokens into {run_dir}"
        + (f", resuming from {latest.name}" if latest else ""))
    blocks = data()
    t0 = time.perf_counter()
    try:
        summary = stage1.train(cfg, resume=resume, data=blocks, base=base_fn() if base_fn else None)
    finally:
        sessions = _add_session(run_dir, time.perf_counter() - t0)["sessions"]
    if summary["step"] < cfg.max_steps:  # SIGTERM: the trainer stopped early and saved a checkpoint
        raise KeyboardInterrupt(f"{v.name} stopped at step {summary['step']} of {cfg.max_steps}")
    rec = {"variant": v.name, "steps": summary["step"], "tokens": summary["tokens"], "wall_s": sum(sessions),
           "sessions": len(sessions), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "final": str(run_dir / "final"), "config": json.loads(json.dumps(cfg.to_dict())),
           "provenance": provenance()}
    _write_json(run_dir / TRAIN_RECORD, rec)
    log(f"{head}: trained {rec['steps']} steps, {rec['tokens']:,} tokens in {rec['wall_s'] / 60:.1f} min")
    return rec


def finished_record(v: Variant, cfg: TrainConfig, strict: bool, log: Callable[[str], None], head: str) -> dict | None:
    """The record of a finished run of ``v``, or None. A finished run trained with another recipe is an error
    (``strict``, before training) or a warning (rebuilding the table)."""
    rec = _read_json(Path(cfg.out_dir) / TRAIN_RECORD)
    if rec is None:
        return None
    diff = config_diff(rec["config"], cfg)
    if diff:
        msg = (f"{v.name}: the finished run in {cfg.out_dir} was trained with another recipe ({'; '.join(diff)})")
        if strict:
            raise AblationError(msg + "; use another --out-dir or the same settings")
        log(f"{head}: warning: {msg}")
    return rec


# ---------------------------------------------------------------------------- scoring
def _row(scores, base, docs, seed: int, saving) -> dict:
    from ..eval.sweep import summarize

    return {**summarize(scores, base, docs, seed, saving), "nll": list(scores.nll), "skipped": list(scores.skipped),
            "pairs": list(scores.pairs)}


def _scores(row: dict, kind: str):
    from ..eval.sweep import SystemScores

    return SystemScores(row["system"], row["tau"], row["nll"], row["skipped"], row["pairs"], kind)


def base_rows(texts: dict, settings: EvalSettings, base_fn: Callable) -> dict:
    """{text: row} of the base model at full depth (an FBS model with fresh modules computes the base exactly)."""
    from ..eval.sweep import PairSaving, score

    model = base_fn()
    out = {}
    for name, docs in texts.items():
        s = score(model, docs, name="base", batch_size=settings.batch_size, gate_from=settings.gate_from, kind="base")
        out[name] = _row(s, s, docs, settings.seed, PairSaving())
    return out


def evaluate_variant(model, texts: dict, base: dict, settings: EvalSettings, log: Callable[[str], None],
                     head: str) -> dict:
    """{text: {"full": row, "taus": [rows], "matched": row | None}, "calibration": {...} | None} of one model."""
    from ..eval.sweep import PairSaving, calibrate_tau, score

    saving = PairSaving.of(model)
    gated = bool(model.layers_cfg.gated)
    kw = dict(batch_size=settings.batch_size, gate_from=settings.gate_from)
    res: dict = {"texts": {}, "calibration": None}
    for name, docs in texts.items():
        b = _scores(base[name], "base")
        full = score(model, docs, name="full depth", kind="full", **kw)
        # with no gated layer a threshold pass is the full-depth pass, pair for pair
        at = [score(model, docs, tau=t, name=f"tau {t:g}", **kw) if gated
              else dataclasses.replace(full, name=f"tau {t:g}", tau=t, kind="tau") for t in settings.taus]
        res["texts"][name] = {"full": _row(full, b, docs, settings.seed, saving),
                              "taus": [_row(s, b, docs, settings.seed, saving) for s in at], "matched": None}
        log(f"{head}: {name} ({len(docs)} blocks): PPL full depth {full.ppl:.3f}; "
            + ", ".join(f"tau {s.tau:g}: {100 * s.skip_ratio:.1f}% skipped, PPL {s.ppl:.3f}" for s in at))
    if settings.target_skip and gated:
        first = settings.texts[0]
        try:
            cal = calibrate_tau(model, texts[first], settings.target_skip, tol=settings.calib_tol,
                                max_iter=settings.calib_iters, **kw)
        except ValueError as e:
            res["calibration"] = {"error": str(e)}
            log(f"{head}: no matched tau: {e}")
            return res
        res["calibration"] = {k: cal[k] for k in ("tau", "skip_ratio", "target")} | {"text": first,
                                                                                    "passes": len(cal["history"])}
        for name, docs in texts.items():
            s = score(model, docs, tau=cal["tau"], name="matched", **kw)
            row = _row(s, _scores(base[name], "base"), docs, settings.seed, saving)
            res["texts"][name]["matched"] = {**row, "kind": "matched"}
            log(f"{head}: {name} matched tau {cal['tau']:.4f}: {100 * s.skip_ratio:.1f}% skipped, PPL {s.ppl:.3f}")
    return res


# ---------------------------------------------------------------------------- the driver
class _Lazy:
    """Loads what an evaluation or training needs once, on first use."""

    def __init__(self, fn: Callable):
        self.fn, self.value, self.done = fn, None, False

    def __call__(self):
        if not self.done:
            self.value, self.done = self.fn(), True
        return self.value


def run_ablations(recipe: TrainConfig, variants: Sequence[Variant], out_dir: str | Path, settings: EvalSettings,
                  *, train: bool = True, resume: bool = True, data=None, texts: dict | None = None,
                  base_fn: Callable | None = None, log: Callable[[str], None] = print) -> dict:
    """Train (``train``) and score every variant in order, rewriting ``out_dir/ablations.{json,md}`` after each.

    ``data`` (:class:`fbs.train.data.BlockData`), ``texts`` ({name: [HeldoutDoc]}) and ``base_fn`` (a fresh HF
    base model per call) default to loading ``recipe.data``, the sweep's held-out texts and ``recipe.model``."""
    import torch

    from .. import FBSForCausalLM
    from . import stage1

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = [(v, variant_config(recipe, v, out)) for v in variants]  # every variant valid before any training
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    tokenizer = _Lazy(lambda: _tokenizer(recipe.model))
    blocks = _Lazy(lambda: data if data is not None else stage1.load_data(recipe, tokenizer()))
    held = _Lazy(lambda: texts if texts is not None else _texts(settings, tokenizer()))
    base = _Lazy(lambda: _base(out, settings, held, lambda: FBSForCausalLM.from_base(
        base_fn() if base_fn else recipe.model).eval(), log))
    heads = [f"[{i}/{len(configs)}] {v.name}" for i, (v, _) in enumerate(configs, 1)]
    # a finished run of another recipe is refused before anything trains
    finished = [finished_record(v, cfg, strict=train, log=log, head=h) for (v, cfg), h in zip(configs, heads)]
    results = []
    for (v, cfg), head, rec in zip(configs, heads, finished):
        if rec is not None:
            log(f"{head}: finished run ({rec['steps']} steps, {rec['tokens']:,} tokens): not retrained")
        elif train:
            rec = train_variant(v, cfg, blocks, base_fn, resume, log, head)
        else:
            log(f"{head}: not trained in {cfg.out_dir}: no scores")
        ev = None
        if rec is not None:
            path = Path(cfg.out_dir) / EVAL_RECORD
            cached = _read_json(path)
            if cached and cached["settings"] == settings.to_dict() and cached["run"] == rec["finished_at"]:
                ev = cached
                log(f"{head}: scored before (same settings): {path}")
            else:
                final = Path(cfg.out_dir) / "final"  # not rec["final"]: OUT may have moved since
                log(f"{head}: scoring {final}")
                t0 = time.perf_counter()
                model = stage1.load_trained(final, base=base_fn() if base_fn else None)
                ev = {"settings": settings.to_dict(), "run": rec["finished_at"],
                      **evaluate_variant(model, held(), base(), settings, log, head),
                      "wall_s": time.perf_counter() - t0}
                del model
                _write_json(path, ev)
        results.append({"variant": v.name, "dir": v.dirname, "what": v.what, "overrides": list(v.overrides),
                        "train": None if rec is None else {k: x for k, x in rec.items() if k != "config"},
                        "eval": ev})
        report = {"recipe": recipe.to_dict(), "settings": settings.to_dict(),
                  "base": base() if any(r["eval"] for r in results) else None, "variants": results}
        _write_json(out / "ablations.json", report)
        (out / "ablations.md").write_text(markdown(report))
    log(f"wrote {out / 'ablations.json'} and {out / 'ablations.md'}")
    return report


def _tokenizer(model: str):
    from ..model.bases import load_tokenizer

    return load_tokenizer(model)


def _texts(settings: EvalSettings, tokenizer) -> dict:
    from ..eval.sweep import sweep_texts

    return sweep_texts(tokenizer, settings.texts, settings.corpus, settings.split, settings.per_lang,
                       settings.max_tokens, settings.seed, settings.gate_from, settings.ood_per_kind)


def _base(out: Path, settings: EvalSettings, held: Callable, model_fn: Callable, log) -> dict:
    """The base model's rows, from ``out/base_eval.json`` when scored under the same settings."""
    path = out / BASE_RECORD
    cached = _read_json(path)
    if cached and cached["settings"] == settings.to_dict():
        return cached["texts"]
    log("base model: scoring")
    rows = base_rows(held(), settings, model_fn)
    _write_json(path, {"settings": settings.to_dict(), "texts": rows})
    return rows


# ---------------------------------------------------------------------------- the table
def _delta(row: dict | None, ref: dict | None, seed: int) -> str:
    """PPL difference of ``row`` against ``ref`` (same blocks), paired bootstrap over blocks."""
    from ..eval.stats import paired_bootstrap, ppl_metric

    if row is None or ref is None:
        return "–"
    d = paired_bootstrap(row["nll"], ref["nll"], ppl_metric, higher_is_better=False, seed=seed)
    return f"{d.delta:+.3f} [{d.ci_low:+.3f}, {d.ci_high:+.3f}], p={d.p_value:.3f}"


def markdown(report: dict) -> str:
    """The tables of :func:`run_ablations`: training, then one table a held-out text."""
    s, rec = report["settings"], report["recipe"]
    rows = report["variants"]
    lines = [
        "# Module ablations (paper §4.3; k_max grid, appendix C.6; gate inputs, appendix E.5)", "",
        f"Recipe: {rec['model']}, {rec['trainable']}, data {rec['data']}, {rec['max_steps']} steps x "
        f"{rec['batch_tokens']} tokens = {rec['max_steps'] * rec['batch_tokens']:,} tokens per variant, seed "
        f"{rec['seed']}. Scored by `fbs.eval.sweep.score` (decode-faithful: the first {s['gate_from']} tokens of "
        f"a block are the prompt, the others are scored); PPL [95% CI over blocks]; Δ vs full: paired bootstrap over "
        f"the same blocks against variant `full`.", "",
        "| variant | change | overrides | steps | tokens | train wall (min) | scoring wall (min) |",
        "|---|---|---|---|---|---|---|"]
    for r in rows:
        t, e = r["train"], r["eval"]
        sets = ", ".join(f"`{o}`" for o in r["overrides"]) or "–"
        lines.append(f"| {r['variant']} | {r['what']} | {sets} | " + (
            f"{t['steps']} | {t['tokens']:,} | {t['wall_s'] / 60:.1f} | " if t else "not trained | – | – | ")
            + (f"{e['wall_s'] / 60:.1f} |" if e else "– |"))
    full = next((r["eval"] for r in rows if r["variant"] == "full" and r["eval"]), None)
    for name in s["texts"]:
        lines += ["", f"## {TEXT_NAMES.get(name, name)} held-out text", ""]
        cal = f"matched skip ({100 * s['target_skip']:g}%): tau / Skip % / PPL / Δ vs full at its matched tau" \
            if s["target_skip"] else None
        head = ["variant", "PPL full depth [95% CI]", "Δ vs full, full depth"] + \
            [f"tau {t:g}: Skip % / PPL" for t in s["taus"]] + ([cal] if cal else [])
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        base = (report.get("base") or {}).get(name)
        if base:
            lines.append(f"| base | {base['ppl']:.3f} [{base['ppl_ci'][0]:.2f}, {base['ppl_ci'][1]:.2f}] | – | "
                         + " | ".join(f"0.0 / {base['ppl']:.3f}" for _ in s["taus"]) + (" | – |" if cal else " |"))
        ref = full["texts"][name] if full else None
        for r in rows:
            if not r["eval"]:
                continue
            e = r["eval"]["texts"][name]
            f = e["full"]
            cells = [r["variant"], f"{f['ppl']:.3f} [{f['ppl_ci'][0]:.2f}, {f['ppl_ci'][1]:.2f}]",
                     "–" if r["variant"] == "full" else _delta(f, ref and ref["full"], s["seed"])]
            cells += [f"{100 * x['skip_ratio']:.1f} / {x['ppl']:.3f}" for x in e["taus"]]
            if cal:
                m, c = e["matched"], r["eval"]["calibration"] or {}
                off = " (off target)" if m and abs(c["skip_ratio"] - c["target"]) > s["calib_tol"] else ""
                cells.append("no gates" if m is None and r["variant"] == "-sg" else "–" if m is None else
                             f"{m['tau']:.3f} / {100 * m['skip_ratio']:.1f}{off} / {m['ppl']:.3f} / "
                             + ("–" if r["variant"] == "full" else _delta(m, ref and ref["matched"], s["seed"])))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options besides the recipe's (``--config``, ``--set``, ``--out-dir``, ``--max-steps``, ``--data`` ...)."""
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma list, in order (default %(default)s; also gate-both, kmaxN, fixedkN). A list that "
                        "starts with a '-' name needs the = form: --variants=-paw,-ch")
    p.add_argument("--eval-only", action="store_true", help="train nothing: score the finished runs, rebuild the table")
    p.add_argument("--taus", help="comma list of the tau grid (default: the recipe's eval_taus and 0.3)")
    p.add_argument("--target-skip", type=float, default=0.1,
                   help="matched skip ratio (0-1) each variant's tau is calibrated to on the first --text; 0 = off")
    p.add_argument("--text", help="held-out text: ood, in or ood,in (default ood,in with a corpus, else ood)")
    p.add_argument("--corpus", help="corpus of the in-domain text (default: --data when it is a directory)")
    p.add_argument("--split", default="test")
    p.add_argument("--per-lang", type=int, default=4, help="in-domain documents per language")
    p.add_argument("--ood-per-kind", type=int, default=4, help="OOD blocks per kind (en, zh, code)")
    p.add_argument("--max-tokens", type=int, default=512, help="in-domain tokens per document")
    p.add_argument("--gate-from", type=int, default=128, help="prompt tokens never gated; only later ones are scored")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--calib-tol", type=float, default=0.005, help="accepted |skip ratio - target| of the matched tau")
    p.add_argument("--eval-seed", type=int, default=0, help="seed of the in-domain sample and the bootstraps")


def cmd_ablations(args: argparse.Namespace) -> int:
    from .common import config_from_args
    from .config import TrainConfigError

    variants = parse_variants(args.variants)
    if not args.out_dir:
        print("error: --out-dir is required (each variant trains into OUT/<variant>)", file=sys.stderr)
        return 2
    quiet = argparse.Namespace(**{**vars(args), "print_config": False})
    cfg = config_from_args(quiet, TrainConfig, TrainConfigError, ("out_dir", "max_steps", "data", "model"))
    if isinstance(cfg, int):
        return cfg
    given = {s.split("=", 1)[0] for s in args.set or []}
    recipe = cfg.with_overrides([d for d in DRIVER_SETS if d.split("=", 1)[0] not in given])
    corpus = args.corpus or (recipe.data if Path(recipe.data).is_dir() else None)
    texts = tuple(t.strip() for t in (args.text or ("ood,in" if corpus else "ood")).split(",") if t.strip())
    taus = ([float(t) for t in args.taus.split(",") if t.strip()] if args.taus
            else sorted({*cfg.eval_taus, 0.3}, reverse=True))
    settings = EvalSettings(tuple(taus), texts, args.target_skip or None, corpus, args.split, args.per_lang,
                            args.ood_per_kind, args.max_tokens, args.gate_from, args.batch_size, args.eval_seed,
                            args.calib_tol)
    if args.print_config:
        print(json.dumps({v.name: variant_config(recipe, v, args.out_dir).to_dict() for v in variants}, indent=1))
        return 0
    try:
        run_ablations(recipe, variants, args.out_dir, settings, train=not args.eval_only, resume=not args.no_resume)
    except KeyboardInterrupt:
        print(f"interrupted; finished variants and checkpoints are under {args.out_dir} (rerun the command to "
              "resume)", file=sys.stderr)
        return 130
    return 0
