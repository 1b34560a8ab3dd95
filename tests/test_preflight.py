"""What is refused before any process group or DeepSpeed starts: sizes that cannot fit, missing token files, a
bad DeepSpeed JSON, a precision the device lacks, flags a launcher would silently ignore."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shared.tools.prepare_data import prepare
from shared.train import distributed
from shared.train.config import TrainConfig
from shared.train.distributed import check_before_start, estimate_memory
from tests.helpers import LIGHTNING, RAW, ROOT, run

CPU = torch.device("cpu")
GiB = 2**30


@pytest.fixture
def ram_16gib(monkeypatch):
    """A machine with 16 GiB of RAM per process, whatever this one has."""
    monkeypatch.setattr(distributed, "memory_capacity", lambda device, local_world: (16.0 * GiB, "16 GiB of RAM"))


def test_a_sequence_that_cannot_fit_is_refused_naming_it(ram_16gib):
    # tiny with seq_len 100000: sdpa on a CPU with attention dropout keeps 2 x 4 x 100000^2 bf16 scores per block
    with pytest.raises(ValueError, match=r"needs at least 298\.\d GiB per process.*seq_len 100000, micro_batch 2"):
        check_before_start(TrainConfig(seq_len=100000), CPU, 1, 1)
    check_before_start(TrainConfig(), CPU, 1, 1)  # the default tiny run fits
    check_before_start(TrainConfig(seq_len=100000, dropout=0.0), CPU, 1, 1)  # torch's flash kernel: no scores


def test_the_memory_bound_stays_below_measured_peaks():
    # benchmarks/results/compare_1xh200 and compare_2xh200: 1.5b, micro-batch 8, ZeRO-3 bf16, peak 62.8 / 52.4 GiB
    for world, peak in ((1, 62.77), (2, 52.35)):
        report = json.loads((ROOT / "benchmarks" / "results" / f"compare_{world}xh200" / "report.json").read_text())
        assert report["paths"]["deepspeed"]["peak_mem_gib"] == pytest.approx(peak, abs=0.01)
        bound = sum(estimate_memory(TrainConfig(preset="1.5b", micro_batch=8), world, "cuda").values()) / GiB
        assert 0.5 * peak < bound < peak


def test_state_is_divided_as_the_zero_stage_partitions_it():
    state = {s: estimate_memory(TrainConfig(preset="1.5b", stage=s), 4, "cuda")["model and optimizer state"]
             for s in (0, 1, 2, 3)}
    assert state[0] > state[1] > state[2] > state[3] and state[0] == pytest.approx(4 * state[3])


def test_missing_or_mismatched_token_files_are_refused_before_any_process(tmp_path):
    with pytest.raises(ValueError, match="missing.meta.json' not found"):
        check_before_start(TrainConfig(data=str(tmp_path / "missing")), CPU, 1, 1)
    src = tmp_path / "t.txt"
    src.write_text("words and more words. " * 400)
    prepare(src, tmp_path / "t", "byte")
    check_before_start(TrainConfig(data=str(tmp_path / "t")), CPU, 1, 1)
    with pytest.raises(ValueError, match="vocab_size 256 but the model has vocab_size 100"):
        check_before_start(TrainConfig(data=str(tmp_path / "t"), vocab_size=100), CPU, 1, 1)
    (tmp_path / "t.val.bin").unlink()
    with pytest.raises(ValueError, match="t.val.bin' not found"):
        check_before_start(TrainConfig(data=str(tmp_path / "t"), val_every=2), CPU, 1, 1)


def test_a_bad_ds_config_or_precision_is_refused_before_any_process(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_before_start(TrainConfig(ds_config=str(tmp_path / "nope.json")), CPU, 1, 1)
    with pytest.raises(ValueError, match="fp16 is not supported by DeepSpeed on CPU"):
        check_before_start(TrainConfig(precision="fp16"), CPU, 1, 1)
    # a train_batch_size that holds for one process but not for the two the run starts
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 2, "zero_optimization": {"stage": 3},
                                                  "bf16": {"enabled": True}}))
    check_before_start(TrainConfig(ds_config=str(tmp_path / "ds.json")), CPU, 1, 1)
    with pytest.raises(ValueError, match=r"train_batch_size=2, but the run's .* x 2 process\(es\) = 4"):
        check_before_start(TrainConfig(ds_config=str(tmp_path / "ds.json")), CPU, 2, 2)


# 2 x 4 x 2^20 x 2^20 bf16 scores per block: too large for any machine, GPU or CPU
HUGE = ["--attention", "reference", "--seq_len", "1048576"]


@pytest.mark.parametrize("script", [RAW, LIGHTNING], ids=["raw", "lightning"])
def test_the_training_scripts_refuse_before_deepspeed_starts(script, tmp_path):
    cases = [
        (HUGE, "seq_len 1048576"),
        (["--lr", "-1"], "lr must be positive and finite, got -1.0"),
        (["--data", tmp_path / "missing"], "missing.meta.json' not found"),
        (["--layout", "local"], "attention backend 'sdpa' computes dense causal attention only, but layout 'local'"),
        (["--layout", tmp_path / "nope.pt", "--attention", "reference"], "nope.pt' does not exist"),
        (["--out", tmp_path], f"--out {tmp_path} is a folder: give the file to write"),  # not found after training
        (["--export", tmp_path / "notes.txt" / "w.safetensors"], "notes.txt is a file, not a folder to write it in"),
        (["--ds_config", tmp_path / "batch.json"], "sets train_batch_size=32, but the run's --micro_batch 2"),
    ]
    (tmp_path / "notes.txt").write_text("a file where the export's folder would be")
    (tmp_path / "batch.json").write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 3},
                                                     "bf16": {"enabled": True}}))
    if script == RAW:
        cases.append((["--devices", "2"], "torchrun --nproc_per_node 2"))
    # in-process up to the refusal, so the test can see that DeepSpeed was never imported; every case in one
    # process (a start-up of Python + torch each would cost more than the refusals), each case's output captured
    # on its own and sys.modules looked at right after its refusal
    code = ("import contextlib, io, json, sys\nfrom shared.train.cli import parse_train_config\n"
            f"from {script.parent.name}.train import main\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):\n"
            "        try:\n            main(parse_train_config(args, ''))\n            refused = None\n"
            "        except (ValueError, SystemExit) as e:\n            refused = str(e)\n"
            "    print('case:', json.dumps({'refused': refused, 'output': out.getvalue(), "
            "'deepspeed_imported': 'deepspeed' in sys.modules}), flush=True)\n")
    proc = run([sys.executable, "-c", code, json.dumps([[str(a) for a in args] for args, _ in cases])], timeout=120)
    results = [json.loads(line[len("case: "):]) for line in proc.stdout.splitlines() if line.startswith("case: ")]
    assert len(results) == len(cases), (proc.stdout[-3000:], proc.stderr[-2000:])
    for (args, message), r in zip(cases, results):
        assert r["refused"] is not None and message in r["refused"] + r["output"], (args, r, proc.stderr[-2000:])
        assert r["deepspeed_imported"] is False, args


def _lock(root, age_s: float):
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_builds_lock_is_kept(tmp_path, monkeypatch, capsys):
    import compare

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert distributed.extensions_root() == tmp_path
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    with open(lock) as f:
        if distributed._open_nowhere_else(f.fileno()) is None:
            pytest.skip("this file system grants no file leases: such locks are refused (the test below)")
    lock.unlink()
    # a build as torch runs it: FileBaton creates the lock and holds it open until the build ends
    builder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom torch.utils.file_baton import FileBaton\n"
                                f"assert FileBaton({str(lock)!r}).try_acquire()\nprint('building', flush=True)\n"
                                "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline() == "building\n"
        os.utime(lock, (time.time() - 120, time.time() - 120))  # a long build
        distributed.check_build_locks(settle_s=0.1)  # live: waited for, as torch waits
        assert lock.exists() and "removed" not in capsys.readouterr().err
    finally:
        builder.kill()  # killed mid-build: its lock stays behind
        builder.wait()
    with open(lock):  # held open by this process too: still a live build
        distributed.check_build_locks(settle_s=0.1)
    assert lock.exists()
    # the documented way to continue a compare refused on such a lock until it was removed by hand
    compare.parse(["--keep_runs", "--out", str(tmp_path / "report")])
    assert not lock.exists()
    # its age as the check reads it: 120 s and the seconds this test took since (a loaded machine takes more than one)
    said = re.search(rf"removed {re.escape(str(lock))}: a build of the deepspeed_shm_comm extension left it "
                     r"(\d+) s ago", capsys.readouterr().err)
    assert said and 120 <= int(said[1]) < 180
    lock.touch()  # just created: a build that is starting
    distributed.check_build_locks(settle_s=0.1)
    assert lock.exists()


def test_a_lock_whose_holders_cannot_be_known_is_refused_naming_the_command_that_removes_it(tmp_path, monkeypatch):
    # another user's lock, or a network file system (another machine may be building): only this machine's
    # processes can be looked at
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(distributed, "_open_nowhere_else", lambda fd: None)
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    os.utime(lock, (time.time() - 120, time.time() - 120))
    with pytest.raises(ValueError, match=f"stale JIT-build lock {lock} .*rm {lock}"):
        distributed.check_build_locks()
    with open(lock):  # a build in progress here holds its lock open: wait for it, as torch does
        distributed.check_build_locks()
    assert lock.exists()


def test_the_tests_build_extensions_outside_the_users_cache():
    from torch.utils.cpp_extension import get_default_build_root

    assert os.environ.get("TORCH_EXTENSIONS_DIR")
    assert not str(distributed.extensions_root()).startswith(get_default_build_root())


def test_every_process_of_a_run_builds_with_this_environments_ninja(monkeypatch):
    # `make run` starts compare.py without .venv/bin on PATH, a shell may have it: each found another ninja, and
    # each ninja rebuilt the other's build of DeepSpeed's CPU op
    import shutil

    import ninja

    from harness.launch import run_env

    own = Path(ninja.BIN_DIR, "ninja").resolve()
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a system ninja, if any, and no other
    assert Path(shutil.which("ninja", path=run_env()["PATH"])).resolve() == own  # what compare.py starts
    # a training process started with that PATH (as torchrun or the deepspeed launcher pass it on)
    code = ("import shutil, sys\nfrom shared.train.distributed import run_cli\n"
            "run_cli(lambda train: print('ninja:', shutil.which('ninja'), flush=True), None, 'cpu')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.split("ninja: ", 1)[1].strip()).resolve() == own
    # a PATH that finds it already is left as it is
    assert distributed.with_own_ninja(f"{own.parent}:/usr/bin") == f"{own.parent}:/usr/bin"


def test_a_triton_kernel_that_cannot_run_here_is_refused_before_deepspeed_starts(monkeypatch):
    """A CPU without Triton's interpreter: each kernel switch is refused up front, naming its flag (it once failed in
    the first forward, after DeepSpeed had started, exit 1)."""
    from shared.kernels import bias_gelu_grad, cross_entropy, dropout_mask

    for module in (cross_entropy, bias_gelu_grad, dropout_mask):
        monkeypatch.setattr(module, "interpreted", lambda: False)
    for flags, flag in ((dict(triton_loss=True), "--triton_loss"),
                        (dict(fused_bias_gelu=True, triton_gelu_grad=True), "--triton_gelu_grad"),
                        (dict(fused_bias_dropout_add=True, triton_dropout=True), "--triton_dropout")):
        with pytest.raises(ValueError, match=f"runs a Triton kernel on CUDA tensors, got cpu; .* or drop {flag}"):
            check_before_start(TrainConfig(**flags), CPU, 1, 1)
    monkeypatch.setattr(cross_entropy, "interpreted", lambda: True)  # under the interpreter it runs
    check_before_start(TrainConfig(triton_loss=True), CPU, 1, 1)
