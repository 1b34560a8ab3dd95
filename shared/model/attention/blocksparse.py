"""The block-sparse backend: the fused Triton kernel (shared/kernels/blocksparse_attention.py) behind the Attention
interface. The kernel module is the operation only; the lookup table of this model's layout is built here, once."""

from __future__ import annotations

import dataclasses

import torch

from shared.kernels import blocksparse_attention as bsa
from shared.kernels.blocksparse_attention import BlockLUT, blocksparse_attention, check_block, draw_seed, split_head_dim
from shared.model.attention.base import Attention
from shared.model.config import GPTConfig


class BlockSparseAttention(Attention):
    """The fused block-sparse kernel behind the Attention interface. The lookup table is built here, once, on the
    CPU; its tensors are buffers (not saved in the state dict), so they follow the module to its device like the
    reference backend's mask.

    The kernel is a torch custom op: under torch.compile (--compile blocks, DeepCompile) it is one node of the
    graph, with no break. Its dropout seed is drawn per call on the device by a random op of the same graph
    (`draw_seed`)."""

    backend = "blocksparse"

    def __init__(self, cfg: GPTConfig, layout: torch.Tensor):
        super().__init__(cfg, layout)
        check_block(cfg.sparse_block)
        split_head_dim(cfg.head_dim)
        self.lut = BlockLUT.from_layout(layout, cfg.sparse_block)
        # Created as the model's other buffers are (GPT.pos, the reference backend's mask): on the device that
        # deepspeed.zero.Init (which patches torch.empty) or a default-device context gives, else the CPU; ZeRO-3's
        # engine does not move a model zero.Init built.
        for name in bsa.LUT_TENSORS:
            table = getattr(self.lut, name)
            self.register_buffer(f"lut_{name}", torch.empty(table.shape, dtype=table.dtype).copy_(table),
                                 persistent=False)
        self.dropout_mask = cfg.attn_dropout_mask
        if self.dropout_mask != "philox":
            self.backend = f"blocksparse:{self.dropout_mask}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self._dropout()
        lut = dataclasses.replace(self.lut, **{name: getattr(self, f"lut_{name}") for name in bsa.LUT_TENSORS})
        seed = draw_seed(q.device) if p > 0 else 0
        return blocksparse_attention(q, k, v, lut, p, seed, dropout_mask=self.dropout_mask)
