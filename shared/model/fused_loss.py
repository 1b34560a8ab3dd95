"""Linear + cross-entropy over row chunks, never materializing the fp32 logits of the whole batch.

The LM head's logits are the largest activation of the model: B*T x V, at micro-batch 8, seq 2048 and
V = 50257 that is 1.6 GB in bf16 and 3.3 GB once upcast to fp32 for a stable softmax, plus as much again for
their gradient. Here the rows are processed in chunks: each chunk's logits are formed (fp32 softmax, computed in
place of the logits), its loss accumulated, and the gradients with respect to the hidden states and the weight are
computed right away (the approach of Liger-Kernel's fused linear cross-entropy, in plain PyTorch), so only one chunk
of fp32 logits is ever alive and the peak does not grow with the batch. The backward then only scales the stored
gradients by the incoming gradient.

Same numbers as F.cross_entropy(x @ W^T) up to rounding (tests/test_fused_loss.py): in fp32 to 1e-5, in bf16
the gradients go through one bf16 rounding of (softmax - onehot), like the plain path's bf16 logits gradient.
"""

from __future__ import annotations

import torch

import shared.kernels.cross_entropy  # noqa: F401  registers torch.ops.zero3bench.cross_entropy_rows

# fp32 logits per chunk: 1 GiB, ~5300 rows at V = 50257 (4 chunks at micro-batch 8, seq 2048). Chunks of 2**26
# (~1300 rows, 13 chunks) measured 7% slower than the unfused loss on the 1.5b step (benchmarks/results/
# ablation_first_1xh200): small matmuls and one fp32 grad_w accumulation per chunk.
CHUNK_ELEMENTS = 2**28


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        """x (N, C), weight (V, C), targets (N,) -> mean cross-entropy of x @ weight^T."""
        n = x.shape[0]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, n, rows):
            xc, tc = x[start:start + rows], targets[start:start + rows]
            logits = (xc @ weight.t()).float()  # (rows, V): the only logits alive
            target_logits = logits.gather(1, tc[:, None]).squeeze(1)
            top = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place: one fp32 chunk, never a second one beside it
            sums = probs.sum(dim=-1, keepdim=True)
            total += ((sums.log() + top).squeeze(1) - target_logits).sum()  # logsumexp - target logit
            if want_x or want_w:
                probs.div_(sums)  # softmax, then d(sum of losses)/d logits = softmax - onehot
                probs[torch.arange(len(tc), device=probs.device), tc] -= 1.0
                g = probs.to(x.dtype)
                del logits, probs  # the fp32 chunk goes before the gradient products allocate theirs
                if want_x:
                    grad_x[start:start + rows] = g @ weight
                if want_w:
                    grad_w += (g.t() @ xc).float()
        ctx.n = n
        ctx.save_for_backward(grad_x if want_x else None, grad_w.to(weight.dtype) if want_w else None)
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return (grad_x * scale.to(grad_x.dtype) if grad_x is not None else None,
                grad_w * scale.to(grad_w.dtype) if grad_w is not None else None, None, None)


def chunked_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (x @ weight^T) against targets; x (..., C), targets (...)."""
    # Target ids are checked on the CPU by the data pipeline (shared/data.py), not here: that would be a sync.
    x2, t2 = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    return ChunkedLinearCrossEntropy.apply(x2, weight, t2, rows)


class LinearCrossEntropy(torch.autograd.Function):
    """x @ W^T in the matmul library, then the loss and the logits' gradient by one Triton kernel per row in forward
    (shared/kernels/cross_entropy.py); the backward's two products read that gradient and are scaled by the incoming
    gradient afterwards, on their (rows x C and V x C) outputs instead of the (rows x V) logits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
        logits = x @ weight.t()  # (rows, padded V), the model's dtype
        loss, grad = torch.ops.zero3bench.cross_entropy_rows(logits, targets, vocab)
        ctx.save_for_backward(x, weight, grad)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, grad = ctx.saved_tensors
        scale = grad_out.to(x.dtype)
        grad_x = (grad @ weight) * scale if ctx.needs_input_grad[0] else None
        grad_w = (grad.t() @ x) * scale if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


def triton_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                vocab: int) -> torch.Tensor:
    """Mean cross-entropy of (x @ weight^T)[..., :vocab] against targets; x (..., C), weight (padded V, C)."""
    return LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, targets.reshape(-1), vocab)
