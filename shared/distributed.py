"""Process-level set-up shared by both paths: environment defaults, device, seeds, clean exit."""

from __future__ import annotations

import gc
import os
import socket
import sys

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_env() -> None:
    """Let a plain `python train.py` run as a one-process world (torchrun and the deepspeed launcher set these)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def pick_device(require_gpus: int | None = None) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else the CPU; fails clearly when asked-for GPUs are absent."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if require_gpus and require_gpus > n_gpus:
        raise ValueError(f"{require_gpus} GPU(s) asked for but {n_gpus} available")
    if n_gpus == 0:
        return torch.device("cpu")
    if local_world > n_gpus:
        raise ValueError(f"{local_world} processes per node asked for but only {n_gpus} GPU(s) are available")
    torch.cuda.set_device(local_rank())
    return torch.device("cuda", local_rank())


def check_precision(device: torch.device, precision: str) -> None:
    """Refuse, before DeepSpeed starts, a precision the device cannot run (DeepSpeed would fail mid-init)."""
    if device.type == "cpu" and precision == "fp16":
        raise ValueError("precision fp16 is not supported by DeepSpeed on CPU; use --precision bf16 or fp32")
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"precision bf16 is not supported on {name}; use --precision fp16 or fp32")


def oom_message(train, device: torch.device) -> str:
    """What to say when the first steps run out of device memory (a ValueError: exit 2, not a traceback)."""
    where = "the CPU"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    ckpt = ", with activation checkpointing" if train.activation_checkpointing else ""
    hint = "lower --micro_batch" + ("" if train.activation_checkpointing else " or add --activation_checkpointing")
    return (f"micro_batch {train.micro_batch} does not fit in {where}: preset {train.preset}, ZeRO-{train.stage}, "
            f"{train.precision}, seq_len {train.model().seq_len}{ckpt}; {hint}")


def run_cli(main, train, device_hint: str) -> None:
    """Run a path's main(train) as a command: a ValueError (bad input) exits 2 with its message, not a traceback."""
    try:
        main(train)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        exit_process(2, torch.device(device_hint))
    except SystemExit as e:  # preemption's exit code; DeepSpeed's autotuning experiments exit() after profiling
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr, flush=True)  # as Python prints sys.exit("message")
        exit_process(e.code if isinstance(e.code, int) else 0 if e.code is None else 1, torch.device(device_hint))
    exit_process(0, torch.device(device_hint))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def seed_all(seed: int) -> None:
    """Seed torch's CPU and CUDA generators (model init and dropout); data has its own (shared/data.py)."""
    torch.manual_seed(seed)


def apply_gc_policy(policy: str) -> None:
    """Python GC policy for the training loop, applied after set-up in both paths.

    `freeze` collects once and moves every object alive after set-up (modules, parameters, DeepSpeed's and
    Lightning's bookkeeping) to a permanent generation: automatic collections then scan only what the steps
    allocate, instead of pausing the host for a full scan of the process whenever the oldest generation fills.
    """
    if policy == "freeze":
        gc.collect()
        gc.freeze()


def dropout_seed(seed: int, rank: int) -> int:
    """Seed of the dropout stream of `rank`, set right before the first step in both paths."""
    return seed * 1000 + 17 + rank


def exit_process(code: int, device: torch.device) -> None:
    """Leave the process with `code`.

    On CPU, DeepSpeed 0.19.8's engine leaves a joinable C++ thread behind, and about half of the runs abort at
    interpreter teardown ("terminate called without an active exception", exit -6) after all work is done
    and the result is written. We flush and leave with os._exit there; on GPUs the normal exit path runs.
    """
    if device.type == "cpu":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
