"""The backward of gelu(x + bias) in one Triton kernel: the input gradient and the bias gradient's partial sums.

The MLP's up projection ends in gelu(x + b) (tanh approximation), x of B*T rows by 4 x hidden. Its backward needs
dz = dy * gelu'(x + b), written once, and db = the sum of dz over all B*T rows. Inductor generates the two as one
reduction kernel over the rows, which at the 1.5b model's shape (32768 x 9216, bf16) runs well below the memory
bandwidth (measured in docs/results.md, "Levers on top of DeepCompile"). Here each program takes a strip of ROWS rows
by BLOCK_N columns: it reads dy and x once, writes dz, and keeps the strip's column sums in fp32 registers, stored as
one row of a small fp32 buffer of partial sums; the bias gradient is that buffer's sum over its rows (a few MB). Per
element: 2 reads, 1 write, the floor of any implementation.

gelu' is torch's `gelu_backward` with approximate="tanh", in fp32; the partial sums add the fp32 dz before it is
rounded to the output dtype, as inductor's fused kernel does. `reference_bias_gelu_grad` is the same computation in
PyTorch operations (the tests compare the two). On a CPU the kernel runs only under Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported).

`bias_gelu_grad` is a torch custom operator (zero3bench::bias_gelu_grad): compiled graphs call it as one opaque node,
so it runs the same whether the model is eager, compiled per block or compiled whole under DeepCompile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from shared.kernels import require_cuda_or_interpreter

# (ROWS, BLOCK_M, BLOCK_N, num_warps): rows a program sums, rows a tile, columns a tile. The autotuner picks one per
# (rows, columns) on a GPU; under the interpreter the first runs.
CONFIGS = [(256, 32, 128, 4), (512, 32, 128, 4), (256, 16, 256, 4), (128, 32, 128, 4), (512, 64, 128, 8),
           (256, 64, 64, 4)]
MIN_ROWS = min(c[0] for c in CONFIGS)  # the partial-sum buffer has a row per strip of the smallest ROWS
assert all(c[0] % MIN_ROWS == 0 for c in CONFIGS)


@triton.jit
def _bias_gelu_grad(dy, x, bias, dz, partial, M, N, G, stride_dy, stride_x, stride_dz, MIN_ROWS: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b = tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in range(0, ROWS, BLOCK_M):
        rows = (pid_m * ROWS + r + tl.arange(0, BLOCK_M)).to(tl.int64)
        ok = (rows < M)[:, None] & col_ok[None, :]
        g = tl.load(dy + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        z = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32) + b[None, :]
        z2 = z * z  # gelu'(z), tanh approximation: sqrt(2 / pi) = 0.7978845608028654, kappa = 0.044715
        t = 2.0 * tl.sigmoid(2.0 * 0.7978845608028654 * (z + 0.044715 * z2 * z)) - 1.0  # tanh of the inner term
        d = g * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z2))
        d = tl.where(ok, d, 0.0)
        tl.store(dz + rows[:, None] * stride_dz + cols[None, :], d.to(dz.dtype.element_ty), mask=ok)
        acc += tl.sum(d, axis=0)
    # the buffer has a row per MIN_ROWS rows of x (G in all): this strip's sum goes into its first row, zeros into
    # the others it covers, so every launch writes every row whatever its ROWS (the autotuner's trials included)
    first = pid_m * (ROWS // MIN_ROWS)
    tl.store(partial + first * N + cols, acc, mask=col_ok)
    zero = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(1, ROWS // MIN_ROWS):
        tl.store(partial + (first + k) * N + cols, zero, mask=col_ok & (cols * 0 + first + k < G))


def interpreted() -> bool:
    return isinstance(_bias_gelu_grad, InterpretedFunction)


_kernel = triton.autotune(
    configs=[triton.Config({"ROWS": r, "BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w) for r, bm, bn, w in CONFIGS],
    key=["M", "N"],
)(_bias_gelu_grad)


def _launch(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, config: tuple | None = None,
            partial: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel, autotuned on a GPU; `config` (one of CONFIGS) and `partial` (the (G, N) fp32 buffer, whatever it
    holds) are the tests' handles: a launch must overwrite every row of the buffer."""
    n = x.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    bias = bias.contiguous()  # the kernel reads column c's bias at bias + c
    m = x2.shape[0]
    dz = torch.empty((m, n), dtype=x.dtype, device=x.device)
    g = triton.cdiv(m, MIN_ROWS)
    if partial is None:
        partial = torch.empty((g, n), dtype=torch.float32, device=x.device)
    if m and n:
        args = (dy2, x2, bias, dz, partial, m, n, g, dy2.stride(0), x2.stride(0), dz.stride(0), MIN_ROWS)
        if config is not None or interpreted():  # the interpreter is too slow to tune: the first configuration
            rows, bm, bn, warps = config or CONFIGS[0]
            _bias_gelu_grad[(triton.cdiv(m, rows), triton.cdiv(n, bn))](*args, ROWS=rows, BLOCK_M=bm, BLOCK_N=bn,
                                                                       num_warps=warps)
        else:
            _kernel[lambda meta: (triton.cdiv(m, meta["ROWS"]), triton.cdiv(n, meta["BLOCK_N"]))](*args)
    return dz.view(x.shape), partial.sum(0).to(bias.dtype)


def check_inputs(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> None:
    """Raise ValueError on inputs the kernel cannot take, naming the problem, before anything runs."""
    if dy.shape != x.shape:
        raise ValueError(f"bias_gelu_grad: the output gradient's shape {tuple(dy.shape)} differs from the input's "
                         f"{tuple(x.shape)}")
    if x.dim() < 1 or bias.shape != (x.shape[-1],):
        raise ValueError(f"bias_gelu_grad: bias must have shape ({x.shape[-1] if x.dim() else '?'},), one entry per "
                         f"column of x {tuple(x.shape)}; got {tuple(bias.shape)}")
    if not all(t.is_floating_point() for t in (dy, x, bias)):
        raise ValueError(f"bias_gelu_grad takes floating-point tensors, got {dy.dtype}, {x.dtype}, {bias.dtype}")
    if len({t.device for t in (dy, x, bias)}) != 1:
        raise ValueError(f"bias_gelu_grad: every tensor must be on one device, got {dy.device}, {x.device}, "
                         f"{bias.device}")
    require_cuda_or_interpreter("bias_gelu_grad", x.device, interpreted(), "--triton_gelu_grad")


@torch.library.custom_op("zero3bench::bias_gelu_grad", mutates_args=())
def bias_gelu_grad(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, db) of y = gelu(x + bias, approximate="tanh") given dy: dz = dy * gelu'(x + bias) in x's dtype, db its
    sum over every row of x (fp32 partial sums), in bias's dtype."""
    check_inputs(dy, x, bias)
    return _launch(dy, x, bias)


@bias_gelu_grad.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias)


def reference_bias_gelu_grad(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """What bias_gelu_grad computes, in PyTorch operations (the tests' reference): fp32 throughout, dz rounded to
    x's dtype at the end, db summed from the unrounded fp32 dz (float64 inputs stay in float64)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    z = x.to(ct) + bias.to(ct)
    d = torch.ops.aten.gelu_backward(dy.to(ct), z, approximate="tanh")
    return d.to(x.dtype), d.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)
