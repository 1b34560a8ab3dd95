"""`python compare.py --explain`: what each Lightning or DeepSpeed overhead costs the Lightning path.

Each round runs the raw loop and the Lightning path with the fast defaults, then the Lightning path with one
overhead switched on at a time (lightning_app/overheads.py, plus the config factors below); odd rounds run
the same list in reverse order (harness/order.py, the policy compare.py's pairs follow too), so neither the raw
loop, the baseline nor a factor always runs first. A factor's cost is its TFLOPs/GPU over the *same round's*
fast-default Lightning run, minus 1: the difference Lightning makes with the factor and without it, with the
machine's drift between rounds cancelled. Over several rounds (--factor_repeats) the table gives the median and
[min, max]; a cost whose spread includes 0, or whose magnitude is below the baseline's round-to-round noise (the larger
relative range, max - min over the median, of the raw run and of the fast-default Lightning run over the rounds),
is labelled "within noise". The phase column names
where the extra time went, against the same round's fast Lightning run.

Below the measured rows come the original study's measurement artefacts, computed from the fast Lightning run
rather than run: they change the number a script prints, not the speed of training. They follow the study's
scripts (github.com/SeanNaren/min-LLM, lightning.py / profiler.py / pytorch.py as stored): the Lightning
callback timed batches 20..40 inclusive (21 batches) with the host clock and divided by 20 steps; it fed the
formula the character vocabulary of tiny-shakespeare (65) instead of GPT-2's 50257; and its formula was
2*k*N*s*B with N the parameter count, which leaves out the s^2 attention term of the Megatron formula.

    python explain.py REPORT/explain.json    # recompute the cost table of a report (REPORT: compare.py's --out)
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from harness.launch import CompareError
from harness.order import round_order
from lightning_app.overheads import LIGHTNING_OVERHEADS, check_overheads
from shared.model import flops
from shared.train.config import TrainConfig
from shared.train.results import RunResult, versions
from shared.train.timing import PHASES

# Factors that change the run's config rather than switch on a Lightning overhead.
CONFIG_FACTORS = {
    "grad_accum_2": ("2 gradient-accumulation micro-steps per step in Lightning, 1 in raw (the study's scripts "
                     "did not match)", {"grad_accum": 2}),
}
FACTORS = {**LIGHTNING_OVERHEADS, **{k: v[0] for k, v in CONFIG_FACTORS.items()}}
STUDY_VOCAB = 65  # tiny-shakespeare's characters, the vocabulary the study's scripts fed their formula
STUDY_TIMED_STEPS = 20  # profiler.py: start_idx 20, end_idx 40, both batches inside the timed interval


def factor_config(train: TrainConfig, factor: str) -> TrainConfig:
    if factor in CONFIG_FACTORS:
        return dataclasses.replace(train, **CONFIG_FACTORS[factor][1])
    if factor in LIGHTNING_OVERHEADS:
        cfg = dataclasses.replace(train, lightning_overheads=factor)
        check_overheads(cfg)
        return cfg
    raise ValueError(f"unknown explain factor {factor!r}; choose from {sorted(FACTORS)}")


def parse_factors(text: str | None) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()] if text else list(FACTORS)
    unknown = [f for f in names if f not in FACTORS]
    if unknown:
        raise ValueError(f"unknown explain factor(s) {unknown}; choose from {sorted(FACTORS)}")
    repeated = sorted({f for f in names if names.count(f) > 1})
    if repeated:
        raise ValueError(f"explain factor(s) {repeated} named more than once in --factors {text!r}")
    return names


def study_artefacts(train: TrainConfig, pl_tflops: float) -> list[dict]:
    """The study's measurement artefacts applied to a measured Lightning TFLOPs/GPU figure."""
    cfg = train.model()
    s, h, n_layer, vocab, k = cfg.seq_len, cfg.n_embd, cfg.n_layer, cfg.vocab_size, train.flops_factor
    true_flops = flops.megatron_flops(1, s, n_layer, h, vocab, k)
    char_vocab = flops.megatron_flops(1, s, n_layer, h, STUDY_VOCAB, k)
    n_params = n_layer * (12 * h * h + 13 * h) + STUDY_VOCAB * h + s * h + 2 * h  # profiler.py's count
    six_nd = 2 * k * n_params * s
    timing = (STUDY_TIMED_STEPS + 1) / STUDY_TIMED_STEPS
    rows = [
        ("study_timing_callback", f"host clock, no device sync, {STUDY_TIMED_STEPS + 1} batches / "
                                  f"{STUDY_TIMED_STEPS} steps", timing),
        ("study_char_vocab", f"vocabulary {STUDY_VOCAB} instead of {vocab} in the formula", char_vocab / true_flops),
        ("study_lightning_formula", "2*k*N*s*B (params, no s^2 attention term), vocabulary 65",
         six_nd / true_flops),
    ]
    rows.append(("study_all_three", "the three together, as the study's Lightning callback printed",
                 timing * six_nd / true_flops))
    return [{"factor": name, "what": what, "multiplier": m, "lightning_tflops_per_gpu": pl_tflops * m}
            for name, what, m in rows]


def run_explain(train: TrainConfig, ns, launch, out_dir: Path) -> dict:
    """Run the rounds and build the explain report; `launch(path, train, out, log)` runs one process group.

    When a run fails, explain.json (and explain.md, if a round of both baselines finished) is written from the runs
    finished before it, marked "complete": false, and the CompareError is raised again, naming that report."""
    factors = parse_factors(ns.factors)
    results: dict[str, list[RunResult]] = {"deepspeed": [], "fast_default": [], **{f: [] for f in factors}}
    finished = []  # run stems, in the order they ran
    for i in range(ns.repeats):
        names = ["deepspeed", "fast_default", *(factors if i < ns.factor_repeats else [])]
        for name in round_order(names, i):
            if name == "deepspeed":
                path, cfg, stem = "deepspeed", train, f"deepspeed_{i}"
            elif name == "fast_default":
                path, cfg, stem = "lightning", train, f"lightning_{i}"
            else:
                path, cfg, stem = "lightning", factor_config(train, name), f"{name}_{i}"
            try:
                results[name].append(launch(path, cfg, out_dir / "runs" / f"{stem}.json",
                                            out_dir / "logs" / f"{stem}.log"))
            except CompareError as e:
                raise write_partial(train, ns, factors, results, finished, stem, e, out_dir) from e
            finished.append(stem)
    report = explain_report(train, ns, factors, results)
    return {**report, "complete": True}


def figures(results: dict[str, list[RunResult]]) -> dict[str, list[dict]]:
    """Per-round run figures, as explain.json stores them and cost_table reads them."""
    return {name: [{"tflops_per_gpu": r.tflops_per_gpu, "phases_s": r.phases_s} for r in rs]
            for name, rs in results.items()}


def explain_report(train: TrainConfig, ns, factors: list[str], results: dict[str, list[RunResult]]) -> dict:
    """The report of `results`: one deepspeed and one fast-default run per round, factors in their first rounds."""
    runs = figures(results)
    table = cost_table(runs, {f: FACTORS[f] for f in factors})
    rounds = len(runs["deepspeed"])
    return {
        "command": getattr(ns, "command", None),  # compare.py's command line
        "preset": train.preset,
        "world_size": ns.world,
        "device": results["deepspeed"][0].device,
        "train": dataclasses.asdict(train),
        "rounds": rounds,
        "factor_rounds": min(ns.factor_repeats, rounds),
        "runs": runs,  # per round, in round order: what cost_table (and recompute) read
        **table,
        "study_artefacts": study_artefacts(train, table["rows"][0]["lightning_tflops_per_gpu"]),
    }


def write_partial(train: TrainConfig, ns, factors: list[str], results: dict[str, list[RunResult]],
                  finished: list[str], failed: str, error: CompareError, out_dir: Path) -> CompareError:
    """A run failed: write the report of the rounds in which both baselines finished (explain.json only, with the
    finished runs' figures and the failure, if none did) and return the error to raise, naming that report."""
    done = min(len(results["deepspeed"]), len(results["fast_default"]))  # rounds run in order: the first `done`
    measured = [f for f in factors if results[f][:done]]
    partial = {"complete": False, "versions": versions(), "failed_run": failed,
               "error": error.reason.removeprefix("reason: "),
               "finished_runs": finished, "not_measured": [f for f in factors if f not in measured],
               "planned_rounds": ns.repeats}
    path = out_dir / "explain.json"
    if done:
        kept = {name: results[name][:done] for name in ("deepspeed", "fast_default", *measured)}
        write_explain({**explain_report(train, ns, measured, kept), **partial}, out_dir)
        what = f"the report of the {done} round(s) finished before it is in {path} and explain.md"
    else:
        (out_dir / "explain.md").unlink(missing_ok=True)  # an earlier invocation's, not these runs'
        path.write_text(json.dumps({"command": getattr(ns, "command", None), "preset": train.preset,
                                    "world_size": ns.world, **partial,
                                    "runs": figures({n: rs for n, rs in results.items() if rs})}, indent=1))
        what = f"no round finished; the finished runs' figures are in {path}"
    first, _, rest = str(error).partition("\n")
    return CompareError(f"{first}\nexplain stopped at {failed} ({len(finished)} run(s) finished): {what}, marked "
                        f"incomplete\n{rest}".rstrip())


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _relative_range(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def verdict(deltas: list[float], noise: float | None) -> str:
    """Whether a factor's per-round deltas against the same round's baseline stand out of the noise.

    Within noise: the spread over rounds includes 0, or the median's magnitude is below the baseline's
    round-to-round noise. With one round of the baselines the noise is not measured, and with one factor round there is
    no spread: the label says so rather than call a single difference a cost."""
    med = statistics.median(deltas)
    if len(deltas) >= 2 and min(deltas) <= 0 <= max(deltas):
        return "within noise"
    if noise is None:
        return "noise not measured (1 round)"
    if abs(med) < noise:
        return "within noise"
    return "beyond noise" if len(deltas) >= 2 else "beyond noise (1 round, no spread)"


def cost_table(runs: dict[str, list[dict]], factors: dict[str, str]) -> dict:
    """Each factor's TFLOPs/GPU against the same round's fast-default Lightning run, from per-round figures.

    runs: "deepspeed" and "fast_default" (one entry per round) and each factor (one per round it ran, from round
    0 on), each entry {"tflops_per_gpu": float, "phases_s": {phase: seconds}}; factors: name -> description.
    """
    raw, base = runs["deepspeed"], runs["fast_default"]
    if not raw or len(raw) != len(base):
        raise ValueError(f"explain runs need one raw and one fast-default Lightning run per round, got {len(raw)} "
                         f"and {len(base)}")
    base_tflops = [r["tflops_per_gpu"] for r in base]
    raw_tflops = [r["tflops_per_gpu"] for r in raw]
    # The machine's round-to-round noise, as both baselines measured it: the larger relative range of the two.
    noise = max(_relative_range(base_tflops), _relative_range(raw_tflops)) if len(base) > 1 else None
    vs_raw = [b["tflops_per_gpu"] / a["tflops_per_gpu"] - 1 for a, b in zip(raw, base)]
    rows = [{"factor": "fast_default", "what": "Lightning with this project's fast defaults",
             "lightning_tflops_per_gpu": statistics.median(base_tflops), "n": len(base),
             "delta_vs_raw": statistics.median(vs_raw), "delta_vs_raw_min": min(vs_raw),
             "delta_vs_raw_max": max(vs_raw), "phase": None}]
    for name, what in factors.items():
        measured = runs.get(name) or []
        if not measured or len(measured) > len(base):
            raise ValueError(f"explain factor {name!r} has {len(measured)} run(s) for {len(base)} round(s)")
        deltas = [r["tflops_per_gpu"] / base[i]["tflops_per_gpu"] - 1 for i, r in enumerate(measured)]
        extra_ms = {p: statistics.median((r["phases_s"][p] - base[i]["phases_s"][p]) * 1e3
                                         for i, r in enumerate(measured)) for p in PHASES}
        worst = max(extra_ms, key=extra_ms.get)
        rows.append({
            "factor": name, "what": what,
            "lightning_tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in measured),
            "n": len(measured),
            "delta_vs_lightning": statistics.median(deltas), "delta_min": min(deltas), "delta_max": max(deltas),
            "verdict": verdict(deltas, noise),
            "extra_ms_by_phase": extra_ms, "phase": worst if extra_ms[worst] > 0 else None,
        })
    return {
        "raw_tflops_per_gpu": statistics.median(raw_tflops),
        "raw_tflops_spread": _spread(raw_tflops),
        "lightning_tflops_spread": _spread(base_tflops),
        "baseline_noise": noise,
        "rows": rows,
    }


def recompute(explain_json: str | Path) -> dict:
    """The cost table of an explain.json, recomputed from its per-round figures.

    Reports written before the figures were stored in explain.json ("runs") are read from the run JSONs in the
    runs/ folder beside it (deepspeed_I, lightning_I, FACTOR_I.json)."""
    path = Path(explain_json)
    report = json.loads(path.read_text())
    if "rows" not in report:
        raise ValueError(f"{path} has no cost table: run {report.get('failed_run')} failed before a round of both "
                         f"baselines finished ({report.get('error')})")
    factors = {r["factor"]: r["what"] for r in report["rows"][1:]}
    runs = report.get("runs")
    if runs is None:
        def read(stem: str) -> dict:
            f = path.parent / "runs" / f"{stem}.json"
            if not f.is_file():
                raise ValueError(f"{path} has no per-round figures and its run JSON {f} is missing")
            r = json.loads(f.read_text())
            return {"tflops_per_gpu": r["tflops_per_gpu"], "phases_s": r["phases_s"]}

        rounds, factor_rounds = report["rounds"], report["factor_rounds"]
        runs = {"deepspeed": [read(f"deepspeed_{i}") for i in range(rounds)],
                "fast_default": [read(f"lightning_{i}") for i in range(rounds)],
                **{f: [read(f"{f}_{i}") for i in range(factor_rounds)] for f in factors}}
    return {**report, "runs": runs, **cost_table(runs, factors)}


def format_explain(report: dict) -> str:
    incomplete = [] if report.get("complete", True) else [
        f"INCOMPLETE: run {report['failed_run']} failed ({report['error']}); the table covers the {report['rounds']} "
        f"round(s) finished before it" + (f"; not measured: {', '.join(report['not_measured'])}"
                                          if report["not_measured"] else ""), ""]
    spec = ".2f" if report["raw_tflops_per_gpu"] >= 1 else ".5f"
    rs, ls, base = report["raw_tflops_spread"], report["lightning_tflops_spread"], report["rows"][0]
    noise = report["baseline_noise"]
    lines = [f"raw DeepSpeed:            {rs['median']:{spec}} TFLOPs/GPU [{rs['min']:{spec}}, {rs['max']:{spec}}] "
             f"over {rs['n']} round(s)",
             f"Lightning, fast defaults: {ls['median']:{spec}} TFLOPs/GPU [{ls['min']:{spec}}, {ls['max']:{spec}}]; "
             f"vs the same round's raw {base['delta_vs_raw']:+.2%} [{base['delta_vs_raw_min']:+.2%}, "
             f"{base['delta_vs_raw_max']:+.2%}]",
             "round-to-round noise (larger range of the raw and the fast Lightning runs, over the median): "
             + (f"{noise:.2%}" if noise is not None else "not measured (1 round)"),
             "",
             f"{'factor (switched on in Lightning)':<34} {'TFLOPs/GPU':>10} {'vs Lightning':>12} {'[min, max]':>17} "
             f"{'rounds':>6}  {'verdict':<33} where",
             ]
    for r in report["rows"][1:]:
        where = f"{r['phase']} (+{r['extra_ms_by_phase'][r['phase']]:.2f} ms)" if r["phase"] else ""
        lines.append(f"{r['factor']:<34} {r['lightning_tflops_per_gpu']:>10{spec}} {r['delta_vs_lightning']:>+12.2%} "
                     f"[{r['delta_min']:+.2%}, {r['delta_max']:+.2%}] {r['n']:>6}  {r['verdict']:<33} {where}")
    lines += ["", "the original study's measurement artefacts, applied to the fast Lightning run (computed):"]
    for a in report["study_artefacts"]:
        lines.append(f"{a['factor']:<34} {a['lightning_tflops_per_gpu']:>10{spec}}  x{a['multiplier']:.4f}  "
                     f"{a['what']}")
    return "\n".join(incomplete + lines)


def write_explain(report: dict, out_dir: Path) -> None:
    (out_dir / "explain.json").write_text(json.dumps(report, indent=1))
    d = report["device"]
    md = [f"# Why is Lightning slower? {report['preset']} on {report['world_size']} x {d['name']}", "",
          *([f"Command: `{report['command']}`", ""] if report["command"] else []),  # none in an incomplete report
          "```", format_explain(report), "```", "",
          "| factor | what it switches on |", "|---|---|"]
    md += [f"| {r['factor']} | {r['what']} |" for r in report["rows"]]
    (out_dir / "explain.md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> dict:
    import argparse

    p = argparse.ArgumentParser(description="Recompute and print the cost table of an explain.json.")
    p.add_argument("explain_json", type=Path)
    report = recompute(p.parse_args(argv).explain_json)
    print(format_explain(report))
    return report


if __name__ == "__main__":
    main()
