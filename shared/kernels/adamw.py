"""AdamW over flat buffers in one Triton kernel: the 16-bit gradient read as it is, the 16-bit parameter copy written.

ZeRO-3's step on a sub-group of the fp32 master weights runs three passes over memory (shared/patches/zero3_step.py,
`--zero3_step fast`): the 16-bit gradient partition copied to fp32, torch's fused AdamW (reads parameter, gradient and
both moments, writes parameter and moments), and the fp32 parameters copied back into the 16-bit partition the model
gathers. `adamw_step` is all three in one pass: per element it reads the fp32 parameter, the gradient (any float
dtype, divided by an optional device scalar: the loss scale and clip factor), the two fp32 moments, and writes the
parameter, the moments and the low-precision copy. 28 bytes an element with a bf16 gradient and copy, against 40 for
the three passes (6 + 28 + 6).

The update is torch.optim.AdamW's (decoupled weight decay first, then the moments, bias corrections from the step
count, `p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`), in fp32; the step count is read from the device tensor
torch's fused AdamW keeps in its state (already incremented by the caller), so nothing waits on the host. Its
PyTorch reference is `reference_adamw_step` below (tests/test_adamw_kernel.py compares the two, and both with
torch.optim.AdamW). On a CPU the kernel runs only under the Triton interpreter (TRITON_INTERPRET=1 set before
triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK = 2048  # elements a program; the kernel is bound by memory, one pass
NUM_WARPS = 8


@triton.jit
def _adamw_kernel(param, grad, exp_avg, exp_avg_sq, param_lp, step_ptr, scale_ptr, skip_ptr, n, lr, beta1, beta2,
                  eps, weight_decay, HAS_SCALE: tl.constexpr, HAS_LP: tl.constexpr, HAS_SKIP: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_SKIP:  # a set flag leaves no element in range: nothing is read or written
        n = tl.where(tl.load(skip_ptr) != 0, 0, n)
    mask = offs < n
    step = tl.load(step_ptr).to(tl.float32)
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    p = tl.load(param + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)  # torch's lerp
    v = beta2 * v + (1.0 - beta2) * g * g
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    p = p - (lr / bias_correction1) * m / (tl.sqrt(v) / tl.sqrt(bias_correction2) + eps)
    tl.store(param + offs, p, mask=mask)
    tl.store(exp_avg + offs, m, mask=mask)
    tl.store(exp_avg_sq + offs, v, mask=mask)
    if HAS_LP:
        tl.store(param_lp + offs, p.to(param_lp.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def interpreted() -> bool:
    return isinstance(_adamw_kernel, InterpretedFunction)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               grad_scale: torch.Tensor | None = None, param_lp: torch.Tensor | None = None,
               skip: torch.Tensor | None = None) -> None:
    """One AdamW update of the flat fp32 `param` in place (and of its moments), from `grad` / `grad_scale`; writes
    the result into `param_lp` too when given. `step` is the update's count (1 for the first), a one-element tensor
    on the parameter's device. `skip`, a one-element bool tensor on that device: when it holds True the kernel
    changes nothing (an update skipped for an invalid gradient norm, decided without the host). Raises ValueError on
    inputs it cannot take, before touching anything."""
    n = param.numel()
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"adamw_step: {name} must be a contiguous 1-D float32 tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    for name, t in (("grad", grad), ("param_lp", param_lp)):
        if t is not None and (not t.is_floating_point() or t.dim() != 1 or not t.is_contiguous()):
            raise ValueError(f"adamw_step: {name} must be a contiguous 1-D float tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    shapes = {t.numel() for t in (grad, exp_avg, exp_avg_sq, param_lp) if t is not None}
    if shapes != {n}:
        raise ValueError(f"adamw_step: every buffer must hold {n} elements like param, got sizes {sorted(shapes)}")
    tensors = [t for t in (param, grad, exp_avg, exp_avg_sq, step, grad_scale, param_lp, skip) if t is not None]
    if len({t.device for t in tensors}) != 1:
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"adamw_step: every tensor must be on one device, got {devices}")
    if param.device.type != "cuda" and not interpreted():
        raise ValueError(f"adamw_step runs on CUDA tensors, got {param.device}; on a CPU set TRITON_INTERPRET=1 before "
                         "triton is imported to run it in Triton's interpreter")
    if step.numel() != 1 or (grad_scale is not None and grad_scale.numel() != 1):
        raise ValueError("adamw_step: step and grad_scale must be one-element tensors")
    if skip is not None and (skip.numel() != 1 or skip.dtype != torch.bool):
        raise ValueError(f"adamw_step: skip must be a one-element bool tensor, got {skip.dtype} {tuple(skip.shape)}")
    if not (0.0 < beta1 < 1.0 and 0.0 < beta2 < 1.0):
        raise ValueError(f"adamw_step: betas must be in (0, 1), got {beta1}, {beta2}")
    if n == 0:
        return
    lp = param_lp if param_lp is not None and param_lp.data_ptr() != param.data_ptr() else None
    skip_flag = skip.view(torch.uint8) if skip is not None else step  # Triton loads no bool pointer in its interpreter
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, lp if lp is not None else param, step,
        grad_scale if grad_scale is not None else step, skip_flag, n, float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), HAS_SCALE=grad_scale is not None, HAS_LP=lp is not None, HAS_SKIP=skip is not None,
        BLOCK=BLOCK, num_warps=NUM_WARPS)


def reference_adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, grad_scale: torch.Tensor | None = None,
                         param_lp: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
    """What adamw_step computes, in PyTorch operations (the tests' reference)."""
    if skip is not None and bool(skip):
        return
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale.float()
    t = float(step)
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt() / (1.0 - beta2**t) ** 0.5 + eps
    param.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**t))
    if param_lp is not None and param_lp.data_ptr() != param.data_ptr():
        param_lp.copy_(param)
