"""--sync_check_step N: the calls of one training step that made the host wait for the device, each with the
Python code that made it.

A synchronizing call (`.item()`, `bool()` or `.tolist()` of a CUDA tensor, any device-to-host copy, a stream's
synchronize) empties the device's queue: until the host launches its next kernel, the device idles, however fast the
kernels are. A step without such a call lets the host run ahead and hides its Python behind queued kernels;
`--profile_step N --profile_sync false` shows where a step in flight idles, this names the calls behind it.

torch.cuda's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`) raises a warning at each synchronizing call
that goes through c10's CUDA helpers, including those of C++ extensions built against them. For the one step, each
warning is recorded with the phase it came in (data, forward, backward, step) and the Python stack at that moment,
and calls with the same phase and stack are counted together. Three limits: an explicit device-wide wait
(`torch.cuda.synchronize()`, c10's `device_synchronize`) and an event's synchronize raise no warning, nor does a C++
extension that calls the CUDA runtime directly; and a warning raised on the autograd engine's threads reaches Python
when `backward()` returns, so its stack ends at the engine's `run_backward` (the sync is inside the backward's C++ or
compiled code, not named further).
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # c10/cuda/CUDAFunctions.cpp warn_or_error_on_sync
STACK_FRAMES = 12  # innermost frames kept per call
_REPO = str(Path(__file__).resolve().parents[2]) + "/"


def short_path(path: str) -> str:
    """A frame's file as a reader finds it: relative to the import path it was found on (inside its package), or to
    this repository."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    if path.startswith(_REPO):
        return path[len(_REPO):]
    roots = [e.rstrip("/") + "/" for e in sys.path if e and e != "/" and path.startswith(e.rstrip("/") + "/")]
    return path[len(max(roots, key=len)):] if roots else path


def frames(stack: list[traceback.FrameSummary]) -> list[str]:
    """`file:line function` of the innermost STACK_FRAMES frames, outermost first, without the warnings machinery
    and this module."""
    kept = [f for f in stack
            if f.filename != __file__ and not f.filename.endswith(("/warnings.py", "<frozen warnings>"))]
    return [f"{short_path(f.filename)}:{f.lineno} {f.name}" for f in kept[-STACK_FRAMES:]]


class SyncCheck:
    """Records the synchronizing CUDA calls made between begin() and end(); `phase()` names the phase in progress."""

    def __init__(self, step: int, phase: Callable[[], str]):
        self.step = step
        self.phase = phase
        self.calls: dict[tuple[str, tuple[str, ...]], int] = {}
        self._catch = None
        self._mode = None

    def begin(self) -> None:
        self._catch = warnings.catch_warnings()  # restores the filters and showwarning on exit
        self._catch.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype feature")
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                key = (self.phase(), tuple(frames(traceback.extract_stack())))
                self.calls[key] = self.calls.get(key, 0) + 1
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")

    def _stop(self) -> None:
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
            self._catch.__exit__(None, None, None)
            self._catch = None

    def end(self) -> dict:
        """Stop recording; the step's record (extra.syncs of the result JSON)."""
        self._stop()
        calls = [{"phase": phase, "calls": n, "stack": list(stack)} for (phase, stack), n in self.calls.items()]
        by_phase: dict[str, int] = {}
        for c in calls:
            by_phase[c["phase"]] = by_phase.get(c["phase"], 0) + c["calls"]
        return {"step": self.step, "total": sum(by_phase.values()), "by_phase": by_phase, "syncs": calls}

    def abandon(self) -> None:
        self._stop()


def format_syncs(record: dict, indent: str = "") -> list[str]:
    """One line per recorded call: phase, count and the innermost frames of its stack."""
    head = (f"{indent}synchronizing CUDA calls in step {record['step']}: {record['total']}"
            + (" (" + ", ".join(f"{p} {n}" for p, n in record["by_phase"].items()) + ")" if record["total"] else ""))
    lines = [head]
    for c in record["syncs"]:
        where = " <- ".join(reversed(c["stack"][-3:]))
        lines.append(f"{indent}  {c['phase']:<8} x{c['calls']}  {where}")
    return lines
