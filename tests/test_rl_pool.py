"""Stage-2 prompt pool: normalization, dedup, the evaluation-overlap check, the idiom pool."""

from fbs.rl.pool import PoolItem, build_pool, check_overlap, dedup, idiom_items, normalize


def _item(i, question, source="mmlu"):
    opts = ("a", "b", "c", "d")
    return PoolItem(f"{source}/{i}", source, question, opts, 0, f"{question}\nA. a\nB. b\nC. c\nD. d\n", "Answer: A. a")


def test_normalize():
    assert normalize("  What IS 2+2?\n ") == normalize("what is 2 2") == "whatis22"
    assert normalize("成语“一丁不识”的意思是：") == "成语一丁不识的意思是"


def test_overlap_check_finds_planted_duplicate():
    pool = [_item(0, "Which planet is largest?"), _item(1, "What is the capital of France?"), _item(2, "Name a prime.")]
    evals = {"mmlu_test": {normalize("what is the  capital of FRANCE")}, "other": {normalize("unrelated")}}
    assert check_overlap(pool, evals) == {"mmlu_test": ["mmlu/1"], "other": []}
    items, report = build_pool({"mmlu": pool}, size=10, eval_sets=evals)
    assert sorted(it.id for it in items) == ["mmlu/0", "mmlu/2"]
    assert report.overlap == {"mmlu_test": 1, "other": 0} and report.size["mmlu"] == 2


def test_dedup_and_sampling_deterministic():
    pool = [_item(i, f"Question number {i}?") for i in range(20)] + [_item(99, "question NUMBER 3")]
    kept, removed = dedup(pool)
    assert removed == 1 and len(kept) == 20
    zh = [_item(i, f"成语{i}", "idiom") for i in range(20)]
    a, rep = build_pool({"mmlu": pool, "idiom": zh}, size=10, seed=5, zh_fraction=0.3)
    b, _ = build_pool({"mmlu": pool, "idiom": zh}, size=10, seed=5, zh_fraction=0.3)
    assert [x.id for x in a] == [x.id for x in b] and rep.size == {"mmlu": 7, "idiom": 3}
    assert rep.duplicates_removed == 1


def test_idiom_items_from_csv(tmp_path):
    rows = [("一丁不识", "形容一个字也不认识。"), ("南征北伐", "形容转战南北，经历了许多战斗。"),
            ("如鱼得水", "好像鱼得到水一样。比喻有所凭借。"), ("画蛇添足", "比喻做了多余的事，反而不恰当。"),
            ("守株待兔", "比喻死守狭隘经验，不知变通。"), ("三人", "太短的词被丢弃。")]
    path = tmp_path / "idiom.csv"
    path.write_text("word,explanation\n" + "".join(f"{w},\"{e}\"\n" for w, e in rows), encoding="utf-8")
    a, b = idiom_items(path, seed=1), idiom_items(path, seed=1)
    assert [x.to_dict() for x in a] == [x.to_dict() for x in b] and len(a) == 5
    for it in a:
        assert len(set(it.options)) == 4 and it.gold_text.startswith("答案：")
        word = it.id.split("/")[1]
        assert it.options[it.gold] == dict(rows)[word].split("。")[0] + "。"
    assert "如鱼得水" in a[[x.id for x in a].index("idiom/如鱼得水")].prompt


def test_save_load_roundtrip_with_unicode_separators(tmp_path):
    from fbs.rl.pool import load_pool, save_pool

    items, report = build_pool({"mmlu": [_item(0, "line\u2028sep\x85 and 中文")]}, size=1)
    save_pool(tmp_path / "pool.jsonl", items, report)
    assert load_pool(tmp_path / "pool.jsonl") == items
    assert (tmp_path / "pool_report.json").is_file()
