"""The top-level documents: every record they link is in the repository, BENCHMARKS.md stays a short reference,
and README's first screen holds the set-up commands and the results table."""

from __future__ import annotations

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
