"""One training step under torch.profiler, summarized per phase and per kind of kernel (`--profile_step N`).

The PhaseTimer (shared/train/timing.py) drives it in both paths and in the reference rows: the profiler starts at
the boundary before step N (counted from the run's first step, 0) and stops at that step's last mark. Inside the
profiled step every phase boundary synchronizes the device, so each phase's kernels run inside that phase's host
range and can be told apart by time; that perturbs only this step, which must be a warm-up step (excluded from
every timing figure; TrainConfig checks it).

The summary (the run JSON's `extra.profile`) holds, for the step and for each phase (data, forward, backward,
step): wall ms, the ms at least one kernel ran (busy), idle = wall - busy, the kernels' summed ms per kind
(KINDS, matched on the kernel name in that order) and the top kernels by summed ms. On a CPU there are no device
kernels: the top operators by self CPU time stand in for them and `device` says "cpu".
"""

from __future__ import annotations

import bisect
import re

import torch

# Kinds of device work, matched in this order on the kernel's name (lower case); the first match wins.
KINDS = (
    ("compiled (triton)", r"^triton_"),  # first: inductor names its kernels after their ops (`_to_copy`, `sdpa`)
    ("communication", r"nccl"),
    ("attention", r"cudnn|flash|fmha|attn|attention|sdpa"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|wgmma|cublas|splitk|^aten::(addmm|mm|bmm|matmul)$"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copy and fill", r"memcpy|memset|copy|fill|cat_|catarray"),
)
TOP = 15  # kernels listed per phase
RANGE = "zero3bench/"  # the record_function ranges that mark each phase on the host


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(kernels: list[tuple[str, float, float]], ranges: list[tuple[str, float, float]], device: str) -> dict:
    """kernels: (name, start_us, end_us) on the device; ranges: (phase, start_us, end_us) on the host, the same
    clock, one per phase of each micro-step. Each kernel goes to the range that holds its start; kernels outside
    every range are counted apart (`unattributed_ms`), never dropped."""
    if not ranges:
        raise ValueError("no phase ranges in the profile: the step's marks were not recorded")
    ranges = sorted(ranges, key=lambda r: r[1])
    starts = [a for _, a, _ in ranges]
    groups: dict[str, list] = {p: [] for p, _, _ in ranges}
    walls = dict.fromkeys(groups, 0.0)
    for p, a, b in ranges:
        walls[p] += b - a
    loose = []
    for k in kernels:
        i = bisect.bisect_right(starts, k[1]) - 1
        if i >= 0 and k[1] < ranges[i][2]:
            groups[ranges[i][0]].append(k)
        else:
            loose.append(k)

    def part(ks: list, wall_us: float) -> dict:
        by_kind: dict[str, float] = {}
        by_name: dict[str, list] = {}
        for name, a, b in ks:
            kind = kind_of(name)
            by_kind[kind] = by_kind.get(kind, 0.0) + (b - a) / 1e3
            entry = by_name.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += (b - a) / 1e3
        busy = _busy([(a, b) for _, a, b in ks]) / 1e3
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP]
        return {"wall_ms": wall_us / 1e3, "busy_ms": busy, "idle_ms": max(0.0, wall_us / 1e3 - busy),
                "kernels": len(ks), "kernel_ms": sum(by_kind.values()),
                "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
                "top": [{"name": n[:160], "kind": kind_of(n), "calls": c, "ms": ms} for n, (c, ms) in top]}

    return {"device": device, "step": part([k for g in groups.values() for k in g], sum(walls.values())),
            "phases": {p: part(groups[p], walls[p]) for p in groups},
            "unattributed_ms": sum(b - a for _, a, b in loose) / 1e3}


class StepProfiler:
    """Profiles one step; PhaseTimer calls begin() at the step's first boundary and phase() at each mark."""

    def __init__(self, cuda: bool, phases: tuple[str, ...]):
        self.cuda = cuda
        self.phases = phases  # PhaseTimer's, in the order they are marked
        self.prof = None
        self._range = None
        self.summary: dict | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def begin(self) -> None:
        self._sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.__enter__()
        self._open(self.phases[0])

    def _open(self, phase: str) -> None:
        self._range = torch.autograd.profiler.record_function(RANGE + phase)
        self._range.__enter__()

    def abandon(self) -> None:
        """Stop without a summary (a pause between steps, or the run ended before the step)."""
        self._range.__exit__(None, None, None)
        self.prof.__exit__(None, None, None)
        self.prof = None

    def phase(self, ended: str, last: bool) -> None:
        """`ended` just ended; `last`: it was the step's last mark, so the profile stops and is summarized."""
        self._sync()
        self._range.__exit__(None, None, None)
        if not last:
            self._open(self.phases[(self.phases.index(ended) + 1) % len(self.phases)])
            return
        self.prof.__exit__(None, None, None)
        self.summary = self._summarize()
        self.prof = None

    def _summarize(self) -> dict:
        events = self.prof.events()
        ranges = [(e.name[len(RANGE):], e.time_range.start, e.time_range.end) for e in events
                  if e.name.startswith(RANGE) and e.device_type == torch.autograd.DeviceType.CPU]
        if self.cuda:
            kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
                       if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
            return summarize(kernels, ranges, "cuda")
        # CPU: the operators' self time stands in for kernels (top-level aten ops, each with its own interval)
        ops = [(e.name, e.time_range.start, e.time_range.start + e.self_cpu_time_total) for e in events
               if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")
               and e.self_cpu_time_total > 0]
        return summarize(ops, ranges, "cpu")
