"""Fault injection for tests: run a training path with a fault planted in it, as a subprocess.

    python tests/inject.py {raw,lightning} FAULT -- TRAIN FLAGS...

Faults in the model (either path): `nan@STEP` makes the training loss NaN on the STEP-th training forward
(1-based) of every rank; `sigterm@STEP` sends the process SIGTERM in its STEP-th training forward, as a
scheduler's preemption would, and the ranks agree on it after every step (shared/train/preemption.CHECK_EVERY 1);
`oom` raises torch.OutOfMemoryError on the first training forward, as a micro-batch that does not fit would.
Faults of a path's training semantics (the Lightning path; loss parity must catch them): `noclip` drops gradient
clipping from the DeepSpeed dict, `double_scale` lets DeepSpeed divide the loss by the accumulation steps again after
Lightning did (the bug lightning_app/strategy.ZeroPrecision fixes), `lr2x` builds the optimizer with twice the
learning rate, `skip_update@STEP` skips the optimizer's update of the STEP-th call of torch's AdamW (one parameter
group's step, as an update lost to a bad inf/NaN check would be), `dropout_rate` applies attention dropout at 1.25x the
model's rate (0.125 for 0.1: a kernel that rounds its rate to sixteenths).
"""

import dataclasses
import os
import signal
import sys

import torch

import shared.model.gpt as model_module

path, fault = sys.argv[1], sys.argv[2]
argv = sys.argv[sys.argv.index("--") + 1:]
SEMANTIC_FAULTS = ("noclip", "double_scale", "lr2x", "skip_update", "dropout_rate")
if fault.split("@")[0] in SEMANTIC_FAULTS and path != "lightning":
    raise SystemExit(f"fault {fault!r} is planted in the Lightning path only")
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
        if fault.startswith("sigterm"):
            os.kill(os.getpid(), signal.SIGTERM)
            return out
        return out * float("nan")
    return out


if fault == "noclip":
    import lightning_app.train as lightning_train

    clipped = lightning_train.lightning_ds_config

    def unclipped(train):
        cfg = clipped(train)
        cfg.pop("gradient_clipping")  # DeepSpeed's default: 0, no clipping
        return cfg

    lightning_train.lightning_ds_config = unclipped
elif fault == "double_scale":
    from pytorch_lightning.plugins.precision import DeepSpeedPrecision

    import lightning_app.strategy as strategy

    strategy.ZeroPrecision.backward = DeepSpeedPrecision.backward  # engine.backward scales by 1/gas again
elif fault == "lr2x":
    import lightning_app.module as module

    build = module.build_optimizer
    module.build_optimizer = lambda model, train, device: build(model, dataclasses.replace(train, lr=2 * train.lr),
                                                                device)
elif fault.startswith("skip_update@"):
    skip_at, step_calls = int(fault.split("@")[1]), {"n": 0}
    adamw_step = torch.optim.AdamW.step

    def skipping_step(self, *args, **kwargs):
        step_calls["n"] += 1
        if step_calls["n"] == skip_at:
            return None  # the update never happens; the moments and parameters stay as they were
        return adamw_step(self, *args, **kwargs)

    torch.optim.AdamW.step = skipping_step
elif fault == "dropout_rate":
    from shared.model.attention import base

    base.Attention._dropout = lambda self: 1.25 * self.dropout_p if self.training else 0.0
elif fault.split("@")[0] not in SEMANTIC_FAULTS:
    model_module.LMHead.forward = faulty
if fault.startswith("sigterm"):
    import shared.train.preemption as preemption

    preemption.CHECK_EVERY = 1
if path == "raw":
    from plain_deepspeed.train import cli
else:
    from lightning_app.train import cli
cli(argv)
