"""Run the raw DeepSpeed loop and the Lightning path on the same model, seed, batches and DeepSpeed dict, and
report how fast each is, where each spends its time, and the gap.

    python compare.py                                    # no GPU: tiny preset, 1 CPU process (gloo)
    python compare.py --stage 3 --precision bf16         # GPUs: 1.5b preset on every GPU
    python compare.py --preset 1.5b --gpus 2 --micro_batch 8 --repeats 3 --out reports/h200x2

Runs are subprocesses launched the same way for both paths (torchrun), interleaved in pairs whose order
alternates (raw, lightning, then lightning, raw, ...), so that drift of the machine hits both and neither path is
always first (in 6 of the 7 one-pair compares of the H200 tuning runs the path run first, raw, was the slower;
README, "Tuning"); warmup steps are excluded inside each run. Orchestration only: the numbers come from the
RunResult JSON each run writes (shared/results.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import autotune
import explain
from shared.cli import add_config_args, config_from_args, to_argv
from shared.config import TrainConfig
from shared.distributed import check_before_start
from shared.results import RunResult, tflops_convention, versions
from shared.timing import PHASES

ROOT = Path(__file__).resolve().parent
SCRIPTS = {"deepspeed": ROOT / "plain_deepspeed" / "train.py", "lightning": ROOT / "lightning_app" / "train.py",
           "ceiling": ROOT / "benchmarks" / "reference.py", "fsdp2": ROOT / "benchmarks" / "reference.py"}
SCRIPT_ARGS = {"ceiling": ["--mode", "ceiling"], "fsdp2": ["--mode", "fsdp2"]}
PATHS = ("deepspeed", "lightning")
# Reference rows (--reference): the same model, seed and batches without DeepSpeed (benchmarks/reference.py).
# ceiling: unsharded, whole model compiled, one GPU; fsdp2: torch FSDP2 + compiled blocks on the run's GPUs.
REFERENCES = ("ceiling", "fsdp2")
# Parity of the two paths: per step, the loss and DeepSpeed's global gradient norm (before clipping), over a window
# past the LR warm-up (lr_warmup_steps on), in every repeat pair; and a checksum of all parameters at the end
# (sum and sum of squares; shared/ds_runtime.param_checksum). The warm-up is excluded because its small learning
# rates hide what a wrong update does (a missing clip, a wrongly scaled gradient, a wrong LR all move the weights
# by less there). Both paths run the same kernels on the same batches with the same seeds: on CPU they agree bit
# for bit, hence the tight fp32 bounds. On GPUs, kernels with atomics (embedding backward, split-K matmuls, the
# flash-attention backward) are not bitwise deterministic, so bf16 runs drift apart in the low bits:
#   loss: the largest |diff| measured over all steps of the 13 committed bf16 H200 pairs (1.5b, 1 and 2 GPUs,
#     14-25 steps; benchmarks/results/compare_*, tuning_*, blocksparse_*) is 1.40e-4 (compare_1xh200 repeat 1,
#     step 8), 1.39e-4 past the warm-up; the bound is about twice that, 3e-4. In the tiny CPU fault runs of
#     tests/test_compare.py a 2x learning rate moves the loss by 2.1e-3, but a missing clip (7e-5) and the
#     accumulation double scaling (2.5e-5) stay inside any loss bound the drift allows, which is why the gradient
#     norm and the checksum are compared too.
#   gradient norm (relative) and checksum (relative: |d sum_sq| / sum_sq, |d sum| / sqrt(sum_sq)): the committed
#     runs did not record them, so their bf16 bounds are provisional: 1e-3 and 1e-4, about 80x and 8x the
#     measured relative loss drift (1.4e-4 of a loss of ~11.1 at that step), to be confirmed by the first GPU
#     compare that records them. The accumulation double scaling halves the gradient norm (gas 2), far outside.
PARITY_TOLERANCE = {
    "fp32": {"loss": 1e-5, "grad_norm": 1e-5, "checksum": 1e-6},
    "bf16": {"loss": 3e-4, "grad_norm": 1e-3, "checksum": 1e-4},
    "fp16": {"loss": 3e-4, "grad_norm": 1e-3, "checksum": 1e-4},
}
# What compare.py runs on a machine with GPUs when these flags are not given (the study's model and a longer run)
GPU_DEFAULTS = {"preset": "1.5b", "micro_batch": 8, "steps": 30, "warmup_steps": 10}
# A path whose runs' TFLOPs/GPU differ by more than this (max/min) ran on an unsteady machine (other load,
# thermals): its median, and the ratio, are flagged in the report and printed with a WARNING line.
REPEAT_SPREAD_BOUND = 1.10
# After SIGTERM to a run's process group: seconds before what is left of it gets SIGKILL. A run stops at its
# next agreed preemption check (--sigterm_check_every steps); a benchmark run keeps nothing worth waiting for.
GRACE_S = 15


class CompareError(Exception):
    """A run failed; the message names it and where its log is."""

    @property
    def oom(self) -> bool:
        """The run ran out of device memory (see is_oom)."""
        return is_oom(str(self))

    @property
    def reason(self) -> str:
        """The run's own error line if its log had one, else the first line of the message."""
        lines = str(self).splitlines()
        return next((ln for ln in lines if ln.startswith("reason:")), lines[0])


# Process-group ids of the runs in progress (several at once with --parallel, each waited on in its own thread).
RUNNING: set[int] = set()


class Stopped(BaseException):
    """compare.py itself was told to stop (SIGTERM); its running run was stopped with it. A BaseException, as
    KeyboardInterrupt is, so that the searches' `except Exception` (a failed candidate) does not swallow it."""


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def stop_group(pid: int, grace_s: float = GRACE_S) -> None:
    """Stop a run started with start_new_session=True: SIGTERM to its process group (torchrun passes it on to the
    training processes), then SIGKILL to every process of its tree still alive after grace_s.

    The tree is walked, not only the group, because torchrun starts each training process in a session of its own
    (torch.distributed.elastic's subprocess handler): once torchrun is gone they would run on, orphaned. SIGTERM
    and SIGINT to compare.py are held off meanwhile, so a second Ctrl-C cannot leave the run half-stopped.
    """
    import psutil  # a DeepSpeed dependency

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        def tree() -> list:
            try:
                root = psutil.Process(pid)
                return [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return []

        procs = tree()
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        alive = {p.pid: p for p in alive + tree()}  # and what they started meanwhile
        for p in alive.values():
            try:
                p.kill()  # psutil checks the process is still the one listed (pid reuse)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(list(alive.values()), timeout=10)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    for action in p._actions:  # the help says what compare.py changes on GPUs (see parse)
        if action.dest in GPU_DEFAULTS:
            action.help = action.help.replace("(default: ", f"(default on GPUs: {GPU_DEFAULTS[action.dest]}; "
                                              "without a GPU: ")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all); error if fewer exist")
    p.add_argument("--nproc", type=int, default=None, help="processes on a machine without GPUs (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each path, interleaved (default 2)")
    p.add_argument("--cross_check", "--cross-check", action="store_true",
                   help="one extra run per path with DeepSpeed's wall_clock_breakdown (synchronized timers)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds before a single run is killed")
    p.add_argument("--reference", nargs="?", const=",".join(REFERENCES), default="",
                   help="also run reference rows in every round: ceiling (plain PyTorch, whole model compiled, no "
                        "sharding, one GPU) and fsdp2 (torch FSDP2 + compiled blocks); each path is reported as a "
                        "fraction of the ceiling of the same run (default with the flag: ceiling,fsdp2)")
    p.add_argument("--parallel", action="store_true",
                   help="run the two paths of each pair at the same time, each on its own GPU (and the reference "
                        "rows likewise): one-GPU runs on a machine with >= 2 GPUs, half the wall time; the runs "
                        "share the host's CPUs")
    p.add_argument("--explain", action="store_true",
                   help="Lightning with one overhead on at a time, against Lightning without it (explain.py)")
    p.add_argument("--factors", default=None, help="--explain: comma-separated factors (default: all)")
    p.add_argument("--factor_repeats", "--factor-repeats", type=int, default=2,
                   help="--explain: rounds that also run every factor (default 2: a spread, not one difference)")
    p.add_argument("--autotune", action="store_true",
                   help="search micro-batch, checkpointing and ZeRO knobs; write the winner (see autotune.py)")
    p.add_argument("--mb_grid", "--mb-grid", default=None,
                   help="--autotune: micro-batches to try (default 4,8,12,16,24,32 on GPUs, 1,2,4 on CPU)")
    p.add_argument("--budget_s", "--budget-s", type=float, default=None,
                   help="--autotune: time budget in seconds (default 1200 on GPUs, 300 on CPU)")
    # compare.py's --out is a report folder; each run's own JSON goes under it.
    p.set_defaults(out=None)
    return p


def parse(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    """Validate everything before a process is started: a bad flag exits with status 2 and names the value."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        if ns.gpus is not None and ns.gpus > n_gpus:
            raise ValueError(f"--gpus {ns.gpus} asked for but {n_gpus} GPU(s) available")
        if ns.gpus is not None and ns.gpus <= 0:
            raise ValueError(f"--gpus must be positive, got {ns.gpus}")
        if ns.nproc is not None and (ns.nproc <= 0 or n_gpus):
            raise ValueError("--nproc is for machines without GPUs and must be positive; use --gpus on GPUs")
        if ns.repeats <= 0:
            raise ValueError(f"--repeats must be positive, got {ns.repeats}")
        if ns.factor_repeats <= 0:
            raise ValueError(f"--factor_repeats must be positive, got {ns.factor_repeats}")
        if ns.explain:
            explain.parse_factors(ns.factors)
        ns.references = [r.strip() for r in ns.reference.split(",") if r.strip()]
        unknown = sorted(set(ns.references) - set(REFERENCES))
        if unknown:
            raise ValueError(f"unknown --reference row(s) {unknown}; choose from {REFERENCES}")
        if ns.references and (ns.explain or ns.autotune):
            raise ValueError("--reference adds rows to a compare run; it does not combine with --explain/--autotune")
        if ns.parallel and (ns.explain or ns.autotune or ns.cross_check):
            raise ValueError("--parallel runs compare pairs side by side; it does not combine with "
                             "--explain/--autotune/--cross_check")
        if ns.parallel and n_gpus and (ns.gpus != 1 or n_gpus < 2):
            raise ValueError(f"--parallel needs --gpus 1 and at least 2 GPUs (one per path), got --gpus {ns.gpus} "
                             f"with {n_gpus} GPU(s)")
        if ns.explain and ns.autotune:
            raise ValueError("--explain and --autotune are separate modes; pick one")
        if ns.autotune:
            ns.mb_grid = ns.mb_grid or ("4,8,12,16,24,32" if n_gpus else "1,2,4")
            ns.budget_s = ns.budget_s or (1200.0 if n_gpus else 300.0)
            autotune.parse_grid(ns.mb_grid)
            if ns.budget_s <= 0:
                raise ValueError(f"--budget_s must be positive, got {ns.budget_s}")
        ns.world = ns.gpus or n_gpus or ns.nproc or 1
        for key, value in (GPU_DEFAULTS if n_gpus else {}).items():
            if getattr(ns, key) is None:
                setattr(ns, key, value)
        ns.report_dir = Path(ns.out or "reports/latest")
        train = config_from_args(ns, out=str(ns.report_dir / "runs" / "run.json"))
        # precision on this device, token files, --ds_config, size: refused here, not by a run's log
        check_before_start(train, torch.device("cuda" if n_gpus else "cpu"), ns.world, ns.world)
        if ns.explain:  # every factor's config must be valid before the first run starts
            for factor in explain.parse_factors(ns.factors):
                explain.factor_config(train, factor)
    except ValueError as e:
        parser.error(str(e))
    return train, ns


def run_env(extra: dict | None = None) -> dict:
    """The environment a training process is started with: unbuffered output, this repo importable."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def is_oom(text: str) -> bool:
    """A run's message says it ran out of device memory: both paths turn that into "micro_batch N does not fit
    in ..." (shared/distributed.oom_message); an out-of-memory they did not catch still says "out of memory"."""
    return "does not fit" in text or "out of memory" in text.lower()


def launch(path: str, train: TrainConfig, world: int, out: Path, log: Path, timeout: int,
           env: dict | None = None) -> RunResult:
    """Run one path in its own processes (torchrun, one process per GPU) and read back its RunResult.

    env: extra environment for the run (e.g. CUDA_VISIBLE_DEVICES to pin it to some of the GPUs)."""
    run_cfg = dataclasses.replace(train, out=str(out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(SCRIPTS[path]), *SCRIPT_ARGS.get(path, []), *to_argv(run_cfg)]
    log.parent.mkdir(parents=True, exist_ok=True)
    env = run_env(env)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        # Its own session and process group: whatever stops compare.py (SIGTERM, Ctrl-C, an error, the timeout)
        # stops torchrun and every training process with it, instead of leaving them running orphaned.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        RUNNING.add(proc.pid)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            stop_group(proc.pid)
            proc.wait()
            raise CompareError(f"{path} run timed out after {timeout}s; log: {log}") from e
        except BaseException:
            stop_group(proc.pid)
            proc.wait()
            raise
        finally:
            RUNNING.discard(proc.pid)
    if returncode != 0 or not out.is_file():
        lines = log.read_text().splitlines()
        # The script's own message ("error: ...", or a Python exception line) says more than torchrun's summary.
        reasons = [ln for ln in lines if ln.startswith("error:") or ln.startswith("[rank0]: ") and "Error" in ln]
        tail = "\n".join(lines[-15:])
        reason = f"\nreason: {reasons[0]}" if reasons else ""
        raise CompareError(f"{path} run failed (exit {returncode}); log: {log}{reason}\n"
                           f"--- last lines of the log ---\n{tail}")
    result = RunResult.from_json(out)
    print(f"  {path:<9} {result.tflops_per_gpu:9.3f} TFLOPs/GPU  step {result.step_time_s['median'] * 1e3:8.1f} ms"
          f"  ({time.perf_counter() - t0:.0f}s incl. start-up)", flush=True)
    return result


def visible_gpu(slot: int) -> str:
    """The slot-th GPU this process may use, as CUDA_VISIBLE_DEVICES names it for a child ("" on a CPU machine)."""
    if not torch.cuda.is_available():
        return ""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return (visible or [str(i) for i in range(torch.cuda.device_count())])[slot]


def measured(r: RunResult) -> dict:
    """What a benchmark keeps of one run: throughput, step-time spread, phases, peak memory and its command."""
    return {"tflops_per_gpu": r.tflops_per_gpu, "mfu": r.mfu, "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
            "step_time_s": r.step_time_s, "phases_s": r.phases_s, "peak_mem_gib": r.peak_mem_gib,
            "command": r.command}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def summarize_path(runs: list[RunResult]) -> dict:
    tflops = [r.tflops_per_gpu for r in runs]
    mfus = [r.mfu for r in runs if r.mfu is not None]
    mems = [r.peak_mem_gib for r in runs if r.peak_mem_gib is not None]
    return {
        "tflops_per_gpu": statistics.median(tflops),
        "tflops_spread": spread(tflops),
        "sparse_tflops_per_gpu": statistics.median(r.sparse_tflops_per_gpu for r in runs),
        "tflops_per_gpu_causal": (statistics.median(r.tflops_per_gpu_causal for r in runs)
                                  if all(r.tflops_per_gpu_causal is not None for r in runs) else None),
        "mfu": statistics.median(mfus) if mfus else None,
        "tokens_per_s_per_gpu": statistics.median(r.tokens_per_s_per_gpu for r in runs),
        "step_time_s": spread([r.step_time_s["median"] for r in runs]),
        "phases_s": {p: statistics.median(r.phases_s[p] for r in runs) for p in PHASES},
        "peak_mem_gib": max(mems) if mems else None,
        "peak_rss_gib": max(r.peak_rss_gib for r in runs),
        "allocator_cache_flushes": [r.extra.get("allocator_cache_flushes") for r in runs],
        "losses": runs[0].losses,
        "attention": runs[0].attention,
        "compile": runs[0].fused.get("compile", "none"),
        # Warm-up (excluded steps: compilation, DeepCompile's profiling) and torch.compile's own time, per run.
        "warmup_s": [r.extra.get("warmup_s") for r in runs],
        "compile_s": [r.extra.get("compile_s") for r in runs],
        "sdpa_kernel": sorted({r.sdpa_kernel for r in runs}, key=str),  # per kernel seen, one entry
        "fused": runs[0].fused,
        "ds_config": runs[0].ds_config,
        "runs": [{"tflops_per_gpu": r.tflops_per_gpu, "step_time_s": r.step_time_s["median"],
                  "command": r.command} for r in runs],
    }


def _max_abs(a: list, b: list) -> float:
    """Largest |a - b| over steps; a step that is null (a skipped non-finite loss) in one path only is inf."""
    diffs = [abs(x - y) if x is not None and y is not None else 0.0 if x is y else float("inf") for x, y in zip(a, b)]
    return max(diffs, default=0.0)


def _max_rel(a: list, b: list) -> float:
    diffs = [abs(x - y) / max(abs(x), abs(y), 1e-30) if x is not None and y is not None
             else 0.0 if x is y else float("inf") for x, y in zip(a, b)]
    return max(diffs, default=0.0)


def checksum_rel_diff(a: dict, b: dict) -> float:
    """Relative difference of two parameter checksums: |d sum_sq| / sum_sq and |d sum| / sqrt(sum_sq) (the sum's
    typical size when the parameters' signs are mixed), the larger of the two."""
    if a["numel"] != b["numel"]:
        return float("inf")
    scale = max(a["sum_sq"], b["sum_sq"], 1e-30)
    return max(abs(a["sum_sq"] - b["sum_sq"]) / scale, abs(a["sum"] - b["sum"]) / scale**0.5)


def pair_parity(a: dict, b: dict, first_step: int) -> dict:
    """Differences of one pair of runs, each {"losses", "grad_norms", "param_checksum"} (either may lack the last
    two: results written before they were recorded), over steps first_step.. of the shorter run."""
    n = min(len(a["losses"]), len(b["losses"]))
    start = first_step if first_step < n else 0  # a run that ends inside the warm-up is compared whole
    out = {"steps": [start, n], "loss_max_abs_diff": _max_abs(a["losses"][start:n], b["losses"][start:n]),
           "grad_norm_max_rel_diff": None, "checksum_rel_diff": None}
    if a.get("grad_norms") and b.get("grad_norms"):
        out["grad_norm_max_rel_diff"] = _max_rel(a["grad_norms"][start:n], b["grad_norms"][start:n])
    if a.get("param_checksum") and b.get("param_checksum"):
        out["checksum_rel_diff"] = checksum_rel_diff(a["param_checksum"], b["param_checksum"])
    return out


def parity(pairs: list[tuple[dict, dict]], precision: str, lr_warmup_steps: int) -> dict:
    """Parity of every repeat pair past the LR warm-up: loss, gradient norm per step, parameter checksum at the end,
    each against PARITY_TOLERANCE[precision]. A measure neither run recorded is null and not judged."""
    tol = PARITY_TOLERANCE[precision]
    per_pair = [pair_parity(a, b, lr_warmup_steps) for a, b in pairs]

    def worst(key: str) -> float | None:
        values = [p[key] for p in per_pair if p[key] is not None]
        return max(values) if values else None

    report = {
        "pairs": per_pair, "lr_warmup_steps": lr_warmup_steps,
        "past_warmup": all(p["steps"][0] == lr_warmup_steps for p in per_pair),
        "max_abs_diff": worst("loss_max_abs_diff"),
        "grad_norm_max_rel_diff": worst("grad_norm_max_rel_diff"),
        "checksum_rel_diff": worst("checksum_rel_diff"),
        "tolerance": tol,
    }
    checks = {"loss": report["max_abs_diff"], "grad_norm": report["grad_norm_max_rel_diff"],
              "checksum": report["checksum_rel_diff"]}
    report["failed"] = [k for k, v in checks.items() if v is not None and not v <= tol[k]]
    report["ok"] = not report["failed"]
    return report


def loss_parity(ds: list[RunResult], pl: list[RunResult], precision: str, lr_warmup_steps: int) -> dict:
    """parity() of the runs of both paths, pair by pair."""
    def series(r: RunResult) -> dict:
        return {"losses": r.losses, "grad_norms": r.grad_norms, "param_checksum": r.param_checksum}

    return parity([(series(a), series(b)) for a, b in zip(ds, pl)], precision, lr_warmup_steps)


def build_report(train: TrainConfig, ns: argparse.Namespace, results: dict[str, list[RunResult]],
                 cross: dict[str, RunResult], argv: list[str]) -> dict:
    ds, pl = results["deepspeed"], results["lightning"]
    paths = {"deepspeed": summarize_path(ds), "lightning": summarize_path(pl)}
    # One statistic for the headline and the table: the ratio of the table's per-path medians. The per-pair
    # ratios (each Lightning run over the DeepSpeed run of its pair) give its spread only.
    ratios = [b.tflops_per_gpu / a.tflops_per_gpu for a, b in zip(ds, pl)]
    disagree = {}
    for path, p in paths.items():
        s = p["tflops_spread"]
        if s["min"] > 0 and s["max"] / s["min"] > REPEAT_SPREAD_BOUND:
            disagree[path] = s["max"] / s["min"]
    first = ds[0]
    report = {
        "command": " ".join(["python", "compare.py", *argv]),
        "preset": train.preset,
        "world_size": ns.world,
        "device": first.device,
        "versions": versions(),
        "train": dataclasses.asdict(train),
        "repeats": ns.repeats,
        "flops_factor": train.flops_factor,
        "paths": paths,
        "ratio_lightning_over_deepspeed": paths["lightning"]["tflops_per_gpu"] / paths["deepspeed"]["tflops_per_gpu"],
        "ratio_definition": "median TFLOPs/GPU of the Lightning runs / median of the DeepSpeed runs (the table's "
                            "medians); ratio_spread: the per-pair ratios",
        "ratio_spread": spread(ratios),
        "repeat_spread_bound": REPEAT_SPREAD_BOUND,
        "repeats_disagree": disagree,
        "loss_parity": loss_parity(ds, pl, train.precision, train.lr_warmup_steps),
        "same_ds_config": all(r.ds_config == ds[0].ds_config for r in ds + pl),
        "parallel": bool(getattr(ns, "parallel", False)),
    }
    refs = [r for r in REFERENCES if results.get(r)]
    if refs:
        report["reference"] = {r: summarize_path(results[r]) for r in refs}
        for r in refs:
            report["reference"][r]["world_size"] = results[r][0].world_size
    if "ceiling" in refs:
        ceiling = report["reference"]["ceiling"]["tflops_per_gpu"]
        report["fraction_of_ceiling"] = {p: report["paths"][p]["tflops_per_gpu"] / ceiling for p in PATHS}
        if "fsdp2" in refs:
            report["fraction_of_ceiling"]["fsdp2"] = report["reference"]["fsdp2"]["tflops_per_gpu"] / ceiling
    if cross:
        report["cross_check"] = {
            path: {"ds_wall_clock_breakdown_ms": r.ds_breakdown_ms,
                   "phase_timer_ms": {p: r.phases_s[p] * 1e3 for p in PHASES},
                   "tflops_per_gpu_with_syncs": r.tflops_per_gpu}
            for path, r in cross.items()
        }
    return report


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def tflops_spec(report: dict) -> str:
    """Enough digits to tell the paths apart: TFLOPs on a CPU are in the thousandths."""
    return ".2f" if report["paths"]["deepspeed"]["tflops_per_gpu"] >= 1 else ".5f"


def format_table(report: dict) -> str:
    spec = tflops_spec(report)
    rows = [("", "deepspeed", "lightning")]
    P = report["paths"]

    def row(name, fn):
        rows.append((name, fn(P["deepspeed"]), fn(P["lightning"])))

    def tflops_cell(p):
        s = p["tflops_spread"]
        return f"{p['tflops_per_gpu']:{spec}} [{s['min']:{spec}}, {s['max']:{spec}}]"

    row(f"TFLOPs/GPU ({tflops_convention(report['flops_factor'])})", tflops_cell)
    row("TFLOPs/GPU (exact causal count)", lambda p: _fmt(p.get("tflops_per_gpu_causal"), spec))
    row("MFU", lambda p: _fmt(p["mfu"] and 100 * p["mfu"], ".1f") + ("%" if p["mfu"] else ""))
    row("tokens/s/GPU", lambda p: f"{p['tokens_per_s_per_gpu']:,.0f}")
    row("step time ms (median)", lambda p: f"{p['step_time_s']['median'] * 1e3:.1f}")
    for ph in PHASES:
        row(f"  {ph} ms", lambda p, ph=ph: f"{p['phases_s'][ph] * 1e3:.2f}")
    row("peak memory GiB", lambda p: _fmt(p["peak_mem_gib"]) if p["peak_mem_gib"] is not None
        else f"RSS {p['peak_rss_gib']:.2f}")
    row("attention", lambda p: p["attention"] + (f" ({', '.join(map(str, p['sdpa_kernel']))})"
                                                  if any(p.get("sdpa_kernel") or []) else ""))
    row("compile", lambda p: p.get("compile", "none"))
    row("warm-up s (excluded)", lambda p: ", ".join(_fmt(w, ".1f") for w in p.get("warmup_s", [])) or "n/a")
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
    for name, ref in report.get("reference", {}).items():
        s = ref["tflops_spread"]
        frac = report.get("fraction_of_ceiling", {})
        lines.append(f"reference {name} ({ref['world_size']} x, compile {ref['fused']['compile']}): "
                     f"{ref['tflops_per_gpu']:{spec}} [{s['min']:{spec}}, {s['max']:{spec}}] TFLOPs/GPU, "
                     f"step {ref['step_time_s']['median'] * 1e3:.1f} ms, peak "
                     f"{_fmt(ref['peak_mem_gib'])} GiB" + (f", {frac['fsdp2']:.3f} of the ceiling"
                                                          if name == "fsdp2" and "fsdp2" in frac else ""))
    if "fraction_of_ceiling" in report:
        f = report["fraction_of_ceiling"]
        lines.append(f"fraction of the ceiling (median TFLOPs / ceiling median, same run): deepspeed "
                     f"{f['deepspeed']:.3f}, lightning {f['lightning']:.3f}")
    rs, lp = report["ratio_spread"], report["loss_parity"]
    lines.append("")
    lines.append(f"Lightning / DeepSpeed throughput: {report['ratio_lightning_over_deepspeed']:.4f} (ratio of the "
                 f"medians above; per-pair ratios min {rs['min']:.4f}, max {rs['max']:.4f}, {rs['n']} interleaved "
                 "pairs)")
    for path, x in report.get("repeats_disagree", {}).items():
        lines.append(f"WARNING: the {path} runs disagree: max/min TFLOPs/GPU {x:.2f} > "
                     f"{report['repeat_spread_bound']:.2f}; the machine was not steady (other load?), so the "
                     "medians and the ratio are unreliable: rerun on an idle machine or with more --repeats")
    lines.append(format_parity(lp))
    lines.append(f"same DeepSpeed config in every run: {report['same_ds_config']}")
    if "cross_check" in report:
        for path, c in report["cross_check"].items():
            b = c["ds_wall_clock_breakdown_ms"] or {}
            lines.append(f"cross-check {path}: DeepSpeed timers fwd {_fmt(b.get('forward'))} bwd "
                         f"{_fmt(b.get('backward'))} step {_fmt(b.get('step'))} ms vs phase timer fwd "
                         f"{c['phase_timer_ms']['forward']:.2f} bwd {c['phase_timer_ms']['backward']:.2f} step "
                         f"{c['phase_timer_ms']['step']:.2f} ms")
    return "\n".join(lines)


def format_parity(lp: dict) -> str:
    tol, (start, end) = lp["tolerance"], lp["pairs"][0]["steps"]
    window = (f"steps {start}..{end - 1} (past the {lp['lr_warmup_steps']}-step LR warm-up)" if lp["past_warmup"]
              else f"steps {start}..{end - 1} (the run ends inside the {lp['lr_warmup_steps']}-step LR warm-up)")

    def cell(name: str, value: float | None, key: str) -> str:
        return f"{name} {'not recorded' if value is None else f'{value:.2e}'} (tol {tol[key]:.0e})"

    verdict = "OK" if lp["ok"] else "MISMATCH in " + ", ".join(lp["failed"])
    return (f"parity over {window}, {len(lp['pairs'])} pair(s): "
            f"{cell('loss max |diff|', lp['max_abs_diff'], 'loss')}, "
            f"{cell('grad norm max rel diff', lp['grad_norm_max_rel_diff'], 'grad_norm')}, "
            f"{cell('param checksum rel diff', lp['checksum_rel_diff'], 'checksum')} -> {verdict}")


def write_markdown(report: dict, path: Path, chart: str) -> None:
    d = report["device"]
    md = [
        f"# DeepSpeed vs Lightning: {report['preset']} on {report['world_size']} x {d['name']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"ZeRO stage {report['train']['stage']}, {report['train']['precision']}, micro-batch "
        f"{report['train']['micro_batch']}, {report['train']['steps']} steps ({report['train']['warmup_steps']} "
        f"warmup excluded), {report['repeats']} interleaved repeats per path"
        + (" (--parallel: the two paths of each pair, and the reference rows, ran at the same time, one GPU each)."
           if report.get("parallel") else "."),
        "",
        "```",
        format_table(report),
        "```",
        "",
        f"![per-phase time]({chart})",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        "",
    ]
    path.write_text("\n".join(md))


def plot_phases(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.6))
    colors = {"data": "#999999", "forward": "#4c72b0", "backward": "#dd8452", "step": "#55a868"}
    for i, name in enumerate(PATHS):
        left = 0.0
        for ph in PHASES:
            ms = report["paths"][name]["phases_s"][ph] * 1e3
            ax.barh(i, ms, left=left, color=colors[ph], label=ph if i == 0 else None)
            left += ms
    ax.set_yticks(range(len(PATHS)), PATHS)
    ax.set_xlabel("median time per step (ms)")
    ax.set_title(f"{report['preset']}, {report['world_size']} x {report['device']['name']}, "
                 f"ratio {report['ratio_lightning_over_deepspeed']:.3f}", fontsize=9)
    ax.legend(ncol=4, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    train, ns = parse(argv)
    out_dir: Path = ns.report_dir
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    where = f"{ns.world} GPU(s)" if torch.cuda.is_available() else f"{ns.world} CPU process(es), gloo"
    print(f"compare: preset {train.preset}, ZeRO-{train.stage} {train.precision}, micro-batch {train.micro_batch}, "
          f"{train.steps} steps ({train.warmup_steps} warmup), {ns.repeats} repeats, {where}", flush=True)
    run = lambda path, cfg, out, log: launch(path, cfg, ns.world, out, log, ns.timeout)
    if ns.autotune:
        report = autotune.run_autotune(train, ns, run, out_dir)
        report["command"] = " ".join(["python", "compare.py", *argv])
        report["versions"] = versions()
        (out_dir / "autotune.json").write_text(json.dumps(report, indent=1))
        print()
        print(autotune.format_autotune(report))
        print(f"\nwrote {out_dir / 'autotune.json'}" + (f", {out_dir / 'winner_ds_config.json'}"
                                                        if report["winner"] else ""))
        return report
    if ns.explain:
        report = explain.run_explain(train, ns, run, out_dir)
        report["command"] = " ".join(["python", "compare.py", *argv])
        report["versions"] = versions()
        explain.write_explain(report, out_dir)
        print()
        print(explain.format_explain(report))
        print(f"\nwrote {out_dir / 'explain.json'}, {out_dir / 'explain.md'}")
        return report
    results: dict[str, list[RunResult]] = {p: [] for p in (*PATHS, *ns.references)}
    for i in range(ns.repeats):
        order = list(PATHS if i % 2 == 0 else PATHS[::-1])
        groups = [order, ns.references] if ns.parallel else [[p] for p in [*order, *ns.references]]
        for group in filter(None, groups):
            with ThreadPoolExecutor(len(group)) as pool:
                jobs = {}
                for slot, path in enumerate(group):
                    # The ceiling is one unsharded process on the first GPU whatever the run's world size; with
                    # --parallel every run of a group has a GPU of its own.
                    world, env = (1, {"CUDA_VISIBLE_DEVICES": visible_gpu(slot)}) \
                        if ns.parallel or path == "ceiling" else (ns.world, None)
                    jobs[path] = pool.submit(launch, path, train, world, out_dir / "runs" / f"{path}_{i}.json",
                                             out_dir / "logs" / f"{path}_{i}.log", ns.timeout, env=env)
                try:
                    for path in group:
                        results[path].append(jobs[path].result())
                except BaseException:
                    # A signal or a failed run reaches this thread, not the ones waiting on the other runs: stop
                    # those too before leaving (the pool waits for its threads).
                    for pid in list(RUNNING):
                        stop_group(pid)
                    raise
    cross = {}
    if ns.cross_check:
        diag = dataclasses.replace(train, wall_clock_breakdown=True)
        for path in PATHS:
            out = out_dir / "runs" / f"{path}_breakdown.json"
            cross[path] = launch(path, diag, ns.world, out, out_dir / "logs" / f"{path}_breakdown.log", ns.timeout)
    report = build_report(train, ns, results, cross, argv)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    plot_phases(report, out_dir / "phases.png")
    write_markdown(report, out_dir / "report.md", "phases.png")
    print()
    print(format_table(report))
    print(f"\nwrote {out_dir / 'report.json'}, {out_dir / 'report.md'}, {out_dir / 'phases.png'}")
    return report


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        main()
    except CompareError as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    except (Stopped, KeyboardInterrupt) as e:
        name = str(e) if isinstance(e, Stopped) else "SIGINT"
        print(f"compare.py: stopped by {name}; the run in progress was stopped with it (SIGTERM to its process "
              f"group, SIGKILL after {GRACE_S}s); no report was written", file=sys.stderr)
        sys.exit(128 + signal.Signals[name].value)
