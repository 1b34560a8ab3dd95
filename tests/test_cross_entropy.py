"""The LM head's cross-entropy kernel (shared/kernels/cross_entropy.py) against its PyTorch reference and autograd.

On a CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); the GPU test runs it compiled
and autotuned, in bf16 at the 1.5b model's shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.kernels.cross_entropy import CONFIGS, cross_entropy_rows, reference_cross_entropy_rows
from shared.model.config import preset
from shared.model.linear_cross_entropy import triton_linear_cross_entropy
from tests.helpers import assert_refused_without_interpreter

BLOCK = CONFIGS[0][0]


def _logits(rows, cols, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (3 * torch.randn(rows, cols, generator=g, device=device)).to(dtype)
    return logits


@pytest.mark.parametrize("rows, vocab, padded", [(1, 1, 1), (5, 257, 384), (3, BLOCK + 5, BLOCK + 5),
                                                 (4, 2 * BLOCK, 2 * BLOCK + 64)],
                         ids=["one", "padded", "ragged_block", "two_blocks_padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_its_reference(rows, vocab, padded, dtype):
    logits = _logits(rows, padded, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))
    loss, grad = cross_entropy_rows(logits, targets, vocab)
    ref_loss, ref_grad = reference_cross_entropy_rows(logits, targets, vocab)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert not grad[:, vocab:].any()  # the padding is outside the softmax: no gradient


def test_strided_logits_and_targets_give_the_numbers_of_contiguous_ones():
    """Column-major logits and a view of every other target (stride 2): each row's loss and gradient are those of
    the same values laid out contiguously, not of a neighbour's target."""
    logits = _logits(40, 4, torch.float32).t()  # (4, 40), stride (1, 4)
    targets = torch.randint(0, 33, (8,), generator=torch.Generator().manual_seed(4))[::2]
    loss, grad = cross_entropy_rows(logits, targets, 33)
    ref_loss, ref_grad = reference_cross_entropy_rows(logits.contiguous(), targets.contiguous(), 33)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_the_reference_is_autograd_of_the_mean_cross_entropy():
    logits = _logits(6, 40, torch.float64).requires_grad_()
    targets = torch.randint(0, 33, (6,), generator=torch.Generator().manual_seed(2))
    mean = F.cross_entropy(logits[:, :33], targets)
    (expected,) = torch.autograd.grad(mean, logits)
    loss, grad = reference_cross_entropy_rows(logits.detach(), targets, 33)
    torch.testing.assert_close(loss.mean(), mean.detach())
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("padded", [257, 384])
def test_the_linear_and_loss_train_like_autograd_of_the_models_loss(padded):
    """triton_linear_cross_entropy (the head's weight padded or not) against F.cross_entropy of the same logits:
    the loss and both gradients, fp32; the padding rows of the weight get no gradient."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    w = torch.randn(padded, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 257, (2, 9), generator=g)
    loss = triton_linear_cross_entropy(x, w, targets, 257)
    ref = F.cross_entropy((x @ w.t())[..., :257].reshape(-1, 257), targets.reshape(-1))
    torch.testing.assert_close(loss, ref)
    go = torch.tensor(0.5)
    for got, exp in zip(torch.autograd.grad(loss, (x, w), go), torch.autograd.grad(ref, (x, w), go)):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
    assert not torch.autograd.grad(triton_linear_cross_entropy(x, w, targets, 257), w)[0][257:].any()


@pytest.mark.parametrize("args, match", [
    (lambda x, t: (x, t[:-1], 5), "one target per row"),
    (lambda x, t: (x, t, 0), "vocab must be in"),
    (lambda x, t: (x, t, 9), "vocab must be in"),
    (lambda x, t: (x, t.float(), 5), "integer targets"),
])
def test_bad_inputs_are_refused_by_name(args, match):
    logits, targets = _logits(4, 8, torch.float32), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        cross_entropy_rows(*args(logits, targets))


def test_a_cpu_without_the_interpreter_refuses_the_kernel():
    code = ("import torch; from shared.kernels.cross_entropy import cross_entropy_rows; "
            "cross_entropy_rows(torch.ones(2, 3), torch.zeros(2, dtype=torch.long), 3)")
    assert_refused_without_interpreter(code, "--triton_loss")


def test_the_model_takes_the_triton_loss_only_when_asked():
    from shared.model.gpt import GPT

    assert GPT(preset("tiny", triton_loss=True)).head.triton_loss and not GPT(preset("tiny")).head.triton_loss


@pytest.mark.gpu
def test_bf16_kernel_matches_the_reference_at_the_models_shape():
    """Autotuned on the GPU, bf16 logits of the 1.5b model's head (micro-batch 16 x 2048 rows, vocabulary padded
    to 50304 columns of which 50257 are real)."""
    logits = _logits(16 * 2048, 50304, torch.bfloat16, device="cuda")
    targets = torch.randint(0, 50257, (16 * 2048,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    loss, grad = cross_entropy_rows(logits, targets, 50257)
    ref_loss, ref_grad = reference_cross_entropy_rows(logits, targets, 50257)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, ref_grad, rtol=1.6e-2, atol=1e-9)  # one bf16 rounding of the same value
    assert not grad[:, 50257:].any()
