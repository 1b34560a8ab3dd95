"""Run the raw DeepSpeed loop and the Lightning path on the same model, seed, batches and DeepSpeed dict, and
report how fast each is, where each spends its time, and the gap.

    python compare.py                                    # no GPU: tiny preset, 1 CPU process (gloo)
    python compare.py --stage 3 --precision bf16         # GPUs: 1.5b preset on every GPU
    python compare.py --preset 1.5b --gpus 2 --micro_batch 8 --repeats 3 --out reports/h200x2

Runs are subprocesses launched the same way for both paths (torchrun), interleaved in pairs whose order
alternates (raw, lightning, then lightning, raw, ...), so that drift of the machine hits both and neither path is
always first (in the tuning runs' one-pair compares the path run first was the slower one in all but one:
docs/tuning.md); warmup steps are excluded inside each run. Orchestration only: the numbers come from the
RunResult JSON each run writes (shared/train/results.py). This file is the command line only: launching, ordering
and reporting live in the harness/ library, which benchmarks/ use too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import signal
import sys
import time
from pathlib import Path

import torch

from harness import autotune, explain
from harness.launch import (
    COLD_FACTORS,
    COLD_ROWS,
    FP8_REFUSAL,
    GRACE_S,
    ONE_PROCESS,
    PATHS,
    REFERENCES,
    SCRIPT_ROWS,
    TIME_LIMIT_EXIT,
    CompareError,
    Stopped,
    TimeLimit,
    TimeLimitReached,
    launch,
    raise_stopped,
    row_config,
    run_group,
    visible_gpu,
)
from harness.order import round_order
from harness.report import build_report, format_table, plot_phases, smoke_test_note, write_markdown
from lightning_app.overheads import check_overheads
from shared.train.cli import MORE_TITLE, Parser, add_config_args, apply_profile, config_from_args, option_group
from shared.train.config import TrainConfig, normalize_precision
from shared.train.data import SHIPPED
from shared.train.distributed import check_before_start, gpu_memory_gib
from shared.train.results import RunResult, differences, replace_text, versions

# What compare.py runs on a machine with GPUs when these flags are not given: the study's model and a longer run.
# The speed settings come from the run's profile (shared/train/profiles.py: fast on GPUs, eager on a CPU).
GPU_DEFAULTS = {"preset": "1.5b", "micro_batch": 8, "steps": 30, "warmup_steps": 10}


def _fill_unset(ns: argparse.Namespace, defaults: dict) -> None:
    """Give every flag of `defaults` the user did not set (None) its default."""
    for key, value in defaults.items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__)
    add_config_args(p)
    for action in p._actions:  # the help says what compare.py changes on GPUs (see parse)
        if action.dest == "micro_batch":
            action.help += "; the profile's where it sets one (see --profile)"
        if action.dest == "data":
            action.help = action.help.replace("(default: synthetic)", f"(default in compare.py: {SHIPPED}, so that "
                                              "loss parity judges real training)")
        if action.dest in GPU_DEFAULTS:
            action.help = action.help.replace("(default: ", f"(default on GPUs: {GPU_DEFAULTS[action.dest]}; "
                                              "without a GPU: ")
    more = option_group(p, MORE_TITLE)
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all); error if fewer exist")
    more.add_argument("--nproc", type=int, default=None, help="processes on a machine without GPUs (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each path, interleaved (default 2)")
    more.add_argument("--cross_check", "--cross-check", action="store_true",
                   help="one extra run per path with DeepSpeed's wall_clock_breakdown (synchronized timers)")
    more.add_argument("--timeout", type=int, default=1800, help="seconds before a single run is killed")
    p.add_argument("--reference", nargs="?", const="all", default="",
                   help="also run reference rows in every round: unsharded (the ZeRO-3 paths' bf16 weights, fp32 "
                        "masters, AdamW step and compile without sharding, one GPU: what ZeRO-3 itself costs), "
                        "ceiling (the PyTorch user's baseline: fp32 weights under autocast, torch's fused AdamW, "
                        "whole model compiled, one GPU), fsdp2 (torch FSDP2 + compiled blocks), stock (the raw "
                        "path under --profile stock: DeepSpeed as shipped) and, with --precision fp8, bf16 (the raw "
                        "path at bf16: what FP8 gains); each path is reported against them, per round (default "
                        "with the flag: every row the compare can run: in fp8 stock and bf16, else the first four, "
                        "stock on GPUs only); "
                        "row:N runs a row in the first N rounds only (unsharded,ceiling:1)")
    more.add_argument("--reference_rounds", "--reference-rounds", type=int, default=None,
                   help="run the reference rows in the first N rounds only (default: every round); the fractions of "
                        "the unsharded row and the ceiling then divide by the median of those N runs")
    p.add_argument("--keep_runs", "--keep-runs", action="store_true",
                   help="continue a cut compare: keep the runs that an earlier invocation with the same flags left in "
                        "--out (runs/<row>_<round>.json), run only the missing ones; a run made with other settings "
                        "is refused by name. With --autotune: continue a cut search from --out's autotune.json")
    p.add_argument("--time_limit", "--time-limit", type=float, default=None,
                   help="seconds this invocation may take (a job's or a session's time limit): a run starts only if "
                        "the time left is at least its row's longest run so far, kept runs included (a new row: the "
                        "longest of any row; with nothing run or kept, the first starts); else compare stops with "
                        f"exit status {TIME_LIMIT_EXIT}, its finished runs in --out, "
                        "a report of the pairs that finished (marked partial), and the same command with "
                        "--keep_runs runs the rest. Needs --out; not with --explain/"
                        "--autotune/--cross_check (--budget_s bounds a search)")
    more.add_argument("--parallel", action="store_true",
                   help="run the two paths of each pair at the same time, each on its own GPU (and the reference "
                        "rows likewise): one-GPU runs on a machine with >= 2 GPUs, half the wall time; the runs "
                        "share the host's CPUs")
    p.add_argument("--explain", action="store_true",
                   help="Lightning with one overhead on at a time, against Lightning without it (harness/explain.py)")
    more.add_argument("--factors", default=None, help="--explain: comma-separated factors (default: all)")
    more.add_argument("--factor_repeats", "--factor-repeats", type=int, default=2,
                   help="--explain: rounds that also run every factor (default 2: a spread, not one difference)")
    p.add_argument("--autotune", action="store_true",
                   help="search micro-batch, checkpointing, compilation, the optimizer step and ZeRO knobs; write the "
                        "winner (see harness/autotune.py)")
    more.add_argument("--mb_grid", "--mb-grid", default=None,
                   help="--autotune: micro-batches to try (default 4,8,12,16,24,32 on GPUs, 1,2,4 on CPU)")
    more.add_argument("--budget_s", "--budget-s", type=float, default=None,
                   help="--autotune: time budget in seconds (default 1200 on GPUs, 300 on CPU)")
    # compare.py's --out is a report folder; each run's own JSON goes under it.
    p.set_defaults(out=None)
    for action in p._actions:
        if action.dest == "out":
            action.help = ("the report's folder: report.json, report.md, phases.png, runs/ (each run's JSON) and "
                           "logs/ (default: reports/latest)")
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
        if ns.timeout <= 0:
            raise ValueError(f"--timeout must be positive (seconds a run may take), got {ns.timeout}")
        for flag, value, mode in (("--mb_grid", ns.mb_grid, "autotune"), ("--budget_s", ns.budget_s, "autotune"),
                                  ("--factors", ns.factors, "explain")):
            if value is not None and not getattr(ns, mode):
                raise ValueError(f"{flag} is an option of --{mode}, which this command does not ask for: add it or "
                                 "drop the option")
        if ns.explain:
            explain.parse_factors(ns.factors)
        # the bare flag: every row this compare can run. On a CPU not stock, whose eager DeepSpeed step says nothing
        # the paths do not; in fp8 the rows that train the paths' model (FP8_REFUSAL), in bf16 or fp32 all but bf16.
        fp8 = normalize_precision(ns.precision or TrainConfig.precision) == "fp8"
        every = tuple(r for r in REFERENCES if (n_gpus or r != "stock")
                      and (r in SCRIPT_ROWS if fp8 else r != "bf16"))
        if ns.reference_rounds is not None and not (ns.reference and 1 <= ns.reference_rounds <= ns.repeats):
            raise ValueError(f"--reference_rounds {ns.reference_rounds} needs --reference and a value from 1 to "
                             f"--repeats ({ns.repeats})")
        ns.references, ns.rounds_of = parse_references(
            ",".join(every) if ns.reference == "all" else ns.reference, ns.repeats, ns.reference_rounds)
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
        if ns.keep_runs and (ns.explain or ns.cross_check or not ns.out):
            raise ValueError("--keep_runs continues a compare run or an autotune search in its --out folder; it needs "
                             "--out and does not combine with --explain/--cross_check")
        if ns.time_limit is not None and (ns.time_limit <= 0 or not ns.out or ns.explain or ns.autotune
                                          or ns.cross_check):
            raise ValueError(f"--time_limit must be positive and needs --out, where the runs it lets finish stay for "
                             f"--keep_runs; it does not combine with --explain/--autotune/--cross_check, got "
                             f"--time_limit {ns.time_limit:g}" + ("" if ns.out else " without --out"))
        if ns.autotune:
            ns.mb_grid = ns.mb_grid or ("4,8,12,16,24,32" if n_gpus else "1,2,4")
            ns.budget_s = ns.budget_s if ns.budget_s is not None else (1200.0 if n_gpus else 300.0)
            autotune.parse_grid(ns.mb_grid)
            if not 0 < ns.budget_s < math.inf:
                raise ValueError(f"--budget_s must be positive, got {ns.budget_s}")
        ns.world = ns.gpus or n_gpus or ns.nproc or 1
        # real text unless told otherwise: parity on random tokens hardly tests training (the loss barely moves)
        _fill_unset(ns, {"data": SHIPPED})
        if n_gpus:  # the run's shape first: the profile's micro-batch depends on the preset
            _fill_unset(ns, {k: v for k, v in GPU_DEFAULTS.items() if k != "micro_batch"})
        if ns.profile is None and (ns.explain or ns.autotune):
            ns.profile = "eager"  # they measure overheads and search the knobs from the eager step, not a profile's
        ns.resolved_profile = apply_profile(
            ns, ns.world, **({"gpu_memory_gib": gpu_memory_gib(),  # unsharded and the ceiling run on one GPU
                              "sharded_gpus": 1 if set(ONE_PROCESS) & set(ns.references) else None} if n_gpus else {}))
        if n_gpus:
            _fill_unset(ns, GPU_DEFAULTS)
        ns.report_dir = Path(ns.out or "reports/latest")
        train = config_from_args(ns, out=str(ns.report_dir / "runs" / "run.json"))
        check_overheads(train)
        if train.precision == "fp8" and set(ns.references) - set(SCRIPT_ROWS):
            raise ValueError(FP8_REFUSAL)
        # each row's config, the paths' own but for the rows that run a path's script under another (row_config)
        ns.row_train = {row: row_config(row, train, row_world(ns, row), ns.resolved_profile.filled)
                        for row in (*PATHS, *ns.references)}
        ns.kept = kept_runs(ns, train) if ns.keep_runs and not ns.autotune else {}
        ns.kept_candidates, ns.kept_commands = (autotune.kept_candidates(train, ns.world, ns.report_dir)
                                                if ns.keep_runs and ns.autotune else ([], []))
        # precision on this device, token files, --ds_config, size: refused here, not by a run's log
        device = torch.device("cuda" if n_gpus else "cpu")
        check_before_start(train, device, ns.world, ns.world,
                           lightning=not ns.autotune)  # the autotuner runs the raw path only
        for row in (r for r in ns.references if r in SCRIPT_ROWS):  # stock, bf16: their configs must run here too
            check_before_start(ns.row_train[row], device, ns.world, ns.world, lightning=False)
        if ns.explain:  # every factor's config must be valid before the first run starts
            for factor in explain.parse_factors(ns.factors):
                explain.factor_config(train, factor)
    except ValueError as e:
        parser.error(str(e))
    return train, ns



def parse_references(value: str, repeats: int, default_rounds: int | None) -> tuple[list[str], dict[str, int]]:
    """--reference's rows and the rounds each runs in: `unsharded,ceiling:1` runs unsharded in every round (or the
    first --reference_rounds) and the ceiling in the first round only; a ValueError names a bad entry."""
    rows, rounds = [], {}
    for entry in (e.strip() for e in value.split(",") if e.strip()):
        name, _, n = entry.partition(":")
        if name not in REFERENCES:
            raise ValueError(f"unknown --reference row {name!r}; choose from {REFERENCES}")
        if name in rounds:
            raise ValueError(f"--reference names {name!r} twice")
        if n and not (n.isdigit() and 1 <= int(n) <= repeats):
            raise ValueError(f"--reference {entry}: the rounds after ':' must be a whole number from 1 to --repeats "
                             f"({repeats})")
        rows.append(name)
        rounds[name] = int(n) if n else default_rounds or repeats
    return rows, rounds


def round_references(ns: argparse.Namespace, i: int) -> list[str]:
    """The reference rows of round i (0-based): those whose rounds (--reference row:N, --reference_rounds) reach it."""
    return [r for r in ns.references if i < ns.rounds_of[r]]


def row_world(ns: argparse.Namespace, row: str) -> int:
    """Processes of one run of `row`: unsharded and the ceiling are one process; --parallel gives every run one GPU."""
    return 1 if ns.parallel or row in ONE_PROCESS else ns.world


def kept_runs(ns: argparse.Namespace, train: TrainConfig) -> dict[tuple[str, int], RunResult]:
    """--keep_runs: the runs this compare would make that its --out already holds, checked to be this command's.

    A run's JSON is written whole or not at all (RunResult.to_json), so one that exists finished; it is kept only if
    it trained with this command's settings (every TrainConfig field but its output path) and world size, on the
    same kind of device with the same package versions."""
    kept = {}
    for i in range(ns.repeats):
        for row in (*PATHS, *round_references(ns, i)):
            path = ns.report_dir / "runs" / f"{row}_{i}.json"
            if not path.is_file():
                continue
            result = RunResult.from_json(path)
            diff = differences(ns.row_train[row], result.train, result.device.get("name"),
                               result.versions)
            if result.world_size != row_world(ns, row):
                diff.append(f"{result.world_size} process(es) there vs {row_world(ns, row)} now")
            if diff:
                raise ValueError(f"--keep_runs: {path} was made with other settings ({'; '.join(diff[:4])}); rerun "
                                 "with its flags, or without --keep_runs (its runs are then replaced)")
            kept[(row, i)] = result
    return kept


def clear_previous_report(out_dir: Path) -> list[Path]:
    """Delete what an earlier compare left in `out_dir` (its report, plot, runs and logs, by their names) so that a
    compare that fails midway leaves only its own files, never its logs beside another run's report; returns what
    it deleted. Other files of the folder stay."""
    ours = re.compile(rf"^({'|'.join(PATHS + REFERENCES)})_(\d+|breakdown)\.")
    gone = [out_dir / name for name in ("report.json", "report.md", "phases.png") if (out_dir / name).is_file()]
    for sub in ("runs", "logs"):
        if (out_dir / sub).is_dir():
            gone += [f for f in sorted((out_dir / sub).iterdir()) if f.is_file() and ours.match(f.name)]
    for f in gone:
        f.unlink()
    return gone


def run_plan(plan: list, train: TrainConfig, ns: argparse.Namespace, out_dir: Path, clock: TimeLimit,
             results: dict[str, list[RunResult]]) -> None:
    """Run the plan's groups round by round into `results`, the kept runs taken as they are; the clock stops it
    between groups (TimeLimitReached) with what finished in `results`."""
    for i, group in plan:
        for path in [p for p in group if (p, i) in ns.kept]:
            print(f"  {path} (round {i + 1}): kept from {out_dir / 'runs' / f'{path}_{i}.json'} (--keep_runs)",
                  flush=True)
            results[path].append(ns.kept[(path, i)])
        group = [p for p in group if (p, i) not in ns.kept]
        if not group:
            continue
        clock.before(f"{' and '.join(group)} (round {i + 1})", rows=tuple(group))

        def launch_one(slot: int, path: str, i: int = i) -> RunResult:
            # unsharded and the ceiling are one process on the first GPU whatever the run's world size; with
            # --parallel every run of a group has a GPU of its own.
            env = {"CUDA_VISIBLE_DEVICES": visible_gpu(slot)} if ns.parallel or path in ONE_PROCESS else None
            return launch(path, ns.row_train[path], row_world(ns, path), out_dir / "runs" / f"{path}_{i}.json",
                          out_dir / "logs" / f"{path}_{i}.log", ns.timeout, env=env)

        for path, result in run_group(group, launch_one).items():
            results[path].append(result)
        clock.after(len(group))


def main(argv: list[str] | None = None) -> dict:
    t0 = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    train, ns = parse(argv)
    out_dir: Path = ns.report_dir
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    where = f"{ns.world} GPU(s)" if torch.cuda.is_available() else f"{ns.world} CPU process(es), gloo"
    if ns.autotune:  # what the mode runs: autotune one run per candidate, explain rounds of the factors
        runs = f"--autotune over micro-batches {ns.mb_grid}, one run per candidate"
    elif ns.explain:
        runs = f"--explain, micro-batch {train.micro_batch}, factors in {ns.factor_repeats} round(s)"
    else:
        runs = f"micro-batch {train.micro_batch}, {ns.repeats} repeats"
    print(f"compare: preset {train.preset}, ZeRO-{train.stage} {train.precision}, {runs}, {train.steps} steps "
          f"({train.warmup_steps} warmup), {where}", flush=True)
    print(f"compare: {ns.resolved_profile.line()}", flush=True)
    # without GPUs: the flags the GPU default would have filled are unset
    smoke = None if torch.cuda.is_available() else smoke_test_note(
        train.preset, {k: v for k, v in GPU_DEFAULTS.items() if getattr(ns, k) is None})
    if smoke and not (ns.autotune or ns.explain):
        print(f"compare: {smoke}", flush=True)
    run = lambda path, cfg, out, log: launch(path, cfg, ns.world, out, log, ns.timeout)
    if ns.autotune:
        ns.commands = [*ns.kept_commands, " ".join(["python", "compare.py", *argv])]
        report = autotune.run_autotune(train, ns, run, out_dir, ns.kept_candidates)
        print()
        print(autotune.format_autotune(report))
        print(f"\nwrote {out_dir / 'autotune.json'}" + (f", {out_dir / 'winner_ds_config.json'}"
                                                        if report["winner"] else ""))
        return report
    if ns.explain:
        ns.command = " ".join(["python", "compare.py", *argv])  # also in a report a failed run leaves
        report = explain.run_explain(train, ns, run, out_dir)
        report["versions"] = versions()
        explain.write_explain(report, out_dir)
        print()
        print(explain.format_explain(report))
        print(f"\nwrote {out_dir / 'explain.json'}, {out_dir / 'explain.md'}")
        return report
    if not ns.keep_runs and (gone := clear_previous_report(out_dir)):
        print(f"compare: replaced the earlier compare's {len(gone)} file(s) in {out_dir} (--keep_runs continues one "
              "instead)", flush=True)
    results: dict[str, list[RunResult]] = {p: [] for p in (*PATHS, *ns.references)}
    plan = []  # (round, the paths run together)
    for i in range(ns.repeats):
        order, refs = round_order(PATHS, i), round_references(ns, i)
        plan += [(i, g) for g in ([order, refs] if ns.parallel else [[p] for p in [*order, *refs]]) if g]
    to_run = sum((p, i) not in ns.kept for i, group in plan for p in group)
    clock = TimeLimit(ns.time_limit, t0, to_run, out_dir / "runs", ["python", "compare.py", *argv],
                      ("--keep_runs", "--keep-runs"),
                      kept_s=[(row, r.extra["launch_s"]) for (row, _), r in ns.kept.items()
                              if (r.extra or {}).get("launch_s")],
                      cold_rows=COLD_ROWS, cold_factors=COLD_FACTORS)
    stopped = None
    try:
        run_plan(plan, train, ns, out_dir, clock, results)
    except TimeLimitReached as e:
        # The pairs that finished are reported now, marked partial; the runs stay for --keep_runs to continue.
        pairs = min(len(results[p]) for p in PATHS)
        if not pairs:
            raise
        stopped = (e, pairs)
        results = {row: runs[:pairs] if row in PATHS else runs for row, runs in results.items()}
    cross, cross_failed = {}, None
    if ns.cross_check:  # after every pair: a cross-check run that fails leaves the report of the pairs written
        diag = dataclasses.replace(train, wall_clock_breakdown=True)
        for path in PATHS:
            out = out_dir / "runs" / f"{path}_breakdown.json"
            try:
                cross[path] = launch(path, diag, ns.world, out, out_dir / "logs" / f"{path}_breakdown.log",
                                     ns.timeout)
            except CompareError as e:
                cross_failed = e
                break
    report = build_report(train, ns, results, cross, argv)
    report["profile"] = {**ns.resolved_profile.to_dict(), "line": ns.resolved_profile.line()}
    report["kept_runs"] = sorted(f"{row}_{i}" for row, i in ns.kept)  # --keep_runs: made by an earlier invocation
    if report["smoke_test"]:
        report["smoke_test_note"] = smoke or smoke_test_note(train.preset, {})
    if stopped is not None:
        report["partial"] = {"pairs": stopped[1], "repeats": ns.repeats, "stopped": str(stopped[0])}
    replace_text(out_dir / "report.json", json.dumps(report, indent=1))
    plot_phases(report, out_dir / "phases.png")
    write_markdown(report, out_dir / "report.md", "phases.png")
    print()
    print(format_table(report))
    print(f"\nwrote {out_dir / 'report.json'}, {out_dir / 'report.md'}, {out_dir / 'phases.png'}")
    if cross_failed is not None:
        raise CompareError(f"the cross-check failed ({cross_failed}); the report above was written without it")
    if stopped is not None:
        raise TimeLimitReached(f"{stopped[0]} The report above covers the {stopped[1]} pair(s) that finished.")
    return report


def cli(argv: list[str] | None = None) -> int:
    """compare.py's exit status: 0, 1 (a run failed), 2 (a bad flag: argparse exits), TIME_LIMIT_EXIT, 128 + signal."""
    try:
        main(argv)
    except CompareError as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 1
    except TimeLimitReached as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return TIME_LIMIT_EXIT
    except (Stopped, KeyboardInterrupt) as e:
        name = str(e) if isinstance(e, Stopped) else "SIGINT"
        print(f"compare.py: stopped by {name}; the run in progress was stopped with it (SIGTERM to its process "
              f"group, SIGKILL after {GRACE_S}s); no report was written", file=sys.stderr)
        return 128 + signal.Signals[name].value
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, raise_stopped)
    sys.exit(cli())
