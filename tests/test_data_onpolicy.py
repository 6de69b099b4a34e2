"""``fbs data drafts`` (fbs.data.onpolicy): the verifier's own greedy answers as draft training data.

Oracles: a hand-written source tree (which functions qualify is known), the chat split read directly (no held-out
prompt is used), the model's own full-depth greedy decoding of each prompt alone (the recorded answers), a torn
last line (a crash mid-write: the rerun drops it and resumes), and the packing rule written out (EOS between
sequences, held-out and training sequences disjoint)."""

import json

import pytest
import torch

from fbs.data import onpolicy
from fbs.data.chat import CODE_INSTRUCTIONS, load_items, render_user_turn, split
from test_serve import EOS, char_tokenizer, tiny_model


def _fn(name, lines):
    return f"def {name}(x):\n" + "".join(f"    x = x + {i}\n" for i in range(lines - 2)) + "    return x\n"


def test_stdlib_functions_are_the_top_level_functions_of_4_to_40_lines(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "a.py").write_text(_fn("short", 3) + _fn("four", 4) + _fn("forty", 40) + _fn("long", 41)
                                   + "class C:\n" + "".join("    " + l + "\n" for l in _fn("method", 6).splitlines()))
    (tmp_path / "pkg" / "b.py").write_text("def nested(x):\n    def inner(y):\n        return y\n    return inner(x)\n")
    (tmp_path / "test" / "c.py").write_text(_fn("tested", 6))
    (tmp_path / "bad.py").write_text("def broken(:\n")
    got = dict(onpolicy.stdlib_functions(tmp_path))
    assert sorted(got) == ["stdlib/a.py:forty", "stdlib/a.py:four", "stdlib/pkg/b.py:nested"]
    assert got["stdlib/a.py:four"] == _fn("four", 4).rstrip("\n")


def test_prompts_use_training_chat_items_and_code_edits_only(tmp_path):
    for i in range(8):
        (tmp_path / f"m{i}.py").write_text(_fn(f"f{i}", 5 + i))
    tok = char_tokenizer()
    items = onpolicy.prompts(tok, ("en",), code_items=5, max_prompt_tokens=2000, stdlib_root=tmp_path)
    train, held = split(load_items(("en",)))
    chat = [p for p in items if p["kind"] == "chat"]
    code = [p for p in items if p["kind"] == "code"]
    assert {p["id"] for p in chat} <= {it.id for it in train} and not {p["id"] for p in chat} & {it.id for it in held}
    assert len(code) == 5 and all(p["id"].startswith("stdlib/") for p in code)
    for p in code:
        text = tok.decode(p["ids"])
        assert any(instr in text for instr in CODE_INSTRUCTIONS.values()) and "```python\ndef " in text
    assert len(chat) == sum(len(render_user_turn(tok, it.prompt)) <= 2000 for it in train)
    assert onpolicy.prompts(tok, ("en",), code_items=5, max_prompt_tokens=2000, stdlib_root=tmp_path) == items


def test_build_records_the_models_greedy_answers_and_resumes_after_a_torn_line(tmp_path, one_thread):
    model = tiny_model()
    tok = model.tokenizer
    items = [{"id": f"x/{i}", "kind": "chat" if i % 2 else "code",
              "ids": render_user_turn(tok, "ab" * (i + 1))}
             for i in range(5)]
    onpolicy.build(model, tmp_path, items[:3], max_new_tokens=12, batch_size=2)
    path = tmp_path / onpolicy.SEQUENCES
    with open(path, "a") as f:
        f.write('{"id": "x/3", "ki')  # a crash mid-line
    info = onpolicy.build(model, tmp_path, items, max_new_tokens=12, batch_size=2)
    rows = {r["id"]: r for r in onpolicy.read_sequences(tmp_path)}
    assert sorted(rows) == [it["id"] for it in items] and info["sequences"] == 5
    for it in items:
        alone = model.generate([it["ids"]], max_new_tokens=12, force_compute=True, weights="auto").new_tokens[0]
        r = rows[it["id"]]
        assert r["prompt_len"] == len(it["ids"]) and r["ids"] == it["ids"] + [int(t) for t in alone]
    assert info["answer_tokens"] == sum(len(r["ids"]) - r["prompt_len"] for r in rows.values())
    assert json.loads((tmp_path / onpolicy.META).read_text())["sequences"] == 5


def test_sequence_blocks_pack_with_eos_and_hold_out_whole_sequences(tmp_path):
    rows = [{"id": f"s/{i}", "kind": "chat", "prompt_len": 1, "ids": list(range(1 + i, 8 + 3 * i))} for i in range(12)]
    (tmp_path / onpolicy.SEQUENCES).write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, ev = onpolicy.sequence_blocks(tmp_path, 8, 2, sep=EOS)
    order = sorted(rows, key=lambda r: onpolicy._rank(r["id"], 7))
    flat = [t for r in order for t in (*r["ids"], EOS)]
    held_tokens = 0
    cut = 0
    while held_tokens < 3 * 8:
        held_tokens += len(order[cut]["ids"]) + 1
        cut += 1
    assert ev.tolist() == torch.tensor(flat[:16]).view(2, 8).tolist()
    rest = flat[held_tokens:]
    assert train.tolist() == torch.tensor(rest[: len(rest) // 8 * 8]).view(-1, 8).tolist()
    with pytest.raises(ValueError, match="too few sequences.*fbs data drafts"):
        onpolicy.sequence_blocks(tmp_path, 8, 40, sep=EOS)
    with pytest.raises(FileNotFoundError, match="fbs data drafts --out"):
        onpolicy.read_sequences(tmp_path / "none")
