"""Raw DeepSpeed training loop: the baseline every comparison is made against.

    deepspeed --num_gpus 8 plain_deepspeed/train.py --preset 1.5b --stage 3 --precision bf16 --micro_batch 8
    torchrun --nproc_per_node 2 plain_deepspeed/train.py --preset tiny
    python plain_deepspeed/train.py                      # one process; CPU + gloo when there is no GPU

The original study's flags keep working: `--attention blocksparse --batch_size_per_gpu 36 --precision bf16`.
Real training: `--data data/kjv --ckpt_dir ckpt --save_every 200 --resume auto --val_every 100 --log_csv m.csv`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchmetrics import MeanMetric

from shared import patches
from shared.model.gpt import count_parameters
from shared.train import checkpoint
from shared.train.build import build_model
from shared.train.cli import parse_train_config
from shared.train.compile import configure_inductor
from shared.train.config import TrainConfig
from shared.train.data import train_loader, val_loader
from shared.train.distributed import (
    backend_for,
    check_before_start,
    dropout_seed,
    ensure_env,
    freeze_gc,
    local_world_size,
    oom_message,
    pick_device,
    release_shm_buffer,
    run_cli,
    seed_all,
)
from shared.train.ds_config import build_ds_config
from shared.train.ds_runtime import (
    BreakdownCollector,
    GradNormRecorder,
    compile_engine,
    param_checksum,
)
from shared.train.loop import format_validation, peak_memory_bytes, start_progress, validation_figures
from shared.train.optim import build_optimizer, build_scheduler
from shared.train.preemption import EXIT_CODE, Preemption
from shared.train.progress import NanGuard, Progress
from shared.train.results import RunResult, build_result, write_result
from shared.train.validation import eager_forward


def save(engine, train: TrainConfig, step: int, progress: Progress, rank: int) -> Path:
    """DeepSpeed's sharded checkpoint + every rank's RNG state, then (rank 0, last) the completion marker."""
    progress.check_finite(step - 1)  # never save after a non-finite loss
    tag = checkpoint.tag_for(step)
    folder = Path(train.ckpt_dir) / tag
    client = {"step": step, "model_config": dataclasses.asdict(train.model()), "data": train.data}
    engine.save_checkpoint(train.ckpt_dir, tag=tag, client_state=client)
    checkpoint.commit(folder, step, rank, train, "deepspeed", dist.barrier)
    return folder


def validate(engine, loader, device: torch.device, step: int, deepcompile: bool = False) -> dict:
    """Mean loss and perplexity over the validation batches (torchmetrics MeanMetric: one sync, at the end); under
    DeepCompile the model runs eagerly outside its compiled graphs (shared/train/validation.py)."""
    metric = MeanMetric(sync_on_compute=True).to(device)
    engine.eval()
    forward = engine.module if deepcompile else engine
    with torch.no_grad(), eager_forward(engine.module, deepcompile):
        for x, y in loader:
            metric.update(forward(x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
    engine.train()
    return validation_figures(step, float(metric.compute()))


def main(train: TrainConfig) -> RunResult:
    """Train `train.steps` steps; rank 0 writes the RunResult JSON to train.out and every rank returns it."""
    ensure_env()
    local_world = local_world_size()
    if train.devices is not None and train.devices != local_world:
        raise ValueError(f"--devices {train.devices}: the raw loop does not start processes itself ({local_world} "
                         f"here); launch it as `torchrun --nproc_per_node {train.devices} plain_deepspeed/train.py "
                         f"...` or `deepspeed --num_gpus {train.devices} plain_deepspeed/train.py ...`")
    device = pick_device()
    check_before_start(train, device, int(os.environ["WORLD_SIZE"]), local_world)
    resume_from = checkpoint.resolve_resume(train.resume, train.ckpt_dir)
    checkpoint.check_ckpt_dir(train, resume_from)
    if resume_from is not None:
        checkpoint.check_resumable(resume_from, "deepspeed", dataclasses.asdict(train.model()),
                                   int(os.environ["WORLD_SIZE"]))
        checkpoint.check_safe_to_load(resume_from, train.trust_checkpoint)
        # before DeepSpeed builds and loads anything
        saved_step = checkpoint.read_marker(resume_from)["step"]
        checkpoint.check_steps_left(resume_from, saved_step, train.steps)
        checkpoint.warn_schedule_change(resume_from, saved_step, train)
    import deepspeed  # after the device is set: DeepSpeed picks its accelerator at import

    deepspeed.init_distributed(dist_backend=backend_for(device))
    release_shm_buffer(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg = train.model()
    ds_config = build_ds_config(train)

    configure_inductor(train)
    seed_all(train.seed)
    # ZeRO-3 partitions each parameter as its module is built, so the full model never sits on one GPU.
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=train.stage == 3):
        model = build_model(train)  # converted to FP8 and compiled as asked, as Lightning's (shared/train/build.py)
    optimizer = build_optimizer(model, train, device)
    scheduler = build_scheduler(optimizer, train)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    start = 0
    if resume_from is not None:
        _, client = engine.load_checkpoint(str(resume_from.parent), tag=resume_from.name)
        start = int(client["step"])
        if rank == 0:
            print(f"[deepspeed] resumed from {resume_from} at step {start}", flush=True)
    # after the resume: DeepCompile registers the loaded shards
    compile_engine(engine, train, rank)
    patches.install(engine, train)  # the ZeRO-3 step (shared/patches/zero3_step.py)

    pin = device.type == "cuda"
    loader = train_loader(train, rank, start, pin_memory=pin)
    val_batches = val_loader(train, rank, pin_memory=pin) if train.val_every else None
    timer, progress = start_progress(train, device, rank, "[deepspeed] ", scheduler, engine, start)
    breakdown = BreakdownCollector(engine)
    grad_norms = GradNormRecorder(engine)
    preemption = Preemption(device)
    nan_guard = NanGuard(train, device)
    history = {"val": [], "saves": []}

    if resume_from is not None:
        checkpoint.load_rng(resume_from, rank)  # the dropout stream continues where it stopped
    else:
        torch.manual_seed(dropout_seed(train.seed, rank))
    engine.train()
    batches = iter(loader)
    freeze_gc()
    timer.start()
    try:
        for step in range(start, train.steps):
            step_loss = torch.zeros((), device=device)
            for _ in range(train.grad_accum):
                x, y = next(batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                timer.mark("data")
                loss = engine(x, y)
                timer.mark("forward")
                if nan_guard.skip(loss, step):  # nan_policy=skip: no backward, no update for this step
                    scheduler.step()  # the schedule and the data move on, as in the Lightning path
                    timer.mark("backward")
                    timer.mark("step")
                    step_loss += loss.detach()
                    continue
                engine.backward(loss)
                timer.mark("backward")
                engine.step()  # a no-op but for bookkeeping until the last micro-step of the step
                timer.mark("step")
                breakdown.collect()
                step_loss += loss.detach()
            progress.record(step, step_loss / train.grad_accum)
            grad_norms.record()
            done = step + 1
            if val_batches is not None and done % train.val_every == 0:
                t0 = time.perf_counter()  # what a validation pass costs: its figures end in a host sync
                history["val"].append(validate(engine, val_batches, device, done, train.compile == "deepcompile"))
                history["val"][-1]["seconds"] = time.perf_counter() - t0
                if rank == 0:
                    print(format_validation("[deepspeed] ", history["val"][-1]), flush=True)
                timer.start()  # validation time is not a training step's
            saved = checkpoint.due(train, done)
            if saved:
                t0 = time.perf_counter()  # what a checkpoint costs: the save ends in a barrier
                save(engine, train, done, progress, rank)
                history["saves"].append({"step": done, "seconds": time.perf_counter() - t0})
                timer.start()
            # the last step is the run's end, not a preemption: the run finishes (result, export, exit 0)
            if done < train.steps and preemption.should_stop(step):
                if train.ckpt_dir and not saved:
                    save(engine, train, done, progress, rank)
                if rank == 0:
                    print(f"[deepspeed] SIGTERM: stopped after step {done}", flush=True)
                dist.barrier()
                dist.destroy_process_group()
                raise SystemExit(EXIT_CODE)
    except torch.OutOfMemoryError as e:
        raise ValueError(oom_message(train, device)) from e
    finally:
        preemption.restore()
        timer.close()  # a profile in progress (--profile_step) stops with the run

    losses = progress.finish()
    timer.finish()
    if train.export:
        checkpoint.export_live(model, dataclasses.asdict(model_cfg), train.export,
                               {"data": train.data, "step": train.steps}, rank, zero3=train.stage == 3)
    peak_mem = peak_memory_bytes(device)  # once, after the timed region
    result = build_result(
        path="deepspeed", train=train, model_cfg=model_cfg, world_size=world, device=device,
        ds_config=json.loads(json.dumps(engine.config)),  # what DeepSpeed received
        attention=model.attention_backend, losses=losses, allow_nonfinite=bool(nan_guard.skipped),
        timing=timer.summary(min(train.warmup_steps, max(0, train.steps - start - 1))),
        n_params=count_parameters(model),
        ds_breakdown_ms=breakdown.summary(train.warmup_steps * train.grad_accum),
        peak_mem_bytes=peak_mem,
        grad_norms=grad_norms.values(), param_checksum=param_checksum(model), fp8_record=model.fp8,
        extra={"start_step": start, "resumed_from": str(resume_from) if resume_from else None,
               "skipped_steps": nan_guard.skipped, "zero3_step_calls": patches.step_calls(engine), **history},
    )
    write_result(result, train.out, rank)
    dist.barrier()
    dist.destroy_process_group()
    return result


def cli(argv: list[str] | None = None) -> None:
    run_cli(main, parse_train_config(argv, __doc__), "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    cli(sys.argv[1:])
