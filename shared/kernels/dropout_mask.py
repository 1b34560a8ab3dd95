"""Dropout keep masks drawn by a Triton kernel: eight 16-bit draws per Philox call where inductor draws one per element.

A compiled `residual + dropout(x + b)` (shared/model/fused_ops.bias_dropout_add) draws its mask inside the kernel
inductor generates, with one call of Philox 4x32-10 (ten rounds of 32-bit multiplies) per element for one uniform
number. At the 1.5b model's shape (32768 x 2304 bf16 per residual branch) that kernel moves the same bytes as its
backward and takes much longer (measured in docs/results.md, "The residual dropouts' masks from a Triton kernel"):
the random numbers, not the memory, bound it. Here one Philox call gives four 32-bit numbers, used as eight 16-bit
halves, one per element: an eighth of the rounds. The kernel writes only the 1-byte keep mask, and the compiled
function around it reads the mask where it would have written one: one byte per element more traffic in all.

Element i of the mask takes half i % 8 of counter i // 8: number (i % 8) // 2 of the call's four, low half for even
i, and is kept when that half is >= p * 65536. The rate applied is therefore p rounded to a multiple of 1/65536
(`applied_rate`: 0.1 -> 6554 / 65536 = 0.100006), and kept elements are scaled by 1 / (1 - applied rate): the scheme
of the block-sparse attention kernel's dropout (shared/kernels/blocksparse_attention.py), over a flat index.

The seed is a one-element int64 tensor on the mask's device, drawn from torch's generator inside the graph
(fused_ops.bias_dropout_add_triton), so the mask is a pure function of (shape, p, seed): a compiled graph may
recompute it in backward and gets the same bits, activation checkpointing's replay of the generator state draws the
same seed, and no value crosses to the host. `reference_keep_mask` is Philox 4x32-10 in NumPy, bit for bit (the
tests compare the two). On a CPU the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1 set before
triton is imported).

`dropout_keep_mask` is a torch custom operator (zero3bench::dropout_keep_mask): compiled graphs, DeepCompile's
included, call it as one opaque node.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from shared.kernels import require_cuda_or_interpreter

# (BLOCK, num_warps): mask elements a program writes (a multiple of 8; BLOCK / 8 Philox calls) and its warps. The
# autotuner picks one per size on a GPU; under the interpreter the first runs. Every one draws the same bits.
CONFIGS = [(4096, 4), (8192, 4), (16384, 8), (32768, 8), (2048, 2)]


@triton.jit
def keep_halves(r0, r1, r2, r3, t):
    """The keep bits of the eight 16-bit halves of one Philox call's four numbers (r_i[j] along the last axis, j
    the call), eight per call along that axis: number i's low half at 8 j + 2 i, its high half at 8 j + 2 i + 1, each
    kept when >= the threshold, given as t = threshold << 16 (uint32). Also the block-sparse attention's dropout."""
    # interleave(interleave(r0, r2), interleave(r1, r3)) puts r_i[j] at 4 j + i; the outer interleave puts its low
    # half at 8 j + 2 i and its high half at 8 j + 2 i + 1. Low half >= threshold is (r << 16) >= t, high half r >= t.
    r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
    return tl.interleave((r << 16) >= t, r >= t)


@triton.jit(do_not_specialize=["threshold"])  # Triton makes an int of value 1 (p = 1/65536) a constant, with no .to
def _dropout_mask(keep, seed, n, threshold, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    counters = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    r0, r1, r2, r3 = tl.randint4x(tl.load(seed), counters)
    k = keep_halves(r0, r1, r2, r3, threshold.to(tl.uint32) << 16)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(keep + offs, k.to(tl.uint8), mask=offs < n)


def interpreted() -> bool:
    return isinstance(_dropout_mask, InterpretedFunction)


_kernel = triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b, w in CONFIGS], key=["n"])(
    _dropout_mask)


def threshold(p: float) -> int:
    """The 16-bit threshold for rate p: a half is dropped when it is below this, i.e. with probability
    threshold / 65536 (p rounded to the nearest multiple of 1/65536 below 1)."""
    return min(round(float(p) * 65536), 65535)


def applied_rate(p: float) -> float:
    """The dropout rate the mask applies for p, e.g. 0.1 -> 6554 / 65536 = 0.100006."""
    return threshold(p) / 65536


def check_inputs(x: torch.Tensor, p: float, seed: torch.Tensor) -> None:
    """Raise ValueError on inputs the kernel cannot take, naming the problem, before anything runs."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_keep_mask: the rate p must be in [0, 1), got {p!r}")
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"dropout_keep_mask: the seed must be a one-element int64 tensor, got {seed.dtype} of shape "
                         f"{tuple(seed.shape)}")
    if seed.device != x.device:
        raise ValueError(f"dropout_keep_mask: the seed must be on the mask's device {x.device}, got {seed.device}")
    require_cuda_or_interpreter("dropout_keep_mask", x.device, interpreted(), "--triton_dropout")


@torch.library.custom_op("zero3bench::dropout_keep_mask", mutates_args=())
def dropout_keep_mask(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """The bool keep mask of x's shape for dropout rate p (applied_rate(p)) from the one-element int64 `seed`: the
    same mask for the same (numel, p, seed) on any device and whatever x holds."""
    check_inputs(x, p, seed)
    return _launch(x.shape, p, seed)


def _launch(shape, p: float, seed: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """The kernel, autotuned on a GPU; `config` (one of CONFIGS) is the tests' handle."""
    keep = torch.empty(shape, dtype=torch.bool, device=seed.device)
    n = keep.numel()
    if n:
        args = (keep.view(torch.uint8), seed, n, threshold(p))
        if config is not None or interpreted():  # the interpreter is too slow to tune: the first configuration
            block, warps = config or CONFIGS[0]
            _dropout_mask[(triton.cdiv(n, block),)](*args, BLOCK=block, num_warps=warps)
        else:
            _kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](*args)
    return keep


@dropout_keep_mask.register_fake
def _(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.bool, device=x.device)


_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_M32 = np.uint64(0xFFFFFFFF)


def reference_keep_mask(numel: int, p: float, seed: int) -> torch.Tensor:
    """What dropout_keep_mask draws, flat, in NumPy (the tests' reference): Philox 4x32-10 with key (seed's low,
    high word) and counter (i // 8, 0, 0, 0), its four outputs split into eight 16-bit halves."""
    calls = -(-numel // 8)
    c = [np.arange(calls, dtype=np.uint64), *(np.zeros(calls, dtype=np.uint64) for _ in range(3))]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    a, b = (np.uint64(v) for v in _PHILOX_ROUND)
    for _ in range(10):
        prod_a, prod_b = a * c[0], b * c[2]  # 32 x 32 bits: exact in 64
        c = [((prod_b >> np.uint64(32)) ^ c[1] ^ k0) & _M32, prod_b & _M32,
             ((prod_a >> np.uint64(32)) ^ c[3] ^ k1) & _M32, prod_a & _M32]
        k0, k1 = (k0 + np.uint64(_PHILOX_KEY[0])) & _M32, (k1 + np.uint64(_PHILOX_KEY[1])) & _M32
    numbers = np.stack(c, axis=1)  # (calls, 4): number i of call j at element 8 j + 2 i (low) and 8 j + 2 i + 1 (high)
    halves = np.stack([numbers & np.uint64(0xFFFF), numbers >> np.uint64(16)], axis=2).reshape(-1)
    return torch.from_numpy(halves[:numel] >= threshold(p))
