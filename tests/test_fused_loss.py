"""Chunked linear + cross-entropy (shared/model/fused_loss.py) against the plain F.linear + F.cross_entropy."""

import sys

import pytest
import torch
import torch.nn.functional as F

from shared.model.config import preset
from shared.model.fused_loss import ChunkedLinearCrossEntropy, chunked_linear_cross_entropy
from shared.model.gpt import GPT
from tests.helpers import FAST, LIGHTNING, RAW, load, run


def plain(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t)


@pytest.mark.parametrize("rows", [1, 7, 64, 1000])  # one row per chunk, a ragged last chunk, one chunk
def test_loss_and_gradients_match_the_plain_version(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, generator=g, requires_grad=True)
    w = torch.randn(37, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 37, (50,), generator=g)
    ref = plain(x, w, t)
    ref.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    out = ChunkedLinearCrossEntropy.apply(x, w, t, rows)
    (out * 3.0).backward()  # a non-unit upstream gradient must scale the stored gradients
    # fp32 throughout: only summation order differs (chunked sums vs one reduction)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, 3 * gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, 3 * gw, rtol=1e-5, atol=1e-6)


def test_no_gradients_are_computed_without_autograd():
    x, w, t = torch.randn(20, 8), torch.randn(11, 8), torch.randint(0, 11, (20,))
    with torch.no_grad():
        out = chunked_linear_cross_entropy(x, w, t)
    torch.testing.assert_close(out, plain(x, w, t))


def test_model_with_fused_loss_matches_the_plain_model():
    idx, tgt = torch.randint(0, 256, (2, 128)), torch.randint(0, 256, (2, 128))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = GPT(preset("tiny", dropout=0.0, attn_dropout=0.0, fused_loss=fused))
        loss = model(idx, tgt)
        loss.backward()
        results.append((loss.detach(), model.wte.weight.grad.clone(), model.blocks[0].mlp.fc.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_whole_model_with_the_fused_loss_compiles_into_one_graph():
    """What DeepCompile and the ceiling compile is the GPT's forward and loss as one graph: the chunked loss (over a
    padded vocabulary too) traces into it without a graph break and computes what the eager model does."""
    torch.manual_seed(0)
    model = GPT(preset("tiny", fused_loss=True, dropout=0.0, attn_dropout=0.0, vocab_size=200, vocab_multiple=128))
    idx, targets = torch.randint(0, 200, (2, 128)), torch.randint(0, 200, (2, 128))
    eager = model(idx, targets)
    eager.backward()
    eager_grad = model.wte.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, targets)  # fullgraph: no break allowed
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(model.wte.weight.grad, eager_grad)
    assert not model.wte.weight.grad[200:].any()


def test_both_paths_train_with_the_fused_loss_and_record_it(tmp_path):
    args = [*FAST, "--precision", "fp32", "--dropout", "0"]
    run([sys.executable, RAW, *args, "--out", tmp_path / "plain.json"])
    for script, out in ((RAW, "raw.json"), (LIGHTNING, "pl.json")):
        run([sys.executable, script, *args, "--fused_loss", "--out", tmp_path / out])
    plain_run, raw, pl = (load(tmp_path / f) for f in ("plain.json", "raw.json", "pl.json"))
    assert raw["fused"] == pl["fused"] and raw["fused"]["chunked_linear_cross_entropy"] is True
    assert plain_run["fused"]["chunked_linear_cross_entropy"] is False
    assert raw["losses"] == pytest.approx(plain_run["losses"], abs=1e-5) and pl["losses"] == raw["losses"]


def _peak_bytes(fn) -> int:
    """Peak CUDA memory allocated by fn() above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_bf16_on_gpu_matches_and_never_holds_the_full_fp32_logits():
    dev, c, v = torch.device("cuda"), 2304, 50257  # the 1.5b preset's width and vocabulary
    w = (torch.randn(v, c, device=dev) * 0.02).bfloat16().requires_grad_()

    def batch(n):
        x = (torch.randn(n, c, device=dev) * 0.5).bfloat16().requires_grad_()
        return x, torch.randint(0, v, (n,), device=dev)

    x, t = batch(8 * 2048)  # micro-batch 8
    ref = plain(x, w, t)
    ref.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    out = chunked_linear_cross_entropy(x, w, t)
    out.backward()
    # bf16 operands: the loss to 1e-3 relative; gradients through one bf16 rounding of softmax - onehot
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(x.grad.float(), gx.float(), rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(w.grad.float(), gw.float(), rtol=2e-2, atol=1e-4)
    del x, t, ref, out, gx, gw
    w.grad = None

    def peak(loss, n):
        x, t = batch(n)
        return _peak_bytes(lambda: loss(x, w, t).backward())

    n8, n16 = 8 * 2048, 16 * 2048
    chunked8, chunked16, plain16 = peak(chunked_linear_cross_entropy, n8), peak(chunked_linear_cross_entropy, n16), \
        peak(plain, n16)
    gib = 2**30
    full_fp32_logits = n16 * v * 4  # 6.1 GiB at micro-batch 16
    assert chunked16 < full_fp32_logits / 2, f"peak {chunked16 / gib:.2f} GiB"
    assert chunked16 < plain16 / 3, f"chunked {chunked16 / gib:.2f} GiB, plain {plain16 / gib:.2f} GiB"
    # one chunk of logits whatever the batch: twice the rows adds only row-sized buffers (x's gradient), not logits
    grown = chunked16 - chunked8
    assert grown < 4 * (n16 - n8) * c * 2 + 64 * 2**20, f"peak grew by {grown / gib:.2f} GiB with the batch"
