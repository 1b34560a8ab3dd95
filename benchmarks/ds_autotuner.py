"""DeepSpeed's own autotuner on the raw loop, and its answer measured against compare.py --autotune's winner.

    python benchmarks/ds_autotuner.py --preset 1.5b --mb_list 8,12,16 --out reports/ds_autotuner
    python benchmarks/ds_autotuner.py --preset 1.5b --mb_list 8,12,16 --versus reports/autotune/autotune.json
    python benchmarks/ds_autotuner.py --preset 1.5b --versus reports/autotune/autotune.json --reuse  # no re-tuning
    python benchmarks/ds_autotuner.py                  # no GPU: tiny preset, one CPU process, micro-batches 1,2

What it runs: `deepspeed --autotuning tune --include localhost:0,..,N-1 plain_deepspeed/train.py --deepspeed_config
CONFIG ...` (so on GPUs 0..N-1).
CONFIG is build_ds_config's dict for the run's flags with zero_optimization cut to the stage, the micro-batch
list to try, and an `autotuning` section: each experiment is a fresh launch whose engine times the profile steps
with DeepSpeed's synchronized timers, writes `throughput` (samples/s) and exits. The raw loop takes DeepSpeed's
--deepspeed_config (a path, or the base64 text the autotuner passes) and gets the experiment's micro-batch and
gradient accumulation as --micro_batch/--grad_accum (autotuning.arg_mappings).

DeepSpeed 0.19.8's autotuner runs here in its fast mode only, the micro-batch search: its experiments run
DeepSpeed's default ZeRO-3 knobs (it replaces zero_optimization with {"stage": 3}). Its full mode, which then
grids over buckets, overlap_comm and contiguous gradients, fails in DeepSpeed itself: the experiments it builds
for that grid carry no "hostfile" entry (KeyError: 'hostfile' in autotuning/scheduler.py run_experiment) and
none of the user config's other sections (bf16, the autotuning section that makes the engine report a metric).
Compiled blocks are refused for the same reason: their leaf-module setting lives in zero_optimization.
The GPUs are given as --include, not --num_gpus N: with --num_gpus the autotuner's pool is every GPU of the
machine and it runs experiments side by side, on GPUs another job may be using, and its arg_mappings then race:
the experiments share one argument list that each launch rewrites. Measured on 2 H200s with --num_gpus 1: the
micro-batch-8 experiment ran on GPU 1 with --micro_batch 12, which the raw loop refused (its config said 8).
Its clean-up after each experiment calls pdsh; on one machine there is nothing left to clean, and a stand-in
pdsh (it runs the command locally) is put on PATH when pdsh is missing.

With --versus AUTOTUNE_JSON (the autotune.json that `compare.py --autotune` wrote) the raw loop then runs
DeepSpeed's optimal config and our winner alternately, --repeats times each, through compare.py's launcher,
and reports tokens/s per GPU of each, the ratio (ours / DeepSpeed's) and its spread over the pairs.
Writes ds_autotuner.json (command, versions, device, every experiment, the optimal config, the head-to-head)
and ds_optimal_config.json, which both paths accept: --ds_config FILE --micro_batch M --grad_accum A.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.autotune import parse_grid
from harness.launch import ROOT, CompareError, is_oom, launch, run_env
from harness.order import round_order
from harness.report import measured, spread
from shared.train.cli import add_config_args, config_from_args, to_argv
from shared.train.config import TrainConfig
from shared.train.distributed import free_port
from shared.train.ds_config import build_ds_config
from shared.train.results import device_info, versions

RAW = ROOT / "plain_deepspeed" / "train.py"
# Flags the autotuner sets per experiment (arg_mappings) or that this script sets: not passed through.
OWN = {"micro_batch", "grad_accum", "ds_config", "steps", "warmup_steps", "out"}
# DeepSpeed's autotuner cleans up each experiment with `pdsh -f N -w HOSTS pkill -f NAME`. The stand-in drops
# pdsh's options and runs the command here; pkill -f NAME also matches the stand-in's own command line and ends it
# (DeepSpeed takes that exit as success), after the finished experiment had nothing left to kill.
PDSH_STANDIN = """#!/bin/sh
# Stand-in for pdsh on one machine, written by benchmarks/ds_autotuner.py.
while [ $# -gt 0 ]; do case "$1" in -f|-w|-R) shift 2;; *) break;; esac; done
"$@"
exit 0
"""
GRACE_S = 40  # after SIGTERM: the training processes' preemption handler stops at its next check


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--gpus", type=int, default=None, help="GPUs per experiment (default: all; 1 CPU process)")
    p.add_argument("--mb_list", "--mb-list", default=None,
                   help="micro-batches per GPU for the autotuner to try (default 8,12,16 on GPUs, 1,2 on CPU)")
    p.add_argument("--start_profile_step", type=int, default=3, help="first step the autotuner times (default 3)")
    p.add_argument("--end_profile_step", type=int, default=5, help="last step it times; the run exits after it")
    p.add_argument("--tuner_timeout", type=int, default=1800, help="seconds before the autotuner is stopped")
    p.add_argument("--versus", default=None, help="autotune.json of compare.py --autotune: run its winner "
                   "against DeepSpeed's optimal config, alternately")
    p.add_argument("--repeats", type=int, default=2, help="--versus: runs of each config (default 2)")
    p.add_argument("--reuse", action="store_true", help="--versus only: take the autotuner's results already "
                   "in --out (its ds_autotuner.json) instead of running it again")
    p.add_argument("--timeout", type=int, default=900, help="--versus: seconds before one run is killed")
    p.set_defaults(out=None)
    return p


def parse(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    parser = build_parser()
    ns = parser.parse_args(argv)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        if ns.gpus is not None and ns.gpus <= 0:
            raise ValueError(f"--gpus must be positive, got {ns.gpus}")
        ns.world = ns.gpus or n_gpus or 1
        if ns.world > max(n_gpus, 1):
            raise ValueError(f"--gpus {ns.gpus}: {n_gpus} GPU(s) available (one process without a GPU)")
        ns.mbs = parse_grid(ns.mb_list or ("8,12,16" if n_gpus else "1,2"), "--mb_list")
        if not 0 <= ns.start_profile_step <= ns.end_profile_step:
            raise ValueError(f"need 0 <= --start_profile_step <= --end_profile_step, got "
                             f"{ns.start_profile_step} and {ns.end_profile_step}")
        if ns.repeats <= 0:
            raise ValueError(f"--repeats must be positive, got {ns.repeats}")
        if ns.tuner_timeout <= 0 or ns.timeout <= 0:  # else every experiment or run is stopped as it starts
            raise ValueError(f"--tuner_timeout and --timeout must be positive seconds, got {ns.tuner_timeout} and "
                             f"{ns.timeout}")
        ns.out_dir = Path(ns.out or "reports/ds_autotuner")
        if ns.out_dir.exists() and not ns.out_dir.is_dir():
            raise ValueError(f"--out {ns.out_dir} is a file: give the folder to write the autotuner's results in")
        if ns.reuse and (ns.versus is None or not (ns.out_dir / "ds_autotuner.json").is_file()):
            raise ValueError("--reuse needs --versus and a finished autotuner run in --out (ds_autotuner.json)")
        if ns.versus is not None and not Path(ns.versus).is_file():
            raise ValueError(f"--versus {ns.versus!r} does not exist (compare.py --autotune writes autotune.json)")
        for key, value in (dict(preset="1.5b", steps=30, warmup_steps=10) if n_gpus else {}).items():
            if getattr(ns, key) is None:
                setattr(ns, key, value)
        train = config_from_args(ns, out=None)
        if train.ds_config is not None:
            raise ValueError("--ds_config: this script writes the autotuner's config itself")
        if train.compile == "blocks" and train.stage == 3:
            raise ValueError("--compile blocks cannot be autotuned by DeepSpeed: its experiments replace "
                             "zero_optimization, which holds the leaf-module setting compiled blocks need")
    except ValueError as e:
        parser.error(str(e))
    return train, ns


def autotuner_config(train: TrainConfig, ns) -> dict:
    """build_ds_config's dict for the run, as the autotuner's user config."""
    cfg = build_ds_config(train)
    cfg["zero_optimization"] = {"stage": train.stage}  # what its micro-batch experiments run anyway
    cfg["train_micro_batch_size_per_gpu"] = ns.mbs
    cfg["gradient_accumulation_steps"] = train.grad_accum
    cfg["autotuning"] = {
        "enabled": True, "fast": True, "metric": "throughput",
        "start_profile_step": ns.start_profile_step, "end_profile_step": ns.end_profile_step,
        "results_dir": str((ns.out_dir / "results").resolve()), "exps_dir": str((ns.out_dir / "exps").resolve()),
        "overwrite": True,
        "arg_mappings": {"train_micro_batch_size_per_gpu": "--micro_batch",
                         "gradient_accumulation_steps": "--grad_accum"},
    }
    return cfg


def passthrough(train: TrainConfig) -> list[str]:
    """The run's flags for every experiment, less those the autotuner or this script sets."""
    argv, flags = [], to_argv(train)
    for name, value in zip(flags[::2], flags[1::2]):
        if name[2:] not in OWN:
            argv += [name, value]
    return argv


def stop_process_group(pgid: int) -> None:
    """SIGTERM a process group, then SIGKILL what is left of it after GRACE_S. The group, not the process tree
    (harness.launch.stop_group): the launcher may be gone already, its experiments still running in its group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def run_tuner(train: TrainConfig, ns, config_path: Path) -> tuple[list[str], float, int]:
    # --include, not --num_gpus: with --num_gpus the pool is every GPU of the machine (see the docstring)
    gpus = ",".join(str(i) for i in range(ns.world))
    # DeepSpeed's launcher listens on 29500 unless told, and the autotuner runs experiment i on that port + i: a
    # free port lets the search run beside another job (or test) that holds 29500
    cmd = ["deepspeed", "--master_port", str(free_port()), "--autotuning", "tune", "--include", f"localhost:{gpus}",
           str(RAW), "--deepspeed_config", str(config_path.resolve()), "--steps", str(ns.end_profile_step + 1),
           "--warmup_steps", str(ns.start_profile_step), *passthrough(train)]
    env = run_env()
    # The autotuner launches each experiment as `deepspeed ...`: the one installed beside this Python.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    if shutil.which("pdsh", path=env["PATH"]) is None:
        bin_dir = ns.out_dir / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        (bin_dir / "pdsh").write_text(PDSH_STANDIN)
        (bin_dir / "pdsh").chmod(0o755)
        env["PATH"] = f"{bin_dir.resolve()}{os.pathsep}{env['PATH']}"
    log = ns.out_dir / "autotuner.log"
    print(f"ds_autotuner: {' '.join(cmd)}\n  log: {log}", flush=True)
    t0 = time.perf_counter()
    rc = -1
    with open(log, "w") as f:
        # its own process group, so that the experiments it launched go down with it, whatever stops this script
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=ns.tuner_timeout)
        except subprocess.TimeoutExpired:
            print(f"ds_autotuner: stopped after --tuner_timeout {ns.tuner_timeout}s", flush=True)
        finally:
            stop_process_group(proc.pid)
    return cmd, time.perf_counter() - t0, rc


def _read_json(path: Path) -> dict | None:
    """A JSON file the autotuner or an experiment wrote, or None when it is missing or cut short."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_experiments(results: Path, seq_len: int, world: int) -> list[dict]:
    """Every experiment the autotuner launched, best first; its model-info run first of all when that failed."""
    from deepspeed.autotuning.utils import search_error

    def error(exp_dir: Path, default: str) -> str:
        return (search_error(str(exp_dir / "stderr.log")) or default).strip()[:300]

    rows = []
    for exp_dir in sorted(p for p in results.glob("*") if p.is_dir()):
        exp = _read_json(exp_dir / "exp.json")
        if exp_dir.name == "profile_model_info":  # the model-info run: only a failure is worth a row
            if _read_json(exp_dir / "model_info.json") is None:
                rows.append({"name": exp_dir.name, "status": "failed", "error": error(exp_dir, "no model_info.json")})
            continue
        if exp is None:
            rows.append({"name": exp_dir.name, "status": "failed", "error": "no readable exp.json"})
            continue
        ds = exp["ds_config"]
        row = {"name": exp_dir.name, "micro_batch": ds["train_micro_batch_size_per_gpu"],
               "grad_accum": ds.get("gradient_accumulation_steps", 1), "zero_optimization": ds["zero_optimization"]}
        m = _read_json(exp_dir / "metrics.json")
        if m is not None:
            # throughput: train_batch_size * 1e6 / latency, latency in microseconds (engine._autotuning_exit)
            row.update(status="ok", samples_per_s=m["throughput"], latency_ms=m["latency"] / 1e3,
                       tokens_per_s_per_gpu=m["throughput"] * seq_len / world)
        else:
            err = error(exp_dir, "no readable metrics.json")
            row.update(status="oom" if is_oom(err) else "failed", error=err)
        rows.append(row)
    return sorted(rows, key=lambda r: -r.get("tokens_per_s_per_gpu", -1.0))


def head_to_head(train: TrainConfig, ns, optimal: dict, optimal_path: Path) -> dict:
    """Our autotune winner vs DeepSpeed's optimal config on the raw loop, alternately, --repeats each."""
    report = _read_json(Path(ns.versus))
    if report is None or not report.get("winner"):
        raise ValueError(f"--versus {ns.versus}: no winner in it (compare.py --autotune writes one)")
    if report.get("complete") is False:  # rewritten after every candidate while the search runs
        raise ValueError(f"--versus {ns.versus}: its search has not finished (complete: false); let it finish, or "
                         "continue it with compare.py --autotune --keep_runs and the same --out")
    for key, here in (("preset", train.preset), ("world_size", ns.world)):
        if report.get(key, here) != here:
            raise ValueError(f"--versus {ns.versus}: its winner was found for {key} {report[key]}, this run has {here}")
    ours = dataclasses.replace(train, zero_profile="tuned", **report["winner"]["knobs"])
    theirs = dataclasses.replace(train, ds_config=str(optimal_path), micro_batch=optimal["micro_batch"],
                                 grad_accum=optimal["grad_accum"])
    runs = {"ours": [], "deepspeed_autotuner": []}
    pair = (("deepspeed_autotuner", theirs), ("ours", ours))
    for i in range(ns.repeats):
        for name, cfg in round_order(pair, i):  # neither always first (harness/order.py)
            out, log = ns.out_dir / "versus" / f"{name}_{i}.json", ns.out_dir / "versus" / f"{name}_{i}.log"
            try:
                r = launch("deepspeed", cfg, ns.world, out, log, ns.timeout)
                runs[name].append({**measured(r), "extra": r.extra})
            except CompareError as e:
                runs[name].append({"error": e.reason[:300], "oom": e.oom})
    pairs = [a["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
             for a, b in zip(runs["ours"], runs["deepspeed_autotuner"])
             if "error" not in a and "error" not in b]
    median = lambda name, key: statistics.median(r[key] for r in runs[name] if key in r) \
        if any(key in r for r in runs[name]) else None
    return {
        "ours": {"knobs": report["winner"]["knobs"], "autotune_json": str(ns.versus)},
        "deepspeed_autotuner": {"micro_batch": optimal["micro_batch"], "grad_accum": optimal["grad_accum"]},
        "runs": runs,
        "tokens_per_s_per_gpu": {n: median(n, "tokens_per_s_per_gpu") for n in runs},
        "tflops_per_gpu": {n: median(n, "tflops_per_gpu") for n in runs},
        "ratio_ours_over_deepspeed": spread(pairs) if pairs else None,
    }


def format_report(report: dict) -> str:
    lines = [f"{'experiment':<24} {'mb':>3} {'gas':>4} {'tokens/s/GPU':>13}  status"]
    for r in report["experiments"]:
        speed = f"{r['tokens_per_s_per_gpu']:13,.0f}" if r["status"] == "ok" else f"{'':13}"
        lines.append(f"{r['name']:<24} {r.get('micro_batch', ''):>3} {r.get('grad_accum', ''):>4} {speed}  "
                     f"{r['status']}{': ' + r['error'] if r.get('error') else ''}")
    opt = report["optimal"]
    lines.append("")
    lines.append(f"DeepSpeed's optimal: micro-batch {opt['micro_batch']}, gradient accumulation {opt['grad_accum']}; "
                 f"train with {opt['flags']}" if opt else "DeepSpeed's autotuner found no optimal config")
    v = report.get("versus")
    if v:
        t, f = v["tokens_per_s_per_gpu"], v["tflops_per_gpu"]
        lines.append(f"head to head (raw loop, {len(v['runs']['ours'])} runs each, alternating):")
        for name in ("deepspeed_autotuner", "ours"):
            lines.append(f"  {name:<20} {t[name]:10,.0f} tokens/s/GPU  {f[name]:8.2f} TFLOPs/GPU" if t[name]
                         else f"  {name:<20} every run failed: {v['runs'][name][0]['error']}")
        q = v["ratio_ours_over_deepspeed"]
        lines.append(f"  ours / DeepSpeed's: {q['median']:.3f} [{q['min']:.3f}, {q['max']:.3f}] over {q['n']} pairs"
                     if q else "  no pair of runs completed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    train, ns = parse(argv)
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    optimal_path, results = ns.out_dir / "ds_optimal_config.json", ns.out_dir / "results"
    if ns.reuse:
        report = _read_json(ns.out_dir / "ds_autotuner.json")
        if report is None or "optimal" not in report:
            print(f"ds_autotuner: error: {ns.out_dir / 'ds_autotuner.json'} is not a finished autotuner run",
                  file=sys.stderr)
            sys.exit(1)
        report["versus_command"] = " ".join(["python", "benchmarks/ds_autotuner.py", *argv])
        for key in ("versus", "versus_error"):  # a head-to-head of an earlier --reuse
            report.pop(key, None)
        optimal = report["optimal"]
    else:
        for stale in (results, optimal_path):  # an earlier run's answer must not pass for this one's
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
        config_path = ns.out_dir / "ds_autotuner_config.json"
        config_path.write_text(json.dumps(autotuner_config(train, ns), indent=1))
        cmd, tuner_s, rc = run_tuner(train, ns, config_path)
        optimal = None
        if (results / "ds_config_optimal.json").is_file():
            cfg = json.loads((results / "ds_config_optimal.json").read_text())
            optimal_path.write_text(json.dumps(cfg, indent=1))
            mb, gas = cfg["train_micro_batch_size_per_gpu"], cfg.get("gradient_accumulation_steps", 1)
            optimal = {"micro_batch": mb, "grad_accum": gas, "ds_config": cfg,
                       "flags": f"--ds_config {optimal_path} --micro_batch {mb} --grad_accum {gas}"}
        report = {
            "command": " ".join(["python", "benchmarks/ds_autotuner.py", *argv]),
            "autotuner_command": " ".join(cmd), "autotuner_exit": rc, "autotuner_s": tuner_s,
            "versions": versions(),
            "device": device_info(),
            "world_size": ns.world, "mode": "fast (micro-batch only; see the docstring for full mode)",
            "experiments": read_experiments(results, train.model().seq_len, ns.world) if results.is_dir() else [],
            "optimal": optimal,
        }
    if ns.versus and optimal:
        try:
            report["versus"] = head_to_head(train, ns, optimal, optimal_path)
        except ValueError as e:
            report["versus_error"] = str(e)
    (ns.out_dir / "ds_autotuner.json").write_text(json.dumps(report, indent=1))
    print(format_report(report))
    print(f"\nwrote {ns.out_dir / 'ds_autotuner.json'}" + (f", {optimal_path}" if optimal else ""))
    if optimal is None:
        print(f"ds_autotuner: error: DeepSpeed's autotuner wrote no optimal config (exit {report['autotuner_exit']}); "
              f"see {ns.out_dir / 'autotuner.log'} and {results}", file=sys.stderr)
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
