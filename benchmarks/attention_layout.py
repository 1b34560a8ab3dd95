"""Does the memory layout of q, k, v and the output's gradient change SDPA's speed at the 1.5b model's shape?

    python benchmarks/attention_layout.py --out reports/attention_layout.json   # ~1 min on an H200

benchmarks/attention.py times attention on contiguous (B, H, T, D) tensors. The model (shared/model/gpt.py) hands
SDPA views instead: q, k, v split from one (B, T, 3C) matmul output and transposed to (B, H, T, D), and the output's
gradient arrives as a transposed view of a (B, T, C) tensor. In a profiled training step the cuDNN kernels took
longer than in that benchmark; this one times the same kernels on each layout, interleaved:

  - `bhtd`: contiguous (B, H, T, D) q, k, v and output gradient (benchmarks/attention.py's inputs);
  - `qkv_split`: the model's views (strides (T*3C, D, 3C, 1)), the gradient a view of (B, T, C);
  - `bthd`: q, k, v each its own (B, T, H, D) tensor, transposed, the gradient as in `qkv_split`.

Each (layout, backend, dropout) runs forward alone and forward + backward (torch.autograd.grad of the output with
respect to q, k, v; no accumulation kernels), timed by triton.testing.do_bench (warm-up, L2 flushed, median) in
`--rounds` interleaved rounds; the JSON keeps every round's time, the median and [min, max], each layout's ratio to
`bhtd` within the same round, and the names of the attention kernels one profiled call ran (cuDNN picks its engine
per layout). FLOPs (dense-causal-equivalent, as in benchmarks/attention.py): forward + backward 3.5 x 2*B*H*T^2*D.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from shared.train.cli import check_out_flag
from shared.train.results import device_info, versions, write_json

LAYOUTS = ("bhtd", "qkv_split", "bthd")
BACKENDS = {"sdpa": None, "sdpa:cudnn": "CUDNN_ATTENTION", "sdpa:flash": "FLASH_ATTENTION"}


def make_inputs(layout: str, B: int, H: int, T: int, D: int, seed: int, device: str = "cuda"):
    """q, k, v (leaves or views of a leaf, requiring grad) and the output's gradient, in `layout`."""
    g = torch.Generator(device=device).manual_seed(seed)
    C = H * D

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)

    if layout == "bhtd":
        q, k, v = (randn(B, H, T, D).requires_grad_() for _ in range(3))
        return q, k, v, randn(B, H, T, D)
    do = randn(B, T, C).view(B, T, H, D).transpose(1, 2)
    if layout == "qkv_split":
        qkv = randn(B, T, 3 * C).requires_grad_()
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))
        return q, k, v, do
    if layout == "bthd":
        q, k, v = (randn(B, T, H, D).requires_grad_() for _ in range(3))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), do
    raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")


def attention(backend: str, dropout: float):
    pinned = BACKENDS[backend]

    def fn(q, k, v):
        if pinned is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, pinned)):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)

    return fn


def calls(attn, sets):
    """Forward alone and forward + backward, each call on the next input set."""
    i = itertools.count()

    def fwd():
        q, k, v, _ = sets[next(i) % len(sets)]
        with torch.no_grad():
            return attn(q, k, v)

    def fwd_bwd():
        q, k, v, do = sets[next(i) % len(sets)]
        return torch.autograd.grad(attn(q, k, v), (q, k, v), do)

    return fwd, fwd_bwd


def bench(fn, args) -> float:
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def kernels_of(fn) -> list[str]:
    """The CUDA kernels one call of fn runs, names only, in order, without torch's own elementwise kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return [n for n in names if "at::native" not in n and "Memcpy" not in n and "Memset" not in n]


def main(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_layout.py needs a CUDA GPU")
    B, H, T, D = args.batch, args.heads, args.seq, args.head_dim
    started = time.time()
    inputs = {lay: [make_inputs(lay, B, H, T, D, seed) for seed in range(3)] for lay in LAYOUTS}
    cases = [(lay, be, p) for p in args.dropouts for be in args.backends for lay in LAYOUTS]
    times = {c: {"fwd_ms": [], "fwd_bwd_ms": []} for c in cases}
    kernels, errors = {}, {}
    for r in range(args.rounds):
        for case in cases:
            lay, be, p = case
            if case in errors:
                continue
            fwd, fwd_bwd = calls(attention(be, p), inputs[lay])
            try:
                if r == 0:
                    fwd_bwd()
                    try:
                        kernels["|".join(map(str, case))] = kernels_of(fwd_bwd)
                    except Exception as exc:  # the names are a note; the times are the result
                        kernels["|".join(map(str, case))] = [f"profiler failed: {type(exc).__name__}: {exc}"]
                times[case]["fwd_ms"].append(bench(fwd, args))
                times[case]["fwd_bwd_ms"].append(bench(fwd_bwd, args))
            except RuntimeError as exc:  # a pinned kernel that does not take this layout: recorded, not timed
                errors[case] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"[{time.time() - started:6.1f}s] round {r + 1}/{args.rounds}", flush=True)
    flops = 3.5 * 2 * B * H * T * T * D
    rows = []
    for lay, be, p in cases:
        case = (lay, be, p)
        row = {"layout": lay, "backend": be, "dropout": p}
        if case in errors:
            rows.append({**row, "status": "error", "error": errors[case]})
            continue
        t = times[case]
        base = times[("bhtd", be, p)]["fwd_bwd_ms"] if ("bhtd", be, p) not in errors else None
        row.update(status="ok", fwd_ms=statistics.median(t["fwd_ms"]), fwd_bwd_ms=statistics.median(t["fwd_bwd_ms"]),
                   fwd_bwd_range_ms=[min(t["fwd_bwd_ms"]), max(t["fwd_bwd_ms"])], rounds=t,
                   tflops_dense_causal_equiv=flops / (statistics.median(t["fwd_bwd_ms"]) * 1e-3) / 1e12)
        if base:  # per round, so the GPU's clock drift between rounds divides out
            ratios = [a / b for a, b in zip(t["fwd_bwd_ms"], base)]
            row.update(fwd_bwd_vs_bhtd=statistics.median(ratios), fwd_bwd_vs_bhtd_range=[min(ratios), max(ratios)])
        rows.append(row)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": versions(),
        "device": device_info(torch.device("cuda")),
        "settings": {"batch": B, "heads": H, "seq": T, "head_dim": D, "dtype": "bf16", "causal": True,
                     "dropouts": args.dropouts, "backends": args.backends, "rounds": args.rounds,
                     "warmup_ms": args.warmup, "rep_ms": args.rep, "input_sets": 3,
                     "timing": "triton.testing.do_bench median per round (L2 flushed); rows: median over rounds"},
        "flops_convention": "dense-causal-equivalent: 3.5 * 2*B*H*T^2*D per forward + backward",
        "rows": rows,
        "kernels": kernels,
        "wall_s": time.time() - started,
    }
    print(f"{'layout':10} {'backend':11} {'p':>4} {'fwd ms':>8} {'fwd+bwd ms':>11} {'[min, max]':>16} {'vs bhtd':>8}")
    for row in rows:
        if row["status"] != "ok":
            print(f"{row['layout']:10} {row['backend']:11} {row['dropout']:4} {row['error'][:80]}")
            continue
        lo, hi = row["fwd_bwd_range_ms"]
        print(f"{row['layout']:10} {row['backend']:11} {row['dropout']:4} {row['fwd_ms']:8.3f} "
              f"{row['fwd_bwd_ms']:11.3f} [{lo:6.3f}, {hi:6.3f}] {row.get('fwd_bwd_vs_bhtd', float('nan')):8.3f}")
    if args.out:
        write_json(args.out, result)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/attention_layout.json", help="where to write the JSON result")
    p.add_argument("--batch", type=int, default=16, help="the GPU default's micro-batch")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", "--head_dim", dest="head_dim", type=int, default=96)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--backends", nargs="+", default=["sdpa"], choices=sorted(BACKENDS),
                   help="sdpa: the dispatcher's pick; sdpa:cudnn / sdpa:flash: that fused kernel pinned")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds over every (layout, backend, dropout)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    args = p.parse_args(argv)
    if bad := [d for d in args.dropouts if not 0.0 <= d < 1.0]:
        p.error(f"every --dropouts value must be in [0, 1), got {bad}")
    if args.rounds < 1 or min(args.batch, args.heads, args.seq, args.head_dim) < 1:
        p.error("--rounds, --batch, --heads, --seq and --head_dim must be positive")
    check_out_flag(p, args.out)  # a folder or an unwritable path: refused before it measures
    return args


if __name__ == "__main__":
    main(parse_args())
