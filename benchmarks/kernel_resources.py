"""What each block-sparse kernel tile costs on the chip, from the compiler alone: registers, spills, shared memory.

    python benchmarks/kernel_resources.py                          # the autotuner's D = 96 candidates, sm_90
    python benchmarks/kernel_resources.py --grid wide --kernels dkdv --dropouts 0 0.1 --out resources.json

Each tile (shared/kernels/blocksparse_attention.py, `candidate_tiles`; `--grid wide` adds the grid of
benchmarks/attention_tiles.py) is compiled ahead of time for a GPU architecture (`--arch 90`: Hopper) with the
installed Triton, no GPU needed, and its cubin read back with the `cuobjdump` Triton ships: registers per thread,
bytes of local memory a thread spills to (`spill_bytes`, cuobjdump's STACK) and shared memory per program. A tile
that spills pays for it in local-memory traffic inside its loop. Triton versions allocate differently: the record
names the version.

What is compiled is what a launch at the benchmark's shape compiles (`--batch/--heads/--seq/--head_dim/--block/
--layout/--inputs`, by default the 1.5b model's attention on the model's q/k/v views): the module's own host code
builds the arguments, on meta tensors, and each argument is specialized by Triton's own rule (integers equal to 1
become constants, integers and addresses divisible by 16 are marked so), as its JIT does. Needs no GPU; must run
without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import attention_tiles  # noqa: E402

from shared.kernels import blocksparse_attention as bsa  # noqa: E402
from shared.train.cli import check_out_flag  # noqa: E402

KINDS = ("fwd", "dq", "dkdv")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
           torch.uint8: "u8"}


def launches(args, dropout: float) -> dict[str, tuple]:
    """(kernel, arguments, constexprs) of each kernel's launch at the benchmark's shape, recorded from the module's
    host code (`_forward`, `_backward_dq`, `_backward_dkdv`) with its launcher replaced: meta tensors, no GPU."""
    q, k, v, do = (x.detach() for x in attention_tiles.make_inputs(
        args, lambda *shape: torch.empty(*shape, device="meta", dtype=DTYPES[args.dtype])))
    lut = attention_tiles.block_lut(args)
    calls = {}

    def record(kernel, kind, T, BH, tiles, block, head_dim, dtype, kernel_args, consts):
        calls[kind] = (kernel, kernel_args, consts)

    with mock.patch.object(bsa, "_launch", record):
        o, lse = bsa._forward(q, k, v, lut, dropout, 1, None)
        _, delta = bsa._backward_dq(do, q, k, v, o, lse, lut, dropout, 1, None)
        bsa._backward_dkdv(do, q, k, v, lse, delta, lut, dropout, 1, None)
    return calls


def specialize(kernel, kernel_args: tuple, consts: dict) -> tuple[dict, dict, dict]:
    """Triton's signature, constants and attributes for these arguments, by the rule its JIT applies at launch."""
    sig, constants, attrs = {}, dict(consts), {}
    params = [p for p in kernel.params if not p.is_constexpr]
    for param, value in zip(params, kernel_args, strict=True):
        index = (kernel.arg_names.index(param.name),)
        align = not param.do_not_specialize_on_alignment
        if isinstance(value, torch.Tensor):  # a meta tensor's address is its offset (allocations are 256-aligned)
            address = value.storage_offset() * value.element_size() if value.is_meta else value.data_ptr()
            sig[param.name] = f"*{POINTEE[value.dtype]}"
            divisible = address % 16 == 0 and align
        else:
            ty, key = native_specialize_impl(CUDABackend, value, False, not param.do_not_specialize, align)
            if ty == "constexpr":
                constants[param.name] = key
            sig[param.name] = ty
            divisible = key == "D"
        if divisible:
            attrs[index] = [["tt.divisibility", 16]]
    for param in kernel.params:
        if param.is_constexpr or param.name in constants:
            sig[param.name] = "constexpr"
            if param.name not in constants and param.default is not inspect.Parameter.empty:
                constants[param.name] = param.default  # constexpr defaults (TMA, DQ_ATOMIC): False
    return sig, constants, attrs


def resources(launch: tuple, tile: bsa.Tile, head_dim: int, arch: int) -> dict:
    """Compile one recorded launch at one tile for `arch` and read its resource usage from the cubin."""
    kernel, kernel_args, consts = launch
    return compile_usage(kernel, kernel_args, {**consts, **tile.meta(head_dim)}, tile.num_warps, tile.num_stages,
                         arch)


def compile_usage(kernel, kernel_args: tuple, consts: dict, num_warps: int, num_stages: int, arch: int) -> dict:
    """Compile `kernel` for these arguments and constants for `arch`; registers, spills and shared memory."""
    if isinstance(kernel, triton.runtime.interpreter.InterpretedFunction):
        raise SystemExit("benchmarks/kernel_resources.py compiles kernels: run it without TRITON_INTERPRET")
    sig, constants, attrs = specialize(kernel, kernel_args, consts)
    src = ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()},
                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    return {**parse_usage(usage), "shared_bytes": compiled.metadata.shared}


def parse_usage(text: str) -> dict:
    """Registers per thread and spilled bytes (local memory, STACK) from `cuobjdump --dump-resource-usage`."""
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", text))
    if set(found) != {"REG", "STACK"}:
        raise ValueError(f"no REG/STACK figures in cuobjdump's output: {text[:200]!r}")
    return {"registers": int(found["REG"]), "spill_bytes": int(found["STACK"])}


def tiles_of(args, kind: str, dropout: bool) -> list[bsa.Tile]:
    """The candidates (with `--grid wide` also the wide grid's tiles), each launch shape once; `--first` of them."""
    tiles = attention_tiles.tile_grid(kind, args.block, args.head_dim, DTYPES[args.dtype], dropout,
                                      args.grid == "wide")
    return tiles[:args.first] if args.first else tiles


def other_launches() -> list[tuple[str, str, object, tuple, dict, int]]:
    """(kernel, configuration, kernel, arguments, constants, warps) of the project's other Triton kernels at the 1.5b
    preset's shapes (bf16, micro-batch 16), one per autotuner configuration: the AdamW step on a 100M-element
    sub-group, the MLP's bias + GELU backward (32768 x 9216), the LM head's cross-entropy (32768 x 50304), a residual
    branch's dropout keep mask (32768 x 2304)."""
    from shared.kernels import adamw, bias_gelu_grad, cross_entropy, dropout_mask

    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, device="meta", dtype=dtype)
    n, f32 = 100_000_000, torch.float32
    out = [("adamw", f"BLOCK {adamw.BLOCK}", adamw._adamw_kernel,
            (meta(n, dtype=f32), meta(n), meta(n, dtype=f32), meta(n, dtype=f32), meta(n), meta(1, dtype=f32),
             meta(1, dtype=f32), meta(1, dtype=torch.uint8), n, 3e-4, 0.9, 0.95, 1e-8, 0.1),
            {"HAS_SCALE": True, "HAS_LP": True, "HAS_SKIP": True, "BLOCK": adamw.BLOCK}, adamw.NUM_WARPS)]
    m, w = 16 * 2048, 9216
    g = -(-m // bias_gelu_grad.MIN_ROWS)
    for rows, bm, bn, warps in bias_gelu_grad.CONFIGS:
        out.append(("bias_gelu_grad", f"ROWS {rows} BLOCK_M {bm} BLOCK_N {bn}", bias_gelu_grad._bias_gelu_grad,
                    (meta(m, w), meta(m, w), meta(w), meta(m, w), meta(g, w, dtype=f32), m, w, g, w, w, w),
                    {"MIN_ROWS": bias_gelu_grad.MIN_ROWS, "ROWS": rows, "BLOCK_M": bm, "BLOCK_N": bn}, warps))
    v, vp = 50257, 50304
    for block, warps in cross_entropy.CONFIGS:
        out.append(("cross_entropy", f"BLOCK {block}", cross_entropy._cross_entropy_rows,
                    (meta(m, vp), meta(m, dtype=torch.int64), meta(m, dtype=f32), meta(m, vp), vp, vp, v, vp,
                     1.0 / m), {"BLOCK": block}, warps))
    n = m * 2304
    for block, warps in dropout_mask.CONFIGS:
        out.append(("dropout_mask", f"BLOCK {block}", dropout_mask._dropout_mask,
                    (meta(n, dtype=torch.uint8), meta(1, dtype=torch.int64), n, dropout_mask.threshold(0.1)),
                    {"BLOCK": block}, warps))
    return out


def main(args) -> dict:
    started = time.time()
    rows, specialized = [], {}
    if args.others:
        for name, config, kernel, kernel_args, consts, warps in other_launches():
            row = {"kernel": name, "config": config, "num_warps": warps}
            try:
                row.update(compile_usage(kernel, kernel_args, consts, warps, 3, args.arch))
            except Exception as exc:  # recorded: the row says which configuration does not compile and why
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(f"{name} {config}: " + (f"{row['registers']} registers, {row['spill_bytes']} bytes spilled"
                                          if "error" not in row else row["error"][:200]), flush=True)
    for p in args.dropouts:
        calls = launches(args, p)
        for kind, (kernel, kernel_args, consts) in calls.items():  # what the launch fixes besides the tile
            _, constants, attrs = specialize(kernel, kernel_args, consts)
            specialized[f"{kind} dropout={int(p > 0)}"] = {
                "constants": constants, "divisible_by_16": [kernel.arg_names[i] for (i,) in sorted(attrs)]}
        for kind in args.kernels:
            for tile in tiles_of(args, kind, p > 0):
                shape = {f: v for f, v in dataclasses.asdict(tile).items() if f != "dropout"}  # not the tile's flag
                row = {"kernel": kind, "dropout": p > 0, **shape}
                try:
                    row.update(resources(calls[kind], tile, args.head_dim, args.arch))
                except Exception as exc:  # recorded: the row says which tile does not compile and why
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
                print(f"{kind:5} dropout={int(p > 0)} {tile}: " + (
                    f"{row['registers']} registers, {row['spill_bytes']} bytes spilled, "
                    f"{row['shared_bytes']} bytes shared" if "error" not in row else row["error"][:120]), flush=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "triton": triton.__version__,
              "target": f"sm_{args.arch}", "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "specialized": specialized, "rows": rows, "wall_s": time.time() - started}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="where to write the JSON (default: print only)")
    p.add_argument("--kernels", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--grid", choices=("candidates", "wide"), default="candidates")
    p.add_argument("--first", type=int, default=0, help="only the first N tiles of each list (0: all)")
    p.add_argument("--others", action="store_true",
                   help="also the project's other Triton kernels (AdamW step, bias + GELU backward, cross-entropy), "
                   "every autotuner configuration, at the 1.5b shapes")
    p.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1],
                   help="dropout rates; any p > 0 compiles the dropout variant")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", "--head_dim", dest="head_dim", type=int, default=96)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--layout", default="causal", choices=("causal", "local", "strided"))
    p.add_argument("--inputs", choices=("model", "bhtd"), default="model",
                   help="q/k/v as the GPT's views of one projection (default) or contiguous (B, H, T, D)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--arch", type=int, default=90, help="compute capability to compile for, e.g. 90 (H100/H200)")
    args = p.parse_args(argv)
    try:
        bsa.split_head_dim(args.head_dim)
        bsa.check_block(args.block)
    except ValueError as e:
        p.error(str(e))
    if args.seq % args.block or min(args.batch, args.heads, args.seq) <= 0:
        p.error(f"--seq must be a positive multiple of --block ({args.block}), --batch and --heads positive; got "
                f"seq {args.seq}, batch {args.batch}, heads {args.heads}")
    if args.first < 0:
        p.error(f"--first must be >= 0, got {args.first}")
    check_out_flag(p, args.out)  # a folder or an unwritable path: refused before it measures
    return args


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("benchmarks/kernel_resources.py compiles kernels: unset TRITON_INTERPRET")
    main(parse_args())
