"""The attention dropout each backend really applies: the rate of dropped probabilities, the kept entries' scale
and whether the backward drops what the forward dropped, read back from each kernel's own output
(shared/model/attention/dropout_probe.py).

    python benchmarks/attention_dropout_rate.py --out $OUT/attention_dropout_rate.json   # ~1 min, one GPU

At the 1.5b model's attention shape (24 heads, head dim 96, seq 2048, bf16, q/k/v as views of a (B, T, H, D)
tensor): SDPA pinned to each of its GPU kernels (cuDNN, flash, efficient), SDPA as its dispatcher picks for the
model (the training default), the math kernel, and this project's block-sparse Triton kernel on the causal layout
with its mask drawn in each kernel (philox) or read from bits. A kernel that cannot run at this shape is recorded
with its reason, never replaced by another.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run by path: the repo root, not benchmarks/, on sys.path for `shared.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.kernels import blocksparse_attention as bsa
from shared.model.attention.dropout_probe import measure_dropout
from shared.model.config import preset
from shared.train.results import device_info, versions, write_json

SDPA_KERNELS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def backends(p: float, block: int) -> dict:
    """name -> attention call (q, k, v) -> y applying dropout p, causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shared.model.attention import build_attention

    def pinned(kernel):
        def call(q, k, v):
            with sdpa_kernel([getattr(SDPBackend, kernel)]):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return call

    calls = {f"sdpa:{k.lower()}": pinned(k) for k in SDPA_KERNELS}
    calls["sdpa (dispatcher's pick)"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p,
                                                                                     is_causal=True)
    for mask in ("philox", "bits"):
        cfg = preset("1.5b", attention="blocksparse", attn_dropout=p, attn_dropout_mask=mask, sparse_block=block)
        module = build_attention(cfg).cuda().train()
        calls[f"blocksparse:{mask}"] = module
    return calls


def main(args) -> dict:
    cfg = preset("1.5b")
    H, T, D = cfg.n_head, cfg.seq_len, cfg.head_dim
    rows = []
    from shared.model.attention import sdpa_kernel

    for p in args.p:
        for name, call in backends(p, args.block).items():
            t0 = time.perf_counter()
            row = {"backend": name, "p": p, "B": args.batch, "H": H, "T": T, "D": D, "dtype": "bf16"}
            try:
                measured = measure_dropout(call, p, args.batch, H, T, D, torch.bfloat16, "cuda")
                # the block-sparse kernels apply p rounded to a multiple of 1/65536 (their 16-bit threshold)
                rounding = abs(bsa.applied_dropout(p) - p) if name.startswith("blocksparse") else 0.0
                row.update(measured.to_dict(), ok=measured.ok(rate_tolerance=rounding))
            except RuntimeError as e:  # a kernel that cannot run this shape or dropout: recorded, not replaced
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            row["seconds"] = round(time.perf_counter() - t0, 2)
            print({k: row.get(k) for k in ("backend", "p", "rate", "z", "scale", "backward_error", "ok", "error")},
                  flush=True)
            rows.append(row)
    picked = sdpa_kernel(preset("1.5b"), 8, torch.bfloat16, torch.device("cuda"))
    result = {"command": " ".join(["python", *sys.argv]), "versions": versions(), "device": device_info(),
              "sdpa_pick_at_1.5b_mb8": picked, "rows": rows}
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=float, nargs="+", default=[0.1, 0.05, 0.15, 0.2, 0.3],
                    help="dropout rates to measure (default: the preset's 0.1 and four others)")
    ap.add_argument("--batch", type=int, default=2, help="batch of the probe (default 2)")
    ap.add_argument("--block", type=int, default=128, help="the block-sparse kernel's block (default 128)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: it measures what the GPU kernels apply")
    if not all(0 < p < 1 for p in args.p):
        ap.error(f"--p: every rate must be in (0, 1), got {args.p}")
    return args


if __name__ == "__main__":
    main(parse_args())
