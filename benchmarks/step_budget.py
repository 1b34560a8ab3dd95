"""How far a profiled training step is from the hardware, kind of kernel by kind, and what a target throughput needs.

    python benchmarks/step_budget.py benchmarks/results/coordinate_descent_compare_1xh200/runs/*_0.json --target 560

Reads run JSONs written with `--profile_step` and reports, for each run (harness/budget.py): the matmuls' and the
attention kernels' achieved rate in the profiled step, as TFLOP/s and as a share of the device's peak; the time of
the kinds that do no model FLOPs (inductor's generated elementwise kernels, the optimizer, copies) and the device's
idle time; the median step a target TFLOPs/GPU needs (the reported convention: the Megatron formula) and the gap;
two what-ifs, each the median step with one change: the attention at the matmuls' achieved rate, and no idle time.
Nothing is measured here: every figure derives from the run JSONs named, which the output records. Writes --out
(JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from harness.budget import step_budget
from shared.train.results import RunResult


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
            rows.append(step_budget(RunResult.from_json(path), ns.target, path))
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
