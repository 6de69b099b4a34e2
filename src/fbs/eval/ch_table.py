"""Bootstrap CIs for the CH table (RESULTS.md §4; ``fbs eval ch-table``).

``fbs probe`` and ``fbs eval ch`` report BIOS-F1 and boundary-F1 pooled over evaluation blocks and idiom accuracy
over idiom items. Their records keep, per block, the integer counts of :data:`fbs.data.metrics.COUNT_COLUMNS`
(``block_counts``), per item a 0/1 hit (``idiom_hits``), and a fingerprint of the evaluation data
(``eval_fingerprint``). That is enough to resample:

* **Unit of resampling**: the evaluation block for BIOS-F1 and boundary-F1, and, independently, the idiom item for
  idiom accuracy (appendix B.6: examples, never tokens). Resample ``b`` draws blocks with
  ``bootstrap_indices(n_blocks, B, seed)[b]`` and items with ``bootstrap_indices(n_items, B, seed + 1)[b]``.
* **Per resample**, the metric is recomputed exactly as the point estimate is: pooled F1 of the summed counts of
  the drawn blocks (a block drawn twice counts twice), the share of hits among the drawn items.
* **CI**: 95% percentile interval (2.5th, 97.5th) over the ``B`` resamples.
* **Paired** (two records with the same fingerprint): the same resamples for both, ``d[b] = metric(A) - metric(B)``,
  95% percentile CI of ``d`` and ``p = 2·min(P(d <= 0), P(d >= 0))`` capped at 1, as
  :func:`fbs.eval.stats.paired_bootstrap`. ``fbs eval ch-table --base`` adds Benjamini-Hochberg q-values over all
  comparisons of the table (:func:`fbs.eval.stats.bh_adjusted`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fbs.data.metrics import COUNT_COLUMNS, EPS, LABELS, report_from_counts
from fbs.eval.stats import ALPHA, N_RESAMPLES, BootstrapResult, bh_adjusted, bootstrap_indices

METRICS: tuple[str, ...] = ("bios_f1", "boundary_f1", "idiom_accuracy")
METRIC_NAMES = {"bios_f1": "BIOS-F1", "boundary_f1": "boundary-F1", "idiom_accuracy": "idiom accuracy"}
_RERUN = "re-run `fbs probe` / `fbs eval ch` with this version (same options) to get them"


class RecordError(ValueError):
    """A record that cannot be bootstrapped (no per-block counts, inconsistent) or paired (other data)."""


@dataclass
class CHRecord:
    """One ``fbs probe`` / ``fbs eval ch`` record with its per-block counts and per-item hits as arrays."""

    path: str
    data: dict
    counts: np.ndarray  # (n_blocks, len(COUNT_COLUMNS)) int64
    hits: np.ndarray  # (n_items,) int64, 0/1
    fingerprint: str

    @property
    def n_blocks(self) -> int:
        return len(self.counts)

    @property
    def n_items(self) -> int:
        return len(self.hits)

    def point(self) -> dict[str, float | None]:
        """The record's own scores, recomputed from its counts (the load checks they equal the stored ones)."""
        rep = report_from_counts(self.counts.sum(axis=0).tolist())
        acc = int(self.hits.sum()) / self.n_items if self.n_items else None
        return {"bios_f1": rep.bios_f1, "boundary_f1": rep.boundary_f1, "idiom_accuracy": acc}

    def describe(self) -> dict:
        """Predictor, layer, model and checkpoint, for the table's label columns."""
        d = self.data
        ckpt = d.get("checkpoint")
        if ckpt is None:
            ckpt = "frozen base"
        elif d.get("shipped_checkpoint"):
            ckpt = f"{ckpt} (shipped)"
        return {"predictor": d.get("predictor", "linear probe"), "layer": d.get("layer"), "model": d.get("model"),
                "checkpoint": ckpt}


def record_from_dict(data: dict, path: str = "<record>") -> CHRecord:
    """Check a record's per-block counts and idiom hits against its pooled scores and wrap them as arrays."""
    missing = [k for k in ("block_counts", "idiom_hits", "eval_fingerprint") if k not in data]
    if missing:
        raise RecordError(f"{path}: no per-block counts ({', '.join(missing)} missing): the record was written before "
                          f"`fbs eval ch-table` existed; {_RERUN}")
    columns = list(data.get("block_count_columns", COUNT_COLUMNS))
    if columns != list(COUNT_COLUMNS):
        raise RecordError(f"{path}: block_count_columns {columns} differ from this version's {list(COUNT_COLUMNS)}; "
                          f"{_RERUN}")
    counts = np.asarray(data["block_counts"], dtype=np.int64).reshape(-1, len(COUNT_COLUMNS))
    hits = np.asarray(data["idiom_hits"], dtype=np.int64).reshape(-1)
    if len(counts) == 0:
        raise RecordError(f"{path}: no evaluation blocks: nothing to resample")
    n_seq, n_items = data.get("n_eval_sequences", len(counts)), data.get("n_idiom_items", len(hits))
    if (len(counts), len(hits)) != (n_seq, n_items):
        raise RecordError(f"{path}: {len(counts)} block count rows and {len(hits)} idiom hits, but the record scored "
                          f"{n_seq} blocks and {n_items} idiom items")
    if not np.isin(hits, (0, 1)).all():
        raise RecordError(f"{path}: idiom_hits must be 0/1")
    rec = CHRecord(str(path), data, counts, hits, str(data["eval_fingerprint"]))
    point, bios = rec.point(), data.get("bios", {})
    stored = {"bios_f1": bios.get("bios_f1"), "boundary_f1": bios.get("boundary_f1"),
              "idiom_accuracy": data.get("idiom_accuracy")}
    if n_items == 0:
        stored["idiom_accuracy"] = None  # the record stores None (or NaN) without items
    if point != stored or int(counts[:, -1].sum()) != bios.get("n_tokens"):
        raise RecordError(f"{path}: the per-block counts do not reproduce the record's scores ({point} against "
                          f"{stored}): the record was edited or mixes two runs")
    return rec


def load_ch_record(path: str | Path) -> CHRecord:
    """:func:`record_from_dict` of a JSON record file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RecordError(f"{path}: no such record") from None
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}: not a JSON record ({exc})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: not a `fbs probe` / `fbs eval ch` record")
    return record_from_dict(data, str(path))


# --------------------------------------------------------------------------- resamples


def resample_weights(n: int, n_resamples: int = N_RESAMPLES, seed: int = 0) -> np.ndarray:
    """(n_resamples, n) int64: how often each index is drawn in each resample of :func:`bootstrap_indices`."""
    idx = bootstrap_indices(n, n_resamples, seed)  # (R, n)
    flat = (idx + n * np.arange(n_resamples)[:, None]).ravel()
    return np.bincount(flat, minlength=n_resamples * n).reshape(n_resamples, n)


def _f1(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """:func:`fbs.data.metrics._f1`'s F1, elementwise (the same float operations in the same order)."""
    p = np.where(tp + fp > 0, tp / np.maximum(tp + fp, 1), 0.0)
    r = np.where(tp + fn > 0, tp / np.maximum(tp + fn, 1), 0.0)
    return 2 * p * r / (p + r + EPS)


def f1_from_sums(sums: np.ndarray) -> dict[str, np.ndarray]:
    """BIOS-F1 and boundary-F1 of (R, len(COUNT_COLUMNS)) pooled counts, one value per row."""
    per_class = [_f1(sums[:, 3 * k], sums[:, 3 * k + 1], sums[:, 3 * k + 2]) for k in range(len(LABELS))]
    bios = per_class[0]
    for f in per_class[1:]:
        bios = bios + f  # left to right, as sum(per_class.values())
    return {"bios_f1": bios / len(LABELS), "boundary_f1": _f1(sums[:, 12], sums[:, 13], sums[:, 14])}


def metric_samples(rec: CHRecord, n_resamples: int = N_RESAMPLES, seed: int = 0) -> dict[str, np.ndarray | None]:
    """Per metric, its value on each of ``n_resamples`` resamples (blocks with ``seed``, items with ``seed + 1``);
    ``None`` for idiom accuracy without items."""
    out: dict[str, np.ndarray | None] = dict(f1_from_sums(resample_weights(rec.n_blocks, n_resamples, seed)
                                                          @ rec.counts))
    out["idiom_accuracy"] = None
    if rec.n_items:
        out["idiom_accuracy"] = (resample_weights(rec.n_items, n_resamples, seed + 1) @ rec.hits) / rec.n_items
    return out


def bootstrap_cis(rec: CHRecord, n_resamples: int = N_RESAMPLES, seed: int = 0) -> dict[str, dict | None]:
    """Per metric: the point estimate and its 95% percentile CI over resampled blocks (items for idiom accuracy)."""
    point, samples = rec.point(), metric_samples(rec, n_resamples, seed)
    out: dict[str, dict | None] = {}
    for m in METRICS:
        if samples[m] is None:
            out[m] = None
            continue
        lo, hi = np.percentile(samples[m], [2.5, 97.5])
        out[m] = {"value": point[m], "ci_low": float(lo), "ci_high": float(hi)}
    return out


def check_pairable(a: CHRecord, b: CHRecord) -> None:
    """Raise :class:`RecordError` unless ``a`` and ``b`` were scored on the same blocks and idiom items."""
    if a.fingerprint != b.fingerprint:
        raise RecordError(f"{a.path} and {b.path} were scored on different evaluation data (fingerprint "
                          f"{a.fingerprint[:12]} against {b.fingerprint[:12]}): pair only records written with the "
                          "same --corpus/--eval-split/--seq-len/--eval-seqs/--idiom-items/--seed and tokenizer")
    if (a.n_blocks, a.n_items) != (b.n_blocks, b.n_items):
        raise RecordError(f"{a.path} and {b.path} share a fingerprint but not their sizes "
                          f"({a.n_blocks}/{a.n_items} against {b.n_blocks}/{b.n_items} blocks/items)")


def paired_cis(a: CHRecord, b: CHRecord, n_resamples: int = N_RESAMPLES, seed: int = 0
               ) -> dict[str, BootstrapResult | None]:
    """Per metric, ``a`` minus ``b`` on the same resamples: Δ, its 95% CI and the two-sided p-value."""
    check_pairable(a, b)
    pa, pb = a.point(), b.point()
    sa, sb = metric_samples(a, n_resamples, seed), metric_samples(b, n_resamples, seed)
    out: dict[str, BootstrapResult | None] = {}
    for m in METRICS:
        if sa[m] is None:
            out[m] = None
            continue
        d = sa[m] - sb[m]  # (R,)
        p = min(1.0, 2.0 * min(float(np.mean(d <= 0)), float(np.mean(d >= 0))))
        lo, hi = np.percentile(d, [2.5, 97.5])
        out[m] = BootstrapResult(delta=pa[m] - pb[m], ci_low=float(lo), ci_high=float(hi), p_value=p,
                                 n=a.n_items if m == "idiom_accuracy" else a.n_blocks, n_resamples=n_resamples)
    return out


# --------------------------------------------------------------------------- table


def ch_table(records: Sequence[CHRecord], labels: Sequence[str] | None = None, base: CHRecord | None = None,
             n_resamples: int = N_RESAMPLES, seed: int = 0) -> dict:
    """Rows of CIs per record and, with ``base``, paired Δ against it with BH q-values over all comparisons.

    ``base`` is a row of its own unless it is one of ``records`` (same path); its Δ cells are empty.
    """
    records = list(records)
    labels = [Path(r.path).stem for r in records] if labels is None else list(labels)
    if len(labels) != len(records):
        raise RecordError(f"{len(labels)} labels for {len(records)} records")

    def is_base(rec: CHRecord) -> bool:
        return base is not None and Path(rec.path).resolve() == Path(base.path).resolve()

    if base is not None and not any(is_base(r) for r in records):
        records, labels = [base, *records], [Path(base.path).stem, *labels]
    for rec in records:  # every pairing is checked before any resampling
        if base is not None and not is_base(rec):
            check_pairable(rec, base)
    rows = []
    for rec, label in zip(records, labels):
        delta = None
        if base is not None and not is_base(rec):
            delta = {m: None if r is None else r.to_dict() for m, r in paired_cis(rec, base, n_resamples, seed).items()}
        rows.append({"label": label, "path": rec.path, **rec.describe(), "n_blocks": rec.n_blocks,
                     "n_items": rec.n_items, "eval_fingerprint": rec.fingerprint, "is_base": is_base(rec),
                     **bootstrap_cis(rec, n_resamples, seed), "delta": delta})
    comparisons = [(row, m) for row in rows if row["delta"] for m in METRICS if row["delta"][m] is not None]
    for (row, m), q in zip(comparisons, bh_adjusted([row["delta"][m]["p_value"] for row, m in comparisons])):
        row["delta"][m]["q_value"] = q
    return {"n_resamples": n_resamples, "seed": seed, "base": base.path if base is not None else None,
            "n_comparisons": len(comparisons), "metrics": list(METRICS), "rows": rows}


def _ci(cell: dict | None) -> str:
    return "–" if cell is None else f"{cell['value']:.3f} [{cell['ci_low']:.3f}, {cell['ci_high']:.3f}]"


def _delta(cell: dict | None) -> str:
    if cell is None:
        return "–"
    star = "*" if cell["q_value"] < ALPHA else ""
    return f"{cell['delta']:+.3f} [{cell['ci_low']:+.3f}, {cell['ci_high']:+.3f}] q {cell['q_value']:.3f}{star}"


def markdown(table: dict) -> str:
    """The table as markdown: one row per record, Δ columns against the base if there is one."""
    head = ["row", "predictor", "layer", "model", "checkpoint", *(f"{METRIC_NAMES[m]} [95% CI]" for m in METRICS),
            "blocks / items"]
    paired = table["base"] is not None
    if paired:
        head += [f"Δ {METRIC_NAMES[m]} [95% CI]" for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["rows"]:
        cells = [row["label"], row["predictor"], str(row["layer"]), str(row["model"]), row["checkpoint"],
                 *(_ci(row[m]) for m in METRICS), f"{row['n_blocks']} / {row['n_items']}"]
        if paired:
            cells += ["base"] * len(METRICS) if row["is_base"] else [_delta(row["delta"][m]) for m in METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    fps = sorted({row["eval_fingerprint"][:12] for row in table["rows"]})
    note = (f"\n95% percentile CIs over {table['n_resamples']} bootstrap resamples of the evaluation blocks (BIOS-F1, "
            f"boundary-F1) and, independently, of the idiom items (seed {table['seed']}). Evaluation data: "
            f"{', '.join(fps)}.")
    if paired:
        note += (f" Δ = row − base on the same resamples; q: Benjamini–Hochberg over the table's "
                 f"{table['n_comparisons']} comparisons; * q < {ALPHA}.")
    return "\n".join(lines) + "\n" + note + "\n"


# --------------------------------------------------------------------------- CLI


def cmd_ch_table(args) -> int:
    try:
        records = [load_ch_record(p) for p in args.records]
        base = load_ch_record(args.base) if args.base else None
        labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
        if args.resamples < 1:
            raise RecordError("--resamples must be >= 1")
        table = ch_table(records, labels, base, args.resamples, args.seed)
    except RecordError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(table), end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        from fbs.provenance import provenance

        Path(args.out).write_text(json.dumps({**table, "provenance": provenance()}, indent=2) + "\n")
    return 0


def add_parser(sub) -> None:
    """``fbs eval ch-table`` (registered by :func:`fbs.eval.cli.register`, next to ``fbs eval ch``)."""
    p = sub.add_parser("ch-table", help="CH table with bootstrap CIs over blocks / idiom items from `fbs probe` and "
                                        "`fbs eval ch` records; with --base, paired deltas and BH q-values")
    p.add_argument("records", nargs="+", type=Path, help="`fbs probe` / `fbs eval ch` JSON records")
    p.add_argument("--base", type=Path, default=None,
                   help="record every other row is paired against (same evaluation data fingerprint)")
    p.add_argument("--labels", default=None, help="comma-separated row labels, one per record (default: file names)")
    p.add_argument("--resamples", type=int, default=N_RESAMPLES, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="seed of the block resamples (items: seed + 1)")
    p.add_argument("--out", type=Path, default=None, help="write the table (CIs, deltas, p and q values) as JSON")
    p.set_defaults(func=cmd_ch_table)
