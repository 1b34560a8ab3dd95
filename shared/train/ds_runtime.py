"""Readers of a live DeepSpeedEngine that both paths share. No deepspeed import: they receive the engine."""

from __future__ import annotations

import functools
import os
import re
import statistics
import time
from typing import TYPE_CHECKING

from shared.train import deepcompile_op

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
    once either way. persist_threshold (TrainConfig.deepcompile_persist = threshold): every compile also runs
    shared/train/deepcompile_passes.keep_small_params_gathered after DeepSpeed's passes. Every schedule made here
    ends with deepcompile_passes.record_schedule's pass, which records the compiled schedule and changes nothing;
    DeepSpeed's own schedule (None) records none."""
    if stage != 3:
        return None
    if name == "deepspeed" and persist_threshold is None:
        return None
    from deepspeed.compile.passes import prefetch, selective_gather, zero3_compile

    from shared.train.config import DEEPCOMPILE_WARMUP
    from shared.train.deepcompile_passes import keep_small_params_gathered, record_schedule

    # ours after DeepSpeed's: the persistence pass, then one that records the compiled schedule and changes nothing
    keep = [] if persist_threshold is None else [keep_small_params_gathered(persist_threshold)]
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
    offload = [n for n in ("offload_parameters", "offload_activation", "offload_opt_states")
               if getattr(engine._config.compile_config, n, False)]
    if offload and (schedule == "once" or persist == "threshold"):  # both replace the schedule that plans offloads
        raise ValueError(f"compile.{offload[0]} in the DeepSpeed config needs DeepSpeed's own DeepCompile schedule: "
                         "run with --deepcompile_schedule deepspeed --deepcompile_persist deepspeed")
    threshold = engine.zero_param_persistence_threshold() if persist == "threshold" else None
    if train.deepcompile_backward_wait == "device":
        deepcompile_op.install()  # before engine.compile() loads DeepSpeed's own op
    time_deepcompile_profilers()
    engine.compile(backend="inductor", schedule=deepcompile_schedule(schedule, stage, threshold))
    if not engine.is_deepcompile_active():
        # DeepSpeed falls back to plain torch.compile when its pass cannot run (e.g. ZeRO stage 0): never report a
        # run as DeepCompile that is not one.
        raise RuntimeError("DeepSpeed did not activate DeepCompile (engine.is_deepcompile_active() is False)")
    if stage == 3 and train.deepcompile_eager_persist == "drop":
        drop_eager_persistent(engine)
    if stage == 3 and train.deepcompile_cached_walks:
        cache_deepcompile_walks(engine)
    align_schedule(engine)


# What DeepCompile's two profilers took in this process (time_deepcompile_profilers; the run JSON reports it as
# extra.deepcompile_profilers, beside deepcompile_passes_s, which includes it); None: DeepCompile was not set up.
PROFILERS: dict | None = None


def time_deepcompile_profilers() -> None:
    """Time DeepCompile's two profilers, once per process: the operator profile (ProfilingInterpreter: every node of
    a graph run again with device syncs and, once per distinct operator and shape, 15 times) that its gather/release
    pass plans from, and the memory profile (MemoryProfilingInterpreter: the whole graph, node by node with syncs)
    that it runs after every pass that changed a graph. Their seconds against deepcompile_passes_s say how much of
    DeepCompile's warm-up is profiling rather than planning."""
    global PROFILERS
    if PROFILERS is not None:
        return
    from deepspeed.compile.profilers import graph_profile

    PROFILERS = {"operators_s": 0.0, "operators_runs": 0, "memory_s": 0.0, "memory_runs": 0}
    for cls, key in ((graph_profile.ProfilingInterpreter, "operators"),
                     (graph_profile.MemoryProfilingInterpreter, "memory")):
        cls.run = _timed(cls.run, key)


def _timed(run, key: str):
    @functools.wraps(run)
    def timed_run(self, *args):
        start = time.perf_counter()
        try:
            return run(self, *args)
        finally:
            PROFILERS[f"{key}_s"] += time.perf_counter() - start
            PROFILERS[f"{key}_runs"] += 1

    return timed_run


# How many parameters the last drop_eager_persistent of this process took off the list (the run JSON reports it,
# shared/train/results.py); None: it did not run.
EAGER_PERSIST_DROPPED: int | None = None


def drop_eager_persistent(engine) -> int:
    """Under DeepCompile at ZeRO-3: empty eager ZeRO-3's list of persistent parameters; returns how many it held.

    ZeRO-3 lists its persistent parameters (at most stage3_param_persistence_threshold elements) when the engine is
    built, and all-gathers them after every optimizer step (deepspeed/runtime/zero/stage3._post_step). DeepCompile,
    set up later, turns persistence off (p.ds_persist = False; deepspeed/compile/init_z3.py) and gathers inside its
    graphs (shared/train/deepcompile_passes keeps the small ones gathered there, in DeepCompile's own buffers), but
    leaves the list: with DeepSpeed 0.19.8 each step gathered them eagerly, and the next forward's eager-fallback
    context partitioned them again (deepspeed/compile/z3_eager_fallback.release_available_params_for_next_forward:
    every gathered parameter that is not persistent), host work the device waited on at the start of each forward
    (a step profiled with Python frames, docs/results.md). The optimizer and its parameter-offload helper share the
    list; it is emptied in place, so checkpoint loads and saves skip it too (nothing of it is gathered any more)."""
    global EAGER_PERSIST_DROPPED
    # the ZeRO-3 optimizer's list (or, without an optimizer, DeepSpeedZeRoOffload's own)
    persistent = getattr(engine.optimizer, "persistent_parameters", None)
    if persistent is None:
        EAGER_PERSIST_DROPPED = 0
        return 0
    still = [p for p in persistent if getattr(p, "ds_persist", False)]
    if still:
        raise RuntimeError(f"{len(still)} parameters on ZeRO-3's persistent list are still persistent (ds_persist): "
                           "DeepCompile turns persistence off in DeepSpeed 0.19.8, not here, and without the list's "
                           "gather after each step they would go stale; run with --deepcompile_eager_persist "
                           "deepspeed")
    n = len(persistent)
    persistent.clear()
    EAGER_PERSIST_DROPPED = n
    return n


# The walks cache_deepcompile_walks replaced in this process, {"modules": n, "parameters": m} (the run JSON reports
# it, shared/train/results.py); None: it did not run.
CACHED_WALKS: dict | None = None


def cache_deepcompile_walks(engine) -> None:
    """Under DeepCompile at ZeRO-3 (TrainConfig.deepcompile_cached_walks): the host's per-step walks of the model,
    over lists taken once instead of the module tree walked each time.

    DeepSpeed 0.19.8 walks the whole module tree in Python around every compiled step, work the device waits on
    (a step profiled with Python frames, docs/results.md):
    - ZeRO-3's optimizer step starts with _partition_all_parameters, three walks of every parameter (release each
      one gathered, then check twice). Under DeepCompile the graphs gather into their own buffers, so it finds
      nothing gathered; here a pass over the cached parameters checks that, and DeepSpeed's own walk runs only when
      some parameter is not partitioned (an eager access outside the graph gathered it).
    - The eager-fallback context of every forward (deepspeed/compile/z3_eager_fallback.py) walks the modules twice
      (marking their parameter dicts in and out of the forward) and the parameters once (partitioning those left
      gathered); the same three steps run over the cached lists.
    The model's modules and parameters must not change after compilation (true of this project's GPT). Refuses a
    DeepSpeed whose fallback lacks the 0.19.8 internals these replace, rather than run something else."""
    import torch
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict
    from deepspeed.runtime.zero.partition_parameters import DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, ZeroParamStatus

    fallback = getattr(engine, "_deepcompile_z3_eager_fallback", None)
    needed = ("_release_unclaimed_tracked_params", "_outstanding_forward_graph_ids",
              "_last_pre_forward_released_param_ids", "release_available_params_for_next_forward",
              "_enable_forward_fallback", "_disable_forward_fallback")
    missing = [n for n in needed if not hasattr(fallback, n)]
    if missing or not hasattr(engine.optimizer, "_partition_all_parameters"):
        raise RuntimeError("--deepcompile_cached_walks replaces DeepSpeed 0.19.8's DeepCompile ZeRO-3 fallback "
                           f"internals, which this DeepSpeed lacks ({', '.join(missing) or '_partition_all_parameters'}"
                           "); run without it")
    modules = tuple(engine.module.modules())
    params = tuple(engine.module.parameters())
    walk_all = engine.optimizer._partition_all_parameters

    def partition_all_parameters():
        if any(p.ds_status != ZeroParamStatus.NOT_AVAILABLE for p in params):
            walk_all()  # something is gathered or in flight: DeepSpeed's own walk releases it

    def enable_forward_fallback():
        for module in modules:
            ensure_zero_ordered_dict(module)
            module._parameters._in_forward = True

    def disable_forward_fallback():
        for module in modules:
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = False

    @torch.no_grad()
    def release_available_params_for_next_forward():  # DeepSpeed 0.19.8's, over the cached parameters
        released = fallback._release_unclaimed_tracked_params()
        if not fallback._outstanding_forward_graph_ids:
            for param in params:
                if (param.ds_status == ZeroParamStatus.AVAILABLE and not getattr(param, "ds_persist", False)
                        and not getattr(param, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0)):
                    param.partition()
                    released.append(param.ds_id)
        fallback._last_pre_forward_released_param_ids = released

    engine.optimizer._partition_all_parameters = partition_all_parameters
    fallback._enable_forward_fallback = enable_forward_fallback
    fallback._disable_forward_fallback = disable_forward_fallback
    fallback.release_available_params_for_next_forward = release_available_params_for_next_forward
    global CACHED_WALKS
    CACHED_WALKS = {"modules": len(modules), "parameters": len(params)}


def align_schedule(engine, backend=None) -> None:
    """Start DeepCompile's remaining pass schedule at the engine's current step: at compile time (a resumed raw
    loop has loaded its step before) and again after a checkpoint is loaded into a compiled engine (Lightning
    loads it after the strategy set-up). Shifts by the steps since the last alignment; no-op without DeepCompile."""
    if not engine.is_deepcompile_active():
        return
    if backend is None:
        from deepspeed.compile import backend
    anchor = getattr(engine, "_zero3bench_schedule_anchor", 0)
    start_schedule_at(backend, engine.global_steps - anchor)
    engine._zero3bench_schedule_anchor = engine.global_steps


def start_schedule_at(backend, steps: int) -> None:
    """Move DeepCompile's remaining pass schedule `steps` later: a schedule counted from 0 then starts at `steps`,
    the step a resumed engine is at (align_schedule passes the steps since its last alignment).

    DeepSpeed 0.19.8 launches a scheduled compile only when engine.global_steps equals the step of the next entry
    (deepspeed/compile/backend.launch_compile_passes), counting from 0; an engine resumed at step 20 never meets
    step 0, and its first forward fails in inductor ("'NoneType' object is not iterable", no passes; seen on the
    H200). The schedule's steps are relative to the first step this process trains, as in a fresh run."""
    if steps:
        backend.remaining_schedule = type(backend.remaining_schedule)(
            (step + steps, passes) for step, passes in backend.remaining_schedule)


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
