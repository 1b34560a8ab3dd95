"""The LM head's cross-entropy in one Triton kernel per row: the loss and the logits' gradient, in forward.

The model's loss is the mean over B*T rows of logsumexp(logits) - logits[target], logits = x @ W^T in bf16 (B*T x V:
at micro-batch 16, seq 2048, V = 50257 that is 3.3 GB). Inductor compiles `F.cross_entropy(logits.float(), ...)` into
a forward reduction and, in backward, kernels that read the logits again and write their gradient (their times in a
profiled step: docs/results.md, "Levers on top of DeepCompile", the Triton loss). Here one program per row reads its
logits once for the running maximum and sum of exponentials, then again (a row is 100 KB, which the L2 cache may
still hold) to write the gradient of the mean loss with respect to them, (softmax - onehot) / rows, in the logits'
dtype; the loss of the row goes to an fp32 vector. The backward has nothing left to do but scale
(shared/model/linear_cross_entropy.LinearCrossEntropy folds that scale into the two products' outputs). Measured at
the 1.5b shape it is no faster than inductor's kernels (docs/ledger.md, the `--triton_loss` row).

Columns from `vocab` to the row's end (a padded vocabulary, shared/model/config.py vocab_multiple) are outside the
softmax: their gradient is written as zero. Targets must lie in [0, vocab) (the data pipeline checks token ids on
the CPU; a check here would be a device sync); a load outside is masked, never out of bounds.
`reference_cross_entropy_rows` is the same in PyTorch operations (the tests compare the two). On a CPU the kernel
runs only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from shared.kernels import require_cuda_or_interpreter

CONFIGS = [(2048, 8), (4096, 8), (4096, 16), (1024, 4), (8192, 16)]  # (BLOCK columns a step, num_warps)


@triton.jit
def _cross_entropy_rows(logits, targets, loss, grad, stride_l, stride_g, V, VP, inv_rows, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src, dst = logits + row * stride_l, grad + row * stride_g
    t = tl.load(targets + row)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)  # running maximum and sum of exp(x - maximum)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    ok = (t >= 0) & (t < V)
    xt = tl.load(src + t, mask=ok, other=0.0).to(tl.float32)
    tl.store(loss + row, lse - xt)
    for start in range(0, VP, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == t, p - 1.0, p) * inv_rows
        tl.store(dst + cols, p.to(grad.dtype.element_ty), mask=cols < VP)


_kernel = triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b, w in CONFIGS],
                          key=["V", "VP"])(_cross_entropy_rows)


def interpreted() -> bool:
    return isinstance(_cross_entropy_rows, InterpretedFunction)


def check_inputs(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> None:
    """Raise ValueError on inputs the kernel cannot take, naming the problem, before anything runs."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_rows takes logits (rows, columns) and one target per row, got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if not 0 < vocab <= logits.shape[1]:
        raise ValueError(f"cross_entropy_rows: vocab must be in [1, {logits.shape[1]}] (the logits' columns), got "
                         f"{vocab}")
    if not logits.is_floating_point() or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cross_entropy_rows takes floating-point logits and integer targets, got {logits.dtype} "
                         f"and {targets.dtype}")
    if logits.device != targets.device:
        raise ValueError(f"cross_entropy_rows: logits on {logits.device}, targets on {targets.device}")
    require_cuda_or_interpreter("cross_entropy_rows", logits.device, interpreted(), "--triton_loss")


@torch.library.custom_op("zero3bench::cross_entropy_rows", mutates_args=())
def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss of each row in fp32, gradient of the mean loss w.r.t. the logits in their dtype) for logits (rows, VP)
    of which the first `vocab` columns are the softmax's; the rest get a zero gradient."""
    check_inputs(logits, targets, vocab)
    rows, vp = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()  # the kernel reads row r's target at targets + r
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    grad = torch.empty((rows, vp), dtype=logits.dtype, device=logits.device)
    if rows:
        args = (logits, targets, loss, grad, logits.stride(0), grad.stride(0), vocab, vp, 1.0 / rows)
        if interpreted():  # the interpreter is too slow to tune: the first configuration
            block, warps = CONFIGS[0]
            _cross_entropy_rows[(rows,)](*args, BLOCK=block, num_warps=warps)
        else:
            _kernel[(rows,)](*args)
    return loss, grad


@cross_entropy_rows.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (logits.new_empty(logits.shape[:1], dtype=torch.float32),
            torch.empty_like(logits, memory_format=torch.contiguous_format))


def reference_cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """What cross_entropy_rows computes, in PyTorch operations (the tests' reference): fp32 (float64 stays), the
    gradient rounded to the logits' dtype once."""
    ct = torch.promote_types(logits.dtype, torch.float32)
    x = logits[:, :vocab].to(ct)
    lse = torch.logsumexp(x, dim=1)
    loss = lse - x.gather(1, targets[:, None].long()).squeeze(1)
    p = torch.exp(x - lse[:, None])
    p[torch.arange(len(targets)), targets.long()] -= 1.0
    grad = torch.zeros(logits.shape, dtype=ct, device=logits.device)
    grad[:, :vocab] = p / max(1, logits.shape[0])
    return loss.to(torch.promote_types(torch.float32, ct)), grad.to(logits.dtype)
