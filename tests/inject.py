"""Fault injection for tests: run a training path with a fault planted in the model, as a subprocess.

    python tests/inject.py {raw,lightning} {nan@STEP,oom} -- TRAIN FLAGS...

`nan@STEP` makes the training loss NaN on the STEP-th training forward (1-based) of every rank; `oom` raises
torch.OutOfMemoryError on the first training forward, as a micro-batch that does not fit would.
"""

import sys

import torch

import shared.model as model_module

path, fault = sys.argv[1], sys.argv[2]
argv = sys.argv[sys.argv.index("--") + 1:]
original = model_module.LMHead.forward
calls = {"n": 0}


def faulty(self, x, targets=None):
    out = original(self, x, targets)
    if targets is None or not torch.is_grad_enabled():
        return out
    calls["n"] += 1
    if fault == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
    if calls["n"] == int(fault.split("@")[1]):
        return out * float("nan")
    return out


model_module.LMHead.forward = faulty
if path == "raw":
    from plain_deepspeed.train import cli
else:
    from lightning_app.train import cli
cli(argv)
