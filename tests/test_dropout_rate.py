"""The attention dropout each backend applies, read back by shared/model/attention/dropout_probe.py: the probe
itself on CPU (it passes SDPA's math kernel and catches each way a kernel can apply another dropout), and every GPU
backend at the preset's rate on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.kernels import blocksparse_attention as bsa
from shared.model.attention.dropout_probe import measure_dropout

P = 0.1
SHAPE = dict(B=1, H=2, T=256, D=32)  # CPU: 8 chunks of 32 keys, 66k causal entries (sigma 0.0012 at p = 0.1)


def sdpa(p: float):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


def probe(call, dtype=torch.float32):
    return measure_dropout(call, P, dtype=dtype, device="cpu", **SHAPE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_math_applies_the_rate_it_is_given(dtype):
    r = probe(sdpa(P), dtype)
    assert r.ok(), r
    assert r.entries == 2 * 256 * 257 // 2 and r.future_nonzero == 0 and abs(r.z) < 6


def test_a_kernel_that_drops_at_another_rate_fails():
    # drops 1/8 (a 1/16-step rounding of 0.1) but scales by 1 / (1 - 0.1)
    r = probe(lambda q, k, v: sdpa(0.125)(q, k, v) * (0.875 / 0.9))
    assert not r.ok() and r.z > 10 and abs(r.scale / r.scale_expected - 1) < 1e-3


def test_a_kernel_that_scales_the_kept_entries_for_another_rate_fails():
    # drops at 0.1 but scales as if it dropped 1/16
    r = probe(lambda q, k, v: sdpa(P)(q, k, v) * (0.9 / 0.9375))
    assert not r.ok() and abs(r.z) < 6 and r.scale / r.scale_expected < 0.97


def test_a_backward_that_draws_another_mask_fails():
    class OtherMask(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return sdpa(P)(q, k, v)

        @staticmethod
        def backward(ctx, do):
            q, k, v = ctx.saved_tensors
            with torch.enable_grad():
                v = v.detach().requires_grad_()
                torch.manual_seed(999)  # another mask than the forward's
                (dv,) = torch.autograd.grad(sdpa(P)(q, k, v), v, do)
            return None, None, dv

    r = probe(OtherMask.apply)
    assert abs(r.z) < 6 and r.backward_error > 0.1 and not r.ok()


def test_a_kernel_whose_mask_is_not_drawn_from_torchs_seed_is_refused():
    gen = torch.Generator().manual_seed(0)  # its own generator: every call another mask

    def call(q, k, v):
        keep = (torch.rand(q.shape[:-1] + (q.shape[-2],), generator=gen) >= P).float() / (1 - P)
        att = torch.softmax((q @ k.transpose(-1, -2)).masked_fill(
            torch.ones(q.shape[-2], q.shape[-2]).triu(1).bool(), float("-inf")), -1)
        return (att * keep) @ v

    with pytest.raises(RuntimeError, match="another dropout mask from the same seed"):
        probe(call)


def test_a_kernel_that_leaks_future_keys_fails():
    r = probe(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=P))  # not causal
    assert r.future_nonzero > 0 and not r.ok()


def test_rates_outside_zero_one_are_refused():
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        measure_dropout(sdpa(0.0), 0.0, 1, 1, 64, 32, torch.float32, "cpu")


# --- GPU: every backend at the 1.5b preset's attention shape -----------------------------------------------------

GPU_SHAPE = dict(B=2, H=24, T=2048, D=96)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH", None])
def test_gpu_sdpa_applies_the_models_attention_dropout(kernel):
    """SDPA's kernels (None: the dispatcher's pick, the model's default) drop at p within 6 binomial sigmas, scale
    the kept entries by 1 / (1 - p), and drop in the backward what the forward dropped."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v):
        if kernel is None:
            return sdpa(P)(q, k, v)
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            return sdpa(P)(q, k, v)

    r = measure_dropout(call, P, dtype=torch.bfloat16, device="cuda", **GPU_SHAPE)
    assert r.ok(), r


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["philox", "bits"])
def test_gpu_blocksparse_applies_the_models_attention_dropout(mask):
    """The Triton kernels apply p rounded to a multiple of 1/65536 (their 16-bit threshold), in both mask modes."""
    from shared.model.attention import build_attention
    from shared.model.config import preset

    module = build_attention(preset("1.5b", attention="blocksparse", attn_dropout=P, attn_dropout_mask=mask)).cuda()
    r = measure_dropout(module.train(), P, dtype=torch.bfloat16, device="cuda", **GPU_SHAPE)
    assert r.ok(rate_tolerance=abs(bsa.applied_dropout(P) - P)), r


@pytest.mark.gpu
def test_gpu_sdpa_flash_applies_an_eight_bit_rate_and_the_record_says_so():
    """SDPA's flash kernel keeps an entry where a random byte is <= floor((1 - p) * 255): it drops 0.1016 at 0.1 and
    scales the kept ones by 1 / (1 - 0.1); applied_attention_dropout records that rate for a run that picks it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shared.model.attention import applied_attention_dropout
    from shared.model.config import preset

    def call(q, k, v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return sdpa(P)(q, k, v)

    r = measure_dropout(call, P, dtype=torch.bfloat16, device="cuda", **GPU_SHAPE)
    applied = applied_attention_dropout(preset("1.5b"), "FLASH_ATTENTION")
    assert abs(r.rate - applied) <= 6 * r.sigma and abs(r.rate - P) > 20 * r.sigma, r
    assert abs(r.scale / r.scale_expected - 1) <= 0.01 and r.backward_error <= 0.05, r


def test_the_recorded_rate_is_ps_except_where_a_kernel_applies_another():
    from shared.model.attention import applied_attention_dropout
    from shared.model.config import preset

    cfg = preset("1.5b")
    assert cfg.attn_dropout == P
    for kernel in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH", None):
        assert applied_attention_dropout(cfg, kernel) == P
    assert applied_attention_dropout(cfg, "FLASH_ATTENTION") == pytest.approx(1 - 230 / 256)
    assert applied_attention_dropout(preset("1.5b", attention="blocksparse"), None) == bsa.applied_dropout(P)
    assert applied_attention_dropout(preset("1.5b", dropout=0.0, attn_dropout=0.0), "FLASH_ATTENTION") == 0.0
