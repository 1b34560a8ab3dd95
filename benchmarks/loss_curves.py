"""Does a run train the same model as two baseline runs? Its loss curve against a bound from the baselines' own drift.

    python benchmarks/loss_curves.py --baseline runs/bf16_a.json runs/bf16_b.json --candidate runs/fp8.json \
        --out benchmarks/results/<folder>

Three runs of one model, seed and data (RunResult JSONs with one loss per step): two baselines that differ only by
the run-to-run drift of their kernels (two bf16 runs of the same command), and a candidate that changes one thing (an
fp8 run). Past the learning-rate warm-up, in windows of --window steps (the steps left at the end make a last
window where they are at least half a window, else they join the one before):

  drift    the baselines' mean |loss_a - loss_b| per step: how far two runs of the same setting wander apart
  offset   the candidate's mean |loss_c - (loss_a + loss_b) / 2| per step
  bias     the candidate's mean signed loss_c - (loss_a + loss_b) / 2: a loss higher or lower throughout

The candidate trains the same model where offset <= --factor x drift in every window. A third run of the baselines'
own setting would have offset about 0.87x drift (for independent per-step noise, E|c - (a+b)/2| / E|a - b| =
sqrt(3)/2), so the default factor of 2 leaves room for the candidate's own rounding but not for a curve that sits
apart. Nothing is measured here: every figure derives from the JSONs named, which the output records. Writes
<out>/loss_curves.json and <out>/loss_curves.png, and prints the windows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# What the three runs must share for their losses to be compared step by step (the candidate may differ in one
# setting: --vary, precision by default).
SAME_MODEL = ("preset", "n_layer", "n_embd", "n_head", "seq_len", "vocab_size")
SAME_TRAINING = ("seed", "data", "steps", "micro_batch", "grad_accum", "lr", "min_lr", "lr_warmup_steps",
                 "weight_decay", "grad_clip", "stage")
DEFAULT_FACTOR = 2.0


class CurveError(ValueError):
    """Runs that cannot be compared: the message names the file and what differs."""


def load(path: Path, resumed: bool = False) -> dict:
    """A RunResult JSON with finite losses; one resumed from a checkpoint only where `resumed` (its losses begin at its
    extra.start_step)."""
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CurveError(f"{path} is not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(r, dict) or not r.get("losses") or "train" not in r:
        raise CurveError(f"{path} is not a RunResult JSON with losses (no 'losses' or 'train')")
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in r["losses"]):
        raise CurveError(f"{path}: a loss is not a finite number")
    if not resumed and (r.get("extra") or {}).get("start_step", 0):
        raise CurveError(f"{path} resumed at step {r['extra']['start_step']}: its losses do not start at step 0")
    return r


def setting(r: dict, key: str):
    """A run's setting: from its TrainConfig, else its model config, else its top level (the preset)."""
    model = r.get("model") or {}
    return r["train"][key] if key in r["train"] else model[key] if key in model else r.get(key)


def check_comparable(runs: dict[str, dict], vary: str) -> None:
    """Refuse runs whose losses are not step-for-step comparable, naming the setting and the files."""
    names = list(runs)
    first = runs[names[0]]
    if not all(vary in r["train"] or vary in (r.get("model") or {}) for r in runs.values()):
        raise CurveError(f"--vary {vary}: not a setting the runs record (their 'train' or 'model')")
    for name in names[1:]:
        r = runs[name]
        for key in (*SAME_MODEL, *SAME_TRAINING):
            if key == vary and name == "candidate":  # what the candidate changes
                continue
            a, b = setting(first, key), setting(r, key)
            if a != b:
                raise CurveError(f"{names[0]} and {name} differ in {key} ({a!r} against {b!r}): their losses are "
                                 "not the same model's on the same batches")
    a, b = (setting(runs[n], vary) for n in names[:2])
    if a != b:
        raise CurveError(f"the baselines differ in {vary} ({a!r} against {b!r}): their drift must be one setting's")
    if len({len(r["losses"]) for r in runs.values()}) != 1:
        raise CurveError("the runs have different numbers of losses: " +
                         ", ".join(f"{n} {len(r['losses'])}" for n, r in runs.items()))
    if runs[names[0]]["losses"] == runs[names[1]]["losses"]:
        raise CurveError("the baselines have the same loss at every step (one run given twice?): two runs of one "
                         "setting are needed, their drift is the bound")


def spans(start: int, end: int, window: int) -> list[tuple[int, int]]:
    """Windows of `window` steps over [start, end): the steps left at the end make a last window of their own when
    they are at least half a window, else they join the one before, so that every step past the warm-up is judged."""
    los = list(range(start, end, window))
    if len(los) > 1 and end - los[-1] < (window + 1) // 2:
        los.pop()
    return list(zip(los, [*los[1:], end]))


def windows(a: list[float], b: list[float], c: list[float], start: int, window: int) -> list[dict]:
    """drift, offset and bias per window (spans) of the steps from `start` to the last."""
    out = []
    for lo, hi in spans(start, len(a), window):
        steps = range(lo, hi)
        n = hi - lo
        mean = [(a[i] + b[i]) / 2 for i in steps]
        out.append({
            "steps": [lo, hi],
            "drift": sum(abs(a[i] - b[i]) for i in steps) / n,
            "offset": sum(abs(c[i] - m) for i, m in zip(steps, mean)) / n,
            "bias": sum(c[i] - m for i, m in zip(steps, mean)) / n,
            "baseline_mean_loss": sum(mean) / n,
            "candidate_mean_loss": sum(c[i] for i in steps) / n,
        })
    return out


def judge(runs: dict[str, dict], window: int, factor: float) -> dict:
    (na, a), (nb, b), (nc, c) = ((n, r["losses"]) for n, r in runs.items())
    warmup = int(setting(runs[na], "lr_warmup_steps") or 0)
    if len(a) - warmup < window:
        raise CurveError(f"{len(a)} steps leave {len(a) - warmup} past the {warmup}-step LR warm-up, fewer than one "
                         f"window of {window}: run longer or pass a smaller --window")
    rows = windows(a, b, c, warmup, window)
    for row in rows:
        row["bound"] = factor * row["drift"]
        row["ok"] = row["offset"] <= row["bound"]
    return {"windows": rows, "lr_warmup_steps": warmup, "window": window, "factor": factor,
            "ok": all(r["ok"] for r in rows), "failed_windows": [r["steps"] for r in rows if not r["ok"]],
            "final_loss": {n: r["losses"][-1] for n, r in runs.items()}}


def plot(runs: dict[str, dict], result: dict, path: Path, vary: str) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[3, 2])
    for name, r in runs.items():
        top.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=0.8, alpha=0.8,
                 label=f"{name} ({vary} {setting(r, vary)})")
    top.set_ylabel("training loss (nats/token)")
    top.set_yscale("log")
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    mids = [sum(w["steps"]) / 2 for w in result["windows"]]
    bottom.plot(mids, [w["drift"] for w in result["windows"]], "o-", ms=3, label="drift of the baselines")
    bottom.plot(mids, [w["offset"] for w in result["windows"]], "s-", ms=3, label="offset of the candidate")
    bottom.plot(mids, [w["bound"] for w in result["windows"]], "--", color="gray",
                label=f"bound: {result['factor']:g} x drift")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel(f"mean |loss diff| per {result['window']} steps")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    r = next(iter(runs.values()))
    paths = " and ".join(sorted({str(x.get("path")) for x in runs.values()}))
    fig.suptitle(f"{r.get('preset')}, {r['world_size']} x {r['device'].get('name')}, {paths} path, "
                 f"data {Path(str(r['train'].get('data'))).name}: {'within' if result['ok'] else 'OUTSIDE'} the bound",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", nargs=2, type=Path, required=True, metavar="RUN",
                   help="two RunResult JSONs of one setting: their drift sets the bound")
    p.add_argument("--candidate", type=Path, required=True, metavar="RUN", help="the RunResult JSON judged")
    p.add_argument("--vary", default="precision", help="the setting the candidate changes (default: precision)")
    p.add_argument("--window", type=int, default=50, help="steps per window (default 50)")
    p.add_argument("--factor", type=float, default=DEFAULT_FACTOR,
                   help=f"the bound, as a multiple of the baselines' drift (default {DEFAULT_FACTOR:g})")
    p.add_argument("--out", type=Path, required=True, help="folder for loss_curves.json and loss_curves.png")
    ns = p.parse_args(argv)
    if ns.window < 1 or not ns.factor > 0:
        p.error(f"--window must be >= 1 and --factor > 0 (got {ns.window}, {ns.factor:g})")
    if ns.out.exists() and not ns.out.is_dir():
        p.error(f"--out {ns.out} is a file: it names the folder the JSON and the plot go into")
    paths = {"baseline_a": ns.baseline[0], "baseline_b": ns.baseline[1], "candidate": ns.candidate}
    try:
        runs = {name: load(path) for name, path in paths.items()}
        check_comparable(runs, ns.vary)
        result = judge(runs, ns.window, ns.factor)
    except CurveError as e:
        p.error(str(e))
    result = {"command": " ".join(["python", "benchmarks/loss_curves.py", *(argv if argv is not None else
                                                                              sys.argv[1:])]),
              "runs": {n: {"file": str(paths[n]), "command": r.get("command"), ns.vary: setting(r, ns.vary),
                           "device": (r.get("device") or {}).get("name"), "versions": r.get("versions")}
                       for n, r in runs.items()},
              "vary": ns.vary, **result}
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "loss_curves.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, result, ns.out / "loss_curves.png", ns.vary)
    print(f"{'steps':>11}  {'drift':>9}  {'offset':>9}  {'bound':>9}  {'bias':>10}  ok")
    for w in result["windows"]:
        print(f"{w['steps'][0]:>5}-{w['steps'][1]:<5}  {w['drift']:9.3e}  {w['offset']:9.3e}  {w['bound']:9.3e}  "
              f"{w['bias']:+10.3e}  {'yes' if w['ok'] else 'NO'}")
    verdict = "within" if result["ok"] else f"outside (windows {result['failed_windows']})"
    print(f"candidate {verdict} {ns.factor:g} x the baselines' drift; wrote {ns.out / 'loss_curves.json'}, "
          f"{ns.out / 'loss_curves.png'}")
    return result


if __name__ == "__main__":
    main()
