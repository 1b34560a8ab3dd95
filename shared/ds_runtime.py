"""Readers of a live DeepSpeedEngine that both paths share. No deepspeed import: they receive the engine."""

from __future__ import annotations

import statistics

# DeepSpeed's per-micro-step timer names (deepspeed/utils/timer.py), filled with "wall_clock_breakdown": true.
BREAKDOWN_TIMERS = {"forward": "fwd_microstep", "backward": "bwd_microstep", "step": "step_microstep"}


class BreakdownCollector:
    """Collects DeepSpeed's own synchronized fwd/bwd/step timers, micro-step by micro-step.

    With wall_clock_breakdown on, DeepSpeed synchronizes the device around each phase, prints the timers and
    resets them at every step; `engine.get_wall_clock_timers()` holds the last micro-step's values (ms), so we
    read it after each engine.step(). It is a diagnostic cross-check of the PhaseTimer, never the measurement:
    the syncs it adds slow the step down.
    """

    def __init__(self, engine):
        self.engine = engine
        self.enabled = bool(engine.wall_clock_breakdown())
        self.records: list[dict[str, float]] = []

    def collect(self) -> None:
        if self.enabled:
            timers = self.engine.get_wall_clock_timers()
            self.records.append({p: timers[n] for p, n in BREAKDOWN_TIMERS.items() if n in timers})

    def summary(self, skip_micro_steps: int) -> dict[str, float] | None:
        """Median ms per micro-step of each phase, warmup skipped; None when the breakdown was off."""
        timed = self.records[skip_micro_steps:]
        if not self.enabled or not timed:
            return None
        return {p: statistics.median(r[p] for r in timed if p in r) for p in BREAKDOWN_TIMERS if p in timed[0]}


def grad_norm(engine) -> float | None:
    """The global gradient norm of the last step (DeepSpeed computes it for clipping); None before the first.

    DeepSpeed may keep it as a device tensor, so reading it syncs: call it once per log interval, not per step.
    """
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def progress_extras(scheduler, engine, device):
    """What progress lines and the CSV log add to the loss: LR, grad norm, peak memory (read per interval)."""
    import torch

    cuda = device.type == "cuda"
    return lambda: {"lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm(engine),
                    "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
