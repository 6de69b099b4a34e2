"""The decoding engine: prefill, then one token per step with true layer skipping.

    from fbs.engine import DecodeOptions, generate, stream
    result = generate(model, input_ids, max_new_tokens=64, tau=0.7)   # GenerationResult: tokens, trace, timings

Modules: :mod:`.decoder` (options, trace, the per-call decoder and its decode step), :mod:`.loop` (the decode
loop: start, run, finish, generate, stream), :mod:`.cache` (the KV
cache and its layer-step context), :mod:`.fused` (the linear algebra of a step: HF modules or fused weight
copies), :mod:`.quant` (weight formats), :mod:`.flops` (the cost model of a decode), :mod:`.speculative`
(lossless speculative decoding: one verifier), :mod:`.drafts` (its draft sources and their registry).

Driving a decoder step by step (the server's batcher and speculative decoding do): :func:`start` builds a
:class:`Decoder` for prompts and options, :func:`run` yields its tokens step by step, :func:`finish` turns it into
a :class:`GenerationResult`. A decoder's documented surface is :meth:`Decoder.prefill`,
:meth:`Decoder.decode_step`, :meth:`Decoder.context`, :meth:`Decoder.pick` / :meth:`Decoder.finished` and its
per-row state (``prompts``, ``out``, ``active``, ``rec``: a :class:`TraceRecorder`).
"""

from .decoder import (CAPACITY_STEP, VALIDATORS, DecodeOptions, Decoder, DecodeTrace, GenerationResult, StepOutput,
                      TraceRecorder)
from .loop import finish, generate, run, start, stream

__all__ = ["CAPACITY_STEP", "VALIDATORS", "DecodeOptions", "DecodeTrace", "Decoder", "GenerationResult", "StepOutput",
           "TraceRecorder", "finish", "generate", "run", "start", "stream"]
