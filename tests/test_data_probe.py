"""Probe-on-hidden-states on a tiny random causal LM (no model files), and the CLI wiring."""

import argparse

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fbs.data.metrics import B, I, IGNORE_INDEX, O, S
from fbs.data.probe import (IdiomItem, ProbeConfig, hidden_features, idiom_accuracy, inverse_frequency_weights,
                            run_probe)


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def synthetic(n, seed):
    """Token 5 always starts a 3-token chunk, token 6 is a single-token chunk, others are O."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(n):
        ids, labels = [], []
        while len(ids) < 24:
            r = int(torch.randint(0, 4, (1,), generator=g))
            if r == 0:
                ids += [5, 7, 8]
                labels += [B, I, I]
            elif r == 1:
                ids.append(6)
                labels.append(S)
            else:
                ids.append(int(torch.randint(10, 60, (1,), generator=g)))
                labels.append(O)
        data.append((ids[:24], labels[:24]))
    return data


def test_inverse_frequency_weights():
    w = inverse_frequency_weights([[O, O, O, B, I, IGNORE_INDEX]])
    # N = 5, C = 4: O -> 5/12, B and I -> 5/4, S absent -> 0
    assert torch.allclose(w, torch.tensor([5 / 4, 5 / 4, 5 / 12, 0.0]))


def test_hidden_features_padding_invariant(tiny_lm):
    a, b = [1, 2, 3], [4, 5, 6, 7, 8]
    together = hidden_features(tiny_lm, [a, b], layer=1, batch_size=2)
    alone = hidden_features(tiny_lm, [a], layer=1, batch_size=1)
    assert together[0].shape == (3, 32)
    torch.testing.assert_close(together[0], alone[0], rtol=1e-4, atol=1e-5)


def test_probe_learns_synthetic_chunks(tiny_lm):
    cfg = ProbeConfig(layer=2, epochs=30, batch_size=8, lr=1e-2)
    train = synthetic(64, 0)
    # item 1: a training prefix whose first chunk is the gold span; item 2: gold span is no chunk
    items = [IdiomItem(train[0][0][:4], (0, 3), "x"), IdiomItem([11, 12, 13, 6], (1, 3), "y")]
    assert train[0][1][:4] == [B, I, I, O]
    res = run_probe(tiny_lm, train, synthetic(16, 1), items, cfg)
    assert res.layer == 2 and res.n_train_sequences == 64 and res.n_eval_sequences == 16
    assert res.train_loss[-1] < res.train_loss[0]
    assert res.bios["bios_f1"] > 0.8  # the chunks are a function of the tokens: recoverable
    assert res.idiom_accuracy == pytest.approx(0.5)  # first item recognisable, second is not a chunk
    assert all(p.requires_grad is False for p in tiny_lm.parameters())


def test_idiom_accuracy_uses_chunk_parsing():
    items = [IdiomItem([0] * 5, (1, 4), "a"), IdiomItem([0] * 5, (1, 4), "b"), IdiomItem([0] * 5, (2, 3), "c")]
    preds = [[O, B, I, I, O], [O, B, I, I, I], [O, I, S, O, O]]  # exact, too long, S after invalid I
    assert idiom_accuracy(preds, items) == pytest.approx(2 / 3)


def test_cli_register_and_clear_errors(tmp_path, capsys):
    from fbs.data import cli

    parser = argparse.ArgumentParser(prog="fbs")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", "build", "--out", str(tmp_path), "--sources", "wiki_demo,nope"])
    assert args.func is cli.cmd_build
    assert args.func(args) == 2
    assert "unknown source 'nope'" in capsys.readouterr().err
    args = parser.parse_args(["data", "label", "--corpus", str(tmp_path / "none"), "--no-pkuseg", "--no-idioms",
                              "--tokenizer", "none"])
    assert args.func(args) == 2
    assert "build the corpus first" in capsys.readouterr().err
    assert parser.parse_args(["probe", "--corpus", str(tmp_path)]).func is cli.cmd_probe


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_hidden_features_early_stop_matches_full_forward(tiny_lm, layer):
    """The truncated forward (hook + stop after block layer-1) returns HF's hidden_states[layer]."""
    seqs = [[1, 2, 3, 4], [5, 6]]
    hooks = {i: dict(block._forward_hooks) for i, block in enumerate(tiny_lm.model.layers)}
    got = hidden_features(tiny_lm, seqs, layer=layer, batch_size=2)
    with torch.no_grad():
        ref = tiny_lm(torch.tensor([seqs[0]]), output_hidden_states=True).hidden_states[layer][0]
    torch.testing.assert_close(got[0], ref, rtol=1e-5, atol=1e-6)
    assert hooks == {i: dict(block._forward_hooks) for i, block in enumerate(tiny_lm.model.layers)}  # hook removed


def test_hidden_features_stops_early(tiny_lm):
    """At layer 1 of 2 the second block never runs."""
    calls = []
    h = tiny_lm.model.layers[1].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        hidden_features(tiny_lm, [[1, 2, 3]], layer=1)
        assert calls == []
        hidden_features(tiny_lm, [[1, 2, 3]], layer=2)
        assert calls == [1]
    finally:
        h.remove()


@pytest.mark.parametrize("layer", [1, 3, 6])
def test_fbs_hidden_features_are_the_full_forwards_states(one_thread, layer):
    """`fbs probe --checkpoint`: the truncated, padded FBS forward returns hidden_states[layer] of the full
    gate-off forward of each sequence alone (PAW at layer 1 and CH at layer 3 of the tiny config included)."""
    from conftest import fbs_tiny, randomize

    from fbs.data.probe import fbs_hidden_features

    model = randomize(fbs_tiny())
    seqs = [[5, 9, 3, 7, 1, 2, 8, 4, 4], [4, 6, 2]]
    got = fbs_hidden_features(model, seqs, layer, batch_size=2)
    for s, g in zip(seqs, got):
        with torch.no_grad():
            ref = model(torch.tensor([s]), gate_mode="off", output_hidden_states=True).hidden_states[layer][0]
        assert g.shape == ref.shape
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)


def test_probe_trains_on_an_fbs_model(one_thread):
    """run_probe with FBS features: the middle layer by default (num_layers // 2), and the probe learns the
    synthetic chunks through the FBS model's states as it does through an HF model's."""
    from conftest import fbs_tiny, randomize

    from fbs.data.probe import fbs_hidden_features

    model = randomize(fbs_tiny())
    res = run_probe(model, synthetic(48, 0), synthetic(16, 1), config=ProbeConfig(epochs=30, batch_size=8, lr=1e-2),
                    features=fbs_hidden_features)
    assert res.layer == 3
    assert res.bios["per_class_f1"]["S"] > 0.9 and res.bios["bios_f1"] > 0.8
    with pytest.raises(ValueError, match="outside 1..6"):
        fbs_hidden_features(model, [[1, 2]], 7)
