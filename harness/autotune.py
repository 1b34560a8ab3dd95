"""`python compare.py --autotune`: find the fastest micro-batch, activation checkpointing and ZeRO knobs for the
chosen preset and GPU count, within a time budget, and write the winner as a DeepSpeed JSON both paths accept.

Search, on the raw path (the faster one to start), each candidate a short run of its own:
  1. micro-batch x activation checkpointing: micro-batches of --mb_grid in increasing order without
     checkpointing, stopping at the first that runs out of memory or is slower than the one before it (early
     stop); then, with checkpointing, the micro-batches above the largest that fitted without it.
  2. compiled blocks (`--compile blocks`) on the best so far: it shortened the forward phase but lengthened the
     backward (docs/kernels.md, fused paths), so whether it pays depends on the setup: measure it.
  3. DeepCompile (`--compile deepcompile --deepcompile_schedule once`, CUDA only) at the best micro-batch so far,
     then at the larger micro-batches of the grid (its memory differs from the eager model's), until one runs out
     of memory or is slower; each candidate includes its compile warm-up (docs/tuning.md, autotune), so a 1.5b
     search wants a budget of 20 min or more.
  4. the optimizer step's three passes in one kernel (`--zero3_step fused`, shared/kernels/adamw.py) on the best
     so far: ZeRO-3 and CUDA only (Triton's interpreter runs the kernel on a CPU for tests, not for speed);
     compare.py's GPU default runs it (measured under DeepCompile: docs/ledger.md); the search measures it on its
     own best configuration. Then the MLP's bias + GELU backward as one Triton kernel (`--triton_gelu_grad`,
     shared/kernels/bias_gelu_grad.py; CUDA only, with the fused bias + GELU): off by the training scripts' default,
     so measured here too (its pairs: docs/ledger.md). Then compare.py's GPU default's padded vocabulary
     (`--vocab_multiple 128`), Triton loss (`--triton_loss`, bf16) and Triton dropout masks (`--triton_dropout`,
     with the fused bias + dropout + add), together as they were measured (docs/ledger.md, the three together), CUDA
     only: those of the three not on yet and not ruled out (a flag given as false cannot be told from the default;
     give the search a base without the switch instead).
  5. ZeRO-3 prefetch bucket, then reduce bucket, then parameter persistence threshold, one knob at a time
     (coordinate descent) from the best so far. Under DeepCompile the prefetch bucket is skipped: its passes
     schedule their own prefetch and never read stage3_prefetch_bucket_size. A persistence threshold that keeps
     the same parameters gathered as one already measured is the same run and is skipped: parameters of at most
     that many elements persist, so at the 1.5b preset 1e4, 1e5 and 1e6 all keep the same 194 (biases and
     LayerNorm weights) and only 1e7 adds the position embedding and the attention output projections.
Candidates are ranked by tokens/s per GPU, not TFLOPs: with activation checkpointing the formula counts the
recomputed forward (k=4) as work, which would flatter the slower configuration. The budget stops the search
before a candidate that would not finish in it (estimated from the slowest run so far); the report names that
candidate (`budget_stopped_before`).

autotune.json is rewritten after every candidate (`complete`: false until the search ends), so a search cut
short loses nothing: `--keep_runs` with the same --out continues it, each candidate already measured there taken
from that file (it must come from the same settings, world size, device and package versions; a candidate that
failed other than by running out of memory runs again) and the budget spent on the new ones only.

DeepSpeed ships an autotuner of its own (`deepspeed --autotuning tune`); benchmarks/ds_autotuner.py runs it on
the raw loop and measures its answer against this search's winner (docs/tuning.md).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from harness.launch import CompareError
from shared.model import config as model_config
from shared.train.config import TrainConfig, normalize_precision
from shared.train.ds_config import build_ds_config
from shared.train.profiles import PROFILES
from shared.train.results import device_info, differences, replace_text, versions

PREFETCH = (50_000_000, 200_000_000, 500_000_000, 1_000_000_000)
REDUCE = (50_000_000, 200_000_000, 500_000_000)
PERSISTENCE = (10_000, 100_000, 1_000_000, 10_000_000)


def parse_grid(text: str, flag: str = "--mb_grid") -> list[int]:
    """Comma-separated micro-batches, sorted and unique; a ValueError names `flag` on bad input."""
    try:
        grid = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from e
    if not grid or grid[0] <= 0:
        raise ValueError(f"{flag} needs positive micro-batches, got {text!r}")
    return grid


def knobs(cfg: TrainConfig) -> dict:
    """The candidate's effective settings (the profile's values filled in), so equal configurations match."""
    zero = build_ds_config(cfg)["zero_optimization"]
    return {"micro_batch": cfg.micro_batch, "activation_checkpointing": cfg.activation_checkpointing,
            "prefetch_bucket_size": zero.get("stage3_prefetch_bucket_size"),
            "reduce_bucket_size": zero.get("reduce_bucket_size"),
            "param_persistence_threshold": zero.get("stage3_param_persistence_threshold"),
            "compile": cfg.compile, "deepcompile_schedule": cfg.deepcompile_schedule, "zero3_step": cfg.zero3_step,
            "triton_gelu_grad": cfg.triton_gelu_grad,
            "vocab_multiple": cfg.vocab_multiple, "triton_loss": cfg.triton_loss, "triton_dropout": cfg.triton_dropout}


def persisted(sizes: list[int], threshold: int) -> int:
    """How many of the model's parameters (`sizes`: their element counts) ZeRO-3 keeps gathered at `threshold`:
    those of at most that many elements (stage3_model_persistence_threshold, a cap on their total, is unset here)."""
    return sum(n <= threshold for n in sizes)


def settings(train: TrainConfig, world: int) -> dict:
    """What a candidate's measurement depends on besides its knobs: a kept search must match it."""
    return {"train": {k: v for k, v in dataclasses.asdict(train).items() if k != "out"}, "world_size": world,
            "device": device_info()["name"], "versions": versions()}


def kept_candidates(train: TrainConfig, world: int, out_dir: Path) -> tuple[list[dict], list[str]]:
    """--keep_runs: the candidates an earlier search in out_dir measured (those that ran or ran out of memory; one
    that failed otherwise, e.g. cut by --timeout, runs again) and the commands that searched there; ([], []) when
    it holds none. A ValueError names what differs when that search was made with other settings."""
    path = out_dir / "autotune.json"
    if not path.is_file():
        return [], []
    try:
        earlier = json.loads(path.read_text())
        rows, there = earlier["ranking"], earlier["settings"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--keep_runs: {path} is not an autotune report this version wrote ({e!r}); rerun without "
                         "--keep_runs (it is then replaced)") from e
    diff = differences(train, there["train"], there.get("device"), there.get("versions", {}))
    if there.get("world_size") != world:
        diff.append(f"world_size {there.get('world_size')!r} there vs {world!r} now")
    if diff:
        raise ValueError(f"--keep_runs: {path} was searched with other settings ({'; '.join(diff[:4])}); rerun with "
                         "its flags, or without --keep_runs (it is then replaced)")
    commands = earlier.get("commands") or ([earlier["command"]] if earlier.get("command") else [])
    for r in rows:  # written before these were knobs: every candidate ran the base's
        r["knobs"].setdefault("zero3_step", train.zero3_step)
        for knob in ("triton_gelu_grad", *DEFAULT_KERNELS):
            r["knobs"].setdefault(knob, getattr(train, knob))
    # knobs of a search written before their flag was removed (docs/ledger.md): a candidate that ran one switched
    # off is the same configuration without it; one that ran it on is none this version can run
    current = set(knobs(train))
    gone = [{k: r["knobs"].pop(k) for k in set(r["knobs"]) - current} for r in rows]
    rows = [r for r, removed in zip(rows, gone) if all(v in (False, None) for v in removed.values())]
    return sorted((r for r in rows if r["status"] in ("ok", "oom")), key=lambda r: r["i"]), commands


class Search:
    def __init__(self, base: TrainConfig, ns, launch, out_dir: Path, kept: list[dict] = ()):
        self.base, self.ns, self.launch, self.out_dir = base, ns, launch, out_dir
        self.t0 = time.perf_counter()
        self.slowest = max((r["wall_s"] for r in kept), default=0.0)
        self.tried: list[dict] = [dict(r, kept=True) for r in kept]
        self.stopped_before: dict | None = None  # the first candidate the budget left out
        self.report: dict = {}  # filled by run_autotune; rewritten to autotune.json after every candidate

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 + self.slowest > self.ns.budget_s

    def write(self, complete: bool) -> dict:
        """autotune.json as the search stands; `complete` false while candidates may still follow."""
        self.report.update(complete=complete, elapsed_s=time.perf_counter() - self.t0,
                           ranking=sorted(self.tried, key=lambda r: -r.get("tokens_per_s_per_gpu", -1.0)),
                           winner=self.best(), budget_stopped_before=self.stopped_before)
        replace_text(self.out_dir / "autotune.json", json.dumps(self.report, indent=1))  # --keep_runs reads it
        return self.report

    def run(self, cfg: TrainConfig) -> dict | None:
        """One candidate; None when the budget is spent. OOM and failures are recorded, not raised."""
        key = knobs(cfg)
        for row in self.tried:
            if row["knobs"] == key:
                return row
        if self.over_budget():
            self.stopped_before = self.stopped_before or key
            return None
        i = max((r["i"] for r in self.tried), default=-1) + 1  # after every kept one (a failed one left a gap)
        t = time.perf_counter()
        row = {"i": i, "knobs": key}
        try:
            r = self.launch("deepspeed", cfg, self.out_dir / "runs" / f"candidate_{i}.json",
                            self.out_dir / "logs" / f"candidate_{i}.log")
            row.update(status="ok", tokens_per_s_per_gpu=r.tokens_per_s_per_gpu, tflops_per_gpu=r.tflops_per_gpu,
                       mfu=r.mfu, peak_mem_gib=r.peak_mem_gib, step_time_s=r.step_time_s["median"])
        except CompareError as e:  # the run failed: say why in the table
            row.update(status="oom" if e.oom else "failed", error=str(e).splitlines()[0][:300])
        row["wall_s"] = time.perf_counter() - t
        self.slowest = max(self.slowest, row["wall_s"])
        self.tried.append(row)
        self.write(complete=False)
        speed = f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU" if row["status"] == "ok" else row["status"]
        print(f"  candidate {i}: {key} -> {speed}", flush=True)
        return row

    def best(self) -> dict | None:
        ok = [r for r in self.tried if r["status"] == "ok"]
        return max(ok, key=lambda r: r["tokens_per_s_per_gpu"]) if ok else None


def run_autotune(train: TrainConfig, ns, launch, out_dir: Path, kept: list[dict] = ()) -> dict:
    """The search; `kept`: candidates measured by an earlier search of the same settings (kept_candidates)."""
    base = dataclasses.replace(train, zero_profile="tuned", wall_clock_breakdown=False)
    search = Search(base, ns, launch, out_dir, kept)
    commands = list(getattr(ns, "commands", []))  # every invocation of a continued search, this one last
    here = settings(train, ns.world)
    search.report = {"preset": train.preset, "world_size": ns.world, "budget_s": ns.budget_s, "settings": here,
                     "kept_candidates": len(kept), "command": commands[-1] if commands else None,
                     "commands": commands, "versions": here["versions"]}
    if kept:
        print(f"  {len(kept)} candidate(s) kept from {out_dir / 'autotune.json'} (--keep_runs)", flush=True)
    grid = parse_grid(ns.mb_grid)

    # 1. micro-batch without, then with, activation checkpointing
    largest_fit, previous = None, None
    for mb in grid:
        row = search.run(dataclasses.replace(base, micro_batch=mb))
        if row is None or row["status"] != "ok":
            break
        largest_fit = mb
        if previous and row["tokens_per_s_per_gpu"] < previous["tokens_per_s_per_gpu"]:
            break  # early stop: a larger micro-batch stopped paying
        previous = row
    for mb in [m for m in grid if largest_fit is None or m > largest_fit]:
        row = search.run(dataclasses.replace(base, micro_batch=mb, activation_checkpointing=True))
        if row is None or row["status"] != "ok":
            break

    # 2. compiled blocks, from the best so far
    best = search.best()
    if best is not None and best["knobs"]["compile"] == "none":
        search.run(dataclasses.replace(base, **{**best["knobs"], "compile": "blocks"}))

    # 3. DeepCompile, from the best micro-batch so far upwards
    best = search.best()
    if best is not None:
        previous = None
        for mb in [m for m in grid if m >= best["knobs"]["micro_batch"]]:
            try:
                cfg = dataclasses.replace(base, **{**best["knobs"], "micro_batch": mb, "compile": "deepcompile",
                                                   "deepcompile_schedule": "once"})
            except ValueError as e:  # no CUDA, stage 0, a flag DeepCompile refuses: say so, go on without it
                print(f"  DeepCompile not tried: {e}", flush=True)
                break
            row = search.run(cfg)
            if row is None or row["status"] != "ok" or (
                    previous and row["tokens_per_s_per_gpu"] < previous["tokens_per_s_per_gpu"]):
                break
            previous = row

    # 4. the optimizer step (a ZeRO-3 step only) and the MLP's bias + GELU backward as one kernel each, in turn on
    # the best so far
    kernels = [("zero3_step", "fused", "fused optimizer step", fused_step_refusal)] if base.stage == 3 else []
    kernels.append(("triton_gelu_grad", True, "bias + GELU backward kernel", gelu_kernel_refusal))
    for knob, value, name, refusal in kernels:
        best = search.best()
        if best is None or best["knobs"][knob] == value:
            continue
        why = refusal(base)
        if why:
            print(f"  {name} not tried: {why}", flush=True)
        else:
            search.run(dataclasses.replace(base, **{**best["knobs"], knob: value}))
    # then compare.py's GPU default's padded vocabulary, Triton loss and Triton dropout, together (as measured), on
    # the best so far: each one it rules out stays as it is, and none is turned off
    best = search.best()
    if best is not None:
        on_best = dataclasses.replace(base, **best["knobs"])
        ruled_out = default_kernels_refusals(on_best)
        together = {k: v for k, v in DEFAULT_KERNELS.items() if k not in ruled_out and not getattr(on_best, k)}
        if not model_config.cuda_available():
            print("  padded vocabulary, Triton loss and dropout not tried: the Triton kernels need a CUDA GPU to be "
                  "timed (on a CPU only Triton's interpreter runs them)", flush=True)
        elif together:
            search.run(dataclasses.replace(on_best, **together))

    # 5. ZeRO-3 knobs, one at a time from the best so far
    if base.stage == 3:
        from shared.model.gpt import GPT  # here: importing the model loads dynamo, which the CLI must not pay

        with torch.device("meta"):  # the parameters' sizes only: nothing is allocated
            sizes = [p.numel() for p in GPT(base.model()).parameters()]
        for field, values in (("prefetch_bucket_size", PREFETCH), ("reduce_bucket_size", REDUCE),
                              ("param_persistence_threshold", PERSISTENCE)):
            best = search.best()
            if best is None or search.stopped_before:  # nothing ran, or the budget is spent
                break
            deepcompile = best["knobs"]["compile"] == "deepcompile"
            if field == "prefetch_bucket_size" and deepcompile:
                print("  prefetch bucket not tried: DeepCompile schedules its own prefetch", flush=True)
                continue
            if field == "param_persistence_threshold" and deepcompile and base.deepcompile_persist != "threshold":
                print("  persistence threshold not tried: --deepcompile_persist deepspeed gathers every parameter "
                      "per use whatever the threshold", flush=True)
                continue
            kept_gathered = {persisted(sizes, best["knobs"][field])} if field == "param_persistence_threshold" else None
            for v in values:
                if kept_gathered is not None:
                    n = persisted(sizes, v)
                    if n in kept_gathered:
                        print(f"  persistence {v:.0e} not tried: it keeps the same {n} parameters gathered as a "
                              "threshold already measured", flush=True)
                        continue
                    kept_gathered.add(n)
                if search.run(dataclasses.replace(base, **{**best["knobs"], field: v})) is None:
                    break

    winner = search.best()
    report = search.report
    if winner is not None:
        cfg = dataclasses.replace(base, **winner["knobs"])
        commands = report["commands"]  # how to make it again: every invocation of the search
        provenance = {"command": commands[-1], "commands": commands} if commands else {}
        (out_dir / "winner_ds_config.json").write_text(json.dumps({**build_ds_config(cfg), **provenance}, indent=1))
        flags = [f"--ds_config {out_dir / 'winner_ds_config.json'}", f"--micro_batch {cfg.micro_batch}"]
        if cfg.activation_checkpointing:
            flags.append("--activation_checkpointing")
        if cfg.compile != "none":
            flags.append(f"--compile {cfg.compile}")
        if cfg.compile == "deepcompile":
            flags.append(f"--deepcompile_schedule {cfg.deepcompile_schedule}")
        if cfg.coordinate_descent_tuning and cfg.compile != "none":  # the candidates ran with it: so must the user
            flags.append("--coordinate_descent_tuning")
        if cfg.zero3_step != TrainConfig.zero3_step:
            flags.append(f"--zero3_step {cfg.zero3_step}")
        if cfg.triton_gelu_grad:
            flags.append("--triton_gelu_grad")
        if cfg.vocab_multiple:
            flags.append(f"--vocab_multiple {cfg.vocab_multiple}")
        flags += [f"--{k}" for k in ("triton_loss", "triton_dropout") if getattr(cfg, k)]
        report["winner_flags"] = " ".join(flags)
    return search.write(complete=True)


# The fast profile's kernels of the model (shared/train/profiles.py), tried together where default_kernels_refusals
# leaves each on
DEFAULT_KERNELS = {k: PROFILES["fast"].settings[k] for k in ("vocab_multiple", "triton_loss", "triton_dropout")}


def default_kernels_refusals(cfg) -> dict:
    """Of DEFAULT_KERNELS, those the configuration rules out (a TrainConfig, or compare.py's parsed flags, where an
    unset flag is None), each with the value it keeps: the Triton loss was measured in bf16 only (its logits'
    gradient is kept in their dtype, which fp16's range does not hold); the
    Triton dropout draws the mask of the fused bias + dropout + add, off with --fused_bias_dropout_add false."""
    off = {}
    if normalize_precision(cfg.precision or TrainConfig.precision) != "bf16":
        off["triton_loss"] = TrainConfig.triton_loss
    if cfg.fused_bias_dropout_add is False:
        off["triton_dropout"] = TrainConfig.triton_dropout
    return off


def fused_step_refusal(cfg: TrainConfig) -> str | None:
    """Why the search does not try `--zero3_step fused` for this configuration, or None when it does."""
    if cfg.zero3_step == "deepspeed":
        return "--zero3_step deepspeed asks for DeepSpeed's own step"
    if not model_config.cuda_available():
        return "its Triton kernel needs a CUDA GPU to be timed (on a CPU only Triton's interpreter runs it)"
    return None


def gelu_kernel_refusal(cfg) -> str | None:
    """Why `--triton_gelu_grad` cannot run in this configuration (a TrainConfig, or compare.py's parsed flags, where
    an unset flag is None), or None when it can: the search does not try it then, nor compare.py's GPU default."""
    if cfg.fused_bias_gelu is False:
        return "it is the backward of the fused bias + GELU, and --fused_bias_gelu is false"
    if not model_config.cuda_available():
        return "its Triton kernel needs a CUDA GPU to be timed (on a CPU only Triton's interpreter runs it)"
    return None


def describe(k: dict) -> str:
    """One candidate's knobs, as the table prints them."""
    return (f"mb {k['micro_batch']}{' +ckpt' if k['activation_checkpointing'] else ''}"
            f"{' +' + k['compile'] if k.get('compile', 'none') != 'none' else ''}"
            f"{' step ' + k['zero3_step'] if k.get('zero3_step', 'fast') != 'fast' else ''}"
            f"{' +gelu_kernel' if k.get('triton_gelu_grad') else ''}"
            f"{' +vocab' + str(k['vocab_multiple']) if k.get('vocab_multiple') else ''}"
            f"{' +triton_loss' if k.get('triton_loss') else ''}{' +triton_dropout' if k.get('triton_dropout') else ''}"
            + "".join(f" {label} {k[key]:.0e}" for label, key in (
                ("prefetch", "prefetch_bucket_size"), ("reduce", "reduce_bucket_size"),
                ("persist", "param_persistence_threshold")) if k[key] is not None))  # None: not of this stage


def format_autotune(report: dict) -> str:
    lines = [f"{'#':>3} {'tokens/s/GPU':>13} {'TFLOPs/GPU':>11} {'peak GiB':>9}  configuration"]
    for r in report["ranking"]:
        conf = describe(r["knobs"]) + (" (kept)" if r.get("kept") else "")
        if r["status"] == "ok":
            mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a"
            lines.append(f"{r['i']:>3} {r['tokens_per_s_per_gpu']:>13,.0f} {r['tflops_per_gpu']:>11.3f} {mem:>9}  "
                         f"{conf}")
        else:
            lines.append(f"{r['i']:>3} {r['status']:>13} {'':>11} {'':>9}  {conf}")
    w = report["winner"]
    lines.append("")
    lines.append(f"winner: candidate {w['i']}; train with {report['winner_flags']}" if w else "no candidate ran")
    kept = report.get("kept_candidates", 0)
    lines.append(f"searched {len(report['ranking']) - kept} candidates in {report['elapsed_s']:.0f}s "
                 f"(budget {report['budget_s']}s)" + (f", {kept} kept from an earlier search" if kept else ""))
    if report.get("budget_stopped_before"):
        lines.append(f"budget spent: the search stopped before {describe(report['budget_stopped_before'])} "
                     "(--keep_runs with the same --out continues it)")
    return "\n".join(lines)
