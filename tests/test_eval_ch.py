"""`fbs eval ch`: the trained chunk head scored with the probe's data and metrics (tiny random models, no files)."""

import argparse
import json

import pytest
import torch
from conftest import fbs_tiny, randomize, tiny_config, tiny_hf
from test_data_corpus import char_tokenizer, zh_segmenter

from fbs.data.metrics import B, I, IGNORE_INDEX, O, S
from fbs.data.probe import IdiomItem
from fbs.eval import chunks

CH = 3  # the CH layer of conftest.tiny_config


class ForcedBios(torch.nn.Module):
    """Stands in for a CH's BIOS head: logits that make position t's argmax ``pattern[t]``, whatever the input."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern = torch.tensor(pattern)

    def forward(self, xn):
        b, t, _ = xn.shape
        return torch.nn.functional.one_hot(self.pattern[:t], 4).to(xn.dtype).expand(b, t, 4) * 5.0


@pytest.fixture
def model(one_thread):
    return randomize(fbs_tiny())


def test_logits_are_the_full_forwards_and_padding_free(model):
    """The truncated forward returns the CH logits of the full gate-off forward; padding changes nothing."""
    seqs = [[5, 9, 3, 7, 1, 2, 8], [4, 4, 6]]
    got = chunks.ch_bios_logits(model, seqs, CH, batch_size=2)
    for s, g in zip(seqs, got):
        with torch.no_grad():
            ref = model(torch.tensor([s]), gate_mode="off").bios_logits[0, 0]  # (T, 4)
        assert g.shape == (len(s), 4)
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)


def test_forced_predictions_give_the_hand_computed_scores(model):
    model.ch[str(CH)].bios = ForcedBios([B, I, O, B, S, B, I, I])
    gold = [B, I, I, O, S, B, I, O]
    # per position (gold/pred): B/B, I/I, I/O, O/B, S/S, B/B, I/I, O/I
    # B: tp 2 fp 1 fn 0 -> F1 0.8; I: tp 2 fp 1 fn 1 -> 2/3; O: tp 0 fp 1 fn 2 -> 0; S: 1 -> macro 37/60
    # boundaries: predicted {0, 3, 4, 5}, gold {0, 4, 5} -> P 3/4, R 1, F1 6/7
    items = [IdiomItem([1, 2, 3], (0, 2), "exact B I"), IdiomItem([1, 2, 3, 4, 5, 6], (3, 5), "B S: two chunks")]
    res = chunks.run_ch(model, [([5, 9, 3, 7, 1, 2, 8, 6], gold)], items)
    assert res.layer == CH and res.n_eval_sequences == 1 and res.n_idiom_items == 2
    assert res.bios["bios_f1"] == pytest.approx(37 / 60)
    assert res.bios["per_class_f1"] == pytest.approx({"B": 0.8, "I": 2 / 3, "O": 0.0, "S": 1.0}, abs=1e-9)
    assert (res.bios["boundary_precision"], res.bios["boundary_recall"]) == pytest.approx((0.75, 1.0))
    assert res.bios["boundary_f1"] == pytest.approx(6 / 7)
    assert res.idiom_accuracy == pytest.approx(0.5)
    # ignored gold positions count nowhere
    res = chunks.run_ch(model, [([5, 9, 3, 7], [B, I, IGNORE_INDEX, IGNORE_INDEX])])
    assert res.bios["n_tokens"] == 2 and res.bios["boundary_f1"] == pytest.approx(1.0)
    assert res.idiom_accuracy is None


def test_layer_choice_and_no_ch_error(one_thread):
    m = fbs_tiny(ch_layers=(2, -2))
    assert chunks.resolve_ch_layer(m) == 2 and chunks.resolve_ch_layer(m, -2) == 4
    with pytest.raises(ValueError, match=r"layer 3 carries no CH; the CH layers are \[2, 4\]"):
        chunks.resolve_ch_layer(m, 3)
    with pytest.raises(ValueError, match="no CH layers"):
        chunks.run_ch(fbs_tiny(ch_layers=()), [([1, 2], [B, I])])


# --------------------------------------------------------------------------- CLI, end to end


def _docs():
    from fbs.data.sources import Document

    zh = ["他做事一丝不苟，我们工作认真。" * 4, "我们坚持解放思想，实事求是。" * 4, "我们工作认真，坚持实事求是。" * 4]
    return [Document("zh_src", f"z{i}", "zh", t) for i, t in enumerate(zh)]


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A base-model directory (tiny Llama + character tokenizer), an FBS checkpoint over it, a labelled corpus."""
    pytest.importorskip("datasketch")
    from fbs import FBSForCausalLM
    from fbs.data import sources
    from fbs.data.bios import IdiomLexicon
    from fbs.data.corpus import CorpusConfig, build_corpus, label_corpus

    tok = char_tokenizer([d.text for d in _docs()] + ["一丝不苟"])
    base = tmp_path / "base"
    tiny_hf().save_pretrained(base)
    tok.save_pretrained(base)
    randomize(FBSForCausalLM.from_base(str(base), config=tiny_config())).save_pretrained(tmp_path / "ckpt")
    FBSForCausalLM.from_base(str(base), config=tiny_config(ch_layers=())).save_pretrained(tmp_path / "no_ch")
    corpus = tmp_path / "corpus"
    build_corpus(corpus, tok, "char", CorpusConfig(min_tokens=10, val_fraction=0.0, test_fraction=0.0),
                 documents=_docs())
    pairs = [("他做事一丝不苟。", "一丝不苟"), ("我们实事求是。", "实事求是")]
    monkeypatch.setattr(sources, "load_idiom_examples", lambda root=None: pairs)
    return tmp_path, base, corpus, lambda: label_corpus(corpus, zh_segmenter, IdiomLexicon(["一丝不苟"]), tok,
                                                       splits=("train",))


def _main(argv):
    from fbs.eval import cli

    parser = argparse.ArgumentParser(prog="fbs")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_end_to_end_and_clear_errors(files, capsys, one_thread):
    tmp, base, corpus, label = files
    opts = ["eval", "ch", "--model", str(base), "--corpus", str(corpus), "--eval-split", "train", "--seq-len", "32",
            "--eval-seqs", "3", "--idiom-items", "2", "--no-progress"]
    assert _main(opts + ["--checkpoint", str(tmp / "ckpt")]) == 2  # not labelled yet
    assert "run `fbs data label" in capsys.readouterr().err
    label()
    assert _main(opts + ["--checkpoint", str(tmp / "no_ch")]) == 2
    assert "no CH layers" in capsys.readouterr().err
    assert _main(opts) == 2  # a local base directory has no shipped weights
    assert "pass --checkpoint" in capsys.readouterr().err

    out = tmp / "res" / "ch.json"
    assert _main(opts + ["--checkpoint", str(tmp / "ckpt"), "--out", str(out), "--note", "tiny"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"trained CH, layer {CH}: BIOS-F1 ") and "(eval 3 seqs / " in line and "2 idiom items" in line
    rec = json.loads(out.read_text())
    assert rec["predictor"] == "trained CH" and rec["checkpoint"] == str(tmp / "ckpt") and rec["note"] == "tiny"
    assert (rec["layer"], rec["ch_layers"], rec["n_eval_sequences"], rec["n_idiom_items"]) == (CH, [CH], 3, 2)
    assert (rec["eval_split"], rec["seq_len"], rec["model"]) == ("train", 32, str(base))
    # the probe record's evaluation fields, and the numbers of the library path on the same data
    from fbs.model.loading import load_fbs

    model = load_fbs(str(base), tmp / "ckpt")
    evaluation, items = chunks.probe_eval_data(corpus, "train", model.tokenizer, 32, 3, 2, 0)
    assert sorted(len(it.ids) for it in items) == [7, 8] and len(evaluation) == 3
    res = chunks.run_ch(model, evaluation, items)
    assert rec["bios"] == res.bios and rec["idiom_accuracy"] == res.idiom_accuracy
    assert 0.0 <= rec["bios"]["bios_f1"] <= 1.0 and 0 < rec["bios"]["n_tokens"] <= 96
