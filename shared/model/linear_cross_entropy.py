"""The LM head's matmul and its cross-entropy around the Triton loss kernel (--triton_loss): LinearCrossEntropy.

Tests: tests/test_cross_entropy.py, against F.cross_entropy of the same logits.
"""

from __future__ import annotations

import torch

import shared.kernels.cross_entropy  # noqa: F401  registers torch.ops.zero3bench.cross_entropy_rows


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
