"""The top-level documents: every record they link is in the repository and names the commit of its code,
BENCHMARKS.md stays a short reference, and README's first screen holds the set-up commands and the results table."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md", "RESULTS.md")
LINK = re.compile(r"\]\(([^)#\s]+)")
RESULT_PATH = re.compile(r"(?<![\w/.-])(results/[\w./*-]+)")


def _tracked() -> set[str] | None:
    """Paths git tracks in this checkout, with every parent folder; None outside a git checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    files = set(out.stdout.split())
    folders = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    return files | folders


def _local_links(doc: str) -> list[str]:
    return [t for t in LINK.findall((ROOT / doc).read_text()) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve_to_files_in_the_repository(doc):
    tracked = _tracked()
    missing, untracked = [], []
    for target in _local_links(doc):
        path = (ROOT / doc).parent / target
        rel = path.resolve().relative_to(ROOT).as_posix()
        if not path.exists():
            missing.append(target)
        elif tracked is not None and rel not in tracked:
            untracked.append(target)
    assert not missing, f"{doc} links files that do not exist: {missing}"
    assert not untracked, f"{doc} links files git does not track (ignored or never added): {untracked}"


def test_benchmarks_cites_only_records_in_the_repository():
    text = (ROOT / "BENCHMARKS.md").read_text()
    tracked = _tracked()
    cited = set()
    for p in RESULT_PATH.findall(text):
        p = p.rstrip(".,")
        matches = sorted(q.relative_to(ROOT).as_posix() for q in ROOT.glob(p)) if "*" in p else [p]
        assert matches, f"BENCHMARKS.md cites {p}, which matches no file"
        cited.update(matches)
    assert cited, "BENCHMARKS.md cites no record under results/"
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, f"BENCHMARKS.md cites records that do not exist: {missing}"
    if tracked is not None:
        untracked = sorted(p for p in cited if p.rstrip("/") not in tracked)
        assert not untracked, f"BENCHMARKS.md cites records git does not track: {untracked}"


def test_benchmarks_is_a_short_reference_without_latest_headings():
    path = ROOT / "BENCHMARKS.md"
    assert path.stat().st_size <= 20_000, f"BENCHMARKS.md is {path.stat().st_size} bytes; history goes to docs/benchmarks-history.md"
    headings = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert not [h for h in headings if "latest" in h.lower()], "a 'Latest' heading in BENCHMARKS.md goes stale: name the question instead"
    assert (ROOT / "docs" / "benchmarks-history.md").exists()


def test_readme_first_screen_has_setup_and_results_table():
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:30])
    assert "make demo" in first and "make test" in first
    lines = first.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    assert start is not None, "no table on README's first screen"
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    rows = table[2:]                                     # after the header and its separator
    assert any("HF" in r for r in rows) and any("llama.cpp" in r for r in rows), "the first table is not the results table"
    assert all("](results/" in r for r in rows), "every row of the results table links its record"


COMMIT = re.compile(r'"(?:git_)?commit"\s*:\s*"[0-9a-f]{7,40}"')
LEGACY = ROOT / "results" / "legacy_provenance.json"


def _cited_records() -> set[str]:
    """Every existing path under results/ that README, BENCHMARKS.md or RESULTS.md cites (links and inline paths,
    globs expanded)."""
    cited = set()
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for p in RESULT_PATH.findall(text) + [t for t in _local_links(doc) if t.startswith("results/")]:
            p = p.rstrip(".,")
            for q in (ROOT.glob(p) if "*" in p else [ROOT / p]):
                if q.exists():
                    cited.add(q.relative_to(ROOT).as_posix().rstrip("/"))
    return cited


def _carries_commit(rel: str) -> bool:
    """A record carries the commit of the code that produced it: a JSON at the path, below it (a folder), next to it
    with its stem, or in its own folder under results/ (a run's bench.md beside its bench.json) names a commit."""
    path = ROOT / rel
    if path.is_dir():
        candidates = list(path.rglob("*.json"))
    else:
        candidates = [path] if path.suffix == ".json" else [path.with_suffix(".json")]
        if path.parent != ROOT / "results":
            candidates += list(path.parent.glob("*.json"))
    return any(c.is_file() and COMMIT.search(c.read_text(errors="ignore")) for c in candidates)


def test_every_cited_record_names_the_commit_of_its_code():
    """No number in the documents lacks a record with a commit: each cited record carries its commit, or (records
    written before records carried one) results/legacy_provenance.json names the commit that committed it."""
    legacy = json.loads(LEGACY.read_text())["records"]
    missing = sorted(r for r in _cited_records() if not _carries_commit(r) and r not in legacy)
    assert not missing, f"cited records without a commit (add provenance, or list them in {LEGACY.name}): {missing}"
    for rel, entry in legacy.items():
        assert (ROOT / rel).exists(), f"{LEGACY.name} lists {rel}, which does not exist"
        assert re.fullmatch(r"[0-9a-f]{7,40}", entry["commit"]), f"{LEGACY.name}: {rel} has no commit"
        assert not _carries_commit(rel), f"{rel} carries its own commit now: drop it from {LEGACY.name}"
    if shutil.which("git") is not None and (ROOT / ".git").exists():
        for rel, entry in legacy.items():
            ok = subprocess.run(["git", "cat-file", "-e", entry["commit"] + "^{commit}"], cwd=ROOT, capture_output=True)
            assert ok.returncode == 0, f"{LEGACY.name}: {rel} names {entry['commit']}, not a commit of this repository"
