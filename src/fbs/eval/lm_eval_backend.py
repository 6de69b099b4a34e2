"""lm-evaluation-harness backend: ``lm_eval --model fbs`` scores FBS (or base) models with lm-eval tasks.

The backend is a thin adapter from lm-eval's three request types to a :class:`~fbs.eval.systems.System`,
so lm-eval and ``fbs eval`` share tokenisation, batching and the skip-aware scoring path:

- ``loglikelihood``: (context, continuation) -> (sum log p, is_greedy)
- ``loglikelihood_rolling``: a document's total log-probability in non-overlapping windows of at most
  ``max_length`` predicted tokens, each conditioned on the preceding tokens that fit (the first token is
  context only)
- ``generate_until``: greedy, stop strings from the task's ``until``, ``max_gen_toks`` (default 256)

Model arguments (``--model_args``): ``system=fbs|base`` (default fbs), ``pretrained`` (bundled base name
or HF directory, default smollm2-135m), ``checkpoint``, ``fresh`` (untrained FBS modules), ``tau``,
``kv_policy``, ``gate_mode=threshold|off``, ``max_length``, ``max_batch_tokens``. From Python, pass a
ready system: ``FBSLM(system=FBSSystem(model, tok))``.

lm-eval's built-in task YAMLs download from the hub; ``fbs eval make-tasks`` writes offline YAMLs plus
JSONL data for the local datasets (``dataset_path: json`` with absolute ``data_files``). Because the
plugin model must be registered before lm-eval resolves ``--model fbs``, run lm-eval through this module:

    python -m fbs.eval.lm_eval_backend --model fbs --model_args system=fbs,tau=0.7 \\
        --include_path ~/.cache/fbs/eval/lm_eval_tasks --tasks fbs_arc_easy --limit 50
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from fbs.eval.systems import LoglikRequest, System

logger = logging.getLogger(__name__)

#: Default generation budget when a task does not set ``max_gen_toks``.
MAX_GEN_TOKS = 256


def _to_bool(v) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("fbs")
class FBSLM(LM):
    """lm-eval model wrapping a :class:`System` (an FBS model by default)."""

    def __init__(self, system: System | str | None = None, *, pretrained: str = "smollm2-135m",
                 checkpoint: str | None = None, fresh: bool = False, tau: float | None = None,
                 kv_policy: str | None = None, gate_mode: str = "threshold", max_length: int = 2048,
                 max_batch_tokens: int = 2048, **unused) -> None:
        super().__init__()
        if unused:
            logger.warning("fbs lm-eval backend: ignoring model args %s", sorted(unused))
        if not isinstance(system, System):
            system = _build_system(system or "fbs", pretrained, checkpoint, _to_bool(fresh),
                                   None if tau in (None, "") else float(tau), kv_policy or None, gate_mode,
                                   int(max_length), int(max_batch_tokens))
        self.system = system

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "FBSLM":
        from lm_eval.utils import simple_parse_args_string

        return cls(**simple_parse_args_string(arg_string))

    # lm-eval's three request types ------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        scores = self.system.loglikelihood([LoglikRequest(*r.args[:2]) for r in requests], progress=not disable_tqdm)
        return [(s.logprob, s.is_greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        W = self.system.max_length
        pairs, owner = [], []
        for k, r in enumerate(requests):
            ids = self.system.encode(r.args[0])
            for s in range(1, len(ids), W):
                e = min(len(ids), s + W)
                pairs.append((ids[max(0, e - 1 - W): s], ids[s:e]))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, sc in zip(owner, self.system.score_tokens(pairs, progress=not disable_tqdm)):
            totals[k] += sc.logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm.auto import tqdm

        out = []
        for r in tqdm(requests, disable=disable_tqdm, desc="fbs: generate_until"):
            context, gen_kwargs = r.args[0], dict(r.args[1] or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            out.append(self.system.generate_until(context, until, int(gen_kwargs.get("max_gen_toks", MAX_GEN_TOKS))))
        return out

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.system.tokenizer, "name_or_path", "fbs").replace("/", "__")


def _build_system(kind: str, pretrained, checkpoint, fresh, tau, kv_policy, gate_mode, max_length, max_batch_tokens) -> System:
    from fbs.eval.systems import FBSSystem, HFSystem
    from fbs.models import load_base, load_tokenizer

    kw = {"max_length": max_length, "max_batch_tokens": max_batch_tokens}
    if kind not in ("base", "fbs"):
        raise ValueError(f"system must be 'base' or 'fbs', got {kind!r}")
    if kind == "base":
        model, tok = load_base(pretrained)
        return HFSystem(model, tok, name=f"{pretrained} (base)", **kw)
    from fbs.loading import load_fbs

    overrides = {k: v for k, v in (("tau", tau), ("kv_policy", kv_policy)) if v is not None}
    model = load_fbs(pretrained, checkpoint or None, shipped=not fresh, **overrides)
    tok = getattr(model, "tokenizer", None) or load_tokenizer(pretrained)
    return FBSSystem(model, tok, tau=tau, kv_policy=kv_policy, gate_mode=gate_mode, name="fbs", **kw)


# --------------------------------------------------------------------------- offline task files

_MC_YAML = """# Generated by `fbs eval make-tasks` from {source}. Same items, contexts and options as `fbs eval run --tasks {task}`.
task: fbs_{task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
num_fewshot: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_PPL_YAML = """# Generated by `fbs eval make-tasks` from {source}. Rolling log-likelihood of whole documents.
task: fbs_{task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
num_fewshot: 0
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def write_task_files(out_dir: Path, tasks: Sequence[str] | None = None, limit: int | None = None,
                     seed: int = 42) -> list[Path]:
    """Write ``<task>.jsonl`` + ``fbs_<task>.yaml`` for multiple-choice tasks with one context per item
    (and the perplexity corpora); returns the written paths. Items with per-option contexts (winogrande)
    cannot be expressed as lm-eval ``multiple_choice`` with a shared context and are skipped."""
    from fbs.eval.tasks import TASKS, select

    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(tasks) if tasks else [n for n, s in TASKS.items() if s.kind in ("mc", "ppl")]
    written = []
    for name in names:
        spec = TASKS[name]
        items = select(spec.load(), limit, seed)
        data = out_dir / f"{name}.jsonl"
        if spec.kind == "mc":
            if any(len(set(ex.contexts)) != 1 for ex in items):
                logger.warning("skipping %s: options have different contexts", name)
                continue
            rows = [{"id": ex.id, "context": ex.contexts[0], "choices": list(ex.continuations), "gold": ex.gold}
                    for ex in items]
            yaml = _MC_YAML
        elif spec.kind == "ppl":
            rows = [{"id": d.id, "text": d.text} for d in items]
            yaml = _PPL_YAML
        else:
            logger.warning("skipping %s: generation tasks are run with `fbs eval run`", name)
            continue
        with open(data, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        path = out_dir / f"fbs_{name}.yaml"
        path.write_text(yaml.format(task=name, data=data.resolve(), source=spec.description))
        written += [data, path]
    return written


def main(argv: list[str] | None = None) -> None:
    """``python -m fbs.eval.lm_eval_backend ...``: lm-eval's CLI with the ``fbs`` model registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
