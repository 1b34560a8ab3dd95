"""The fused-kernel / compile ablation: both paths, one configuration at a time, in one run.

    python benchmarks/ablation.py --preset 1.5b --micro_batch 8 --out benchmarks/results/ablation_1xh200
    python benchmarks/ablation.py                       # no GPU: tiny preset on CPU

Each configuration adds one switch to the naive model (every switch off), then `compile` (blocks), then `all`
(every switch that ran). Each runs through the raw DeepSpeed loop and the Lightning path: with two or more GPUs
the two paths of a configuration run at the same time on GPU 0 and GPU 1 (one GPU each, so the figures are
1-GPU figures), else one after the other. Then the largest micro-batch without activation checkpointing is
found for the naive and the `all` configuration (raw path; increasing, stops at the first out-of-memory).
Writes ablation.json (every run's TFLOPs/GPU, step-time spread, phases, peak memory, fused paths and dynamo
counters) and ablation.md (the table). A configuration that fails is recorded with its reason; the rest go on.

    python benchmarks/ablation.py --set last_mile --out benchmarks/results/last_mile_ablation_1xh200   # CUDA only

`--set last_mile` starts from compare.py's one-GPU GPU default instead (DeepCompile, --deepcompile_schedule once,
micro-batch 16, coordinate-descent kernel tuning, the vocabulary padded to a multiple of 128, the LM head's loss by a
Triton kernel, the residual dropouts' masks by a Triton kernel, the MLP's bias + GELU backward and the optimizer step
each in one Triton kernel, DeepCompile's backward end waited for on the device, the step's gradient-norm check left on
the device, the tuned ZeRO-3 buckets; 20 steps of which 10 warm-up) and changes one lever per configuration: micro-batch
24 (`+mb24`: each step's host work is the same, its kernels half as long again), the vocabulary unpadded (`-vocab128`),
DeepSpeed's own optimizer step instead of this project's (`-fast_zero3_step`), the fast step's three passes (gradient
copy, torch's fused AdamW, parameter copy) instead of the one kernel (`-fused_zero3_step`, shared/kernels/adamw.py),
DeepCompile without the small parameters kept gathered (`-persist_threshold`, shared/patches/deepcompile_passes.py),
inductor's generated kernels without coordinate-descent tuning (`-coordinate_descent`), inductor's generated bias + GELU
backward instead of that kernel (`-triton_gelu_grad`, shared/kernels/bias_gelu_grad.py), the model's own loss
(inductor's kernels over the whole logits) instead of one Triton kernel per row (`-triton_loss`,
shared/kernels/cross_entropy.py), eager ZeRO-3's list of persistent parameters kept under DeepCompile, so each step
gathers them again (`-drop_eager_persist`, shared/patches/deepcompile.py), DeepSpeed's own walks of the
model around each step instead of lists taken once (`-cached_walks`, shared/patches/deepcompile.py),
inductor's dropout masks, one Philox call per element, instead of the Triton kernel's eight draws per call
(`-triton_dropout`, shared/kernels/dropout_mask.py), DeepSpeed's own DeepCompile op, whose host waits for the backward's
end, instead of the one whose compute stream waits for it (`-device_backward_wait`, shared/patches/deepcompile_op.py),
DeepSpeed's read of the gradient norm's inf/NaN check on the host instead of the flag left on the device, each update
skipping itself there (`-device_norm_check`, shared/patches), and the padded vocabulary, the Triton loss and
the Triton dropout all off (`-together`: each measured within its baselines' noise alone, the three 1.017x together).
The levers measured here and removed since are in docs/ledger.md. The block-sparse kernel is not a lever here: on the
causal layout SDPA (cuDNN) is faster, with and without dropout; benchmarks/attention.py and attention_dropout.py compare
them at the model's shape.
`baseline` runs first and again last (`baseline_again`): each configuration's ratio is against the
mean of the baseline runs, whose two values give the noise. Raw path only by default (`--paths`): a lever changes
the shared model or step, which both paths run alike (compare.py measures their ratio). A DeepCompile run of the
1.5b preset takes ~3 min with its start-up and warm-up, so under a 10-minute time limit one GPU measures two or
three; `--keep` continues an ablation in the same --out: the configurations it already measured with the same base
settings, device and package versions are kept (and not run again if named), the others run. With `--profile_step` the
report adds each run's profiled step by kind of kernel against the baselines' (a lever's kernels apart from the
clock's drift of the matmuls; with `--profile_sync false` its idle is what a step in flight idles).
`--time_limit SECONDS` starts a configuration only if the longest one so far still fits in the time left, else stops
(exit status 3) with the command that runs the rest.

`--gpus N` (CUDA) spreads the configurations over N GPUs, one 1-GPU run on each at a time, a configuration's paths
one after the other on one GPU: every GPU runs the reference configurations named (the baselines named before the
first lever first, those named after it last), each other configuration runs once, on the first GPU free, and its
ratio is against the reference runs of its own GPU, since GPUs of one kind differ in clock (each row records its
GPU's index and UUID; the table names the GPU). With --keep every reference run measured stays, rating the runs of
its own GPU, and a GPU of this machine without one runs it again. On 8 GPUs the last-mile set (14 levers, a baseline
and a baseline again on every GPU) takes at most 4 runs a GPU, against 16 one after the other on one GPU. The runs of a
round compile at the same time on the host's CPUs, baselines and levers alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

if __package__ in (None, ""):
    # Run by path (`python benchmarks/ablation.py`): Python puts benchmarks/, not the repo root, on sys.path, and
    # compare.py imports lightning_app, which is not installed (lightning_app/train.py does the same)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compare import gpu_memory_gib
from harness.autotune import parse_grid
from harness.budget import kinds_ms, minus_mean
from harness.launch import (
    GRACE_S,
    TIME_LIMIT_EXIT,
    CompareError,
    Stopped,
    TimeLimit,
    TimeLimitReached,
    launch,
    raise_stopped,
    run_group,
    stop_running,
    visible_gpu,
)
from harness.report import measured
from shared.train import profiles
from shared.train.config import TrainConfig
from shared.train.results import device_info, replace_text, versions

SWITCHES = {
    "bias_dropout_add": {"fused_bias_dropout_add": True},
    "bias_gelu": {"fused_bias_gelu": True},
    "compile": {"compile": "blocks"},
    "fast_zero3_step": {"zero3_step": "fast"},
}
PATHS = ("deepspeed", "lightning")
LABEL = {"deepspeed": "raw", "lightning": "Lightning"}  # the paths as the tables name them
# Every switch off, spelled out: the bias fusions default to on where CUDA is (shared/model/config.py), the fast
# ZeRO-3 step everywhere (shared/patches/zero3_step.py).
NAIVE = {"fused_bias_dropout_add": False, "fused_bias_gelu": False, "zero3_step": "deepspeed"}


# On top of compare.py's GPU default: one lever per configuration (see the module docstring).
LAST_MILE = {
    "baseline": {},
    # 1.5x the work per step for the same host work per step: the host's launches hidden behind longer kernels
    "+mb24": {"micro_batch": 24},
    "-vocab128": {"vocab_multiple": 1},
    "-fast_zero3_step": {"zero3_step": "deepspeed", "grad_norm_check": "host"},  # DeepSpeed's step checks on the host
    "-persist_threshold": {"deepcompile_persist": "deepspeed"},
    "-coordinate_descent": {"coordinate_descent_tuning": False},
    "-triton_gelu_grad": {"triton_gelu_grad": False},
    "-triton_loss": {"triton_loss": False},
    "-drop_eager_persist": {"deepcompile_eager_persist": "deepspeed"},
    "-cached_walks": {"deepcompile_cached_walks": False},
    "-fused_zero3_step": {"zero3_step": "fast"},
    "-triton_dropout": {"triton_dropout": False},
    "-device_backward_wait": {"deepcompile_backward_wait": "host"},
    "-device_norm_check": {"grad_norm_check": "host"},
    # the three levers of the default that measured within their baselines' noise alone and a gain together, all off
    "-together": {"vocab_multiple": 1, "triton_loss": False, "triton_dropout": False},
    "baseline_again": {},
}
REFERENCE = {"fusions": "naive", "last_mile": "baseline"}  # each set's ratios are against these runs


def configurations() -> dict[str, dict]:
    # naive, compile and all first: a run cut short by a time limit still has the main comparison
    configs = {"naive": {}, "+compile": SWITCHES["compile"],
               "all": {k: v for flags in SWITCHES.values() for k, v in flags.items()}}
    configs.update({f"+{k}": v for k, v in SWITCHES.items() if k != "compile"})
    return {name: {**NAIVE, **flags} for name, flags in configs.items()}


def run_one(base: TrainConfig, name: str, flags: dict, path: str, out: Path, gpu: int | None, timeout: int,
            suffix: str = "") -> dict:
    """One run of configuration `name` on `path`, on this process's GPU slot `gpu` (None: wherever the launcher
    puts it); `suffix` tells apart the files of one configuration run on several GPUs."""
    cfg = dataclasses.replace(base, **flags)
    slug = name.lstrip("+").replace("/", "_") + suffix
    env = {"CUDA_VISIBLE_DEVICES": visible_gpu(gpu)} if gpu is not None else None
    try:
        r = launch(path, cfg, 1, out / "runs" / f"{slug}_{path}.json", out / "logs" / f"{slug}_{path}.log",
                   timeout, env=env)
    except CompareError as e:
        return {"config": name, "path": path, "flags": flags, "micro_batch": cfg.micro_batch, "gpu": gpu, "ok": False,
                "oom": e.oom, "error": e.reason[:300]}
    row = {"config": name, "path": path, "flags": flags, "micro_batch": cfg.micro_batch, "gpu": gpu, "ok": True,
           **measured(r),
           "fused": r.fused, "losses": r.losses[:5], "device": r.device["name"]}
    step = (r.extra.get("profile") or {}).get("step")
    if step:  # --profile_step: the profiled step's device time by kind of kernel, and its idle time
        row["profiled_step_ms"] = {**kinds_ms(step["by_kind_ms"]), "idle": step["idle_ms"]}
    return row


def spread(before, levers: list, after, gpus: int, run, fits) -> list:
    """Run tasks on `gpus` GPUs at once, one task per GPU at a time: each GPU runs the tasks `before(gpu)` lists (the
    reference runs) on itself, then takes the next of `levers` whenever it is free, then runs the tasks
    `after(gpu)` lists on itself. `run(task, gpu)` runs one task; `fits()`, asked before each start under the
    workers' lock, says whether a task may still start (--time_limit). Returns the (task, gpu) pairs never started,
    gpu None for the levers no GPU took: once a task would not fit, or a task raised, no GPU starts another."""
    import collections
    import threading

    queue, lock, skipped, stop = collections.deque(levers), threading.Lock(), [], []

    def tasks(gpu: int):
        yield from before(gpu)
        while True:
            with lock:
                if not queue or stop:
                    break
                task = queue.popleft()
            yield task
        yield from after(gpu)

    def worker(gpu: int) -> None:
        for task in tasks(gpu):
            with lock:
                if stop or not fits():
                    stop.append(gpu)
                    skipped.append((task, gpu))
                    continue
            try:
                run(task, gpu)
            except BaseException:
                with lock:
                    stop.append(gpu)
                raise

    with ThreadPoolExecutor(max_workers=gpus) as pool:
        jobs = [pool.submit(worker, g) for g in range(gpus)]
        try:
            for job in jobs:
                job.result()
        except (Stopped, KeyboardInterrupt):  # these reach this thread only: no GPU starts another, the runs stop
            with lock:
                stop.append(None)
            while not all(job.done() for job in jobs):  # a run started meanwhile included
                stop_running()
                time.sleep(0.1)
            raise
    return skipped + [(task, None) for task in queue]


def gpu_uuids(n: int) -> list[str]:
    """The UUIDs of this process's first n GPUs: which physical GPU a row ran on, across machines and calls."""
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]


def configs_value_joined(argv: list[str]) -> list[str]:
    """`--configs -lever,...` as `--configs=-lever,...`: argparse takes a value that starts with "-" for an option
    and stops with "expected one argument"; every option here starts with "--", so a single "-" is a lever."""
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        nxt = args[i + 1]
        if arg == "--configs" and nxt.startswith("-") and not nxt.startswith("--"):
            args[i:i + 2] = [f"--configs={nxt}"]
            break
    return args


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--set", dest="lever_set", choices=tuple(REFERENCE), default="fusions",
                   help="fusions: the fused kernels and compiled blocks on the naive model (default); last_mile: "
                   "levers on top of the DeepCompile GPU default (CUDA only)")
    p.add_argument("--preset", default="1.5b" if cuda else "tiny")
    p.add_argument("--micro_batch", type=int, default=None,
                   help="default 8 on GPUs (16 with --set last_mile), 2 without")
    p.add_argument("--steps", type=int, default=None, help="default 14 on GPUs (20 with --set last_mile), 6 without")
    p.add_argument("--warmup_steps", type=int, default=None,
                   help="default 5 on GPUs (10 with --set last_mile), 2 without")
    p.add_argument("--zero_profile", default=None,
                   help="DeepSpeed config profile (default: original, the naive one; tuned with --set last_mile)")
    p.add_argument("--profile_step", type=int, default=None,
                   help="profile this step of every run (a warm-up step, before --warmup_steps: the timing excludes "
                   "it); the run JSONs under --out/runs then carry its kernels by kind")
    p.add_argument("--profile_sync", choices=("true", "false"), default=None,
                   help="with --profile_step: false profiles that step as timed steps run (no device syncs at its "
                   "phase boundaries), so its idle time is what a step in flight idles (default true)")
    p.add_argument("--configs", default=None, help="comma-separated subset of the configurations (a list that "
                   "starts with a lever taking something off, e.g. -fast_zero3_step, is read as the value too)")
    p.add_argument("--paths", default=None, help="comma-separated paths (default: deepspeed,lightning; deepspeed "
                   "with --set last_mile)")
    p.add_argument("--mb_sweep", default=None, help="micro-batches above --micro_batch to try without activation "
                   "checkpointing, for naive and all ('' to skip; default 12,16,24 on GPUs with --set fusions)")
    p.add_argument("--keep", action="store_true", help="keep what --out/ablation.json already measured with the "
                   "same base settings, device and versions (named configurations that ran are not run again)")
    p.add_argument("--timeout", type=int, default=600, help="seconds a run may take (default 600)")
    p.add_argument("--time_limit", type=float, default=None,
                   help="seconds this invocation may take: a configuration starts only if the time left is at least "
                        "the longest configuration made so far in this invocation (the first always starts); else "
                        f"the ablation stops with exit status {TIME_LIMIT_EXIT}, what it measured written, and the "
                        "same command with --keep runs the rest. Not with a micro-batch sweep")
    p.add_argument("--gpus", type=int, default=1,
                   help="spread the runs over this many GPUs (CUDA), one 1-GPU run on each at a time: every GPU runs "
                   "the reference configurations named (baseline, baseline_again; naive), each other configuration "
                   "runs once, on the first GPU free, and its ratio is against the reference runs of its own GPU "
                   "(GPUs of one kind still differ in clock). Default 1: one run at a time (the two paths of a "
                   "configuration side by side on GPUs 0 and 1 where there are two)")
    p.add_argument("--out", default="reports/ablation")
    t_start = time.monotonic()
    ns = p.parse_args(configs_value_joined(sys.argv[1:] if argv is None else argv))
    last_mile = ns.lever_set == "last_mile"
    all_configs = LAST_MILE if last_mile else configurations()
    names = list(all_configs) if ns.configs is None else [c.strip() for c in ns.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in all_configs]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(all_configs)}")
    paths = list(dict.fromkeys(x.strip() for x in (ns.paths or ("deepspeed" if last_mile else ",".join(PATHS)))
                               .split(",") if x.strip()))
    if not paths or set(paths) - set(PATHS):
        p.error(f"--paths takes a comma-separated subset of {PATHS}, got {ns.paths!r}")
    if ns.timeout <= 0:
        p.error(f"--timeout must be positive seconds, got {ns.timeout}")
    if last_mile and ns.mb_sweep:
        p.error("--mb_sweep sweeps the naive and all configurations of --set fusions; with --set last_mile a "
                "micro-batch is a lever (+mb24) or --micro_batch")
    if ns.gpus < 1 or (ns.gpus > 1 and (not cuda or ns.gpus > torch.cuda.device_count())):
        p.error(f"--gpus takes 1 up to the GPUs this machine has ({torch.cuda.device_count() if cuda else 0}), "
                f"got {ns.gpus}")
    if ns.gpus > 1 and ns.mb_sweep:
        p.error("--gpus spreads the configurations; the micro-batch sweep runs on one GPU (leave --mb_sweep out or "
                "give it '')")
    if last_mile and not cuda:
        p.error("--set last_mile measures levers on top of DeepCompile, which needs a CUDA GPU; on this machine use "
                "--set fusions (the default)")
    if last_mile:  # the fast profile at the 1.5b preset on one GPU (each run's), its micro-batch where it fits
        try:
            fast = profiles.resolve({"preset": ns.preset, "micro_batch": ns.micro_batch}, "fast", cuda=True, gpus=1,
                                    gpu_memory_gib=gpu_memory_gib())
        except ValueError as e:
            p.error(str(e))
        defaults = {**fast.filled, "steps": 20, "warmup_steps": 10, "zero_profile": "tuned", "profile": "fast"}
        if fast.note:
            print(f"ablation.py: --micro_batch {defaults['micro_batch']}{fast.note}", flush=True)
    else:
        defaults = {"micro_batch": 8 if cuda else 2, "steps": 14 if cuda else 6, "warmup_steps": 5 if cuda else 2,
                    "zero_profile": "original"}
    for key in ("micro_batch", "steps", "warmup_steps", "zero_profile", "profile_step"):
        if getattr(ns, key) is not None:
            defaults[key] = getattr(ns, key)
    if ns.profile_sync is not None:
        defaults["profile_sync"] = ns.profile_sync == "true"
    mb_sweep = ns.mb_sweep if ns.mb_sweep is not None else "12,16,24" if cuda and not last_mile and ns.gpus == 1 \
        else ""
    try:
        sweep = parse_grid(mb_sweep, "--mb_sweep") if mb_sweep.strip() else []  # sorted: it stops at the first OOM
        if ns.time_limit is not None and (ns.time_limit <= 0 or sweep):
            raise ValueError(f"--time_limit must be positive and stops between configurations, not inside a "
                             f"micro-batch sweep (--mb_sweep ''), got --time_limit {ns.time_limit:g}"
                             + (f" with --mb_sweep {mb_sweep}" if sweep else ""))
        base = TrainConfig(preset=ns.preset, stage=3, precision="bf16" if cuda else "fp32",
                           log_every=max(defaults["steps"] // 2, 1), **defaults)
    except ValueError as e:
        p.error(str(e))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        earlier = earlier_report(out / "ablation.json", base) if ns.keep else {}
    except ValueError as e:
        p.error(str(e))
    parallel = cuda and torch.cuda.device_count() >= 2 and len(paths) == 2 and ns.gpus == 1
    gpus = {"deepspeed": 0, "lightning": 1} if parallel else dict.fromkeys(PATHS, 0 if cuda else None)
    t0 = time.perf_counter()
    # --keep: the earlier rows of other configurations stay as they are; those of `names` are reused where they ran
    kept = [dict(r, kept=True) for r in earlier.get("rows", [])]
    rows = [r for r in kept if r["config"] not in names or r["path"] not in paths]
    sweeps = dict(earlier.get("mb_sweep", {}))

    def write() -> dict:  # after every configuration: a run cut short keeps what it measured
        report = {
            "command": " ".join(["python", "benchmarks/ablation.py", *(argv if argv is not None else sys.argv[1:])]),
            "versions": versions(),
            "device": rows[0].get("device") if rows else None,
            "set": ns.lever_set,
            "reference": REFERENCE[ns.lever_set],
            "parallel_paths": parallel,
            "gpus": ns.gpus,
            "base": dataclasses.asdict(base),
            "kept": sorted({r["config"] for r in rows if r.get("kept")}),
            "rows": rows,
            "mb_sweep": sweeps,
            "largest_micro_batch_without_checkpointing": {
                n: max([base.micro_batch] + [r["micro_batch"] for r in rs if r["ok"]]) for n, rs in sweeps.items()},
            "wall_s": time.perf_counter() - t0,
        }
        replace_text(out / "ablation.json", json.dumps(report, indent=2))  # --keep reads it
        (out / "ablation.md").write_text(table(report))
        return report

    done_ok = lambda name: [r for r in kept if r["config"] == name and r["path"] in paths and r["ok"]]
    to_run = [n for n in names if {r["path"] for r in done_ok(n)} != set(paths)]
    command = ["python", "benchmarks/ablation.py", *(argv if argv is not None else sys.argv[1:])]
    clock = TimeLimit(ns.time_limit, t_start, len(to_run) * len(paths), out / "ablation.json", command, ("--keep",))
    if ns.gpus > 1:
        run_spread(base, names, all_configs, paths, out, ns, kept, rows, write, clock)
        report = write()
        print(table(report))
        return report

    def together(calls: list[tuple]) -> list[dict]:
        """run_one(*args) for each args of `calls`: side by side, a thread each, with two GPUs (harness.launch's
        run_group: a signal or a failure stops them all), else one after the other in this thread, where SIGTERM and
        Ctrl-C arrive."""
        if not parallel:
            return [run_one(*args) for args in calls]
        return list(run_group(list(range(len(calls))), lambda _, i: run_one(*calls[i])).values())

    for name in names:
        if name not in to_run:
            print(f"== {name}: kept from {out / 'ablation.json'}", flush=True)
            rows += done_ok(name)
            continue
        clock.before(name)
        print(f"== {name} {all_configs[name]}", flush=True)
        rows += together([(base, name, all_configs[name], path, out, gpus[path], ns.timeout) for path in paths])
        write()
        clock.after(len(paths))
    # the largest micro-batch without activation checkpointing: raw path, naive on GPU 0 and all on GPU 1, each
    # micro-batch in turn until a configuration's first failure (out of memory)
    swept = [n for n in ("naive", "all") if n in names]
    sweeps.update({n: [] for n in swept} if sweep else {})
    for mb in sweep:
        found = together([(dataclasses.replace(base, micro_batch=mb), n, all_configs[n], "deepspeed", out / f"mb{mb}",
                           {"naive": 0, "all": 1}[n] if parallel else gpus["deepspeed"], ns.timeout) for n in swept])
        for n, row in zip(swept, found):
            sweeps[n].append(row)
        swept = [n for n, row in zip(swept, found) if row["ok"]]
        write()
    report = write()
    print(table(report))
    return report


def run_spread(base: TrainConfig, names: list[str], configs: dict, paths: list[str], out: Path, ns, kept: list,
               rows: list, write, clock: TimeLimit) -> None:
    """--gpus N > 1: the named configurations over N GPUs (spread), all paths of a configuration one after the other
    on one GPU. The rows --keep reuses go into `rows` first, each new one as its run ends, and ablation.json is
    written then. The reference configurations named before the first lever run first on every GPU, those named
    after it last. Each row records its GPU's index and UUID; --keep reuses every reference run measured (each rates
    the runs of its own GPU) and runs a reference again on each GPU of this machine that has none, and reuses a lever
    that ran on all paths. Stops (TimeLimitReached) when a run would not fit in --time_limit, once the runs going
    have ended."""
    import threading

    ids = gpu_uuids(ns.gpus)
    ref = {"reference": REFERENCE[ns.lever_set]}
    refs = [n for n in names if is_reference(ref, {"config": n})]
    first = next((i for i, n in enumerate(names) if n not in refs), len(names))
    ok = [r for r in kept if r["config"] in names and r["path"] in paths and r["ok"]]
    complete = lambda rs: {r["path"] for r in rs} == set(paths)
    reused = [r for r in ok if r["config"] in refs]
    reused += [r for n in names if n not in refs and complete(rs := [r for r in ok if r["config"] == n]) for r in rs]
    ran_on = lambda n, g: complete([r for r in reused if r["config"] == n and r.get("gpu_uuid") == ids[g]])
    for r in reused:
        print(f"== {r['config']} ({LABEL[r['path']]}, GPU {r.get('gpu')}): kept from {out / 'ablation.json'}")
    rows += reused

    def own(part: list[str]):  # a GPU's reference runs, less those kept from it
        return lambda gpu: [n for n in part if n in refs and not ran_on(n, gpu)]

    levers = [n for n in names if n not in refs and not any(r["config"] == n for r in reused)]
    lock = threading.Lock()

    def run(name: str, gpu: int) -> None:
        for path in paths:
            with lock:  # one line at a time from the GPUs' threads
                print(f"== {name} {configs[name]} ({LABEL[path]}, GPU {gpu})", flush=True)
            started = time.monotonic()
            row = run_one(base, name, configs[name], path, out, gpu, ns.timeout,
                          suffix=f"_gpu{gpu}" if name in refs else "")
            with lock:
                clock.longest = max(clock.longest, time.monotonic() - started)
                rows.append({**row, "gpu_uuid": ids[gpu]})
                write()

    # a configuration's paths run one after the other: each may take as long as the longest run
    skipped = spread(own(names[:first]), levers, own(names[first:]), ns.gpus, run, lambda: clock.fits(len(paths)))
    if skipped:
        write()
        what = ", ".join(n + ("" if g is None else f" (GPU {g})") for n, g in skipped)
        raise TimeLimitReached(
            f"--time_limit {clock.limit_s:g}: the longest run so far took {clock.longest:.0f} s, more than was left; "
            f"not started: {what}. The finished runs are in {clock.where}; to run the rest: {' '.join(clock.command)}")


def earlier_report(path: Path, base: TrainConfig) -> dict:
    """The earlier ablation in the same --out, if its rows may stand beside new runs: same base settings, package
    versions and device (else a ValueError names what differs); {} when there is none. What this version no longer
    records (a setting or package of a removed option, docs/ledger.md) is not a difference, as in
    shared/train/results.differences."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    for what, key, value in (("base settings", "base", dataclasses.asdict(base)), ("versions", "versions", versions())):
        theirs = old.get(key) or {}
        diff = sorted(k for k in value if theirs.get(k) != value[k])
        if diff:
            raise ValueError(f"--keep: {path} was measured with other {what} ({', '.join(diff)}); use another --out")
    device = device_info()["name"]
    if old.get("device") not in (None, device):
        raise ValueError(f"--keep: {path} was measured on {old['device']}, this machine has {device}")
    return old


def spread_gpus(report: dict) -> bool:
    """Whether the report's runs were spread over GPUs (--gpus > 1): each is then rated against its own GPU's."""
    return report.get("gpus", 1) > 1


def gpu_key(row: dict):
    """Which GPU a row ran on: its UUID where recorded (--gpus), else its index on its machine."""
    return row.get("gpu_uuid") or row.get("gpu")


def gpu_labels(report: dict) -> dict:
    """{gpu_key: "GPU i"} for the table, with the UUID's end where one index names GPUs of several machines."""
    keys = dict.fromkeys((gpu_key(r), r.get("gpu")) for r in report["rows"])
    shared = {i for _, i in keys if sum(j == i for _, j in keys) > 1}
    return {k: f"GPU {i}" + (f" ...{str(k)[-6:]}" if i in shared else "") for k, i in keys}


def baseline_values(report: dict, path: str, gpu=None) -> list[float]:
    """TFLOPs/GPU of the set's reference runs on `path` (naive; baseline and baseline_again); with runs spread over
    GPUs, those of the GPU `gpu` names (gpu_key)."""
    return [r["tflops_per_gpu"] for r in report["rows"] if r["path"] == path and r.get("ok")
            and is_reference(report, r) and (not spread_gpus(report) or gpu_key(r) == gpu)]


def is_reference(report: dict, row: dict) -> bool:
    """Whether `row` is one of the set's reference runs (naive; baseline and baseline_again)."""
    ref = report.get("reference", "naive")
    return row["config"] == ref or row["config"].startswith(ref + "_")


def table(report: dict) -> str:
    spread_ = spread_gpus(report)
    line_of = (lambda r: (r["config"], gpu_key(r))) if spread_ else (lambda r: (r["config"], None))
    by = {(*line_of(r), r["path"]): r for r in report["rows"]}
    ref = report.get("reference", "naive")
    paths = [p for p in PATHS if any(r["path"] == p for r in report["rows"])]
    labels = gpu_labels(report) if spread_ else {None: ""}
    base = {(p, g): baseline_values(report, p, g) for p in paths for g in labels}
    mean = {k: sum(v) / len(v) if v else None for k, v in base.items()}
    against = f"vs {ref}" + (" of its GPU" if spread_ else "")
    head = "| configuration | " + " | ".join(f"{LABEL[p]} TFLOPs/GPU [step min-max] | {against} | {LABEL[p]} peak GiB"
                                             for p in paths)
    lines = [head + (" | Lightning/raw |" if len(paths) == 2 else " |"),
             "|---|" + "---|---|---|" * len(paths) + ("---|" if len(paths) == 2 else "")]
    for name, gpu in dict.fromkeys(line_of(r) for r in report["rows"]):
        cells = []
        for p in paths:
            r = by.get((name, gpu, p), {})
            mb = f", mb {r['micro_batch']}" if r and r["micro_batch"] != report["base"]["micro_batch"] else ""
            if not r:
                cells += ["", "", ""]
                continue
            if not r.get("ok"):
                cells += [f"failed{mb}: " + ("out of memory" if r.get("oom") else r.get("error", "?")[:60]), "", ""]
                continue
            m = mean.get((p, gpu if spread_ else None))
            rel = f"{r['tflops_per_gpu'] / m:.3f}" if m else ""
            spread = f" [{r['step_time_s']['min'] * 1e3:.0f}-{r['step_time_s']['max'] * 1e3:.0f} ms]"
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "n/a"
            cells += [f"{_fmt(r['tflops_per_gpu'])}{spread}{mb}", rel, mem]
        ratio = ""
        if len(paths) == 2:
            ds, pl = by.get((name, gpu, "deepspeed"), {}), by.get((name, gpu, "lightning"), {})
            ratio = f" {pl['tflops_per_gpu'] / ds['tflops_per_gpu']:.3f} |" if ds.get("ok") and pl.get("ok") else " |"
        label = f"{name} ({labels[gpu]})" if spread_ else name
        lines.append(f"| {label} | " + " | ".join(cells) + f" |{ratio}")
    for (p, g), values in base.items():
        on = f" on {labels[g]}" if spread_ else ""
        if len(values) > 1:
            m = mean[(p, g)]
            lines.append(f"\n{LABEL[p]} {ref} runs{on}: " + ", ".join(_fmt(v) for v in values) +
                         f" TFLOPs/GPU (ratios above{on} are against their mean {_fmt(m)}; they differ by "
                         f"{(max(values) - min(values)) / m:.2%})")
    lines += profiled_table(report)
    for name, mb in report["largest_micro_batch_without_checkpointing"].items():
        tried = ", ".join(f"{r['micro_batch']}: " + (_fmt(r["tflops_per_gpu"]) if r["ok"] else
                                                      "OOM" if r.get("oom") else "failed")
                          for r in report["mb_sweep"][name])
        lines.append(f"\nLargest micro-batch without activation checkpointing, {name}: {mb} (raw; tried {tried})")
    return "\n".join(lines) + "\n"


def profiled_table(report: dict) -> list[str]:
    """With --profile_step: each run's profiled step, ms by kind of kernel and idle, against the mean of its path's
    baseline runs. A lever's own kernels show there apart from the clock's drift of the matmuls and attention,
    which moves a whole step by as much as a small lever does."""
    rows = [r for r in report["rows"] if r.get("ok") and r.get("profiled_step_ms")]
    if not rows:
        return []
    lines = ["\nProfiled step, device ms by kind of kernel (and idle), each against the mean of its path's baseline "
             "runs" + (" on its GPU" if spread_gpus(report) else "") + " (+ is slower):\n",
             "| configuration | path | " + " | ".join(rows[0]["profiled_step_ms"]) + " |",
             "|---|---|" + "---|" * len(rows[0]["profiled_step_ms"])]
    for r in rows:
        ms = r["profiled_step_ms"]
        base = [b["profiled_step_ms"] for b in rows if b["path"] == r["path"] and is_reference(report, b)
                and (not spread_gpus(report) or gpu_key(b) == gpu_key(r))]
        delta = {k: f" ({d:+.1f})" for k, d in minus_mean(ms, base).items()} if base else {}
        cells = [f"{v:.1f}{delta.get(k, '')}" for k, v in ms.items()]
        label = f"{r['config']} ({gpu_labels(report)[gpu_key(r)]})" if spread_gpus(report) else r["config"]
        lines.append(f"| {label} | {LABEL[r['path']]} | " + " | ".join(cells) + " |")
    return lines


def _fmt(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, raise_stopped)
    try:
        main()
    except TimeLimitReached as e:
        print(f"ablation.py: {e}", file=sys.stderr)
        sys.exit(TIME_LIMIT_EXIT)
    except (Stopped, KeyboardInterrupt) as e:  # as compare.py: the configurations finished stay in ablation.json
        name = str(e) if isinstance(e, Stopped) else "SIGINT"
        print(f"ablation.py: stopped by {name}; the run in progress was stopped with it (SIGTERM to its process "
              f"group, SIGKILL after {GRACE_S}s); the configurations finished are in --out's ablation.json",
              file=sys.stderr)
        sys.exit(128 + signal.Signals[name].value)
