"""The fused block-sparse kernel against the reference: output, dq/dk/dv, dropout, errors, and the GPT on top.

On a CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), with tiles of half a sparse
block so that the sub-tile loops and the partially masked diagonal tiles are exercised. bf16 runs only on a GPU
(the interpreter's bf16 dot is wrong: numpy has no bf16). The reference is `masked_reference` in float64, which
`test_reference_helper_is_the_project_reference` ties to shared.model.attention.ReferenceAttention.

Tolerances (absolute, on outputs of O(1) and gradients of O(1) from unit-variance inputs), and why:
  fp32  1e-4: fp32 dots and exp2 in a different summation order (online softmax rescaling) than float64.
  fp16  output 4e-3, grads 1e-2: P and dS are rounded to fp16 (unit roundoff 2^-11 = 4.9e-4) before the second
        product of each pair and outputs are stored in fp16; over ~T terms the rounding errors stay a few ulps of
        the largest values (measured on the CPU cases: 9e-4 / 2.1e-3).
  bf16  output 2e-2, grads 5e-2: the same with bf16's unit roundoff 2^-8 = 3.9e-3, eight times fp16's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.kernels import blocksparse_attention as bsa
from shared.kernels.blocksparse_attention import BlockLUT, Tile, blocksparse_attention
from shared.model import layouts
from shared.model.attention import ReferenceAttention, build_attention
from shared.model.attention.blocksparse import BlockSparseAttention
from shared.model.config import GPTConfig, preset
from shared.model.gpt import GPT

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 1e-2), torch.bfloat16: (2e-2, 5e-2)}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_layout(n_head: int, nb: int, seed: int, density: float = 0.5) -> torch.Tensor:
    """A per-head user layout: random blocks at or below the diagonal; an empty row gets its first block."""
    g = torch.Generator().manual_seed(seed)
    lay = (torch.rand(n_head, nb, nb, generator=g) < density) & torch.ones(nb, nb, dtype=torch.bool).tril()
    empty = ~lay.any(-1)
    lay[..., 0] |= empty
    return layouts.validate(lay, n_head, nb)


def make_layout(kind: str, n_head: int, nb: int) -> torch.Tensor:
    if kind == "causal":
        return layouts.causal(nb)
    if kind == "local":
        return layouts.local(nb, 2)
    if kind == "strided":
        return layouts.strided(nb, 2)
    return random_layout(n_head, nb, seed=nb * 31 + n_head)


def masked_reference(q, k, v, layout, block, keep=None, p=0.0):
    """softmax(q k^T / sqrt(D) + mask) [* keep / (1 - p)] v in float64, mask = expand(layout) & causal."""
    T = q.shape[-2]
    mask = layouts.token_mask(layout.to(q.device), block)[:, :T, :T]
    att = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    if keep is not None:
        att = att * keep / (1.0 - bsa.applied_dropout(p))  # the rate the kernels apply (a multiple of 1/65536)
    return att @ v.double()


def inputs(B, H, T, D, dtype, seed=0, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def model_views(B, H, T, D, dtype, seed=0, device=DEVICE):
    """q, k, v (B, H, T, D) as the model hands them over, views of one (B, T, 3C) projection, and dO in (B, T, H, D)
    storage (the gradient of y.transpose(1, 2).reshape(B, T, C))."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, T, 3 * H * D, generator=g).to(device, dtype)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2).detach().requires_grad_() for t in x.split(H * D, dim=2))
    return q, k, v, torch.randn(B, T, H, D, generator=g).to(device, dtype).transpose(1, 2)


def assert_tma_loads_match_pointer_loads(q, k, v, do, lut, tiles, dropout_p, seed):
    """Outputs and gradients with every kernel's tile loading through TMA equal those of pointer loads, bit for bit."""
    runs = []
    for tma in (False, True):
        fixed = {kind: dataclasses.replace(t, tma=tma) for kind, t in tiles.items()}
        out = blocksparse_attention(q, k, v, lut, dropout_p=dropout_p, seed=seed, tiles=fixed)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def check_against_reference(layout, block, q, k, v, do, tiles=None, dropout_p=0.0, seed=0, dropout_mask="philox"):
    lut = BlockLUT.from_layout(layout, block).to(q.device)
    out = blocksparse_attention(q, k, v, lut, dropout_p=dropout_p, seed=seed, tiles=tiles, dropout_mask=dropout_mask)
    out.backward(do)
    keep = None
    if dropout_p > 0:
        B, H, T, _ = q.shape
        keep = bsa.dropout_keep_mask(B, H, T, dropout_p, seed, q.device)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = masked_reference(*ref_in, layout, block, keep, dropout_p)
    ref.backward(do.double())
    atol_out, atol_grad = TOL[q.dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol_out, rtol=0, msg=lambda m: f"output: {m}")
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), ref_in):
        torch.testing.assert_close(got.double(), want.grad, atol=atol_grad, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


# ------------------------------------------------------------------------------------------------ lookup table


def test_lut_lists_exactly_the_layout_blocks():
    lay = random_layout(3, 6, seed=1)
    lut = BlockLUT.from_layout(lay, 64)
    assert lut.nnz == int(lay.sum())
    for h in range(3):
        for i in range(6):
            r = h * 6 + i
            row = lut.row_idx[r, : lut.row_off[r]].tolist()
            assert row == [j for j in range(i) if lay[h, i, j]]
            assert lut.diag[r] == int(lay[h, i, i])
            col = lut.col_idx[r, : lut.col_cum[r, -1]].tolist()
            assert col == [q for q in range(i + 1, 6) if lay[h, q, i]]
            for t in range(6):  # prefix counts for a shorter runtime T of t + 1 blocks
                assert lut.col_cum[r, t] == sum(1 for q in col if q <= t)


def test_lut_marks_layouts_whose_rows_and_columns_are_runs():
    assert BlockLUT.from_layout(layouts.causal(6), 64).contiguous
    assert BlockLUT.from_layout(layouts.local(6, 2), 64).contiguous
    assert not BlockLUT.from_layout(layouts.strided(6, 2), 64).contiguous
    assert not BlockLUT.from_layout(random_layout(3, 6, seed=1), 64).contiguous
    gap = layouts.causal(4).clone()
    gap[0, 3, 1] = False  # row 3 keeps blocks 0 and 2 (and its diagonal): not one run
    assert not BlockLUT.from_layout(gap, 64).contiguous


# ------------------------------------------------------------------------------------------------ numerics (CPU)


def test_reference_helper_is_the_project_reference():
    cfg = GPTConfig(n_head=2, n_embd=128, seq_len=256, sparse_block=64, layout="strided", stride_blocks=2,
                    attn_dropout=0.0)
    ref = ReferenceAttention(cfg, layouts.make_layout(cfg)).eval()
    q, k, v, _ = inputs(1, 2, 256, 64, torch.float32, device="cpu")
    torch.testing.assert_close(ref(q, k, v).double(), masked_reference(q, k, v, ref.layout_cpu, 64), atol=1e-5,
                               rtol=0)


CPU_CASES = [
    # (layout kind, head_dim, sparse block, dtype, n_blocks): every kind x head dim at block 64 in fp32, the
    # 128 block with each kind, fp16 once per kind.
    *[(kind, d, 64, torch.float32, 4) for kind in ("causal", "local", "strided", "random") for d in (64, 96, 128)],
    ("causal", 64, 128, torch.float32, 2),
    ("local", 96, 128, torch.float32, 4),
    ("strided", 128, 128, torch.float32, 4),
    ("random", 96, 128, torch.float32, 4),
    ("causal", 96, 64, torch.float16, 4),
    ("local", 64, 128, torch.float16, 4),
    ("strided", 128, 64, torch.float16, 4),
    ("random", 96, 128, torch.float16, 2),
]


@pytest.mark.parametrize("kind,head_dim,block,dtype,nb", CPU_CASES)
def test_matches_reference(kind, head_dim, block, dtype, nb):
    H = 2
    layout = make_layout(kind, H, nb)
    q, k, v, do = inputs(1, H, nb * block, head_dim, dtype, seed=head_dim + block)
    check_against_reference(layout, block, q, k, v, do)


@pytest.mark.parametrize("kind", ["strided", "random"])
def test_head_dim_96_padded_to_128(kind):
    """The other D = 96 variant the autotuner may pick: one 128-wide part with masked loads and stores."""
    layout = make_layout(kind, 2, 4)
    q, k, v, do = inputs(1, 2, 256, 96, torch.float32, seed=5)
    check_against_reference(layout, 64, q, k, v, do, tiles=bsa.interpreter_tiles(64, pad_d=True))


def test_tiles_of_a_whole_block_and_uneven_tiles():
    """Tile shapes other than the interpreter default: a 64-query tile against 16-key tiles, and the reverse."""
    layout = random_layout(2, 4, seed=3)
    q, k, v, do = inputs(1, 2, 256, 64, torch.float32, seed=6)
    tiles = {"fwd": Tile(64, 16, 4, 1), "dq": Tile(16, 64, 4, 1), "dkdv": Tile(16, 64, 4, 1)}
    check_against_reference(layout, 64, q, k, v, do, tiles=tiles)


@pytest.mark.parametrize("kind,T", [("causal", 256), ("local", 256), ("local", 192)])
def test_run_layouts_step_affinely_like_the_lookup_path(kind, T):
    """Causal and local layouts take the affine path (CONTIG); forcing the lookup path gives the same numbers,
    also on a shorter T (the columns' run is cut at T's last block)."""
    layout = make_layout(kind, 2, 4)
    lut = BlockLUT.from_layout(layout, 64).to(DEVICE)
    assert lut.contiguous
    q, k, v, do = inputs(1, 2, T, 64, torch.float32, seed=T)
    grads = []
    for table in (lut, dataclasses.replace(lut, contiguous=False)):
        for x in (q, k, v):
            x.grad = None
        out = blocksparse_attention(q, k, v, table, tiles=bsa.interpreter_tiles(64) if DEVICE == "cpu" else None)
        out.backward(do)
        grads.append([out.detach(), q.grad, k.grad, v.grad])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for x in (q, k, v):
        x.grad = None
    check_against_reference(layout, 64, q, k, v, do)


def test_shorter_sequence_uses_the_top_left_of_the_layout():
    layout = random_layout(2, 4, seed=7)  # built for 4 blocks, run on 2
    q, k, v, do = inputs(2, 2, 128, 64, torch.float32, seed=8)
    check_against_reference(layout, 64, q, k, v, do)


def test_all_ones_layout_is_dense_causal_attention_and_sdpa():
    q, k, v, do = inputs(1, 2, 256, 64, torch.float32, seed=9)
    check_against_reference(layouts.causal(4), 64, q, k, v, do)
    q.grad = k.grad = v.grad = None
    out = blocksparse_attention(q, k, v, BlockLUT.from_layout(layouts.causal(4), 64).to(q.device))
    ref_in = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    torch.testing.assert_close(out, sdpa, atol=1e-4, rtol=0)
    out.backward(do)
    sdpa.backward(do)
    for got, want in zip((q.grad, k.grad, v.grad), ref_in):
        torch.testing.assert_close(got, want.grad, atol=1e-4, rtol=0)


def test_module_strided_input_views_like_the_model():
    """q/k/v as the model makes them: views of one (B, T, 3C) projection, transposed to (B, H, T, D)."""
    cfg = GPTConfig(n_head=2, n_embd=128, seq_len=256, sparse_block=64, layout="local", local_blocks=2,
                    attn_dropout=0.0, attention="blocksparse")
    attn = build_attention(cfg).eval().to(DEVICE)
    B, T, C = 2, 256, 128
    x = torch.randn(B, T, 3 * C, device=DEVICE)
    q, k, v = (t.view(B, T, 2, 64).transpose(1, 2) for t in x.split(C, dim=2))
    assert not q.is_contiguous()
    torch.testing.assert_close(attn(q, k, v).double(), masked_reference(q, k, v, attn.layout_cpu, 64), atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_head_dim_that_is_not_contiguous_gives_the_reference_gradients(compiled):
    """q, k, v whose last stride is not 1 run on unit-stride copies, in the forward and in the backward, which
    receives the caller's tensors: eagerly (the autograd.Function) and traced (the custom ops)."""
    layout = make_layout("random", 2, 2)
    q, k, v = (torch.randn(1, 2, 128, 128, device=DEVICE)[..., ::2].detach().requires_grad_() for _ in range(3))
    assert q.stride(-1) == 2
    do = torch.randn(1, 2, 128, 64, device=DEVICE)
    if not compiled:
        check_against_reference(layout, 64, q, k, v, do, dropout_p=0.25, seed=3)
        return
    lut = BlockLUT.from_layout(layout, 64).to(DEVICE)
    call = lambda q, k, v: blocksparse_attention(q, k, v, lut, 0.25, 3)
    results = []  # eager on contiguous copies, then traced on the strided tensors: the same numbers
    for fn, inputs_ in ((call, [t.detach().contiguous().requires_grad_() for t in (q, k, v)]),
                        (torch.compile(call, backend="aot_eager"), (q, k, v))):
        out = fn(*inputs_)
        results.append((out, *torch.autograd.grad(out, inputs_, do)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("head_dim,pad_d,dropout_p", [(96, False, 0.0), (96, True, 0.1), (64, False, 0.1)])
def test_tma_loads_give_the_numbers_of_pointer_loads(head_dim, pad_d, dropout_p):
    """Tiles read through TMA tensor descriptors (the two parts of D = 96, or one part padded with zeros past the
    head dim) give bit-identical outputs and gradients, on the model's strided views."""
    q, k, v, do = model_views(1, 2, 128, head_dim, torch.float16, seed=head_dim)
    lut = BlockLUT.from_layout(layouts.causal(2), 64).to(DEVICE)
    assert_tma_loads_match_pointer_loads(q, k, v, do, lut, bsa.interpreter_tiles(64, pad_d), dropout_p, seed=11)


@pytest.mark.parametrize("head_dim,pad_d,dropout_p", [(96, False, 0.0), (96, True, 0.1), (64, False, 0.1)])
def test_one_pass_backward_with_atomic_dq_matches_the_two_kernel_backward(head_dim, pad_d, dropout_p):
    """The alternative backward benchmarks/attention_tiles.py --atomic_dq times (the dk/dv kernel also adds dq
    atomically in fp32; delta from its own kernel) gives the two-kernel backward's gradients."""
    q, k, v, do = (x.detach() for x in inputs(1, 2, 128, head_dim, torch.float32, seed=head_dim))
    lut = BlockLUT.from_layout(random_layout(2, 2, seed=4), 64).to(DEVICE)
    tiles = bsa.interpreter_tiles(64, pad_d) if DEVICE == "cpu" else None  # the autotuned candidates on a GPU
    o, lse = bsa._forward(q, k, v, lut, dropout_p, 9, tiles)
    two = bsa._backward(do, q, k, v, o, lse, lut, dropout_p, 9, tiles)
    strided_do = torch.stack([do, do], dim=-1)[..., 0]  # the same values, head dim not contiguous
    one = bsa._backward_atomic_dq(strided_do, q, k, v, o, lse, lut, dropout_p, 9, tiles)
    for name, a, b in zip(("dq", "dk", "dv"), two, one):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_the_one_pass_backwards_autotuner_zeroes_dq_before_every_trial(monkeypatch):
    """Each autotuning trial of the one-pass backward adds dq into the same buffer: its tuner resets it before every
    trial and before the call (an H200 run without the reset returned dq summed over the trials). The tuner runs
    here with a stand-in for do_bench that launches each candidate three times."""
    q, k, v, do = (x.detach() for x in inputs(1, 2, 128, 64, torch.float32, seed=13))
    lut = BlockLUT.from_layout(layouts.causal(2), 64).to(DEVICE)
    o, lse = bsa._forward(q, k, v, lut, 0.0, 0, bsa.interpreter_tiles(64))
    want = bsa._backward(do, q, k, v, o, lse, lut, 0.0, 0, bsa.interpreter_tiles(64))
    candidates = bsa.candidate_tiles("dkdv", 64, 64, torch.float32)
    # A fresh tuner: one that an earlier test ran has already looked up its benchmark function (a cached property).
    monkeypatch.setattr(bsa, "_TUNERS", {})
    tuner = bsa._tuned(bsa._attn_bwd_dkdv, "dkdv_dq", 64, candidates)
    assert len(candidates) > 1 and tuner.reset_to_zero == ["DQ"]
    trials = []

    def bench(kernel_call, quantiles):
        for _ in range(3):
            kernel_call()
        trials.append(kernel_call)
        return [float(len(trials))] * len(quantiles)

    monkeypatch.setattr(tuner, "_do_bench", bench)
    got = bsa._backward_atomic_dq(do, q, k, v, o, lse, lut, 0.0, 0, tiles=None)
    assert len(trials) == len(candidates)
    for name, a, b in zip(("dq", "dk", "dv"), want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert bsa._tuned(bsa._attn_bwd_dkdv, "dkdv", 64, candidates).reset_to_zero == []


def test_fixed_tiles_must_name_every_kernel():
    q, k, v, _ = inputs(1, 2, 128, 64, torch.float32)
    lut = BlockLUT.from_layout(layouts.causal(2), 64).to(DEVICE)
    with pytest.raises(ValueError, match=r"missing \['dq', 'fwd'\]"):
        blocksparse_attention(q, k, v, lut, tiles={"dkdv": bsa.interpreter_tiles(64)["dkdv"]})


@pytest.mark.parametrize("tile", [Tile(128, 128, 4, 1), Tile(64, 128, 4, 1), Tile(48, 16, 4, 1), Tile(64, 8, 4, 1)],
                         ids=["wider_than_the_block", "keys_wider", "not_a_power_of_two", "below_16"])
def test_fixed_tiles_must_fit_the_sparse_block(tile):
    """A tile wider than the sparse block would read the next block's keys with this block's table (wrong numbers,
    no error); one that does not divide it would skip keys: refused by name, before anything runs."""
    q, k, v, _ = inputs(1, 2, 256, 64, torch.float32)
    lut = BlockLUT.from_layout(layouts.causal(4), 64).to(DEVICE)
    tiles = {**bsa.interpreter_tiles(64), "dkdv": tile}
    with pytest.raises(ValueError, match=r"tile dkdv .*powers of two from 16 .* to the sparse block 64"):
        blocksparse_attention(q, k, v, lut, tiles=tiles)


def test_tma_tiles_refuse_inputs_descriptors_cannot_read():
    q, k, v, do = inputs(1, 2, 128, 64, torch.float16)
    assert bsa.tma_ok(q, k, v, do) is None
    assert "dtype torch.float32" in bsa.tma_ok(q.float())
    shifted = torch.randn(1 * 2 * 128 * 64 + 1, dtype=torch.float16, device=DEVICE)[1:].view(1, 2, 128, 64)
    assert "16-byte aligned" in bsa.tma_ok(shifted, k, v)
    odd = torch.randn(1, 2, 128, 65, dtype=torch.float16, device=DEVICE)[..., :64]  # rows of 130 bytes
    assert "16-byte aligned" in bsa.tma_ok(odd)
    assert "not contiguous" in bsa.tma_ok(q.detach().transpose(-2, -1))
    lut = BlockLUT.from_layout(layouts.causal(2), 64).to(DEVICE)
    tiles = {kind: dataclasses.replace(t, tma=True) for kind, t in bsa.interpreter_tiles(64).items()}
    with pytest.raises(ValueError, match="loads through TMA.*16-byte aligned"):
        blocksparse_attention(shifted, k, v, lut, tiles=tiles)


# ------------------------------------------------------------------------------------------------ dropout


def test_dropout_keep_rate_and_streams():
    B, H, T = 2, 3, 256
    n = B * H * T * T
    for p in (0.1, 0.5):
        keep = bsa.dropout_keep_mask(B, H, T, p, seed=11, device=DEVICE)
        # Bernoulli(1 - p) mean: 6 standard deviations (a false alarm every ~10^9 runs).
        assert abs(keep.float().mean().item() - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n)
    a = bsa.dropout_keep_mask(B, H, T, 0.5, seed=11, device=DEVICE)
    assert torch.equal(a, bsa.dropout_keep_mask(B, H, T, 0.5, seed=11, device=DEVICE))  # same seed, same mask
    assert (a != bsa.dropout_keep_mask(B, H, T, 0.5, seed=12, device=DEVICE)).float().mean() > 0.4
    assert (a[0, 0] != a[0, 1]).float().mean() > 0.4  # heads draw independent streams
    assert (a[0, 0] != a[1, 0]).float().mean() > 0.4  # so do batch elements
    # One Philox call feeds eight neighbouring columns (four numbers, two halves each): each of them, and the
    # next group, draws its own bits.
    for shift in (1, 2, 3, 4, 5, 6, 7, 8):
        assert (a[..., :-shift] != a[..., shift:]).float().mean() > 0.4, f"columns {shift} apart agree"
    assert (a[..., :-1, :] != a[..., 1:, :]).float().mean() > 0.4  # and rows


def test_the_attention_mask_is_philox_of_the_numpy_reference():
    """The keep mask every check above compares with comes from the kernels' own `_keep`: tie it to the NumPy Philox
    4x32-10 of shared/kernels/dropout_mask.py. Head bh's score (q, k) is element q * T + k of that reference's flat
    mask with the key (seed, bh), i.e. the 64-bit seed seed + bh * 2^32."""
    from shared.kernels.dropout_mask import reference_keep_mask

    B, H, T = 2, 3, 128
    for p, seed in ((0.3, 1234), (0.1, 2**31 - 2)):
        keep = bsa.dropout_keep_mask(B, H, T, p, seed, DEVICE).cpu()
        for bh in range(B * H):
            ref = reference_keep_mask(T * T, p, seed + (bh << 32)).reshape(T, T)
            assert torch.equal(keep[bh // H, bh % H], ref), (p, seed, bh)


def test_applied_dropout_is_the_rate_rounded_to_sixteen_bits():
    assert bsa.applied_dropout(0.1) == 6554 / 65536 and abs(bsa.applied_dropout(0.1) - 0.1) < 1e-5
    assert bsa.applied_dropout(0.5) == 0.5 and bsa.applied_dropout(0.0) == 0.0
    assert bsa.applied_dropout(0.9999999) == 65535 / 65536  # never 1: some scores are always kept
    keep = bsa.dropout_keep_mask(1, 4, 512, 0.9999999, seed=3, device=DEVICE)
    # 2^20 scores, 16 kept on average (P(none) ~ 1e-7); a threshold wrapping to 0 would keep them all
    assert 0 < keep.sum() < 64


@pytest.mark.parametrize("kind,head_dim", [("strided", 96), ("random", 64)])
def test_dropout_forward_and_backward_use_the_same_mask(kind, head_dim):
    """Output and dq/dk/dv equal the reference computed with the mask the kernels draw (recovered separately):
    a backward regenerating any other mask would give other gradients."""
    layout = make_layout(kind, 2, 4)
    q, k, v, do = inputs(2, 2, 256, head_dim, torch.float32, seed=13)
    check_against_reference(layout, 64, q, k, v, do, dropout_p=0.3, seed=1234)


def run_with_mask(q, k, v, do, lut, tiles, dropout_p, seed, dropout_mask):
    for x in (q, k, v):
        x.grad = None
    out = blocksparse_attention(q, k, v, lut, dropout_p=dropout_p, seed=seed, tiles=tiles, dropout_mask=dropout_mask)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("kind,head_dim,pad_d,block", [("causal", 96, False, 64), ("random", 64, False, 64),
                                                        ("strided", 96, True, 64), ("local", 32, False, 32)])
def test_dropout_mask_read_from_bits_gives_the_philox_kernels_numbers(kind, head_dim, pad_d, block):
    """dropout_mask="bits" (the mask drawn once, packed eight scores to a byte, read by all three kernels) gives
    outputs and gradients bit for bit equal to the kernels drawing it themselves, on the model's strided views."""
    nb = 4
    q, k, v, do = model_views(1, 2, nb * block, head_dim, torch.float16, seed=head_dim + block)
    lut = BlockLUT.from_layout(make_layout(kind, 2, nb), block).to(DEVICE)
    tiles = bsa.interpreter_tiles(block, pad_d) if DEVICE == "cpu" else {
        name: bsa.candidate_tiles(name, block, head_dim, q.dtype, True)[0] for name in ("fwd", "dq", "dkdv")}
    philox = run_with_mask(q, k, v, do, lut, tiles, 0.3, 77, "philox")
    bits = run_with_mask(q, k, v, do, lut, tiles, 0.3, 77, "bits")
    for name, a, b in zip(("out", "dq", "dk", "dv"), philox, bits):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    no_drop = run_with_mask(q, k, v, do, lut, tiles, 0.0, 77, "bits")  # without dropout no mask is drawn or read
    torch.testing.assert_close(no_drop[0], run_with_mask(q, k, v, do, lut, tiles, 0.0, 77, "philox")[0], atol=0, rtol=0)
    assert not torch.equal(no_drop[0], bits[0])


@pytest.mark.parametrize("kind,block", [("causal", 16), ("random", 64), ("strided", 128), ("local", 32)])
def test_dropout_bits_pack_the_keep_mask_of_every_visited_block(kind, block):
    """Bit k % 8 of byte (q, k // 8) is the keep mask's (q, k) in every block of the layout, whole (a diagonal
    block's tiles read past the causal diagonal); blocks outside the layout are not drawn."""
    B, H, nb = 2, 2, 4 if block == 128 else 6
    T = nb * block
    q = torch.empty(B, H, T, 64, device=DEVICE)
    layout = make_layout(kind, H, nb)
    bits = bsa._dropout_bits(q, BlockLUT.from_layout(layout, block).to(DEVICE), bsa.applied_dropout(0.25), 5)
    bits = bits.cpu().reshape(B, H, T, T // 8)
    unpacked = ((bits[..., None].int() >> torch.arange(8)) & 1).reshape(B, H, T, T).bool()
    keep = bsa.dropout_keep_mask(B, H, T, 0.25, 5, DEVICE).cpu()
    drawn = layout.expand(H, nb, nb).repeat_interleave(block, 1).repeat_interleave(block, 2).expand(B, H, T, T)
    assert torch.equal(unpacked[drawn], keep[drawn])
    assert abs(keep[drawn].float().mean().item() - 0.75) < 0.05


def test_module_dropout_follows_torch_seed_and_eval_turns_it_off():
    cfg = GPTConfig(n_head=2, n_embd=128, seq_len=128, sparse_block=64, attn_dropout=0.2, attention="blocksparse")
    attn = build_attention(cfg).to(DEVICE)  # the lookup table's buffers follow the module
    q, k, v, _ = inputs(1, 2, 128, 64, torch.float32, seed=14)
    torch.manual_seed(0)
    a = attn(q, k, v)
    torch.manual_seed(0)
    b = attn(q, k, v)
    c = attn(q, k, v)
    assert torch.equal(a, b)
    assert not torch.equal(b, c)
    attn.eval()
    torch.testing.assert_close(attn(q, k, v).double(), masked_reference(q, k, v, attn.layout_cpu, 64), atol=1e-4,
                               rtol=0)


# ------------------------------------------------------------------------------------------------ errors


def test_bad_inputs_raise_naming_the_value():
    lut = BlockLUT.from_layout(layouts.causal(4), 64)
    q, k, v, _ = inputs(1, 2, 256, 64, torch.float32)
    with pytest.raises(ValueError, match="200"):
        blocksparse_attention(q[:, :, :200], k[:, :, :200], v[:, :, :200], lut)  # T not a multiple of the block
    long = torch.randn(1, 2, 320, 64)
    with pytest.raises(ValueError, match="320"):
        blocksparse_attention(long, long, long, lut)  # T beyond the layout
    odd = torch.randn(1, 2, 256, 80)
    with pytest.raises(ValueError, match="80"):
        blocksparse_attention(odd, odd, odd, lut)
    with pytest.raises(ValueError, match="float64"):
        blocksparse_attention(q.double(), k.double(), v.double(), lut)
    per_head = BlockLUT.from_layout(random_layout(3, 4, seed=2), 64)
    with pytest.raises(ValueError, match="3 heads"):
        blocksparse_attention(q, k, v, per_head)
    with pytest.raises(ValueError, match="dropout_p"):
        blocksparse_attention(q, k, v, lut, dropout_p=1.0)
    with pytest.raises(ValueError, match="'philox', 'bits'.*'bitz'"):
        blocksparse_attention(q, k, v, lut, dropout_p=0.1, dropout_mask="bitz")


def test_bad_configs_and_layouts_raise():
    with pytest.raises(ValueError, match="head_dim"):
        build_attention(GPTConfig(n_head=2, n_embd=160, seq_len=128, sparse_block=64, attention="blocksparse"))
    with pytest.raises(ValueError, match="sparse_block"):
        build_attention(GPTConfig(n_head=2, n_embd=128, seq_len=128, sparse_block=8, attention="blocksparse"))
    cfg = GPTConfig(n_head=2, n_embd=128, seq_len=256, sparse_block=64, attention="blocksparse")
    with pytest.raises(ValueError, match="shape"):
        layouts.validate(torch.ones(2, 3, 3, dtype=torch.bool).tril(), 2, 4)
    empty_row = layouts.causal(4).clone()
    empty_row[0, 2] = False
    with pytest.raises(ValueError, match="empty"):
        layouts.validate(empty_row, 2, 4)
    with pytest.raises(ValueError, match="above the diagonal"):
        layouts.validate(torch.ones(1, 4, 4, dtype=torch.bool), 2, 4)
    with pytest.raises(ValueError, match="above the diagonal"):  # the kernel's table checks on its own, too
        BlockLUT.from_layout(torch.ones(1, 4, 4, dtype=torch.bool), 64)
    with pytest.raises(ValueError, match="empty"):
        BlockLUT.from_layout(empty_row, 64)
    assert isinstance(BlockSparseAttention(cfg, layouts.validate(random_layout(2, 4, seed=4), 2, 4)),
                      BlockSparseAttention)


# ------------------------------------------------------------------------------------------------ the custom op


def test_the_op_passes_torch_library_opcheck():
    """The forward op's schema, fake (shape-only) version, autograd formula and AOT dispatch agree with what it
    computes (torch.library.opcheck): what torch.compile relies on to keep it in a graph. With "bits" the mask's
    bytes outside the layout's blocks are left unwritten (only the backward op reads that output, in the blocks),
    so that output differs from call to call and opcheck's comparison of two calls' outputs cannot hold; the
    compiled call's output and gradients are compared here instead."""
    lut = BlockLUT.from_layout(random_layout(2, 2, seed=4), 64).to(DEVICE)
    q, k, v, do = inputs(1, 2, 128, 64, torch.float32, seed=3)
    tensors, meta = bsa._lut_args(lut)
    tiles = bsa.interpreter_tiles(64)
    args = (q, k, v, torch.tensor(5, device=DEVICE), tensors, meta, 0.25, bsa._tile_ints(tiles))
    torch.library.opcheck(bsa._attention_fwd_op, (*args, "philox"))
    torch.library.opcheck(bsa._attention_fwd_op, (*args, "bits"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    call = lambda q, k, v: blocksparse_attention(q, k, v, lut, 0.25, 5, tiles, dropout_mask="bits")
    results = []
    for fn in (call, torch.compile(call, backend="aot_eager", dynamic=True)):
        out = fn(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_op_without_fixed_tiles_crosses_autograd(monkeypatch):
    """Without fixed tiles (the autotuned launches of a GPU) the op's tile list is empty, which torch's autograd
    wrapper reads as a list of no tensors: the backward formula must still hand back one gradient per input in the
    inputs' structure. The kernels' launches are recorded here, not run."""
    launched = []
    monkeypatch.setattr(bsa, "_launch", lambda kernel, kind, T, BH, tiles, *_: launched.append((kind, tiles)))
    lut = BlockLUT.from_layout(layouts.causal(2), 64)
    q, k, v, do = inputs(1, 2, 128, 64, torch.float32, device="cpu")
    tensors, meta = bsa._lut_args(lut)
    args = (q, k, v, torch.tensor(5), tensors, meta, 0.1, [], "philox")
    torch.library.opcheck(bsa._attention_fwd_op, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    launched.clear()
    o, _, _ = bsa._attention_fwd_op(*args)
    o.backward(do)
    assert launched == [("fwd", None), ("dq", None), ("dkdv", None)]
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_eager_calls_take_the_function_and_traced_calls_the_op(monkeypatch):
    """Eager code runs the autograd.Function (the op's dispatch costs several times its host time); code that
    torch.compile traces runs the op, the same kernels (tests below compare the two)."""
    called = []
    monkeypatch.setattr(bsa._BlockSparseAttentionFn, "apply", lambda *a: called.append("function") or a[0])
    lut = BlockLUT.from_layout(layouts.causal(2), 64).to(DEVICE)
    q, k, v, _ = inputs(1, 2, 128, 64, torch.float32)
    bsa.blocksparse_attention(q, k, v, lut)
    assert called == ["function"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(bsa, "_attention_fwd_op", lambda *a: called.append("op") or (a[0], None, None))
    bsa.blocksparse_attention(q, k, v, lut)
    assert called == ["function", "op"]


def test_traced_as_on_a_gpu_the_call_is_one_graph_around_the_op():
    """Without Triton's interpreter the kernels are JITFunction objects, as on a GPU, which dynamo wraps as kernels
    of its own: tracing the call must still give one graph whose only node of ours is the op (nothing of the
    launcher, no break). Traced only: the backend records the graph and runs nothing (the CPU has no GPU to run the
    kernels; the device check is skipped for that reason)."""
    from tests.helpers import python_without_interpreter

    code = """
import torch
from torch._dynamo.utils import counters
from shared.kernels import blocksparse_attention as bsa
from shared.model import layouts
assert not bsa._interpreted()
bsa._check_inputs = lambda *a: None
lut = bsa.BlockLUT.from_layout(layouts.causal(2), 64)
graphs = []
def record(gm, example_inputs):
    graphs.append(gm)
    return lambda *args: [torch.zeros(1, 2, 128, 64)]
fn = torch.compile(lambda q, k, v, seed: bsa.blocksparse_attention(q, k, v, lut, 0.1, seed) * 2, backend=record)
q = torch.randn(1, 2, 128, 64)
fn(q, q, q, torch.tensor(3))
calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
print(len(graphs), sum(counters["graph_break"].values()), calls)
"""
    proc = python_without_interpreter(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphs, breaks, calls = proc.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (graphs, breaks) == ("1", "0") and "zero3bench.blocksparse_attention_fwd.default" in calls, proc.stdout


def test_fixed_tiles_cross_the_op_as_ints_and_come_back_equal():
    tables = (bsa._SMALL_D, bsa._D96, bsa._D128, bsa._FP32)
    for table in tables:
        for fwd, dq, dkdv in zip(table["fwd"], table["dq"], table["dkdv"]):
            tiles = {"fwd": fwd, "dq": dq, "dkdv": dkdv}
            back = bsa._tiles_of(bsa._tile_ints(tiles))
            assert back == tiles
            assert all(type(getattr(t, f)) is bool for t in back.values() for f in ("pad_d", "dropout", "tma"))
    assert bsa._tiles_of(bsa._tile_ints(None)) is None


def test_a_seed_tensor_applies_the_mask_of_its_value_and_bad_seeds_are_named():
    lut = BlockLUT.from_layout(layouts.causal(2), 64).to(DEVICE)
    q, k, v, _ = inputs(1, 2, 128, 64, torch.float32, seed=2)
    by_int = blocksparse_attention(q, k, v, lut, 0.3, 1234)
    assert torch.equal(blocksparse_attention(q, k, v, lut, 0.3, torch.tensor(1234, device=DEVICE)), by_int)
    assert not torch.equal(blocksparse_attention(q, k, v, lut, 0.3, 1235), by_int)
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match=rf"seed must be in \[0, 2\^31\).*got {bad}"):
            blocksparse_attention(q, k, v, lut, 0.3, bad)
    with pytest.raises(ValueError, match="one int64 on q's device.*torch.int32"):
        blocksparse_attention(q, k, v, lut, 0.3, torch.tensor(5, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="one int64 on q's device.*shape \\(2,\\)"):
        blocksparse_attention(q, k, v, lut, 0.3, torch.tensor([5, 6], device=DEVICE))


def test_the_whole_gpt_compiles_to_one_graph_with_the_kernel_and_trains_like_eager():
    """torch.compile of the whole model (what DeepCompile compiles), activation checkpointing and attention dropout
    on: one graph, no break, and the loss and every gradient of eager code. The seeds are random ops of the graph;
    with inductor's fallback_random they draw what eager code draws, and the recompute of a checkpointed block
    replays them (a recompute with another mask would give other gradients). A second call draws other masks."""
    import torch._inductor.config as inductor_config

    from shared.train.results import dynamo_stats

    # one block of 64 tokens: the Triton interpreter's time grows with both, and one checkpointed block already
    # recomputes a kernel call that must draw its mask again
    cfg = preset("tiny", attention="blocksparse", dropout=0.0, attn_dropout=0.2, seq_len=64, n_layer=1,
                 activation_checkpointing=True)
    torch.manual_seed(0)
    model = GPT(cfg).to(DEVICE)
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.manual_seed(5)
    eager = model(idx, idx)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(model)
        torch.manual_seed(5)
        loss = compiled(idx, idx)
        loss.backward()
        stats = dynamo_stats()
        assert stats["dynamo_graphs"] == 1 and stats["dynamo_graph_breaks"] == 0, stats
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        torch.manual_seed(6)
        assert compiled(idx, idx).item() != loss.item()


# ------------------------------------------------------------------------------------------------ the model


def test_build_attention_picks_the_kernel():
    attn = build_attention(GPTConfig(n_head=2, n_embd=128, seq_len=128, sparse_block=64, attention="blocksparse"))
    assert isinstance(attn, BlockSparseAttention)
    assert attn.backend == "blocksparse"


def test_gpt_trains_with_blocksparse_like_reference():
    """GPT forward + backward with --attention blocksparse equals the same seeded GPT on the reference backend."""
    losses, grads = {}, {}
    for backend in ("blocksparse", "reference"):
        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, seq_len=128, vocab_size=256, sparse_block=16,
                        layout="local", local_blocks=2, dropout=0.0, attn_dropout=0.0, attention=backend)
        torch.manual_seed(0)
        model = GPT(cfg)
        assert model.attention_backend == backend
        idx = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
        loss = model(idx, targets=torch.roll(idx, -1, dims=1))
        loss.backward()
        losses[backend] = loss.item()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert losses["blocksparse"] == pytest.approx(losses["reference"], abs=1e-5)
    for name, g in grads["reference"].items():
        torch.testing.assert_close(grads["blocksparse"][name], g, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_gpt_step_with_attention_dropout_runs():
    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=64, seq_len=64, vocab_size=64, sparse_block=16, layout="strided",
                    stride_blocks=2, dropout=0.1, attn_dropout=0.1, attention="blocksparse")
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, 64, (2, 64))
    loss = model(idx, targets=idx)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ------------------------------------------------------------------------------------------------ GPU


GPU_TILES = {  # the default (first) candidate of each kernel: one compile per variant keeps the GPU file fast
    d: {kind: bsa.candidate_tiles(kind, 128, d, torch.bfloat16)[0] for kind in ("fwd", "dq", "dkdv")}
    for d in (64, 96, 128)
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["causal", "local", "strided", "random"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_gpu_bf16_matches_reference(kind, head_dim):
    H = 4
    layout = make_layout(kind, H, 8)
    q, k, v, do = inputs(2, H, 1024, head_dim, torch.bfloat16, seed=head_dim)
    check_against_reference(layout, 128, q, k, v, do, tiles=GPU_TILES[head_dim])


@pytest.mark.gpu
@pytest.mark.parametrize("block,kind", [(64, "random"), (128, "strided")])
def test_gpu_fp16_and_block_64(block, kind):
    layout = make_layout(kind, 4, 1024 // block)
    q, k, v, do = inputs(2, 4, 1024, 96, torch.float16, seed=block)
    tiles = {kind_: bsa.candidate_tiles(kind_, block, 96, torch.float16)[0] for kind_ in ("fwd", "dq", "dkdv")}
    check_against_reference(layout, block, q, k, v, do, tiles=tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_gpu_every_candidate_tile_is_correct(kernel, dropout_p, tma):
    """The autotuner may pick any candidate: each must compile and agree (D = 96, the benchmark's head dim; its
    padded variants run the D = 128 code path), with dropout too (each tile shape draws the mask's four-column
    Philox groups from its own offsets, the dk/dv kernel transposed), its tiles loaded with pointers or TMA."""
    layout = random_layout(4, 4, seed=21)
    q, k, v, do = inputs(1, 4, 512, 96, torch.bfloat16, seed=22)
    tiles = {name: bsa.candidate_tiles(name, 128, 96, torch.bfloat16, dropout_p > 0)[0] for name in GPU_TILES[96]}
    for tile in bsa.candidate_tiles(kernel, 128, 96, torch.bfloat16, dropout_p > 0):
        tile = dataclasses.replace(tile, tma=tma)
        for x in (q, k, v):
            x.grad = None
        check_against_reference(layout, 128, q, k, v, do, tiles={**tiles, kernel: tile}, dropout_p=dropout_p,
                                seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_gpu_every_candidate_tile_reads_the_dropout_bits(kernel):
    """With the mask read from bits every tile is a candidate (no Philox registers): each agrees with the reference
    under the mask, on the causal layout at D = 96 (tiles reaching past the diagonal read bits drawn for them)."""
    q, k, v, do = inputs(1, 4, 512, 96, torch.bfloat16, seed=23)
    tiles = {name: bsa.candidate_tiles(name, 128, 96, torch.bfloat16, False)[0] for name in GPU_TILES[96]}
    for tile in bsa.candidate_tiles(kernel, 128, 96, torch.bfloat16, False):
        for x in (q, k, v):
            x.grad = None
        check_against_reference(layouts.causal(4), 128, q, k, v, do, tiles={**tiles, kernel: tile}, dropout_p=0.1,
                                seed=5, dropout_mask="bits")


@pytest.mark.gpu
def test_gpu_autotuned_path_and_model_layout_inputs():
    cfg = GPTConfig(n_head=4, n_embd=384, seq_len=1024, sparse_block=128, layout="strided", attn_dropout=0.0,
                    attention="blocksparse")
    attn = build_attention(cfg).cuda().eval()
    B, T, C = 2, 1024, 384
    x = torch.randn(B, T, 3 * C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = (t.view(B, T, 4, 96).transpose(1, 2) for t in x.split(C, dim=2))
    out = attn(q, k, v)
    ref = masked_reference(q, k, v, attn.layout_cpu, 128)
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.bfloat16][0], rtol=0)
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert bsa.chosen_configs(), "the autotuner recorded no choice"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_gpu_tma_tiles_read_the_models_strided_views(head_dim):
    """q, k, v as views of one (B, T, 3C) projection and dO in (B, T, H, D) storage, loaded through TMA: the same
    outputs and gradients as pointer loads, bit for bit, and the reference's."""
    H = 4
    q, k, v, do = model_views(2, H, 1024, head_dim, torch.bfloat16, seed=head_dim)
    lut = BlockLUT.from_layout(make_layout("strided", H, 8), 128).to("cuda")
    assert bsa.tma_ok(q, k, v, do) is None
    assert_tma_loads_match_pointer_loads(q, k, v, do, lut, GPU_TILES[head_dim], 0.1, seed=3)
    for x_ in (q, k, v):
        x_.grad = None
    tiles = {kind: dataclasses.replace(t, tma=True) for kind, t in GPU_TILES[head_dim].items()}
    check_against_reference(make_layout("strided", H, 8), 128, q, k, v, do, tiles=tiles, dropout_p=0.1, seed=3)


@pytest.mark.gpu
def test_gpu_dropout_mask_consistency_and_rate():
    layout = make_layout("strided", 4, 8)
    q, k, v, do = inputs(2, 4, 1024, 96, torch.bfloat16, seed=31)
    tiles = {kind: bsa.candidate_tiles(kind, 128, 96, torch.bfloat16, dropout=True)[0]
             for kind in ("fwd", "dq", "dkdv")}
    check_against_reference(layout, 128, q, k, v, do, tiles=tiles, dropout_p=0.1, seed=77)
    keep = bsa.dropout_keep_mask(2, 4, 1024, 0.1, 77, "cuda")
    n = keep.numel()
    assert abs(keep.float().mean().item() - 0.9) < 6 * math.sqrt(0.09 / n)


@pytest.mark.gpu
def test_gpu_all_ones_layout_equals_sdpa_bf16():
    q, k, v, do = inputs(2, 4, 1024, 96, torch.bfloat16, seed=41)
    lut = BlockLUT.from_layout(layouts.causal(8), 128).to("cuda")
    out = blocksparse_attention(q, k, v, lut, tiles=GPU_TILES[96])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, atol=TOL[torch.bfloat16][0], rtol=0)


def test_lookup_table_is_built_on_the_cpu_under_a_default_device_context():
    # deepspeed.zero.Init makes the accelerator the default device while the model is built; the layout and its
    # lookup table must stay CPU tensors (an H200 run once failed here: "found cuda:0 and cpu").
    from shared.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(preset("tiny", attention="blocksparse"))
    lut = model.blocks[0].attn.attn.lut
    assert lut.row_idx.device.type == "cpu" and lut.col_cum.device.type == "cpu"
    # its device copies, the module's buffers, are made where the model's other buffers are (zero.Init's device on a
    # GPU: ZeRO-3's engine moves no model that zero.Init built)
    attn = model.blocks[0].attn.attn
    assert model.pos.device.type == "meta" and attn.lut_row_idx.device.type == "meta"
    assert attn.lut_row_idx.dtype == torch.int32 and attn.lut_row_idx.shape == lut.row_idx.shape


@pytest.mark.parametrize("sweep,files,dropouts", [
    ("blocksparse_tiles_1xh200", ["attention_tiles_h200.json"], {0.0, 0.1}),  # pointer loads only
    ("blocksparse_tma_1xh200", ["tiles_tma_wide.json", "tiles_tma_dropout.json"], {0.0, 0.1}),  # and TMA loads
    ("blocksparse_rows_1xh200", ["tiles_wide.json", "tiles_dkdv_bhtd.json"], {0.0}),  # no pointer tiles in loops
])
def test_head_dim_96_candidates_hold_the_fastest_tiles_of_the_committed_h200_sweeps(sweep, files, dropouts):
    """The autotuner can only pick what it is offered: each sweep's fastest tile of each kernel it timed, with and
    without dropout, is a candidate, and the fastest of the latest sweep over all kernels on the model's q/k/v
    views, without dropout, lead."""
    folder = Path(__file__).parents[1] / "benchmarks" / "results" / sweep
    summaries = {f: json.loads((folder / f).read_text())["summary"] for f in files}
    assert {s["dropout"] for summary in summaries.values() for s in summary} == dropouts
    for f, summary in summaries.items():
        for s in summary:
            for kind, best in s["best"].items():
                tile = Tile(best["block_m"], best["block_n"], best["num_warps"], best["num_stages"], best["pad_d"],
                            tma=best.get("tma", False))
                shapes = [dataclasses.replace(t, dropout=True)
                          for t in bsa.candidate_tiles(kind, 128, 96, torch.bfloat16, s["dropout"] > 0)]
                assert tile in shapes, (f, kind, s["dropout"], tile)
                if f == "tiles_wide.json" and sweep == "blocksparse_rows_1xh200":
                    assert shapes[0] == tile, (kind, "the fastest tile is not the first candidate")
