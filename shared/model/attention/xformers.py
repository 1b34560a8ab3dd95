"""xFormers backend: xformers.ops.memory_efficient_attention with the layout as an xFormers attention bias.

What can run, and why (xFormers 0.0.35, read from its source):
  - Its compiled extension (xformers/_C.so: cutlass, CK, FA3 glue) was built for torch 2.10 and does not load
    into torch 2.11+ (`xformers._cpp_lib` catches the load error). `xformers.ops.fmha.common._built_with_cuda` is
    derived from that extension's build metadata, so after the failed load *every* fmha operator reports
    "xFormers wasn't build with CUDA support" on CUDA inputs, and the dispatcher refuses them all.
  - Two operator pairs do not use that extension at all; their kernels are PyTorch's own:
      fa2F@<v>-pt / fa2B@<v>-pt   (fmha.flash, when the flash_attn package is absent and torch has flash SDPA):
                                   torch.ops.aten._flash_attention_forward/_backward, PyTorch's FlashAttention-2
      cutlassF-pt / cutlassB-pt    (fmha.cutlass): torch.ops.aten._efficient_attention_forward/_backward
    For them that reason is stale. This backend runs them through xFormers' own memory_efficient_attention
    with an explicit op pair, after lifting exactly that one reason (a subclass; every other check still runs),
    and records the pair in `self.backend` ("xformers:fa2F@2.x-pt+fa2B@2.x-pt"). The flash pair is preferred
    (faster on Ampere/Hopper); the dispatcher never chooses.
  - Nothing else is runnable: FA3 needs the separate flash_attn_3 package, CK is ROCm, cutlass-blackwell needs
    the extension. Reinstalling an xFormers wheel built for the running torch would bring its own kernels back.

Layouts: only the causal layout is an xFormers bias (LowerTriangularMask). The block-local layout is not: xFormers'
local biases (LowerTriangularFromBottomRightLocalAttentionMask and kin) are token-level sliding windows, where
query t sees keys t-w+1..t, while the block layout lets every query of block i see all of blocks i-n+1..i, so the
two key sets differ inside every block and the result would not be the reference's. Any non-causal layout raises.
benchmarks/xformers_probe.py reports, on a GPU machine, which fmha ops are available and why not.
"""

from __future__ import annotations

import functools

import torch

from shared.model import layouts
from shared.model.attention.base import Attention
from shared.model.config import GPTConfig

STALE_REASON = "xFormers wasn't build with CUDA support"  # xformers.ops.fmha.common, spelled as xFormers spells it


@functools.cache
def _lift_stale_build_check(base):
    """`base` with STALE_REASON removed from its not_supported_reasons; every other check is kept.

    The NAME gets a suffix because xFormers maps the names of its own flash ops back to its classes when it
    serializes the op for autograd (fmha._serialize_op), which would bring the check back.
    """

    class Lifted(base):
        NAME = f"{base.NAME}+torch-kernel"

        @classmethod
        def not_supported_reasons(cls, d) -> list[str]:
            return [r for r in super().not_supported_reasons(d) if r != STALE_REASON]

    Lifted.__name__ = Lifted.__qualname__ = f"Lifted{base.__module__.rsplit('.', 1)[-1]}{base.__name__}"
    return Lifted


def torch_kernel_op_pairs() -> list[tuple[type, type, str]]:
    """xFormers fmha (forward, backward) op pairs whose kernels are PyTorch's own, best first, with that kernel."""
    from xformers.ops.fmha import cutlass, flash

    pairs = []
    if getattr(flash, "_USE_PT_FLASH_ATTN", False):
        pairs.append((flash.FwOp, flash.BwOp, "torch.ops.aten._flash_attention_forward/_flash_attention_backward"))
    if (cutlass.FwOp.OPERATOR is torch.ops.aten._efficient_attention_forward
            and cutlass.BwOp.OPERATOR is torch.ops.aten._efficient_attention_backward):
        pairs.append((cutlass.FwOp, cutlass.BwOp,
                      "torch.ops.aten._efficient_attention_forward/_efficient_attention_backward"))
    return pairs


def xformers_state() -> dict:
    """What decides which xFormers ops can run here: versions, the extension's load error, the flags derived."""
    import xformers
    from xformers import _cpp_lib
    from xformers.ops.fmha import common, flash

    exc = _cpp_lib._cpp_library_load_exception
    meta = _cpp_lib._build_metadata or getattr(exc, "build_info", None)
    return {
        "xformers": xformers.__version__,
        "torch": torch.__version__,
        "extension_load_error": None if exc is None else str(exc),
        "extension_built_for_torch": meta.torch_version if meta is not None else None,
        "built_with_cuda_flag": bool(common._built_with_cuda),
        "flash_uses_torch_kernel": bool(getattr(flash, "_USE_PT_FLASH_ATTN", False)),
        "flash_version": getattr(flash, "FLASH_VERSION", None),
        "torch_flash_available": bool(torch.backends.cuda.is_flash_attention_available()),
    }


class XFormersAttention(Attention):
    """memory_efficient_attention(q, k, v, LowerTriangularMask(), p) with one fixed, recorded op pair."""

    backend = "xformers"

    def __init__(self, cfg: GPTConfig, layout: torch.Tensor):
        super().__init__(cfg, layout)
        try:
            import xformers.ops as xops
            from xformers.ops.fmha import attn_bias
        except ImportError as exc:
            raise ValueError(f"attention backend 'xformers' cannot import xformers.ops: {exc}") from exc
        if not layouts.is_causal(layout):
            raise ValueError(
                f"attention backend 'xformers' expresses only the causal layout as an attention bias, got layout "
                f"{cfg.layout!r}: xFormers' local biases are token-level sliding windows, not block windows, so "
                "they would attend to different keys than the reference; use --attention blocksparse or flex"
            )
        pairs = torch_kernel_op_pairs()
        if not pairs:
            state = xformers_state()
            raise ValueError(
                f"attention backend 'xformers' has no runnable fmha operator: xFormers {state['xformers']}'s "
                f"extension does not load into torch {state['torch']} ({state['extension_load_error']}), and neither "
                "op pair that runs on PyTorch's own kernels is usable here (flash needs "
                "torch.backends.cuda.is_flash_attention_available(), cutlass-pt needs compatible "
                "aten._efficient_attention_* schemas); install an xFormers build made for this torch"
            )
        fw, bw, self.kernel = pairs[0]
        # The forward op is checked by xFormers (minus the stale reason); the backward op is used as given:
        # xFormers skips backward checks when the op is explicit, and with dropout its flash forward insists on
        # exactly flash.BwOp.
        self._op = (_lift_stale_build_check(fw), bw)
        self.backend = f"xformers:{fw.NAME}+{bw.NAME}"
        self._mea = xops.memory_efficient_attention
        self._bias = attn_bias.LowerTriangularMask()

    @torch.compiler.disable  # xFormers' dispatch is not traceable: its ops run between compiled graphs
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.device.type != "cuda":
            raise ValueError(f"attention backend {self.backend!r} runs on CUDA tensors only, got {q.device}")
        # xFormers takes (B, T, H, D): transposed views, no copies.
        y = self._mea(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=self._bias,
                      p=self._dropout(), op=self._op)
        return y.transpose(1, 2)  # (B, H, T, D)
