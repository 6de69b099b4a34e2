"""The decode loop: :func:`start` a :class:`fbs.engine.decoder.Decoder`, :func:`run` it step by step,
:func:`finish` it into a :class:`fbs.engine.decoder.GenerationResult`; :func:`generate` and :func:`stream` do all
three (``lossless=True``: the loop of :mod:`fbs.engine.speculative`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .decoder import (TRACE_DTYPES, VALIDATORS, DecodeOptions, Decoder, DecodeTrace, GenerationResult, StepOutput,
                      rows_from_input)
from .speculative import run_lossless

def stream(model, input_ids, attention_mask=None, tokenizer=None, **kwargs) -> Iterator[StepOutput]:
    """Yield the tokens of each decode step as they are produced (see :func:`generate` for options)."""
    dec = start(model, input_ids, attention_mask, tokenizer, kwargs)
    yield from run(dec)


def start(model, input_ids, attention_mask, tokenizer, kwargs) -> Decoder:
    opts = DecodeOptions(**kwargs)
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if opts.stop_strings and tok is None:
        raise ValueError("stop_strings need a tokenizer (pass tokenizer=)")
    return Decoder(model, rows_from_input(input_ids, attention_mask), opts, tok)


@torch.inference_mode()
def run(dec: Decoder) -> Iterator[StepOutput]:
    if dec.opts.lossless:
        yield from run_lossless(dec)
        return
    t0 = time.perf_counter()
    logits = torch.stack(dec.prefill())
    dec.timings = {"prefill_s": time.perf_counter() - t0}
    t1 = time.perf_counter()
    tokens = dec.pick(logits, dec.active)
    step = 0
    while True:
        rows = dec.active
        for r, t in zip(rows, tokens):
            dec.out[r].append(t)
            if dec.structure is not None:
                dec.depth[r] = max(0, dec.depth[r] + dec.structure.depth_delta[t])
        yield StepOutput(step, list(rows), list(tokens))
        keep = [i for i, (r, t) in enumerate(zip(rows, tokens)) if not dec.finished(r, t)]
        if not keep:
            break
        dec.active = [rows[i] for i in keep]
        tokens = [tokens[i] for i in keep]
        logits = dec.decode_step(step, tokens)
        step += 1
        tokens = dec.pick(logits, dec.active)
    dec.timings["decode_s"] = time.perf_counter() - t1
    dec.timings["total_s"] = time.perf_counter() - t0


def generate(model, input_ids, attention_mask=None, tokenizer=None, **kwargs) -> GenerationResult:
    """Generate with KV caching and true layer skipping.

    ``input_ids``: (B, T) tensor (with ``attention_mask`` for padded rows) or a list of token-id lists.
    Keyword options are the fields of :class:`DecodeOptions`. Returns sequences, per-row new tokens, the
    per-step trace (what ran, gate probabilities, k(t), chunk boundaries, TFLOPs(rel)) and timings.
    """
    dec = start(model, input_ids, attention_mask, tokenizer, kwargs)
    for _ in run(dec):
        pass
    result = finish(dec)
    validator = dec.opts.validator
    if validator is not None:
        check = VALIDATORS[validator] if isinstance(validator, str) else validator
        if dec.tok is None:
            raise ValueError("a validator needs a tokenizer (pass tokenizer=)")
        bad = [r for r in range(dec.B) if not check(dec.tok.decode(result.new_tokens[r], skip_special_tokens=True))]
        if bad:
            result = _fallback(model, dec, result, bad, kwargs)
    return result


def _fallback(model, dec: Decoder, result: GenerationResult, bad: list[int], kwargs) -> GenerationResult:
    """Regenerate the rows whose output failed the validator with the conservative ``fallback_tau``."""
    retry = dict(kwargs, tau=dec.opts.fallback_tau, validator=None)
    again = start(model, [dec.prompts[r] for r in bad], None, dec.tok, retry)
    for _ in run(again):
        pass
    for i, r in enumerate(bad):
        dec.out[r], dec.scores[r] = again.out[i], again.scores[i]
        dec.rec.replace_row(r, again.rec, i)
    dec.timings = {k: result.timings[k] + again.timings[k] for k in result.timings}
    out = finish(dec)
    out.trace.fallback = [r in bad for r in range(dec.B)]
    return out


def finish(dec: Decoder) -> GenerationResult:
    pad = dec.opts.pad_token_id
    if pad is None:
        pad = getattr(dec.tok, "pad_token_id", None) if dec.tok is not None else None
        pad = pad if pad is not None else (min(dec.eos) if dec.eos else 0)
    width = max(len(p) for p in dec.prompts) + max(len(o) for o in dec.out)
    seq = torch.full((dec.B, width), pad, dtype=torch.long)
    for r in range(dec.B):
        row = dec.prompts[r] + dec.out[r]
        seq[r, : len(row)] = torch.tensor(row)
    # trace step s is the decode step that consumed generated token s (the last token is never consumed)
    n = max(len(o) for o in dec.out)
    fields = {k: torch.tensor(v, dtype=TRACE_DTYPES[k]) for k, v in dec.rec.rows(n).items()}
    fields["gate_p"] = torch.sigmoid(fields["gate_p"])  # recorded as logits (NaN stays NaN)
    tr = DecodeTrace(**fields, tflops_rel=0.0, tflops_rel_exact=0.0, fallback=[False] * dec.B,
                     skip_granularity=dec.granularity)
    tr.tflops_rel, tr.tflops_rel_exact = dec.flops.relative(tr) if dec.spec is None else dec.spec.tflops(tr)
    scores = [torch.stack(s) for s in dec.scores] if dec.opts.output_scores else None
    return GenerationResult(seq, [list(o) for o in dec.out], tr, dict(dec.timings), scores,
                            None if dec.spec is None else dec.spec.stats())
