"""One PhaseTimer for both paths: per-step data / forward / backward / step times without extra host syncs.

A step is cut into four phases by four marks, each recorded where that phase ends:
    [previous step's "step" mark] data | forward | backward | step
On CUDA each mark is a CUDA event recorded on the current stream: recording costs ~2 us and never blocks the
host; events are read (elapsed_time) only once they have completed (event.query(), non-blocking) or at the end
of the run. On CPU, where work is synchronous, a mark is time.perf_counter().

What a phase contains, in both paths:
    data      fetching the batch and copying it to the device (Lightning: also its between-step bookkeeping)
    forward   model forward and loss
    backward  engine.backward (ZeRO reduce-scatter of gradients included)
    step      engine.step (clip, optimizer, ZeRO parameter updates), LR scheduler
"""

from __future__ import annotations

import statistics
import time

import torch

PHASES = ("data", "forward", "backward", "step")


class PhaseTimer:
    """Marks arrive as data, forward, backward, step, repeated `micro_steps` times per optimizer step."""

    def __init__(self, device: torch.device, micro_steps: int = 1):
        self.cuda = device.type == "cuda"
        self.micro_steps = micro_steps
        self._last = None  # the most recent mark (a boundary)
        self._current: list | None = None  # [(phase, mark), ...] of the step being recorded, first = its start
        self._open: list[list] = []  # recorded steps not yet resolved
        self.steps: list[dict[str, float]] = []  # resolved per-step phase sums in seconds, plus "total"

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        """Mark the boundary before the first step's data fetch."""
        self._last = self._now()

    def mark(self, phase: str) -> None:
        """Record the end of `phase`; marks cycle through PHASES, micro_steps times per optimizer step."""
        if self._last is None:
            raise RuntimeError("PhaseTimer.start() was not called")
        if self._current is None:
            self._current = [("start", self._last)]
        expected = PHASES[(len(self._current) - 1) % len(PHASES)]
        if phase != expected:
            raise RuntimeError(f"phase {phase!r} marked where {expected!r} was expected")
        self._last = self._now()
        self._current.append((phase, self._last))
        if len(self._current) - 1 == len(PHASES) * self.micro_steps:
            self._open.append(self._current)
            self._current = None

    def poll(self) -> None:
        """Resolve every finished step whose events have completed, without blocking."""
        while self._open:
            if self.cuda and not self._open[0][-1][1].query():
                return
            self._resolve(self._open.pop(0))

    def finish(self) -> None:
        """Block until every recorded step is resolved (one device sync, at the end of the run)."""
        if self.cuda:
            torch.cuda.synchronize()
        while self._open:
            self._resolve(self._open.pop(0))

    def _resolve(self, marks: list) -> None:
        step = dict.fromkeys(PHASES, 0.0)
        for (_, a), (phase, b) in zip(marks, marks[1:]):
            step[phase] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        step["total"] = sum(step[p] for p in PHASES)
        self.steps.append(step)

    def summary(self, skip: int) -> dict:
        """Median and spread of step time and each phase over the steps after the first `skip` (warmup)."""
        timed = self.steps[skip:]
        if not timed:
            raise ValueError(f"no timed steps: {len(self.steps)} recorded, {skip} skipped as warmup")
        totals = [s["total"] for s in timed]
        return {
            "n": len(timed),
            "step_time_s": {
                "median": statistics.median(totals),
                "mean": statistics.fmean(totals),
                "min": min(totals),
                "max": max(totals),
                "stdev": statistics.stdev(totals) if len(totals) > 1 else 0.0,
            },
            "phases_s": {p: statistics.median(s[p] for s in timed) for p in PHASES},
            "per_step_s": totals,
            # The excluded steps' wall time: compilation (torch.compile, DeepCompile's profiling and recompile),
            # autotuning and allocator warm-up land here, reported apart from every throughput figure.
            "warmup_s": sum(s["total"] for s in self.steps[:skip]),
        }
