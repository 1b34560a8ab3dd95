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
import warnings

import torch

from shared.train.sync_check import SyncCheck

PHASES = ("data", "forward", "backward", "step")


class PhaseTimer:
    """Marks arrive as data, forward, backward, step, repeated `micro_steps` times per optimizer step."""

    def __init__(self, device: torch.device, micro_steps: int = 1, profile_step: int | None = None,
                 profile_stack: bool = False, profile_sync: bool = True, sync_check_step: int | None = None):
        self.cuda = device.type == "cuda"
        if sync_check_step is not None and not self.cuda:
            raise ValueError(f"--sync_check_step {sync_check_step} records CUDA synchronizations; this run's device is "
                             f"{device.type}")
        self.micro_steps = micro_steps
        # --profile_step: that step (counted from this run's first, 0) runs under torch.profiler
        # (shared/train/step_profile.py); its summary is summary()["profile"]
        self.profile_step = profile_step
        self.profile_stack = profile_stack  # --profile_stack: Python frames in that profile too
        self.profile_sync = profile_sync  # --profile_sync: device syncs at that step's phase boundaries
        self._profiler = None
        self.profile: dict | None = None
        # --sync_check_step: that step's synchronizing CUDA calls (shared/train/sync_check.py), summary()["syncs"]
        self.sync_check_step = sync_check_step
        self._sync_check = None
        self.syncs: dict | None = None
        self._last = None  # the most recent mark (a boundary)
        self._current: list | None = None  # [(phase, mark), ...] of the step being recorded, first = its start
        self._open: list[list] = []  # recorded steps not yet resolved
        self.steps: list[dict[str, float]] = []  # resolved per-step phase sums in seconds, plus "total"
        # Host wall-clock times (time.time()) of the first start() and of each step's last mark: where the timed
        # steps lie in time, for readings taken beside the run (harness/telemetry.py)
        self.wall_started: float | None = None
        self.wall_done: list[float] = []

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        """Mark the boundary before the first step's data fetch (again after a validation or save)."""
        if self._profiler is not None and self._current is None:  # begun at the boundary: restart it after the pause
            self._profiler.abandon()
            self._profiler = None
        if self._sync_check is not None and self._current is None:  # likewise
            self._sync_check.abandon()
            self._sync_check = None
        self._maybe_profile()
        self._last = self._now()
        if self.wall_started is None:
            self.wall_started = time.time()

    def _maybe_profile(self) -> None:
        """At a step boundary: start the profiler (or the sync check) if the next step is the one to profile."""
        done = len(self.steps) + len(self._open)  # steps whose marks are complete
        if self.sync_check_step == done and self._sync_check is None and self.syncs is None:
            self._sync_check = SyncCheck(done, self._phase_in_progress)
            self._sync_check.begin()
        if self.profile_step == done and self._profiler is None and self.profile is None:
            from shared.train.step_profile import StepProfiler

            self._profiler = StepProfiler(self.cuda, PHASES, with_stack=self.profile_stack,
                                          synced=self.profile_sync)
            self._profiler.begin()

    def _phase_in_progress(self) -> str:
        return PHASES[(len(self._current) - 1) % len(PHASES)] if self._current else PHASES[0]

    def mark(self, phase: str) -> None:
        """Record the end of `phase`; marks cycle through PHASES, micro_steps times per optimizer step."""
        if self._last is None:
            raise RuntimeError("PhaseTimer.start() was not called")
        if self._current is None:
            self._current = [("start", self._last)]
        expected = self._phase_in_progress()
        if phase != expected:
            raise RuntimeError(f"phase {phase!r} marked where {expected!r} was expected")
        self._last = self._now()
        self._current.append((phase, self._last))
        done = len(self._current) - 1 == len(PHASES) * self.micro_steps
        if self._profiler is not None:
            self._profiler.phase(phase, last=done)
        if done:
            self.wall_done.append(time.time())
            self._open.append(self._current)
            self._current = None
            if self._profiler is not None:  # the profiled step ended: keep the summary, restart the clock
                self.profile, self._profiler = self._profiler.summary, None
                self._last = self._now()  # stopping and summarizing the profile is no step's time
            if self._sync_check is not None:
                self.syncs, self._sync_check = self._sync_check.end(), None
            self._maybe_profile()

    def close(self) -> None:
        """Stop a profile in progress without a summary (the run ends, or stops on an error)."""
        if self._profiler is not None:
            self._profiler.abandon()
            self._profiler = None
        if self._sync_check is not None:
            self._sync_check.abandon()
            self._sync_check = None

    def poll(self) -> None:
        """Resolve every finished step whose events have completed, without blocking."""
        while self._open:
            if self.cuda and not self._open[0][-1][1].query():
                return
            self._resolve(self._open.pop(0))

    def finish(self) -> None:
        """Block until every recorded step is resolved (one device sync, at the end of the run)."""
        if self.profile_step is not None and self.profile is None:  # also when one is still in progress
            warnings.warn(f"--profile_step {self.profile_step}: the run ended before that step did; no profile",
                          stacklevel=2)
        if self.sync_check_step is not None and self.syncs is None:
            warnings.warn(f"--sync_check_step {self.sync_check_step}: the run ended before that step did; no record",
                          stacklevel=2)
        self.close()
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
        # never time the profiled or the sync-checked step (a resumed run may exclude fewer steps)
        if self.profile is not None:
            skip = max(skip, self.profile_step + 1)
        if self.syncs is not None:
            skip = max(skip, self.sync_check_step + 1)
        timed = self.steps[skip:]
        if not timed:
            raise ValueError(f"no timed steps: {len(self.steps)} recorded, {skip} skipped as warmup"
                             + (f" or profiled (--profile_step {self.profile_step})" if self.profile else ""))
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
            "profile": self.profile,
            "syncs": self.syncs,
            # [start of the first timed step, end of the last], host time (up to a step ahead of the device)
            "timed_wall": [self.wall_done[skip - 1] if skip else self.wall_started, self.wall_done[-1]],
        }
