"""The MLP's bias + GELU tail, forward + backward, two ways: inductor's kernels, or the whole backward as one Triton
kernel.

    python benchmarks/mlp_tail.py --out mlp_tail.json            # the 1.5b model's shape, micro-batch 16 (a GPU)
    python benchmarks/mlp_tail.py --rows 256 --cols 384 --rounds 1   # a small shape, runs on a CPU too

gelu(x + b) (tanh approximation), x the up projection's output (rows = micro-batch x sequence, cols = 4 x hidden),
b its bias. `inductor` is shared.model.fused_ops.bias_gelu: inductor generates the forward as one kernel and, in
backward, the GELU gradient and the bias gradient (its sum over every row) as one reduction kernel. `triton_grad` is
fused_ops.bias_gelu_triton_grad: the same forward, the GELU gradient and the bias gradient's partial sums in one
pass of a Triton kernel (shared/kernels/bias_gelu_grad.py; on a CPU only under TRITON_INTERPRET=1, else it is left
out and the JSON says why). Both are torch.compile'd as the model compiles them (`--coordinate_descent_tuning` as
compare.py's GPU default sets it).

Timing: triton.testing.do_bench medians of forward + backward (torch.autograd.grad of the output for x and b with a
fixed output gradient), the variants alternated `--rounds` times; each variant is compiled and checked before
any timing. Correctness: each variant's output, dx and db against the same computation in float32 eager PyTorch,
the max absolute error (db's relative to its largest entry).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.kernels import bias_gelu_grad
from shared.model import fused_ops
from shared.train.cli import _parse_bool, check_out_flag
from shared.train.results import device_info, versions

VARIANTS = {"inductor": fused_ops.bias_gelu, "triton_grad": fused_ops.bias_gelu_triton_grad}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = timing_parser(__doc__, 4 * 2304, "the MLP's width (4 x hidden at 1.5b)")
    return check_sizes(p, p.parse_args(argv))


def timing_parser(doc: str, cols: int, cols_help: str) -> argparse.ArgumentParser:
    """The flags of a (rows, cols) elementwise benchmark: its shape and dtype, the timing and the JSON's path."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16 * 2048, help="micro-batch x sequence (1.5b, micro-batch 16)")
    p.add_argument("--cols", type=int, default=cols, help=cols_help)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--rounds", type=int, default=3, help="times each variant is timed, alternated")
    p.add_argument("--coordinate_descent_tuning", type=_parse_bool, default=True,
                   help="inductor's coordinate-descent tuning while compiling (true/false; CUDA only)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    return p


def check_sizes(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    for name in ("rows", "cols", "rounds", "warmup", "rep"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    check_out_flag(p, args.out)  # a folder or an unwritable path: refused before it measures
    return args


def errors(fn, x: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> dict[str, float]:
    """Max abs error of fn's output, dx and db (db relative to its largest entry) against float32 eager."""
    y = fn(x, b)
    dx, db = torch.autograd.grad(y, (x, b), g)
    xf, bf = x.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    yf = F.gelu(xf + bf, approximate="tanh")
    dxf, dbf = torch.autograd.grad(yf, (xf, bf), g.float())
    return {"out": (y.float() - yf).abs().max().item(), "dx": (dx.float() - dxf).abs().max().item(),
            "db_relative": ((db.float() - dbf).abs().max() / dbf.abs().max()).item()}


def timer(device: torch.device):
    if device.type == "cuda":
        import triton

        return lambda f, a: triton.testing.do_bench(f, warmup=a.warmup, rep=a.rep, return_mode="median")

    def cpu_time(f, a) -> float:
        f()
        t0, n = time.perf_counter(), 0
        while n < 3 or time.perf_counter() - t0 < a.rep / 1000:
            f()
            n += 1
        return (time.perf_counter() - t0) / n * 1000
    return cpu_time


def setup(args) -> tuple[torch.device, torch.dtype, torch.Generator, bool]:
    """This machine's device, the dtype asked for, a seeded generator on the device, and whether inductor's
    coordinate-descent tuning is on (asked for, and a GPU: it tunes Triton kernels only)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = bool(args.coordinate_descent_tuning and device.type == "cuda")
    return device, dtype, torch.Generator(device=device).manual_seed(0), inductor_config.coordinate_descent_tuning


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    device, dtype, gen, tuning = setup(args)
    x = torch.randn(args.rows, args.cols, device=device, dtype=dtype, generator=gen).requires_grad_()
    b = (0.1 * torch.randn(args.cols, device=device, dtype=dtype, generator=gen)).requires_grad_()
    g = torch.randn(args.rows, args.cols, device=device, dtype=dtype, generator=gen)

    result: dict = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                    "versions": versions(), "device": device_info(device),
                    "shape": {"rows": args.rows, "cols": args.cols, "dtype": args.dtype},
                    "coordinate_descent_tuning": tuning,
                    "timing": "triton.testing.do_bench median, forward + backward" if device.type == "cuda"
                    else "perf_counter mean, forward + backward (CPU)", "variants": {}, "left_out": {}}
    variants = dict(VARIANTS)
    if device.type != "cuda" and not bias_gelu_grad.interpreted():
        del variants["triton_grad"]
        result["left_out"]["triton_grad"] = "its Triton kernel runs on a CPU only under TRITON_INTERPRET=1"
    for name, fn in variants.items():
        t0 = time.perf_counter()
        err = errors(fn, x, b, g)
        result["variants"][name] = {"errors": err, "compile_and_check_s": round(time.perf_counter() - t0, 1),
                                    "ms": []}
        print(f"{name}: compiled and checked in {time.perf_counter() - t0:.1f} s, errors {err}", flush=True)

    time_alternated(result, {name: (lambda fn=fn: torch.autograd.grad(fn(x, b), (x, b), g))
                             for name, fn in variants.items()}, args, device)
    for v in result["variants"].values():
        v["backward_bytes_floor_gb"] = round(3 * args.rows * args.cols * x.element_size() / 1e9, 3)  # x, dy; dx
    return write_result(result, args.out)


def time_alternated(result: dict, steps: dict, args, device: torch.device, against: dict | None = None) -> None:
    """Time each variant's zero-argument step `args.rounds` times (do_bench with args.warmup / args.rep on a GPU),
    the order reversed every other round; result["variants"][name] gets the times, their median and range, and the
    per-round speedup against the first variant, or against the variant `against` names for it."""
    time_ms = timer(device)
    order = list(steps)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            ms = time_ms(steps[name], args)
            result["variants"][name]["ms"].append(round(ms, 4))
            print(f"round {r + 1} {name}: {ms:.4f} ms", flush=True)
    for name, v in result["variants"].items():
        base = (against or {}).get(name, order[0])
        v["median_ms"] = statistics.median(v["ms"])
        v["min_ms"], v["max_ms"] = min(v["ms"]), max(v["ms"])
        v[f"speedup_vs_{base}_per_round"] = [round(bi / mi, 4)
                                             for bi, mi in zip(result["variants"][base]["ms"], v["ms"])]


def write_result(result: dict, out: Path | None) -> dict:
    """Print each variant's median and per-round speedups; write the JSON to `out` if given."""
    speedup = lambda v: next(x for k, x in v.items() if k.startswith("speedup_vs_"))
    print(json.dumps({k: {"median_ms": v["median_ms"], "per_round_speedup": speedup(v)}
                      for k, v in result["variants"].items()}))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
