"""lm-evaluation-harness backend: ``lm_eval --model fbs`` scores FBS (or base) models with lm-eval tasks.

The backend turns lm-eval's three request types into token pairs for a :class:`~fbs.eval.systems.System`
(which batches them and runs the skip-aware forward or the decoding engine) and follows the conventions of
lm-eval's own Hugging Face backend (``--model hf``, ``HFLM``) exactly, so its numbers compare with published
lm-eval numbers of other models (``tests/test_lm_eval_conformance.py`` checks it against ``hf``):

- tokenisation: the tokenizer's own special tokens (a tokenizer that adds BOS adds it here too), unless
  ``add_bos_token`` says otherwise or the text already starts with the prefix token's text. The *prefix token*
  is ``prefix_token_id`` if given, else BOS, else EOS.
- ``loglikelihood``: (context, continuation) -> (sum log p, is_greedy). Trailing whitespace of the context moves
  to the continuation; context + continuation is encoded as a whole and split at the length of the context's own
  encoding. An empty context is the prefix token (or, when the continuation's first token is the prefix token,
  that first token).
- ``loglikelihood_rolling``: the document's total log-probability with *every* token predicted: the prefix
  token conditions the first one. Tokens are predicted in consecutive chunks of ``max_length``; each chunk is
  conditioned on the tokens before it, so that every model input is ``max_length`` tokens (the first: the
  prefix token and the chunk). An empty document scores 0.
- ``generate_until``: greedy, prompt left-truncated to ``max_length - max_gen_toks`` tokens; stops at the model's
  generation-config EOS, the tokenizer's EOS and the task's ``until`` strings (the EOS text is added to them);
  the text is decoded without special tokens and cut before the first ``until`` string. ``max_gen_toks`` (or
  ``max_new_tokens`` / ``max_tokens`` / ``max_completion_tokens``, in that order) defaults to 256. Sampling
  (``do_sample`` or a temperature > 0) is refused: the backend decodes greedily.
- ``max_length`` defaults to the model's context length (``max_position_embeddings``; 8192 for SmolLM2), as in
  ``hf``; the old default, 2048, shortens rolling windows and so changes perplexities of longer documents.
- batching: requests are scored in batches of right-padded rows (``max_batch_tokens``), which gives the same
  results as lm-eval's batch size 1 (to float rounding); generation runs one request at a time.

Model arguments (``--model_args``): ``system=fbs|base`` (default fbs), ``pretrained`` (bundled base name
or HF directory, default smollm2-135m), ``checkpoint``, ``fresh`` (untrained FBS modules), ``tau``,
``kv_policy``, ``gate_mode=threshold|off``, ``max_length``, ``max_batch_tokens``, ``add_bos_token``,
``prefix_token_id`` (the last two as in ``hf``). From Python, pass a ready system:
``FBSLM(system=FBSSystem(model, tok))`` (its ``max_length`` is then the system's).

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

import lm_eval.models  # noqa: F401  lm-eval registers its own backends (hf, ...) only into an empty registry
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from fbs.eval.systems import System

logger = logging.getLogger(__name__)

#: Default generation budget when a task does not set ``max_gen_toks`` (lm-eval's ``hf`` default).
MAX_GEN_TOKS = 256
#: Context length when neither the model config nor the tokenizer names one (lm-eval's default).
DEFAULT_MAX_LENGTH = 2048
#: Generation-length keys of a task's ``generation_kwargs``, first present wins (lm-eval's order).
_MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
#: ``tokenizer.model_max_length`` of tokenizers that set none.
_TOKENIZER_UNSET = int(1e30)


def _to_bool(v) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


def _opt_bool(v) -> bool | None:
    return None if v in (None, "") else _to_bool(v)


def default_max_length(config, tokenizer=None) -> int:
    """The context length lm-eval's ``hf`` backend uses when ``max_length`` is not given: the (text) config's
    ``n_positions`` / ``max_position_embeddings`` / ``n_ctx``, else the tokenizer's ``model_max_length`` unless
    unset, else 2048."""
    cfg = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(cfg, attr, None) is not None:
            return int(getattr(cfg, attr))
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if n is not None and n != _TOKENIZER_UNSET else DEFAULT_MAX_LENGTH


def rolling_windows(ids: Sequence[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that predict every token of ``ids`` exactly once: chunks of ``max_length``
    tokens, each conditioned on the tokens before it so that context + chunk minus the last token is
    ``max_length`` tokens (or all there is); the prefix token is the first chunk's context."""
    seq = [prefix_token, *ids]  # seq[i + 1] is ids[i]
    out = []
    for s in range(0, len(ids), max_length):
        e = min(len(ids), s + max_length)
        out.append((seq[max(0, e - max_length): s + 1], list(ids[s:e])))
    return out


@register_model("fbs")
class FBSLM(LM):
    """lm-eval model wrapping a :class:`System` (an FBS model by default)."""

    def __init__(self, system: System | str | None = None, *, pretrained: str = "smollm2-135m",
                 checkpoint: str | None = None, fresh: bool = False, tau: float | None = None,
                 kv_policy: str | None = None, gate_mode: str = "threshold", max_length: int | None = None,
                 max_batch_tokens: int = 2048, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, **unused) -> None:
        super().__init__()
        if unused:
            logger.warning("fbs lm-eval backend: ignoring model args %s", sorted(unused))
        if not isinstance(system, System):
            system = _build_system(system or "fbs", pretrained, checkpoint, _to_bool(fresh),
                                   None if tau in (None, "") else float(tau), kv_policy or None, gate_mode,
                                   None if max_length in (None, "") else int(max_length), int(max_batch_tokens))
        self.system = system
        self.add_bos_token = _opt_bool(add_bos_token)
        self._prefix_token_id = None if prefix_token_id in (None, "") else int(prefix_token_id)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "FBSLM":
        from lm_eval.utils import simple_parse_args_string

        return cls(**simple_parse_args_string(arg_string))

    # tokenisation, as lm-eval's hf backend does it ----------------------------------------------
    @property
    def tokenizer(self):
        return self.system.tokenizer

    @property
    def prefix_token_id(self) -> int:
        """The token that conditions a first token with nothing before it: ``prefix_token_id``, BOS, else EOS."""
        if self._prefix_token_id is not None:
            return self._prefix_token_id
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.tokenizer.eos_token_id

    def _encode(self, text: str, add_special_tokens: bool | None) -> list[int]:
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer(text, **kw)["input_ids"])

    def tok_encode(self, text: str) -> list[int]:
        """Scoring encoding: the tokenizer's special tokens, unless ``add_bos_token`` is set or ``text`` already
        starts with the prefix token's text."""
        starts_with_prefix = text.startswith(self.tokenizer.decode([self.prefix_token_id]))
        return self._encode(text, False if starts_with_prefix else self.add_bos_token)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids of one ``loglikelihood`` request (see the module docstring)."""
        if context == "":
            cont = self._encode(continuation, False)
            return (cont[:1], cont[1:]) if cont[:1] == [self.prefix_token_id] else ([self.prefix_token_id], cont)
        n_ws = len(context) - len(context.rstrip())
        if n_ws:
            context, continuation = context[:-n_ws], context[-n_ws:] + continuation
        ctx = self.tok_encode(context)
        return ctx, self.tok_encode(context + continuation)[len(ctx):]

    # lm-eval's three request types ------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*r.args[:2]) for r in requests]
        for (ctx, cont), r in zip(pairs, requests):
            if len(cont) > self.system.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens exceeds max_length {self.system.max_length}: "
                                 f"{r.args[1][:80]!r}")
        scores = self.system.score_tokens(pairs, progress=not disable_tqdm)
        return [(s.logprob, s.is_greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for k, r in enumerate(requests):
            windows = rolling_windows(self.tok_encode(r.args[0]), self.prefix_token_id, self.system.max_length)
            pairs += windows
            owner += [k] * len(windows)
        totals = [0.0] * len(requests)
        for k, sc in zip(owner, self.system.score_tokens(pairs, progress=not disable_tqdm)):
            totals[k] += sc.logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm.auto import tqdm

        eos = _generation_eos(self.system)
        eos_id = self.tokenizer.eos_token_id
        eos_text = None if eos_id is None else self.tokenizer.decode([eos_id], skip_special_tokens=False)
        out = []
        for r in tqdm(requests, disable=disable_tqdm, desc="fbs: generate_until"):
            context, gen_kwargs = r.args[0], dict(r.args[1] or {})
            until, max_new = _stop_and_budget(gen_kwargs, eos_text)
            max_ctx = self.system.max_length - max_new
            if max_ctx <= 0:
                raise ValueError(f"max_gen_toks {max_new} leaves no room for a prompt in max_length "
                                 f"{self.system.max_length}")
            bos = getattr(self.tokenizer, "bos_token", None)
            ids = self._encode(context, False if bos and context.startswith(bos) else self.add_bos_token)[-max_ctx:]
            if "max_length" in gen_kwargs:  # lm-eval: prompt + generation, overrides max_gen_toks
                max_new = int(gen_kwargs["max_length"]) - len(ids)
            stop = [s for s in until if s]
            new = self.system.generate_ids(torch.tensor([ids], dtype=torch.long), max_new, stop, eos=eos or None)
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            for s in stop:
                text = text.split(s)[0]
            out.append(text)
        return out

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "fbs").replace("/", "__")


def _stop_and_budget(gen_kwargs: dict, eos_text: str | None) -> tuple[list[str], int]:
    """A ``generate_until`` request's stop strings (``until`` + the EOS text) and token budget."""
    sampling = gen_kwargs.get("do_sample")
    if sampling is None:
        sampling = float(gen_kwargs.get("temperature", 0.0) or 0.0) > 0.0
    if sampling:
        raise ValueError(f"the fbs backend decodes greedily; this task asks for sampling: {gen_kwargs}")
    until = gen_kwargs.get("until")
    if not isinstance(until, (str, list, type(None))):
        raise ValueError(f"until must be a string or a list of strings, got {until!r}")
    until = [until] if isinstance(until, str) else list(until or [])
    if eos_text is not None and eos_text not in until:
        until.append(eos_text)
    budget = next((gen_kwargs[k] for k in _MAX_TOKEN_KEYS if gen_kwargs.get(k) is not None), MAX_GEN_TOKS)
    return until, int(budget)


def _generation_eos(system: System) -> list[int]:
    """Token ids lm-eval's hf backend stops generating at: the model's generation-config EOS (Hugging Face
    ``generate``'s default) and the tokenizer's EOS (whose text lm-eval adds to ``until``)."""
    model = getattr(system, "model", None)
    hf = getattr(getattr(model, "base", None), "hf", model)  # an FBS model wraps the HF model
    cfg_eos = getattr(getattr(hf, "generation_config", None), "eos_token_id", None)
    ids = set() if cfg_eos is None else {cfg_eos} if isinstance(cfg_eos, int) else set(cfg_eos)
    if system.tokenizer.eos_token_id is not None:
        ids.add(system.tokenizer.eos_token_id)
    return sorted(ids)


def _build_system(kind: str, pretrained, checkpoint, fresh, tau, kv_policy, gate_mode, max_length,
                  max_batch_tokens) -> System:
    from fbs.eval.systems import FBSSystem, HFSystem
    from fbs.model.bases import load_base, load_tokenizer

    if kind not in ("base", "fbs"):
        raise ValueError(f"system must be 'base' or 'fbs', got {kind!r}")
    if kind == "base":
        model, tok = load_base(pretrained)
        return HFSystem(model, tok, name=f"{pretrained} (base)", max_batch_tokens=max_batch_tokens,
                        max_length=max_length or default_max_length(model.config, tok))
    from fbs.model.loading import load_fbs

    overrides = {k: v for k, v in (("tau", tau), ("kv_policy", kv_policy)) if v is not None}
    model = load_fbs(pretrained, checkpoint or None, shipped=not fresh, **overrides)
    tok = getattr(model, "tokenizer", None) or load_tokenizer(pretrained)
    return FBSSystem(model, tok, tau=tau, kv_policy=kv_policy, gate_mode=gate_mode, name="fbs",
                     max_batch_tokens=max_batch_tokens,
                     max_length=max_length or default_max_length(model.base.hf.config, tok))


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
