"""benchmarks/results/ is walkable: every folder has one name scheme and a row in INDEX.md, every row a folder, and
every results path that the docs, the tests, the code and the folders' notes name exists."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "INDEX.md"
NAME = re.compile(r"[a-z][a-z0-9_]*_\d+x[a-z]\d{2,3}")  # <what>_<n>x<gpu>: compare_1xh200, levers_mb8_1xh100
# a results path as the docs and comments write it, brace lists and globs included
MENTION = re.compile(r"benchmarks/results/[A-Za-z0-9_.\-/*{},]*[A-Za-z0-9_*}/]")
# tests and code name a folder as a string of its own, or join it: ROOT / "benchmarks" / "results" / f"compare_{n}xh200"
# (an f-string's fields: any name)
NAMED = re.compile(r"\"([a-z][a-z0-9_]*_\d+x[a-z]\d{2,3}(?:/[^\"]*)?)\"")
JOINED = re.compile(r"\"results\"\s*/\s*f?\"([^\"]+)\"")


def folders() -> list[str]:
    """Every results folder: those at the top level and those under archive/."""
    top = [p.name for p in RESULTS.iterdir() if p.is_dir() and p.name != "archive"]
    return sorted(top) + sorted(f"archive/{p.name}" for p in (RESULTS / "archive").iterdir() if p.is_dir())


def indexed() -> list[str]:
    """The folders INDEX.md lists, in its order: the first cell of each table row, [`name`](name/)."""
    return re.findall(r"^\| \[`([^`]+)`\]\(\1/\) \|", INDEX.read_text(), re.M)


def expand(path: str) -> list[str]:
    """`a_{1,2}x` -> a_1x, a_2x (the shell-style brace lists the docs use)."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in expand(path[:m.start()] + alt + path[m.end():])]


def missing(paths: list[str], base: Path) -> list[str]:
    """The paths (brace lists expanded) that match nothing under `base`."""
    return [q for p in paths for q in expand(p) if not list(base.glob(q.rstrip("/")))]


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split()]


def test_every_folder_is_in_the_index_once_and_every_row_is_a_folder():
    rows = indexed()
    assert len(rows) == len(set(rows)), "a folder listed twice"
    assert sorted(rows) == sorted(folders())


def test_the_results_hold_folders_named_by_the_scheme_and_nothing_loose():
    assert [f for f in folders() if not NAME.fullmatch(f.removeprefix("archive/"))] == []
    loose = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    # the files about every folder: the index, the renames, the GPU tests' record (benchmarks/gpu_record.py)
    assert loose == ["GPU_TESTS.json", "GPU_TESTS.md", "INDEX.md", "RENAMES.md"]
    assert [p.name for p in (RESULTS / "archive").iterdir() if p.is_file()] == []


def test_every_index_row_says_what_how_where_and_when():
    for line in INDEX.read_text().splitlines():
        if not line.startswith("| [`"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        assert len(cells) == 5, line
        folder, claim, command, gpus, date = cells
        assert claim and "`" in command and re.search(r"\dx |none", gpus), line
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", date), line


def test_every_results_path_the_docs_tests_and_code_name_exists():
    # (this file names paths that are gone on purpose, below)
    files = [p for p in tracked("*.md", "*.py", "*.toml") if RESULTS not in p.parents and p != Path(__file__)]
    mentioned, joined = {}, {}
    for f in files:
        text = f.read_text()
        mentioned.update({m: f for m in MENTION.findall(text)})
        if f.suffix == ".py":
            joined.update({re.sub(r"\{[^}]*\}", "*", m): f for m in JOINED.findall(text) + NAMED.findall(text)})
    assert len(mentioned) > 50 and len(joined) > 15  # the scan sees the paths
    assert {m: str(mentioned[m]) for m in missing(sorted(mentioned), ROOT)} == {}
    assert {m: str(joined[m]) for m in missing(sorted(joined), RESULTS)} == {}


def test_the_notes_links_to_other_folders_resolve():
    """A folder's NOTES.md names its neighbours relatively (`../headline_1xh200/`): a move must carry them along."""
    broken = []
    for notes in RESULTS.rglob("*.md"):
        for link in re.findall(r"(?<![\w/.])((?:\.\./)+[A-Za-z0-9_.\-/*{},]*[A-Za-z0-9_*}])", notes.read_text()):
            broken += [f"{notes.relative_to(RESULTS)}: {q}" for q in missing([link], notes.parent)]
    assert broken == []


def test_the_renames_name_what_exists_now_and_nothing_that_was():
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|", (RESULTS / "RENAMES.md").read_text(), re.M)
    assert len(rows) == 23
    for old, new in rows:
        assert (RESULTS / new.rstrip("/")).exists(), new
        assert not (RESULTS / old.rstrip("/")).exists(), old


@pytest.mark.parametrize("text, gone", [
    ("see `benchmarks/results/headline_1xh200/report.json`", []),
    ("(`benchmarks/results/ablation{,_first}_1xh200/ablation.md`)", []),
    ("in `benchmarks/results/compare_{1,2}xh200`", []),
    ("in `benchmarks/results/deepcompile_1xh200_final/report.json`",
     ["benchmarks/results/deepcompile_1xh200_final/report.json"]),
    ("`benchmarks/results/explain_{1,3}xh200`", ["benchmarks/results/explain_3xh200"]),
])
def test_the_path_check_finds_a_path_that_is_gone(text, gone):
    found = MENTION.findall(text)
    assert len(found) == 1 and missing(found, ROOT) == gone
