"""Launching runs: each path (or reference row) in its own process group, as compare.py, explain, autotune and the
benchmarks start them, and stopping them again.

A run is `python -m torch.distributed.run --standalone` of the path's script (a reference row: `-m harness.reference`)
with the run's flags; the numbers come back in the RunResult JSON the run writes (shared/train/results.py). Whatever
stops the caller (SIGTERM, Ctrl-C, an error, the timeout) stops the run's whole process tree with it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from harness import telemetry
from shared.train.cli import to_argv
from shared.train.config import TrainConfig
from shared.train.distributed import with_own_ninja
from shared.train.results import RunResult

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"deepspeed": ROOT / "plain_deepspeed" / "train.py", "lightning": ROOT / "lightning_app" / "train.py",
           "stock": ROOT / "plain_deepspeed" / "train.py", "bf16": ROOT / "plain_deepspeed" / "train.py"}
# The reference rows are a module of this library, run as `torchrun -m harness.reference` (the paths are scripts).
MODULES = {"unsharded": "harness.reference", "ceiling": "harness.reference", "fsdp2": "harness.reference"}
SCRIPT_ARGS = {row: ["--mode", row] for row in MODULES}
PATHS = ("deepspeed", "lightning")
# Reference rows (--reference): the same model, seed and batches (harness/reference.py). unsharded: the ZeRO-3
# paths' 16-bit weights, fp32 masters and optimizer step without the sharding, one GPU (what ZeRO-3 costs is
# measured against it); ceiling: the PyTorch user's baseline, fp32 weights under autocast and torch's fused AdamW,
# one GPU; fsdp2: torch FSDP2 + compiled blocks on the run's GPUs; stock: the raw path under the stock profile,
# DeepSpeed as shipped (shared/train/profiles.py), on the run's GPUs; bf16 (fp8 compares only): the raw path at bf16
# under the paths' profile, its precision rules applied for bf16, on the run's GPUs: what FP8 gains, round by round.
REFERENCES = ("unsharded", "ceiling", "fsdp2", "stock", "bf16")
# The unsharded, ceiling and fsdp2 rows (harness/reference.py) build their own models, which no FP8 conversion
# reaches: beside fp8 paths they would read as what the setup costs when it is what fp8 saves.
FP8_REFUSAL = ("the reference rows unsharded, ceiling and fsdp2 run bf16 or fp32 models of their own, not the paths' "
               "FP8 conversion: with --precision fp8 use --reference stock (the raw path under the stock profile) "
               "or bf16 (the raw path at bf16, for what FP8 gains), or compare them in a bf16 compare")
BF16_ROW_REFUSAL = ("--reference bf16 runs the raw path at bf16 beside an FP8 compare (what FP8 gains); this compare "
                    "trains in {precision}: add --precision fp8, or leave the bf16 row out")
# The rows that run a path's script under another config (row_config), beside the paths on the run's GPUs.
SCRIPT_ROWS = ("stock", "bf16")
# The rows that run as one unsharded process on one GPU, whatever the compare's world size.
ONE_PROCESS = ("unsharded", "ceiling")
# --time_limit: the rows a reference row's first run is planned from (TimeLimit; none named: every row). The stock
# and bf16 rows compile the paths' model with DeepCompile, the others compile models of their own.
COLD_ROWS = {row: PATHS if row in SCRIPT_ROWS else () for row in REFERENCES}
# --time_limit: a cold row's factor where it is not TimeLimit.COLD_FACTOR. The bf16 row compiles the fp8 paths' model
# without the FP8 casts, a smaller graph than theirs, so it is planned at the paths' longest run: at COLD_FACTOR times
# a cold fp8 run, no 10-minute call could ever start it (docs/tuning.md, "Runs under a time limit").
COLD_FACTORS = {"bf16": 1.0}
# After SIGTERM to a run's process group: seconds before what is left of it gets SIGKILL. A run stops at its
# next agreed preemption check (shared/train/preemption.CHECK_EVERY steps); a benchmark run keeps nothing worth
# waiting for.
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


# Exit status of compare.py and benchmarks/ablation.py when --time_limit stopped them between runs (the finished runs
# are kept; the same command with --keep_runs / --keep runs the rest): distinct from a failure (1), a bad flag (2)
# and a signal (128 + n).
TIME_LIMIT_EXIT = 3


class TimeLimitReached(Exception):
    """--time_limit: the next run would not end inside the limit; it was not started, nothing is lost."""


class TimeLimit:
    """--time_limit: before each run (or group of runs side by side), whether it still fits in the time left, planned
    at the longest run so far of each of its rows (compare's paths and references), or at the longest run of any row
    for a row that has none yet. "So far" counts the runs an earlier invocation left (`kept_s`: (row, launch_s)
    pairs, start-up and compilation included): a continued compare whose first call compiled cold must not start a
    row the second call cannot finish because that call's own runs were warm. Each row keeps its own longest run, so
    a row that runs shorter is not planned at another row's cold compile, which would leave a call's time unused. A
    row of `cold_rows` with no run yet (compare's reference rows: they compile graphs no path compiled, so their first
    run compiles cold) is planned at COLD_FACTOR (or its row's entry in `cold_factors`) times the longest run so far
    of the rows `cold_rows` names for it (none named: of any row): a run cut by the call's end loses all its time, one
    not started loses a call's start-up. The stock and bf16 rows compile the paths' model with DeepCompile as they
    do, so they are planned from the paths' runs, not from a whole-model row's compile, which can take far longer.
    With nothing run or kept yet, the first run starts. A stop names the command that runs the rest: `command` with a
    keep flag (the first of `keep_flags`) added if it has none."""

    # The reference rows' first runs it was set from: docs/tuning.md ("Runs under a time limit").
    COLD_FACTOR = 1.8

    def __init__(self, limit_s: float | None, t0: float, runs: int, where: Path, command: list,
                 keep_flags: tuple[str, ...], kept_s: list[tuple[str, float]] = (),
                 cold_rows: dict[str, tuple[str, ...]] | None = None, cold_factors: dict[str, float] | None = None):
        self.limit_s, self.t0, self.left, self.where, self.cold_rows = limit_s, t0, runs, where, dict(cold_rows or {})
        self.cold_factors = dict(cold_factors or {})
        self.command = [str(a) for a in command]
        if not set(keep_flags) & set(self.command):
            self.command.append(keep_flags[0])
        self.row_s: dict[str, float] = {}  # each row's longest run
        for row, s in kept_s:
            self.row_s[row] = max(self.row_s.get(row, 0.0), s)
        self.started, self.longest, self.rows = t0, max(self.row_s.values(), default=0.0), ()

    def planned_s(self, rows: tuple[str, ...] = ()) -> float:
        """The seconds a run of these rows is planned at: each row's longest run, else the longest run of any row
        (for a row of `cold_rows`, its cold factor times the longest of the rows it names, or of any)."""
        return max((self.row_s.get(r, self.cold_basis_s(r) * self.cold_factor(r) if r in self.cold_rows
                                   else self.longest) for r in rows), default=self.longest)

    def cold_factor(self, row: str) -> float:
        return self.cold_factors.get(row, self.COLD_FACTOR)

    def cold_basis_s(self, row: str) -> float:
        """The longest run so far of the rows a cold row's first run is planned from (none named: of any row)."""
        return max((self.row_s[r] for r in self.cold_rows.get(row, ()) if r in self.row_s), default=self.longest)

    def basis_words(self, row: str) -> str:
        return f" of {' and '.join(self.cold_rows[row])}" if self.cold_rows.get(row) else ""

    def fits(self, runs: int = 1, rows: tuple[str, ...] = ()) -> bool:
        """Whether `runs` runs of `rows` still fit in the time left (always before the first run)."""
        left_s = (self.limit_s or 0) - (time.monotonic() - self.t0)
        return self.limit_s is None or not self.longest or left_s >= self.planned_s(rows) * runs

    def before(self, what: str, rows: tuple[str, ...] = ()) -> None:
        self.started, self.rows = time.monotonic(), tuple(rows)
        left_s = (self.limit_s or 0) - (self.started - self.t0)
        if not self.fits(rows=self.rows):
            own = all(r in self.row_s for r in self.rows) and self.rows
            cold = [r for r in self.rows if r in self.cold_rows and r not in self.row_s]
            plan = (f"the longest run of {' and '.join(self.rows)} took {self.planned_s(self.rows):.0f} s" if own else
                    f"a first run of {' and '.join(cold)} compiles cold: planned at {self.cold_factor(cold[0]):g}x "
                    f"the longest run so far{self.basis_words(cold[0])} ({self.cold_basis_s(cold[0]):.0f} s), "
                    f"{self.planned_s(self.rows):.0f} s" if cold else
                    f"the longest run so far took {self.planned_s(self.rows):.0f} s")
            raise TimeLimitReached(
                f"--time_limit {self.limit_s:g}: {max(left_s, 0):.0f} s left, and {plan}; "
                f"stopped before {what}, {self.left} run(s) left. The finished runs are in {self.where}; to run the "
                f"rest: {' '.join(self.command)}")

    def after(self, n_runs: int) -> None:
        took = time.monotonic() - self.started
        self.longest = max(self.longest, took)
        self.row_s.update({r: max(self.row_s.get(r, 0.0), took) for r in self.rows})
        self.left -= n_runs


def raise_stopped(signum, frame) -> None:
    """Signal handler: turn SIGTERM into Stopped (installed by compare.py's entry point)."""
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



def run_env(extra: dict | None = None) -> dict:
    """The environment a training process is started with: unbuffered output, this repo importable, this
    environment's ninja first on PATH (one ninja for every op build: shared/train/distributed.with_own_ninja)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = with_own_ninja(env.get("PATH", ""))
    return env


def is_oom(text: str) -> bool:
    """A run's message says it ran out of device memory: both paths turn that into "micro_batch N does not fit
    in ..." (shared/train/distributed.oom_message); an out-of-memory they did not catch still says "out of memory"."""
    return "does not fit" in text or "out of memory" in text.lower()


def row_config(row: str, train: TrainConfig, world: int, filled: Iterable[str] = ()) -> TrainConfig:
    """The config a compare row runs: the compare's own, except
    - stock: the speed settings come from the stock profile (its rules applied for this run: stage, attention backend,
      user JSON), keeping the compare's warm-up where it is longer;
    - bf16 (beside an fp8 compare): precision bf16, and the speed settings the paths' profile filled (`filled`, the
      names in profiles.Resolved.filled) filled again for bf16, so that its rules for fp8 (the unfused tails) do not
      carry over; the flags the user gave, the micro-batch and the warm-up stay the compare's. ValueError where the
      compare is not fp8."""
    if row not in SCRIPT_ROWS:
        return train
    from shared.train import profiles

    cuda = torch.cuda.is_available()
    if row == "stock":
        given = {k: v for k, v in dataclasses.asdict(train).items()
                 if k not in profiles.SPEED_FIELDS and k != "profile"}
        stock = profiles.resolve(given, "stock", cuda=cuda, gpus=world)
        settings = {**stock.filled, "warmup_steps": max(train.warmup_steps, stock.filled.get("warmup_steps", 0))}
        return dataclasses.replace(train, profile="stock", **settings)
    if train.precision != "fp8":
        raise ValueError(BF16_ROW_REFUSAL.format(precision=train.precision))
    keep = {"micro_batch", "warmup_steps"}
    given = {k: v for k, v in dataclasses.asdict(train).items() if (k not in filled or k in keep) and k != "profile"}
    given["precision"] = "bf16"
    bf16 = profiles.resolve(given, train.profile, cuda=cuda, gpus=world)
    return dataclasses.replace(train, precision="bf16", fp8_recipe=TrainConfig.fp8_recipe, **bf16.filled)


def launch(path: str, train: TrainConfig, world: int, out: Path, log: Path, timeout: int,
           env: dict | None = None) -> RunResult:
    """Run one row in its own processes (torchrun, one process per GPU) with `train`, the row's config (row_config),
    and read back its RunResult.

    env: extra environment for the run (e.g. CUDA_VISIBLE_DEVICES to pin it to some of the GPUs)."""
    run_cfg = dataclasses.replace(train, out=str(out))
    entry = ["-m", MODULES[path]] if path in MODULES else [str(SCRIPTS[path])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           *entry, *SCRIPT_ARGS.get(path, []), *to_argv(run_cfg)]
    log.parent.mkdir(parents=True, exist_ok=True)
    gpus = run_gpus(env, world)
    env = run_env(env)
    t0 = time.perf_counter()
    # the SM clock and power of the run's GPUs, read beside it (harness/telemetry.py); none on a CPU machine
    tele = telemetry.Telemetry(gpus, log.with_suffix(".gpu.csv")).start() if gpus else None
    try:
        returncode = _run(path, cmd, env, log, timeout)
    finally:
        if tele is not None:
            tele.stop()
    if returncode != 0 or not out.is_file():
        lines = log.read_text().splitlines()
        tail = "\n".join(lines[-15:])
        reason = failure_reason(lines)
        reason = f"\nreason: {reason}" if reason else ""
        raise CompareError(f"{path} run failed (exit {returncode}); log: {log}{reason}\n"
                           f"--- last lines of the log ---\n{tail}")
    result = RunResult.from_json(out)
    if tele is not None:
        result.extra["gpu_telemetry"] = ({"gpus": gpus, "error": tele.error} if tele.error else
                                         telemetry.summarize(tele.csv_path, result.extra.get("timed_wall"), gpus,
                                                             tele.interval_ms))
    # the run's wall time from launch to exit, start-up and compilation included: what a continued compare's
    # --time_limit plans the next call's runs with (TimeLimit's kept_s)
    result.extra["launch_s"] = time.perf_counter() - t0
    result.to_json(out)
    clock = telemetry.held_sm_mhz(result.extra)
    print(f"  {path:<9} {result.tflops_per_gpu:9.3f} TFLOPs/GPU  step {result.step_time_s['median'] * 1e3:8.1f} ms"
          + (f"  SM {clock:.0f} MHz" if clock else "")
          + f"  ({result.extra['launch_s']:.0f}s incl. start-up)", flush=True)
    return result


# A run's own message: the paths' refusals ("error: ...", shared/train/distributed.run_cli) and the exception line
# that ends a Python traceback, with or without the "[rankN]:" prefix torch puts on a training process's output.
_REASON = re.compile(r"^(?:\[rank(\d+)\]:)?\s*(error: .*|[\w.]+(?:Error|Exception|Interrupt)\b.*:.*)$")


def failure_reason(lines: list[str]) -> str | None:
    """The line of a failed run's log that says why: the last refusal or exception line of rank 0 (or of a process
    not yet in the process group, whose output has no rank prefix), else of any rank. torchrun's own ChildFailedError,
    which only says that a training process failed, is passed over."""
    found = [(m[1] in (None, "0"), m[2]) for m in map(_REASON.match, lines)
             if m and "ChildFailedError" not in m[2]]
    return next((text for rank0, text in reversed(found) if rank0), found[-1][1] if found else None)


def run_gpus(env: dict | None, world: int) -> list[str]:
    """The GPUs a run will use, as CUDA_VISIBLE_DEVICES names them (its own, where `env` pins one); [] on a CPU."""
    if not torch.cuda.is_available():
        return []
    pinned = (env or {}).get("CUDA_VISIBLE_DEVICES")
    if pinned:
        return [v.strip() for v in pinned.split(",") if v.strip()][:world]
    return [visible_gpu(i) for i in range(min(world, torch.cuda.device_count()))]


def _run(path: str, cmd: list[str], env: dict, log: Path, timeout: int) -> int:
    """One run's process group, its output in `log`; its exit status."""
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
    return returncode


def visible_gpu(slot: int) -> str:
    """The slot-th GPU this process may use, as CUDA_VISIBLE_DEVICES names it for a child ("" on a CPU machine)."""
    if not torch.cuda.is_available():
        return ""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return (visible or [str(i) for i in range(torch.cuda.device_count())])[slot]



def stop_running() -> None:
    """stop_group every run this process started that is still running (RUNNING)."""
    for pid in list(RUNNING):
        stop_group(pid)


def run_group(group: list[str], launch_one) -> dict:
    """Run the paths of `group` at the same time, `launch_one(slot, path)` each in a thread of its own, and return
    {path: RunResult}. When one fails, or a signal arrives, every other run of the group is stopped before this
    returns (the pool waits for its threads)."""
    with ThreadPoolExecutor(len(group)) as pool:
        jobs = {path: pool.submit(launch_one, slot, path) for slot, path in enumerate(group)}
        try:
            return {path: jobs[path].result() for path in group}
        except BaseException:
            # A signal or a failed run reaches this thread, not the ones waiting on the other runs: stop those too.
            stop_running()
            raise
