"""A DeepCompile graph pass of this project: ZeRO-3's persistence threshold, honoured inside the compiled graphs.

DeepCompile (deepspeed/compile/init_z3.py) turns off ZeRO-3's persistent parameters and wraps every parameter of the
graph in gather -> wait -> consumer -> release_param. The release is an opaque custom op whose input is the
consumer's output, so inductor must materialize that output and cannot fuse across it: on the 1.5b preset the
LayerNorms' affine parts and the biases' adds ran as separate elementwise kernels next to the reductions and GELUs
they fuse into without sharding (a profiled step on the H200, docs/results.md).

`keep_small_params_gathered(threshold)` returns a pass for DeepCompile's schedule (after its own passes): parameters
of at most `threshold` elements (ZeRO-3's `stage3_param_persistence_threshold`: eager ZeRO-3's per-parameter rule;
its cap on the total, `stage3_model_persistence_threshold`, unset in this project's dicts, is not applied) are
set persistent in DeepCompile's registry, which keeps them gathered and re-gathers them after each update, and
their release nodes are taken out of the forward and backward graphs. A persistent parameter's release only counts
its uses (deepspeed/ops/csrc/compile/z3.cpp releaseParam), so nothing else changes; for the presets these are the
biases and LayerNorm weights. The pass relies on the form of the release nodes that DeepSpeed 0.19.8's
gather/release pass (deepspeed/compile/passes/zero3_compile.add_z3_gather_release) inserts: made through
shared/patches (`patches.persistence_pass`), which checks the DeepSpeed version first; the measurement:
docs/ledger.md, row `--deepcompile_persist threshold`.
"""

from __future__ import annotations

from shared.train.deepcompile_passes import RELEASE_OP, op_name

# What the last pass made in this process did (shared/train/results.py reports it in the run JSON); None: no pass.
LAST_STATS: dict | None = None


def drop_releases(graph, ds_ids: set[int]) -> int:
    """Take the release nodes of these parameters out of an FX graph (each release returns its input, so its users
    read the input instead); returns how many were removed. release_param(x, graph_id, ds_id, n_users)."""
    removed = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and op_name(node) == RELEASE_OP and node.args[2] in ds_ids:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
    return removed


def small_param_ids(param_manager, threshold: int) -> set[int]:
    """ds_ids of the graph's parameters with at most `threshold` elements (DSGraphParamManager of one graph)."""
    return {param_manager.ds_ids[name] for name, p in param_manager.params.items() if p.numel <= threshold}


def keep_small_params_gathered(threshold: int):
    """The pass (DeepCompile's pass signature); LAST_STATS counts what it did, for the run's report."""
    persisted: set[int] = set()
    # releases dropped per graph, of its latest compile (DeepSpeed's own schedule compiles each graph twice)
    stats = {"threshold": threshold, "persistent_params": 0, "releases_dropped": {}}

    def keep_small_params_gathered_pass(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget,
                                        param_manager, bwd):
        from deepspeed.compile.util import get_deepcompile_handle
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        ids = small_param_ids(param_manager[graph_id], threshold)
        handle = get_deepcompile_handle()
        with unset_fake_temporarily():  # passes run under the compile's fake mode; the gathered buffers are real
            for ds_id in sorted(ids):  # idempotent: a gathered persistent parameter is returned as it is
                handle.set_persistent(ds_id)  # gathers it now into a buffer it keeps; re-gathered after each update
        persisted.update(ids)
        stats["persistent_params"] = len(persisted)
        stats["releases_dropped"][f"{graph_id} {'backward' if bwd else 'forward'}"] = drop_releases(gm.graph, ids)
        gm.graph.lint()
        gm.recompile()  # the module's code follows its graph (cheap; no profiling run)
        # The graph is changed in place and None returned: DeepSpeed re-profiles the memory of every graph a pass
        # returns (backend.run_opt_passes), a whole profiling run for a change of a few MB.
        return None

    global LAST_STATS
    LAST_STATS = stats
    return keep_small_params_gathered_pass
