"""The block-sparse backend: the fused Triton kernel (shared/kernels/blocksparse_attention.py) behind the Attention
interface. The kernel module is the operation only; the lookup table of this model's layout is built here, once."""

from __future__ import annotations

import torch

from shared.kernels.blocksparse_attention import BlockLUT, blocksparse_attention, check_block, draw_seed, split_head_dim
from shared.model.attention.base import Attention
from shared.model.config import GPTConfig


class BlockSparseAttention(Attention):
    """The fused block-sparse kernel behind the Attention interface; the lookup table is built here, once."""

    backend = "blocksparse"

    def __init__(self, cfg: GPTConfig, layout: torch.Tensor):
        super().__init__(cfg, layout)
        check_block(cfg.sparse_block)
        split_head_dim(cfg.head_dim)
        self.lut = BlockLUT.from_layout(layout, cfg.sparse_block)
        self.dropout_mask = cfg.attn_dropout_mask
        if self.dropout_mask != "philox":
            self.backend = f"blocksparse:{self.dropout_mask}"
        self._device_luts: dict[torch.device, BlockLUT] = {}

    def lut_on(self, device: torch.device) -> BlockLUT:
        if device not in self._device_luts:
            self._device_luts[device] = self.lut.to(device)
        return self._device_luts[device]

    # Inside a compiled block (--compile blocks) the kernel runs as it is, between two compiled graphs: dynamo
    # would otherwise trace into the Triton launcher and the seed's .item() (under TRITON_INTERPRET it cannot).
    # The break is counted in the result's dynamo_graph_breaks.
    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self._dropout()
        seed = draw_seed() if p > 0 else 0
        return blocksparse_attention(q, k, v, self.lut_on(q.device), p, seed, dropout_mask=self.dropout_mask)
