"""Raw DeepSpeed training loop: the baseline every comparison is made against.

    deepspeed --num_gpus 8 plain_deepspeed/train.py --preset 1.5b --stage 3 --precision bf16 --micro_batch 8
    torchrun --nproc_per_node 2 plain_deepspeed/train.py --preset tiny
    python plain_deepspeed/train.py                      # one process; CPU + gloo when there is no GPU

The original study's flags keep working: `--attention blocksparse --batch_size_per_gpu 36 --precision bf16`.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from shared import flops
from shared.cli import parse_train_config
from shared.config import TrainConfig
from shared.data import make_loader
from shared.distributed import (
    apply_gc_policy,
    backend_for,
    check_precision,
    dropout_seed,
    ensure_env,
    pick_device,
    run_cli,
    seed_all,
)
from shared.ds_config import build_ds_config
from shared.ds_runtime import BreakdownCollector
from shared.model import GPT, count_parameters
from shared.optim import build_optimizer, build_scheduler
from shared.progress import Progress
from shared.results import RunResult, build_result, format_summary
from shared.timing import PhaseTimer


def main(train: TrainConfig) -> RunResult:
    """Train `train.steps` steps; rank 0 writes the RunResult JSON to train.out and every rank returns it."""
    ensure_env()
    device = pick_device()
    check_precision(device, train.precision)
    import deepspeed  # after the device is set: DeepSpeed picks its accelerator at import

    deepspeed.init_distributed(dist_backend=backend_for(device))
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg = train.model()
    ds_config = build_ds_config(train, model_cfg, world)

    seed_all(train.seed)
    # ZeRO-3 partitions each parameter as its module is built, so the full model never sits on one GPU.
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=train.stage == 3):
        model = GPT(model_cfg)
    optimizer = build_optimizer(model, train, device)
    scheduler = build_scheduler(optimizer, train)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)

    loader = make_loader(train.data, model_cfg.vocab_size, model_cfg.seq_len, train.micro_batch, train.seed, rank,
                         train.steps * train.grad_accum, pin_memory=device.type == "cuda")
    timer = PhaseTimer(device, micro_steps=train.grad_accum)
    breakdown = BreakdownCollector(engine)
    per_gpu_flops = flops.step_flops(model_cfg, train.micro_batch * train.grad_accum, train.flops_factor)
    progress = Progress(train.steps, device, timer, per_gpu_flops, train.log_every, enabled=rank == 0,
                        prefix="[deepspeed] ")

    torch.manual_seed(dropout_seed(train.seed, rank))
    engine.train()
    batches = iter(loader)
    apply_gc_policy(train.python_gc)
    timer.start()
    for step in range(train.steps):
        step_loss = torch.zeros((), device=device)
        for _ in range(train.grad_accum):
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            timer.mark("data")
            loss = engine(x, y)
            timer.mark("forward")
            engine.backward(loss)
            timer.mark("backward")
            engine.step()  # a no-op but for bookkeeping until the last micro-step of the step
            timer.mark("step")
            breakdown.collect()
            step_loss += loss.detach()
        progress.record(step, step_loss / train.grad_accum)

    losses = progress.finish()
    timer.finish()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    peak_all = torch.tensor(float(peak), device=device)
    dist.all_reduce(peak_all, op=dist.ReduceOp.MAX)  # once, after the timed region
    result = build_result(
        path="deepspeed", train=train, model_cfg=model_cfg, world_size=world, device=device,
        ds_config=json.loads(json.dumps(engine.config)),  # what DeepSpeed received
        attention=model.attention_backend, fused={}, losses=losses, timing=timer.summary(train.warmup_steps),
        n_params=count_parameters(model),
        ds_breakdown_ms=breakdown.summary(train.warmup_steps * train.grad_accum),
        peak_mem_bytes=peak_all.item() if device.type == "cuda" else None,
    )
    if rank == 0:
        result.to_json(train.out)
        print(format_summary(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return result


def cli(argv: list[str] | None = None) -> None:
    run_cli(main, parse_train_config(argv, __doc__), "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    cli(sys.argv[1:])
