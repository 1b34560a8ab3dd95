"""One training step under torch.profiler, summarized per phase and per kind of kernel (`--profile_step N`).

The PhaseTimer (shared/train/timing.py) drives it in both paths and in the reference rows: the profiler starts at
the boundary before step N (counted from the run's first step, 0) and stops at that step's last mark. Inside the
profiled step every phase boundary synchronizes the device, so each phase's kernels run inside that phase's host
range and can be told apart by time; that perturbs only this step, which must be a warm-up step (excluded from
every timing figure; TrainConfig checks it). The syncs drain the device's queue at each boundary, so the step's
idle time includes what the host does before the next phase's first kernel, which a timed step may hide behind
queued work. `--profile_sync false` profiles the step as timed steps run: no sync before it or at its boundaries
(one after its last mark, before the profiler stops); each kernel is then attributed to the phase that launched
it and each phase's wall is its stretch of the device's timeline (device_ranges), so the step's wall and idle are
those of a step in flight (only the profiler's own start and recording slow its host), and each phase also gets
the host's own time in it (`host_wall_ms`) and its lead over the device when it began (`host_lead_ms`, host_leads).

The summary (the run JSON's `extra.profile`) holds, for the step and for each phase (data, forward, backward,
step): wall ms, the ms at least one kernel ran (busy), idle = wall - busy, the kernels' summed ms per kind
(KINDS, matched on the kernel name in that order) and the top kernels by summed ms. On a CPU there are no device
kernels: the top operators by self CPU time stand in for them and `device` says "cpu".

On a GPU each phase's idle time is also split by cause (`idle`, see idle_causes): `host_ms`, the device idle
before the host had launched the next kernel (the host was behind), with the host operators that ran in those
windows (`host_ops`, the innermost operator of the thread that launched the next kernel; "(no operator)" is host
code the profiler saw no operator for, e.g. Python between calls; `host_inclusive`, every operator open then);
`queued_ms`, idle although the next kernel was already launched (a wait on another stream's event, or launch
latency); `unlinked_ms`, gaps before kernels without a launch record.

With `--profile_stack` the profiler also records every Python call (with_stack): the host code the device waited on
is then named down to the Python function ("file.py(line): function" entries among the operators, longer lists;
`python_frames` says whether any were recorded, with a warning when none were). The tracing slows the host, so that
step's idle milliseconds grow; the names are the point.
"""

from __future__ import annotations

import bisect
import re
import warnings

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
TOP_HOST = 10  # host operators listed per phase under idle.host_ops
TOP_FRAMES = 15  # enclosing operators listed per phase under idle.host_inclusive
TOP_WITH_STACK = 40  # both lists' length when Python frames are recorded (--profile_stack)
NO_OP = "(no operator)"
RANGE = "zero3bench/"  # the record_function ranges that mark each phase on the host
PY_FRAME = re.compile(r"^(<built-in |\S+\.py\(\d+\): )")  # torch.profiler's names of Python calls (with_stack)


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


def innermost(ops: list[tuple[str, float, float]]) -> list[tuple[float, float, str, tuple[str, ...]]]:
    """Host operators of one thread, (name, start_us, end_us), nested -> the timeline of the innermost one: sorted,
    non-overlapping (start, end, name, enclosing) segments, `enclosing` the names of every operator open then,
    outermost first; time covered by no operator has no segment. A child that outlasts its parent is cut at the
    parent's end."""
    segs: list[tuple[float, float, str, tuple[str, ...]]] = []
    stack: list[tuple[str, float, float]] = []
    t = float("-inf")

    def emit(upto: float) -> None:
        nonlocal t
        if stack and upto > t:
            segs.append((t, upto, stack[-1][0], tuple(s[0] for s in stack)))
        t = max(t, upto)

    for name, a, b in sorted(ops, key=lambda o: (o[1], -o[2])):
        while stack and stack[-1][2] <= a:
            emit(stack[-1][2])
            stack.pop()
        if stack:
            emit(a)
            b = min(b, stack[-1][2])
        else:
            t = a
        stack.append((name, a, b))
    while stack:
        emit(stack[-1][2])
        stack.pop()
    return segs


def idle_causes(kernels: list[tuple], ranges: list[tuple[str, float, float]],
                host: dict[int, list[tuple[float, float, str]]], main: int,
                top: tuple[int, int] = (TOP_HOST, TOP_FRAMES)) -> dict:
    """Split the idle time of some host ranges (one phase's) by cause. kernels: (name, start_us, end_us, launch),
    each inside one of the ranges, launch = (launch_us, host thread) or None; host: innermost() per thread; main:
    the thread that marks the phases.

    Each gap in the device's busy timeline (from the range's start, between kernels, up to the range's end) is
    host time up to the next kernel's launch (or to the range's end after the last kernel) and queued time after
    it; the host part is credited to the innermost operator of the launching thread (the autograd engine's thread
    launches the backward's kernels; after the last kernel, the main thread) at each instant, and to every operator
    open then (`host_inclusive`: which call the host was inside)."""
    by_op: dict[str, float] = {}
    inclusive: dict[str, float] = {}
    host_us = queued_us = unlinked_us = 0.0

    def credit(a: float, b: float, thread: int) -> None:
        segs = host.get(thread, [])
        i = max(0, bisect.bisect_right(segs, (a, float("inf"))) - 1)
        covered = 0.0
        while i < len(segs) and segs[i][0] < b:
            sa, sb, name, enclosing = segs[i]
            d = min(b, sb) - max(a, sa)
            if d > 0:
                by_op[name] = by_op.get(name, 0.0) + d
                for n in set(enclosing):
                    inclusive[n] = inclusive.get(n, 0.0) + d
                covered += d
            i += 1
        if b - a - covered > 0:
            by_op[NO_OP] = by_op.get(NO_OP, 0.0) + (b - a - covered)

    for _, r0, r1 in ranges:
        frontier = r0
        for _, a, b, launch in sorted((k for k in kernels if r0 <= k[1] < r1), key=lambda k: k[1]):
            if a > frontier:
                if launch is None:
                    unlinked_us += a - frontier
                else:
                    cut = min(max(launch[0], frontier), a)
                    credit(frontier, cut, launch[1])
                    host_us += cut - frontier
                    queued_us += a - cut
            frontier = max(frontier, b)
        if r1 > frontier:  # after the last kernel: the host had nothing more to launch before the phase's mark
            credit(frontier, r1, main)
            host_us += r1 - frontier

    def listed(d: dict, n: int) -> list[dict]:
        return [{"name": k[:160], "ms": us / 1e3} for k, us in sorted(d.items(), key=lambda kv: -kv[1])[:n]]

    return {"host_ms": host_us / 1e3, "queued_ms": queued_us / 1e3, "unlinked_ms": unlinked_us / 1e3,
            "host_ops": listed(by_op, top[0]), "host_inclusive": listed(inclusive, top[1])}


def _by_range(kernels: list[tuple], ranges: list[tuple[str, float, float]], when) -> tuple[list, list]:
    """The kernels whose time `when(kernel)` (None: none) lies in each of the sorted ranges, and the rest."""
    starts = [a for _, a, _ in ranges]
    per: list[list] = [[] for _ in ranges]
    rest = []
    for k in kernels:
        t = when(k)
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        if i >= 0 and t < ranges[i][2]:
            per[i].append(k)
        else:
            rest.append(k)
    return per, rest


def _launch_time(kernel: tuple) -> float | None:
    return kernel[3][0] if len(kernel) > 3 and kernel[3] is not None else None


def device_ranges(kernels: list[tuple], ranges: list[tuple[str, float, float]]) -> tuple[list, list, list]:
    """A step profiled without syncs (--profile_sync false): the kernels each phase launched and the stretch of the
    device's timeline that is that phase's. kernels: (name, start_us, end_us, launch); ranges: the host ranges,
    sorted. A kernel belongs to the range its launch lies in, one without a launch record to the device range it
    started in; the rest (launched before or after the step, e.g. the previous step's last kernels) are returned
    apart. The device ranges tile the step's device time: the step starts where the work before it ended (the end
    of the last earlier kernel, else its own first kernel's start) and each range ends at the latest end of its
    kernels (or where the previous one ended). Returns (device ranges, the kernels of each range, the rest)."""
    per, rest = _by_range(kernels, ranges, _launch_time)
    mine = [k for ks in per for k in ks]
    if not mine:
        raise ValueError("no kernel was launched inside the profiled step's phases: nothing to attribute")
    first = min(k[1] for k in mine)
    t = max((k[2] for k in rest if k[2] <= first), default=first)
    out = []
    for (phase, _, _), ks in zip(ranges, per):
        end = max([t] + [k[2] for k in ks])
        out.append((phase, t, end))
        t = end
    # a kernel without a launch record that started inside the step goes to the range it started in (unlinked)
    ends = [r[2] for r in out]
    keep = []
    for k in rest:
        i = bisect.bisect_right(ends, k[1])
        if _launch_time(k) is None and out[0][1] <= k[1] and i < len(out):
            per[i].append(k)
        else:
            keep.append(k)
    return out, per, keep


def host_leads(kernels: list[tuple], ranges: list[tuple[str, float, float]]) -> dict[str, dict]:
    """A step profiled without syncs: per phase, how far the host ran ahead of the device. `host_wall_ms`: the host's
    own time in the phase (its ranges summed); `host_lead_ms`: the device work still queued when the host began
    the phase, i.e. the latest end of the kernels launched before that moment (or, without a launch record, started
    before it) minus the moment; the least over the phase's ranges (micro-steps); negative: the device had been idle
    that long, waiting for the host; None: no kernel ran before it in the profile. A lead near zero or below at
    every phase is a host that never gets ahead: a sync, or a host slower than the device over the whole step."""
    out: dict[str, dict] = {}
    for phase, a, b in sorted(ranges, key=lambda r: r[1]):
        ends = [k[2] for k in kernels if (_launch_time(k) is not None and _launch_time(k) < a)
                or (_launch_time(k) is None and k[1] < a)]
        lead = (max(ends) - a) / 1e3 if ends else None
        entry = out.setdefault(phase, {"host_wall_ms": 0.0, "host_lead_ms": lead})
        entry["host_wall_ms"] += (b - a) / 1e3
        if lead is not None and (entry["host_lead_ms"] is None or lead < entry["host_lead_ms"]):
            entry["host_lead_ms"] = lead
    return out


def _clipped(ks: list, r0: float, r1: float) -> list:
    """The kernels' intervals cut to [r0, r1] (a kernel of one phase that began while the previous one's ran)."""
    return [(k[0], max(k[1], r0), min(k[2], r1), *k[3:]) for k in ks if min(k[2], r1) > max(k[1], r0)]


def summarize(kernels: list[tuple], ranges: list[tuple[str, float, float]], device: str,
              host: dict[int, list] | None = None, main: int = 0, python_frames: bool | None = None,
              synced: bool = True) -> dict:
    """kernels: (name, start_us, end_us[, launch]) on the device; ranges: (phase, start_us, end_us) on the host, the
    same clock, one per phase of each micro-step. Each kernel goes to the range that holds its start; kernels
    outside every range are counted apart (`unattributed_ms`), never dropped. With `host` (innermost() of each
    thread's operators), `main` and the kernels' launches, each phase also gets `idle` (idle_causes).
    `python_frames` (given for a --profile_stack profile: whether Python calls are among the host operators) is
    recorded, and when true the idle lists are TOP_WITH_STACK long. `synced` false (a step profiled as timed steps
    run, without syncs at its phase boundaries): each kernel goes to the phase that launched it and the phases'
    walls are their stretches of the device's timeline (device_ranges); busy and idle are counted inside them."""
    if not ranges:
        raise ValueError("no phase ranges in the profile: the step's marks were not recorded")
    ranges = sorted(ranges, key=lambda r: r[1])
    leads = {} if synced else host_leads(kernels, ranges)
    if synced:  # each kernel ran inside the host range that launched it: attribute by start time
        per, loose = _by_range(kernels, ranges, lambda k: k[1])
    else:
        ranges, per, loose = device_ranges(kernels, ranges)
        # what ran before the step (the previous step's tail) is not this step's: counted only inside its span
        loose = _clipped(loose, ranges[0][1], ranges[-1][2])
    groups: dict[str, list] = {p: [] for p, _, _ in ranges}
    inside: dict[str, list] = {p: [] for p in groups}  # the kernels' intervals inside the phase's ranges
    of_phase: dict[str, list] = {p: [] for p in groups}
    walls = dict.fromkeys(groups, 0.0)
    for r, ks in zip(ranges, per):
        p, a, b = r
        of_phase[p].append(r)
        walls[p] += b - a
        groups[p].extend(ks)
        inside[p].extend(ks if synced else _clipped(ks, a, b))

    idle_top = (TOP_WITH_STACK, TOP_WITH_STACK) if python_frames else (TOP_HOST, TOP_FRAMES)  # idle lists' lengths

    def part(ks: list, wall_us: float, busy_ks: list, phase: str | None = None) -> dict:
        by_kind: dict[str, float] = {}
        by_name: dict[str, list] = {}
        for name, a, b, *_ in ks:
            kind = kind_of(name)
            by_kind[kind] = by_kind.get(kind, 0.0) + (b - a) / 1e3
            entry = by_name.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += (b - a) / 1e3
        busy = _busy([(a, b) for _, a, b, *_ in busy_ks]) / 1e3
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP]
        out = {"wall_ms": wall_us / 1e3, "busy_ms": busy, "idle_ms": max(0.0, wall_us / 1e3 - busy),
               "kernels": len(ks), "kernel_ms": sum(by_kind.values()),
               "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
               "top": [{"name": n[:160], "kind": kind_of(n), "calls": c, "ms": ms} for n, (c, ms) in top]}
        if host is not None and phase is not None:
            out["idle"] = idle_causes(busy_ks, of_phase[phase], host, main, idle_top)
        return out

    return {"device": device, **({"python_frames": python_frames} if python_frames is not None else {}),
            **({} if synced else {"synced": False}),
            "step": part([k for g in groups.values() for k in g], sum(walls.values()),
                         [k for g in inside.values() for k in g]),
            "phases": {p: {**part(groups[p], walls[p], inside[p], p), **leads.get(p, {})} for p in groups},
            "unattributed_ms": sum(b - a for _, a, b, *_ in loose) / 1e3}


class StepProfiler:
    """Profiles one step; PhaseTimer calls begin() at the step's first boundary and phase() at each mark."""

    def __init__(self, cuda: bool, phases: tuple[str, ...], with_stack: bool = False, synced: bool = True):
        self.cuda = cuda
        self.with_stack = with_stack  # record Python calls too (--profile_stack)
        # --profile_sync false: no sync before the step or at its phase boundaries, only after its last mark (so
        # that every kernel it launched is recorded before the profiler stops)
        self.synced = synced
        self.phases = phases  # PhaseTimer's, in the order they are marked
        self.prof = None
        self._range = None
        self.summary: dict | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def begin(self) -> None:
        if self.synced:
            self._sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, with_stack=self.with_stack)
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
        if self.synced or last:
            self._sync()
        self._range.__exit__(None, None, None)
        if not last:
            self._open(self.phases[(self.phases.index(ended) + 1) % len(self.phases)])
            return
        self.prof.__exit__(None, None, None)
        self.summary = self._summarize()
        self.prof = None

    def _python_calls(self) -> list[tuple[str, float, float, int]]:
        """The Python calls the profiler recorded (with_stack), as (name, start_us, end_us, thread) on the clock of
        its events: read from its event tree, which holds them in every torch version (events() lists them only in
        some)."""
        try:
            from torch._C._profiler import _EventType

            results = self.prof.profiler.kineto_results
            t0, out, todo = results.trace_start_ns(), [], list(results.experimental_event_tree())
        except (ImportError, AttributeError, RuntimeError) as e:  # a torch whose profiler lacks the tree
            warnings.warn(f"--profile_stack: cannot read the profiler's Python calls ({e!r})", stacklevel=2)
            return []
        while todo:
            node = todo.pop()
            todo.extend(node.children)
            if node.tag in (_EventType.PyCall, _EventType.PyCCall):
                out.append((node.name, (node.start_time_ns - t0) / 1e3, (node.end_time_ns - t0) / 1e3, node.start_tid))
        return out

    def _summarize(self) -> dict:
        events = self.prof.events()
        ranges = [(e.name[len(RANGE):], e.time_range.start, e.time_range.end) for e in events
                  if e.name.startswith(RANGE) and e.device_type == torch.autograd.DeviceType.CPU]
        if self.cuda:
            cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
            # A kernel's launch is the runtime or driver call (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync,
            # ...) with the kernel's correlation id.
            launches = {e.id: (e.time_range.start, e.thread) for e in cpu
                        if e.name.startswith("cu") and not PY_FRAME.match(e.name)}
            kernels = [(e.name, e.time_range.start, e.time_range.end, launches.get(e.id)) for e in events
                       if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
            ops: dict[int, list] = {}
            calls = self._python_calls() if self.with_stack else []
            if self.with_stack and not calls:
                warnings.warn(f"--profile_stack: torch {torch.__version__}'s profiler recorded no Python calls in the "
                              "profiled step; its idle causes name operators only (python_frames false)",
                              stacklevel=2)
            for name, a, b, thread in [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in cpu
                                       if not (calls and PY_FRAME.match(e.name))] + calls:
                if not name.startswith(RANGE):  # " at 0x...": one name per built-in, whatever object it is bound to
                    ops.setdefault(thread, []).append((re.sub(r" at 0x[0-9a-f]+", "", name), a, b))
            main = next((e.thread for e in cpu if e.name.startswith(RANGE)), 0)
            return summarize(kernels, ranges, "cuda", {t: innermost(o) for t, o in ops.items()}, main,
                             python_frames=bool(calls) if self.with_stack else None, synced=self.synced)
        # CPU: the operators' self time stands in for kernels (top-level aten ops, each with its own interval)
        ops = [(e.name, e.time_range.start, e.time_range.start + e.self_cpu_time_total) for e in events
               if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")
               and e.self_cpu_time_total > 0]
        return summarize(ops, ranges, "cpu")
