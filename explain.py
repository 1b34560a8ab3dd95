"""`python compare.py --explain`: what each Lightning or DeepSpeed overhead costs, against the raw loop.

Each round runs the raw loop and the Lightning path with the fast defaults, then the Lightning path with one
overhead switched on at a time (shared/config.LIGHTNING_OVERHEADS, plus the config factors below). A factor's
delta is its TFLOPs/GPU over the same round's raw run, so drift of the machine between rounds cancels; the
phase column names where the extra time went, against the same round's fast Lightning run.

Below the measured rows come the original study's measurement artefacts, computed from the fast Lightning run
rather than run: they change the number a script prints, not the speed of training. They follow the study's
scripts (github.com/SeanNaren/min-LLM, lightning.py / profiler.py / pytorch.py as stored): the Lightning
callback timed batches 20..40 inclusive (21 batches) with the host clock and divided by 20 steps; it fed the
formula the character vocabulary of tiny-shakespeare (65) instead of GPT-2's 50257; and its formula was
2*k*N*s*B with N the parameter count, which leaves out the s^2 attention term of the Megatron formula.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from shared import flops
from shared.config import LIGHTNING_OVERHEADS, TrainConfig
from shared.results import RunResult
from shared.timing import PHASES

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
        return dataclasses.replace(train, lightning_overheads=factor)
    raise ValueError(f"unknown explain factor {factor!r}; choose from {sorted(FACTORS)}")


def parse_factors(text: str | None) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()] if text else list(FACTORS)
    unknown = [f for f in names if f not in FACTORS]
    if unknown:
        raise ValueError(f"unknown explain factor(s) {unknown}; choose from {sorted(FACTORS)}")
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
    """Run the rounds and build the explain report; `launch(path, train, out, log)` runs one process group."""
    factors = parse_factors(ns.factors)
    raw: list[RunResult] = []
    base: list[RunResult] = []
    runs: dict[str, list[tuple[int, RunResult]]] = {f: [] for f in factors}
    for i in range(ns.repeats):
        raw.append(launch("deepspeed", train, out_dir / "runs" / f"deepspeed_{i}.json",
                          out_dir / "logs" / f"deepspeed_{i}.log"))
        base.append(launch("lightning", train, out_dir / "runs" / f"lightning_{i}.json",
                           out_dir / "logs" / f"lightning_{i}.log"))
        if i < ns.factor_repeats:
            for f in factors:
                runs[f].append((i, launch("lightning", factor_config(train, f), out_dir / "runs" / f"{f}_{i}.json",
                                          out_dir / "logs" / f"{f}_{i}.log")))

    def row(name: str, what: str, pairs: list[tuple[int, RunResult]]) -> dict:
        deltas = [r.tflops_per_gpu / raw[i].tflops_per_gpu - 1 for i, r in pairs]
        extra_ms = {p: statistics.median((r.phases_s[p] - base[i].phases_s[p]) * 1e3 for i, r in pairs)
                    for p in PHASES}
        worst = max(extra_ms, key=extra_ms.get)
        return {
            "factor": name, "what": what,
            "lightning_tflops_per_gpu": statistics.median(r.tflops_per_gpu for _, r in pairs),
            "delta_vs_raw": statistics.median(deltas), "delta_min": min(deltas), "delta_max": max(deltas),
            "n": len(pairs), "extra_ms_by_phase": extra_ms,
            "phase": worst if name != "fast_default" and extra_ms[worst] > 0 else None,
        }

    rows = [row("fast_default", "Lightning with this project's fast defaults", list(enumerate(base)))]
    rows += [row(f, FACTORS[f], runs[f]) for f in factors]
    pl_fast = rows[0]["lightning_tflops_per_gpu"]
    raw_tflops = [r.tflops_per_gpu for r in raw]
    report = {
        "command": None,  # filled by compare.py
        "preset": train.preset,
        "world_size": ns.world,
        "device": raw[0].device,
        "train": dataclasses.asdict(train),
        "rounds": ns.repeats,
        "factor_rounds": min(ns.factor_repeats, ns.repeats),
        "raw_tflops_per_gpu": statistics.median(raw_tflops),
        "raw_tflops_spread": {"min": min(raw_tflops), "max": max(raw_tflops), "n": len(raw_tflops)},
        "rows": rows,
        "study_artefacts": study_artefacts(train, pl_fast),
    }
    return report


def format_explain(report: dict) -> str:
    spec = ".2f" if report["raw_tflops_per_gpu"] >= 1 else ".5f"
    rs = report["raw_tflops_spread"]
    lines = [f"raw DeepSpeed: {report['raw_tflops_per_gpu']:{spec}} TFLOPs/GPU "
             f"[{rs['min']:{spec}}, {rs['max']:{spec}}] over {rs['n']} rounds",
             "",
             f"{'factor':<31} {'Lightning TFLOPs/GPU':>21} {'vs raw':>8} {'[min, max]':>17}  where",
             ]
    for r in report["rows"]:
        where = f"{r['phase']} (+{r['extra_ms_by_phase'][r['phase']]:.2f} ms)" if r["phase"] else ""
        lines.append(f"{r['factor']:<31} {r['lightning_tflops_per_gpu']:>21{spec}} {r['delta_vs_raw']:>+8.2%} "
                     f"[{r['delta_min']:+.2%}, {r['delta_max']:+.2%}]  {where}")
    lines += ["", "the original study's measurement artefacts, applied to the fast Lightning run (computed):"]
    for a in report["study_artefacts"]:
        lines.append(f"{a['factor']:<31} {a['lightning_tflops_per_gpu']:>21{spec}}  x{a['multiplier']:.4f}  "
                     f"{a['what']}")
    return "\n".join(lines)


def write_explain(report: dict, out_dir: Path) -> None:
    (out_dir / "explain.json").write_text(json.dumps(report, indent=1))
    d = report["device"]
    md = [f"# Why is Lightning slower? {report['preset']} on {report['world_size']} x {d['name']}", "",
          f"Command: `{report['command']}`", "", "```", format_explain(report), "```", "",
          "| factor | what it switches on |", "|---|---|"]
    md += [f"| {r['factor']} | {r['what']} |" for r in report["rows"]]
    (out_dir / "explain.md").write_text("\n".join(md) + "\n")
