"""Which xFormers attention operators can run on this machine, and why the others cannot.

    python benchmarks/xformers_probe.py --out benchmarks/results/xformers_probe_1xh200/xformers_probe.json

For a (B, T, H, D) = (8, 2048, 24, 96) bf16 causal input (LowerTriangularMask) it records, for every registered
fmha operator: is_available() and not_supported_reasons(); the state that decides them (xFormers' extension
load error, the torch it was built for, the flags derived from it); what xFormers' own dispatcher does with
the input; and one forward + backward through shared.model.attention.xformers.XFormersAttention compared with SDPA.
See shared/model/attention/xformers.py for why the "-pt" operators can run although xFormers reports them unsupported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from shared.model.config import GPTConfig
from shared.train.results import device_info, versions


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def probe_ops(q, k, v) -> list[dict]:
    from xformers.ops import fmha
    from xformers.ops.common import OPERATORS_REGISTRY
    from xformers.ops.fmha import attn_bias

    inp = fmha.Inputs(q, k, v, attn_bias=attn_bias.LowerTriangularMask(), p=0.0)
    out = []
    for op in OPERATORS_REGISTRY:
        if getattr(op, "OPERATOR_CATEGORY", None) != "memory_efficient_attention":
            continue
        entry = {"name": op.NAME, "class": f"{op.__module__}.{op.__qualname__}", "operator": repr(op.OPERATOR)[:200]}
        try:
            entry["is_available"] = bool(op.is_available())
            entry["not_supported_reasons"] = op.not_supported_reasons(inp)
        except Exception as exc:
            entry["error"] = error_text(exc)
        out.append(entry)
    return out


def probe_dispatcher(q, k, v) -> dict:
    """What xformers.ops.memory_efficient_attention does on its own (no op given)."""
    import xformers.ops as xops
    from xformers.ops import fmha
    from xformers.ops.fmha import attn_bias, dispatch

    res = {}
    try:
        res["forward_op_chosen"] = dispatch._dispatch_fw(fmha.Inputs(q, k, v, attn_bias.LowerTriangularMask()),
                                                         True).NAME
    except Exception as exc:
        res["forward_op_chosen"] = error_text(exc)
    try:
        xops.memory_efficient_attention(q, k, v, attn_bias=attn_bias.LowerTriangularMask())
        res["call"] = "ok"
    except Exception as exc:
        res["call"] = error_text(exc)
    return res


def try_backend(B: int, T: int, H: int, D: int) -> dict:
    from shared.model.attention import build_attention

    res = {}
    cfg = GPTConfig(n_head=H, n_embd=H * D, seq_len=T, sparse_block=128, attn_dropout=0.0, attention="xformers")
    try:
        attn = build_attention(cfg)
    except Exception as exc:
        res["construct"] = error_text(exc)
        return res
    res["construct"] = "ok"
    res["backend"] = attn.backend
    res["kernel"] = attn.kernel
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = attn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do)
        torch.cuda.synchronize()
        res["first_fwd_bwd_s"] = time.perf_counter() - t0
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do)
        res["max_abs_err_vs_sdpa"] = {"out": (out - ref).abs().max().item(),
                                      **{f"d{n}": (a - b).abs().max().item()
                                         for n, a, b in zip("qkv", grads, ref_grads)}}
        res["fwd_bwd"] = "ok"
    except Exception as exc:
        res["fwd_bwd"] = error_text(exc)
        res["traceback"] = traceback.format_exc()[-3000:]
    return res


def main(args) -> dict:
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "versions": versions(),
              "input": {"B": args.batch, "T": args.seq, "H": args.heads, "D": args.head_dim, "dtype": "bf16",
                        "attn_bias": "LowerTriangularMask"}}
    if torch.cuda.is_available():
        result["device"] = device_info(torch.device("cuda"))
    try:
        from shared.model.attention.xformers import torch_kernel_op_pairs, xformers_state

        result["state"] = xformers_state()
        result["torch_kernel_op_pairs"] = [{"forward": fw.NAME, "backward": bw.NAME, "kernel": kernel}
                                           for fw, bw, kernel in torch_kernel_op_pairs()]
    except Exception as exc:
        result["state"] = {"import_error": error_text(exc)}
    if torch.cuda.is_available() and "import_error" not in result["state"]:
        shape = (args.batch, args.seq, args.heads, args.head_dim)  # xFormers' (B, T, H, D)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        result["ops"] = probe_ops(q, k, v)
        result["dispatcher"] = probe_dispatcher(q, k, v)
        result["XFormersAttention"] = try_backend(args.batch, args.seq, args.heads, args.head_dim)
        del q, k, v
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/xformers_probe.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", "--head_dim", dest="head_dim", type=int, default=96)
    main(p.parse_args())
