"""FlexAttention backend: torch.nn.attention.flex_attention over a BlockMask built from the block layout.

The BlockMask is written directly from the layout (BlockMask.from_kv_blocks, BLOCK_SIZE = the sparse block): the
diagonal blocks are "partial" blocks where the mask_mod (layout lookup & causal) is evaluated per score, the
off-diagonal layout blocks are "full" blocks that skip the mask_mod, the rest is never visited. That is the same
work split as the blocksparse kernel, so the two compare like for like. One BlockMask per (T, device), built on
first use and cached; a shorter T takes the layout's top-left sub-grid, as every backend does.

On CUDA flex_attention is compiled (torch.compile, one graph per T): eager flex_attention is a slow dense
reference implementation. Limits, each raised with the reason rather than worked around:
  - no attention dropout: FlexAttention has no dropout (score_mod sees scores, not probabilities), so training
    with attn_dropout > 0 raises ValueError;
  - on a CPU torch (2.11-2.13) has no FlexAttention backward and refuses any input that requires grad, even
    under no_grad; the forward of inputs without grad runs, eagerly (compiling it for CPU takes ~15 s per shape).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from shared.model.attention.base import Attention
from shared.model.config import GPTConfig

_COMPILED = None


def compiled_flex_attention():
    """torch.compile(flex_attention), built once per process (dynamic=False: T takes a handful of values)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def _rows_as_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask (..., n) bool -> (count (...,) int32, indices (..., n) int32: True positions first, ascending)."""
    n = mask.shape[-1]
    pos = torch.arange(n, device=mask.device).expand_as(mask)
    order = torch.where(mask, pos, pos + n).sort(dim=-1).values
    return mask.sum(dim=-1).to(torch.int32), torch.where(order < n, order, 0).to(torch.int32)


def layout_block_mask(layout: torch.Tensor, block: int, seq_len: int, device: torch.device | str) -> BlockMask:
    """BlockMask of `layout` (n_head or 1, n_blocks, n_blocks) for T = seq_len: diagonal blocks partial (causal
    mask_mod), other layout blocks full, batch broadcast (B = 1) and heads broadcast when the layout is shared."""
    nb = seq_len // block
    lay = layout[:, :nb, :nb].to(device)  # (Hl, nb, nb)
    diag = torch.eye(nb, dtype=torch.bool, device=device)
    kv_num, kv_idx = _rows_as_indices(lay & diag)
    full_num, full_idx = _rows_as_indices(lay & ~diag)
    shared_heads = lay.shape[0] == 1

    def mask_mod(b, h, q_idx, kv_idx):
        # The full token-level rule, though flex only evaluates it inside partial (diagonal) blocks.
        head = 0 if shared_heads else h
        return lay[head, q_idx // block, kv_idx // block] & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(kv_num[None], kv_idx[None], full_num[None], full_idx[None], BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))


class FlexAttention(Attention):
    """flex_attention with the layout's BlockMask; compiled on CUDA, eager forward-only on CPU."""

    backend = "flex"

    def __init__(self, cfg: GPTConfig, layout: torch.Tensor):
        super().__init__(cfg, layout)
        self._block_masks: dict[tuple[int, torch.device], BlockMask] = {}

    def block_mask(self, seq_len: int, device: torch.device) -> BlockMask:
        key = (seq_len, device)
        if key not in self._block_masks:
            self._block_masks[key] = layout_block_mask(self.layout_cpu, self.block, seq_len, device)
        return self._block_masks[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._dropout() > 0:
            raise ValueError(
                f"attention backend 'flex' has no attention dropout, but attn_dropout = {self.dropout_p} in "
                "training; train with --dropout 0 or use --attention blocksparse / sdpa / reference"
            )
        T = q.shape[-2]
        if T % self.block != 0 or T > self.layout_cpu.shape[-1] * self.block:
            raise ValueError(f"sequence length {T} must be a multiple of the sparse block {self.block} and at most "
                             f"{self.layout_cpu.shape[-1] * self.block}")
        if q.device.type == "cuda":
            fn = compiled_flex_attention()
        else:
            if any(x.requires_grad for x in (q, k, v)):
                raise ValueError(
                    f"FlexAttention has no CPU backward in torch {torch.__version__} and refuses inputs that require "
                    "grad; run it on CUDA, call it on inputs without grad (eval under torch.no_grad), or use "
                    "--attention blocksparse / reference on a CPU"
                )
            fn = flex_attention
        return fn(q, k, v, block_mask=self.block_mask(T, q.device))
