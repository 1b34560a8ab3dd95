"""benchmarks/gpu_record.py and the run record tests/conftest.py writes: the committed GPU_TESTS.md is current and
names every gpu-marked test, the check fails on a stale record, logs parse into outcomes, and the conftest hooks write
a record the script reads back (no GPU: the hooks are called with fake reports)."""

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest

from benchmarks import gpu_record
from tests.helpers import ROOT

# the fake results' folders are named from these, not written out: tests/test_results_index.py reads a folder name
# written out in a test as one that must exist under benchmarks/results/
H200, H100 = "1xh200", "1xh100"


@pytest.fixture(scope="module")
def gpu_ids() -> list[str]:
    """The gpu-marked test ids, collected once for the module (a pytest subprocess, a few seconds)."""
    return gpu_record.collected()


@pytest.fixture
def committed(tmp_path, monkeypatch, gpu_ids) -> Path:
    """A copy of the committed record under tmp_path, and main() reading the ids collected once."""
    monkeypatch.setattr(gpu_record, "collected", lambda root=ROOT: gpu_ids)
    for suffix in (".md", ".json"):
        shutil.copy(gpu_record.RECORD.with_suffix(suffix), tmp_path / f"GPU_TESTS{suffix}")
    return tmp_path / "GPU_TESTS.md"


def check(record: Path, capsys) -> tuple[int, str]:
    code = gpu_record.main(["update", "--check", "--record", str(record)])
    return code, capsys.readouterr().out


def test_the_committed_record_is_current(committed, capsys):
    code, out = check(committed, capsys)
    assert code == 0, out


def test_every_collected_gpu_test_has_a_row_and_every_row_a_test(gpu_ids):
    assert len(gpu_ids) > 50
    assert "tests/test_zero3_step.py::test_gpu_fused_step_trains_like_the_fast_step[raw]" in gpu_ids
    record = gpu_record.load(gpu_record.RECORD.with_suffix(".json"))
    assert sorted(record) == sorted(gpu_ids)
    rows = [line.split(" | ")[0].removeprefix("| `").removesuffix("`")
            for line in gpu_record.RECORD.read_text().splitlines() if line.startswith("| `tests/")]
    assert sorted(rows) == sorted(gpu_ids)
    assert all(r["outcome"] == "never run" or (r["commit"] and r["date"] and r["log"]) for r in record.values())


def test_a_record_with_a_test_that_is_gone_or_missing_fails_the_check(committed, capsys):
    record = gpu_record.load(committed.with_suffix(".json"))
    kept = next(iter(record))
    record["tests/test_gone.py::test_renamed_since[a b]"] = record.pop(kept)
    committed.with_suffix(".json").write_text(gpu_record.dump(record))
    committed.write_text(gpu_record.render(record))  # the .md agrees with the .json: the check reads the evidence
    code, out = check(committed, capsys)
    assert code == 1
    assert "tests/test_gone.py::test_renamed_since[a b]: in the record, but no gpu-marked test has this id now" in out
    assert f"{kept}: a gpu-marked test the record lacks" in out


def test_a_changed_row_or_a_hand_edited_table_fails_the_check(committed, capsys):
    record = gpu_record.load(committed.with_suffix(".json"))
    test, row = next((t, r) for t, r in record.items() if r["outcome"] == "passed")
    committed.with_suffix(".json").write_text(gpu_record.dump({**record, test: {**row, "commit": "0000000"}}))
    code, out = check(committed, capsys)
    assert code == 1 and f"{test}: the record says" in out and "0000000" in out
    shutil.copy(gpu_record.RECORD.with_suffix(".json"), committed.with_suffix(".json"))
    committed.write_text(committed.read_text().replace("| passed |", "| failed |", 1))
    code, out = check(committed, capsys)
    assert code == 1 and "is not what update writes" in out


SAMPLE = """\
============================= test session starts ==============================
commit: 1234abcd
collecting ... collected 7 items

tests/test_a.py::test_plain PASSED                                       [ 14%]
tests/test_a.py::test_param[with space-1] FAILED                         [ 28%]
tests/test_a.py::test_param[x[0]] PASSED                                 [ 42%]
tests/test_a.py::test_setup_fails ERROR                                  [ 57%]
tests/test_a.py::test_teardown_fails PASSED                              [ 71%]
tests/test_a.py::test_teardown_fails ERROR                               [ 71%]
tests/test_b.py::TestK::test_m[raw] loss gaps: [0.0, 0.1]
PASSED
tests/test_b.py::test_s SKIPPED (needs two GPUs)                         [100%]
=========================== short test summary info ============================
FAILED tests/test_a.py::test_param[with space-1] - AssertionError: 1 != 2 [x]
ERROR tests/test_a.py::test_setup_fails - RuntimeError: CUDA error
======= 1 failed, 4 passed, 1 skipped, 2 errors in 12.00s (0:00:12) ===========
....                                                                     [100%]
============================= slowest 25 durations =============================
9.10s call     tests/test_c.py::test_quiet[1]
0.20s setup    tests/test_c.py::test_quiet[1]
3.00s call     tests/test_c.py::test_quiet[2]
(5 durations < 0.005s hidden.  Use -vv to show these durations.)
4 passed, 12 deselected, 3 warnings in 13.01s
.F                                                                       [100%]
5.00s call     tests/test_d.py::test_not_said
2 failed, 1 passed in 6.00s
[gw1] [ 50%] PASSED tests/test_e.py::test_xdist[a b]
"""


def test_a_log_parses_into_each_tests_outcome():
    assert gpu_record.parse_log(SAMPLE) == {
        "tests/test_a.py::test_plain": "passed",
        "tests/test_a.py::test_param[with space-1]": "failed",
        "tests/test_a.py::test_param[x[0]]": "passed",
        "tests/test_a.py::test_setup_fails": "error",
        "tests/test_a.py::test_teardown_fails": "error",  # passed its call, errored in teardown
        "tests/test_b.py::TestK::test_m[raw]": "passed",  # -s: the outcome after the test's output
        "tests/test_b.py::test_s": "skipped",
        "tests/test_c.py::test_quiet[1]": "passed",  # -q, a session of passes only: its durations name them
        "tests/test_c.py::test_quiet[2]": "passed",
        # test_d: a -q session that failed: which test failed, its log does not say
        "tests/test_e.py::test_xdist[a b]": "passed",
    }
    assert gpu_record.HEADER_COMMIT.search(SAMPLE).group(1) == "1234abcd"
    assert gpu_record.parse_log("tests/test_a.py::test_plain\nsome output FAILED here\n") == {}


def test_a_later_session_of_the_same_log_decides_and_the_latest_pass_wins():
    rerun = "tests/t.py::test_x FAILED\n1 failed in 1.00s\ntests/t.py::test_x PASSED\n1 passed in 1.00s\n"
    assert gpu_record.parse_log(rerun) == {"tests/t.py::test_x": "passed"}
    early = gpu_record.Run(f"a_{H200}/a.log", "aaa", "2026-12-01T00:00:00+00:00", H200,
                           {"t": "passed", "u": "passed"})
    late = gpu_record.Run(f"b_{H100}/b.log", "bbb", "2026-12-02T00:00:00+00:00", H100, {"t": "failed"})
    record = gpu_record.build(["t", "u", "v"], [late, early])
    assert record["t"]["commit"] == "aaa" and record["t"]["failed_since"]["commit"] == "bbb"
    assert record["u"] == {"outcome": "passed", "commit": "aaa", "date": early.date, "device": H200,
                           "log": f"a_{H200}/a.log"}
    assert record["v"] == {"outcome": "never run"}
    assert "passed; then failed at `bbb` 2026-12-02" in gpu_record.render(record)


def fake_report(nodeid: str, when: str, outcome: str, gpu: bool = True, duration: float = 1.0):
    return SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, duration=duration,
                           keywords={"gpu": 1} if gpu else {}, passed=outcome == "passed", failed=outcome == "failed")


def test_the_conftest_hooks_write_a_run_record_the_script_reads(tmp_path, monkeypatch):
    out = tmp_path / "benchmarks" / "results" / f"gpu_tests_{H100}" / "gpu_test_record.json"
    out.parent.mkdir(parents=True)
    monkeypatch.setattr(conftest, "GPU_TESTS", {})
    monkeypatch.setattr(conftest, "HAS_CUDA", True)
    monkeypatch.setattr(conftest.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("GPU_TEST_RECORD", str(out))
    monkeypatch.setenv("ZERO3_BENCH_COMMIT", "abc1234")
    assert "commit: abc1234" in conftest.pytest_report_header(None)
    conftest.pytest_configure(SimpleNamespace(invocation_params=SimpleNamespace(args=("-m", "gpu", "tests/test_k.py"))))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # an xdist worker writes nothing: its controller does
    conftest.pytest_runtest_logreport(fake_report("tests/test_k.py::test_w", "teardown", "passed"))
    assert not out.exists()
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.setattr(conftest, "GPU_TESTS", {})
    phases = {"tests/test_k.py::test_ok[a b]": ("passed", "passed", "passed"),
              "tests/test_k.py::test_bad": ("passed", "failed", "passed"),
              "tests/test_k.py::test_setup_error": ("failed",),
              "tests/test_k.py::test_teardown_error": ("passed", "passed", "failed"),
              "tests/test_k.py::test_skipped": ("skipped",)}
    for i, (nodeid, outcomes) in enumerate(phases.items()):
        for when, outcome in zip(("setup", "call", "teardown"), outcomes, strict=False):
            conftest.pytest_runtest_logreport(fake_report(nodeid, when, outcome))
        if i == 0:  # written after each test's teardown: a session killed by a time limit keeps what it finished
            assert [t["id"] for t in json.loads(out.read_text())["tests"]] == [nodeid]
    conftest.pytest_runtest_logreport(fake_report("tests/test_k.py::test_cpu", "call", "passed", gpu=False))
    conftest.pytest_runtest_logreport(fake_report("tests/test_k.py::test_skipped", "teardown", "passed"))
    rec = json.loads(out.read_text())
    assert rec["command"] == "python -m pytest -m gpu tests/test_k.py"  # what reruns it
    assert rec["commit"] == "abc1234" and rec["device"] == "NVIDIA H100 80GB HBM3" and rec["date"].startswith("20")
    assert set(rec["versions"]) == {"torch", "deepspeed"} and all(rec["versions"].values())
    assert {t["id"]: (t["outcome"], t["duration_s"]) for t in rec["tests"]} == {
        "tests/test_k.py::test_ok[a b]": ("passed", 3.0), "tests/test_k.py::test_bad": ("failed", 3.0),
        "tests/test_k.py::test_setup_error": ("error", 1.0), "tests/test_k.py::test_teardown_error": ("error", 3.0),
        "tests/test_k.py::test_skipped": ("skipped", 2.0)}

    runs = gpu_record.record_runs(tmp_path)
    assert [(r.source, r.commit, r.device) for r in runs] == [
        (f"gpu_tests_{H100}/gpu_test_record.json", "abc1234", "NVIDIA H100 80GB HBM3")]
    record = gpu_record.build(["tests/test_k.py::test_ok[a b]", "tests/test_k.py::test_bad"], runs)
    assert record["tests/test_k.py::test_ok[a b]"]["commit"] == "abc1234"
    assert record["tests/test_k.py::test_bad"]["outcome"] == "failed"

    out.unlink()
    monkeypatch.setattr(conftest, "HAS_CUDA", False)  # a CPU run writes no record
    conftest.pytest_runtest_logreport(fake_report("tests/test_k.py::test_ok[a b]", "teardown", "passed"))
    assert not out.exists()


def test_a_log_keeps_the_commit_of_its_run_through_a_move_but_not_through_a_copy(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    results = tmp_path / "benchmarks" / "results"
    old, moved, second, recorded = (results / name for name in ("first_h200", f"first_{H200}", f"second_{H100}",
                                                                 f"recorded_{H100}"))
    log = "tests/t.py::test_x PASSED\ntests/t.py::test_y PASSED\n" + "padding line\n" * 50
    old.mkdir(parents=True)
    (old / "gpu.log").write_text(log)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "run")
    first = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                           text=True).stdout.strip()
    git("mv", str(old.relative_to(tmp_path)), str(moved.relative_to(tmp_path)))
    second.mkdir()
    (second / "gpu.log").write_text(log.replace("test_y PASSED", "test_y FAILED"))  # begun as a copy of the first
    recorded.mkdir()
    (recorded / "gpu.log").write_text(log + "\n")  # beside a run record of its tests: the record tells
    (recorded / "gpu_test_record.json").write_text(json.dumps(
        {"commit": "feed123", "date": "2026-12-07T00:00:00+00:00", "device": "NVIDIA H100",
         "tests": [{"id": f"tests/t.py::test_{x}", "outcome": "passed", "duration_s": 1.0} for x in "xy"]}))
    git("add", ".")
    git("commit", "-qm", "move, and a second run")
    runs = {Path(r.source).parent.name: r for r in gpu_record.log_runs(gpu_record.record_runs(tmp_path), tmp_path)}
    assert sorted(runs) == [moved.name, second.name]
    assert runs[moved.name].commit == first and runs[moved.name].device == H200
    assert runs[second.name].commit != first and runs[second.name].device == H100
    assert runs[second.name].outcomes == {"tests/t.py::test_x": "passed", "tests/t.py::test_y": "failed"}


def test_every_gpu_test_command_of_the_device_stages_writes_a_run_record():
    from benchmarks import device

    found = set()
    for stage in device.load().values():
        for c in stage.commands():
            if "pytest -m gpu" in c.command:
                env = {k: device.fill(v, {"work": "/tmp/work"}) for k, v in {**stage.env, **c.env}.items()}
                assert Path(env["GPU_TEST_RECORD"]).match(gpu_record.RUN_RECORDS), (stage.name, c.log)
                assert Path(env["GPU_TEST_RECORD"]).parent == Path("/tmp/work"), (stage.name, c.log)
                found.add(stage.name)
    assert found == {"headline", "lever", "gpu_tests", "fp8_curve", "resume"}  # the stages that run GPU tests
