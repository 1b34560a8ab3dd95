"""The block's elementwise tails, fused: bias + dropout + residual add, bias + GELU, and LayerNorm.

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

`layer_norm` is liger-kernel's Triton LayerNorm (forward and backward in one kernel each): a well-kept library
kernel, CUDA only. It refuses CPU tensors with an error instead of running something else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.compile(dynamic=False)
def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(x + bias): one kernel forward, one backward; the 1-byte mask is saved for backward."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p, training)


@torch.compile(dynamic=False)
def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias) with the tanh approximation, as one kernel each way."""
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate="tanh")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """liger-kernel's fused LayerNorm; raises on CPU tensors or without liger-kernel installed."""
    if x.device.type != "cuda":
        raise RuntimeError(
            f"fused_layernorm runs liger-kernel's Triton LayerNorm, which needs a CUDA tensor; got one on "
            f"{x.device.type}. Drop --fused_layernorm on this machine."
        )
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except ImportError as e:
        raise RuntimeError(
            "fused_layernorm needs liger-kernel (pip install liger-kernel==0.8.5); it is not importable: " + str(e)
        ) from e
    return LigerLayerNormFunction.apply(x, weight, bias, eps)
