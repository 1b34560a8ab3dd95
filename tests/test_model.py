import math

import pytest
import torch

from shared.model import layouts
from shared.model.attention import ReferenceAttention, SDPAttention, build_attention
from shared.model.config import preset
from shared.model.gpt import GPT

LAYOUT_KINDS = ["causal", "local", "strided"]


def _model(attention="reference", layout="causal", **kw):
    torch.manual_seed(0)
    cfg = preset("tiny", attention=attention, layout=layout, dropout=0.0, attn_dropout=0.0, **kw)
    return GPT(cfg).eval()


@pytest.mark.parametrize("attention, layout", [("reference", k) for k in LAYOUT_KINDS] + [("sdpa", "causal")])
def test_future_tokens_never_change_past_logits(attention, layout):
    model = _model(attention, layout)
    T = model.cfg.seq_len
    idx = torch.randint(0, model.cfg.vocab_size, (2, T))
    with torch.no_grad():
        base = model(idx)
        for t in (0, 17, T // 2, T - 2):
            changed = idx.clone()
            changed[:, t + 1:] = torch.randint(0, model.cfg.vocab_size, (2, T - t - 1))
            out = model(changed)
            assert torch.equal(out[:, : t + 1], base[:, : t + 1]), f"position <= {t} changed"
            assert not torch.equal(out[:, t + 1:], base[:, t + 1:])


def test_sdpa_equals_reference_on_the_causal_layout():
    cfg = preset("tiny", dropout=0.0, attn_dropout=0.0)
    lay = layouts.make_layout(cfg)
    q, k, v = (torch.randn(2, cfg.n_head, cfg.seq_len, cfg.head_dim, dtype=torch.float64) for _ in range(3))
    ref = ReferenceAttention(cfg, lay)(q, k, v)
    sdpa = SDPAttention(cfg, lay)(q, k, v)
    torch.testing.assert_close(sdpa, ref, rtol=1e-10, atol=1e-10)  # fp64: both exact up to rounding


def test_sparse_layout_changes_the_result_and_is_respected():
    cfg = preset("tiny", attention="reference", layout="local", dropout=0.0, attn_dropout=0.0)
    attn = build_attention(cfg)
    q, k, v = (torch.randn(1, cfg.n_head, cfg.seq_len, cfg.head_dim, dtype=torch.float64) for _ in range(3))
    v2 = v.clone()
    v2[:, :, :16] = 0.0  # keys of block 0: outside the local window of blocks >= 2
    out, out2 = attn(q, k, v), attn(q, k, v2)
    assert torch.equal(out[:, :, 32:], out2[:, :, 32:])
    assert not torch.equal(out[:, :, :16], out2[:, :, :16])


def test_sdpa_refuses_sparse_layouts():
    with pytest.raises(ValueError, match="dense causal attention only"):
        build_attention(preset("tiny", attention="sdpa", layout="local"))


def test_megatron_init():
    model = _model(n_layer=8, n_embd=256, n_head=4)
    std_out = 0.02 / math.sqrt(2 * 8)
    w = torch.cat([b.attn.proj.weight.flatten() for b in model.blocks] + [b.mlp.proj.weight.flatten()
                                                                            for b in model.blocks])
    assert w.std().item() == pytest.approx(std_out, rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.qkv.bias.abs().max().item() == 0.0
    assert model.head.weight is model.wte.weight  # tied


def test_loss_and_logits():
    model = _model()
    idx, targets = torch.randint(0, 256, (2, 128)), torch.randint(0, 256, (2, 128))
    loss = model(idx, targets)
    assert loss.ndim == 0 and abs(loss.item() - math.log(256)) < 0.2  # near-uniform at init
    assert model(idx).shape == (2, 128, 256)
    with pytest.raises(ValueError, match="exceeds the model's seq_len 128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_a_padded_vocabulary_computes_the_same_function_and_never_predicts_the_padding():
    idx, targets = torch.randint(0, 200, (2, 128)), torch.randint(0, 200, (2, 128))
    plain, padded = _model(vocab_size=200), _model(vocab_size=200, vocab_multiple=128)
    assert padded.cfg.padded_vocab_size == 256 and padded.wte.weight.shape == (256, 64)
    # the same init (padding draws nothing, its rows are zero) and so the same logits and loss
    assert torch.equal(padded.wte.weight[:200], plain.wte.weight) and not padded.wte.weight[200:].any()
    for (name, a), b in zip(plain.named_parameters(), padded.parameters(), strict=True):
        assert name == "wte.weight" or torch.equal(a, b), name
    assert padded(idx).shape == (2, 128, 200)
    torch.testing.assert_close(padded(idx), plain(idx))
    loss = padded(idx, targets)
    torch.testing.assert_close(loss, plain(idx, targets))
    loss.backward()
    assert not padded.wte.weight.grad[200:].any()  # the padding gets no gradient: it stays zero under AdamW
    assert preset("1.5b", vocab_multiple=128).padded_vocab_size == 50304
    with pytest.raises(ValueError, match="vocab_multiple must be a positive integer, got 0"):
        preset("tiny", vocab_multiple=0)


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 128))
    grads = []
    for ckpt in (False, True):
        model = _model(activation_checkpointing=ckpt).train()
        model(idx, idx).backward()
        grads.append(model.blocks[0].attn.qkv.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
