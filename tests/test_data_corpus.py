"""Corpus build determinism, filters, errors, labels and the resumable packed stream."""

import json
import random

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from fbs.data.bios import IdiomLexicon
from fbs.data.corpus import (CorpusConfig, PackedBlocks, build_corpus, collate_blocks, label_corpus, label_statistics,
                             read_split)
from fbs.data.metrics import B, I, IGNORE_INDEX, O, S
from fbs.data.sources import (Document, SourceError, bundle, fortune_records, parse_jsonl_texts, pd_articles,
                              pd_line_text, read_fortunes_zh)

pytest.importorskip("datasketch")


def char_tokenizer(texts):
    """Character-level HF fast tokenizer over the characters of ``texts`` (built in-process)."""
    chars = sorted({c for t in texts for c in t})
    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def make_docs():
    rng = random.Random(0)
    words = [f"word{i}" for i in range(500)]
    en = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(12)]
    zh = ["他做事一丝不苟，我们工作认真。" * 4, "我们坚持解放思想，实事求是。" * 4]
    docs = [Document("en_src", f"d{i}", "en", t) for i, t in enumerate(en)]
    docs.append(Document("en_src", "dup", "en", en[0].upper()))  # exact duplicate after normalisation
    docs.append(Document("en_src", "near", "en", en[1] + " extra"))  # near duplicate
    docs.append(Document("en_src", "short", "en", "too short"))
    docs += [Document("zh_src", f"z{i}", "zh", t) for i, t in enumerate(zh)]
    return docs


def zh_segmenter(text):
    lexicon = ["工作", "认真", "我们", "坚持", "解放", "思想", "实事求是", "做事"]
    out, i = [], 0
    while i < len(text):
        for n in (4, 2):
            if text[i:i + n] in lexicon:
                out.append(text[i:i + n])
                i += n
                break
        else:
            out.append(text[i])
            i += 1
    return out


@pytest.fixture()
def tok():
    return char_tokenizer([d.text for d in make_docs()])


def test_build_is_byte_identical_and_filters(tmp_path, tok):
    cfg = CorpusConfig(min_tokens=40, val_fraction=0.2, test_fraction=0.2, seed=3)
    m1 = build_corpus(tmp_path / "a", tok, "char", cfg, documents=make_docs())
    build_corpus(tmp_path / "b", tok, "char", cfg, documents=make_docs())
    for name in ("train.jsonl", "validation.jsonl", "test.jsonl", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    st = m1["sources"]["en_src"]
    assert (st["documents_read"], st["too_short"], st["exact_duplicates"], st["near_duplicates"]) == (15, 1, 1, 1)
    assert st["kept"] == 12 and m1["sources"]["zh_src"]["kept"] == 2
    kept = [r["id"] for s in ("train", "validation", "test") for r in read_split(tmp_path / "a", s)]
    assert sorted(kept) == sorted({f"en_src/d{i}" for i in range(12)} | {"zh_src/z0", "zh_src/z1"})
    line = (tmp_path / "a" / "train.jsonl").read_text().splitlines()[0]
    assert list(json.loads(line)) == sorted(json.loads(line))  # sorted keys
    # a different seed changes the split but not the kept set
    m3 = build_corpus(tmp_path / "c", tok, "char", CorpusConfig(min_tokens=40, val_fraction=0.2, test_fraction=0.2,
                                                                 seed=4), documents=make_docs())
    assert sum(sum(s["documents"].values()) for s in m3["splits"].values()) == 14


def test_empty_corpus_and_bad_inputs(tmp_path, tok):
    with pytest.raises(SourceError, match="empty corpus.*--min-tokens"):
        build_corpus(tmp_path, tok, "char", CorpusConfig(min_tokens=10_000), documents=make_docs())
    with pytest.raises(ValueError, match="unknown source"):
        CorpusConfig(sources=("nope",))
    with pytest.raises(SourceError, match="not found: build the corpus first"):
        list(read_split(tmp_path / "missing", "train"))
    (tmp_path / "train.jsonl").write_text('{"id": "a", "lang": "en", "text": "x"}\n{broken\n')
    with pytest.raises(SourceError, match=r"train.jsonl:2: malformed JSONL"):
        list(read_split(tmp_path, "train"))
    with pytest.raises(SourceError, match="c4.jsonl:2: malformed JSONL"):
        list(parse_jsonl_texts('{"text": "a"}\nnot json\n', "c4.jsonl"))
    with pytest.raises(SourceError, match="apt-get install fortunes-zh"):
        list(read_fortunes_zh(fortunes_dir=tmp_path / "nowhere"))


def test_label_and_packed_stream_resume(tmp_path, tok):
    cfg = CorpusConfig(min_tokens=40, val_fraction=0.0, test_fraction=0.0)
    build_corpus(tmp_path, tok, "char", cfg, documents=make_docs())
    report = label_corpus(tmp_path, zh_segmenter, IdiomLexicon(["一丝不苟"]), tok, splits=("train",))
    st = report["splits"]["train"]
    assert st["documents"] == 2 and st["chunks"]["idiom"] == 4
    assert st["coverage_q"] == 1.0  # a character tokenizer never misaligns
    full = list(PackedBlocks(tmp_path, "train", tok, block_size=32))
    assert [b.index for b in full] == list(range(len(full)))
    resumed = list(PackedBlocks(tmp_path, "train", tok, block_size=32, start=5))
    assert [b.index for b in resumed] == [b.index for b in full[5:]]
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.bios_labels, b.bios_labels)
               for a, b in zip(full[5:], resumed))
    ids = torch.cat([b.input_ids for b in full])
    labels = torch.cat([b.bios_labels for b in full])
    assert (labels[ids == tok.eos_token_id] == IGNORE_INDEX).all()  # separators unlabelled
    # the Chinese text is labelled; the idiom 一丝不苟 is B I I I
    text = "他做事一丝不苟，我们工作认真。"
    zh_ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    starts = [i for i in range(len(ids) - len(zh_ids)) if torch.equal(ids[i:i + len(zh_ids)], zh_ids)]
    assert starts
    got = labels[starts[0]:starts[0] + len(zh_ids)].tolist()
    assert got == [O, B, I, B, I, I, I, O, B, I, B, I, B, I, O]
    assert set(labels.tolist()) >= {B, I, O, IGNORE_INDEX} and S not in labels.tolist()
    batch = collate_blocks(full[:2])
    assert batch["input_ids"].shape == (2, 32) and batch["coverage"].shape == (2,)


def test_source_document_rules():
    assert pd_line_text("[中央/n  人民/n  广播/vn  电台/n]nt  １２月/t  ，/w") == "中央人民广播电台１２月，"
    lines = ["标题一", "正文" * 120 + "。", "正文。", "新标题", "副标题", "正文" * 3 + "。"]
    arts = list(pd_articles(lines, min_article_chars=10))
    assert [a[0] for a in arts] == ["标题一", "新标题"]
    assert fortune_records("\x1b[32m《静夜思》\x1b[m\n床前明月光\n%\n第二首\n%\n") == ["《静夜思》\n床前明月光", "第二首"]
    assert list(bundle(["ab", "cd", "ef"], "r", 5)) == [("r-00000", "ab\ncd"), ("r-00001", "ef")]


def test_label_statistics_under_a_merging_tokenizer(tmp_path):
    """Hand-computed alignment under a tokenizer whose tokens straddle word boundaries.

    Text 我们工作认真 with chunks 我们 | 工作 | 认真 and tokens 我 | 们工 | 作认 | 真: all four tokens touch a
    chunk, only 我 and 真 lie inside one -> labels S O O S, q = 2/4, the chunk 工作 has no token (dropped).
    """
    text = "我们工作认真"
    (tmp_path / "train.jsonl").write_text(json.dumps({"id": "z", "lang": "zh", "text": text}) + "\n"
                                          + json.dumps({"id": "e", "lang": "en", "text": "ignored"}) + "\n")
    (tmp_path / "train.bios.jsonl").write_text(json.dumps({"id": "z", "chunks": [[0, 2, "seg"], [2, 4, "seg"],
                                                                                   [4, 6, "seg"]]}) + "\n")
    vocab = {"<eos>": 0, "<unk>": 1, "我": 2, "们工": 3, "作认": 4, "真": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("我|们工|作认|真|[\\s\\S]"), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<unk>")
    r = label_statistics(tmp_path, tok, "train", block_size=2)
    assert r["documents"] == 1 and r["tokens"] == 4 and r["chunks_dropped"] == 1
    assert r["label_share"] == {"B": 0.0, "I": 0.0, "O": 0.5, "S": 0.5}
    assert r["coverage_q"] == 0.5
    # blocks of 2 over 我 们工 | 作认 真 (+ separator, dropped as a partial block): q = 1/2 each, both < q0
    assert r["per_block"]["blocks"] == 2 and r["per_block"]["q_mean"] == 0.5 and r["per_block"]["below_q0"] == 1.0
    with pytest.raises(SourceError, match="fbs data label"):
        label_statistics(tmp_path, tok, "validation")
