"""Measure the dropout an attention call really applies: the rate of dropped probabilities and the scale of the kept
ones, read back from the call's own output.

With q = k = 0 every causal row r of the attention matrix is uniform, P[r, j] = 1 / (r + 1) for j <= r, so an
attention call with dropout returns A[r, j] = P[r, j] * keep[r, j] * s, s being the kept entries' scale
(1 / (1 - p) where the kernel applies rate p). Taking v = one-hot columns (key j -> channel j - c * D in chunk c)
reads A back one chunk of D keys at a time: out[b, h, r, d] = A[r, c * D + d]. Every chunk's call is made from the
same generator state, so a kernel that draws its mask from torch's generator (SDPA's flash, efficient and cuDNN
kernels; this project's Triton kernels through `draw_seed`) draws the same mask in each; the probe checks that by
repeating the first chunk, and refuses a kernel whose mask changes between calls.

Why: some cuDNN attention kernels are reported to quantize the dropout rate (steps of 1/16); a kernel applying
another rate than the model's trains another model than the one a figure names. tests/test_dropout_rate.py runs
this on the GPU for every backend; benchmarks/attention_dropout_rate.py records it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

AttentionCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AppliedDropout:
    """What one attention call applied, counted over every causal entry (j <= r) of B * H rows of T."""

    p: float  # the rate asked for
    entries: int  # causal entries counted
    dropped: int  # of them, dropped (read back as exactly zero)
    rate: float  # dropped / entries
    sigma: float  # binomial standard deviation of `rate` at p: sqrt(p (1 - p) / entries)
    z: float  # (rate - p) / sigma
    scale: float  # the kept entries' median scale (1 / (1 - p) where the kernel applies p)
    scale_expected: float  # 1 / (1 - p)
    future_nonzero: int  # entries above the diagonal (j > r) that were not zero: must be 0 for a causal kernel
    backward_error: float  # max |dv - A^T dO| / max |A^T dO|: ~1e-2 (bf16) where the backward drops what the
    # forward dropped, about 0.3 where it draws another mask

    def ok(self, z_max: float = 6.0, rate_tolerance: float = 0.0, scale_rtol: float = 0.01,
           backward_tolerance: float = 0.05) -> bool:
        """The rate is p within z_max binomial sigmas (plus `rate_tolerance`, e.g. a kernel's known rounding), the
        kept entries are scaled by 1 / (1 - p) within scale_rtol, nothing above the diagonal leaked, and the
        backward applied the forward's mask (backward_error within `backward_tolerance`, bf16's rounding)."""
        return (abs(self.rate - self.p) <= z_max * self.sigma + rate_tolerance
                and abs(self.scale / self.scale_expected - 1) <= scale_rtol and self.future_nonzero == 0
                and self.backward_error <= backward_tolerance)

    def to_dict(self) -> dict:
        return asdict(self)


def one_hot_values(B: int, H: int, T: int, D: int, chunk: int, dtype, device) -> torch.Tensor:
    """v of chunk `chunk`: key j = chunk * D + d carries the unit vector e_d, every other key zero."""
    v = torch.zeros(B, H, T, D, dtype=dtype, device=device)
    keys = torch.arange(chunk * D, min((chunk + 1) * D, T), device=device)
    v[:, :, keys, keys - chunk * D] = 1
    return v


def measure_dropout(attn: AttentionCall, p: float, B: int, H: int, T: int, D: int, dtype: torch.dtype,
                    device: torch.device | str, seed: int = 1234) -> AppliedDropout:
    """Run `attn(q, k, v)` (causal, dropout p inside) ceil(T / D) times with q = k = 0 and one-hot v, and count what
    it dropped and how it scaled the rest (see the module docstring). q/k/v are (B, H, T, D) views of a (B, T, H, D)
    tensor, as the model passes them. RuntimeError if the call's mask is not reproducible from torch's seed."""
    if not 0 < p < 1:
        raise ValueError(f"the dropout rate must be in (0, 1) to be measured, got {p}")
    device = torch.device(device)
    qk = torch.zeros(B, T, H, D, dtype=dtype, device=device).transpose(1, 2)

    def call(chunk: int, grad_out: torch.Tensor | None = None):
        v = one_hot_values(B, H, T, D, chunk, dtype, device).transpose(1, 2).contiguous().transpose(1, 2)
        v.requires_grad_(grad_out is not None)
        torch.manual_seed(seed)  # seeds the CUDA generators too: every chunk draws the same mask
        with torch.set_grad_enabled(grad_out is not None):
            out = attn(qk, qk, v)  # (B, H, T, D)
        if grad_out is None:
            return out.float()
        (dv,) = torch.autograd.grad(out, v, grad_out)
        return out.detach().float(), dv.float()

    chunks = math.ceil(T / D)
    grad_out = torch.randn(B, H, T, D, generator=torch.Generator(device).manual_seed(seed), device=device,
                           dtype=dtype)
    first, dv = call(0, grad_out)
    if not torch.equal(first, call(0)):
        raise RuntimeError("the attention call drew another dropout mask from the same seed: its rate cannot be read "
                           "back chunk by chunk")
    rows = torch.arange(T, device=device)
    dropped = entries = future = 0
    scales = []
    A = torch.zeros(B, H, T, T, device=device)  # the dropped, scaled probabilities the forward applied
    for c in range(chunks):
        out = first if c == 0 else call(c)
        keys = torch.arange(c * D, min((c + 1) * D, T), device=device)
        A[..., keys] = out[..., : keys.numel()]
        a = out[..., : keys.numel()] * (rows + 1).view(1, 1, T, 1)  # P[r, j] = 1 / (r + 1): kept entries read s
        causal = (keys.view(1, -1) <= rows.view(-1, 1)).expand_as(a)
        future += int((a[~causal] != 0).sum())
        kept = a[causal]
        entries += kept.numel()
        dropped += int((kept == 0).sum())
        nonzero = kept[kept != 0]
        if nonzero.numel():  # a bounded sample per chunk for the median
            scales.append(nonzero[:: max(1, nonzero.numel() // 100_000)])
    rate = dropped / entries
    sigma = math.sqrt(p * (1 - p) / entries)
    scale = float(torch.cat(scales).median()) if scales else 0.0
    expected_dv = A.transpose(-1, -2) @ grad_out.float()  # dv[j] = sum_r A[r, j] dO[r]
    backward_error = float((dv - expected_dv).abs().max() / expected_dv.abs().max())
    return AppliedDropout(p=p, entries=entries, dropped=dropped, rate=rate, sigma=sigma, z=(rate - p) / sigma,
                          scale=scale, scale_expected=1 / (1 - p), future_nonzero=future,
                          backward_error=backward_error)
