"""Readers of a live DeepSpeedEngine that both paths share, and the engine's DeepCompile set-up. No deepspeed import at
module level: they receive the engine. What replaces DeepSpeed internals lives in shared/patches, called from here."""

from __future__ import annotations

import os
import re
import statistics
from typing import TYPE_CHECKING

from shared import patches

if TYPE_CHECKING:
    from shared.train.config import TrainConfig

# DeepSpeed's per-micro-step timer names (deepspeed/utils/timer.py), filled with "wall_clock_breakdown": true.
BREAKDOWN_TIMERS = {"forward": "fwd_microstep", "backward": "bwd_microstep", "step": "step_microstep"}


class BreakdownCollector:
    """Collects DeepSpeed's own synchronized fwd/bwd/step timers, micro-step by micro-step.

    With wall_clock_breakdown on, DeepSpeed synchronizes the device around each phase, prints the timers and
    resets them at every step; `engine.get_wall_clock_timers()` holds the last micro-step's values (ms), so we
    read it after each engine.step(). It is a diagnostic cross-check of the PhaseTimer, never the measurement:
    the syncs it adds slow the step down.
    """

    def __init__(self, engine):
        self.engine = engine
        self.enabled = bool(engine.wall_clock_breakdown())
        self.records: list[dict[str, float]] = []

    def collect(self) -> None:
        if self.enabled:
            timers = self.engine.get_wall_clock_timers()
            self.records.append({p: timers[n] for p, n in BREAKDOWN_TIMERS.items() if n in timers})

    def summary(self, skip_micro_steps: int) -> dict[str, float] | None:
        """Median ms per micro-step of each phase, warmup skipped; None when the breakdown was off."""
        timed = self.records[skip_micro_steps:]
        if not self.enabled or not timed:
            return None
        return {p: statistics.median(r[p] for r in timed if p in r) for p in BREAKDOWN_TIMERS if p in timed[0]}


def grad_norm(engine) -> float | None:
    """The global gradient norm of the last step (DeepSpeed computes it for clipping); None before the first.

    DeepSpeed may keep it as a device tensor, so reading it syncs: call it once per log interval, not per step.
    """
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def progress_extras(scheduler, engine, device):
    """What progress lines and the CSV log add to the loss: the learning rate the last step used, its grad norm, the
    peak memory (read per interval). The scheduler (shared/train/optim.build_scheduler's LambdaLR) has already
    stepped past that step, so its get_last_lr() is the next step's rate; the last step's is recomputed."""
    import torch

    cuda = device.type == "cuda"
    used_lr = lambda: scheduler.base_lrs[0] * scheduler.lr_lambdas[0](max(0, scheduler.last_epoch - 1))
    return lambda: {"lr": used_lr(), "grad_norm": grad_norm(engine),
                    "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def normalize_cuda_arch_list(environ=os.environ) -> str | None:
    """Make TORCH_CUDA_ARCH_LIST parseable by DeepSpeed 0.19's JIT op builder; returns a note when it changed it.

    PyTorch accepts arch-specific entries such as "9.0a" (Hopper's wgmma/TMA variant), and some CUDA images set
    them; DeepSpeed's builder sorts the list by int() of each part and fails with "invalid literal for int() with
    base 10: '0a'" when DeepCompile builds its op. Its ops use no arch-specific instruction, so the
    plain capability ("9.0") builds the same code. "+PTX" suffixes are kept.
    """
    value = environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return None
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    fixed = [re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", e) for e in entries]
    fixed = list(dict.fromkeys(fixed))  # "9.0;9.0a" -> "9.0"
    if fixed == entries:
        return None
    environ["TORCH_CUDA_ARCH_LIST"] = ";".join(fixed)
    return (f"TORCH_CUDA_ARCH_LIST={value!r} set to {environ['TORCH_CUDA_ARCH_LIST']!r} for DeepSpeed's op builder "
            "(it cannot parse arch-specific suffixes such as '9.0a')")


def prepare_op_build(rank: int = 0) -> None:
    """Call before anything that makes DeepSpeed JIT-build a CUDA op (DeepCompile's op): the arch list fix
    above, announced once (rank 0)."""
    note = normalize_cuda_arch_list()
    if note and rank == 0:
        print(f"note: {note}", flush=True)


def deepcompile_schedule(name: str, stage: int, persist_threshold: int | None = None):
    """DeepCompile's pass schedule for TrainConfig.deepcompile_schedule: None = DeepSpeed's own (for ZeRO-3: gather/
    release from step 0, a second whole compile at step 5 with prefetching and selective gathering; deepspeed/compile/
    init_z3.py). `once` puts those three passes at step 0, where they plan from the first step's profile (the
    forward's profile exists when the backward graph is compiled), so the model is compiled once. ZeRO 1/2 compile
    once either way. persist_threshold (TrainConfig.deepcompile_persist = threshold): every compile also runs the
    patch layer's persistence pass (shared/patches/deepcompile_passes.py) after DeepSpeed's passes. Every schedule
    made here ends with shared/train/deepcompile_passes.record_schedule's pass, which records the compiled schedule
    and changes nothing; DeepSpeed's own schedule (None) records none."""
    if stage != 3:
        return None
    if name == "deepspeed" and persist_threshold is None:
        return None
    from deepspeed.compile.passes import prefetch, selective_gather, zero3_compile

    from shared.train.config import DEEPCOMPILE_WARMUP
    from shared.train.deepcompile_passes import record_schedule

    # ours after DeepSpeed's: the persistence pass, then one that records the compiled schedule and changes nothing
    keep = [] if persist_threshold is None else [patches.persistence_pass(persist_threshold)]
    keep.append(record_schedule())
    full = [zero3_compile.add_z3_gather_release, prefetch.schedule_prefetch, selective_gather.selective_gather, *keep]
    if name == "once":
        return [(0, full)]
    return [(0, [zero3_compile.add_z3_gather_release, *keep]), (DEEPCOMPILE_WARMUP, full)]  # DeepSpeed's, plus ours


def compile_engine(engine, train: TrainConfig, rank: int = 0) -> None:
    """Apply train.compile where it lives in the engine: deepcompile calls engine.compile() (inductor), with the
    config's DeepCompile options (schedule, persistence, the eager list, the cached walks, the backward's wait).

    The compiled graph is built at the first forward; DeepCompile profiles it and compiles it with its passes on the
    schedule of deepcompile_schedule, whose compile steps the timing excludes (TrainConfig validation). The
    module compiled is the engine's module: the GPT in the raw loop; in Lightning the GPTModule hands it on to its
    GPT (lightning_app/module.GPTModule.compile), so both paths compile the same forward + loss.
    """
    if train.compile != "deepcompile":
        return
    schedule, stage, persist = train.deepcompile_schedule, train.stage, train.deepcompile_persist
    prepare_op_build(rank)  # DeepCompile builds its `dc` op here
    import torch._inductor.config as inductor_config

    # A forward without grad (validation) compiles a graph in which cuDNN attention returns no logsumexp, and
    # inductor's generated alignment check on that undefined output raises "expected Tensor() for op:
    # aten._scaled_dot_product_cudnn_attention" (torch 2.11, H200). The check is a debug assert; DeepCompile already
    # turns inductor's size asserts off the same way (deepspeed/compile/init_z3.py).
    inductor_config.alignment_asserts = False
    offload = compile_offloads(engine)
    if offload and (schedule == "once" or persist == "threshold"):  # both replace the schedule that plans offloads
        raise ValueError(f"compile.{offload[0]} in the DeepSpeed config needs DeepSpeed's own DeepCompile schedule: "
                         "run with --deepcompile_schedule deepspeed --deepcompile_persist deepspeed")
    threshold = engine.zero_param_persistence_threshold() if persist == "threshold" else None
    patches.before_compile(train)  # the backward-wait op before engine.compile() loads DeepSpeed's own; profilers
    engine.compile(backend="inductor", schedule=deepcompile_schedule(schedule, stage, threshold))
    if not engine.is_deepcompile_active():
        # DeepSpeed falls back to plain torch.compile when its pass cannot run (e.g. ZeRO stage 0): never report a
        # run as DeepCompile that is not one.
        raise RuntimeError("DeepSpeed did not activate DeepCompile (engine.is_deepcompile_active() is False)")
    patches.after_compile(engine, train)  # the eager persistent list, the cached walks, the schedule's start


def compile_offloads(engine) -> list[str]:
    """The offloads the engine's DeepSpeed dict asks DeepCompile for (its `compile` section), in DeepSpeed's names.
    Read from the dict the engine was built with (`engine.config`, the dict both paths record), whose absent keys
    read False, as DeepSpeed's parsed defaults for these fields are."""
    section = (engine.config or {}).get("compile") or {}
    return [n for n in ("offload_parameters", "offload_activation", "offload_opt_states") if section.get(n, False)]


class GradNormRecorder:
    """The global gradient norm of every optimizer step, without a per-step host sync.

    DeepSpeed computes the norm for clipping (before clipping) and keeps it as a device tensor under ZeRO; we keep
    a reference to each step's tensor and read them all at once, after the timed region (`values`). A float (or
    None, where DeepSpeed does not compute it) is kept as it is.
    """

    def __init__(self, engine):
        self.engine = engine
        self.norms: list = []

    def record(self) -> None:
        """Call once per optimizer step, after its engine.step()."""
        self.norms.append(self.engine.get_global_grad_norm())

    def values(self) -> list[float | None]:
        import torch

        tensors = [n for n in self.norms if torch.is_tensor(n)]
        host = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).cpu().tolist()) if tensors else None
        return [next(host) if torch.is_tensor(n) else None if n is None else float(n) for n in self.norms]


def param_checksum(model) -> dict[str, float]:
    """Sum and sum of squares (fp64) of every parameter of `model`, counted once, across all ranks: a fingerprint
    of the trained weights that both paths compute the same way. A collective: every rank must call it.

    Under ZeRO-3 each rank sums the valid part of its own partition (`ds_tensor`, which the optimizer step writes
    back; its tail past the parameter's end is padding), so nothing is gathered; an unpartitioned parameter is
    counted by rank 0 only.
    """
    import torch
    import torch.distributed as dist

    params = list({id(p): p for p in model.parameters()}.values())
    device = params[0].ds_tensor.device if hasattr(params[0], "ds_tensor") else params[0].device
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for p in params:
        if hasattr(p, "ds_tensor"):
            shard = p.ds_tensor.detach().reshape(-1)
            group = getattr(p, "ds_process_group", None)
            start = shard.numel() * (dist.get_rank(group=group) if dist.is_initialized() else 0)
            x = shard[: max(0, min(shard.numel(), p.ds_numel - start))]
        elif rank == 0:
            x = p.detach().reshape(-1)
        else:
            continue
        for chunk in x.split(1 << 24):  # fp64 copies of 16M elements at most (128 MiB), not of the whole table
            c = chunk.to(device=device, dtype=torch.float64)
            acc += torch.stack([c.sum(), (c * c).sum()])
    if dist.is_initialized():
        dist.all_reduce(acc)
    total, squares = acc.tolist()
    return {"sum": total, "sum_sq": squares, "numel": sum(getattr(p, "ds_numel", p.numel()) for p in params)}
