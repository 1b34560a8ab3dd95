"""Where attention dropout's time goes, kernel by kernel: the block-sparse kernel's mask drawn in each kernel or
read from bits, against no dropout and against SDPA (cuDNN) with and without it.

    python benchmarks/attention_dropout.py --out reports/attention_dropout.json   # ~3 min, H200

At the 1.5b model's attention (B 16, 24 heads, head dim 96, seq 2048, causal layout, bf16, q/k/v as the model's views
of one (B, T, 3C) projection), each of the block-sparse kernels (shared/kernels/blocksparse_attention.py) runs alone,
autotuned as in training, in three modes: no dropout (`none`), the mask drawn by Philox inside each kernel
(`philox`, the default) and the mask drawn once by its own kernel, packed eight scores to a byte and read by the
three kernels (`bits`; the `mask_bits` row is that kernel). SDPA pinned to cuDNN gives the forward and the forward +
backward with and without dropout. Every time is a triton.testing.do_bench median (L2 flushed between runs); the
rounds run every row once each, in turn, after the autotuner's first calls, so a ratio of two rows compares times
measured side by side. `sums` adds each mode's kernels (with `mask_bits` for bits) per round: [min, max] over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

if __package__ in (None, ""):  # run by path: the repo root, not benchmarks/, on sys.path for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_tiles import add_shape_args, check_shape_args, make_inputs
from shared.kernels import blocksparse_attention as bsa
from shared.model import layouts
from shared.train.results import device_info, versions, write_json

MODES = ("none", "philox", "bits")


def kernel_calls(args, q, k, v, do) -> dict:
    """name -> a no-argument call of one kernel launch (its inputs made once, by the kernels before it). q, k, v
    require gradients (SDPA's backward); the block-sparse kernels are launched on detached views of them."""
    qg, kg, vg = q, k, v
    q, k, v = (t.detach() for t in (q, k, v))
    lut = bsa.BlockLUT.from_layout(layouts.causal(args.seq // args.block), args.block).to("cuda")
    p, seed = bsa.applied_dropout(args.dropout), torch.tensor(1234, device="cuda")  # on the device, as the model's
    calls = {}
    for mode in MODES:
        rate = 0.0 if mode == "none" else p
        bits = bsa._dropout_bits(q, lut, rate, seed) if mode == "bits" else None
        o, lse = bsa._forward(q, k, v, lut, rate, seed, None, bits)
        _, delta = bsa._backward_dq(do, q, k, v, o, lse, lut, rate, seed, None, bits)
        calls[f"{mode}/fwd"] = lambda r=rate, b=bits: bsa._forward(q, k, v, lut, r, seed, None, b)
        calls[f"{mode}/dq"] = lambda r=rate, b=bits, o=o, lse=lse: bsa._backward_dq(do, q, k, v, o, lse, lut, r, seed,
                                                                                   None, b)
        calls[f"{mode}/dkdv"] = lambda r=rate, b=bits, lse=lse, d=delta: bsa._backward_dkdv(
            do, q, k, v, lse, d, lut, r, seed, None, bits=b)
        if mode == "bits":
            calls["bits/mask_bits"] = lambda: bsa._dropout_bits(q, lut, p, seed)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    for mode, rate in (("sdpa_none", 0.0), ("sdpa_dropout", args.dropout)):
        def fwd(r=rate):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return f(qg, kg, vg, is_causal=True, dropout_p=r)
        calls[f"{mode}/fwd"] = fwd
        calls[f"{mode}/fwd_bwd"] = lambda fwd=fwd: torch.autograd.grad(fwd(), (qg, kg, vg), do)
    return calls


def summarize(times: dict[str, list[float]]) -> tuple[dict, dict]:
    """Per mode the sum of its kernels in each round (median, [min, max]); SDPA's forward + backward as measured;
    ratios a_vs_b = b's median / a's (> 1: a is faster)."""
    rounds = len(next(iter(times.values())))
    sums = {}
    for mode in MODES:
        parts = [n for n in times if n.startswith(f"{mode}/")]
        per_round = [sum(times[n][r] for n in parts) for r in range(rounds)]
        sums[mode] = {"median_ms": statistics.median(per_round), "range_ms": [min(per_round), max(per_round)],
                      "kernels": parts}
    for mode in ("sdpa_none", "sdpa_dropout"):
        t = times[f"{mode}/fwd_bwd"]
        sums[mode] = {"median_ms": statistics.median(t), "range_ms": [min(t), max(t)]}
    ratios = {f"{a}_vs_{b}": sums[b]["median_ms"] / sums[a]["median_ms"]
              for a, b in (("bits", "philox"), ("bits", "sdpa_dropout"), ("philox", "sdpa_dropout"),
                           ("none", "sdpa_none"))}
    return sums, ratios


def main(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_dropout.py needs a CUDA GPU")
    started = time.time()
    q, k, v, do = make_inputs(argparse.Namespace(**vars(args), inputs="model"))
    calls = kernel_calls(args, q, k, v, do)
    for call in calls.values():  # the autotuner's trials and the compiles, before any timing
        call()
    torch.cuda.synchronize()
    times = {name: [] for name in calls}
    for r in range(args.rounds):
        for name, call in calls.items():
            times[name].append(triton.testing.do_bench(call, warmup=args.warmup, rep=args.rep, return_mode="median"))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.3f}" for n, t in times.items()), flush=True)
    sums, ratios = summarize(times)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": versions(), "device": device_info(),
        "settings": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "seq": args.seq,
                     "block": args.block, "layout": "causal", "dropout": args.dropout,
                     "applied_dropout": bsa.applied_dropout(args.dropout), "dtype": "bf16",
                     "inputs": "the model's views of one (B, T, 3C) projection", "rounds": args.rounds,
                     "warmup_ms": args.warmup, "rep_ms": args.rep,
                     "timing": "triton.testing.do_bench median per row, rows in turn each round"},
        "ms": {n: {"median": statistics.median(t), "rounds": t} for n, t in times.items()},
        "sums": sums,
        "ratios": ratios,
        "blocksparse_autotune": bsa.chosen_configs(),
        "mask_bits_mib": args.batch * args.heads * args.seq * args.seq / 8 / 2**20,
        "wall_s": time.time() - started,
    }
    for mode, s in sums.items():
        print(f"{mode:13} {s['median_ms']:.3f} ms [{s['range_ms'][0]:.3f}, {s['range_ms'][1]:.3f}]")
    print(", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    if args.out:
        write_json(args.out, result, default=str)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/attention_dropout.json")
    add_shape_args(p)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    args = p.parse_args(argv)
    check_shape_args(p, args)
    if not 0.0 < args.dropout < 1.0:
        p.error(f"--dropout must be in (0, 1), got {args.dropout}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


if __name__ == "__main__":
    main(parse_args())
