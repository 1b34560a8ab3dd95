"""The fused-kernel / compile ablation: both paths, one configuration at a time, in one run.

    python benchmarks/ablation.py --preset 1.5b --micro_batch 8 --out benchmarks/results/ablation_1xh200
    python benchmarks/ablation.py                       # no GPU: tiny preset on CPU (fused_layernorm left out)

Each configuration adds one switch to the naive model (every switch off), then `compile` (blocks), then `all`
(every switch that ran). Each runs through the raw DeepSpeed loop and the Lightning path: with two or more GPUs
the two paths of a configuration run at the same time on GPU 0 and GPU 1 (one GPU each, so the figures are
1-GPU figures), else one after the other. Then the largest micro-batch without activation checkpointing is
found for the naive and the `all` configuration (raw path; increasing, stops at the first out-of-memory).
Writes ablation.json (every run's TFLOPs/GPU, step-time spread, phases, peak memory, fused paths and dynamo
counters) and ablation.md (the table). A configuration that fails is recorded with its reason; the rest go on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from harness.launch import CompareError, launch
from harness.report import measured
from shared.train.config import TrainConfig
from shared.train.results import versions

SWITCHES = {
    "native_linear": {"memory_efficient_linear": False},
    "fused_loss": {"fused_loss": True},
    "bias_dropout_add": {"fused_bias_dropout_add": True},
    "bias_gelu": {"fused_bias_gelu": True},
    "layernorm_liger": {"fused_layernorm": True},
    "compile": {"compile": "blocks"},
    "fast_zero3_step": {"zero3_step": "fast"},
}
PATHS = ("deepspeed", "lightning")
# Every switch off, spelled out: the bias fusions default to on where CUDA is (shared/model/config.py), the fast
# ZeRO-3 step everywhere (shared/train/zero3_step.py).
NAIVE = {"fused_bias_dropout_add": False, "fused_bias_gelu": False, "zero3_step": "deepspeed"}


def configurations(cuda: bool) -> dict[str, dict]:
    switches = {k: v for k, v in SWITCHES.items() if cuda or k != "layernorm_liger"}  # liger is CUDA-only
    # naive, compile and all first: a run cut short by a time limit still has the main comparison
    # all: every switch that combines with compile (liger's LayerNorm does not: see shared/train/config.py)
    configs = {"naive": {}, "+compile": switches["compile"],
               "all": {k: v for name, flags in switches.items() for k, v in flags.items()
                       if name != "layernorm_liger"}}
    configs.update({f"+{k}": v for k, v in switches.items() if k != "compile"})
    return {name: {**NAIVE, **flags} for name, flags in configs.items()}


def run_one(base: TrainConfig, name: str, flags: dict, path: str, out: Path, gpu: int | None, timeout: int) -> dict:
    cfg = dataclasses.replace(base, **flags)
    slug = name.lstrip("+").replace("/", "_")
    env = {"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else None
    try:
        r = launch(path, cfg, 1, out / "runs" / f"{slug}_{path}.json", out / "logs" / f"{slug}_{path}.log",
                   timeout, env=env)
    except CompareError as e:
        return {"config": name, "path": path, "flags": flags, "micro_batch": cfg.micro_batch, "ok": False,
                "oom": e.oom, "error": e.reason[:300]}
    return {"config": name, "path": path, "flags": flags, "micro_batch": cfg.micro_batch, "ok": True, **measured(r),
            "fused": r.fused, "losses": r.losses[:5], "device": r.device["name"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--preset", default="1.5b" if cuda else "tiny")
    p.add_argument("--micro_batch", type=int, default=8 if cuda else 2)
    p.add_argument("--steps", type=int, default=14 if cuda else 6)
    p.add_argument("--warmup_steps", type=int, default=5 if cuda else 2)
    p.add_argument("--zero_profile", default="original", help="DeepSpeed config profile (default: the naive one)")
    p.add_argument("--configs", default=None, help="comma-separated subset of the configurations")
    p.add_argument("--mb_sweep", default="12,16,24" if cuda else "", help="micro-batches above --micro_batch to "
                   "try without activation checkpointing, for naive and all ('' to skip)")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default="reports/ablation")
    ns = p.parse_args(argv)
    all_configs = configurations(cuda)
    names = list(all_configs) if ns.configs is None else [c.strip() for c in ns.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in all_configs]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(all_configs)}")
    try:
        sweep = [int(x) for x in ns.mb_sweep.split(",") if x.strip()]
        base = TrainConfig(preset=ns.preset, stage=3, precision="bf16" if cuda else "fp32",
                           micro_batch=ns.micro_batch, steps=ns.steps, warmup_steps=ns.warmup_steps,
                           zero_profile=ns.zero_profile, log_every=max(ns.steps // 2, 1))
    except ValueError as e:
        p.error(str(e))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    parallel = cuda and torch.cuda.device_count() >= 2
    gpus = {"deepspeed": 0, "lightning": 1} if parallel else dict.fromkeys(PATHS, 0 if cuda else None)
    t0 = time.perf_counter()
    rows, sweeps = [], {}

    def write() -> dict:  # after every configuration: a run cut short keeps what it measured
        report = {
            "command": " ".join(["python", "benchmarks/ablation.py", *(argv if argv is not None else sys.argv[1:])]),
            "versions": versions(),
            "device": rows[0].get("device") if rows else None,
            "parallel_paths": parallel,
            "base": dataclasses.asdict(base),
            "rows": rows,
            "mb_sweep": sweeps,
            "largest_micro_batch_without_checkpointing": {
                n: max([ns.micro_batch] + [r["micro_batch"] for r in rs if r["ok"]]) for n, rs in sweeps.items()},
            "wall_s": time.perf_counter() - t0,
        }
        (out / "ablation.json").write_text(json.dumps(report, indent=2))
        (out / "ablation.md").write_text(table(report))
        return report

    with ThreadPoolExecutor(max_workers=2 if parallel else 1) as pool:
        for name in names:
            print(f"== {name} {all_configs[name]}", flush=True)
            jobs = [pool.submit(run_one, base, name, all_configs[name], path, out, gpus[path], ns.timeout)
                    for path in PATHS]
            rows += [j.result() for j in jobs]
            write()
        # the largest micro-batch without activation checkpointing: raw path, naive on GPU 0 and all on GPU 1
        def largest(name: str, gpu: int | None) -> list[dict]:
            found = []
            for mb in sweep:
                row = run_one(dataclasses.replace(base, micro_batch=mb), name, all_configs[name], "deepspeed",
                              out / f"mb{mb}", gpu, ns.timeout)
                found.append(row)
                if not row["ok"]:
                    break
            return found

        if sweep:
            jobs = {n: pool.submit(largest, n, (i if parallel else gpus["deepspeed"]))
                    for i, n in enumerate(("naive", "all")) if n in names}
            sweeps.update({n: j.result() for n, j in jobs.items()})
    report = write()
    print(table(report))
    return report


def table(report: dict) -> str:
    by = {(r["config"], r["path"]): r for r in report["rows"]}
    naive = {p: by.get(("naive", p), {}).get("tflops_per_gpu") for p in PATHS}
    lines = ["| configuration | raw TFLOPs/GPU | vs naive | raw peak GiB | Lightning TFLOPs/GPU | vs naive | "
             "Lightning peak GiB | Lightning/raw |", "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["config"] for r in report["rows"]):
        cells = []
        for p in PATHS:
            r = by.get((name, p), {})
            if not r.get("ok"):
                cells += ["failed: " + ("out of memory" if r.get("oom") else r.get("error", "?")[:60]), "", ""]
                continue
            rel = f"{r['tflops_per_gpu'] / naive[p]:.3f}" if naive[p] else ""
            spread = f" [{r['step_time_s']['min'] * 1e3:.0f}-{r['step_time_s']['max'] * 1e3:.0f} ms]"
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "n/a"
            cells += [f"{_fmt(r['tflops_per_gpu'])}{spread}", rel, mem]
        ds, pl = by.get((name, "deepspeed"), {}), by.get((name, "lightning"), {})
        ratio = f"{pl['tflops_per_gpu'] / ds['tflops_per_gpu']:.3f}" if ds.get("ok") and pl.get("ok") else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    for name, mb in report["largest_micro_batch_without_checkpointing"].items():
        tried = ", ".join(f"{r['micro_batch']}: " + (_fmt(r["tflops_per_gpu"]) if r["ok"] else
                                                      "OOM" if r.get("oom") else "failed")
                          for r in report["mb_sweep"][name])
        lines.append(f"\nLargest micro-batch without activation checkpointing, {name}: {mb} (raw; tried {tried})")
    return "\n".join(lines) + "\n"


def _fmt(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


if __name__ == "__main__":
    main()
