"""The block's elementwise tails, fused: bias + dropout + residual add, and bias + GELU.

Eager PyTorch runs `residual + dropout(x @ W^T + b)` as a bias epilogue in the matmul, a dropout kernel that
draws the mask, scales and writes the mask (kept for backward), and an add: separate passes over a B*T x h
activation. `bias_dropout_add` below is one torch.compile'd function: inductor emits a single kernel that adds
the bias, draws the mask from its Philox seed, scales, adds the residual and writes the output plus the 1-byte
mask that backward reuses (tests/test_fused_ops.py checks the keep-rate and that forward and backward agree on
the mask). `bias_gelu` does the same for the MLP's
`gelu(x @ W^T + b)` (Megatron's bias_gelu fusion). This is the fusion the original study could not use in
bf16 (its FusedDropout had no bf16 kernel); inductor generates it for every dtype.

Both are plain functions of tensors, called inside the module that owns the bias, so ZeRO-3's hooks have
gathered it; they take the parameters as arguments and never hold a module, so compiling them needs no
DeepSpeed cooperation. On CPU inductor emits C++ for the same graph (CI runs them there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shared.kernels.bias_gelu_grad  # noqa: F401  registers torch.ops.zero3bench.bias_gelu_grad
import shared.kernels.dropout_mask  # noqa: F401  registers torch.ops.zero3bench.dropout_keep_mask
from shared.kernels.dropout_mask import applied_rate


@torch.compile(dynamic=False)
def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(x + bias): one kernel forward, one backward; the 1-byte mask is saved for backward."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p, training)


@torch.compile(dynamic=False)
def bias_dropout_add_triton(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                            training: bool) -> torch.Tensor:
    """bias_dropout_add with its keep mask drawn by a Triton kernel (shared/kernels/dropout_mask.py: eight draws per
    Philox call, the rate p rounded to a multiple of 1/65536) from a seed drawn in the graph; the compiled kernel
    around it reads the mask, scales and adds, and backward reuses the saved mask."""
    if not training or p == 0.0:
        return residual + (x if bias is None else x + bias)
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device)
    # the op reads only x's shape: given x + bias, inductor would write that sum to memory for it and read it back
    keep = torch.ops.zero3bench.dropout_keep_mask(x, p, seed)
    if bias is not None:
        x = x + bias
    return residual + torch.where(keep, x * (1.0 / (1.0 - applied_rate(p))), 0.0)


@torch.compile(dynamic=False)
def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias) with the tanh approximation, as one kernel each way."""
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate="tanh")


class _BiasGeluOwnGrad(torch.autograd.Function):
    """gelu(x + bias) with a backward of its own (a subclass's): x and bias are saved, x + bias recomputed there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        return F.gelu(x + bias, approximate="tanh")


class _BiasGeluTritonGrad(_BiasGeluOwnGrad):
    """The whole backward as one Triton kernel (shared/kernels/bias_gelu_grad.py): the input gradient and the bias
    gradient's partial sums in one pass over the rows."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, bias = ctx.saved_tensors
        return tuple(torch.ops.zero3bench.bias_gelu_grad(grad, x, bias))


def _bias_gelu_with(function: type[_BiasGeluOwnGrad], doc: str):
    """bias_gelu compiled as the model runs it, the same forward, with `function`'s backward."""

    @torch.compile(dynamic=False)
    def bias_gelu_with(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None:
            return F.gelu(x, approximate="tanh")
        return function.apply(x, bias)

    bias_gelu_with.__doc__ = doc
    return bias_gelu_with


bias_gelu_triton_grad = _bias_gelu_with(
    _BiasGeluTritonGrad, "bias_gelu, the same forward, with the backward (input and bias gradients) as one Triton "
    "kernel.")

