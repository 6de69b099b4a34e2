"""The decoding engine: prefill, then one token per step with true layer skipping.

    from fbs.engine import DecodeOptions, generate, stream
    result = generate(model, input_ids, max_new_tokens=64, tau=0.7)   # GenerationResult: tokens, trace, timings

Modules: :mod:`.decoder` (options, trace, the per-call decoder and the decode loop), :mod:`.cache` (the KV
cache and its layer-step context), :mod:`.fused` (the linear algebra of a step: HF modules or fused weight
copies), :mod:`.quant` (weight formats), :mod:`.flops` (the cost model of a decode), :mod:`.speculative`
(lossless self-drafting).
"""

from .decoder import (CAPACITY_STEP, VALIDATORS, DecodeOptions, DecodeTrace, GenerationResult, StepOutput,
                      _Decoder, _finish, _run, _start, _TraceRecorder, generate, stream)

__all__ = ["CAPACITY_STEP", "VALIDATORS", "DecodeOptions", "DecodeTrace", "GenerationResult", "StepOutput",
           "generate", "stream"]
