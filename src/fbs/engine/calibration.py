"""The calibration prompt of an int8 KV cache's key factors (:func:`fbs.engine.quant.key_factors`).

A model's decoder runs it once (a full-depth prefill with an fp32 cache) and keeps, per layer, KV head and rotary
channel pair, the largest key norm it saw. The text is this project's own: English prose, Chinese prose and Python
code, the three kinds of text the evaluations hold out, none of it drawn from them. Without a tokenizer (the tiny
random models of the tests) the prompt is seeded random token ids.
"""

from __future__ import annotations

import torch

TEXT = """\
A cache of keys and values lets a decoder attend to everything it has read without reading it again. Each new
token adds one entry per layer and head, and each step reads all of them, so at long context the cache, not the
weights, is what the memory bus carries. Storing the entries in eight bits halves that traffic again, but a key
whose few large channels set its scale leaves the small channels only a handful of levels. Those channels are the
same in every token, which is why a fixed factor per channel, chosen once, can even them out.

人们在阅读的时候，眼睛并不是一个字一个字地看，而是跳跃着前进。中央凹看清当前的词，旁边的区域则提前看到后面的内容，
于是大脑可以决定下一次跳到哪里，哪些词可以略过。一个好的模型也应该知道什么时候需要认真计算，什么时候可以少算一点。

def moving_average(values, window=3):
    \"\"\"The mean of each run of `window` consecutive values.\"\"\"
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    total, out = 0.0, []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""

#: token ids of the random calibration prompt (no tokenizer)
RANDOM_TOKENS = 256


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """The calibration prompt's token ids: :data:`TEXT` encoded, or without a tokenizer seeded random ids."""
    if tokenizer is not None:
        ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        return [i for i in ids if i < vocab_size]
    g = torch.Generator().manual_seed(0)
    return torch.randint(vocab_size, (RANDOM_TOKENS,), generator=g).tolist()
