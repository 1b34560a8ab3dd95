"""Where the ZeRO-3 optimizer step's time goes: each part of DeepSpeed's step, timed, and its kernels, profiled.

    python benchmarks/optimizer_step.py --preset 1.5b --stage 3 --precision bf16 --micro_batch 4 --out step.json
    torchrun --nproc_per_node 2 benchmarks/optimizer_step.py --preset 1.5b ...   # per rank: rank 0 writes

The model, DeepSpeed dict and optimizer are the raw path's (same builders, same flags). The first `--warmup_steps`
steps run untouched; then, for each remaining step, engine.step() runs (a) plain, timed between two device
synchronizations (the step as the training loop sees it), and (b) on the profiled steps, with every part of
DeepSpeedZeroOptimizer_Stage3.step wrapped in a synchronized timer (the synchronizations cost a little, so the
parts sum to a bit more than the plain step) and under torch.profiler (its top kernels by device time).
On a CPU it runs the tiny preset with gloo (the timings then say nothing about a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shared import patches
from shared.model.gpt import GPT
from shared.train.cli import parse_train_config
from shared.train.data import train_loader
from shared.train.distributed import backend_for, check_outputs, ensure_env, pick_device, seed_all
from shared.train.ds_config import build_ds_config
from shared.train.optim import build_optimizer, build_scheduler
from shared.train.results import device_info, versions

# The parts of DeepSpeedZeroOptimizer_Stage3.step (deepspeed/runtime/zero/stage3.py), in the order it calls them.
STEP_PARTS = ("_pre_step", "_partition_all_parameters", "_overflow_check_and_loss_scale_update", "_get_norm_groups",
              "zero_grad", "_prepare_sub_group", "unscale_and_clip_grads", "_optimizer_step",
              "_reassign_or_swap_out_partitioned_parameters", "_release_sub_group", "_post_step")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wrap_parts(zero_opt, device: torch.device, spent: dict[str, list[float]]) -> callable:
    """Time every STEP_PARTS method of the optimizer (synchronized); returns a function that removes the wrappers
    and puts back what the instance had (the fast step's own methods, shared/patches/zero3_step.py). A part called
    once per sub-group adds up over the sub-groups of one step."""
    originals = {}
    installed = {name: zero_opt.__dict__[name] for name in STEP_PARTS if name in zero_opt.__dict__}
    for name in STEP_PARTS:
        fn = getattr(zero_opt, name, None)
        if fn is None:
            continue
        originals[name] = fn

        @functools.wraps(fn)
        def timed(*args, _fn=fn, _name=name, **kwargs):
            _sync(device)
            t0 = time.perf_counter()
            out = _fn(*args, **kwargs)
            _sync(device)
            spent.setdefault(_name, []).append(time.perf_counter() - t0)
            return out

        setattr(zero_opt, name, timed)

    def unwrap():
        for name in originals:
            if name in installed:
                setattr(zero_opt, name, installed[name])
            else:
                delattr(zero_opt, name)  # the instance attribute goes, the class method shows again
    return unwrap


def main(argv: list[str] | None = None) -> dict:
    train = parse_train_config(argv, __doc__)
    if train.stage != 3:
        raise SystemExit("optimizer_step.py times DeepSpeed's ZeRO-3 optimizer step: use --stage 3")
    if train.steps - train.warmup_steps < 2:
        raise SystemExit("need at least 2 steps after --warmup_steps (one plain, one profiled)")
    if train.grad_accum != 1:  # its loop runs one micro-batch per engine.step(): most would step nothing
        raise SystemExit(f"optimizer_step.py times one optimizer step per micro-batch: use --grad_accum 1, got "
                         f"{train.grad_accum}")
    try:
        check_outputs(train)  # a folder in --out's place: refused now, not after the steps ran
    except ValueError as e:
        raise SystemExit(str(e)) from None
    ensure_env()
    device = pick_device()
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend_for(device))
    rank = dist.get_rank()
    ds_config = build_ds_config(train)
    seed_all(train.seed)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = GPT(train.model())
    optimizer = build_optimizer(model, train, device)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=build_scheduler(optimizer, train), config=ds_config,
                                           dist_init_required=False)
    # the run's step, its invalid-norm check on the host whatever the profile says: DeepSpeed's step as it times it
    patches.install(engine, dataclasses.replace(train, grad_norm_check="host"))
    zero_opt = engine.optimizer
    plain, parts, steps = [], {}, []
    kernels = None
    for step, (x, y) in enumerate(train_loader(train, rank, 0, pin_memory=device.type == "cuda")):
        if step >= train.steps:
            break
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        _sync(device)
        measured = step >= train.warmup_steps
        profiled = measured and (step - train.warmup_steps) % 2 == 1
        if profiled:
            unwrap = wrap_parts(zero_opt, device, parts)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                engine.step()
                _sync(device)
            unwrap()
            if kernels is None:  # the first profiled step's kernels
                attr = "device_time_total" if device.type == "cuda" else "cpu_time_total"
                rows = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0), reverse=True)
                kernels = [{"name": e.key[:120], "calls": e.count, "total_ms": getattr(e, attr, 0) / 1e3}
                           for e in rows[:20]]
        else:
            t0 = time.perf_counter()
            engine.step()
            _sync(device)
            if measured:
                plain.append(time.perf_counter() - t0)
        steps.append(float(loss))
    n_sub_groups = len(zero_opt.fp16_groups)
    profiled_steps = max(1, len(parts.get("_pre_step", [])))
    result = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "preset": train.preset, "zero3_step": train.zero3_step,
        "zero3_step_calls": patches.step_calls(engine), "micro_batch": train.micro_batch,
        "world_size": dist.get_world_size(), "device": device_info(device), "versions": versions(),
        "ds_config": ds_config, "n_sub_groups": n_sub_groups,
        "n_params_partitioned": sum(int(t.numel()) for t in zero_opt.fp16_partitioned_groups_flat if t is not None),
        "step_ms": {"median": statistics.median(plain) * 1e3, "min": min(plain) * 1e3, "max": max(plain) * 1e3,
                    "n": len(plain)},
        # ms per step, each part summed over its calls in one step (mean over the profiled steps)
        "parts_ms_per_step": {name: sum(v) / profiled_steps * 1e3 for name, v in parts.items()},
        "parts_calls_per_step": {name: len(v) / profiled_steps for name, v in parts.items()},
        "top_kernels": kernels,
        "losses": steps,
    }
    if rank == 0 and train.out:
        Path(train.out).parent.mkdir(parents=True, exist_ok=True)
        Path(train.out).write_text(json.dumps(result, indent=1))
    if rank == 0:
        print(f"optimizer step: {result['step_ms']['median']:.2f} ms median over {len(plain)} plain steps "
              f"({n_sub_groups} sub-groups)")
        for name, ms in sorted(result["parts_ms_per_step"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:<46} {ms:8.2f} ms  ({result['parts_calls_per_step'][name]:.0f} calls)")
        for k in kernels or []:
            print(f"  kernel {k['total_ms']:8.2f} ms  x{k['calls']:<5} {k['name'][:90]}")
    dist.barrier()
    return result


if __name__ == "__main__":
    main()
