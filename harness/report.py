"""Reports of compare runs: per-path summaries, the parity of the two paths, the table, markdown and the plot.

Pure functions of RunResults (shared/train/results.py) and of the report dict they build; nothing here starts a
run (harness/launch.py does).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
from pathlib import Path

from harness import budget
from harness.launch import PATHS, REFERENCES
from shared.model import fp8
from shared.train.config import TrainConfig
from shared.train.results import CACHE_COUNTERS, RunResult, tflops_convention, versions
from shared.train.sync_check import format_syncs
from shared.train.timing import PHASES

# Parity of the two paths: per step, the loss and DeepSpeed's global gradient norm (before clipping), over a window
# past the LR warm-up (lr_warmup_steps on), in every repeat pair; and a checksum of all parameters at the end
# (sum and sum of squares; shared/train/ds_runtime.param_checksum). The warm-up is excluded because its small learning
# rates hide what a wrong update does (a missing clip, a wrongly scaled gradient, a wrong LR all move the weights
# by less there). Both paths run the same kernels on the same batches with the same seeds: on CPU they agree bit
# for bit, hence the tight fp32 bounds. On GPUs, kernels with atomics (embedding backward, split-K matmuls, the
# flash-attention backward) are not bitwise deterministic, so bf16 runs drift apart in the low bits:
#   loss: about twice the largest drift of the committed bf16 pairs. A loss bound the drift allows cannot catch a
#     missing clip or gradients scaled twice by the accumulation (their loss differences sit inside the drift;
#     tests/test_compare.py plants each), which is why the gradient norm and the checksum are compared too.
#   gradient norm (relative, per step past the warm-up) and checksum (relative: the larger of |d sum_sq| / sum_sq
#     and |d sum| / sqrt(sum_sq)): set from the drift between the raw and the fast-default Lightning runs of the
#     committed explain runs. A sum over parameters drifting independently grows like the norm, so
#     |d sum| / sqrt(sum_sq) reads the typical per-parameter relative drift of bf16 updates. The accumulation's
#     double scaling halves the gradient norm (gas 2), far outside.
#   With >= 2 runs per path the report also measures the same path's run-to-run drift (every two runs of one path,
#     same command) and a measure passes when it is within the larger of its bound and RUN_TO_RUN_FACTOR x that
#     drift: under DeepCompile one path's two runs already differ in the checksum as much as the two paths do, so a
#     fixed bound from eager runs would blame the paths for the compiler's nondeterminism. A single pair is judged by
#     the bounds alone.
# The drifts measured and the runs behind each bound: docs/results.md, "Loss parity".
RUN_TO_RUN_FACTOR = 1.5
_BF16_TOLERANCE = {"loss": 3e-4, "grad_norm": 2e-4, "checksum": 4e-3}
PARITY_TOLERANCE = {
    "fp32": {"loss": 1e-5, "grad_norm": 1e-5, "checksum": 1e-6},
    "bf16": _BF16_TOLERANCE,
    "fp16": _BF16_TOLERANCE,
    # fp8 (shared/model/fp8.py): both paths cast the same bf16 tensors with scales computed from them, so they differ
    # only where the bf16 kernels drift, but a drifted operand can move its tensor's scale and the rounding of every
    # element: one 1.5b pair drifted about 8x as far as bf16's on the same machine (docs/fp8.md). bf16's bounds, which
    # a compare of two or more pairs widens by each path's own run-to-run drift.
    "fp8": _BF16_TOLERANCE,
}
# Every reference row starts from the paths' weights and batch, so its first loss (step 0, before any update) is
# theirs up to the precision of the forward; two draws of the initial weights part by far more (the measurements:
# docs/results.md, "The reference rows").
START_TOLERANCE = 5e-3
# The bf16 row beside an fp8 compare runs the same weights through bf16 linears where the paths cast to FP8, and the
# stock row draws its residual and MLP dropout masks from torch's generator where the paths' Triton kernel draws its
# own: each one's step-0 loss sits further from the paths' than the forward's bf16 rounding (docs/fp8.md,
# docs/results.md), still well inside what another draw of the weights moves it.
START_TOLERANCES = {"bf16": 5e-2, "stock": 5e-2}
# A path whose runs' TFLOPs/GPU differ by more than this (max/min) ran on an unsteady machine (other load,
# thermals): its median, and the ratio, are flagged in the report and printed with a WARNING line.
REPEAT_SPREAD_BOUND = 1.10
# How the table names the reference rows; the ceiling row keeps its key (report.json, run files) for old reports.
ROW_NAMES = {"ceiling": "ceiling (the PyTorch user's baseline)",
             "unsharded": "unsharded (the ZeRO-3 paths' model and step, no sharding)",
             "bf16": "bf16 (the raw path at bf16, the paths' profile)"}


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
        # fp8 runs: MFU against the FP8 peak too, and what ran in FP8 (RunResult.fp8, the first run's)
        "mfu_fp8": statistics.median(m) if (m := [r.mfu_fp8 for r in runs if r.mfu_fp8 is not None]) else None,
        "fp8": runs[0].fp8,
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
        "deepcompile_passes_s": [r.extra.get("deepcompile_passes_s") for r in runs],
        # of those, DeepCompile's operator and memory profiling (shared/patches/deepcompile.time_deepcompile_profilers)
        "deepcompile_profiling_s": [_profiling_s(r.extra.get("deepcompile_profilers")) for r in runs],
        # inductor's compiled graphs found in its on-disk cache / compiled / not cacheable, per run
        "compile_cache": [r.extra.get("compile_cache") for r in runs],
        # which schedule DeepCompile compiled (shared/train/deepcompile_passes.record_schedule), per run
        "deepcompile_schedule": [schedule_id(r.extra.get("deepcompile_schedules")) for r in runs],
        # the SM clock and power its GPUs held during the timed steps (harness/telemetry.py), per run; None on CPU
        "gpu_telemetry": [r.extra.get("gpu_telemetry") for r in runs],
        "sdpa_kernel": sorted({r.sdpa_kernel for r in runs}, key=str),  # per kernel seen, one entry
        # the attention dropout rate the runs' kernels applied (RunResult.attn_dropout_applied), per rate seen
        "attn_dropout_applied": sorted({r.attn_dropout_applied for r in runs}, key=str),
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


_MEASURES = {"loss": "loss_max_abs_diff", "grad_norm": "grad_norm_max_rel_diff", "checksum": "checksum_rel_diff"}


def parity(pairs: list[tuple[dict, dict]], precision: str, lr_warmup_steps: int,
           same_path: list[tuple[dict, dict]] = ()) -> dict:
    """Parity of every repeat pair past the LR warm-up: loss, gradient norm per step, parameter checksum at the end,
    each against PARITY_TOLERANCE[precision], or against RUN_TO_RUN_FACTOR x the drift between runs of one path
    (`same_path` pairs) where that is larger. A measure neither run recorded is null and not judged."""
    tol = PARITY_TOLERANCE[precision]
    per_pair = [pair_parity(a, b, lr_warmup_steps) for a, b in pairs]
    per_same = [pair_parity(a, b, lr_warmup_steps) for a, b in same_path]

    def worst(key: str, rows: list[dict] = per_pair) -> float | None:
        values = [p[key] for p in rows if p[key] is not None]
        return max(values) if values else None

    cross = {k: worst(key) for k, key in _MEASURES.items()}
    run_to_run = {k: worst(key, per_same) for k, key in _MEASURES.items()} if per_same else None
    bound = {k: max(tol[k], RUN_TO_RUN_FACTOR * run_to_run[k]) if run_to_run and run_to_run[k] is not None
             else tol[k] for k in _MEASURES}
    report = {
        "pairs": per_pair, "lr_warmup_steps": lr_warmup_steps,
        "past_warmup": all(p["steps"][0] == lr_warmup_steps for p in per_pair),
        "max_abs_diff": cross["loss"],
        "grad_norm_max_rel_diff": cross["grad_norm"],
        "checksum_rel_diff": cross["checksum"],
        "tolerance": tol, "run_to_run": run_to_run, "run_to_run_factor": RUN_TO_RUN_FACTOR, "bound": bound,
    }
    report["failed"] = [k for k, v in cross.items() if v is not None and not v <= bound[k]]
    report["ok"] = not report["failed"]
    return report


def parity_series(r: RunResult) -> dict:
    """What parity() compares of a run: its losses, gradient norms and final parameter checksum."""
    return {"losses": r.losses, "grad_norms": r.grad_norms, "param_checksum": r.param_checksum}


def loss_parity(ds: list[RunResult], pl: list[RunResult], precision: str, lr_warmup_steps: int) -> dict:
    """parity() of the runs of both paths, pair by pair."""
    same = [(parity_series(runs[i]), parity_series(runs[j])) for runs in (ds, pl)
            for i in range(len(runs)) for j in range(i + 1, len(runs))]
    return parity([(parity_series(a), parity_series(b)) for a, b in zip(ds, pl)], precision, lr_warmup_steps, same)


def _first_runs(results: dict[str, list[RunResult]], key: str) -> dict:
    """extra[key] of each row's first run, for the rows whose first run recorded it."""
    return {name: runs[0].extra[key] for name, runs in results.items() if runs and (runs[0].extra or {}).get(key)}


def smoke_test_note(preset: str, gpu_flags: dict) -> str:
    """What a compare without GPUs is, said in its printed header, under its table and in its report: a smoke test of
    both paths' code whose speed figures are the CPU's, and what the same command runs on GPUs (`gpu_flags`: the
    GPU default of the flags it leaves unset, compare.py's GPU_DEFAULTS)."""
    flags = " ".join(f"--{k} {v}" for k, v in gpu_flags.items())
    return (f"SMOKE TEST: no GPU, so both paths ran preset {preset} in CPU processes (gloo) to exercise their code. "
            "Its TFLOPs, step times and Lightning / DeepSpeed ratio are this CPU's and say nothing about either path "
            "on GPUs. On a machine with GPUs the same command runs on every GPU"
            + (f" with the GPU default for the flags it leaves unset ({flags})" if flags else "")
            + ", and the fast profile (DeepCompile and its micro-batch where they fit: compare.py --profile list).")


def over_rounds(runs: list[RunResult], base: list[RunResult]) -> dict:
    """A row's TFLOPs/GPU over a reference row's, over the rounds both ran (a reference row may run in fewer rounds
    than the paths: `ceiling:1`, or a compare cut before a round's reference run): the ratio of their medians over
    those rounds, with the per-round ratios' range (each run over the same round's reference run) as its spread.
    Medians over different rounds would mix machines and clocks, and the ratio could land outside its own range."""
    n = min(len(runs), len(base))
    runs, base = runs[:n], base[:n]
    per_round = [r.tflops_per_gpu / b.tflops_per_gpu for r, b in zip(runs, base)]
    ratio = statistics.median(r.tflops_per_gpu for r in runs) / statistics.median(b.tflops_per_gpu for b in base)
    return {"ratio": ratio, "min": min(per_round), "max": max(per_round), "n": n}


def cards(results: dict[str, list[RunResult]]) -> dict | None:
    """Which GPU each round's runs ran on (the first 12 characters of its uuid, as the runs record it): a compare
    continued over several calls (--keep_runs) may have made its rounds on different machines. Each per-round ratio
    (Lightning over DeepSpeed, a path over a reference row) compares runs of one machine only where that round's runs
    share one card; the spread across rounds then holds machine-to-machine variation too. None where no run
    recorded its card (CPU runs, older runs)."""
    rounds = []
    for i in range(max(len(runs) for runs in results.values() if runs)):
        row_cards = {row: (runs[i].device.get("uuid") or "")[:12] or None for row, runs in results.items()
                     if i < len(runs)}
        rounds.append(row_cards)
    named = {c for r in rounds for c in r.values() if c}
    if not named:
        return None
    return {"rounds": rounds, "distinct": len(named),
            "each_round_on_one_card": all(len(set(r.values())) == 1 and None not in r.values() for r in rounds)}


def format_cards(c: dict) -> str:
    """One line: the cards the rounds ran on, and whether each round stayed on one."""
    if c["distinct"] == 1:
        return f"every run on one GPU ({next(v for r in c['rounds'] for v in r.values() if v)})"
    per_round = "; ".join(f"round {i + 1}: " + ", ".join(sorted({v or 'not recorded' for v in r.values()}))
                          for i, r in enumerate(c["rounds"]))
    return (f"runs on {c['distinct']} GPUs ({per_round}); "
            + ("each round on one GPU, so each per-round ratio compares runs of one machine and the spread across "
               "rounds holds machine-to-machine variation too" if c["each_round_on_one_card"]
               else "WARNING: a round's runs span GPUs, so its per-round ratios compare different machines"))


def same_start(results: dict[str, list[RunResult]], refs: list[str]) -> dict:
    """Whether each reference row trained the paths' model from their weights: each of its runs' step-0 loss against
    the first raw run's, within the row's tolerance (START_TOLERANCE; START_TOLERANCES for the bf16 and stock rows),
    one difference per round. A run that fails it measured the same architecture from other weights (or other
    dropout masks): its speed still compares, its losses do not. One-GPU compares only: on N GPUs the paths' losses
    are the mean over N ranks' batches, a reference row's are one rank's."""
    base = results["deepspeed"][0].losses[0]
    diff = {r: [abs(run.losses[0] - base) for run in results[r]] for r in refs}
    tolerance = {r: START_TOLERANCES.get(r, START_TOLERANCE) for r in refs}
    return {"deepspeed_first_loss": base, "abs_diff": diff, "tolerance": START_TOLERANCE,
            "tolerances": tolerance, "ok": all(d <= tolerance[r] for r, ds in diff.items() for d in ds)}


def format_same_start(s: dict) -> str:
    """One line: the reference rows' step-0 losses against the raw path's, per round (a row with a tolerance of its
    own names it)."""
    own = {r: t for r, t in (s.get("tolerances") or {}).items() if t != s["tolerance"]}
    diffs = ", ".join(f"{r} {' / '.join(f'{d:.2e}' for d in ds)}" + (f" (within {own[r]:g})" if r in own else "")
                      for r, ds in s["abs_diff"].items())
    if s["ok"]:
        return f"reference rows start from the paths' weights: step-0 loss within {s['tolerance']:g} ({diffs})"
    return (f"WARNING: a reference row did not start from the paths' weights: its step-0 loss is off the raw path's "
            f"{s['deepspeed_first_loss']:.4f} by more than {s['tolerance']:g} ({diffs}); its speed compares, its "
            "losses do not")


def baseline_difference(train: TrainConfig, cuda: bool) -> str:
    """What the unsharded row does differently from the PyTorch user's baseline (the ceiling row) in this run: the
    weights' precision and the optimizer step; both run unsharded on one process, with the same model and batches."""
    if train.precision == "bf16":
        weights = "bf16 weights and gradients with fp32 master weights (the baseline: fp32 weights under bf16 autocast)"
    else:
        weights = (f"{train.precision} weights with a separate fp32 master copy (the baseline: fp32 weights updated "
                   "in place)")
    baseline_step = "torch's fused AdamW" if cuda else "torch's AdamW"
    step = ("the project's AdamW kernel, update and 16-bit copy in one pass" if train.zero3_step == "fused"
            else f"{baseline_step} on the masters, then the 16-bit copy")
    return (f"unsharded differs from the PyTorch user's baseline (ceiling) in its {weights} and its step: {step} "
            f"(the baseline: {baseline_step}); the clip is DeepSpeed's formula (the baseline: clip_grad_norm_)")


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
        # runs on CPU processes: a test of the code paths, not a measurement (smoke_test_note says what it is)
        "smoke_test": first.device.get("type") == "cpu",
    }
    if (c := cards(results)) is not None:
        report["cards"] = c
    refs = [r for r in REFERENCES if results.get(r)]
    if refs:
        report["reference"] = {r: summarize_path(results[r]) for r in refs}
        if ns.world == 1:  # with N GPUs the paths log the mean loss of N ranks' batches, a reference row its own
            report["same_start"] = same_start(results, refs)
        for r in refs:
            report["reference"][r]["world_size"] = results[r][0].world_size
    if "ceiling" in refs:
        report["fraction_of_ceiling"] = {p: over_rounds(results[p], results["ceiling"])["ratio"]
                                         for p in (*PATHS, "fsdp2") if results.get(p)}
    if "unsharded" in refs:  # what ZeRO-3 costs: each row over the same round's unsharded run
        report["fraction_of_unsharded"] = {p: over_rounds(results[p], results["unsharded"])
                                           for p in (*PATHS, "fsdp2", "ceiling") if results.get(p)}
        report["unsharded_vs_ceiling"] = baseline_difference(train, first.device.get("type") == "cuda")
    if "stock" in refs:  # what this project's profile adds over DeepSpeed as shipped, round by round
        report["over_stock"] = {p: over_rounds(results[p], results["stock"]) for p in PATHS}
    if "bf16" in refs:  # what FP8 gains: each fp8 path over the same round's bf16 run of the same profile
        report["over_bf16"] = {p: over_rounds(results[p], results["bf16"]) for p in PATHS}
    # --profile_step: each row's first run's profiled step (shared/train/step_profile.py)
    profiles = _first_runs(results, "profile")
    if profiles:
        report["profiles"] = profiles
        report["kernel_rates"] = {name: budget.kernel_rates(results[name][0], name) for name, prof in profiles.items()
                                  if budget.is_gpu_profile(prof)}
    # --sync_check_step: each row's first run's synchronizing CUDA calls (shared/train/sync_check.py)
    if syncs := _first_runs(results, "syncs"):
        report["syncs"] = syncs
    if cross:
        report["cross_check"] = {
            path: {"ds_wall_clock_breakdown_ms": r.ds_breakdown_ms,
                   "phase_timer_ms": {p: r.phases_s[p] * 1e3 for p in PHASES},
                   "tflops_per_gpu_with_syncs": r.tflops_per_gpu}
            for path, r in cross.items()
        }
    return report


def schedule_id(schedules: list | None) -> str | None:
    """Six hex digits naming the schedules one run's DeepCompile compiled (every graph's node order and its gathers'
    and releases' order): equal in two runs when they compiled the same schedules. None: not recorded; "error":
    a graph's schedule could not be read (the run JSON's extra.deepcompile_schedules says why)."""
    if not schedules:
        return None
    if any("error" in s for s in schedules):
        return "error"
    key = [(s.get("graph"), s["bwd"], s["order"], s["collectives"]) for s in schedules]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:6]


def _cache_cell(counts: dict | None) -> str:
    """One run's inductor graphs: found in the on-disk cache / compiled / not cacheable (`n/a` where not recorded)."""
    if not counts:
        return "n/a"
    return "/".join(str(counts.get(n, 0)) for n in CACHE_COUNTERS["inductor"])  # hit, miss, bypass


def _profiling_s(profilers: dict | None) -> float | None:
    """Seconds of DeepCompile's operator and memory profiling in one run (None: not recorded, or no DeepCompile)."""
    return None if not profilers else profilers["operators_s"] + profilers["memory_s"]


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def tflops_spec(report: dict) -> str:
    """Enough digits to tell the paths apart: TFLOPs on a CPU are in the thousandths."""
    return ".2f" if report["paths"]["deepspeed"]["tflops_per_gpu"] >= 1 else ".5f"


def telemetry_cell(p: dict, key: str, spec: str) -> str:
    """Each run's median reading of `key` during its timed steps ("n/a": none; "?": the reading failed)."""
    cells = []
    for t in p.get("gpu_telemetry") or []:
        if not t:
            cells.append("n/a")
        elif t.get("error") or not t.get(key):
            cells.append("?")
        else:
            cells.append(f"{t[key]['median']:{spec}}")
    return ", ".join(cells) or "n/a"


def format_table(report: dict) -> str:
    spec = tflops_spec(report)
    rows = [("", "deepspeed", "lightning")]
    P = report["paths"]
    partial = report.get("partial")

    def row(name, fn):
        rows.append((name, fn(P["deepspeed"]), fn(P["lightning"])))

    def tflops_cell(p):
        s = p["tflops_spread"]
        return f"{p['tflops_per_gpu']:{spec}} [{s['min']:{spec}}, {s['max']:{spec}}]"

    row(f"TFLOPs/GPU ({tflops_convention(report['flops_factor'])})", tflops_cell)
    row("TFLOPs/GPU (exact causal count)", lambda p: _fmt(p.get("tflops_per_gpu_causal"), spec))
    fp8_run = any(p.get("fp8") for p in P.values())
    percent = lambda v: _fmt(v and 100 * v, ".1f") + ("%" if v else "")
    row("MFU" + (" (bf16 peak)" if fp8_run else ""), lambda p: percent(p["mfu"]))
    if fp8_run:
        row("MFU (FP8 peak)", lambda p: percent(p.get("mfu_fp8")))
    row("tokens/s/GPU", lambda p: f"{p['tokens_per_s_per_gpu']:,.0f}")
    row("step time ms (median)", lambda p: f"{p['step_time_s']['median'] * 1e3:.1f}")
    for ph in PHASES:
        row(f"  {ph} ms", lambda p, ph=ph: f"{p['phases_s'][ph] * 1e3:.2f}")
    row("peak memory GiB", lambda p: _fmt(p["peak_mem_gib"]) if p["peak_mem_gib"] is not None
        else f"RSS {p['peak_rss_gib']:.2f}")
    row("attention", lambda p: p["attention"] + (f" ({', '.join(map(str, p['sdpa_kernel']))})"
                                                  if any(p.get("sdpa_kernel") or []) else ""))
    row("attention dropout applied", lambda p: ", ".join(f"{r:.6g}" for r in p.get("attn_dropout_applied") or []
                                                         if r is not None) or "n/a")
    row("compile", lambda p: p.get("compile", "none"))
    def per_run_s(p: dict, key: str) -> str:  # one figure per run, seconds
        return ", ".join(_fmt(w, ".1f") for w in p.get(key, []))

    row("warm-up s (excluded)", lambda p: per_run_s(p, "warmup_s") or "n/a")
    row("  of it compiling s", lambda p: per_run_s(p, "compile_s") or "n/a")
    if any(any(v is not None for v in p.get("deepcompile_passes_s", [])) for p in report["paths"].values()):
        row("  DeepCompile passes s", lambda p: per_run_s(p, "deepcompile_passes_s"))
        row("    of them profiling s", lambda p: per_run_s(p, "deepcompile_profiling_s") or "n/a")
    if any(any(p.get("deepcompile_schedule") or []) for p in report["paths"].values()):
        row("  DeepCompile schedule (per run)",
            lambda p: ", ".join(s or "n/a" for s in p.get("deepcompile_schedule") or []) or "n/a")
    if any(any((c or {}).get(n) for n in CACHE_COUNTERS["inductor"]) for p in report["paths"].values()
           for c in p.get("compile_cache") or []):  # a run that compiled a graph
        row("  graphs cached/compiled/uncacheable",
            lambda p: ", ".join(_cache_cell(c) for c in p.get("compile_cache") or []))
    if any(t for p in P.values() for t in p.get("gpu_telemetry") or []):
        row("SM clock MHz, timed steps (per run)", lambda p: telemetry_cell(p, "sm_mhz", ".0f"))
        row("  power W (per run)", lambda p: telemetry_cell(p, "power_w", ".0f"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
    if fp8_run:  # the same conversion in both paths (shared/train/build.py); each path's own record is printed
        lines += [f"FP8 matmuls ({path}): {fp8.describe(p.get('fp8'))}" for path, p in P.items()]
    for name, ref in report.get("reference", {}).items():
        s = ref["tflops_spread"]
        frac = report.get("fraction_of_ceiling", {})
        of_unsharded = report.get("fraction_of_unsharded", {})
        clock = telemetry_cell(ref, "sm_mhz", ".0f")
        lines.append(f"reference {ROW_NAMES.get(name, name)} ({ref['world_size']} x, compile "
                     f"{ref['fused']['compile']}): "
                     f"{ref['tflops_per_gpu']:{spec}} [{s['min']:{spec}}, {s['max']:{spec}}] TFLOPs/GPU, "
                     f"step {ref['step_time_s']['median'] * 1e3:.1f} ms, peak "
                     f"{_fmt(ref['peak_mem_gib'])} GiB"
                     + (f", {of_unsharded[name]['ratio']:.3f} of unsharded" if name in of_unsharded else "")
                     + (f", {frac['fsdp2']:.3f} of the PyTorch baseline" if name == "fsdp2" and "fsdp2" in frac
                        else "")
                     + (f", SM clock {clock} MHz" if any(ref.get("gpu_telemetry") or []) else ""))
    for p, o in report.get("over_stock", {}).items():
        lines.append(f"{p} over the stock row (DeepSpeed as shipped): {o['ratio']:.3f}x "
                     f"[{o['min']:.3f}, {o['max']:.3f}] over {o['n']} round(s)")
    for p, o in report.get("over_bf16", {}).items():
        lines.append(f"{p} in fp8 over the bf16 row (the same profile at bf16): {o['ratio']:.3f}x "
                     f"[{o['min']:.3f}, {o['max']:.3f}] over {o['n']} round(s)")
    if "fraction_of_unsharded" in report:
        f = report["fraction_of_unsharded"]
        lines.append("fraction of unsharded (what ZeRO-3 costs; median TFLOPs / unsharded median over the rounds both "
                     "ran; per round [min, max]): "
                     + ", ".join(f"{p} {f[p]['ratio']:.3f} [{f[p]['min']:.3f}, {f[p]['max']:.3f}]" for p in PATHS))
    if "fraction_of_ceiling" in report:
        f = report["fraction_of_ceiling"]
        lines.append(f"fraction of the PyTorch user's baseline (ceiling row; median TFLOPs / its median over the "
                     f"rounds both ran): deepspeed {f['deepspeed']:.3f}, lightning {f['lightning']:.3f}")
    if "unsharded_vs_ceiling" in report:
        lines.append(report["unsharded_vs_ceiling"])
    if "same_start" in report:
        lines.append(format_same_start(report["same_start"]))
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
    if partial:
        lines.append(f"PARTIAL: {partial['pairs']} of {partial['repeats']} pair(s); {partial['stopped']}")
    lines.append(f"same DeepSpeed config in every run: {report['same_ds_config']}")
    if report.get("cards"):
        lines.append(format_cards(report["cards"]))
    if report.get("kept_runs"):
        lines.append("runs made by an earlier invocation of this command (--keep_runs): "
                     + ", ".join(report["kept_runs"]))
    if "cross_check" in report:
        for path, c in report["cross_check"].items():
            b = c["ds_wall_clock_breakdown_ms"] or {}
            lines.append(f"cross-check {path}: DeepSpeed timers fwd {_fmt(b.get('forward'))} bwd "
                         f"{_fmt(b.get('backward'))} step {_fmt(b.get('step'))} ms vs phase timer fwd "
                         f"{c['phase_timer_ms']['forward']:.2f} bwd {c['phase_timer_ms']['backward']:.2f} step "
                         f"{c['phase_timer_ms']['step']:.2f} ms")
    if report.get("profiles"):
        lines += ["", format_profiles(report["profiles"], report["train"].get("profile_step"),
                                      report.get("kernel_rates"))]
    for name, record in report.get("syncs", {}).items():
        lines += ["", f"{name}:", *format_syncs(record, indent="  ")]
    if report.get("smoke_test_note"):
        lines += ["", report["smoke_test_note"]]
    return "\n".join(lines)


def format_profiles(profiles: dict, step: int | None, rates: dict | None = None) -> str:
    """The profiled step of each row's first run: per phase wall / busy / idle ms and the kernels' ms by kind, and the
    matmuls' and the attention's achieved TFLOP/s over the step (harness/budget.kernel_rates) where given."""
    synced = {prof.get("synced", True) for prof in profiles.values()}
    how = ("a device sync at each phase boundary" if synced == {True} else
           "no syncs: kernels by the phase that launched them, walls on the device's timeline" if synced == {False}
           else "rows marked 'no sync' ran without syncs, the others with a device sync at each phase boundary")
    lines = [f"profiled step {step} of each row's first run (torch.profiler, {how}; ms; busy: some kernel running, "
             "idle: the rest)"]
    for name, prof in profiles.items():
        if len(synced) > 1 and not prof.get("synced", True):
            lines.append(f"  {name:<9} (no sync)")
        for phase, p in [*prof["phases"].items(), ("whole step", prof["step"])]:
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in p["by_kind_ms"].items() if v >= 0.05)
            lines.append(f"  {name:<9} {phase:<10} wall {p['wall_ms']:8.1f}  busy {p['busy_ms']:8.1f}  idle "
                         f"{p['idle_ms']:7.1f}  kernels {p['kernels']:5d}" + (f"  | {kinds}" if kinds else ""))
            if idle := p.get("idle"):  # a GPU profile: the idle time by cause, the host's part by operator
                ops = ", ".join(f"{o['name'][:48]} {o['ms']:.1f}" for o in idle["host_ops"][:4] if o["ms"] >= 0.05)
                lines.append(f"  {'':<9} {'':<10} idle: host behind {idle['host_ms']:.1f} ({ops}), next kernel "
                             f"queued {idle['queued_ms']:.1f}" + (f", no launch record {idle['unlinked_ms']:.1f}"
                                                                  if idle["unlinked_ms"] else ""))
            if "host_wall_ms" in p:  # no syncs: the host's own time in the phase and its lead when the phase began
                lead = "-" if p["host_lead_ms"] is None else f"{p['host_lead_ms']:.1f}"
                lines.append(f"  {'':<9} {'':<10} host: its own time {p['host_wall_ms']:.1f}, ahead of the device "
                             f"by {lead} when the phase began (negative: the device waited)")
        if rates and name in rates:
            lines.append(f"  {'':<9} {'':<10} model FLOPs over the kernels' time: "
                         + ", ".join(_rate(kind, rates[name][kind], rates[name].get("sm_mhz"))
                                     for kind in ("matmul", "attention")))
    return "\n".join(lines)


def _rate(kind: str, r: dict, sm_mhz: float | None = None) -> str:
    """A kind's achieved rate, its share of the datasheet peak and, where the run's telemetry read the clock the GPU
    held (harness/budget.kernel_rates), its share of the peak at that clock."""
    if r["tflops"] is None:
        return f"{kind} -"
    shares = [f"{r['of_peak']:.0%} of peak"] if r["of_peak"] is not None else []
    if r.get("of_held_peak") is not None:
        shares.append(f"{r['of_held_peak']:.0%} of the peak at the {sm_mhz:.0f} MHz held")
    return f"{kind} {r['tflops']:.3g} TFLOP/s" + (f" ({', '.join(shares)})" if shares else "")


def format_parity(lp: dict) -> str:
    tol, (start, end) = lp["tolerance"], lp["pairs"][0]["steps"]
    window = (f"steps {start}..{end - 1} (past the {lp['lr_warmup_steps']}-step LR warm-up)" if lp["past_warmup"]
              else f"steps {start}..{end - 1} (the run ends inside the {lp['lr_warmup_steps']}-step LR warm-up)")

    bound, same = lp.get("bound", tol), lp.get("run_to_run")

    def cell(name: str, value: float | None, key: str) -> str:
        limit = f"tol {tol[key]:.0e}"
        if same and same.get(key) is not None:
            limit += f", same path run to run {same[key]:.2e}" + (f" -> bound {bound[key]:.2e}"
                                                                  if bound[key] > tol[key] else "")
        return f"{name} {'not recorded' if value is None else f'{value:.2e}'} ({limit})"

    verdict = "OK" if lp["ok"] else "MISMATCH in " + ", ".join(lp["failed"])
    if not lp["ok"] and not same:
        # Without a second run of a path the report cannot tell the paths' difference from the run-to-run drift that
        # GPU kernels with atomics and DeepCompile's schedules already give one path (docs/results.md, "Loss parity").
        verdict += (" (judged by the fixed bounds alone: with one run per path the same path's run-to-run drift is not "
                    f"measured; --repeats 2 or more measures it and widens the bounds to {RUN_TO_RUN_FACTOR:g}x it)")
    return (f"parity over {window}, {len(lp['pairs'])} pair(s): "
            f"{cell('loss max |diff|', lp['max_abs_diff'], 'loss')}, "
            f"{cell('grad norm max rel diff', lp['grad_norm_max_rel_diff'], 'grad_norm')}, "
            f"{cell('param checksum rel diff', lp['checksum_rel_diff'], 'checksum')} -> {verdict}")


def write_markdown(report: dict, path: Path, chart: str) -> None:
    d = report["device"]
    md = [
        f"# DeepSpeed vs Lightning: {report['preset']} on {report['world_size']} x {d['name']}"
        + (" (smoke test on CPU)" if report.get("smoke_test") else ""),
        "",
        *([f"**{report['smoke_test_note']}**", ""] if report.get("smoke_test_note") else []),
        f"Command: `{report['command']}`",
        "",
        f"ZeRO stage {report['train']['stage']}, {report['train']['precision']}, micro-batch "
        f"{report['train']['micro_batch']}, {report['train']['steps']} steps ({report['train']['warmup_steps']} "
        f"warmup excluded), "
        + (f"{report['partial']['pairs']} of {report['repeats']} interleaved repeats per path (partial: stopped by "
           "--time_limit; --keep_runs continues it)" if report.get("partial") else
           f"{report['repeats']} interleaved repeats per path")
        + (" (--parallel: the two paths of each pair, and the reference rows, ran at the same time, one GPU each)."
           if report.get("parallel") else "."),
        "",
        *([f"Speed settings: {report['profile']['line']}", ""] if report.get("profile") else []),
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
