"""llama.cpp as a bench system: the adapter's protocol on a scripted Llama double; the real build (slow)."""

from __future__ import annotations

import pytest
import torch

from fbs.bench import systems
from fbs.bench.harness import BenchConfig, measure
from fbs.bench.systems import LlamaCppSystem, vocab_agreement

V = 50


def next_token(t: int) -> int:  # the double's "greedy argmax" given the last evaluated token
    return (7 * t + 3) % V


class FakeLlama:
    """Scripted stand-in for llama_cpp.Llama: records calls, 'samples' next_token(last evaluated token)."""

    instances: list["FakeLlama"] = []

    def __init__(self, model_path, n_ctx, n_threads, n_batch, verbose, n_vocab=V):
        self.kwargs = dict(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)
        self.vocab_size = n_vocab
        self.calls: list[tuple] = []
        self.tokens: list[int] = []
        self.closed = False
        FakeLlama.instances.append(self)

    def n_vocab(self) -> int:
        return self.vocab_size

    def detokenize(self, ids, special=False):
        return b"" if ids[0] == 3 else f"<{ids[0]}>".encode()  # id 3 renders empty, as 47 ids do in SmolLM2

    def reset(self):
        self.calls.append(("reset",))
        self.tokens = []

    def eval(self, tokens):
        assert len(self.tokens) + len(tokens) <= self.kwargs["n_ctx"]
        self.calls.append(("eval", list(tokens)))
        self.tokens += list(tokens)

    def sample(self, temp=0.8, **kw):
        self.calls.append(("sample", temp))
        return next_token(self.tokens[-1])

    def close(self):
        self.closed = True


class FakeTokenizer:
    def __len__(self):
        return V

    def decode(self, ids):
        return f"<{ids[0]}>"


@pytest.fixture(autouse=True)
def fresh_instances():
    FakeLlama.instances.clear()


def fake_system(**kw) -> LlamaCppSystem:
    return LlamaCppSystem("/models/x.gguf", FakeTokenizer(), n_threads=2, llama_factory=FakeLlama, **kw)


def test_greedy_exactly_n_tokens_fed_back_one_by_one():
    sys_ = fake_system()
    assert sys_.unavailable(1) == ""
    ids = torch.tensor([[5, 9, 11]])
    out = sys_.generate(ids, 4, probe=True)
    want, t = [], 11
    for _ in range(4):
        t = next_token(t)
        want.append(t)
    assert out.sequences.tolist() == [[5, 9, 11] + want]
    llm = FakeLlama.instances[-1]
    # the prompt once, then each new token except the last; every sample greedy
    assert [c for c in llm.calls if c[0] == "eval"] == [("eval", [5, 9, 11])] + [("eval", [w]) for w in want[:-1]]
    assert {c[1] for c in llm.calls if c[0] == "sample"} == {0.0}
    assert llm.calls[0] == ("reset",)
    assert out.prefill_s >= 0 and out.decode_s >= 0
    assert llm.kwargs == dict(model_path="/models/x.gguf", n_ctx=256, n_threads=2, n_batch=512)  # from unavailable()
    assert out.stats["vocab_pieces_differ"] == 1  # id 3 renders differently
    assert out.stats["generated_pieces_differ"] == sum(w == 3 for w in want)


def test_engine_rebuilt_only_for_a_longer_context_and_closed():
    sys_ = fake_system()
    sys_.unavailable(1)  # loads the engine once to check the vocabulary
    first = FakeLlama.instances[-1]
    sys_.generate(torch.tensor([[1] * 300]), 5)
    assert len(FakeLlama.instances) == 2 and first.closed and FakeLlama.instances[-1].kwargs["n_ctx"] == 305
    sys_.generate(torch.tensor([[1] * 4]), 5)  # shorter: reuses the engine, reset before the run
    assert len(FakeLlama.instances) == 2
    assert FakeLlama.instances[-1].calls.count(("reset",)) == 2
    sys_.close()
    assert FakeLlama.instances[-1].closed


def test_batch_one_only():
    sys_ = fake_system()
    assert "batch size 1" in sys_.unavailable(2)
    with pytest.raises(ValueError, match="batch size 1"):
        sys_.generate(torch.tensor([[1, 2], [3, 4]]), 3)


def test_a_different_vocabulary_is_reported_not_compared():
    factory = lambda **kw: FakeLlama(**kw, n_vocab=V + 1)  # noqa: E731
    sys_ = LlamaCppSystem("/models/x.gguf", FakeTokenizer(), llama_factory=factory)
    assert "vocabulary" in sys_.unavailable(1)
    assert vocab_agreement(FakeLlama("p", 8, 1, 8, False), FakeTokenizer())["differing_ids"] == [3]


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(systems, "_llama_class", lambda: None)
    reason = LlamaCppSystem("/models/x.gguf", FakeTokenizer()).unavailable(1)
    assert "llama-cpp-python is not installed" in reason and "FBS_BENCH_LLAMA_CPP=1" in reason


def test_no_gguf_for_a_non_bundled_base():
    reason = systems.llama_cpp_system("/some/hf/dir", FakeTokenizer()).unavailable(1)
    assert "GGUF" in reason


def test_runs_under_the_harness_protocol():
    prompts = torch.randint(0, V, (2, 6))
    res = measure(fake_system(), prompts, BenchConfig(prompt_len=6, new_tokens=5, warmup=1, runs=2, num_prompts=2))
    assert res.status == "ok", res.note
    assert res.outputs.shape == (2, 5) and res.decode_s.median >= 0
    assert res.outputs[:, 0].tolist() == [next_token(int(t)) for t in prompts[:, -1]]


@pytest.mark.slow
def test_real_llama_cpp_on_the_shipped_gguf():
    """The real build on SmolLM2's Q4_1 GGUF: same vocabulary as the HF tokenizer, and the first greedy token of
    a factual prompt agrees with HF generate's on the dequantized weights."""
    pytest.importorskip("llama_cpp")
    from fbs.model.bases import load_base

    model, tok = load_base("smollm2-135m")
    sys_ = systems.llama_cpp_system("smollm2-135m", tok, n_threads=2)
    assert sys_.unavailable(1) == ""
    assert sys_.vocab["same_size"] and len(sys_.vocab["differing_ids"]) < 100
    ids = torch.tensor([tok("The capital of France is", add_special_tokens=False)["input_ids"]])
    out = sys_.generate(ids, 6, probe=True)
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                        do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.sequences.shape == hf.shape == (1, ids.shape[1] + 6)
    assert out.sequences[0, ids.shape[1]] == hf[0, ids.shape[1]]  # " Paris"
    sys_.close()
