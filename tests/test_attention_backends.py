"""FlexAttention and xFormers backends: numbers against the reference where they run, clear errors where not.

On a CPU, FlexAttention runs forward only (torch has no CPU FlexAttention backward) and xFormers not at all
(its operators are CUDA kernels); both are checked on the GPU machine by the `gpu` tests. Tolerances as in
tests/test_blocksparse.py: fp32 1e-4 (summation order), bf16 2e-2 on outputs and 5e-2 on gradients (bf16 unit
roundoff 2^-8 on P, dS and the stored results).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# tests/ has no __init__.py: pytest puts it on sys.path, so the sibling module imports by its own name.
from test_blocksparse import inputs, make_layout, masked_reference

from shared.model import layouts
from shared.model.attention import build_attention
from shared.model.attention.flex import FlexAttention
from shared.model.config import GPTConfig


def flex_cfg(**overrides) -> GPTConfig:
    kw = dict(n_head=2, n_embd=128, seq_len=256, sparse_block=64, attn_dropout=0.0, attention="flex")
    return GPTConfig(**{**kw, **overrides})


# ------------------------------------------------------------------------------------------------ flex, CPU


@pytest.mark.parametrize("kind", ["causal", "local", "strided", "random"])
def test_flex_forward_matches_reference_on_cpu(kind):
    layout = make_layout(kind, 2, 4)
    attn = FlexAttention(flex_cfg(), layout).eval()
    q, k, v, _ = (x.detach() for x in inputs(1, 2, 256, 64, torch.float32, device="cpu"))
    torch.testing.assert_close(attn(q, k, v).double(), masked_reference(q, k, v, layout, 64), atol=1e-4, rtol=0)
    # a shorter sequence takes the layout's top-left sub-grid
    q2, k2, v2 = q[:, :, :128], k[:, :, :128], v[:, :, :128]
    torch.testing.assert_close(attn(q2, k2, v2).double(), masked_reference(q2, k2, v2, layout, 64), atol=1e-4,
                               rtol=0)


def test_flex_refuses_cpu_backward_with_the_reason():
    attn = FlexAttention(flex_cfg(), layouts.causal(4))
    q, k, v, _ = inputs(1, 2, 256, 64, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="no CPU backward"):
        attn(q, k, v)


def test_flex_refuses_attention_dropout_in_training():
    attn = FlexAttention(flex_cfg(attn_dropout=0.1), layouts.causal(4))
    q, k, v, _ = (x.detach() for x in inputs(1, 2, 256, 64, torch.float32, device="cpu"))
    with pytest.raises(ValueError, match="--dropout 0"):
        attn(q, k, v)
    attn.eval()  # no dropout in eval: runs
    assert attn(q, k, v).shape == q.shape


def test_build_attention_picks_flex():
    attn = build_attention(flex_cfg(layout="strided", stride_blocks=2))
    assert isinstance(attn, FlexAttention) and attn.backend == "flex"


# ------------------------------------------------------------------------------------------------ xformers, CPU


xformers_attention = pytest.importorskip("shared.model.attention.xformers")


def test_xformers_backend_records_a_torch_kernel_op_pair_or_says_why():
    cfg = GPTConfig(n_head=2, n_embd=128, seq_len=256, sparse_block=64, attention="xformers")
    pairs = xformers_attention.torch_kernel_op_pairs()
    if not pairs:
        with pytest.raises(ValueError, match="no runnable fmha operator"):
            build_attention(cfg)
        return
    attn = build_attention(cfg)
    assert isinstance(attn, xformers_attention.XFormersAttention)
    fw, bw, _ = pairs[0]
    assert attn.backend == f"xformers:{fw.NAME}+{bw.NAME}"
    q, k, v, _ = inputs(1, 2, 256, 64, torch.float16, device="cpu")
    with pytest.raises(ValueError, match="CUDA"):
        attn(q, k, v)


def test_xformers_lifts_only_the_stale_build_reason():
    from xformers.ops import fmha
    from xformers.ops.fmha import attn_bias

    pairs = xformers_attention.torch_kernel_op_pairs()
    if not pairs:
        pytest.skip("no xFormers op pair runs on torch kernels in this torch build")
    lifted = xformers_attention._lift_stale_build_check(pairs[0][0])
    x = torch.randn(1, 128, 2, 64)
    reasons = lifted.not_supported_reasons(fmha.Inputs(x, x, x, attn_bias=attn_bias.LowerTriangularMask()))
    assert xformers_attention.STALE_REASON not in reasons
    assert any("device=cpu" in r for r in reasons)  # every other check still applies


def test_xformers_refuses_layouts_it_cannot_express():
    for layout, extra in (("local", dict(local_blocks=2)), ("strided", dict(stride_blocks=2))):
        cfg = GPTConfig(n_head=2, n_embd=128, seq_len=256, sparse_block=64, attention="xformers", layout=layout,
                        **extra)
        with pytest.raises(ValueError, match="causal layout"):
            build_attention(cfg)


def test_xformers_state_explains_the_extension():
    state = xformers_attention.xformers_state()
    assert state["torch"] == torch.__version__
    assert set(state) >= {"extension_load_error", "built_with_cuda_flag", "flash_uses_torch_kernel"}


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["causal", "local", "strided", "random"])
def test_gpu_flex_matches_reference(kind):
    H = 4
    # Every layout per head, so all four share one BlockMask shape and one torch.compile graph (~20 s each).
    layout = make_layout(kind, H, 4).expand(H, 4, 4).contiguous()
    cfg = GPTConfig(n_head=H, n_embd=H * 64, seq_len=512, sparse_block=128, attn_dropout=0.0, attention="flex")
    attn = FlexAttention(cfg, layout)
    q, k, v, do = inputs(2, H, 512, 64, torch.bfloat16, seed=3)
    out = attn(q, k, v)
    out.backward(do)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = masked_reference(*ref_in, layout, 128)
    ref.backward(do.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)
    for got, want in zip((q.grad, k.grad, v.grad), ref_in):
        torch.testing.assert_close(got.double(), want.grad, atol=5e-2, rtol=0)


@pytest.mark.gpu
def test_gpu_xformers_causal_matches_sdpa():
    cfg = GPTConfig(n_head=4, n_embd=384, seq_len=1024, sparse_block=128, attn_dropout=0.0, attention="xformers")
    try:
        attn = build_attention(cfg)
    except ValueError as exc:
        pytest.skip(f"xformers backend cannot run here: {exc}")
    q, k, v, do = inputs(2, 4, 1024, 96, torch.bfloat16, seed=4)
    out = attn(q, k, v)
    out.backward(do)
    ref_in = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref.backward(do)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
    for got, want in zip((q.grad, k.grad, v.grad), ref_in):
        torch.testing.assert_close(got, want.grad, atol=5e-2, rtol=0)
