"""A DeepCompile graph pass of this project that changes nothing: the compiled schedule, recorded.

`record_schedule()` is a pass for the end of DeepCompile's schedule (shared/train/ds_runtime.deepcompile_schedule
puts it after every other pass) that records each graph's order of nodes, gathers and releases, so that two runs
can be told to have compiled the same schedule. It reads the graph through DeepCompile's pass signature and
returns None (nothing to re-profile). The pass that does change the graphs, keeping the small parameters gathered,
is a replacement of DeepSpeed internals and lives in shared/patches/deepcompile_passes.py.
"""

from __future__ import annotations

RELEASE_OP = "dc::release_param"  # DeepCompile's release op (deepspeed/ops/csrc/compile/init.cpp)


def op_name(node) -> str | None:
    """The name of a call's operator where it is a custom op (`dc::release_param`), else None."""
    name = getattr(node.target, "name", None)
    return name() if callable(name) else None


# The schedules DeepCompile compiled in this process, as record_schedule's pass saw them after every other pass
# (shared/train/results.py reports them in the run JSON); None: no such pass was made.
SCHEDULES: list[dict] | None = None
GATHER_OP = "dc::allgather_param"  # DeepCompile's gather op (deepspeed/ops/csrc/compile/init.cpp)


def _target_name(node) -> str:
    return op_name(node) or getattr(node.target, "__name__", None) or str(node.target)


def schedule_fingerprint(graph) -> dict:
    """What makes a compiled ZeRO-3 schedule, stable across processes: the order of the graph's nodes with their
    operators and inputs (not the constants of its ops, among which DeepCompile's process-local graph id), and the
    order of its gathers and releases by parameter (ds_id); 16 hex digits of a SHA-256 each, and the counts."""
    import hashlib

    order, collectives = [], []
    for node in graph.nodes:
        name = _target_name(node)
        order.append(f"{node.op}|{node.name}|{name}|{','.join(n.name for n in node.all_input_nodes)}")
        if node.op == "call_function" and name in (GATHER_OP, RELEASE_OP) and len(node.args) > 2:
            collectives.append(f"{'gather' if name == GATHER_OP else 'release'} {node.args[2]}")
    digest = lambda lines: hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    return {"nodes": len(order), "order": digest(order), "collectives": digest(collectives),
            "gathers": sum(c.startswith("gather") for c in collectives),
            "releases": sum(c.startswith("release") for c in collectives)}


def record_schedule():
    """A pass for the end of DeepCompile's schedule that changes nothing (returns None: no re-profiling) and records
    each graph's schedule_fingerprint in SCHEDULES: whether two runs (the two paths, or repeats) compiled the same
    schedule, which DeepCompile plans from profiled operator times. It never raises: a failure is recorded. What it
    cannot see: the parameters selective_gather keeps gathered, which DeepCompile holds in its C++ registry
    (set_persistent) without a change to the graph, and which it plans from profiled memory."""
    global SCHEDULES
    SCHEDULES = []
    schedules = SCHEDULES

    def record_schedule_pass(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget,
                             param_manager, bwd):
        index = None
        try:  # a diagnostic: never the reason a compile fails
            # DeepSpeed's graph order: (graph id, needs backward) per graph, in the order the graphs were compiled
            index = next((i for i, entry in enumerate(graph_order or []) if entry[0] == graph_id), None)
            schedules.append({"graph": index, "bwd": bool(bwd), **schedule_fingerprint(gm.graph)})
        except Exception as e:
            schedules.append({"graph": index, "bwd": bool(bwd), "error": f"{type(e).__name__}: {e}"[:200]})
        return None

    return record_schedule_pass
