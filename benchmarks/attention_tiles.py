"""Each block-sparse kernel alone, on one GPU, at every tile shape of a grid: which tiles win on this GPU.

    python benchmarks/attention_tiles.py --out reports/attention_tiles.json          # ~3 min, H200
    python benchmarks/attention_tiles.py --grid candidates --dropouts 0 0.1 --out ...          # the tuner's set

The forward, dq and dk/dv kernels (shared/kernels/blocksparse_attention.py) are timed one at a time with fixed
tiles: the forward on q, k, v; dq on the forward's output; dk/dv on dq's delta. `--grid candidates` is the
autotuner's candidate set (`candidate_tiles`), `--grid wide` adds every (block_m, block_n, warps, stages, D = 96
as 64 + 32 or padded to 128) of a larger grid. A tile that fails to compile or launch (shared memory, registers)
records its error. Each result is compared with the first tile's (max abs difference; the kernels' tiles sum in
different orders, so small bf16 differences are expected; with dropout the mask is the same in every tile).

`--tma off|on|both` loads each tile's loop operands with pointers, through TMA descriptors, or times each tile
both ways. `--atomic_dq` also times the one-pass backward at every dk/dv tile (`dkdv_dq` rows: delta, zeroed fp32
dq, the dk/dv kernel adding dq atomically, the cast back), against the two-kernel backward's best dq + dk/dv.

With `--lookup`, layouts whose rows and columns are runs (causal, local) are also timed with the lookup-table path
forced (`lookup` rows): the ratio says what the affine path gains. The yardstick in the same run is SDPA with the cuDNN
kernel (forward, and forward + backward) at the same shape; `best_sum_ms` adds each kernel's fastest tile
(plus nothing else: the autograd wrapper launches exactly these three kernels).

Inputs (`--inputs`): `model` (default) hands the kernels q, k, v as the GPT does, views of one (B, T, 3C)
projection, and dO in (B, T, H, D) storage; `bhtd` uses contiguous (B, H, T, D) tensors, as
benchmarks/attention.py does.

Timing: triton.testing.do_bench median (L2 flushed between runs), --warmup/--rep ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import torch
import triton

from shared.kernels import blocksparse_attention as bsa
from shared.model import layouts
from shared.model.config import GPTConfig
from shared.train.cli import check_out_flag
from shared.train.results import device_info, versions, write_json

KINDS = ("fwd", "dq", "dkdv")
ATOMIC = "dkdv_dq"  # the whole backward in one pass over the keys, dq added atomically (--atomic_dq)
FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "pad_d", "tma", "ms")


def wide_grid(kind: str, head_dim: int) -> list[bsa.Tile]:
    """Hopper-shaped tiles: 128-row tiles with 8 warps (two 64-row warpgroups), 64-row tiles with 4."""
    pads = (False, True) if head_dim == 96 else (False,)
    if kind == "fwd":
        shapes = [(128, bn, 8, s, pad) for bn in (64, 128) for s in (2, 3, 4) for pad in pads]
        shapes += [(64, bn, 4, s, False) for bn in (64, 128) for s in (2, 3)]
    elif kind == "dq":
        shapes = [(128, bn, 8, s, pad) for bn in (32, 64) for s in (2, 3, 4) for pad in pads]
        shapes += [(64, bn, 4, s, False) for bn in (32, 64) for s in (2, 3)]
    else:  # dk/dv: block_n keys owned, block_m queries per step
        shapes = [(bm, 128, 8, s, pad) for bm in (16, 32, 64) for s in (2, 3) for pad in pads]
        shapes += [(bm, 64, 4, s, False) for bm in (16, 32, 64) for s in (2, 3)]
    return [bsa.Tile(*shape) for shape in shapes]


def tile_grid(kind: str, block: int, head_dim: int, dtype: torch.dtype, dropout: bool, wide: bool,
              loads: tuple[bool, ...] | None = None) -> list[bsa.Tile]:
    """The autotuner's candidates for one kernel (with `wide` also the wide grid's tiles that fit a sparse block),
    each launch shape once; with `loads` each shape is taken with those TMA flags instead of its own."""
    cands = list(bsa.candidate_tiles(kind, block, head_dim, dtype, dropout))
    if wide:
        cands += [t for t in wide_grid(kind, head_dim) if t.block_m <= block and t.block_n <= block]
    if loads is not None:
        cands = [dataclasses.replace(c, tma=tma) for tma in loads for c in cands]
    out, shapes = [], set()
    for tile in cands:
        shape = dataclasses.replace(tile, dropout=True)  # the flag says when a tile is offered, not how it runs
        if shape not in shapes:
            shapes.add(shape)
            out.append(tile)
    return out


def grid(args, kind: str, dropout: bool) -> list[bsa.Tile]:
    loads = {"off": (False,), "on": (True,), "both": (False, True)}[args.tma]
    return tile_grid("dkdv" if kind == ATOMIC else kind, args.block, args.head_dim, torch.bfloat16, dropout,
                     args.grid == "wide", loads)


def time_kernels(args, lut, q, k, v, do, p: float, seed: torch.Tensor, path: str) -> list[dict]:
    rows = []
    o, lse = bsa._forward(q, k, v, lut, p, seed, {"fwd": bsa.candidate_tiles("fwd", args.block, args.head_dim,
                                                                                q.dtype, p > 0)[0]})
    dq_tile = {"dq": bsa.candidate_tiles("dq", args.block, args.head_dim, q.dtype, p > 0)[0]}
    _, delta = bsa._backward_dq(do, q, k, v, o, lse, lut, p, seed, dq_tile)
    calls = {
        "fwd": lambda t: bsa._forward(q, k, v, lut, p, seed, {"fwd": t})[0],
        "dq": lambda t: bsa._backward_dq(do, q, k, v, o, lse, lut, p, seed, {"dq": t})[0],
        "dkdv": lambda t: torch.cat(bsa._backward_dkdv(do, q, k, v, lse, delta, lut, p, seed, {"dkdv": t}), -1),
        ATOMIC: lambda t: torch.cat(bsa._backward_atomic_dq(do, q, k, v, o, lse, lut, p, seed, {"dkdv": t}), -1),
    }
    for kind in tuple(args.kernels) + ((ATOMIC,) if args.atomic_dq else ()):
        first = None
        for tile in grid(args, kind, p > 0):
            shape = {f: v for f, v in dataclasses.asdict(tile).items() if f != "dropout"}  # not the tile's flag
            row = {"kernel": kind, "path": path, "dropout": p, **shape}
            try:
                out = calls[kind](tile)
                torch.cuda.synchronize()
                first = out if first is None else first
                row["max_abs_diff_vs_first"] = (out.float() - first.float()).abs().max().item()
                run = calls[kind]
                row["ms"] = triton.testing.do_bench(lambda f=run, t=tile: f(t), warmup=args.warmup, rep=args.rep,
                                                    return_mode="median")
                row["status"] = "ok"
            except Exception as exc:  # recorded: the row says which tile cannot run here and why
                row["status"] = "error"
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(f"  {path:6} p={p} {kind:5} {tile}: " + (f"{row['ms']:.3f} ms" if row["status"] == "ok"
                                                            else row["error"][:120]), flush=True)
    return rows


def make_inputs(args, new=None) -> tuple[torch.Tensor, ...]:
    """q, k, v, do as (B, H, T, D): `model` as the GPT hands them over (views of one (B, T, 3C) projection;
    do as the gradient of y.transpose(1, 2).reshape(B, T, C)), `bhtd` contiguous. `new(*shape)` makes each
    tensor: by default seeded bf16 normals on the GPU."""
    B, H, T, D = args.batch, args.heads, args.seq, args.head_dim
    if new is None:
        g = torch.Generator(device="cuda").manual_seed(0)
        new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    if args.inputs == "bhtd":
        q, k, v, do = (new(B, H, T, D) for _ in range(4))
    else:
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in new(B, T, 3 * H * D).split(H * D, dim=2))
        do = new(B, T, H, D).transpose(1, 2)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def block_lut(args) -> bsa.BlockLUT:
    """The lookup table of the benchmark's layout (`--layout`, `--seq`, `--block`, `--heads`), on the CPU."""
    cfg = GPTConfig(n_head=args.heads, n_embd=args.heads * args.head_dim, seq_len=args.seq,
                    sparse_block=args.block, layout=args.layout)
    return bsa.BlockLUT.from_layout(layouts.make_layout(cfg), args.block)


def sdpa_ms(args, q, k, v, do, p: float) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd = lambda: f(q, k, v, is_causal=True, dropout_p=p)
        fb = lambda: torch.autograd.grad(fwd(), (q, k, v), do)
        fb()
        return {"fwd_ms": triton.testing.do_bench(fwd, warmup=args.warmup, rep=args.rep, return_mode="median"),
                "fwd_bwd_ms": triton.testing.do_bench(fb, warmup=args.warmup, rep=args.rep, return_mode="median")}


def summarize(rows: list[dict], sdpa: dict, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """Per (path, dropout): each of `kinds`' fastest tile; with all three kernels also their sum against SDPA."""
    out = []
    for (path, p), group in itertools.groupby(sorted(rows, key=lambda r: (r["path"], r["dropout"])),
                                              key=lambda r: (r["path"], r["dropout"])):
        group = [r for r in group if r["status"] == "ok"]
        best = {kind: min((r for r in group if r["kernel"] == kind), key=lambda r: r["ms"], default=None)
                for kind in kinds}
        if any(b is None for b in best.values()):
            continue
        if set(kinds) != set(KINDS):  # some kernels only (--kernels): their best tiles, no sum
            out.append({"path": path, "dropout": p, "best": {k: {x: b.get(x, False) for x in FIELDS}
                                                             for k, b in best.items()}})
            continue
        total = sum(b["ms"] for b in best.values())
        atomic = min((r for r in group if r["kernel"] == ATOMIC), key=lambda r: r["ms"], default=None)
        ref = sdpa[str(p)]
        out.append({"path": path, "dropout": p,
                    "best": {k: {x: b.get(x, False) for x in FIELDS} for k, b in best.items()},
                    "best_sum_ms": total, "sdpa_cudnn_fwd_bwd_ms": ref["fwd_bwd_ms"],
                    "speedup_vs_sdpa_cudnn": ref["fwd_bwd_ms"] / total,
                    "fwd_speedup_vs_sdpa_cudnn": ref["fwd_ms"] / best["fwd"]["ms"]})
        if atomic is not None:  # the forward's best plus the one-pass backward's best (delta, zeros and cast included)
            out[-1]["atomic_dq"] = {"best": {x: atomic.get(x, False) for x in FIELDS},
                                    "sum_ms": best["fwd"]["ms"] + atomic["ms"],
                                    "speedup_vs_sdpa_cudnn": ref["fwd_bwd_ms"] / (best["fwd"]["ms"] + atomic["ms"]),
                                    "vs_two_kernel_backward": (best["dq"]["ms"] + best["dkdv"]["ms"]) / atomic["ms"]}
    return out


def main(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_tiles.py needs a CUDA GPU")
    started = time.time()
    lut = block_lut(args).to("cuda")
    paths = {"affine": lut, "lookup": dataclasses.replace(lut, contiguous=False)} if lut.contiguous \
        else {"lookup": lut}
    q, k, v, do = make_inputs(args)
    seed = torch.tensor(1234, device=q.device)  # the dropout seed on the device, where the kernels read it
    rows, sdpa = [], {}
    for p in args.dropouts:
        sdpa[str(p)] = sdpa_ms(args, q, k, v, do, p)
        print(f"sdpa cudnn p={p}: {sdpa[str(p)]}", flush=True)
        for path, table in paths.items():
            if path == "lookup" and lut.contiguous and not args.lookup:
                continue
            rows += time_kernels(args, table, q.detach(), k.detach(), v.detach(), do, p, seed, path)
    summary = summarize(rows, sdpa, tuple(args.kernels))
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": versions(), "device": device_info(),
        "settings": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "seq": args.seq,
                     "block": args.block, "layout": args.layout, "dtype": "bf16", "dropouts": args.dropouts,
                     "inputs": args.inputs, "tma": args.tma, "atomic_dq": args.atomic_dq, "kernels": args.kernels,
                     "grid": args.grid, "warmup_ms": args.warmup, "rep_ms": args.rep,
                     "timing": "triton.testing.do_bench median, one kernel per row"},
        "sdpa_cudnn": sdpa, "summary": summary, "rows": rows, "wall_s": time.time() - started,
    }
    for s in summary:
        if "best_sum_ms" not in s:
            print(f"{s['path']:6} p={s['dropout']}: best "
                  + ", ".join(f"{k} {b['ms']:.3f}" for k, b in s["best"].items()))
            continue
        print(f"{s['path']:6} p={s['dropout']}: best sum {s['best_sum_ms']:.3f} ms, sdpa cudnn "
              f"{s['sdpa_cudnn_fwd_bwd_ms']:.3f} ms -> {s['speedup_vs_sdpa_cudnn']:.3f}x; "
              + ", ".join(f"{k} {b['ms']:.3f}" for k, b in s["best"].items()))
        if "atomic_dq" in s:
            a = s["atomic_dq"]
            print(f"{'':6} one-pass backward {a['best']['ms']:.3f} ms ({a['vs_two_kernel_backward']:.3f}x the two "
                  f"kernels): sum {a['sum_ms']:.3f} ms -> {a['speedup_vs_sdpa_cudnn']:.3f}x sdpa cudnn")
    if args.out:
        write_json(args.out, result, default=str)
    return result


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The attention's shape that make_inputs and block_lut read: by default the 1.5b model's."""
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", "--head_dim", dest="head_dim", type=int, default=96)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--block", type=int, default=128)


def check_shape_args(p: argparse.ArgumentParser, args) -> None:
    """p.error for a head dim or sparse block the kernels do not support, or a --seq the block does not divide."""
    if args.head_dim not in bsa.SUPPORTED_HEAD_DIMS:
        p.error(f"--head_dim {args.head_dim}: the kernels support {bsa.SUPPORTED_HEAD_DIMS}")
    if args.block not in bsa.SUPPORTED_BLOCKS:
        p.error(f"--block {args.block}: the kernels support {bsa.SUPPORTED_BLOCKS}")
    if args.seq % args.block:
        p.error(f"--seq {args.seq} must be a multiple of --block {args.block}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/attention_tiles.json")
    p.add_argument("--grid", choices=("candidates", "wide"), default="wide")
    add_shape_args(p)
    p.add_argument("--layout", default="causal", choices=("causal", "local", "strided"))
    p.add_argument("--dropouts", type=float, nargs="+", default=[0.0])
    p.add_argument("--inputs", choices=("model", "bhtd"), default="model",
                   help="q, k, v as the model's views of one (B, T, 3C) projection, or contiguous (B, H, T, D)")
    p.add_argument("--tma", choices=("off", "on", "both"), default="both",
                   help="tiles loaded with pointers, through TMA descriptors, or each tile both ways")
    p.add_argument("--atomic-dq", "--atomic_dq", dest="atomic_dq", action="store_true",
                   help="also time the one-pass backward (dk/dv kernel adding dq atomically) at every dk/dv tile")
    p.add_argument("--kernels", nargs="+", choices=KINDS, default=list(KINDS),
                   help="time only these kernels (the summary then gives their best tiles, no sum)")
    p.add_argument("--lookup", action="store_true", help="also time the lookup-table path on a causal/local layout")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    args = p.parse_args(argv)
    check_shape_args(p, args)
    if bad := [d for d in args.dropouts if not 0.0 <= d < 1.0]:
        p.error(f"every --dropouts value must be in [0, 1), got {bad}")
    check_out_flag(p, args.out)  # a folder or an unwritable path: refused before it measures
    return args


if __name__ == "__main__":
    main(parse_args())
