"""Replacements of DeepSpeed 0.19.8's DeepCompile ZeRO-3 internals around the compiled graphs.

Installed through shared/patches (`patches.before_compile`, `patches.after_compile`, `patches.align_schedule`),
which checks the DeepSpeed version first and names each replaced target; the measurements are in docs/ledger.md
(rows `--deepcompile_eager_persist drop`, `--deepcompile_cached_walks`) and docs/results.md. No deepspeed import at
module level: each function receives the engine or imports what it replaces.
"""

from __future__ import annotations

import functools
import time

# What DeepCompile's two profilers took in this process (time_deepcompile_profilers; the run JSON reports it as
# extra.deepcompile_profilers, beside deepcompile_passes_s, which includes it); None: DeepCompile was not set up.
PROFILERS: dict | None = None


def time_deepcompile_profilers() -> bool:
    """Time DeepCompile's two profilers, once per process: the operator profile (ProfilingInterpreter: every node of
    a graph run again with device syncs and, once per distinct operator and shape, 15 times) that its gather/release
    pass plans from, and the memory profile (MemoryProfilingInterpreter: the whole graph, node by node with syncs)
    that it runs after every pass that changed a graph. Their seconds against deepcompile_passes_s say how much of
    DeepCompile's warm-up is profiling rather than planning. Returns whether it wrapped them now (False: already)."""
    global PROFILERS
    if PROFILERS is not None:
        return False
    from deepspeed.compile.profilers import graph_profile

    PROFILERS = {"operators_s": 0.0, "operators_runs": 0, "memory_s": 0.0, "memory_runs": 0}
    for cls, key in ((graph_profile.ProfilingInterpreter, "operators"),
                     (graph_profile.MemoryProfilingInterpreter, "memory")):
        cls.run = _timed(cls.run, key)
    return True


def _timed(run, key: str):
    @functools.wraps(run)  # __wrapped__: DeepSpeed's own run, for the fingerprint (shared/patches/fingerprints.py)
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
    graphs (shared/patches/deepcompile_passes keeps the small ones gathered there, in DeepCompile's own buffers), but
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


def schedule_shift(engine) -> int:
    """The steps DeepCompile's remaining pass schedule must move for this engine: those since its last alignment
    (align_schedule records where it last aligned the engine)."""
    return engine.global_steps - getattr(engine, "_zero3bench_schedule_anchor", 0)


def align_schedule(engine, backend=None) -> None:
    """Start DeepCompile's remaining pass schedule at the engine's current step: at compile time (a resumed raw
    loop has loaded its step before) and again after a checkpoint is loaded into a compiled engine (Lightning
    loads it after the strategy set-up). Shifts by the steps since the last alignment; no-op without DeepCompile."""
    if not engine.is_deepcompile_active():
        return
    if backend is None:
        from deepspeed.compile import backend
    start_schedule_at(backend, schedule_shift(engine))
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
