"""The pieces of a training run the raw loop and the Lightning callbacks must do identically, written once:
the timer and progress set-up, the validation figures, and the peak memory reduced over ranks."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from shared.model import flops
from shared.train.config import TrainConfig
from shared.train.ds_runtime import progress_extras
from shared.train.progress import Progress
from shared.train.results import tflops_convention
from shared.train.timing import PhaseTimer


def slowed_step_left(train: TrainConfig, first_step: int, flag: str) -> int | None:
    """--profile_step or --sync_check_step (`flag`), unless this run (resumed at first_step) is too short for it:
    the step they slow is never timed, and slowing one of the last steps left would leave no step to time (and no
    result); then none, with a warning."""
    step, left = getattr(train, flag), train.steps - first_step
    if step is not None and step + 1 >= left:
        doing = "profiling" if flag == "profile_step" else "checking the syncs of"
        warnings.warn(f"--{flag} {step}: this run resumes with {left} step(s) left, and {doing} step {step} of them "
                      f"would leave none to time: it is not done", stacklevel=2)
        return None
    return step


def start_progress(train: TrainConfig, device: torch.device, rank: int, prefix: str, scheduler, engine,
                   first_step: int) -> tuple[PhaseTimer, Progress]:
    """The run's PhaseTimer and the Progress that reads it: per-GPU FLOPs of a step, the device's peak (CUDA only),
    progress lines on rank 0, the CSV log, LR / grad norm / memory extras."""
    timer = PhaseTimer(device, micro_steps=train.grad_accum,
                       profile_step=slowed_step_left(train, first_step, "profile_step"),
                       profile_stack=train.profile_stack, profile_sync=train.profile_sync,
                       sync_check_step=slowed_step_left(train, first_step, "sync_check_step"))
    per_gpu_flops = flops.step_flops(train.model(), train.micro_batch * train.grad_accum, train.flops_factor)
    cuda = device.type == "cuda"
    # fp8 runs: against the bf16 peak, as the run JSON's mfu (shared/train/results.py keeps the FP8 peak's too)
    peak = flops.peak_flops(torch.cuda.get_device_name(device), train.tensor_precision) if cuda else None
    progress = Progress(train.steps, device, timer, per_gpu_flops, train.log_every, enabled=rank == 0,
                        prefix=prefix, peak_flops=peak, csv_path=train.log_csv, first_step=first_step,
                        stop_on_nan=train.nan_policy == "stop", extras=progress_extras(scheduler, engine, device),
                        convention=tflops_convention(train.flops_factor))
    return timer, progress


def validation_figures(step: int, mean_loss: float) -> dict:
    """One validation's record: the step, the mean loss and its perplexity (exp clamped: an early, diverged
    model's loss must not overflow the JSON)."""
    return {"step": step, "val_loss": mean_loss, "val_ppl": math.exp(min(mean_loss, 50.0))}


def format_validation(prefix: str, v: dict) -> str:
    return f"{prefix}validation at step {v['step']}: loss {v['val_loss']:.4f}, perplexity {v['val_ppl']:.2f}"


def peak_memory_bytes(device: torch.device) -> float | None:
    """The largest peak of allocated device memory over all ranks (collective: every rank calls it, once, after
    the timed region); None off CUDA."""
    cuda = device.type == "cuda"
    peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)) if cuda else 0.0, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item() if cuda else None
