"""Sampling: the engine's temperature / top-k / top-p against transformers' logits warpers, Bernoulli gates
(``gate_sampling``) against their probabilities, and seeded sampled requests through ``fbs serve``.

Oracles: ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` applied in the order HF's
``generate`` applies them; a replay of the seeded draws over the warped logits of each step; the binomial law
of the gate decisions given their recorded probabilities; the engine's own seeded ``generate`` for the server.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import fbs_tiny, randomize
from fbs.engine import DecodeOptions, Decoder
from fbs.engine.greedy import greedy_ids

TEMPERATURES = (0.6, 1.0, 1.7)
TOP_K = (0, 1, 7, 60)
TOP_P = (1.0, 0.93, 0.5, 0.02)


def hf_warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What HF's ``generate(do_sample=True)`` samples from: temperature, then top-k, then top-p."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)  # the warpers do not read the prompt
    for w in warpers:
        logits = w(ids, logits)
    return logits


def fbs_warp(logits: torch.Tensor, **opts) -> torch.Tensor:
    """The engine's sampling filter (``Decoder.warp``) under these options, on fixed logits."""
    return Decoder.warp(types.SimpleNamespace(opts=DecodeOptions(do_sample=True, **opts)), logits)


def fixed_logits() -> torch.Tensor:
    """Rows of different shapes: a peaked one, flat ones, a heavy tail, one dominant token (no exact ties)."""
    g = torch.Generator().manual_seed(11)
    v = 256
    rows = [torch.randn(v, generator=g) * s for s in (0.3, 1.0, 3.0, 8.0)]
    rows.append(torch.randn(v, generator=g).exp() * 2)      # skewed: a few large logits
    peak = torch.randn(v, generator=g) * 0.5
    peak[17] = 12.0                                          # one token holds nearly all the mass
    rows.append(peak)
    return torch.stack(rows)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("top_k", TOP_K)
@pytest.mark.parametrize("top_p", TOP_P)
def test_warp_equals_hf_logits_warpers(temperature, top_k, top_p):
    logits = fixed_logits()
    ref = hf_warp(logits.clone(), temperature, top_k, top_p)
    out = fbs_warp(logits.clone(), temperature=temperature, top_k=top_k, top_p=top_p)
    kept = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), kept)
    assert torch.equal(out[kept], ref[kept])
    # the cases are not vacuous: each filter removes tokens from every row
    n_kept = kept.sum(-1)
    assert (n_kept >= 1).all()
    if top_k:
        assert (n_kept <= top_k).all()
    if top_p < 1.0:
        assert (n_kept < logits.shape[-1]).all()
    if not top_k and top_p == 1.0:
        assert kept.all()


def test_sampled_tokens_are_draws_from_the_hf_warped_distribution(one_thread):
    """End to end: each sampled token is the seeded generator's next draw from softmax(HF-warped logits of that
    step), replayed from the step logits the engine reports (``output_scores``)."""
    model = fbs_tiny("qwen2", seed=3)
    with torch.no_grad():
        for p in model.base.hf.parameters():  # matrices at std 0.2: flat enough next-token distributions to sample
            if p.dim() == 2:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    prompts = [[5, 9, 200, 31, 7], [44, 2, 3]]
    opts = dict(temperature=0.8, top_k=40, top_p=0.9)
    res = model.generate(prompts, max_new_tokens=24, ignore_eos=True, do_sample=True, seed=1234, output_scores=True,
                         force_compute=True, **opts)
    gen = torch.Generator().manual_seed(1234)
    replay = [[] for _ in prompts]
    for step in range(24):  # every row is active at every step (EOS ignored): one draw of both rows per step
        logits = torch.stack([res.scores[r][step] for r in range(len(prompts))])
        probs = hf_warp(logits, opts["temperature"], opts["top_k"], opts["top_p"]).softmax(-1)
        for r, t in enumerate(torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()):
            replay[r].append(t)
    assert res.new_tokens == replay
    greedy = model.generate(prompts, max_new_tokens=24, ignore_eos=True, force_compute=True).new_tokens
    assert res.new_tokens != greedy  # sampling is not greedy here: the replay compares real draws


def test_sampling_options_are_validated():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        DecodeOptions(do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be > 0 when sampling, got 0"):
        DecodeOptions(do_sample=True, temperature=0.0)


def test_gate_sampling_skips_with_the_gate_probability(one_thread):
    """Bernoulli gates: over every gated decision of a seeded run, the number of skips is the sum of the
    recorded probabilities within 5 binomial standard deviations, overall and in each probability band; the
    decisions are not the threshold's (some skip below p = 0.5, some run above)."""
    model = randomize(fbs_tiny("llama", seed=2), seed=4, scale=0.2)
    prompts = torch.randint(0, 255, (8, 8), generator=torch.Generator().manual_seed(9))
    res = model.generate(prompts, max_new_tokens=80, ignore_eos=True, gate_sampling=True, seed=77)
    tr = res.trace
    gated = list(model.layers_cfg.gated)
    valid = tr.valid.unsqueeze(-1).expand_as(tr.gate_p)[..., gated]
    p = tr.gate_p[..., gated][valid].double()
    skip = tr.intended_skip[..., gated][valid].double()
    assert not torch.isnan(p).any() and p.numel() == 8 * 79 * len(gated)  # the last token is never consumed
    var = (p * (1 - p)).sum().item()
    assert var > 100, "the gates must be uncertain for the test to have power"
    assert abs(skip.sum().item() - p.sum().item()) <= 5 * math.sqrt(var)
    for lo, hi in ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)):
        band = (p >= lo) & (p < hi)
        v = (p[band] * (1 - p[band])).sum().item()
        assert band.sum() >= 50, f"too few decisions with p in [{lo}, {hi})"
        assert abs(skip[band].sum().item() - p[band].sum().item()) <= 5 * math.sqrt(v) + 1e-9, (lo, hi)
    assert skip[p < 0.5].sum() > 0 and (1 - skip[p > 0.5]).sum() > 0
    again = model.generate(prompts, max_new_tokens=80, ignore_eos=True, gate_sampling=True, seed=77)
    assert torch.equal(again.trace.intended_skip, tr.intended_skip)  # seeded: the same draws


# --------------------------------------------------------------------------- through the server
def test_seeded_sampled_requests_through_serve_are_reproducible(one_thread):
    """A seeded sampled request gets the text of the engine's seeded ``generate``, alone or while other
    requests share the batch; another seed gives another text."""
    import threading

    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from test_serve import NAME, _ids, tiny_model

    from fbs.serve.app import ServerThread, create_app
    from fbs.serve.batcher import Limits

    model = tiny_model()
    ids = _ids(40, 9)
    sample = dict(temperature=0.9, top_p=0.95)
    ref = model.generate([ids], max_new_tokens=30, ignore_eos=True, do_sample=True, seed=5, **sample)
    text = model.tokenizer.decode(ref.new_tokens[0], skip_special_tokens=True)
    other = model.generate([ids], max_new_tokens=30, ignore_eos=True, do_sample=True, seed=6, **sample)
    assert other.new_tokens != ref.new_tokens
    with ServerThread(create_app(model, model.tokenizer, NAME, Limits(max_concurrent=3, context_length=256))) as srv:
        cl = openai.OpenAI(base_url=srv.url, api_key="test", max_retries=0, timeout=120)

        def ask(seed, prompt=ids):
            return cl.completions.create(model=NAME, prompt=prompt, max_tokens=30, seed=seed,
                                         extra_body={"ignore_eos": True}, **sample).choices[0].text

        assert ask(5) == text and ask(5) == text
        assert ask(6) == model.tokenizer.decode(other.new_tokens[0], skip_special_tokens=True) != text
        results = {}
        jobs = [(5, ids), (8, _ids(41, 12)), (5, ids), (9, _ids(42, 5))]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(*jobs[i]))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results[0] == results[2] == text


def test_greedy_ids_are_torch_argmax_on_ties_nan_and_infinities():
    """The greedy choice (NumPy on CPU) against torch.argmax: the first maximal index, NaN counted as maximal, on hand
    cases and on random rows of a vocabulary's width, for 1-d, 2-d and strided inputs."""
    nan, inf = float("nan"), float("inf")
    hand = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [-inf] * 4, [0.0, inf, inf, 1.0]])
    assert greedy_ids(hand) == [1, 0, 0, 1] == hand.argmax(-1).tolist()
    wide = torch.randn(8, 49152, generator=torch.Generator().manual_seed(0))
    wide[3, 100] = wide[3, 200] = wide[3].max() + 1  # a tie: the first index
    with torch.inference_mode():
        assert greedy_ids(wide) == wide.argmax(-1).tolist()
        assert greedy_ids(wide[:, ::3]) == wide[:, ::3].argmax(-1).tolist()
        assert greedy_ids(wide[5]) == int(wide[5].argmax())
    assert greedy_ids(wide.double()) == wide.argmax(-1).tolist()  # other dtypes: torch's own argmax
