"""Per-step losses and progress lines for long runs, without a per-step host sync.

Each step's loss is written into a device-side buffer (one tiny kernel, no sync). Every `log_every` steps the
buffer is copied to pinned host memory with non_blocking=True and an event recorded; the line is printed at a
later step, once that event has completed (event.query() never blocks). So a progress line arrives at most one
log interval late and costs one async copy of a few bytes and a timer poll per interval: nothing per step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shared.timing import PhaseTimer


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
    def __init__(self, steps: int, device: torch.device, timer: PhaseTimer, flops_per_step_per_gpu: float,
                 log_every: int, enabled: bool, prefix: str = ""):
        self.steps, self.device, self.timer = steps, device, timer
        self.flops = flops_per_step_per_gpu
        self.log_every, self.enabled, self.prefix = log_every, enabled, prefix
        self.losses = torch.zeros(steps, device=device, dtype=torch.float32)
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[int, torch.Tensor, object]] = []
        self._t0 = time.perf_counter()

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
            self._print(step, float(host))

    def _print(self, step: int, loss: float) -> None:
        self.timer.poll()
        recent = [s["total"] for s in self.timer.steps[-self.log_every:]]
        line = f"{self.prefix}step {step + 1:>6}/{self.steps} | loss {loss:8.4f}"
        if recent:
            step_s = sorted(recent)[len(recent) // 2]
            eta = step_s * (self.steps - step - 1)
            line += f" | {step_s * 1e3:8.1f} ms/step | {self.flops / step_s / 1e12:7.2f} TFLOPs/GPU"
            line += f" | ETA {_fmt_duration(eta)}"
        line += f" | elapsed {_fmt_duration(time.perf_counter() - self._t0)}"
        print(line, flush=True)

    def finish(self) -> list[float]:
        """Print what is pending; return every step's loss averaged over ranks (one all-reduce, at the end).

        Progress lines show rank 0's own loss; the returned losses are the global means.
        """
        if self.enabled:
            self._flush(block=True)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.losses)
            self.losses /= dist.get_world_size()
        return self.losses.tolist()
