"""Per-step losses, progress lines with ETA, CSV metrics and the NaN guard, without a per-step host sync.

Each step's loss is written into a device-side buffer (one tiny kernel, no sync). Every `log_every` steps the
buffer entry is copied to pinned host memory with non_blocking=True and an event recorded; the line is printed
at a later step, once that event has completed (event.query() never blocks). So a progress line arrives at most
one log interval late and costs one async copy of a few bytes and a timer poll per interval: nothing per step.
The same line feeds the CSV log (`--log_csv`) and the NaN guard: a non-finite loss stops the run at the
interval that sees it, and `check_finite()` (a sync, used before every checkpoint save) makes sure no checkpoint
is ever written after a non-finite step.
"""

from __future__ import annotations

import csv
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shared.train.timing import PhaseTimer

CSV_FIELDS = ("step", "loss", "lr", "grad_norm", "step_ms", "tflops_per_gpu", "mfu", "mem_gib", "elapsed_s")


class NonFiniteLoss(FloatingPointError):
    """A loss that is NaN or infinite: the run stops, the last complete checkpoint stays the one to resume."""


class NanGuard:
    """nan_policy=skip: before backward, the ranks agree (all-reduce MIN) whether the loss is finite everywhere;
    if not, every rank skips the step's backward and update together. One collective and one host sync per step:
    the price of skipping, which is why `stop` (checked at log intervals, no per-step sync) is the default."""

    def __init__(self, train, device: torch.device):
        self.enabled = train.nan_policy == "skip"
        self.max_skips, self.device = train.max_nan_skips, device
        self.skipped: list[int] = []

    def skip(self, loss: torch.Tensor, step: int) -> bool:
        if not self.enabled:
            return False
        finite = torch.isfinite(loss.detach()).float().reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if finite.item() == 1.0:
            return False
        self.skipped.append(step + 1)
        if len(self.skipped) > self.max_skips:
            raise NonFiniteLoss(f"{len(self.skipped)} non-finite losses (steps {self.skipped}), more than "
                                f"--max_nan_skips {self.max_skips}; stopping")
        print(f"non-finite loss at step {step + 1}: step skipped ({len(self.skipped)}/{self.max_skips})", flush=True)
        return True


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + f"] {100 * done / total:3.0f}%"


class Progress:
    def __init__(self, steps: int, device: torch.device, timer: PhaseTimer, flops_per_step_per_gpu: float,
                 log_every: int, enabled: bool, prefix: str = "", peak_flops: float | None = None,
                 csv_path: str | None = None, extras: Callable[[], dict] | None = None, first_step: int = 0,
                 stop_on_nan: bool = True, *, convention: str):
        self.steps, self.device, self.timer = steps, device, timer
        self.flops, self.peak = flops_per_step_per_gpu, peak_flops
        self.log_every, self.enabled, self.prefix = log_every, enabled, prefix
        self.first_step = first_step  # a resumed run starts here; losses before it are not in this run
        self.extras = extras or dict
        self.stop_on_nan = stop_on_nan  # False with nan_policy=skip: NanGuard has already dealt with each one
        self.losses = torch.zeros(steps, device=device, dtype=torch.float32)
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[int, torch.Tensor, object]] = []
        self._t0 = time.perf_counter()
        self.convention = convention  # how TFLOPs/GPU is counted, said once before the first line that has it
        self._legend = enabled
        self._csv = None
        if csv_path and enabled:
            path = Path(csv_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            new = not path.is_file() or path.stat().st_size == 0
            self._csv_file = open(path, "a", newline="")
            self._csv = csv.DictWriter(self._csv_file, fieldnames=CSV_FIELDS)
            if new:
                self._csv.writeheader()

    def record(self, step: int, loss: torch.Tensor) -> None:
        """Store step's loss (a device scalar) and, every log_every steps, print what has completed."""
        self.losses[step] = loss.detach().float()
        if not self.enabled:
            return
        if (step + 1) % self.log_every == 0 or step + 1 == self.steps:
            if self.cuda:
                host = torch.empty((), dtype=torch.float32, pin_memory=True)
                host.copy_(self.losses[step], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending.append((step, host, event))
            else:
                self._pending.append((step, self.losses[step].clone(), None))
        self._flush(block=False)

    def _flush(self, block: bool) -> None:
        while self._pending:
            step, host, event = self._pending[0]
            if event is not None and not event.query():
                if not block:
                    return
                event.synchronize()
            self._pending.pop(0)
            self._report(step, float(host))

    def _report(self, step: int, loss: float) -> None:
        if not math.isfinite(loss) and self.stop_on_nan:
            raise NonFiniteLoss(f"loss is {loss} at step {step + 1}; stopping (nan_policy=stop). Resume from the "
                                "last complete checkpoint with a lower --lr or --nan_policy skip")
        self.timer.poll()
        recent = [s["total"] for s in self.timer.steps[-self.log_every:]]
        row = {"step": step + 1, "loss": loss, "elapsed_s": time.perf_counter() - self._t0, **self.extras()}
        done = step + 1 - self.first_step
        line = f"{self.prefix}{_bar(step + 1, self.steps)} step {step + 1}/{self.steps} | loss {loss:.4f}"
        if recent:
            if self._legend:
                print(f"{self.prefix}ms/step: the median of the last {self.log_every} steps (warm-up "
                      f"steps too, the first lines); TFLOPs/GPU: {self.convention}", flush=True)
                self._legend = False
            step_s = statistics.median(recent)  # the median of the last log_every steps, as the result JSON takes it
            tflops = self.flops / step_s / 1e12
            row.update(step_ms=step_s * 1e3, tflops_per_gpu=tflops,
                       mfu=tflops * 1e12 / self.peak if self.peak else None)
            line += f" | {step_s * 1e3:.1f} ms/step | {tflops:.2f} TFLOPs/GPU"
            line += f" | ETA {_fmt_duration(step_s * (self.steps - step - 1))}"
        elif done > 0:
            line += f" | ETA {_fmt_duration(row['elapsed_s'] / done * (self.steps - step - 1))}"
        if "lr" in row:
            line += f" | lr {row['lr']:.2e}"
        print(line, flush=True)
        if self.stop_on_nan and row.get("grad_norm") is not None and not math.isfinite(row["grad_norm"]):
            raise NonFiniteLoss(f"gradient norm is {row['grad_norm']} at step {step + 1}; stopping (nan_policy=stop)")
        if self._csv is not None:
            self._csv.writerow({k: row.get(k) for k in CSV_FIELDS})
            self._csv_file.flush()

    def check_finite(self, upto_step: int) -> None:
        """Raise NonFiniteLoss if any loss of this run up to `upto_step` is not finite (a host sync)."""
        if not self.stop_on_nan:
            return
        seen = self.losses[self.first_step: upto_step + 1]
        bad = (~torch.isfinite(seen)).nonzero()
        if len(bad):
            step = self.first_step + int(bad[0]) + 1
            raise NonFiniteLoss(f"loss is {float(seen[int(bad[0])])} at step {step}; not saving a checkpoint after "
                                "it (nan_policy=stop)")

    def finish(self) -> list[float]:
        """Print what is pending; return this run's losses averaged over ranks (one all-reduce, at the end).

        Progress lines show rank 0's own loss; the returned losses are the global means.
        """
        if self.enabled:
            self._flush(block=True)
        if self._csv is not None:
            self._csv_file.close()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.losses)
            self.losses /= dist.get_world_size()
        return self.losses[self.first_step:].tolist()
