"""How far a profiled training step is from the hardware, kind of kernel by kind, and what a target throughput needs.

    python benchmarks/step_budget.py benchmarks/results/coordinate_descent_compare_1xh200/runs/*_0.json --target 560

Reads run JSONs written with `--profile_step` (the profiled step's device time by kind of kernel,
shared/train/step_profile.py) and reports, for each run:
  - the matmuls' and the attention kernels' achieved rate: their model FLOPs (shared/model/flops.py: the linear
    layers and the LM head; the score and value products over the causal triangle, or over the layout's blocks for
    a sparse layout) over their device time in the profiled step, and that rate as a share of the device's peak;
  - the time of the kinds that do no model FLOPs (inductor's generated elementwise kernels, the optimizer, copies)
    and the device's idle time;
  - the median step a target TFLOPs/GPU needs (the reported convention: the Megatron formula, k=3) and the gap;
  - two what-ifs, each the median step with one change: the attention at the matmuls' achieved rate, and no idle
    time.
Nothing is measured here: every figure derives from the run JSONs named, which the output records. The profiled
step synchronizes at each phase boundary, so its wall time is close to, not equal to, the run's median step.
Writes --out (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from shared.model import flops
from shared.train.results import RunResult

TRIANGLE_LAYOUTS = ("causal", "dense")  # layouts whose attention is the causal triangle (shared/model/layouts.py)


def attention_density(run: RunResult) -> float:
    """The share of the s x s score grid the model's attention needs: the causal triangle, or the layout's blocks."""
    if run.model["layout"] in TRIANGLE_LAYOUTS:
        return flops.causal_density(run.model["seq_len"])
    return run.layout_density


def budget(run: RunResult, source: str, target: float) -> dict:
    """One run's step, kind by kind, against the device's peak and a target TFLOPs/GPU."""
    profile = run.extra.get("profile")
    if not profile or "step" not in profile:
        raise ValueError(f"{source} has no profiled step: rerun it with --profile_step N (a step past the warm-up)")
    m, t = run.model, run.train
    batch = t["micro_batch"] * t["grad_accum"] * run.world_size
    args = (batch, m["seq_len"], m["n_layer"], m["n_embd"])
    density = attention_density(run)
    attention = flops.attention_flops(*args, run.flops_factor, density)
    linear = flops.matmul_flops(*args, m["vocab_size"], run.flops_factor, density) - attention
    per_gpu = 1.0 / run.world_size  # every figure below is one GPU's share of the step
    peak = flops.peak_flops(run.device.get("name"), t["precision"]) if run.device.get("type") == "cuda" else None
    step = profile["step"]
    by_kind = step["by_kind_ms"]
    median_ms = run.step_time_s["median"] * 1e3
    formula = flops.megatron_flops(*args, m["vocab_size"], run.flops_factor) * per_gpu

    def rate(model_flops: float, kind: str) -> dict:
        ms = by_kind.get(kind)
        tflops = model_flops * per_gpu / (ms * 1e-3) / 1e12 if ms else None
        return {"model_flops": model_flops * per_gpu, "ms": ms, "tflops": tflops,
                "of_peak": tflops * 1e12 / peak if tflops is not None and peak else None}

    matmul, attn = rate(linear, "matmul"), rate(attention, "attention")
    needed_ms = formula / (target * 1e12) * 1e3
    what_if = {}
    if matmul["tflops"] and attn["ms"] is not None:
        at_matmul_rate = attn["model_flops"] / (matmul["tflops"] * 1e12) * 1e3
        what_if["attention_at_matmul_rate"] = _step(median_ms - attn["ms"] + at_matmul_rate, formula)
    what_if["no_idle"] = _step(median_ms - step["idle_ms"], formula)
    return {
        "source": source, "row": run.path, "command": run.command, "device": run.device.get("name"),
        "precision": t["precision"], "world_size": run.world_size, "tflops_per_gpu": run.tflops_per_gpu,
        "median_step_ms": median_ms, "profiled_step_ms": step["wall_ms"], "idle_ms": step["idle_ms"],
        "by_kind_ms": by_kind, "peak_tflops": peak / 1e12 if peak else None, "matmul": matmul, "attention": attn,
        "target_tflops_per_gpu": target, "needed_step_ms": needed_ms, "gap_ms": median_ms - needed_ms,
        "what_if": what_if,
    }


def _step(ms: float, formula: float) -> dict:
    return {"step_ms": ms, "tflops_per_gpu": formula / (ms * 1e-3) / 1e12}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    target = rows[0]["target_tflops_per_gpu"]
    lines = [f"{'row':<10} {'TFLOPs':>7} {'step ms':>8} {'matmul ms (TFLOP/s, peak)':>27} "
             f"{'attention ms (TFLOP/s, peak)':>30} {'triton ms':>9} {'other ms':>8} {'idle ms':>7} "
             f"{f'step for {target:g}':>13} {'gap ms':>7}"]
    for r in rows:
        kinds = r["by_kind_ms"]
        other = sum(v for k, v in kinds.items() if k not in ("matmul", "attention", "compiled (triton)"))

        def cell(d):
            return (f"{_fmt(d['ms'], '.1f')} ({_fmt(d['tflops'], '.0f')}, "
                    f"{_fmt(d['of_peak'] * 100 if d['of_peak'] is not None else None, '.0f')}%)")

        lines.append(f"{r['row']:<10} {r['tflops_per_gpu']:>7.1f} {r['median_step_ms']:>8.1f} {cell(r['matmul']):>27} "
                     f"{cell(r['attention']):>30} {kinds.get('compiled (triton)', 0.0):>9.1f} {other:>8.1f} "
                     f"{r['idle_ms']:>7.1f} {r['needed_step_ms']:>13.1f} {r['gap_ms']:>7.1f}")
    lines.append("what if (median step ms -> TFLOPs/GPU):")
    for r in rows:
        parts = [f"{name.replace('_', ' ')} {w['step_ms']:.1f} -> {w['tflops_per_gpu']:.1f}"
                 for name, w in r["what_if"].items()]
        lines.append(f"  {r['row']:<10} " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run JSONs written with --profile_step")
    p.add_argument("--target", type=float, default=560.0, help="TFLOPs/GPU to budget for (default 560)")
    p.add_argument("--out", default=None, help="write the budget as JSON here (default: print only)")
    ns = p.parse_args(argv)
    if ns.target <= 0:
        p.error(f"--target must be positive, got {ns.target}")
    rows = []
    for path in ns.runs:
        try:
            rows.append(budget(RunResult.from_json(path), path, ns.target))
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"{path}: {e}")
    args = argv if argv is not None else sys.argv[1:]
    report = {"command": " ".join([os.path.basename(sys.executable), "benchmarks/step_budget.py", *args]),
              "derived_from": ns.runs, "runs": rows}
    print(table(rows))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
        print(f"wrote {ns.out}")
    return report


if __name__ == "__main__":
    main()
