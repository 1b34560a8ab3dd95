"""What each block-sparse kernel tile costs on the chip, from the compiler alone: registers, spills, shared memory.

    python benchmarks/kernel_resources.py                          # the autotuner's D = 96 candidates, sm_90
    python benchmarks/kernel_resources.py --grid wide --kernels dkdv --dropouts 0 0.1 --out resources.json

Each tile (shared/kernels/blocksparse_attention.py, `candidate_tiles`; `--grid wide` adds the grid of
benchmarks/attention_tiles.py) is compiled ahead of time for a GPU architecture (`--arch 90`: Hopper) with the
installed Triton, no GPU needed, and its cubin read back with the `cuobjdump` Triton ships: registers per thread,
bytes of local memory a thread spills to (`spill_bytes`, cuobjdump's STACK) and shared memory per program. A tile
that spills pays for it in local-memory traffic inside its loop; the candidate lists are kept spill-free. Triton
versions allocate differently: the record names the version. Needs no GPU; must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from shared.kernels import blocksparse_attention as bsa  # noqa: E402

KERNELS = {"fwd": bsa._attn_fwd, "dq": bsa._attn_bwd_dq, "dkdv": bsa._attn_bwd_dkdv}
POINTERS = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"}  # the inputs' dtype
FP32_POINTERS = {"LSE", "DELTA"}
INT_POINTERS = {"ROW_IDX", "ROW_OFF", "DIAG", "COL_IDX", "COL_CUM"}
FLOATS = {"sm_scale", "dropout_p"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def signature(fn, consts: dict, dtype: str) -> dict:
    """Triton's signature of one of the kernels: pointers by name, constexprs as given, every other argument int32."""
    sig = {}
    for name in fn.arg_names:
        sig[name] = ("constexpr" if name in consts else f"*{dtype}" if name in POINTERS else "*fp32"
                     if name in FP32_POINTERS else "*i32" if name in INT_POINTERS else "fp32" if name in FLOATS
                     else "i32")
    return sig


def resources(kind: str, tile: bsa.Tile, head_dim: int, dtype: str, dropout: bool, block: int, arch: int) -> dict:
    """Compile one kernel at one tile for `arch` and read its resource usage from the cubin."""
    if isinstance(KERNELS[kind], triton.runtime.interpreter.InterpretedFunction):
        raise SystemExit("benchmarks/kernel_resources.py compiles kernels: run it without TRITON_INTERPRET")
    fn = KERNELS[kind]
    consts = dict(HEAD_DIM=head_dim, SPARSE_BLOCK=block, DROPOUT=dropout, PREC="tf32", CONTIG=True,
                  **tile.meta(head_dim))
    consts.update({name: False for name in ("DQ_ATOMIC",) if name in fn.arg_names})  # the two-kernel backward
    src = ASTSource(fn, signature(fn, consts, dtype),
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages))
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
    cands = list(bsa.candidate_tiles(kind, args.block, args.head_dim, DTYPES[args.dtype], dropout))
    if args.grid == "wide":
        import attention_tiles

        cands += [t for t in attention_tiles.wide_grid(kind, args.head_dim) if t not in cands
                  and t.block_m <= args.block and t.block_n <= args.block]
    return cands[:args.first] if args.first else cands


def main(args) -> dict:
    started = time.time()
    rows = []
    for kind in args.kernels:
        for p in args.dropouts:
            for tile in tiles_of(args, kind, p > 0):
                shape = {f: v for f, v in dataclasses.asdict(tile).items() if f != "dropout"}  # not the tile's flag
                row = {"kernel": kind, "dropout": p > 0, **shape}
                try:
                    row.update(resources(kind, tile, args.head_dim, args.dtype, p > 0, args.block, args.arch))
                except Exception as exc:  # recorded: the row says which tile does not compile and why
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
                print(f"{kind:5} dropout={int(p > 0)} {tile}: " + (
                    f"{row['registers']} registers, {row['spill_bytes']} bytes spilled, "
                    f"{row['shared_bytes']} bytes shared" if "error" not in row else row["error"][:120]), flush=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "triton": triton.__version__,
              "target": f"sm_{args.arch}", "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "rows": rows, "wall_s": time.time() - started}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="where to write the JSON (default: print only)")
    p.add_argument("--kernels", nargs="+", choices=tuple(KERNELS), default=list(KERNELS))
    p.add_argument("--grid", choices=("candidates", "wide"), default="candidates")
    p.add_argument("--first", type=int, default=0, help="only the first N tiles of each list (0: all)")
    p.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1],
                   help="dropout rates; any p > 0 compiles the dropout variant")
    p.add_argument("--head-dim", "--head_dim", dest="head_dim", type=int, default=96)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--arch", type=int, default=90, help="compute capability to compile for, e.g. 90 (H100/H200)")
    args = p.parse_args(argv)
    try:
        bsa.split_head_dim(args.head_dim)
        bsa.check_block(args.block)
    except ValueError as e:
        p.error(str(e))
    if args.first < 0:
        p.error(f"--first must be >= 0, got {args.first}")
    return args


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("benchmarks/kernel_resources.py compiles kernels: unset TRITON_INTERPRET")
    main(parse_args())
