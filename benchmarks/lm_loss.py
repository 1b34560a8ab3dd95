"""The LM head and its loss, forward + backward, two ways: inductor's kernels, or the Triton cross-entropy kernel.

    python benchmarks/lm_loss.py --out lm_loss.json          # the 1.5b model's shape, micro-batch 16 (a GPU)
    python benchmarks/lm_loss.py --rows 64 --hidden 32 --vocab 300 --rounds 1   # a small shape, on a CPU too

loss = cross_entropy(x @ W^T, targets), x (rows = micro-batch x sequence, hidden), W (vocabulary, hidden), both in the
model's dtype. `inductor` is the model's LM head (shared/model/gpt.LMHead: the logits upcast to fp32 inside
F.cross_entropy), torch.compile'd. `triton` is shared/model/linear_cross_entropy.triton_linear_cross_entropy,
torch.compile'd: the same matmul, then shared/kernels/cross_entropy.py's kernel writes each row's loss and the logits'
gradient in forward, and the backward's two products are scaled afterwards (on a CPU only under TRITON_INTERPRET=1,
else it is left out and the JSON says why). `--vocab_multiple 128` pads W's rows as the model's flag does.

Timing: triton.testing.do_bench medians of forward + backward (torch.autograd.grad of the loss for x and W), the
variants alternated `--rounds` times, each compiled and checked first. Correctness: each variant's loss, dx and dW
against the same computation in float32 (dx, dW as max absolute error relative to the largest entry).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_tail import time_alternated, write_result  # noqa: E402

from shared.kernels import cross_entropy
from shared.model.gpt import LMHead
from shared.model.linear_cross_entropy import triton_linear_cross_entropy
from shared.train.cli import check_out_flag
from shared.train.results import device_info, versions


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16 * 2048, help="micro-batch x sequence (1.5b, micro-batch 16)")
    p.add_argument("--hidden", type=int, default=2304, help="the model's width (1.5b)")
    p.add_argument("--vocab", type=int, default=50257, help="the vocabulary (GPT-2's)")
    p.add_argument("--vocab_multiple", type=int, default=1, help="pad W's rows to a multiple of this")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--rounds", type=int, default=3, help="times each variant is timed, alternated")
    # one forward + backward at the 1.5b shape takes ~40 ms: do_bench needs a second or more to repeat it enough
    p.add_argument("--warmup", type=int, default=200, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=1500, help="do_bench measuring time, ms")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    for name in ("rows", "hidden", "vocab", "vocab_multiple", "rounds", "warmup", "rep"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    check_out_flag(p, args.out)  # a folder or an unwritable path: refused before it measures
    return args


def variants(vocab: int) -> dict:
    def inductor(x, w, t):  # the model's LMHead.forward on this weight
        return LMHead.forward(SimpleNamespace(weight=w, vocab_size=vocab, triton_loss=False), x, t)

    return {"inductor": torch.compile(inductor, dynamic=False),
            "triton": torch.compile(lambda x, w, t: triton_linear_cross_entropy(x, w, t, vocab), dynamic=False)}


def errors(fn, x, w, t, vocab) -> dict[str, float]:
    loss = fn(x, w, t)
    dx, dw = torch.autograd.grad(loss, (x, w))
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy((xf @ wf.t())[:, :vocab], t)
    dxf, dwf = torch.autograd.grad(ref, (xf, wf))
    rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()
    return {"loss": abs(loss.item() - ref.item()), "dx_relative": rel(dx, dxf), "dw_relative": rel(dw, dwf)}


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    padded = -(-args.vocab // args.vocab_multiple) * args.vocab_multiple
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.rows, args.hidden, device=device, generator=gen).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(padded, args.hidden, device=device, generator=gen)).to(dtype)
    w[args.vocab:] = 0
    w.requires_grad_()
    t = torch.randint(0, args.vocab, (args.rows,), device=device, generator=gen)
    result: dict = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                    "versions": versions(), "device": device_info(device),
                    "shape": {"rows": args.rows, "hidden": args.hidden, "vocab": args.vocab, "padded_vocab": padded,
                              "dtype": args.dtype},
                    "timing": "triton.testing.do_bench median, forward + backward" if device.type == "cuda"
                    else "perf_counter mean, forward + backward (CPU)", "variants": {}, "left_out": {}}
    fns = variants(args.vocab)
    if device.type != "cuda" and not cross_entropy.interpreted():
        del fns["triton"]
        result["left_out"]["triton"] = "its Triton kernel runs on a CPU only under TRITON_INTERPRET=1"
    for name, fn in fns.items():
        t0 = time.perf_counter()
        err = errors(fn, x, w, t, args.vocab)
        result["variants"][name] = {"errors": err, "compile_and_check_s": round(time.perf_counter() - t0, 1),
                                    "ms": []}
        print(f"{name}: compiled and checked in {time.perf_counter() - t0:.1f} s, errors {err}", flush=True)
    time_alternated(result, {name: (lambda fn=fn: torch.autograd.grad(fn(x, w, t), (x, w)))
                             for name, fn in fns.items()}, args, device)
    return write_result(result, args.out)


if __name__ == "__main__":
    main()
