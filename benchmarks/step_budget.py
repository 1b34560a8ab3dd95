"""How far a profiled training step is from the hardware, kind of kernel by kind, and what a target throughput needs.

    python benchmarks/step_budget.py benchmarks/results/coordinate_descent_compare_1xh200/runs/*_0.json --target 560

Reads run JSONs written with `--profile_step` and reports, for each run (harness/budget.py): the matmuls' and the
attention kernels' achieved rate in the profiled step, as TFLOP/s and as a share of the device's peak, and of the
peak at the SM clock the GPU held over the run's timed steps (its telemetry, where the run has one); the time of
the kinds that do no model FLOPs (inductor's generated elementwise kernels, the optimizer, copies) and the device's
idle time; the median step a target TFLOPs/GPU needs (the reported convention: the Megatron formula) and the gap;
two what-ifs, each the median step with one change: the attention at the matmuls' achieved rate, and no idle time.

    python benchmarks/step_budget.py benchmarks/results/triton_dropout_op_1xh200/runs/*.json \
        --baseline benchmarks/results/triton_dropout_op_1xh200/runs/baseline*.json

`--baseline` (run JSONs among those named) adds each run's device time per kind of kernel, idle and median step
minus the baselines' mean: a lever that changes a few kernels shows there apart from the drift of every matmul and
attention kernel between runs (the GPU's clock), which moves the step by as much as a small lever does. Rows are
named by their path, or by their file's name where paths repeat (an ablation's runs).
Nothing is measured here: every figure derives from the run JSONs named, which the output records. Writes --out
(JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from harness.budget import kinds_ms, minus_mean, step_budget
from shared.train.results import RunResult


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pct(share: float | None) -> str:
    return _fmt(None if share is None else share * 100, ".0f")


def against_baseline(rows: list[dict], baseline: list[dict]) -> None:
    """Adds `vs_baseline_ms` to each row: its ms minus the baselines' mean, per kind, idle and median step."""
    def parts(r: dict) -> dict:
        return {**kinds_ms(r["by_kind_ms"]), "idle": r["idle_ms"], "median step": r["median_step_ms"]}

    for r in rows:
        r["vs_baseline_ms"] = minus_mean(parts(r), [parts(b) for b in baseline])


def table(rows: list[dict]) -> str:
    target = rows[0]["target_tflops_per_gpu"]
    width = max(10, *(len(r["row"]) for r in rows))
    lines = [f"{'row':<{width}} {'TFLOPs':>7} {'step ms':>8} {'matmul ms (TFLOP/s, peak)':>27} "
             f"{'attention ms (TFLOP/s, peak)':>30} {'triton ms':>9} {'other ms':>8} {'idle ms':>7} "
             f"{f'step for {target:g}':>13} {'gap ms':>7}"]
    for r in rows:
        kinds = kinds_ms(r["by_kind_ms"])

        def cell(d):
            return f"{_fmt(d['ms'], '.1f')} ({_fmt(d['tflops'], '.0f')}, {_pct(d['of_peak'])}%)"

        lines.append(f"{r['row']:<{width}} {r['tflops_per_gpu']:>7.1f} {r['median_step_ms']:>8.1f} "
                     f"{cell(r['matmul']):>27} {cell(r['attention']):>30} "
                     f"{kinds['compiled (triton)']:>9.1f} {kinds['other']:>8.1f} "
                     f"{r['idle_ms']:>7.1f} {r['needed_step_ms']:>13.1f} {r['gap_ms']:>7.1f}")
    if any(r["held_peak_tflops"] for r in rows):
        lines.append("at the clock the GPU held over the timed steps (nvidia-smi's median; the datasheet peak assumes "
                     "a higher one): held-clock peak, then the matmuls' and the attention's share of it")
        for r in rows:
            if r["held_peak_tflops"]:
                lines.append(f"  {r['row']:<{width}} {r['sm_mhz']:.0f} MHz: {r['held_peak_tflops']:.1f} TFLOP/s; "
                             + ", ".join(f"{k} {_pct(r[k]['of_held_peak'])}%" for k in ("matmul", "attention")))
    if any(not r.get("profile_synced", True) for r in rows):
        lines.append("profiled without syncs (idle as a step in flight idles): "
                     + ", ".join(r["row"] for r in rows if not r.get("profile_synced", True)))
    if any("host" in r for r in rows):
        lines.append("the host per phase (no syncs; ms): its own time / how far ahead of the device it began "
                     "(negative: the device waited)")
        for r in rows:
            if "host" in r:
                lines.append(f"  {r['row']:<{width}} " + ", ".join(
                    f"{p} {h['host_wall_ms']:.1f} / {_fmt(h['host_lead_ms'], '+.1f')}" for p, h in r["host"].items()))
    lines.append("what if (median step ms -> TFLOPs/GPU):")
    for r in rows:
        parts = [f"{name.replace('_', ' ')} {w['step_ms']:.1f} -> {w['tflops_per_gpu']:.1f}"
                 for name, w in r["what_if"].items()]
        lines.append(f"  {r['row']:<{width}} " + "; ".join(parts))
    if any("vs_baseline_ms" in r for r in rows):
        lines.append("against the baselines' mean (ms; + is slower):")
        for r in rows:
            lines.append(f"  {r['row']:<{width}} " + ", ".join(f"{k} {v:+.1f}" for k, v in r["vs_baseline_ms"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run JSONs written with --profile_step")
    p.add_argument("--target", type=float, default=560.0, help="TFLOPs/GPU to budget for (default 560)")
    p.add_argument("--baseline", nargs="+", default=[], metavar="RUN",
                   help="run JSONs among those named: each run's ms per kind minus these runs' mean")
    p.add_argument("--out", default=None, help="write the budget as JSON here (default: print only)")
    ns = p.parse_args(argv)
    if not (math.isfinite(ns.target) and ns.target > 0):  # nan passes `<= 0`, and the JSON refuses it
        p.error(f"--target must be a finite positive TFLOPs/GPU, got {ns.target}")
    rows = []
    for path in ns.runs:
        try:
            rows.append(step_budget(RunResult.from_json(path), ns.target, path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"{path}: {e}")
    unknown = [b for b in ns.baseline if b not in ns.runs]
    if unknown:
        p.error(f"--baseline {' '.join(unknown)}: not among the runs named (name each run once, then again here)")
    labels = [r["row"] for r in rows]
    for r in rows:  # an ablation's runs share their path: name them by their files
        if labels.count(r["row"]) > 1:
            r["row"] = Path(r["source"]).stem
    if ns.baseline:
        against_baseline(rows, [rows[ns.runs.index(b)] for b in ns.baseline])
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
