"""The GPU tests' record: for each `gpu`-marked test id, its latest pass, with the commit, the device and the log it
comes from (results/GPU_TESTS.md, and GPU_TESTS.json beside it for scripts).

    python benchmarks/gpu_record.py update            # rebuild both from the evidence below
    python benchmarks/gpu_record.py update --check    # write nothing; exit 1, naming each difference, if stale

The evidence, every source under benchmarks/results/:
  - each committed pytest log (`*.log`): the per-test lines of `-v` (`tests/x.py::t[p] PASSED [ 5%]`, with `-s` the
    outcome may follow the test's output on a later line) and of `-rA` (`FAILED tests/x.py::t[p] - AssertionError`);
    a `-q` log has no such lines, but where its session's totals count passes only (`6 passed, 12 deselected`),
    each test its durations list names in the call phase passed. Its commit is the one pytest's header names
    (`commit: ...`, which tests/conftest.py prints), else the one that added the log (through exact moves: a folder
    renamed later keeps the commit of its run); its date is the adding commit's, its device the `_<n>x<gpu>` that
    ends its folder's name. A log whose tests a run record beside it names is left out (the record says more);
  - each run record `gpu_test_record*.json` that tests/conftest.py writes where GPU_TEST_RECORD names a file: its
    own commit (ZERO3_BENCH_COMMIT, else the checkout's HEAD), date and device.
Per test id, as `pytest --collect-only -m gpu` names it now, the latest pass wins (by date, then path), and a failure
or error after it is named beside it; a test without a pass shows its latest failure, else `never run`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RECORD = RESULTS / "GPU_TESTS.md"  # and RECORD.with_suffix(".json")
RUN_RECORDS = "gpu_test_record*.json"  # what tests/conftest.py writes (GPU_TEST_RECORD), wherever a run put it
OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}
RANK = {"skipped": 0, "passed": 1, "failed": 2, "error": 3}  # within one session a failure outranks a pass
# a test id: file, function (or Class::function), and parameters that may hold spaces and one level of brackets
NODEID = r"tests/[\w/.-]+\.py::[\w:]+(?:\[(?:[^\[\]\n]|\[[^\[\]\n]*\])*\])?"
WORD = r"(PASSED|FAILED|ERROR|SKIPPED)"
PERCENT = r"(?:\s+\[\s*\d+%\])"
XDIST = r"(?:\[gw\d+\]\s+\[\s*\d+%\]\s+)?"
SUMMARY = re.compile(rf"^{XDIST}{WORD} ({NODEID})(?: - .*)?$")  # -rA, and -v under xdist
VERBOSE = re.compile(rf"^({NODEID})(?: (.*))?$")  # -v: the id, then (after any output of -s) the outcome
REASON = r"(?: \([^)]*\))?"  # -v: SKIPPED (its reason)
TRAILING = re.compile(rf"(?:^|\s){WORD}{REASON}{PERCENT}?\s*$")
BARE = re.compile(rf"^{WORD}{REASON}{PERCENT}?\s*$|\s{WORD}{REASON}{PERCENT}\s*$")  # -s: after the test's output
DURATION = re.compile(rf"^\s*[\d.]+s\s+call\s+({NODEID})\s*$")
TOTALS = re.compile(r"^=*\s*(\d+ [a-z]+(?:, \d+ [a-z]+)*) in [\d.]+s\b")
PASSES_ONLY = {"passed", "deselected", "warning", "warnings"}
DEVICE = re.compile(r"_(\d+x[a-z]\d{2,3})$")  # results/<what>_<n>x<gpu>/
HEADER_COMMIT = re.compile(r"^commit: ([0-9a-f]{7,40})$", re.M)


def parse_log(text: str) -> dict[str, str]:
    """Each test id a pytest log names with an outcome -> "passed", "failed", "error" or "skipped" (the last session
    that ran it decides; within one, the worst of its lines)."""
    outcomes: dict[str, str] = {}
    session: dict[str, str] = {}
    ran: list[str] = []  # ids with a call-phase duration in this session
    current = None  # the id of the -v line whose outcome is still to come

    def note(test: str, word: str) -> None:
        o = OUTCOMES[word]
        if RANK[o] > RANK.get(session.get(test, ""), -1):
            session[test] = o

    def close(totals: str | None) -> None:
        if totals is not None and {kind.split()[1] for kind in totals.split(", ")} <= PASSES_ONLY:
            for test in ran:
                session.setdefault(test, "passed")
        outcomes.update(session)
        session.clear()
        ran.clear()

    for line in text.splitlines():
        if "test session starts" in line:
            close(None)
            current = None
        elif m := TOTALS.match(line):
            close(m.group(1))
            current = None
        elif m := SUMMARY.match(line):
            note(m.group(2), m.group(1))
        elif m := DURATION.match(line):
            ran.append(m.group(1))
        elif m := VERBOSE.match(line):
            current = m.group(1)
            if m.group(2) and (t := TRAILING.search(m.group(2))):
                note(current, t.group(1))
                current = None
        elif current and (m := BARE.search(line)):
            note(current, m.group(1) or m.group(2))
            current = None
    close(None)
    return outcomes


@dataclass
class Run:
    """One source of outcomes: a log or a run record."""

    source: str  # its path under results/
    commit: str | None
    date: str  # ISO 8601
    device: str | None
    outcomes: dict[str, str] = field(default_factory=dict)

    def key(self) -> tuple:
        return datetime.fromisoformat(self.date), self.source

    def where(self) -> dict:
        return {"commit": self.commit, "date": self.date, "device": self.device, "log": self.source}


def git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def origins(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """Each path under results/ (from the repo root) -> the commit that added it and its date, through its exact
    moves (a folder renamed keeps the commit of its run). Not `git log --follow`: that also follows copies, and a log
    started from another one's text would take the other's commit."""
    found: dict[str, tuple[str, str]] = {}
    commit = None
    log = git("log", "--reverse", "-M", "--diff-filter=AR", "--name-status", "--format=@%h %aI", "--",
              str(RESULTS.relative_to(ROOT)), root=root)
    for line in log.splitlines():
        status, *paths = line.split("\t")
        if status.startswith("@"):
            commit = tuple(status[1:].split())
        elif status == "A":
            found[paths[0]] = commit
        elif status == "R100" and paths[0] in found:
            found[paths[1]] = found[paths[0]]
        elif status.startswith("R"):  # moved and changed: another file now
            found[paths[1]] = commit
    return found


def log_runs(records: list[Run], root: Path = ROOT) -> list[Run]:
    """Every committed log under results/ that names a test's outcome, with the commit that added it, less those
    whose tests the run records (record_runs) beside them name."""
    results = root / RESULTS.relative_to(ROOT)
    recorded: dict[Path, set[str]] = {}  # folder -> the tests its run records name
    for run in records:
        recorded.setdefault((results / run.source).parent, set()).update(run.outcomes)
    added = origins(root)
    runs = []
    for path in git("ls-files", "-z", "--", "*.log", root=results).split("\0"):
        commit = added.get(str((results / path).relative_to(root)))
        if not path or commit is None:  # None: staged, not committed
            continue
        text = (results / path).read_text(errors="replace")
        # a log whose tests a run record beside it names says less than the record (which has its commit and date)
        if not (outcomes := parse_log(text)) or outcomes.keys() <= recorded.get((results / path).parent, set()):
            continue
        ran_at = HEADER_COMMIT.search(text)  # the commit tests/conftest.py prints in pytest's header
        device = next((m.group(1) for part in reversed(Path(path).parent.parts) if (m := DEVICE.search(part))), None)
        runs.append(Run(path, ran_at.group(1) if ran_at else commit[0], commit[1], device, outcomes))
    return runs


def record_runs(root: Path = ROOT) -> list[Run]:
    """Every run record under results/ (tests/conftest.py's format: commit, date, device, tests)."""
    results = root / RESULTS.relative_to(ROOT)
    runs = []
    for path in sorted(results.rglob(RUN_RECORDS)):
        rec = json.loads(path.read_text())
        runs.append(Run(str(path.relative_to(results)), rec["commit"], rec["date"], rec["device"],
                        {t["id"]: t["outcome"] for t in rec["tests"]}))
    return runs


def collected(root: Path = ROOT) -> list[str]:
    """The gpu-marked test ids as pytest collects them (on a CPU too: tests/conftest.py skips them, after)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_TEST_RECORD", "PYTEST_ADDOPTS")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    ids = [line for line in proc.stdout.splitlines() if line.startswith("tests/") and "::" in line]
    if proc.returncode != 0 or not ids:
        raise RuntimeError(f"pytest --collect-only -m gpu: exit {proc.returncode}\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-2000:]}")
    return ids


def build(ids: list[str], runs: list[Run]) -> dict[str, dict]:
    """Each id -> its latest pass (and a failure since), else its latest failure, skip, or `never run`."""
    ordered = sorted(runs, key=Run.key)
    record = {}
    for test in ids:
        seen = [(run, run.outcomes[test]) for run in ordered if test in run.outcomes]
        passes = [run for run, o in seen if o == "passed"]
        fails = [(run, o) for run, o in seen if o in ("failed", "error")]
        if passes:
            row = {"outcome": "passed", **passes[-1].where()}
            if fails and fails[-1][0].key() > passes[-1].key():
                row["failed_since"] = {"outcome": fails[-1][1], **fails[-1][0].where()}
        elif fails:
            row = {"outcome": fails[-1][1], **fails[-1][0].where()}
        elif seen:
            row = {"outcome": seen[-1][1], **seen[-1][0].where()}
        else:
            row = {"outcome": "never run"}
        record[test] = row
    return record


HEADER = """\
# GPU tests: the latest pass of each

Every `gpu`-marked test id as `pytest --collect-only -m gpu` names it, with its latest pass: the commit, the date,
the device and the log (or run record) that shows it. Written by `python benchmarks/gpu_record.py update` from
every committed pytest log and run record under `benchmarks/results/` (`--check` fails when this file is stale;
`tests/test_gpu_record.py` runs it); [GPU_TESTS.json](GPU_TESTS.json) holds the same for scripts.

The commit of a log written before pytest's header named one (`commit: ...`) is the commit that added the log to
git (through exact moves of its folder), and its date that commit's: the code it ran at is that commit or its
parent's working tree, since a log was committed with or after the change it tested. A run record
(`gpu_test_record.json`, written by `tests/conftest.py` where `GPU_TEST_RECORD` is set) names the commit it ran at
itself, its date, and the GPU by name. The device of a log is its folder's `<n>x<gpu>`. The latest pass is the one
of the latest date (then path); "then" names a failure or error after it; a test that never passed shows its latest
failure, or `never run`. A `-q` log without per-test lines counts where its session passed every test it ran.
"""


def cell(run: dict) -> list[str]:
    commit = f"`{run['commit'][:10]}`" if run.get("commit") else "unknown"
    return [commit, run["date"][:10], run["device"] or "", f"[{run['log']}]({run['log']})"]


def render(record: dict[str, dict]) -> str:
    passed = sum(r["outcome"] == "passed" for r in record.values())
    never_ran = sum(r["outcome"] == "never run" for r in record.values())
    lines = [HEADER, f"{len(record)} test ids: {passed} with a pass, {len(record) - passed} never passed "
             f"({len(record) - passed - never_ran} failed, errored or skipped last, {never_ran} never run).", "",
             "| test id | latest | commit | date | device | log |", "|---|---|---|---|---|---|"]
    for test, row in record.items():
        outcome = row["outcome"]
        if since := row.get("failed_since"):
            outcome += f"; then {since['outcome']} at {' '.join(cell(since)[:2])}, {cell(since)[3]}"
        cells = [f"`{test}`", outcome, *(cell(row) if "log" in row else ["", "", "", ""])]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def differences(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """What the committed record (old) says that the evidence (new) does not, one line a test id."""
    out = []
    for test in sorted(old.keys() | new.keys()):
        if test not in new:
            out.append(f"{test}: in the record, but no gpu-marked test has this id now")
        elif test not in old:
            out.append(f"{test}: a gpu-marked test the record lacks")
        elif old[test] != new[test]:
            out.append(f"{test}: the record says {old[test]}, the evidence {new[test]}")
    return out


# How the JSON record is made, and how each of its tests runs again (on a CUDA machine; benchmarks/README.md,
# "Recording a GPU test run", says how to record that run).
COMMAND = "python benchmarks/gpu_record.py update"
RERUN = "python -m pytest -m gpu -v -rA '<test id>'"


def dump(record: dict[str, dict]) -> str:
    """The JSON record: the command that wrote it, the command that reruns a test, and the tests' rows."""
    return json.dumps({"command": COMMAND, "rerun": RERUN, "tests": record}, indent=1) + "\n"


def load(path: Path) -> dict[str, dict]:
    """The tests' rows of a JSON record dump() wrote ({} where there is none)."""
    return json.loads(path.read_text())["tests"] if path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("update", help="rebuild the record from the logs and run records under results/")
    u.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each difference if stale")
    u.add_argument("--record", type=Path, default=RECORD, help=f"the record (.md; .json beside it); default {RECORD}")
    ns = p.parse_args(argv)
    records = record_runs()
    record = build(collected(), log_runs(records) + records)
    as_json = ns.record.with_suffix(".json")
    if not ns.check:
        ns.record.write_text(render(record))
        as_json.write_text(dump(record))
        print(f"{ns.record}: {len(record)} test ids, {sum(r['outcome'] == 'passed' for r in record.values())} "
              f"with a pass")
        return 0
    old = load(as_json)
    problems = differences(old, record)
    if not problems and (not ns.record.exists() or ns.record.read_text() != render(old)):
        problems = [f"{ns.record} is not what update writes from {as_json.name}"]
    if problems:
        print(f"{ns.record} is stale (python benchmarks/gpu_record.py update rebuilds it):", *problems, sep="\n  ")
        return 1
    print(f"{ns.record}: current ({len(record)} test ids)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
