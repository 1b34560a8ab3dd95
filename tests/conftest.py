"""Test set-up: CPU by default; `gpu`-marked tests run only where CUDA is present (the device machine)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_record import RANK  # a session's worst outcome of a test, as the record reads logs
from shared.train.distributed import with_own_ninja

# DeepSpeed JIT-builds its ops under TORCH_EXTENSIONS_DIR, by default the user's ~/.cache/torch_extensions: a
# build killed there (a test timing out) would leave a lock that hangs the user's own runs, and theirs ours. The
# tests build into the project's own folder unless one is set.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))
# One ninja for every build there, the one installed beside this Python, as the training processes and the launcher
# use (shared/train/distributed.with_own_ninja): ninja 1.13 (pip's) and 1.11 (e.g. /usr/bin) hash a command
# differently in .ninja_log, so each read the other's build of deepspeed_shm_comm as "command line changed" and rebuilt
# it whenever a test ran processes under the other PATH.
os.environ["PATH"] = with_own_ninja(os.environ.get("PATH", ""))

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton kernels run under the interpreter on CPU; it must be set before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One CPU thread per process: the test workers (pytest-xdist) and the training processes they start run side by
    # side, and torch's default of one OpenMP thread per core in each of them oversubscribes the cores (OpenMP
    # threads spin while they wait). On a 2-core machine two tiny 60-step runs side by side took 91-93 s with the
    # default and 25-27 s with one thread each; six of the training-run tests on two workers 230 s and 204 s. An
    # OMP_NUM_THREADS set by the caller is kept (torch read it when it was imported).
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # the processes the tests start
        torch.set_num_threads(1)  # this one, whose torch is imported already


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


ROOT = Path(__file__).resolve().parents[1]

# The run record of the gpu-marked tests: each one's outcome, written on a CUDA machine where GPU_TEST_RECORD names a
# file; benchmarks/gpu_record.py reads these into benchmarks/results/GPU_TESTS.md. The device machine gets the tree
# without .git, so its caller passes the commit in ZERO3_BENCH_COMMIT.
GPU_TESTS: dict[str, dict] = {}


def run_commit() -> str | None:
    if os.environ.get("ZERO3_BENCH_COMMIT"):
        return os.environ["ZERO3_BENCH_COMMIT"]
    if not (ROOT / ".git").exists():
        return None
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or None


def pytest_report_header(config):
    return f"commit: {run_commit() or 'unknown (no .git and no ZERO3_BENCH_COMMIT)'}"


def pytest_configure(config):
    global INVOCATION
    INVOCATION = " ".join(["python -m pytest", *config.invocation_params.args])


INVOCATION = "python -m pytest"


def pytest_runtest_logreport(report):
    if "gpu" not in report.keywords:
        return
    test = GPU_TESTS.setdefault(report.nodeid, {"id": report.nodeid, "outcome": None, "duration_s": 0.0})
    test["duration_s"] = round(test["duration_s"] + report.duration, 3)
    if report.when == "call" or not report.passed:  # a setup or teardown that fails is an error, as pytest counts it
        outcome = "error" if report.failed and report.when != "call" else report.outcome
        if RANK[outcome] > RANK.get(test["outcome"], -1):
            test["outcome"] = outcome
    if report.when == "teardown":
        write_gpu_test_record()  # after each test: a session that a time limit kills keeps what it finished


def write_gpu_test_record():
    path, tests = os.environ.get("GPU_TEST_RECORD"), [t for t in GPU_TESTS.values() if t["outcome"]]
    if not (HAS_CUDA and path and tests) or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: the controller writes
        return
    Path(path).write_text(json.dumps({
        "command": INVOCATION, "commit": run_commit(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "tests": tests,
        "versions": {m: importlib.metadata.version(m) for m in ("torch", "deepspeed")}}, indent=1) + "\n")


# The training scripts' default --out (runs/result.json) and compare.py's (reports/latest): a test launches them with
# an --out under its tmp_path, so that a refusal that regressed into a run cannot write into the checkout.
DEFAULT_OUTPUTS = ("runs", "reports")


def _files_under_default_outputs() -> set[Path]:
    return {p for d in DEFAULT_OUTPUTS for p in (ROOT / d).rglob("*") if p.is_file()}


@pytest.fixture(scope="session")
def kjv(tmp_path_factory):
    """The shipped text (data/kjv.txt) as byte-level token files (shared.tools.prepare_data), made once per session
    under pytest's tmp folder; its prefix."""
    from shared.tools.prepare_data import prepare

    prefix = tmp_path_factory.mktemp("kjv") / "kjv"
    prepare(ROOT / "data" / "kjv.txt", prefix, "byte")
    return prefix


@pytest.fixture(autouse=True)
def no_output_in_the_checkout():
    """Fail a test that leaves a new file under runs/ or reports/ at the repo root (a launch without --out)."""
    before = _files_under_default_outputs()
    yield
    new = sorted(str(p.relative_to(ROOT)) for p in _files_under_default_outputs() - before)
    if new:
        pytest.fail(f"the test wrote into the checkout (launch it with --out under tmp_path): {', '.join(new)}")
