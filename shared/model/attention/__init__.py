"""Attention backends behind one call: `attn(q, k, v) -> y`, q/k/v/y of shape (B, n_head, T, head_dim).

The backend is chosen once, at construction (`build_attention(cfg)`), from cfg.attention:
  reference    plain masked attention over any block layout: the numerical definition every test compares to
  sdpa         torch scaled_dot_product_attention, dense causal (only the causal layout)
  blocksparse  our fused Triton kernel (shared/kernels/blocksparse_attention.py) behind blocksparse.py
  flex         PyTorch FlexAttention with a BlockMask built from the same layout
  xformers     xformers.ops.memory_efficient_attention with the layout as an attention bias

The base class and reference/sdpa live in base.py, below every backend; each backend module imports only base.py,
and is imported here on demand, so the import graph has no circle. No backend falls back to another: one that
cannot run raises with the reason, and `module.backend` names what runs.
"""

from __future__ import annotations

from shared.model import layouts
from shared.model.attention.base import (
    Attention,
    ReferenceAttention,
    SDPAttention,
    applied_attention_dropout,
    sdpa_kernel,
)
from shared.model.config import GPTConfig

__all__ = ["Attention", "ReferenceAttention", "SDPAttention", "applied_attention_dropout", "build_attention",
           "sdpa_kernel"]


def build_attention(cfg: GPTConfig) -> Attention:
    """The attention module for cfg.attention over cfg's layout (validated here, once)."""
    layout = layouts.make_layout(cfg)
    if cfg.attention == "reference":
        return ReferenceAttention(cfg, layout)
    if cfg.attention == "sdpa":
        return SDPAttention(cfg, layout)
    if cfg.attention == "blocksparse":
        from shared.model.attention.blocksparse import BlockSparseAttention

        return BlockSparseAttention(cfg, layout)
    if cfg.attention == "flex":
        from shared.model.attention.flex import FlexAttention

        return FlexAttention(cfg, layout)
    if cfg.attention == "xformers":
        from shared.model.attention.xformers import XFormersAttention

        return XFormersAttention(cfg, layout)
    raise ValueError(f"unknown attention backend {cfg.attention!r}")
