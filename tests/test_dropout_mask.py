"""The dropout keep-mask kernel (shared/kernels/dropout_mask.py) against its NumPy Philox reference, and the
residual dropout that uses it (fused_ops.bias_dropout_add_triton, `--triton_dropout`).

On a CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); the GPU tests run it compiled,
at the 1.5b model's shape, in bf16 and inside a DeepCompile'd model.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from shared.kernels.dropout_mask import (
    CONFIGS,
    _launch,
    applied_rate,
    dropout_keep_mask,
    reference_keep_mask,
    threshold,
)
from shared.model import fused_ops
from shared.model.config import preset
from tests.helpers import (
    FAST,
    LIGHTNING,
    RAW,
    assert_refused_without_interpreter,
    load,
    python_without_interpreter,
    run,
)
from tests.test_fused_ops import P, _keep_rate_and_mask


def _mask(shape, p, seed, device="cpu"):
    return dropout_keep_mask(torch.empty(shape, device=device), p, torch.tensor([seed], device=device))


BLOCK = CONFIGS[0][0]


@pytest.mark.parametrize("shape", [(1,), (7,), (BLOCK + 13,), (3, 70, 33)], ids=["one", "seven", "ragged", "3d"])
@pytest.mark.parametrize("p, seed", [(0.1, 0), (0.5, 12345), (0.0, 2**31 - 2)])
def test_kernel_matches_its_numpy_reference_bit_for_bit(shape, p, seed):
    keep = _mask(shape, p, seed)
    assert keep.shape == shape and keep.dtype == torch.bool
    assert torch.equal(keep.reshape(-1), reference_keep_mask(keep.numel(), p, seed))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_every_configuration_draws_the_same_bits(config):
    """The autotuner may pick any configuration: each program's counters follow from the element index alone."""
    n = 2 * max(c[0] for c in CONFIGS) + 13
    keep = _launch((n,), 0.1, torch.tensor([99]), config=config)
    assert torch.equal(keep, reference_keep_mask(n, 0.1, 99))


def test_the_reference_is_philox_4x32_10():
    """Random123's known-answer vector for Philox 4x32-10 (counter 0, key 0): 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
    Its four numbers' halves, low first, against threshold 0x8000: keep iff the half has its top bit set."""
    halves = [0xe8d5, 0x6627, 0xc58d, 0xe169, 0xac4c, 0xbc57, 0xdbd8, 0x9b00]
    assert reference_keep_mask(8, 0.5, 0).tolist() == [h >= 0x8000 for h in halves]


def test_the_rate_applied_is_p_rounded_to_a_multiple_of_1_65536():
    assert threshold(0.1) == 6554 and applied_rate(0.1) == 6554 / 65536
    assert threshold(0.0) == 0 and threshold(0.99999999) == 65535
    keep = reference_keep_mask(1 << 20, 0.1, 7)
    n = keep.numel()
    assert abs((1 - keep.float().mean().item()) - applied_rate(0.1)) < 5 * (0.1 * 0.9 / n) ** 0.5  # 5 sigma
    assert bool(_mask((4096,), 0.0, 3).all())  # p = 0 keeps everything


def test_the_mask_depends_on_the_seed_and_the_size_only():
    a = dropout_keep_mask(torch.randn(64, 64), 0.1, torch.tensor([5]))
    assert torch.equal(a, dropout_keep_mask(torch.zeros(64, 64), 0.1, torch.tensor([5])))
    assert torch.equal(a.reshape(-1), _mask((4096,), 0.1, 5))
    assert not torch.equal(a, dropout_keep_mask(torch.zeros(64, 64), 0.1, torch.tensor([6])))


@pytest.mark.parametrize("args, match", [
    (lambda x: (x, 1.0, torch.tensor([1])), r"p must be in \[0, 1\)"),
    (lambda x: (x, -0.1, torch.tensor([1])), r"p must be in \[0, 1\)"),
    (lambda x: (x, 0.1, torch.tensor([1], dtype=torch.int32)), "one-element int64 tensor"),
    (lambda x: (x, 0.1, torch.tensor([1, 2])), "one-element int64 tensor"),
])
def test_bad_inputs_are_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        dropout_keep_mask(*args(torch.ones(8, 6)))


def test_a_cpu_without_the_interpreter_refuses_the_kernel():
    code = ("import torch; from shared.kernels.dropout_mask import dropout_keep_mask; "
            "dropout_keep_mask(torch.ones(2, 3), 0.1, torch.tensor([1]))")
    assert_refused_without_interpreter(code, "--triton_dropout")


# The kernel compiled for sm_90 as its launcher would compile it for these arguments (Triton's own binder gives the
# specialization: an int argument of value 1 becomes a constant), on a CPU: no GPU runs, Triton's compiler does.
COMPILE_FOR_SM90 = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
from shared.kernels.dropout_mask import CONFIGS, _dropout_mask, threshold
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
bind = create_function_from_signature(_dropout_mask.signature, _dropout_mask.params, backend)
kwargs = {"BLOCK": CONFIGS[0][0]}
n, p = %d, %r
keep, seed = torch.empty(n, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
bound, spec, opts = bind(keep, seed, n, threshold(p), **kwargs)
options, signature, constexprs, attrs = _dropout_mask._pack_args(backend, kwargs, bound, spec, opts)
triton.compile(ASTSource(_dropout_mask, signature, constexprs, attrs), target=target, options=options.__dict__)
"""


@pytest.mark.parametrize("n, p", [(4096, 1 / 65536), (1, 0.1)], ids=["threshold_1", "one_element"])
def test_the_kernel_compiles_for_a_gpu_when_an_argument_is_1(n, p):
    """p = 1/65536 gives the threshold 1, which Triton would turn into a constant (one with no .to): the kernel
    still compiles. The interpreter specializes nothing, so only a compile shows it."""
    proc = python_without_interpreter(COMPILE_FOR_SM90 % (n, p), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_compiled_residual_dropout_keeps_scales_and_masks_like_dropout():
    """Forward keeps about 1 - p, scaled by 1 / (1 - applied rate); backward passes gradient exactly where forward
    kept (the saved mask); the residual is never dropped."""
    _keep_rate_and_mask("cpu", torch.float32, fn=fused_ops.bias_dropout_add_triton, rate=applied_rate(P))


def test_the_compiled_residual_dropout_draws_from_torchs_generator():
    """A new mask each call; the same masks again after torch.manual_seed: runs are reproducible from their seed."""
    x = torch.ones(256, 256)
    masks = []
    for _ in range(2):
        torch.manual_seed(0)
        masks.append([fused_ops.bias_dropout_add_triton(x, None, torch.zeros_like(x), P, True) != 0
                      for _ in range(2)])
    assert not torch.equal(masks[0][0], masks[0][1])
    assert torch.equal(masks[0][0], masks[1][0]) and torch.equal(masks[0][1], masks[1][1])


@pytest.mark.parametrize("bias", [True, False])
def test_the_compiled_residual_dropout_without_dropout_is_the_identity_dropout(bias):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    b = torch.randn(32, generator=g) if bias else None
    for training, p in ((False, P), (True, 0.0)):
        torch.testing.assert_close(fused_ops.bias_dropout_add_triton(x, b, r, p, training),
                                   fused_ops.bias_dropout_add(x, b, r, p, training))


def test_the_model_takes_the_triton_dropout_only_with_the_fused_bias_dropout_add():
    from shared.model.gpt import ResidualLinear

    on = preset("tiny", fused_bias_dropout_add=True, triton_dropout=True)
    assert ResidualLinear(on, on.n_embd).bias_dropout_add is fused_ops.bias_dropout_add_triton
    off = preset("tiny", fused_bias_dropout_add=True)
    assert ResidualLinear(off, off.n_embd).bias_dropout_add is fused_ops.bias_dropout_add
    with pytest.raises(ValueError, match="triton_dropout draws the mask of fused_bias_dropout_add"):
        preset("tiny", fused_bias_dropout_add=False, triton_dropout=True)


@pytest.mark.timeout(600)  # three CPU runs of 150 s at most each
def test_both_paths_train_with_the_triton_dropout_from_the_command_line(tmp_path):
    """--triton_dropout on a CPU (the kernel in Triton's interpreter, under ZeRO-3): both paths record the switch and
    train to the same losses as each other, and close to inductor's own dropout (another mask, the same rate)."""
    flags = ["--fused_bias_dropout_add", "true"]
    for script, name in ((RAW, "raw"), (LIGHTNING, "pl")):
        run([sys.executable, script, *FAST, *flags, "--triton_dropout", "true", "--out", tmp_path / f"{name}.json"],
            timeout=150)
    run([sys.executable, RAW, *FAST, *flags, "--out", tmp_path / "inductor.json"], timeout=150)
    raw, pl, inductor = (load(tmp_path / f"{n}.json") for n in ("raw", "pl", "inductor"))
    assert raw["fused"]["dropout_triton_mask"] is True and pl["fused"]["dropout_triton_mask"] is True
    assert inductor["fused"]["dropout_triton_mask"] is False and inductor["fused"]["bias_dropout_add"] is True
    assert pl["losses"] == raw["losses"] and raw["losses"] != inductor["losses"]  # another mask: other losses
    assert max(abs(a - b) for a, b in zip(raw["losses"], inductor["losses"])) < 0.1


@pytest.mark.gpu
def test_the_gpu_kernel_matches_the_reference_at_the_models_shape():
    """Compiled and autotuned on the GPU, one residual branch of the 1.5b model at micro-batch 2 (2 x 2048 x 2304),
    and every configuration at that size."""
    shape, seed = (2, 2048, 2304), 2**31 - 5
    ref = reference_keep_mask(2 * 2048 * 2304, P, seed)
    assert torch.equal(_mask(shape, P, seed, device="cuda").cpu().reshape(-1), ref)
    for config in CONFIGS:
        keep = _launch(shape, P, torch.tensor([seed], device="cuda"), config=config)
        assert torch.equal(keep.cpu().reshape(-1), ref), config
    assert os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_compiled_residual_dropout_keeps_scales_and_masks_on_gpu(dtype):
    _keep_rate_and_mask("cuda", dtype, fn=fused_ops.bias_dropout_add_triton, rate=applied_rate(P))


def test_activation_checkpointing_recomputes_the_same_masks():
    """The tiny GPT with dropout and the kernel's masks: recomputing each block in backward (activation
    checkpointing) replays torch's generator, so it draws the same seeds and masks: the same loss and gradients."""
    from shared.model.gpt import GPT

    grads, losses = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(preset("tiny", fused_bias_dropout_add=True, triton_dropout=True, attn_dropout=0.0,
                           activation_checkpointing=checkpointing))
        idx = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(1)
        loss = model(idx, idx)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert losses[0] == losses[1]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6, msg=n)
