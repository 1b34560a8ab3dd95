"""The attention interface and the two backends every build has: the base class, reference and sdpa.

The other backends (shared/model/attention/blocksparse.py, flex.py, xformers.py) import only this module; the
package's build_attention imports them on demand.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shared.model import layouts
from shared.model.config import GPTConfig


class Attention(nn.Module):
    """Base: holds the layout and the dropout rate; subclasses implement forward(q, k, v)."""

    backend = "?"

    def __init__(self, cfg: GPTConfig, layout: torch.Tensor):
        super().__init__()
        self.dropout_p = cfg.attn_dropout
        self.block = cfg.sparse_block
        self.layout_cpu = layout  # plain attribute, not a buffer: never partitioned, saved or moved by DeepSpeed

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0


class ReferenceAttention(Attention):
    """softmax(q k^T / sqrt(d) + mask) v in fp32 (fp64 for fp64 inputs), with the layout's token mask.

    O(T^2) memory: the numerical definition for tests, not a training backend for long sequences.
    """

    backend = "reference"

    def __init__(self, cfg: GPTConfig, layout: torch.Tensor):
        super().__init__(cfg, layout)
        self.register_buffer("mask", layouts.token_mask(layout, cfg.sparse_block), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[-2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)
        att = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale  # (B, H, T, T)
        att = att.masked_fill(~self.mask[:, :T, :T], float("-inf"))
        att = torch.softmax(att, dim=-1)
        att = F.dropout(att, p=self._dropout(), training=True)
        return (att @ v.to(acc)).to(q.dtype)


class SDPAttention(Attention):
    """torch.nn.functional.scaled_dot_product_attention with is_causal=True (flash / cuDNN / efficient kernels)."""

    backend = "sdpa"

    def __init__(self, cfg: GPTConfig, layout: torch.Tensor):
        super().__init__(cfg, layout)
        if not layouts.is_causal(layout):
            raise ValueError(
                f"attention backend 'sdpa' computes dense causal attention only, but layout {cfg.layout!r} is "
                "sparse; use --attention blocksparse, flex or reference for sparse layouts"
            )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self._dropout(), is_causal=True)


def sdpa_kernel(cfg: GPTConfig, batch: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """The kernel torch's SDPA dispatcher picks for this model's training call: q/k/v of shape (batch, n_head,
    seq_len, head_dim) laid out as the model's (a transposed (B, T, H, D) view), `dtype`, its attention dropout,
    causal. FLASH_ATTENTION / EFFICIENT_ATTENTION / CUDNN_ATTENTION / MATH, as torch names them (on CPU, MATH with
    dropout, its flash CPU kernel without); None when cfg.attention is not sdpa. What torch reports, never a guess:
    if the private dispatcher call fails, the reason is recorded instead."""
    if cfg.attention != "sdpa":
        return None
    try:
        from torch.nn.attention import SDPBackend

        q = torch.empty(batch, cfg.seq_len, cfg.n_head, cfg.head_dim, dtype=dtype, device=device).transpose(1, 2)
        return SDPBackend(torch._fused_sdp_choice(q, q, q, dropout_p=cfg.attn_dropout, is_causal=True)).name
    except Exception as exc:  # a private API: say why it is unknown rather than fail the run
        return f"unknown ({type(exc).__name__}: {exc})"


def applied_attention_dropout(cfg: GPTConfig, kernel: str | None) -> float:
    """The attention dropout rate the model's kernel applies where cfg.attn_dropout is asked for, as the GPU test
    tests/test_dropout_rate.py measures it (counts of dropped entries; docs/kernels.md): SDPA's cuDNN, efficient and
    math kernels apply p; its flash kernel keeps a probability where a random byte is at most floor((1 - p) * 255),
    so it drops 1 - (floor((1 - p) * 255) + 1) / 256 (0.1 -> 0.1016) while it scales the kept ones by 1 / (1 - p);
    the block-sparse kernels apply p rounded to a multiple of 1/65536. `kernel`: sdpa_kernel's answer."""
    p = cfg.attn_dropout
    if p == 0:
        return 0.0
    if cfg.attention == "blocksparse":
        from shared.kernels.blocksparse_attention import applied_dropout

        return applied_dropout(p)
    if cfg.attention == "sdpa" and kernel == "FLASH_ATTENTION":
        return 1 - (math.floor((1 - p) * 255) + 1) / 256
    return p
