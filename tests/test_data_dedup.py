"""Exact and MinHash near-duplicate removal at the paper's 0.7 threshold."""

import random

import pytest

from fbs.data.dedup import DedupConfig, Deduplicator, jaccard, normalize

pytest.importorskip("datasketch")

WORDS = [f"w{i}" for i in range(2000)]


def text_with_changes(base: list[str], frac: float, seed: int) -> str:
    rng = random.Random(seed)
    out = list(base)
    for i in rng.sample(range(len(out)), int(frac * len(out))):
        out[i] = rng.choice(WORDS) + "x"
    return " ".join(out)


@pytest.fixture(scope="module")
def base():
    rng = random.Random(0)
    return [rng.choice(WORDS) for _ in range(400)]


def test_near_duplicate_above_threshold_removed_below_kept(base):
    original = " ".join(base)
    near = text_with_changes(base, 0.02, 1)  # a few words changed
    far = text_with_changes(base, 0.3, 2)  # 30% of the words changed
    assert jaccard(original, near) > 0.8  # well above 0.7
    assert 0.45 < jaccard(original, far) < 0.6  # well below 0.7
    dd = Deduplicator(DedupConfig(threshold=0.7))
    assert dd.check("a", original) is None
    assert dd.check("b", near) == ("near", "a")
    assert dd.check("c", far) is None
    assert (dd.stats.near, dd.stats.exact) == (1, 0)


def test_threshold_is_the_decision(base):
    original, far = " ".join(base), text_with_changes(base, 0.3, 2)
    dd = Deduplicator(DedupConfig(threshold=0.4))  # a looser threshold now removes the far copy
    dd.check("a", original)
    assert dd.check("c", far) == ("near", "a")


def test_exact_duplicates_after_normalisation():
    dd = Deduplicator()
    assert dd.check("a", "Hello   World\n") is None
    assert dd.check("b", "hello world") == ("exact", "a")
    assert normalize("Ｈｅｌｌｏ\t world ") == "hello world"
