"""Launch the training scripts as a user would, in subprocesses with a hard timeout (a hang fails, not blocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "plain_deepspeed" / "train.py"
LIGHTNING = ROOT / "lightning_app" / "train.py"
FAST = ["--preset", "tiny", "--steps", "6", "--warmup_steps", "2", "--log_every", "3"]
# GPU tests: a small GPT on real text (add --data): compiles in seconds, its loss falls, dropout 0.1 everywhere (the
# preset's default).
GPU_BASE = ["--preset", "125m", "--n_layer", "2", "--seq_len", "512", "--vocab_size", "256", "--micro_batch", "8",
            "--lr", "1e-3", "--min_lr", "1e-4", "--lr_warmup_steps", "5", "--log_every", "10"]


def env() -> dict:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    return e


def run(cmd: list[str], timeout: int = 240, check: bool = True, eager: bool = True) -> subprocess.CompletedProcess:
    """Run `cmd`; a training script without --profile trains the eager profile (TrainConfig's own defaults), which
    the tests' flags change one by one, also on a GPU, where the scripts' default is the fast profile (eager=False:
    the command as given, the machine's default profile)."""
    cmd = [str(c) for c in cmd]
    if eager and any(c in (str(RAW), str(LIGHTNING)) for c in cmd) and "--profile" not in cmd and "--help" not in cmd:
        cmd += ["--profile", "eager"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout,
                          cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def python_without_interpreter(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Python `code` in a fresh process without TRITON_INTERPRET: Triton as a CPU without a GPU has it."""
    e = {k: v for k, v in env().items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=ROOT,
                          timeout=timeout)


def assert_refused_without_interpreter(code: str, flag: str) -> None:
    """Python `code`, run as on a CPU without a GPU (python_without_interpreter), fails with the Triton kernels'
    refusal (shared/kernels.require_cuda_or_interpreter), which names `flag`."""
    proc = python_without_interpreter(code)
    assert proc.returncode != 0 and "runs a Triton kernel on CUDA tensors, got cpu" in proc.stderr, proc.stderr[-2000:]
    assert "TRITON_INTERPRET=1" in proc.stderr and flag in proc.stderr


def torchrun(script: Path, nproc: int, args: list[str], timeout: int = 240, check: bool = True):
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                script, *args], timeout=timeout, check=check)


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def generate_error(capsys, argv: list[str]) -> str:
    """shared.tools.generate's refusal of argv: it exits 2; returns what it printed to stderr."""
    import pytest

    from shared.tools import generate

    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err
