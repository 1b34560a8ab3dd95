"""SIGTERM (preemption) handling both paths share: save a checkpoint, then leave.

A scheduler sends SIGTERM to every rank, but not at the same instant, so a rank must not act on its own flag:
one rank entering a checkpoint save (collectives) while another starts a training step deadlocks both. Every
CHECK_EVERY steps the ranks all-reduce their flags (MAX) and all stop at the same step if any rank was signalled.
That is one tiny all-reduce and one host sync per CHECK_EVERY steps, instead of Lightning's one per step (the
Lightning path runs Lightning's own broadcast at the same cadence: shared/patches/lightning.SigtermCheck).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

EXIT_CODE = 143  # 128 + SIGTERM: "terminated, checkpoint saved"
# Steps between the ranks' agreements on a SIGTERM: the default of the option it was (docs/ledger.md). Read when a
# Preemption is made (tests/inject.py lowers it, so that a test's SIGTERM is acted on at the next step).
CHECK_EVERY = 50


class Preemption:
    def __init__(self, device: torch.device):
        self.device, self.every = device, CHECK_EVERY
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = True

    def should_stop(self, step: int) -> bool:
        """Collective: call on every rank after every step; True on all ranks at once when any got SIGTERM."""
        if (step + 1) % self.every:
            return False
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.received  # one process: nothing to agree on, no sync
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
