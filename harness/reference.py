"""Reference rows for `compare.py --reference`: the same GPT, seed, batches, optimizer, LR schedule and clipping as
the two DeepSpeed paths, trained without DeepSpeed. They are yardsticks, not a third training product.

    ceiling  plain PyTorch on one GPU: no sharding, the whole model (forward + loss) torch.compile'd. What this
             model can do on this GPU with this compiler: the ZeRO-3 paths are reported as a fraction of it.
    fsdp2    torch FSDP2 (`fully_shard` on every block and on the root) with compiled blocks: what a user would
             pick instead of DeepSpeed.

Precision: with bf16, parameters and optimizer state stay fp32 and the matmuls run in bf16 (autocast for the
ceiling, FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), as DeepSpeed's bf16 mode computes
in bf16 from fp32 master weights. On a CPU (tests) nothing is compiled and the result says so (fused.compile).

    torchrun --nproc_per_node 1 -m harness.reference --mode ceiling --preset 1.5b --micro_batch 16
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist

from shared.model.gpt import GPT, count_parameters
from shared.train.cli import add_config_args, config_from_args
from shared.train.compile import compile_blocks, configure_inductor
from shared.train.config import TrainConfig
from shared.train.data import train_loader
from shared.train.distributed import (
    backend_for,
    check_outputs,
    check_precision,
    dropout_seed,
    ensure_env,
    freeze_gc,
    pick_device,
    run_cli,
    seed_all,
)
from shared.train.loop import peak_memory_bytes
from shared.train.optim import build_optimizer, build_scheduler
from shared.train.results import RunResult, build_result, write_result
from shared.train.timing import PhaseTimer

MODES = ("ceiling", "fsdp2")


def build_model(mode: str, train: TrainConfig, device: torch.device) -> tuple[torch.nn.Module, GPT, str]:
    """(module to call, the GPT inside it, what was compiled)."""
    cuda = device.type == "cuda"
    seed_all(train.seed)
    if mode == "ceiling":
        if dist.get_world_size() != 1:
            raise ValueError("the ceiling row is one unsharded process: launch it with one process per run")
        gpt = GPT(train.model()).to(device)
        return (torch.compile(gpt) if cuda else gpt), gpt, "whole_model" if cuda else "none"
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2's hooks sit on each block and its forward is compiled inside them (torchtitan's recipe): the paths'
    # own compiled blocks (shared/train/compile.py).
    gpt = GPT(train.model()).to(device)
    if cuda:
        compile_blocks(gpt)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if train.precision == "bf16" else MixedPrecisionPolicy()
    for block in gpt.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(gpt, mp_policy=policy)
    return gpt, gpt, "blocks" if cuda else "none"


def main(train: TrainConfig, mode: str) -> RunResult:
    if mode not in MODES:
        raise ValueError(f"unknown reference mode {mode!r}; choose one of {MODES}")
    if train.precision == "fp16":
        raise ValueError("the reference rows run bf16 or fp32 (fp16 would need a loss scaler the paths share)")
    if train.grad_accum != 1 or train.activation_checkpointing:
        raise ValueError("the reference rows run grad_accum 1 without activation checkpointing")
    ensure_env()
    device = pick_device()
    check_precision(device, train.precision)
    dist.init_process_group(backend=backend_for(device))
    rank, world = dist.get_rank(), dist.get_world_size()
    configure_inductor(train)
    module, gpt, compiled = build_model(mode, train, device)
    optimizer = build_optimizer(gpt, train, device)
    scheduler = build_scheduler(optimizer, train)
    pin = device.type == "cuda"
    batches = iter(train_loader(train, rank, 0, pin_memory=pin))
    timer = PhaseTimer(device, profile_step=train.profile_step, profile_stack=train.profile_stack,
                       profile_sync=train.profile_sync, sync_check_step=train.sync_check_step)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) \
        if mode == "ceiling" and train.precision == "bf16" else contextlib.nullcontext()
    losses = []
    torch.manual_seed(dropout_seed(train.seed, rank))
    gpt.train()
    freeze_gc()
    timer.start()
    for _ in range(train.steps):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        timer.mark("data")
        with autocast:
            loss = module(x, y)
        timer.mark("forward")
        loss.backward()
        timer.mark("backward")
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        timer.mark("step")
        losses.append(loss.detach().float())
    timer.finish()
    result = build_result(
        path=mode, train=train, model_cfg=train.model(), ds_config={}, world_size=world, device=device,
        attention=gpt.attention_backend, losses=torch.stack(losses).tolist(),
        timing=timer.summary(train.warmup_steps), n_params=count_parameters(gpt),
        peak_mem_bytes=peak_memory_bytes(device),
    )
    result.fused["compile"] = compiled  # what this row compiled, not the DeepSpeed paths' mode
    write_result(result, train.out, rank)
    dist.barrier()
    dist.destroy_process_group()
    return result


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, required=True, help="which reference row to run")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_config_args(parser)
    ns = parser.parse_args(argv)
    try:
        train = config_from_args(ns)
        check_outputs(train)  # a folder in --out's place: refused now, not after the row trained
    except ValueError as e:
        parser.error(str(e))
    run_cli(lambda t: main(t, ns.mode), train, "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    cli(sys.argv[1:])
