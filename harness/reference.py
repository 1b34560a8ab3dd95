"""Reference rows for `compare.py --reference`: the same GPT, seed, batches, optimizer, LR schedule and clipping as
the two DeepSpeed paths, trained without DeepSpeed. They are yardsticks, not a third training product.

    unsharded  what ZeRO-3 itself costs is measured against this row: the ZeRO-3 paths' model and optimizer state
               without the sharding, one process. 16-bit parameters and gradients (bf16 runs; fp32 runs hold fp32),
               fp32 master weights and moments, the update the run's --zero3_step makes (`fused`: the project's
               AdamW kernel, shared/kernels/adamw.py, updating master, moments and the 16-bit copy in one pass;
               otherwise torch's AdamW on the masters, then the copy, as `fast` does), clipping by the global norm
               with DeepSpeed's formula, and the paths' compile (--compile deepcompile: the whole model
               torch.compile'd, as DeepCompile compiles the whole forward; blocks: the compiled blocks; none:
               nothing). The ZeRO-3 paths are reported as a fraction of it (fraction_of_unsharded).
    ceiling    the PyTorch user's baseline (the key keeps its old name, for old reports): no sharding, fp32
               weights under bf16 autocast, torch's fused AdamW, the whole model torch.compile'd. It differs from
               `unsharded` in the weights' precision and the optimizer, so it is no bound on the ZeRO-3 paths.
    fsdp2      torch FSDP2 (`fully_shard` on every block and on the root) with compiled blocks: what a user would
               pick instead of DeepSpeed.

Precision of the ceiling and fsdp2: with bf16, parameters and optimizer state stay fp32 and the matmuls run in bf16
(autocast for the ceiling, FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)). On a CPU (tests)
nothing is compiled and the result says so (fused.compile); the unsharded row's AdamW kernel runs on a CPU only in
Triton's interpreter (TRITON_INTERPRET=1), as the ZeRO-3 step's does.

    torchrun --nproc_per_node 1 -m harness.reference --mode unsharded --preset 1.5b --micro_batch 16 --zero3_step fused
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist

from harness.launch import FP8_REFUSAL
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
from shared.train.results import COMPUTE_DTYPES, RunResult, build_result, write_result
from shared.train.timing import PhaseTimer

MODES = ("unsharded", "ceiling", "fsdp2")


class MasterAdamW:
    """The ZeRO-3 paths' optimizer state on one process, without the sharding: each parameter group's 16-bit
    parameters are views of one flat buffer (DeepSpeed's fp16_partitioned_groups_flat), its fp32 master weights one
    flat tensor (fp32_partitioned_groups_flat), stepped by `inner`, the paths' torch AdamW (build_optimizer) whose
    groups now hold the masters, as DeepSpeed's ZeRO optimizer rewrites its client optimizer's groups. The LR
    schedule steps `inner`.

    step(): the gradients of each group gathered into one flat 16-bit tensor (where ZeRO-3 reduces them into its
    flat partition buffer), the global norm of them all with fp32 accumulation (zero3_step's norm), DeepSpeed's clip
    scale `max(1, (norm + 1e-6) / grad_clip)` divided out of the gradient, an inf/NaN norm skipping the update (as
    DeepSpeed skips the step), then AdamW on the masters and the 16-bit copy written. With `kernel` (the run's
    --zero3_step fused) the update and the copy are one adamw_step call per group, its state laid out as torch's
    fused AdamW keeps it (zero3_step's `_adamw_kernel_step`); without it, torch's AdamW (fused, with the scale as
    its grad_scale and the skip as its found_inf, on a GPU), then the copy.
    """

    def __init__(self, gpt: GPT, train: TrainConfig, device: torch.device, kernel: bool):
        self.inner = build_optimizer(gpt, train, device)  # the paths' AdamW and its hyperparameters
        self.grad_clip, self.kernel = train.grad_clip, kernel
        self.params, self.flat_lp, self.masters = [], [], []
        for group in self.inner.param_groups:
            params = list(group["params"])
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else \
                torch.zeros(0, dtype=COMPUTE_DTYPES[train.precision], device=device)
            offset = 0
            for p in params:  # the model's parameters become views of the flat 16-bit buffer the update writes
                p.data = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            master = flat.to(torch.float32, copy=True)  # from the 16-bit values, as DeepSpeed's masters are
            group["params"] = [master]
            self.params.append(params)
            self.flat_lp.append(flat)
            self.masters.append(master)

    def flat_grads(self) -> list[torch.Tensor]:
        """Each group's gradients as one flat tensor of the parameters' dtype."""
        return [torch.cat([p.grad.reshape(-1) for p in params]) if params else flat.new_zeros(0)
                for params, flat in zip(self.params, self.flat_lp)]

    def step(self) -> torch.Tensor:
        """One update from the parameters' gradients; returns the global gradient norm before clipping (a device
        tensor: nothing here waits on the device, except the skip check of torch's unfused AdamW on a CPU)."""
        grads = self.flat_grads()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
                                                     for g in grads]))
        invalid = norm.isinf().logical_or(norm.isnan())
        # DeepSpeed's combined scale (stage3.unscale_and_clip_grads, loss scale 1): the gradient is divided by it
        scale = torch.clamp((norm + 1e-6) / self.grad_clip, min=1.0) if self.grad_clip > 0 else None
        if self.kernel:
            self._kernel_step(grads, scale, invalid)
        else:
            self._torch_step(grads, scale, invalid)
        return norm

    def _kernel_step(self, grads, scale, invalid) -> None:
        from shared.kernels.adamw import adamw_step

        for group, master, grad, flat in zip(self.inner.param_groups, self.masters, grads, self.flat_lp):
            state = self.inner.state[master]
            if not state:  # torch's fused AdamW's layout: the step count a device tensor
                state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
                state["exp_avg"] = torch.zeros_like(master)
                state["exp_avg_sq"] = torch.zeros_like(master)
            state["step"].add_(invalid.logical_not().to(state["step"].dtype))
            beta1, beta2 = group["betas"]
            adamw_step(master, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=group["lr"],
                       beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                       grad_scale=scale, param_lp=flat, skip=invalid)
        self.inner._opt_called = True  # what torch's step wrapper records for the LR scheduler's order check

    def _torch_step(self, grads, scale, invalid) -> None:
        for master, grad in zip(self.masters, grads):
            master.grad = grad.to(torch.float32)
        fused = all(group.get("fused") for group in self.inner.param_groups)
        if fused:  # the hooks torch.amp.GradScaler uses: the scale divided out as the kernel reads the gradient
            if scale is not None:
                self.inner.grad_scale = scale
            self.inner.found_inf = invalid.to(torch.float32)
        elif bool(invalid):  # torch's unfused AdamW (a CPU) has no skip hook: the host decides
            return self._drop_grads()
        elif scale is not None:
            for master in self.masters:
                master.grad.mul_(1.0 / scale)  # DeepSpeed's unscale, a multiply by the reciprocal
        try:
            self.inner.step()
        finally:
            for hook in ("grad_scale", "found_inf"):
                if hasattr(self.inner, hook):
                    delattr(self.inner, hook)
        for master, flat in zip(self.masters, self.flat_lp):
            flat.copy_(master)
        self._drop_grads()

    def _drop_grads(self) -> None:
        for master in self.masters:
            master.grad = None

    def zero_grad(self) -> None:
        for params in self.params:
            for p in params:
                p.grad = None


def init_on(device: torch.device, train: TrainConfig) -> GPT:
    """The GPT with the paths' initial weights: built on `device`, as DeepSpeed's zero.Init builds the paths' model
    (each parameter made on the GPU, then initialized), so its init draws from the same generator (the GPU's, seeded
    by seed_all) in the same order. Built on the CPU and moved, a GPU row drew other weights, which the report's
    `same_start` check catches (docs/results.md, "The reference rows")."""
    with torch.device(device):
        return GPT(train.model())


def build_model(mode: str, train: TrainConfig, device: torch.device) -> tuple[torch.nn.Module, GPT, str]:
    """(module to call, the GPT inside it, what was compiled)."""
    cuda = device.type == "cuda"
    seed_all(train.seed)
    if mode in ("ceiling", "unsharded"):
        if dist.get_world_size() != 1:
            raise ValueError(f"the {mode} row is one unsharded process: launch it with one process per run")
        gpt = init_on(device, train)
        if mode == "ceiling":
            return (torch.compile(gpt) if cuda else gpt), gpt, "whole_model" if cuda else "none"
        gpt.to(COMPUTE_DTYPES[train.precision])  # the paths' 16-bit model: the fp32 initialization rounded
        # The paths' compile: DeepCompile compiles the whole forward, so does this row; compiled blocks likewise.
        if not cuda or train.compile == "none":
            return gpt, gpt, "none"
        if train.compile == "blocks":
            return compile_blocks(gpt), gpt, "blocks"
        return torch.compile(gpt), gpt, "whole_model"
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2's hooks sit on each block and its forward is compiled inside them (torchtitan's recipe): the paths'
    # own compiled blocks (shared/train/compile.py).
    gpt = init_on(device, train)
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
    if train.precision == "fp8":
        raise ValueError(FP8_REFUSAL)
    if train.grad_accum != 1 or train.activation_checkpointing:
        raise ValueError("the reference rows run grad_accum 1 without activation checkpointing")
    ensure_env()
    device = pick_device()
    check_precision(device, train.precision)
    dist.init_process_group(backend=backend_for(device))
    rank, world = dist.get_rank(), dist.get_world_size()
    configure_inductor(train)
    module, gpt, compiled = build_model(mode, train, device)
    masters = MasterAdamW(gpt, train, device, kernel=train.zero3_step == "fused") if mode == "unsharded" else None
    optimizer = masters.inner if masters else build_optimizer(gpt, train, device)
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
        if masters is not None:
            masters.step()
            scheduler.step()
            masters.zero_grad()
        else:
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
    if masters is not None:  # which update this row made (the ZeRO-3 paths record theirs in zero3_step_calls)
        result.fused["optimizer_step"] = "adamw_kernel" if masters.kernel else "torch_adamw"
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
