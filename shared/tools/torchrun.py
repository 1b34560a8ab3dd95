"""torchrun for preemptible jobs: torchrun's own arguments, and a stop by a signal ends it with that signal's status.

    python -m shared.tools.torchrun --standalone --nproc_per_node 2 plain_deepspeed/train.py --ckpt_dir ckpt ...

A SIGTERM to torchrun (a scheduler's preemption) reaches the training processes, which save a checkpoint at their
next agreed step and exit 143 (shared/train/preemption.py). torchrun itself then raises the signal again as a
SignalException (torch.distributed.elastic's agent, torch 2.11-2.13): a traceback and exit 1, read as a crash by
whoever launched it. Here that ends with one line and 128 + the signal's number (143 for SIGTERM, the training
processes' own status). The same holds where the scheduler signals the training processes themselves and every one
that ended exited 143: torchrun's ChildFailedError report becomes one line and exit 143.
Any other failure is reported as torchrun reports it.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from shared.train.preemption import EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    """torchrun with `argv`; its exit status (see the module docstring)."""
    try:
        run.main(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"torchrun: stopped by {name}, which it passed to the training processes: with --ckpt_dir they saved a "
              "checkpoint at their next agreed step (their lines above say which); the same command with --resume "
              "auto continues", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if not e.failures or any(f.exitcode != EXIT_CODE for f in e.failures.values()):
            raise
        print(f"torchrun: the training processes stopped on SIGTERM (exit {EXIT_CODE}): with --ckpt_dir they saved a "
              "checkpoint first (their lines above say which); the same command with --resume auto continues",
              file=sys.stderr, flush=True)
        return EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
