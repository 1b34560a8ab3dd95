"""A residual branch's tail, forward and forward + backward, two ways: inductor's dropout mask or the Triton kernel's.

    python benchmarks/residual_dropout.py --out residual_dropout.json     # the 1.5b model's shape, micro-batch 16
    python benchmarks/residual_dropout.py --rows 256 --cols 384 --rounds 1   # a small shape, runs on a CPU too

The tail as the DeepCompile'd model runs it: h = residual + dropout(x + b), then the next LayerNorm of h, one
compiled function (x the projection's output, rows = micro-batch x sequence, cols = hidden). `inductor` is
shared.model.fused_ops.bias_dropout_add: inductor generates one kernel that draws the mask (one Philox call per
element), adds, normalises and writes h, the LayerNorm's output and the 1-byte mask. `triton_mask` is
fused_ops.bias_dropout_add_triton (`--triton_dropout`): the mask from shared/kernels/dropout_mask.py (eight draws per
Philox call; on a CPU only under TRITON_INTERPRET=1, else it is left out and the JSON says why), read by the same
generated kernel. `mask_kernel` times that kernel alone. Both compiled as the model compiles them
(`--coordinate_descent_tuning` as compare.py's GPU default sets it; at the 1.5b shape on an H200 that tuning made
inductor's variant take 152.5 s to compile and check: give the call that time, keep TORCHINDUCTOR_CACHE_DIR between
calls, or pass `--coordinate_descent_tuning false` for a first look).

Timing: as benchmarks/mlp_tail.py (do_bench medians on a GPU, the variants alternated `--rounds` times, the order
reversed every other round). The masks of the two ways are different draws, so correctness is checked per way: the
rate kept (within 5 sigma of 1 - p), h equal to residual + (x + b) / (1 - p) where kept and to the residual where
dropped, against float32 (`errors.h` the max absolute error; the check takes |x| + 1 for x, so that a kept element
always moves h off the residual), and the LayerNorm against float32 of that h.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run by path: the repo root, not benchmarks/, on sys.path for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.mlp_tail import check_sizes, setup, time_alternated, timing_parser, write_result
from shared.kernels import dropout_mask
from shared.model import fused_ops
from shared.train.results import device_info, versions

VARIANTS = {"inductor": fused_ops.bias_dropout_add, "triton_mask": fused_ops.bias_dropout_add_triton}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = timing_parser(__doc__, 2304, "the hidden size (1.5b)")
    p.add_argument("--p", type=float, default=0.1, help="the dropout rate (the presets' 0.1)")
    args = check_sizes(p, p.parse_args(argv))
    if not 0.0 < args.p < 1.0:
        p.error(f"--p must be in (0, 1), got {args.p}")
    return args


def residual_tail(dropout_add, p: float):
    """(h, layer_norm(h)) with h = residual + dropout(x + b), compiled whole as the model is."""

    @torch.compile(dynamic=False)
    def tail(x, b, r, w, lb):
        h = dropout_add(x, b, r, p, True)
        return h, F.layer_norm(h, (h.shape[-1],), w, lb)

    return tail


def errors(tail, p: float, x, b, r, w, lb) -> dict[str, float]:
    """The kept rate and the max abs errors of h and of the LayerNorm against float32, given the mask h shows: x is
    taken as |x| + 1, so that x + b >= 0.5 (|b| < 0.5) and a kept element moves h off the residual even in bf16."""
    x = x.detach().abs() + 1
    if b.detach().abs().max().item() >= 0.5:
        raise ValueError("errors() reads the mask off h, which needs |b| < 0.5")
    h, y = tail(x, b.detach(), r.detach(), w.detach(), lb.detach())
    hf, rf = h.float(), r.float()
    kept = hf != rf
    scale = 1.0 / (1.0 - p)
    ref = torch.where(kept, rf + (x.float() + b.float()) * scale, rf)
    n = kept.numel()
    rate = kept.float().mean().item()
    if abs(rate - (1 - p)) > 5 * (p * (1 - p) / n) ** 0.5:
        raise RuntimeError(f"kept {rate:.5f} of the elements, expected {1 - p:.5f} within 5 sigma")
    yf = F.layer_norm(hf, (hf.shape[-1],), w.float(), lb.float())
    return {"kept_rate": rate, "h": (hf - ref).abs().max().item(), "layer_norm": (y.float() - yf).abs().max().item()}


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    device, dtype, gen, tuning = setup(args)
    new = lambda *shape, s=1.0: (s * torch.randn(*shape, device=device, generator=gen)).to(dtype).requires_grad_()
    x, r, b = new(args.rows, args.cols), new(args.rows, args.cols), new(args.cols, s=0.1)
    w, lb = new(args.cols, s=0.1), new(args.cols, s=0.1)
    gh = torch.randn(args.rows, args.cols, device=device, generator=gen).to(dtype)
    gy = torch.randn(args.rows, args.cols, device=device, generator=gen).to(dtype)

    result: dict = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                    "versions": versions(), "device": device_info(device),
                    "shape": {"rows": args.rows, "cols": args.cols, "dtype": args.dtype, "p": args.p,
                              "applied_p_triton_mask": dropout_mask.applied_rate(args.p)},
                    "coordinate_descent_tuning": tuning,
                    "timing": "triton.testing.do_bench median" if device.type == "cuda" else "perf_counter mean (CPU)",
                    "variants": {}, "left_out": {}}
    variants = dict(VARIANTS)
    if device.type != "cuda" and not dropout_mask.interpreted():
        del variants["triton_mask"]
        result["left_out"]["triton_mask"] = "its Triton kernel runs on a CPU only under TRITON_INTERPRET=1"
    tails = {name: residual_tail(fn, args.p) for name, fn in variants.items()}
    for name, tail in tails.items():
        t0 = time.perf_counter()
        p = dropout_mask.applied_rate(args.p) if name == "triton_mask" else args.p
        err = errors(tail, p, x, b, r, w, lb)
        torch.autograd.grad(tail(x, b, r, w, lb), (x, b, r, w, lb), (gh, gy))  # compile the backward too
        took = round(time.perf_counter() - t0, 1)
        result["variants"][f"{name}_forward"] = {"errors": err, "ms": [], "compile_and_check_s": took}
        result["variants"][f"{name}_forward_backward"] = {"ms": []}  # the errors: under {name}_forward
        print(f"{name}: compiled and checked in {took} s, errors {err}", flush=True)
    steps = {}
    for name, tail in tails.items():
        steps[f"{name}_forward"] = lambda tail=tail: tail(x, b, r, w, lb)
        steps[f"{name}_forward_backward"] = (
            lambda tail=tail: torch.autograd.grad(tail(x, b, r, w, lb), (x, b, r, w, lb), (gh, gy)))
    if "triton_mask" in variants:
        seed = torch.tensor([1], device=device)
        result["variants"]["mask_kernel"] = {"ms": []}
        steps["mask_kernel"] = lambda: dropout_mask.dropout_keep_mask(x, args.p, seed)
    # each way against inductor's same part; the mask kernel against inductor's whole forward
    against = {name: "inductor_" + name.removeprefix("triton_mask_").removeprefix("inductor_")
               for name in steps if name != "mask_kernel"}
    time_alternated(result, steps, args, device, against)
    n = args.rows * args.cols
    result["mask_bytes_gb"] = round(n / 1e9, 3)  # the mask kernel's whole traffic: one byte written per element
    # the forward's floor: x and the residual read, h and the LayerNorm's output written, one mask byte per element
    result["forward_bytes_floor_gb"] = round((4 * x.element_size() + 1) * n / 1e9, 3)
    return write_result(result, args.out)


if __name__ == "__main__":
    main()
