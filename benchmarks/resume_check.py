"""Does a run resumed from a mid-run checkpoint train on as the uninterrupted run did, and what do its checkpoints and
validation passes cost?

    python benchmarks/resume_check.py --full full.json --resumed resumed.json --drift plain.json \
        --out benchmarks/results/<folder>

--full is a run that validated and saved checkpoints mid-run (its JSON's `extra.val` and `extra.saves` hold each
pass's step and seconds); --resumed is the same command resumed from one of those checkpoints (`--resume
<ckpt_dir>/stepNNNNNNNN`: its JSON starts at that step, `extra.start_step`) to the same last step; --drift is an
uninterrupted run of the same settings without the mid-run passes. Over the steps the resumed run trained, its losses
and gradient norms, and the parameter checksum both end with, are judged against the full run's by compare's parity
(harness.report.parity): within the precision's fixed bounds, or RUN_TO_RUN_FACTOR x the drift of the full run
against --drift over the same steps where that is larger (two uninterrupted runs of one setting part by their
kernels' rounding; a restored checkpoint should part no further). Without --drift only the fixed bounds apply, which
runs on real text under DeepCompile exceed between any two runs (docs/results.md).

The costs: each checkpoint's and validation pass's seconds, and what one costs in the full run's median steps.
Nothing is measured here: every figure derives from the JSONs named, which the output records. Writes
<out>/resume_check.json and prints the verdict; exit 0 where the resumed run is within the bounds, 1 where not, 2 for
runs that cannot be compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run by path: Python puts benchmarks/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

from benchmarks.loss_curves import SAME_MODEL, SAME_TRAINING, CurveError, load, setting  # noqa: E402
from harness.report import parity  # noqa: E402

# What the runs must share for their steps to be compared one by one: loss_curves' model and training, and here also
# the precision and the speed profile.
SAME = (*SAME_MODEL, *SAME_TRAINING, "precision", "profile")


class ResumeError(CurveError):
    """Runs that cannot be compared: the message names the file and what is wrong."""


def start(r: dict) -> int:
    return int((r.get("extra") or {}).get("start_step") or 0)


def series(r: dict, first: int, last: int) -> dict:
    """A run's losses and gradient norms over steps [first, last) of the run (its lists begin at its start step), and
    its final parameter checksum."""
    s = start(r)
    norms = r.get("grad_norms")
    return {"losses": r["losses"][first - s:last - s], "grad_norms": norms[first - s:last - s] if norms else None,
            "param_checksum": r.get("param_checksum")}


def check(full: dict, resumed: dict, drift: dict | None, names: dict[str, str]) -> int:
    """The step the resumed run starts at, after refusing runs that cannot be compared."""
    if start(full):
        raise ResumeError(f"{names['full']} is itself resumed (at step {start(full)}): the full run starts at step 0")
    at = start(resumed)
    if not at:
        raise ResumeError(f"{names['resumed']} starts at step 0: not a resumed run (extra.start_step)")
    runs = {"resumed": resumed, **({"drift": drift} if drift else {})}
    for name, r in runs.items():
        for key in SAME:
            a, b = setting(full, key), setting(r, key)
            if a != b:
                raise ResumeError(f"{names['full']} and {names[name]} differ in {key} ({a!r} against {b!r}): not one "
                                  "setting's runs")
    if drift and start(drift):
        raise ResumeError(f"{names['drift']} is resumed (at step {start(drift)}): the drift run must be uninterrupted")
    for name, r in {"full": full, **runs}.items():
        if start(r) + len(r["losses"]) != full["train"]["steps"]:
            raise ResumeError(f"{names[name]} ended at step {start(r) + len(r['losses'])}, not at the last step "
                              f"({full['train']['steps']}): a run cut short")
    saved = [s["step"] for s in (full.get("extra") or {}).get("saves", [])]
    if at not in saved:
        raise ResumeError(f"{names['resumed']} resumed at step {at}, where {names['full']} saved no checkpoint "
                          f"(it saved at {saved or 'no step'})")
    if at < full["train"]["lr_warmup_steps"]:
        raise ResumeError(f"{names['resumed']} resumed at step {at}, inside the {full['train']['lr_warmup_steps']}-"
                          "step learning-rate warm-up: parity is judged past it")
    return at


def costs(full: dict) -> dict:
    """Each mid-run pass's seconds, their median, and the median in the full run's median steps."""
    step = (full.get("step_time_s") or {}).get("median")
    out = {"step_median_s": step}
    for kind, key in (("checkpoint", "saves"), ("validation", "val")):
        rows = [{"step": p["step"], "seconds": p["seconds"]} for p in (full.get("extra") or {}).get(key, [])]
        median = statistics.median(p["seconds"] for p in rows) if rows else None
        out[kind] = {"passes": rows, "median_s": median,
                     "median_in_steps": median / step if median is not None and step else None}
    return out


def judge(full: dict, resumed: dict, drift: dict | None, names: dict[str, str]) -> dict:
    at = check(full, resumed, drift, names)
    last = full["train"]["steps"]
    uninterrupted = series(full, at, last)
    same_path = [(uninterrupted, series(drift, at, last))] if drift else []
    report = parity([(uninterrupted, series(resumed, at, last))], full["train"]["precision"], 0, same_path)
    return {"resumed_at": at, "steps": [at, last], "parity": report, "ok": report["ok"], "costs": costs(full)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", type=Path, required=True, help="the run that validated and saved mid-run")
    p.add_argument("--resumed", type=Path, required=True, help="the same command resumed from one of its checkpoints")
    p.add_argument("--drift", type=Path, help="an uninterrupted run of the same settings: the same-path drift")
    p.add_argument("--out", type=Path, required=True, help="folder for resume_check.json")
    ns = p.parse_args(argv)
    if ns.out.exists() and not ns.out.is_dir():
        p.error(f"--out {ns.out} is a file: it names the folder resume_check.json goes into")
    paths = {"full": ns.full, "resumed": ns.resumed, **({"drift": ns.drift} if ns.drift else {})}
    names = {k: str(v) for k, v in paths.items()}
    try:
        runs = {k: load(v, resumed=True) for k, v in paths.items()}
        result = judge(runs["full"], runs["resumed"], runs.get("drift"), names)
    except CurveError as e:
        p.error(str(e))
    result = {"command": " ".join(["python", "benchmarks/resume_check.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "runs": {k: {"file": names[k], "command": r.get("command"), "path": r.get("path"),
                           "device": (r.get("device") or {}).get("name"), "versions": r.get("versions")}
                       for k, r in runs.items()}, **result}
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "resume_check.json").write_text(json.dumps(result, indent=1) + "\n")
    par, c = result["parity"], result["costs"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3g}"
    print(f"resumed at step {result['resumed_at']}, steps {result['steps'][0]}-{result['steps'][1] - 1} against the "
          f"uninterrupted run ({'with' if ns.drift else 'without'} a drift run):")
    for k, key in (("loss", "max_abs_diff"), ("grad_norm", "grad_norm_max_rel_diff"),
                   ("checksum", "checksum_rel_diff")):
        drift = par["run_to_run"][k] if par["run_to_run"] else None
        print(f"  {k:<10} {fmt(par[key])}  bound {fmt(par['bound'][k])}  (drift {fmt(drift)})")
    for kind in ("checkpoint", "validation"):
        print(f"  a {kind}: {len(c[kind]['passes'])} x, median {fmt(c[kind]['median_s'])} s = "
              f"{fmt(c[kind]['median_in_steps'])} median steps")
    print(("within the bounds" if result["ok"] else f"OUTSIDE the bounds: {', '.join(par['failed'])}")
          + f"; wrote {ns.out / 'resume_check.json'}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
