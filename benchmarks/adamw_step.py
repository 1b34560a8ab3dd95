"""The optimizer step of one ZeRO-3 sub-group, alone: `--zero3_step fast`'s three passes against the fused kernel.

    python benchmarks/adamw_step.py --out adamw_step.json                      # 1.65B elements: the 1.5b preset
    python benchmarks/adamw_step.py --numel 100000 --out adamw_step.json       # CPU: TRITON_INTERPRET=1

On flat buffers of `--numel` elements (fp32 parameters and moments, a bf16 gradient and bf16 parameter copy, as
ZeRO-3 keeps a sub-group's partition), alternated `--repeats` times, each timed between device synchronizations:
- fast: what shared/patches/zero3_step.py's fast step runs: the bf16 gradient cast to an fp32 copy, torch's fused
  AdamW with the clip/loss-scale factor as its grad_scale, the fp32 parameters copied into the bf16 ones;
- fused: shared/kernels/adamw.adamw_step, the three in one kernel (`--zero3_step fused`).
Writes the times (ms), their median and [min, max], the ratio of the medians, each mode's bytes moved per element
and effective bandwidth, and how far apart the two modes' parameters ended, with the command, versions and device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from shared.kernels.adamw import adamw_step, interpreted
from shared.train.cli import check_out_flag
from shared.train.results import device_info, versions

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# bytes an element: fast = cast (read bf16 2, write fp32 4) + AdamW (read p, g, m, v 16, write p, m, v 12) + copy
# (read fp32 4, write bf16 2); fused = read p, m, v 12 and the bf16 gradient 2, write p, m, v 12 and the bf16 copy 2
BYTES = {"fast": 6 + 28 + 6, "fused": 14 + 14}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1_650_000_000, help="elements of the sub-group (default: the 1.5b "
                   "preset's 1.65B parameters on one GPU)")
    p.add_argument("--repeats", type=int, default=5, help="times each mode runs, alternated (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each mode first (default 2)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    if args.numel < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--numel and --repeats must be >= 1, --warmup >= 0")
    if not torch.cuda.is_available() and not interpreted():  # refused before the buffers and the fast mode's steps
        p.error("the fused mode's Triton kernel needs a CUDA GPU, or on a CPU TRITON_INTERPRET=1 (set before triton "
                "is imported) to run it in Triton's interpreter")
    check_out_flag(p, args.out)  # a folder or an unwritable path: refused before it measures
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = args.numel
    gen = torch.Generator(device=device).manual_seed(0)
    param = torch.randn(n, device=device, generator=gen) * 0.02
    grad = (torch.randn(n, device=device, generator=gen) * 1e-3).bfloat16()
    lp = param.bfloat16()
    scale = torch.tensor(1.0, device=device)  # the combined clip/loss scale, 1 when the norm is under the clip
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step = torch.zeros((), device=device)
    fp32_param = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([fp32_param], fused=True, **HYPER)

    def fast():
        fp32_param.grad = grad.to(torch.float32, copy=True)
        opt.grad_scale = scale
        opt.step()
        del opt.grad_scale
        lp.copy_(fp32_param.detach())
        fp32_param.grad = None

    def fused():
        step.add_(1)
        adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr=HYPER["lr"], beta1=HYPER["betas"][0],
                   beta2=HYPER["betas"][1], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], grad_scale=scale,
                   param_lp=lp)

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    modes = {"fast": fast, "fused": fused}
    for _ in range(args.warmup):
        for fn in modes.values():
            timed(fn)
    ms = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, fn in modes.items():
            ms[name].append(timed(fn))
    summary = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v,
                      "bytes_per_element": BYTES[name],
                      "effective_TBps": BYTES[name] * n / (statistics.median(v) / 1e3) / 1e12}
               for name, v in ms.items()}
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "numel": n,
              "repeats": args.repeats, "device": device_info(device), "versions": versions(), "ms": summary,
              "fused_over_fast": summary["fused"]["median"] / summary["fast"]["median"],
              # both modes took the same steps from the same start: their fp32 parameters agree up to rounding
              "max_abs_param_difference": float((param - fp32_param.detach()).abs().max()),
              "max_abs_param": float(param.abs().max())}
    print(f"{n:,} elements: fast {summary['fast']['median']:.2f} ms [{summary['fast']['min']:.2f}, "
          f"{summary['fast']['max']:.2f}], fused {summary['fused']['median']:.2f} ms [{summary['fused']['min']:.2f}, "
          f"{summary['fused']['max']:.2f}], fused / fast {result['fused_over_fast']:.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
