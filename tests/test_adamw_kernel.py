"""The AdamW kernel (shared/kernels/adamw.py) against its PyTorch reference and torch.optim.AdamW.

On a CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); the GPU test runs it compiled,
with the bf16 gradient and parameter copy of a ZeRO-3 sub-group.
"""

from __future__ import annotations

import pytest
import torch

from shared.kernels.adamw import BLOCK, adamw_step, reference_adamw_step

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _state(n, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(device)
    return p, torch.zeros(n, device=device), torch.zeros(n, device=device), torch.zeros((), device=device)


@pytest.mark.parametrize("n", [1, 1000, 2 * BLOCK + 3])  # one element, one ragged program, several programs
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_matches_torch_adamw_over_steps(n, scaled):
    """Three steps, fp32 throughout: the kernel, its reference and torch's AdamW (non-fused) agree."""
    p, m, v, step = _state(n)
    ref_p, ref_m, ref_v, ref_step = (t.clone() for t in (p, m, v, step))
    torch_p = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([torch_p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"])
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grad = torch.randn(n, generator=gen)
        scale = torch.tensor(4.0) if scaled else None
        step += 1
        ref_step += 1
        adamw_step(p, grad, m, v, step, grad_scale=scale, **HYPER)
        reference_adamw_step(ref_p, grad, ref_m, ref_v, ref_step, grad_scale=scale, **HYPER)
        torch_p.grad = grad / 4.0 if scaled else grad
        opt.step()
    torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, ref_m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, ref_v, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(p, torch_p.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, opt.state[torch_p]["exp_avg"], rtol=1e-6, atol=1e-7)
    assert float(step) == 3.0


@pytest.mark.parametrize("dtype, mantissa", [(torch.bfloat16, 7), (torch.float16, 10)])  # --precision bf16 / fp16
def test_kernel_reads_a_16_bit_gradient_and_writes_the_16_bit_copy(dtype, mantissa):
    n = 3000
    p, m, v, step = _state(n)
    ref = [t.clone() for t in (p, m, v, step)]
    grad = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
    lp, ref_lp = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    step += 1
    ref[3] += 1
    adamw_step(p, grad, m, v, step, param_lp=lp, grad_scale=torch.tensor(1024.0), **HYPER)
    reference_adamw_step(ref[0], grad, ref[1], ref[2], ref[3], param_lp=ref_lp, grad_scale=torch.tensor(1024.0),
                         **HYPER)
    torch.testing.assert_close(p, ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, ref[1], rtol=1e-6, atol=1e-9)
    # the copy is the updated fp32 parameter in 16 bits: rounded to nearest on a GPU (the GPU test checks bf16 bit for
    # bit); Triton's interpreter may truncate instead, so here it is within one step of the format of it
    assert ((lp.float() - p).abs() <= p.abs() * 2**-mantissa).all()
    assert ((ref_lp.float() - p).abs() <= p.abs() * 2**-(mantissa + 1)).all()


def test_the_copy_is_skipped_when_it_is_the_parameter_itself():
    p, m, v, step = _state(100)
    step += 1
    expected = p.clone()
    reference_adamw_step(expected, torch.ones(100), m.clone(), v.clone(), step.clone(), **HYPER)
    adamw_step(p, torch.ones(100), m, v, step, param_lp=p, **HYPER)  # fp32 model: the "16-bit" copy aliases p
    torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("skipped", [False, True])
def test_a_set_skip_flag_leaves_everything_as_it_was(skipped):
    """skip (a device flag: the gradient norm was invalid) masks the whole update, the 16-bit copy's too; unset, the
    update is the one without the flag."""
    n = 2 * BLOCK + 5
    p, m, v, step = _state(n)
    m += 0.5
    lp = torch.full((n,), 7.0, dtype=torch.bfloat16)
    grad = torch.full((n,), float("nan"))
    grad[1:] = torch.randn(n - 1, generator=torch.Generator().manual_seed(4))
    grad = grad if skipped else grad.nan_to_num()
    expected = [t.clone() for t in (p, m, v, lp)]
    step += 1
    if not skipped:
        reference_adamw_step(expected[0], grad, expected[1], expected[2], step, param_lp=expected[3], **HYPER)
    adamw_step(p, grad, m, v, step, param_lp=lp, skip=torch.tensor(skipped), **HYPER)
    if skipped:  # bit for bit what it was, although the gradient holds a NaN
        assert all(torch.equal(a, b) for a, b in zip((p, m, v, lp), expected, strict=True))
    else:
        torch.testing.assert_close(p, expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m, expected[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, expected[2], rtol=1e-5, atol=1e-9)
        assert not torch.equal(lp, expected[3])


def test_bad_inputs_are_refused_before_anything_changes():
    p, m, v, step = _state(10)
    before = p.clone()
    with pytest.raises(ValueError, match="every buffer must hold 10 elements"):
        adamw_step(p, torch.ones(9), m, v, step, **HYPER)
    with pytest.raises(ValueError, match="exp_avg must be a contiguous 1-D float32"):
        adamw_step(p, torch.ones(10), m.bfloat16(), v, step, **HYPER)
    with pytest.raises(ValueError, match="param must be a contiguous 1-D float32"):
        adamw_step(p.view(2, 5), torch.ones(10), m, v, step, **HYPER)
    with pytest.raises(ValueError, match="step and grad_scale must be one-element"):
        adamw_step(p, torch.ones(10), m, v, torch.zeros(2), **HYPER)
    with pytest.raises(ValueError, match="betas must be in"):
        adamw_step(p, torch.ones(10), m, v, step, **{**HYPER, "beta2": 1.0})
    with pytest.raises(ValueError, match="skip must be a one-element bool tensor"):
        adamw_step(p, torch.ones(10), m, v, step, skip=torch.tensor(1.0), **HYPER)
    assert torch.equal(p, before) and not m.any() and not v.any()


@pytest.mark.gpu
def test_gpu_kernel_matches_the_reference_with_bf16_gradient_and_copy():
    dev = torch.device("cuda")
    n = 5_000_003  # several thousand programs and a ragged last one
    p, m, v, step = _state(n, dev)
    ref_p, ref_m, ref_v, ref_step = (t.clone() for t in (p, m, v, step))
    lp, ref_lp = torch.empty(n, dtype=torch.bfloat16, device=dev), torch.empty(n, dtype=torch.bfloat16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    for _ in range(3):
        grad = torch.randn(n, generator=gen, device=dev).bfloat16()
        scale = torch.tensor(2.5, device=dev)
        step += 1
        ref_step += 1
        adamw_step(p, grad, m, v, step, grad_scale=scale, param_lp=lp, **HYPER)
        reference_adamw_step(ref_p, grad, ref_m, ref_v, ref_step, grad_scale=scale, param_lp=ref_lp, **HYPER)
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, ref_m, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v, ref_v, rtol=1e-5, atol=1e-9)
    assert torch.equal(lp, p.bfloat16())
    # a copy rounded from fp32 values a few ulp apart may differ in a rare last bf16 bit
    assert (lp != ref_lp).float().mean() < 1e-3
