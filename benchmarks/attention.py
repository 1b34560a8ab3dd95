"""Attention kernels, forward + backward, on one GPU: blocksparse (ours) vs FlexAttention vs SDPA vs xFormers.

    python benchmarks/attention.py --out benchmarks/results/attention_backends_1xh200/attention.json  # ~3 min, H200
    python benchmarks/attention.py --quick --out reports/attention_quick.json  # seq 2048 only

Shapes: B=8, H=24, D=96 (the 1.5b model's heads), bf16, block 128, seq 2048/4096/8192; layouts causal, local
(4 blocks = 512 tokens) and strided (segments of 4 blocks, the last block of each earlier segment as summary).
sdpa (dense causal) and xformers (only the causal layout is an xFormers bias) run on the causal layout only;
a backend that cannot run records its error string instead of a time.

Timing: triton.testing.do_bench (warm-up, L2 flushed between runs, median), each call on the next of three input
sets; forward + backward is out = attn(q, k, v) then torch.autograd.grad(out, (q, k, v), do) (no gradient
accumulation kernels). The first call of each (backend, seq, layout) happens in the correctness check, so
torch.compile (flex) and Triton's autotuner (blocksparse) are done before timing.

FLOPs conventions (both reported):
  - dense-causal-equivalent: forward 4*B*H*T^2*D / 2 (two T x T x D products, causal half), backward 2.5x the
    forward (QK^T recomputed, then dV, dP, dQ, dK), so forward + backward = 3.5 x 2*B*H*T^2*D. The same
    yardstick for every layout: a sparse layout's figure is what dense causal attention would need to match.
  - sparse: 3.5 x 4*B*H*T^2*D x density, density = the layout's share of the T/128 x T/128 block grid
    (shared/model/layouts.density): the block-granular work a block-sparse kernel does (diagonal blocks counted whole).
Ratios: speedup_vs_flex = flex_ms / blocksparse_ms and speedup_vs_sdpa = sdpa_ms / blocksparse_ms (> 1: ours is
faster); for sparse layouts time_vs_causal = ms(layout) / ms(causal) of the same backend, ideal_vs_causal =
nnz(layout) / nnz(causal), efficiency = ideal / actual (1.0: time scales exactly with the non-zero blocks).

Attention dropout (`--dropouts 0 0.1`, the preset's rate): every backend runs in training mode with that rate
(its masks drawn in the kernel: SDPA's fused kernels, blocksparse's Triton kernel; flex has none and records its
error). `sdpa:flash`, `sdpa:efficient`, `sdpa:cudnn` pin one of SDPA's fused kernels (torch.nn.attention.sdpa_kernel);
plain `sdpa` is what the dispatcher picks, recorded per dropout rate. `blocksparse:bits` is the block-sparse kernel
with its mask drawn once per call and read from bits by the three kernels (`dropout_mask="bits"`; the same mask).
With dropout the outputs cannot be compared with the reference (other random masks): those rows record no error
(the GPU tests check dropout's statistics).

Correctness: before timing, each backend's output and dq/dk/dv on the benchmark input are compared with the
reference (shared.model.attention.ReferenceAttention in fp32, on batch 0 and the first CHECK_HEADS heads); the max
absolute errors are recorded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

from shared.kernels import blocksparse_attention as bsa
from shared.model import layouts
from shared.model.attention import ReferenceAttention, build_attention
from shared.model.config import GPTConfig
from shared.train.cli import check_out_flag
from shared.train.results import device_info, versions

CHECK_HEADS = 4
N_INPUT_SETS = 3


SDPA_PINNED = {"sdpa:flash": "FLASH_ATTENTION", "sdpa:efficient": "EFFICIENT_ATTENTION",
               "sdpa:cudnn": "CUDNN_ATTENTION"}


def model_cfg(args, seq: int, layout: str, backend: str, dropout: float = 0.0) -> GPTConfig:
    return GPTConfig(n_head=args.heads, n_embd=args.heads * args.head_dim, seq_len=seq, sparse_block=args.block,
                     layout=layout, local_blocks=args.local_blocks, stride_blocks=args.stride_blocks,
                     attn_dropout=dropout, dropout=0.0, attention=backend.split(":")[0],
                     attn_dropout_mask="bits" if backend == "blocksparse:bits" else "philox")


class Pinned(torch.nn.Module):
    """An SDPA attention module run under one pinned fused kernel (sdpa_kernel raises if it cannot run)."""

    def __init__(self, attn, kernel: str):
        super().__init__()
        from torch.nn.attention import SDPBackend

        self.attn, self.kernel = attn, getattr(SDPBackend, kernel)
        self.backend = f"sdpa:{kernel}"

    def forward(self, q, k, v):
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.kernel):
            return self.attn(q, k, v)


def make_inputs(args, seq: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (args.batch, args.heads, seq, args.head_dim)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def fwd_bwd(attn, q, k, v, do):
    out = attn(q, k, v)
    return out, torch.autograd.grad(out, (q, k, v), do)


def max_errors(attn, ref: ReferenceAttention, q, k, v, do) -> dict[str, float]:
    out, grads = fwd_bwd(attn, q, k, v, do)
    sl = (slice(0, 1), slice(0, CHECK_HEADS))
    ref_in = [x.detach()[sl].float().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = fwd_bwd(ref, *ref_in, do[sl].float())
    errs = {"out": (out[sl].float() - ref_out).abs().max().item()}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        errs[name] = (got[sl].float() - want).abs().max().item()
    return errs


def bench(fn_of_inputs, input_sets, warmup: int, rep: int) -> float:
    cycle = itertools.cycle(input_sets)
    return triton.testing.do_bench(lambda: fn_of_inputs(*next(cycle)), warmup=warmup, rep=rep, return_mode="median")


def sdpa_choice(q, dropout: float = 0.0) -> str | None:
    """Which fused kernel PyTorch's SDPA dispatcher picks for these inputs (causal, this dropout rate)."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, q, q, dropout_p=dropout, is_causal=True)).name
    except Exception as exc:  # a private API: record why it is unknown rather than fail the benchmark
        return f"unknown ({type(exc).__name__}: {exc})"


def run_one(args, seq: int, layout_name: str, backend: str, input_sets, ref, dropout: float = 0.0) -> dict:
    cfg = model_cfg(args, seq, layout_name, backend, dropout)
    layout = layouts.make_layout(cfg)
    row = {"seq": seq, "layout": layout_name, "backend": backend, "dropout": dropout,
           "density": layouts.density(layout), "nnz_blocks": int(layout.sum()), "status": "ok"}
    try:
        attn = build_attention(cfg).cuda().train()
        if backend in SDPA_PINNED:
            attn = Pinned(attn, SDPA_PINNED[backend])
        row["backend"] = attn.backend
        if dropout == 0.0:
            row["max_abs_err"] = max_errors(attn, ref, *input_sets[0])
        else:  # other random masks than the reference's: only that it runs and stays finite
            out, grads = fwd_bwd(attn, *input_sets[0])
            if not all(bool(t.isfinite().all()) for t in (out, *grads)):
                raise FloatingPointError("non-finite output or gradient with dropout")
        row["fwd_ms"] = bench(lambda q, k, v, do: attn(q, k, v), input_sets, args.warmup, args.rep)
        row["fwd_bwd_ms"] = bench(lambda q, k, v, do: fwd_bwd(attn, q, k, v, do), input_sets, args.warmup, args.rep)
    except Exception as exc:  # recorded, not hidden: the row says which backend failed and why
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    B, H, T, D = args.batch, args.heads, seq, args.head_dim
    dense_causal = 3.5 * 2 * B * H * T * T * D
    sparse = 3.5 * 4 * B * H * T * T * D * row["density"]
    row["tflops_dense_causal_equiv"] = dense_causal / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    row["tflops_sparse"] = sparse / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    return row


def backend_key(r: dict) -> str:
    """A row's backend without its detail ("xformers:fa2F@..." -> "xformers"); pinned SDPA kernels and the
    block-sparse kernel reading its dropout mask from bits kept apart."""
    return r["backend"] if r["backend"].startswith(("sdpa:", "blocksparse:bits")) else r["backend"].split(":")[0]


def add_ratios(rows: list[dict]) -> None:
    ok = {(r["seq"], r["layout"], backend_key(r), r.get("dropout", 0.0)): r for r in rows if r["status"] == "ok"}
    for (seq, lay, name, p), r in ok.items():
        if name.startswith("blocksparse"):
            for other in ("flex", "sdpa", "xformers"):
                o = ok.get((seq, lay, other, p))
                if o is not None:
                    r[f"speedup_vs_{other}"] = o["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        if p > 0 and (no_dropout := ok.get((seq, lay, name, 0.0))) is not None:
            r["time_vs_no_dropout"] = r["fwd_bwd_ms"] / no_dropout["fwd_bwd_ms"]
        causal = ok.get((seq, "causal", name, p))
        if lay != "causal" and causal is not None:
            r["time_vs_causal"] = r["fwd_bwd_ms"] / causal["fwd_bwd_ms"]
            r["ideal_vs_causal"] = r["nnz_blocks"] / causal["nnz_blocks"]
            r["efficiency"] = r["ideal_vs_causal"] / r["time_vs_causal"]


def table(rows: list[dict]) -> str:
    head = (f"{'seq':>5} {'p':>4} {'layout':8} {'backend':34} {'fwd ms':>8} {'f+b ms':>8} {'TF dce':>7} {'TF sp':>6} "
            f"{'vs flex':>7} {'vs sdpa':>7} {'eff':>5} {'max err (out/dq/dk/dv)':>26}")
    lines = [head, "-" * len(head)]
    fmt = lambda r, k, f: format(r[k], f) if k in r else "-"
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['seq']:>5} {r['dropout']:4.2f} {r['layout']:8} {r['backend'][:34]:34} ERROR "
                         f"{r['error'][:150]}")
            continue
        e = r.get("max_abs_err")
        errs = "/".join(f"{e[k]:.1e}" for k in ("out", "dq", "dk", "dv")) if e else "(dropout: not compared)"
        lines.append(f"{r['seq']:>5} {r['dropout']:4.2f} {r['layout']:8} {r['backend'][:34]:34} "
                     f"{r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
                     f"{r['tflops_dense_causal_equiv']:7.1f} {r['tflops_sparse']:6.1f} "
                     f"{fmt(r, 'speedup_vs_flex', '7.2f'):>7} {fmt(r, 'speedup_vs_sdpa', '7.2f'):>7} "
                     f"{fmt(r, 'efficiency', '5.2f'):>5} {errs:>26}")
    return "\n".join(lines)


def main(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")
    # One flex graph per (seq, shape); keep torch.compile from giving up and silently running eager flex.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    seqs = [2048] if args.quick else args.seqs
    started = time.time()
    rows, sdpa_choices = [], {}
    for seq in seqs:
        input_sets = [make_inputs(args, seq, seed) for seed in range(N_INPUT_SETS)]
        sdpa_choices[seq] = {p: sdpa_choice(input_sets[0][0], p) for p in args.dropouts}
        for layout_name, p in itertools.product(args.layouts, args.dropouts):
            cfg = model_cfg(args, seq, layout_name, "reference")
            ref = ReferenceAttention(cfg, layouts.make_layout(cfg)).cuda().eval()
            for backend in args.backends:
                if backend.split(":")[0] in ("sdpa", "xformers") and layout_name != "causal":
                    continue
                row = run_one(args, seq, layout_name, backend, input_sets, ref, p)
                rows.append(row)
                print(f"[{time.time() - started:6.1f}s] seq {seq} p {p} {layout_name} {row['backend']}: "
                      + (f"{row['fwd_bwd_ms']:.3f} ms" if row["status"] == "ok" else row["error"][:200]),
                      flush=True)
            del ref
        del input_sets
        torch.cuda.empty_cache()
    add_ratios(rows)
    try:
        from shared.model.attention.xformers import xformers_state

        xf = xformers_state()
    except Exception as exc:
        xf = {"error": f"{type(exc).__name__}: {exc}"}
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": versions(),
        "device": device_info(torch.device("cuda")),
        "settings": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "block": args.block,
                     "dtype": "bf16", "seqs": seqs, "layouts": args.layouts, "local_blocks": args.local_blocks,
                     "stride_blocks": args.stride_blocks, "dropouts": args.dropouts, "warmup_ms": args.warmup,
                     "rep_ms": args.rep,
                     "input_sets": N_INPUT_SETS, "timing": "triton.testing.do_bench median, forward+backward"},
        "flops_convention": "dense-causal-equivalent: 3.5 * 2*B*H*T^2*D per fwd+bwd; sparse: 3.5 * 4*B*H*T^2*D * "
                            "block density",
        "sdpa_kernel_chosen": sdpa_choices,
        "blocksparse_autotune": bsa.chosen_configs(),
        "xformers": xf,
        "rows": rows,
        "wall_s": time.time() - started,
    }
    print()
    print(table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {args.out}")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/attention.json", help="where to write the JSON result")
    p.add_argument("--quick", action="store_true", help="seq 2048 only")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", "--head_dim", dest="head_dim", type=int, default=96)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--layouts", nargs="+", default=["causal", "local", "strided"])
    p.add_argument("--backends", nargs="+", default=["blocksparse", "flex", "sdpa", "xformers"],
                   help=f"blocksparse, flex, sdpa (the dispatcher's pick), xformers, or a pinned {sorted(SDPA_PINNED)}")
    p.add_argument("--dropouts", type=float, nargs="+", default=[0.0],
                   help="attention dropout rates, each timed in training mode (the preset's is 0.1)")
    p.add_argument("--local-blocks", "--local_blocks", dest="local_blocks", type=int, default=4)
    p.add_argument("--stride-blocks", "--stride_blocks", dest="stride_blocks", type=int, default=4)
    p.add_argument("--warmup", type=int, default=50, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench measuring time, ms")
    args = p.parse_args(argv)
    if any(s % args.block for s in args.seqs):
        p.error(f"every --seqs value must be a multiple of --block {args.block}")
    known = {"blocksparse", "blocksparse:bits", "flex", "sdpa", "xformers", *SDPA_PINNED}
    if unknown := [b for b in args.backends if b not in known]:
        p.error(f"unknown --backends {unknown}; choose from {sorted(known)}")
    if bad := [d for d in args.dropouts if not 0.0 <= d < 1.0]:
        p.error(f"every --dropouts value must be in [0, 1), got {bad}")
    try:  # an unknown layout or shape: refused now, not after the rows before it
        for seq, layout in itertools.product([2048] if args.quick else args.seqs, args.layouts):
            layouts.make_layout(model_cfg(args, seq, layout, "reference"))
    except ValueError as e:
        p.error(str(e))
    check_out_flag(p, args.out)  # a folder or an unwritable path: refused before it measures
    return args


if __name__ == "__main__":
    main(parse_args())
