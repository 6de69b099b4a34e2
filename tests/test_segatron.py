"""The Segatron-style baseline (:mod:`fbs.baselines.segatron`) and its recipe (:mod:`fbs.train.segatron`).

Oracles: paragraph / sentence / token indices computed by hand for a hand-made token sequence; the indices of
every prefix (causality); the base model's own logits (a fresh model is the base, bit for bit); the model the
checkpoint was written from; an uninterrupted run (resume)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, tiny_hf
from fbs.baselines.segatron import (MANIFEST_NAME, WEIGHTS_NAME, Segatron, SegatronConfig, SegatronError,
                                    segment_indices, token_bytes_table)

# id -> bytes of a hand-made vocabulary; every other id is the letter "x"
PIECES = {0: b"\n", 1: b"Hello", 2: b" world", 3: b".", 4: b" Next", 5: b"\n", 6: "。".encode(), 7: "中".encode(),
          8: "。".encode()[:2], 9: "。".encode()[2:], 10: b".\n", 11: b"3", 12: b"!", 13: b" ", 14: "！".encode(),
          15: "？".encode()}
TABLE = [PIECES.get(i, b"x") for i in range(VOCAB)]

SEQ = [1, 2, 3, 4, 2, 10, 7, 6, 7, 8, 9, 7, 5, 5, 1, 12, 13, 1]
# Hand-derived. "Hello world." | " Next world.\n" (the ". " boundary starts " Next"; the "." + "\n" inside token 10
# ends a sentence from the next token, whose first byte also follows the newline: a new paragraph) | "中。" |
# "中" + "。" split over two tokens | "中\n\n" (two newlines: one paragraph break) | "Hello!" | " Hello".
PAR = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]
SEN = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 2, 2, 2, 0, 0, 1, 1]
TOK = [0, 1, 2, 0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 2, 0, 1, 0, 1]


def tiny_segatron(seed: int = 0, base_seed: int = 0, randomize: bool = False, **cfg) -> Segatron:
    torch.manual_seed(seed)
    model = Segatron.from_base(tiny_hf("llama", layers=4, seed=base_seed), SegatronConfig(**cfg), token_bytes=TABLE)
    if randomize:  # non-zero tables and LoRA, so both change the output
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(("paragraph.", "sentence.", "position.")) or "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def test_indices_of_a_hand_made_sequence():
    assert segment_indices(SEQ, TABLE) == (PAR, SEN, TOK)
    model = tiny_segatron(max_paragraphs=2, max_sentences=2, max_tokens=2)  # clipped to the last row
    idx = model.indices(torch.tensor([SEQ, SEQ]))
    assert idx.shape == (2, len(SEQ), 3)
    assert idx[1, :, 0].tolist() == [min(p, 1) for p in PAR]
    assert idx[0, :, 1].tolist() == [min(s, 1) for s in SEN] and idx[0, :, 2].tolist() == [min(k, 1) for k in TOK]


def test_full_width_terminators_and_ascii_without_whitespace():
    # "中！中？中" -> three sentences; "3.3" and "x.x" do not end a sentence (no whitespace after the point)
    assert segment_indices([7, 14, 7, 15, 7], TABLE)[1] == [0, 0, 1, 1, 2]
    assert segment_indices([11, 3, 11, 20, 3, 20], TABLE)[1] == [0] * 6


def test_indices_are_causal_on_random_streams():
    """The indices of every prefix equal the first entries of the whole sequence's indices."""
    rng = random.Random(0)
    for _ in range(30):
        seq = [rng.choice([*PIECES, 20, 21]) for _ in range(40)]
        whole = segment_indices(seq, TABLE)
        for t in range(1, len(seq) + 1):
            assert segment_indices(seq[:t], TABLE) == tuple(x[:t] for x in whole)


def test_output_at_t_ignores_later_tokens():
    model = tiny_segatron(randomize=True)
    g = torch.Generator().manual_seed(5)
    boundary = torch.tensor([0, 3, 5, 6, 10, 12, 13, 14, 15])
    a = torch.randint(16, 40, (1, 24), generator=g)
    b = a.clone()
    b[0, 12:] = boundary[torch.randint(0, len(boundary), (12,), generator=g)]  # paragraph / sentence ends after t
    assert not torch.equal(model.indices(a)[0, 12:], model.indices(b)[0, 12:])
    with torch.no_grad():
        la, lb = model(a).logits, model(b).logits
    torch.testing.assert_close(la[0, :12], lb[0, :12], rtol=0, atol=1e-6)
    assert (la[0, 12:] - lb[0, 12:]).abs().max() > 1e-2  # the later tokens do change later outputs


def test_fresh_model_is_the_base_exactly():
    base = tiny_hf("llama", layers=4, seed=0)
    ids = torch.tensor([SEQ, list(reversed(SEQ))])
    for rank in (8, 0):
        model = tiny_segatron(lora_rank=rank)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, base(ids).logits)
        assert model.trainable_counts()["segment_tables"] == (64 + 128 + 512) * 64
        assert (model.trainable_counts()["lora"] > 0) == (rank > 0)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    model = tiny_segatron(randomize=True)
    ids = torch.tensor([SEQ])
    path = model.save_pretrained(tmp_path / "ckpt", {"note": "test"})
    assert json.loads((path / "segatron_config.json").read_text())["extra"] == {"note": "test"}
    assert not list(path.glob(".tmp-*"))
    base = tiny_hf("llama", layers=4, seed=0)
    with pytest.raises(SegatronError, match="needs a tokenizer or a token_bytes table"):
        Segatron.from_pretrained(path, base)
    with torch.no_grad():
        want = model(ids).logits
    loaded = _load(path, tiny_hf("llama", layers=4, seed=0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)

    with pytest.raises(SegatronError, match="trained on other base weights"):
        _load(path, tiny_hf("llama", layers=4, seed=1))
    cfg = json.loads((path / "segatron_config.json").read_text())
    (path / "segatron_config.json").write_text(json.dumps({**cfg, "base_fingerprint": None}))
    with pytest.raises(SegatronError, match="records no base_fingerprint"):
        _load(path, tiny_hf("llama", layers=4, seed=0))
    assert torch.equal(_load(path, tiny_hf("llama", layers=4, seed=1), check_base=False).paragraph.weight,
                       model.paragraph.weight)
    data = bytearray((path / WEIGHTS_NAME).read_bytes())
    data[-1] ^= 1
    (path / WEIGHTS_NAME).write_bytes(bytes(data))
    with pytest.raises(SegatronError, match="does not match its integrity record"):
        _load(path, tiny_hf("llama", layers=4, seed=0))
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(SegatronError, match="no integrity record"):
        _load(path, tiny_hf("llama", layers=4, seed=0))
    with pytest.raises(SegatronError, match="is not a Segatron checkpoint"):
        Segatron.from_pretrained(tmp_path / "nothing")


def _load(path: Path, base, check_base: bool = True) -> Segatron:
    """``from_pretrained`` with the hand-made byte table standing in for a tokenizer."""
    return Segatron.from_pretrained(path, base, _TableTokenizer(), check_base=check_base)


class _TableTokenizer:
    """The smallest tokenizer :func:`token_bytes_table` reads: byte-level BPE pieces spelling :data:`TABLE`."""

    all_special_ids: list[int] = []

    def __len__(self) -> int:
        return VOCAB

    def convert_ids_to_tokens(self, ids):
        from fbs.baselines.segatron import _bytes_to_unicode

        spell = _bytes_to_unicode()
        return ["".join(spell[b] for b in TABLE[i]) for i in ids]


def test_token_bytes_of_byte_level_and_sentencepiece_pieces():
    class Tok:
        all_special_ids = [3]

        def __len__(self):
            return 6

        def convert_ids_to_tokens(self, ids):
            return ["Ġworld", "ãĢĤ", "▁the", "<eos>", "<0x0A>", "中"][: len(ids)]

    # byte-level: "Ġ" is a space, "ãĢĤ" the three bytes of "。"; SentencePiece: "▁" a space, <0x0A> a newline;
    # the special token and the ids past the tokenizer's vocabulary count as a newline
    assert token_bytes_table(Tok(), 8) == [b" world", "。".encode(), b" the", b"\n", b"\n", "中".encode(), b"\n",
                                           b"\n"]


# --------------------------------------------------------------------------- the recipe


def _run(out: Path, steps: int, model: Segatron, resume: bool = True) -> dict:
    from fbs.train.data import BlockData
    from fbs.train.segatron import SegatronTrainConfig, train

    g = torch.Generator().manual_seed(0)
    data = BlockData(torch.randint(0, VOCAB, (6, 16), generator=g), None,
                     torch.randint(0, VOCAB, (2, 16), generator=g), None)
    cfg = SegatronTrainConfig(out_dir=str(out), max_steps=steps, block_size=16, batch_tokens=64, micro_batch_size=2,
                              eval_every=0, save_every=1, progress=False, lr=1e-2, segment_lr=1e-2,
                              segatron={"max_paragraphs": 4, "max_sentences": 4, "max_tokens": 8})
    return train(cfg, resume=resume, data=data, model=model)


def test_recipe_trains_the_tables_and_lora_and_resumes_exactly(tmp_path, one_thread):
    cfg = {"max_paragraphs": 4, "max_sentences": 4, "max_tokens": 8}
    full = _run(tmp_path / "a", 3, tiny_segatron(**cfg))
    log = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 3] and log[0]["ppl"] == log[0]["ppl_base"]
    assert full["steps"] == 3 and full["tokens"] == 3 * 64
    assert full["trainable"] == tiny_segatron(**cfg).trainable_counts()
    a = _load(Path(full["final"]), tiny_hf("llama", layers=4, seed=0))
    assert a.paragraph.weight.abs().sum() > 0 and a.position.weight.abs().sum() > 0  # the tables moved from zero

    # b: the same run, stopped after step 2 (its last checkpoint removed), then resumed by rerunning
    _run(tmp_path / "b", 3, tiny_segatron(**cfg))
    ckpts = tmp_path / "b" / "checkpoints"
    for d in ckpts.glob("step-00000003"):
        import shutil

        shutil.rmtree(d)
    (ckpts / "latest").write_text("step-00000002\n")
    resumed = _run(tmp_path / "b", 3, tiny_segatron(seed=9, **cfg))  # another init: the checkpoint must win
    b = _load(Path(resumed["final"]), tiny_hf("llama", layers=4, seed=0))
    for (name, pa), (_, pb) in zip(a.segatron_state_dict().items(), b.segatron_state_dict().items()):
        assert torch.equal(pa, pb), name
