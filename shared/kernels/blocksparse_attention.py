"""Block-sparse causal attention: a fused FlashAttention-2 Triton kernel that visits only a layout's blocks.

Numbers are defined by `shared.model.attention.ReferenceAttention`: softmax(q k^T / sqrt(D) + mask) v with the token
mask `expand(layout) & causal` (shared/model/layouts.token_mask), dropout on the probabilities.
tests/test_blocksparse.py holds the comparison. This module is the operation only and imports nothing of the
project; the model's attention module around it is shared/model/attention/blocksparse.py.

Design (Triton's fused-attention tutorial, tutorials/06-fused-attention.py, FA2 of Dao 2023, plus a lookup table):
  - Lookup table (`BlockLUT`), built once per layout on the CPU and copied once per device. A kernel program owns a
    tile of one sparse block row (forward, dq) or column (dk/dv), reads how many blocks that row/column has and
    which, and loops only over those. Blocks strictly below the diagonal need no mask; the diagonal block is kept
    apart and visited last (rows) or first (columns) with the causal mask: the mask is applied in diagonal blocks
    only, and the unmasked loop stays a plain software-pipelined loop. Columns carry a cumulative count so that
    a shorter runtime T (the layout's top-left sub-grid) needs no new table. Where every row's and column's
    blocks are one run (causal, local: `BlockLUT.contiguous`, the CONTIG constexpr) the loops step from the run's
    first block with affine addresses instead of reading each block index.
  - Forward: one program per BLOCK_M queries, online softmax over BLOCK_N-key tiles in base 2 (scale folded into
    log2(e)), saves the log-sum-exp (base 2) for backward. Programs of the longest rows are launched first.
  - Backward, no atomics: the dq kernel (one program per query tile, same row table) also computes
    delta = rowsum(o * do) for its rows (the tutorial's separate preprocess pass, fused); then the dk/dv kernel
    (one program per key tile, column table) reads delta. Each gradient element is written by exactly one program.
    `_backward_atomic_dq` is the one-pass alternative (the dk/dv kernel also adds dq atomically in fp32, DQ_ATOMIC:
    5 products instead of 7), kept for benchmarks/attention_tiles.py --atomic_dq: it measured slower (docs/ledger.md,
    the one-pass backward's row).
  - Head dims: Triton tiles are powers of two. D = 96 runs either as two parts, 64 + 32 wide (q_a/q_b,
    acc_a/acc_b, ...: no wasted tensor-core work, a second chained dot per product), or as one part zero-padded
    to 128 with masked loads and stores (4/3 of the work, one dot); both are autotuning candidates, since which
    wins on Hopper is a measurement. Dims 16, 32, 64 and 128 use one part.
  - Kernel tiles may be smaller than the sparse block (e.g. 64x64 tiles in 128-token blocks): a block is then
    visited as SPARSE_BLOCK // BLOCK_N sub-tiles in one flattened loop. Tile sizes, warps, stages and the D = 96
    variant are chosen per (kernel, sparse block, head dim, dtype, dropout, sequence length, stepping, layout
    width) among a few candidates by Triton's autotuner on the first call on a GPU (`candidate_tiles`, for D = 96
    led by the fastest tiles of a sweep, benchmarks/attention_tiles.py, docs/kernels.md; registers and spills of
    each, per Triton version: benchmarks/kernel_resources.py); `chosen_configs()` records the choices.
  - Registers: a loop holds no (rows x head dim) tile of pointers, which takes twice the registers of an fp32
    tile of its shape. Pointer loads keep one (1, part) row of column addresses across the loop and add the
    tile's token offsets inside it (`_load_rows`; loops with LICM off, so that the compiler does not hoist the
    tile back out).
  - TMA: a tile may load the tiles of its loop (keys and values in the forward and dq kernels, queries and dO in
    dk/dv) through tensor descriptors the program creates on the device (`Tile.tma`; Hopper's tensor memory
    accelerator copies a whole tile to shared memory, no per-thread addresses). Such tiles are candidates only
    where `tma_ok` accepts the inputs (fp16/bf16, 16-byte aligned bases and strides, compute capability >= 9);
    a fixed TMA tile on other inputs raises ValueError.
  - Dropout: Philox counter-based random numbers (tl.randint4x: four 32-bit numbers per call, used as eight
    16-bit halves). The key is (per-call seed, batch*head index); score (q, k) takes half k % 8 of counter
    q * T / 8 + k // 8 and is kept when it is >= p * 65536, so the rate applied is p rounded to a multiple of
    1/65536 (`applied_dropout`: 0.1 -> 0.100006), and kept probabilities are scaled by 1 / (1 - that rate).
    Forward, dq and dk/dv therefore regenerate the same keep mask element by element whatever their tile shapes.
    With `dropout_mask="bits"` the mask is drawn once per call instead (`_dropout_bits_kernel`: one Philox call per
    byte of eight scores, in the layout's blocks only) and the three kernels read it (DROPOUT_BITS): the same mask,
    T * T / 8 bytes a head kept from the forward to the backward, faster than the three kernels' own draws at the
    1.5b model's shape (benchmarks/attention_dropout.py; measured in docs/ledger.md, the `--attn_dropout_mask bits`
    row).
    The per-call seed is drawn on the device by torch.randint (`draw_seed`: reproducible under torch.manual_seed,
    replayed by torch.utils.checkpoint on recompute, no host sync) and read by the kernels from device memory.
    `dropout_keep_mask` returns the mask of a seed, for tests.
  - torch.compile: the operation is a pair of torch custom ops (forward, backward) with its autograd formula
    registered, so a compiled graph holds it as one node, with no break (see `_attention_fwd_op`).

Limits (each raises ValueError naming the value): head dims SUPPORTED_HEAD_DIMS, sparse blocks SUPPORTED_BLOCKS,
dtypes fp16/bf16/fp32 (fp32 uses exact fp32 dots: correct but slow), T a multiple of the sparse block and at most
the layout's size; with dropout T <= 32768 (the mask kernel for tests addresses q * T + k in int32; the Philox
counter q * T / 8 + k / 8 stays below 2^27). On a CPU the kernels run only under the Triton interpreter
(TRITON_INTERPRET=1 set before triton is imported).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from shared.kernels.dropout_mask import applied_rate, keep_halves

SUPPORTED_HEAD_DIMS = (16, 32, 64, 96, 128)
SUPPORTED_BLOCKS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_DROPOUT_T = 32768
DROPOUT_MASKS = ("philox", "bits")  # where the kernels take the dropout mask from: see blocksparse_attention
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------------
# Lookup table
# ----------------------------------------------------------------------------------------------------------------


def _sorted_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask (R, n) bool -> (positions of True per row, ascending, padded with 0: (R, max(1, widest)), counts (R,))."""
    n = mask.shape[-1]
    pos = torch.arange(n, device=mask.device).expand_as(mask)
    ordered = torch.where(mask, pos, pos + n).sort(dim=-1).values  # True positions first, in order
    counts = mask.sum(dim=-1)
    width = max(1, int(counts.max()))
    ordered = ordered[:, :width]
    return torch.where(ordered < n, ordered, 0).to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()


def _runs(idx: torch.Tensor, counts: torch.Tensor) -> bool:
    """True when each row's first counts[r] entries of idx are consecutive: idx[r, 0], idx[r, 0] + 1, ..."""
    steps = torch.arange(idx.shape[1], dtype=idx.dtype, device=idx.device)  # also under a default device
    valid = steps[None, :] < counts[:, None]
    return bool(((idx == idx[:, :1] + steps) | ~valid).all())


def check_layout(layout: torch.Tensor) -> torch.Tensor:
    """The layout as a contiguous CPU bool tensor (n_heads or 1, n_blocks, n_blocks), or a ValueError naming what the
    kernels cannot run: another shape, non-0/1 values, a block above the diagonal, a row without any block."""
    if not isinstance(layout, torch.Tensor) or layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        shape = tuple(layout.shape) if isinstance(layout, torch.Tensor) else type(layout).__name__
        raise ValueError(f"layout must be (n_heads or 1, n_blocks, n_blocks), got shape {shape}")
    if layout.dtype != torch.bool:
        if layout.is_floating_point() or not ((layout == 0) | (layout == 1)).all():
            raise ValueError(f"layout must be bool or 0/1 integers, got dtype {layout.dtype}")
        layout = layout.bool()
    layout = layout.cpu()
    nb = layout.shape[-1]
    above = layout & ~torch.ones(nb, nb, dtype=torch.bool, device="cpu").tril()  # also under a default device
    if above.any():
        h, i, j = above.nonzero()[0].tolist()
        raise ValueError(f"layout has a block above the diagonal (head {h}, query block {i}, key block {j}); "
                         "the kernels compute causal attention only")
    empty = ~layout.any(dim=-1)
    if empty.any():
        h, i = empty.nonzero()[0].tolist()
        raise ValueError(f"layout row is empty (head {h}, query block {i}): those queries would attend to no key")
    return layout.contiguous()


@dataclass(frozen=True)
class BlockLUT:
    """The layout as the kernels read it; row r = head * n_blocks + block (head 0 only when shared by all heads)."""

    block: int
    """tokens per sparse block"""
    n_blocks: int
    """blocks per side of the full layout"""
    n_heads: int
    """layout heads: 1 (shared) or n_head"""
    nnz: int
    """non-zero blocks of the layout, summed over its heads"""
    row_idx: torch.Tensor
    """(n_heads * n_blocks, row_width) int32: off-diagonal key blocks of each query block, ascending"""
    row_off: torch.Tensor
    """(n_heads * n_blocks,) int32: how many of row_idx are valid"""
    diag: torch.Tensor
    """(n_heads * n_blocks,) int32: 1 where the diagonal block is in the layout"""
    col_idx: torch.Tensor
    """(n_heads * n_blocks, col_width) int32: off-diagonal query blocks of each key block, ascending"""
    col_cum: torch.Tensor
    """(n_heads * n_blocks, n_blocks) int32: [r, t] = entries of col_idx row r that are <= t (for T = (t+1) blocks)"""
    contiguous: bool = False
    """every row's and every column's off-diagonal blocks are one run (causal, local): the kernels then step over
    keys/queries from the run's first block with affine addresses instead of reading each block index"""

    @staticmethod
    def from_layout(layout: torch.Tensor, block: int) -> BlockLUT:
        """Tables of a bool layout (n_heads or 1, n_blocks, n_blocks), built on the CPU. The kernel's preconditions
        are checked here (`check_layout`): a block above the diagonal would otherwise be visited unmasked."""
        layout = check_layout(layout)
        n_heads, nb, _ = layout.shape
        off_diag = layout & ~torch.eye(nb, dtype=torch.bool, device=layout.device)  # [h, q, k]; none above diagonal
        row_idx, row_off = _sorted_positions(off_diag.reshape(n_heads * nb, nb))
        by_column = off_diag.transpose(1, 2).reshape(n_heads * nb, nb)  # [h, k block, q block]
        col_idx, col_cnt = _sorted_positions(by_column)
        return BlockLUT(
            block=block, n_blocks=nb, n_heads=n_heads, nnz=int(layout.sum()),
            row_idx=row_idx, row_off=row_off,
            diag=layout.diagonal(dim1=1, dim2=2).reshape(-1).to(torch.int32).contiguous(),
            col_idx=col_idx, col_cum=by_column.to(torch.int32).cumsum(dim=-1).to(torch.int32).contiguous(),
            contiguous=_runs(row_idx, row_off) and _runs(col_idx, col_cnt),
        )

    def to(self, device: torch.device | str) -> BlockLUT:
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in LUT_TENSORS})


# BlockLUT's tensor fields (the rest are ints and a flag): what moves between devices, the custom op's tensor list,
# the attention module's buffers
LUT_TENSORS = ("row_idx", "row_off", "diag", "col_idx", "col_cum")


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _philox_key(seed, off_hz):
    # 64-bit Philox key: low word the per-call seed, high word the (batch, head) index, so that every head draws
    # an independent stream and the 32-bit counter only has to number the T x T scores of one head.
    return seed.to(tl.int64) + off_hz.to(tl.int64) * 4294967296


@triton.jit
def _seed_key(SEED, off_hz, DROPOUT: tl.constexpr):
    """The Philox key of this (batch, head) from the per-call seed, which the kernels read from device memory (a
    one-element int64 tensor: drawn on the device, no host sync); without dropout nothing is read."""
    if DROPOUT:
        key = _philox_key(tl.load(SEED), off_hz)
    else:
        key = off_hz.to(tl.int64)
    return key


@triton.jit
def _keep(key, rows, col0, N: tl.constexpr, T, dropout_p):
    """Dropout keep mask (len(rows), N) of the scores (rows, col0 .. col0 + N - 1), col0 a multiple of 8: the same
    bits in every kernel whatever its tile shape. One Philox call gives four 32-bit numbers, eight 16-bit halves:
    score (q, k) takes half k % 8 of counter q * T / 8 + k // 8 (number (k % 8) // 2, low half for even k) and is
    kept when it is >= p * 65536 (`applied_dropout`: p is a multiple of 1/65536). A tile costs an eighth of the
    Philox rounds of one call per score; those integer rounds are what dropout costs the kernels."""
    counters = rows[:, None] * (T // 8) + (col0 // 8 + tl.arange(0, N // 8))[None, :]
    r0, r1, r2, r3 = tl.randint4x(key, counters)
    return keep_halves(r0, r1, r2, r3, tl.cast(dropout_p * 65536.0 + 0.5, tl.uint32) << 16)


@triton.jit
def _bits_words(bits, rows, col0, N: tl.constexpr, T):
    """The packed keep mask of the scores (rows, col0 .. col0 + N - 1), col0 a multiple of 8, as (len(rows), N / 8)
    int32 words of one byte each (`bits` is the (batch, head)'s (T, T / 8) bytes that `_dropout_bits_kernel` packed).
    The tile functions issue this load first, before their products, so that it is in flight while they run
    (measured in docs/kernels.md, block-sparse attention's dropout); `_unpack_words` makes the mask where it is
    applied."""
    return tl.load(bits + rows[:, None] * (T // 8) + (col0 // 8 + tl.arange(0, N // 8))[None, :]).to(tl.int32)


@triton.jit
def _unpack_words(words, M: tl.constexpr, N: tl.constexpr):
    """The (M, N) keep mask of `_bits_words`' words: the same mask `_keep` draws, one byte load per eight scores
    instead of an eighth of a Philox call per score."""
    return tl.reshape((words[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1, (M, N)) != 0


@triton.jit
def _dropout_bits_kernel(BITS, COL_CUM, DIAG, dropout_p, SEED, T, H, NB, LUT_HEADS, SPARSE_BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, BYTES: tl.constexpr):
    """The keep mask packed for DROPOUT_BITS: score (q, k) of head bh is bit k % 8 of byte
    (bh * T + q) * T / 8 + k // 8. That byte's index within the head, q * T / 8 + k // 8, is the Philox counter
    whose eight 16-bit halves `_keep` gives the scores k // 8 * 8 .. + 7: one call makes one byte, no shuffles.
    A program draws (ROWS x 8 BYTES) scores inside one sparse block, and only in the layout's blocks (the kernels
    visit no other; their diagonal blocks' tiles read the whole block, past the causal diagonal): a sparse layout
    pays for its own blocks. Bytes of other blocks stay unwritten."""
    off_hz = tl.program_id(2)
    row0 = tl.program_id(0) * ROWS
    byte0 = tl.program_id(1) * BYTES
    rb = row0 // SPARSE_BLOCK
    cb = byte0 * 8 // SPARSE_BLOCK
    # Is block (rb, cb) in the layout? The diagonal one says DIAG; below it, col_cum[col, t] counts the key block
    # cb's query blocks <= t, so it grows at t = rb exactly when (rb, cb) is one.
    col = ((off_hz % H) % LUT_HEADS) * NB + cb
    visited = (rb == cb) & (tl.load(DIAG + col - cb + rb) != 0)
    if cb < rb:
        visited = tl.load(COL_CUM + col * NB + rb) != tl.load(COL_CUM + col * NB + rb - 1)
    if visited:
        counters = (row0 + tl.arange(0, ROWS))[:, None] * (T // 8) + (byte0 + tl.arange(0, BYTES))[None, :]
        r0, r1, r2, r3 = tl.randint4x(_philox_key(tl.load(SEED), off_hz), counters)
        t = tl.cast(dropout_p * 65536.0 + 0.5, tl.uint32) << 16
        # number i's low half is score 2 i of the eight, its high half score 2 i + 1 (`keep_halves`' order)
        packed = (((r0 << 16) >= t).to(tl.int32) | ((r0 >= t).to(tl.int32) << 1)
                  | (((r1 << 16) >= t).to(tl.int32) << 2) | ((r1 >= t).to(tl.int32) << 3)
                  | (((r2 << 16) >= t).to(tl.int32) << 4) | ((r2 >= t).to(tl.int32) << 5)
                  | (((r3 << 16) >= t).to(tl.int32) << 6) | ((r3 >= t).to(tl.int32) << 7))
        BITS += off_hz.to(tl.int64) * T * (T // 8)
        tl.store(BITS + counters, packed.to(tl.uint8))


@triton.jit
def _load_a(ptrs, dmask, PADDED: tl.constexpr):
    """Load a tile of the first head-dim part; masked only when that part is padded past the head dim."""
    if PADDED:
        x = tl.load(ptrs, mask=dmask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _store_a(ptrs, x, dmask, PADDED: tl.constexpr):
    if PADDED:
        tl.store(ptrs, x, mask=dmask)
    else:
        tl.store(ptrs, x)


@triton.jit
def _load_rows(src, offsets, start, dmask, PADDED: tl.constexpr, TMA: tl.constexpr):
    """A (BLOCK, part) tile of tokens start .. start + BLOCK - 1: from a tensor descriptor (TMA; zero past the head
    dim) or from the (1, part) row of addresses `src` plus the tokens' element offsets `offsets` (BLOCK, 1), so
    that no (BLOCK, part) tile of pointers lives across the loop."""
    if TMA:
        x = src.load([start, 0])
    else:
        x = _load_a(src + offsets, dmask, PADDED)
    return x


@triton.jit
def _descriptors(X, T, stride_t, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr):
    """TMA descriptors of one (T, HEAD_DIM) head, tiles of (ROWS, DA) columns [0, DA) and (ROWS, DB) columns
    [DA, DA + DB); a padded part (DA > HEAD_DIM) reads zeros past the head dim."""
    xa = tl.make_tensor_descriptor(X, shape=[T, HEAD_DIM - DB], strides=[stride_t, 1], block_shape=[ROWS, DA])
    xb = xa
    if DB > 0:
        xb = tl.make_tensor_descriptor(X + DA, shape=[T, DB], strides=[stride_t, 1], block_shape=[ROWS, DB])
    return xa, xb


@triton.jit
def _fwd_tile(acc_a, acc_b, l_i, m_i, q_a, q_b, K_a, K_b, V_a, V_b, start_n, offs_m, offs_n, qk_scale,
              stride_kt, stride_vt, key, bits, dropout_p, T, dm_row, dm_col,
              DB: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
              PADDED: tl.constexpr, TMA: tl.constexpr, FROM_BITS: tl.constexpr):
    """One (BLOCK_M x BLOCK_N) step of the online softmax (FA2 algorithm 1), in base 2. With TMA, K_*/V_* are
    tensor descriptors of (BLOCK_N, part) tiles instead of rows of addresses."""
    if DROPOUT and FROM_BITS:
        words = _bits_words(bits, offs_m, start_n, offs_n.shape[0], T)  # issued before the products
    cols_k = (start_n + offs_n)[None, :] * stride_kt
    if TMA:
        kT_a = K_a.load([start_n, 0]).T
    else:
        kT_a = _load_a(K_a + cols_k, dm_col, PADDED)  # (DA, BLOCK_N)
    qk = tl.dot(q_a, kT_a, input_precision=PREC)
    if DB > 0:
        if TMA:
            kT_b = K_b.load([start_n, 0]).T
        else:
            kT_b = tl.load(K_b + cols_k)
        qk = tl.dot(q_b, kT_b, qk, input_precision=PREC)
    if MASK:
        causal = offs_m[:, None] >= (start_n + offs_n)[None, :]
        qk = tl.where(causal, qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_ij[:, None]
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_ij[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)  # the normalizer counts dropped probabilities too
    if DROPOUT:
        if FROM_BITS:
            keep = _unpack_words(words, offs_m.shape[0], offs_n.shape[0])
        else:
            keep = _keep(key, offs_m, start_n, offs_n.shape[0], T, dropout_p)
        p = tl.where(keep, p, 0.0)
    p = p.to(q_a.dtype)
    rows_v = (start_n + offs_n)[:, None] * stride_vt
    v_a = _load_rows(V_a, rows_v, start_n, dm_row, PADDED, TMA)  # (BLOCK_N, DA)
    acc_a = tl.dot(p, v_a, acc_a * alpha[:, None], input_precision=PREC)
    if DB > 0:
        v_b = _load_rows(V_b, rows_v, start_n, dm_row, False, TMA)
        acc_b = tl.dot(p, v_b, acc_b * alpha[:, None], input_precision=PREC)
    return acc_a, acc_b, l_i, m_ij


@triton.jit
def _attn_fwd(Q, K, V, Out, LSE, ROW_IDX, ROW_OFF, DIAG,
              sm_scale, dropout_p, SEED, BITS,
              stride_qz, stride_qh, stride_qt, stride_kz, stride_kh, stride_kt,
              stride_vz, stride_vh, stride_vt, stride_oz, stride_oh, stride_ot,
              H, T, NB, LUT_HEADS, ROW_WIDTH,
              HEAD_DIM: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
              CONTIG: tl.constexpr, TMA: tl.constexpr = False, DROPOUT_BITS: tl.constexpr = False):
    # Query tiles in reverse: under a causal layout the last rows have the most blocks, so they start first and
    # the short rows fill the tail of the grid.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    Q += off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    K += off_z.to(tl.int64) * stride_kz + off_h.to(tl.int64) * stride_kh
    V += off_z.to(tl.int64) * stride_vz + off_h.to(tl.int64) * stride_vh
    Out += off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
    LSE += off_hz.to(tl.int64) * T

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, DA)
    PADDED: tl.constexpr = DA > HEAD_DIM
    dm_row = offs_da[None, :] < HEAD_DIM
    dm_col = offs_da[:, None] < HEAD_DIM
    q_a = _load_a(Q + offs_m[:, None] * stride_qt + offs_da[None, :], dm_row, PADDED)
    K_a = K + offs_da[:, None]  # a (DA, 1) column and (1, DA) row: the tile function adds its keys' offsets
    V_a = V + offs_da[None, :]
    acc_a = tl.zeros([BLOCK_M, DA], dtype=tl.float32)
    q_b, K_b, V_b, acc_b = q_a, K_a, V_a, acc_a  # placeholders, never read when DB == 0
    if DB > 0:
        offs_db = DA + tl.arange(0, DB)
        q_b = tl.load(Q + offs_m[:, None] * stride_qt + offs_db[None, :])
        K_b = K + offs_db[:, None]
        V_b = V + offs_db[None, :]
        acc_b = tl.zeros([BLOCK_M, DB], dtype=tl.float32)
    if TMA:  # keys and values of the loops through the tensor memory accelerator
        K_a, K_b = _descriptors(K, T, stride_kt, BLOCK_N, HEAD_DIM, DA, DB)
        V_a, V_b = _descriptors(V, T, stride_vt, BLOCK_N, HEAD_DIM, DA, DB)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
    key = _seed_key(SEED, off_hz, DROPOUT)
    bits = BITS + off_hz.to(tl.int64) * T * (T // 8)  # read only with DROPOUT_BITS

    row = (off_h % LUT_HEADS) * NB + start_m // SPARSE_BLOCK
    SUB: tl.constexpr = SPARSE_BLOCK // BLOCK_N
    # Blocks strictly left of the diagonal: no mask.
    n_off = tl.load(ROW_OFF + row)
    lo = tl.load(ROW_IDX + row * ROW_WIDTH) * SPARSE_BLOCK  # the run's first key when CONTIG
    for it in tl.range(0, n_off * SUB, disable_licm=True):
        if CONTIG:
            start_n = tl.multiple_of(lo + it * BLOCK_N, BLOCK_N)
        else:
            kb = tl.load(ROW_IDX + row * ROW_WIDTH + it // SUB)
            start_n = tl.multiple_of(kb * SPARSE_BLOCK + (it % SUB) * BLOCK_N, BLOCK_N)
        acc_a, acc_b, l_i, m_i = _fwd_tile(acc_a, acc_b, l_i, m_i, q_a, q_b, K_a, K_b, V_a, V_b, start_n, offs_m,
                                           offs_n, qk_scale, stride_kt, stride_vt, key, bits, dropout_p, T,
                                           dm_row, dm_col, DB, False, DROPOUT, PREC, PADDED, TMA, DROPOUT_BITS)
    # The diagonal block, causal mask, up to this tile's last query. Its first key is at or before every query
    # of the tile, so no row is ever fully masked and the running max stays finite.
    diag_start = (start_m // SPARSE_BLOCK) * SPARSE_BLOCK
    n_diag = tl.load(DIAG + row) * tl.cdiv(start_m + BLOCK_M - diag_start, BLOCK_N)
    for it in tl.range(0, n_diag, disable_licm=True):
        start_n = tl.multiple_of(diag_start + it * BLOCK_N, BLOCK_N)
        acc_a, acc_b, l_i, m_i = _fwd_tile(acc_a, acc_b, l_i, m_i, q_a, q_b, K_a, K_b, V_a, V_b, start_n, offs_m,
                                           offs_n, qk_scale, stride_kt, stride_vt, key, bits, dropout_p, T,
                                           dm_row, dm_col, DB, True, DROPOUT, PREC, PADDED, TMA, DROPOUT_BITS)

    l_rcp = 1.0 / l_i
    if DROPOUT:
        l_rcp = l_rcp / (1.0 - dropout_p)  # inverted dropout: kept probabilities scaled by 1/(1-p)
    tl.store(LSE + offs_m, m_i + tl.math.log2(l_i))
    out_ty = Out.dtype.element_ty
    _store_a(Out + offs_m[:, None] * stride_ot + offs_da[None, :], (acc_a * l_rcp[:, None]).to(out_ty), dm_row, PADDED)
    if DB > 0:
        tl.store(Out + offs_m[:, None] * stride_ot + offs_db[None, :], (acc_b * l_rcp[:, None]).to(out_ty))


@triton.jit
def _dq_tile(dq_a, dq_b, q_a, q_b, do_a, do_b, lse, delta, K_a, K_b, V_a, V_b, start_n, offs_m, offs_n, qk_scale,
             stride_kt, stride_vt, key, bits, dropout_p, T, dm_row,
             DB: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr, PADDED: tl.constexpr,
             TMA: tl.constexpr, FROM_BITS: tl.constexpr):
    """dq += dS K for one (BLOCK_M x BLOCK_N) tile, with P recomputed from the saved log-sum-exp."""
    if DROPOUT and FROM_BITS:
        words = _bits_words(bits, offs_m, start_n, offs_n.shape[0], T)
    rows_k = (start_n + offs_n)[:, None] * stride_kt
    rows_v = (start_n + offs_n)[:, None] * stride_vt
    k_a = _load_rows(K_a, rows_k, start_n, dm_row, PADDED, TMA)  # (BLOCK_N, DA)
    v_a = _load_rows(V_a, rows_v, start_n, dm_row, PADDED, TMA)
    qk = tl.dot(q_a, tl.trans(k_a), input_precision=PREC)
    dp = tl.dot(do_a, tl.trans(v_a), input_precision=PREC)
    if DB > 0:
        k_b = _load_rows(K_b, rows_k, start_n, dm_row, False, TMA)
        v_b = _load_rows(V_b, rows_v, start_n, dm_row, False, TMA)
        qk = tl.dot(q_b, tl.trans(k_b), qk, input_precision=PREC)
        dp = tl.dot(do_b, tl.trans(v_b), dp, input_precision=PREC)
    p = tl.math.exp2(qk * qk_scale - lse[:, None])
    if MASK:
        p = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], p, 0.0)
    if DROPOUT:
        if FROM_BITS:
            keep = _unpack_words(words, offs_m.shape[0], offs_n.shape[0])
        else:
            keep = _keep(key, offs_m, start_n, offs_n.shape[0], T, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = (p * (dp - delta[:, None])).to(q_a.dtype)
    dq_a = tl.dot(ds, k_a, dq_a, input_precision=PREC)
    if DB > 0:
        dq_b = tl.dot(ds, k_b, dq_b, input_precision=PREC)
    return dq_a, dq_b


@triton.jit
def _attn_bwd_dq(Q, K, V, Out, DO, DQ, LSE, DELTA, ROW_IDX, ROW_OFF, DIAG,
                 sm_scale, dropout_p, SEED, BITS,
                 stride_qz, stride_qh, stride_qt, stride_kz, stride_kh, stride_kt,
                 stride_vz, stride_vh, stride_vt, stride_oz, stride_oh, stride_ot,
                 stride_doz, stride_doh, stride_dot,
                 H, T, NB, LUT_HEADS, ROW_WIDTH,
                 HEAD_DIM: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
                 CONTIG: tl.constexpr, TMA: tl.constexpr = False, DROPOUT_BITS: tl.constexpr = False):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    Q += off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    K += off_z.to(tl.int64) * stride_kz + off_h.to(tl.int64) * stride_kh
    V += off_z.to(tl.int64) * stride_vz + off_h.to(tl.int64) * stride_vh
    Out += off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh  # Out and DQ share one layout
    DQ += off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
    DO += off_z.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh
    LSE += off_hz.to(tl.int64) * T
    DELTA += off_hz.to(tl.int64) * T

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, DA)
    PADDED: tl.constexpr = DA > HEAD_DIM
    dm_row = offs_da[None, :] < HEAD_DIM
    q_a = _load_a(Q + offs_m[:, None] * stride_qt + offs_da[None, :], dm_row, PADDED)
    do_a = _load_a(DO + offs_m[:, None] * stride_dot + offs_da[None, :], dm_row, PADDED)
    o_a = _load_a(Out + offs_m[:, None] * stride_ot + offs_da[None, :], dm_row, PADDED)
    delta = tl.sum(o_a.to(tl.float32) * do_a.to(tl.float32), axis=1)
    K_a = K + offs_da[None, :]  # (1, DA) rows: the tile function adds its keys' offsets inside the loop
    V_a = V + offs_da[None, :]
    dq_a = tl.zeros([BLOCK_M, DA], dtype=tl.float32)
    q_b, do_b, K_b, V_b, dq_b = q_a, do_a, K_a, V_a, dq_a  # placeholders, never read when DB == 0
    if DB > 0:
        offs_db = DA + tl.arange(0, DB)
        q_b = tl.load(Q + offs_m[:, None] * stride_qt + offs_db[None, :])
        do_b = tl.load(DO + offs_m[:, None] * stride_dot + offs_db[None, :])
        o_b = tl.load(Out + offs_m[:, None] * stride_ot + offs_db[None, :])
        delta += tl.sum(o_b.to(tl.float32) * do_b.to(tl.float32), axis=1)
        K_b = K + offs_db[None, :]
        V_b = V + offs_db[None, :]
        dq_b = tl.zeros([BLOCK_M, DB], dtype=tl.float32)
    if TMA:
        K_a, K_b = _descriptors(K, T, stride_kt, BLOCK_N, HEAD_DIM, DA, DB)
        V_a, V_b = _descriptors(V, T, stride_vt, BLOCK_N, HEAD_DIM, DA, DB)
    # delta = rowsum(dO * O) = rowsum(P * dP) even with dropout (O already carries the mask); dk/dv reads it.
    tl.store(DELTA + offs_m, delta)
    lse = tl.load(LSE + offs_m)
    qk_scale = sm_scale * 1.4426950408889634
    key = _seed_key(SEED, off_hz, DROPOUT)
    bits = BITS + off_hz.to(tl.int64) * T * (T // 8)  # read only with DROPOUT_BITS

    row = (off_h % LUT_HEADS) * NB + start_m // SPARSE_BLOCK
    SUB: tl.constexpr = SPARSE_BLOCK // BLOCK_N
    n_off = tl.load(ROW_OFF + row)
    lo = tl.load(ROW_IDX + row * ROW_WIDTH) * SPARSE_BLOCK  # the run's first key when CONTIG
    for it in tl.range(0, n_off * SUB, disable_licm=True):
        if CONTIG:
            start_n = tl.multiple_of(lo + it * BLOCK_N, BLOCK_N)
        else:
            kb = tl.load(ROW_IDX + row * ROW_WIDTH + it // SUB)
            start_n = tl.multiple_of(kb * SPARSE_BLOCK + (it % SUB) * BLOCK_N, BLOCK_N)
        dq_a, dq_b = _dq_tile(dq_a, dq_b, q_a, q_b, do_a, do_b, lse, delta, K_a, K_b, V_a, V_b, start_n, offs_m,
                              offs_n, qk_scale, stride_kt, stride_vt, key, bits, dropout_p, T, dm_row, DB, False,
                              DROPOUT, PREC, PADDED, TMA, DROPOUT_BITS)
    diag_start = (start_m // SPARSE_BLOCK) * SPARSE_BLOCK
    n_diag = tl.load(DIAG + row) * tl.cdiv(start_m + BLOCK_M - diag_start, BLOCK_N)
    for it in tl.range(0, n_diag, disable_licm=True):
        start_n = tl.multiple_of(diag_start + it * BLOCK_N, BLOCK_N)
        dq_a, dq_b = _dq_tile(dq_a, dq_b, q_a, q_b, do_a, do_b, lse, delta, K_a, K_b, V_a, V_b, start_n, offs_m,
                              offs_n, qk_scale, stride_kt, stride_vt, key, bits, dropout_p, T, dm_row, DB, True,
                              DROPOUT, PREC, PADDED, TMA, DROPOUT_BITS)

    _store_a(DQ + offs_m[:, None] * stride_ot + offs_da[None, :], (dq_a * sm_scale).to(DQ.dtype.element_ty), dm_row,
             PADDED)
    if DB > 0:
        tl.store(DQ + offs_m[:, None] * stride_ot + offs_db[None, :], (dq_b * sm_scale).to(DQ.dtype.element_ty))


@triton.jit
def _dkdv_tile(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, Q_a, Q_b, DO_a, DO_b, DQ_a, DQ_b, LSE, DELTA, start_m,
               start_n, offs_m, offs_n, sm_scale, qk_scale, stride_qt, stride_dot, stride_gt, key, bits, dropout_p, T,
               dm_row, DB: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
               PADDED: tl.constexpr, TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr, FROM_BITS: tl.constexpr):
    """dv += P^T dO and dk += dS^T Q for one (BLOCK_N keys x BLOCK_M queries) tile, computed transposed; with
    DQ_ATOMIC also dq += dS K, added atomically."""
    q_idx = start_m + offs_m
    if DROPOUT and FROM_BITS:
        words = _bits_words(bits, q_idx, start_n, offs_n.shape[0], T)
    rows_q = (start_m + offs_m)[:, None] * stride_qt
    rows_do = (start_m + offs_m)[:, None] * stride_dot
    q_a = _load_rows(Q_a, rows_q, start_m, dm_row, PADDED, TMA)  # (BLOCK_M, DA)
    do_a = _load_rows(DO_a, rows_do, start_m, dm_row, PADDED, TMA)
    lse = tl.load(LSE + q_idx)
    delta = tl.load(DELTA + q_idx)
    qkT = tl.dot(k_a, tl.trans(q_a), input_precision=PREC)  # (BLOCK_N, BLOCK_M)
    dpT = tl.dot(v_a, tl.trans(do_a), input_precision=PREC)
    if DB > 0:
        q_b = _load_rows(Q_b, rows_q, start_m, dm_row, False, TMA)
        do_b = _load_rows(DO_b, rows_do, start_m, dm_row, False, TMA)
        qkT = tl.dot(k_b, tl.trans(q_b), qkT, input_precision=PREC)
        dpT = tl.dot(v_b, tl.trans(do_b), dpT, input_precision=PREC)
    pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
    if MASK:
        pT = tl.where(q_idx[None, :] >= offs_n[:, None], pT, 0.0)
    if DROPOUT:
        if FROM_BITS:
            keep = tl.trans(_unpack_words(words, offs_m.shape[0], offs_n.shape[0]))  # (N, M)
        else:
            keep = tl.trans(_keep(key, q_idx, start_n, offs_n.shape[0], T, dropout_p))  # (N, M)
        ppT = tl.where(keep, pT, 0.0)  # dv is scaled by 1/(1-p) once, at the end
        dpT = tl.where(keep, dpT * (1.0 / (1.0 - dropout_p)), 0.0)
    else:
        ppT = pT
    dv_a = tl.dot(ppT.to(q_a.dtype), do_a, dv_a, input_precision=PREC)
    dsT = (pT * (dpT - delta[None, :])).to(q_a.dtype)
    dk_a = tl.dot(dsT, q_a, dk_a, input_precision=PREC)
    if DB > 0:
        dv_b = tl.dot(ppT.to(q_a.dtype), do_b, dv_b, input_precision=PREC)
        dk_b = tl.dot(dsT, q_b, dk_b, input_precision=PREC)
    if DQ_ATOMIC:
        _add_dq(DQ_a, DQ_b, dsT, k_a, k_b, q_idx[:, None] * stride_gt, sm_scale, dm_row, DB, PREC, PADDED)
    return dk_a, dk_b, dv_a, dv_b


@triton.jit
def _add_dq(DQ_a, DQ_b, dsT, k_a, k_b, offsets, sm_scale, dm_row,
            DB: tl.constexpr, PREC: tl.constexpr, PADDED: tl.constexpr):
    """dq of the tile's queries (element offsets `offsets`, (BLOCK_M, 1), from the (1, part) rows DQ_a/DQ_b) +=
    sm_scale * dS K of one tile, added atomically into fp32 (DQ_ATOMIC)."""
    ds = tl.trans(dsT)  # (BLOCK_M, BLOCK_N)
    dq_a = tl.dot(ds, k_a, input_precision=PREC) * sm_scale
    if PADDED:
        tl.atomic_add(DQ_a + offsets, dq_a, mask=dm_row, sem="relaxed")
    else:
        tl.atomic_add(DQ_a + offsets, dq_a, sem="relaxed")
    if DB > 0:
        tl.atomic_add(DQ_b + offsets, tl.dot(ds, k_b, input_precision=PREC) * sm_scale, sem="relaxed")


@triton.jit
def _attn_bwd_delta(Out, DO, DELTA, stride_oz, stride_oh, stride_ot, stride_doz, stride_doh, stride_dot, H, T,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(o * do) for the dk/dv kernel when no dq kernel computes it (DQ_ATOMIC)."""
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d[None, :] < HEAD_DIM
    o = tl.load(Out + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_ot
                + offs_d[None, :], mask=dmask, other=0.0)
    do = tl.load(DO + off_z.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dot + offs_d[None, :], mask=dmask, other=0.0)
    tl.store(DELTA + off_hz.to(tl.int64) * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1))


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, DQ, LSE, DELTA, COL_IDX, COL_CUM, DIAG,
                   sm_scale, dropout_p, SEED, BITS,
                   stride_qz, stride_qh, stride_qt, stride_kz, stride_kh, stride_kt,
                   stride_vz, stride_vh, stride_vt, stride_doz, stride_doh, stride_dot,
                   stride_gz, stride_gh, stride_gt,
                   H, T, NB, LUT_HEADS, COL_WIDTH,
                   HEAD_DIM: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
                   CONTIG: tl.constexpr, TMA: tl.constexpr = False, DQ_ATOMIC: tl.constexpr = False,
                   DROPOUT_BITS: tl.constexpr = False):
    # Key tiles in order: under a causal layout the first columns have the most blocks.
    start_n = tl.program_id(0) * BLOCK_N
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    Q += off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    K += off_z.to(tl.int64) * stride_kz + off_h.to(tl.int64) * stride_kh
    V += off_z.to(tl.int64) * stride_vz + off_h.to(tl.int64) * stride_vh
    DO += off_z.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh
    DK += off_z.to(tl.int64) * stride_gz + off_h.to(tl.int64) * stride_gh  # DK and DV share one layout
    DV += off_z.to(tl.int64) * stride_gz + off_h.to(tl.int64) * stride_gh
    DQ += off_z.to(tl.int64) * stride_gz + off_h.to(tl.int64) * stride_gh  # fp32, DK's layout (DQ_ATOMIC)
    LSE += off_hz.to(tl.int64) * T
    DELTA += off_hz.to(tl.int64) * T

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_da = tl.arange(0, DA)
    PADDED: tl.constexpr = DA > HEAD_DIM
    dm_row = offs_da[None, :] < HEAD_DIM
    k_a = _load_a(K + offs_n[:, None] * stride_kt + offs_da[None, :], dm_row, PADDED)  # (BLOCK_N, DA), stays on chip
    v_a = _load_a(V + offs_n[:, None] * stride_vt + offs_da[None, :], dm_row, PADDED)
    Q_a = Q + offs_da[None, :]  # a (1, DA) row: the tile function adds its queries' offsets inside the loop
    DO_a = DO + offs_da[None, :]
    dk_a = tl.zeros([BLOCK_N, DA], dtype=tl.float32)
    dv_a = tl.zeros([BLOCK_N, DA], dtype=tl.float32)
    k_b, v_b, Q_b, DO_b, dk_b, dv_b = k_a, v_a, Q_a, DO_a, dk_a, dv_a  # placeholders, never read when DB == 0
    if DB > 0:
        offs_db = DA + tl.arange(0, DB)
        k_b = tl.load(K + offs_n[:, None] * stride_kt + offs_db[None, :])
        v_b = tl.load(V + offs_n[:, None] * stride_vt + offs_db[None, :])
        Q_b = Q + offs_db[None, :]
        DO_b = DO + offs_db[None, :]
        dk_b = tl.zeros([BLOCK_N, DB], dtype=tl.float32)
        dv_b = tl.zeros([BLOCK_N, DB], dtype=tl.float32)
    DQ_a = DQ + offs_da[None, :]
    DQ_b = DQ_a
    if DB > 0:
        DQ_b = DQ + offs_db[None, :]
    if TMA:
        Q_a, Q_b = _descriptors(Q, T, stride_qt, BLOCK_M, HEAD_DIM, DA, DB)
        DO_a, DO_b = _descriptors(DO, T, stride_dot, BLOCK_M, HEAD_DIM, DA, DB)
    qk_scale = sm_scale * 1.4426950408889634
    key = _seed_key(SEED, off_hz, DROPOUT)
    bits = BITS + off_hz.to(tl.int64) * T * (T // 8)  # read only with DROPOUT_BITS

    kb = start_n // SPARSE_BLOCK
    col = (off_h % LUT_HEADS) * NB + kb
    # The diagonal block first, causal mask, from the query tile holding this tile's first key.
    diag_lo = (start_n // BLOCK_M) * BLOCK_M
    n_diag = tl.load(DIAG + col) * (((kb + 1) * SPARSE_BLOCK - diag_lo) // BLOCK_M)
    for it in tl.range(0, n_diag, disable_licm=True):
        start_m = tl.multiple_of(diag_lo + it * BLOCK_M, BLOCK_M)
        dk_a, dk_b, dv_a, dv_b = _dkdv_tile(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, Q_a, Q_b, DO_a, DO_b, DQ_a,
                                            DQ_b, LSE, DELTA, start_m, start_n, offs_m, offs_n, sm_scale, qk_scale,
                                            stride_qt, stride_dot, stride_gt, key, bits, dropout_p, T, dm_row, DB,
                                            True, DROPOUT, PREC, PADDED, TMA, DQ_ATOMIC, DROPOUT_BITS)
    # Query blocks strictly below the diagonal, only those inside the runtime T.
    n_off = tl.load(COL_CUM + col * NB + T // SPARSE_BLOCK - 1)
    SUB: tl.constexpr = SPARSE_BLOCK // BLOCK_M
    lo = tl.load(COL_IDX + col * COL_WIDTH) * SPARSE_BLOCK  # the run's first query when CONTIG
    for it in tl.range(0, n_off * SUB, disable_licm=True):
        if CONTIG:
            start_m = tl.multiple_of(lo + it * BLOCK_M, BLOCK_M)
        else:
            qb = tl.load(COL_IDX + col * COL_WIDTH + it // SUB)
            start_m = tl.multiple_of(qb * SPARSE_BLOCK + (it % SUB) * BLOCK_M, BLOCK_M)
        dk_a, dk_b, dv_a, dv_b = _dkdv_tile(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, Q_a, Q_b, DO_a, DO_b, DQ_a,
                                            DQ_b, LSE, DELTA, start_m, start_n, offs_m, offs_n, sm_scale, qk_scale,
                                            stride_qt, stride_dot, stride_gt, key, bits, dropout_p, T, dm_row, DB,
                                            False, DROPOUT, PREC, PADDED, TMA, DQ_ATOMIC, DROPOUT_BITS)

    dv_scale = 1.0
    if DROPOUT:
        dv_scale = 1.0 / (1.0 - dropout_p)
    _store_a(DK + offs_n[:, None] * stride_gt + offs_da[None, :], (dk_a * sm_scale).to(DK.dtype.element_ty), dm_row,
             PADDED)
    _store_a(DV + offs_n[:, None] * stride_gt + offs_da[None, :], (dv_a * dv_scale).to(DV.dtype.element_ty), dm_row,
             PADDED)
    if DB > 0:
        tl.store(DK + offs_n[:, None] * stride_gt + offs_db[None, :], (dk_b * sm_scale).to(DK.dtype.element_ty))
        tl.store(DV + offs_n[:, None] * stride_gt + offs_db[None, :], (dv_b * dv_scale).to(DV.dtype.element_ty))


@triton.jit(do_not_specialize=["seed"])
def _dropout_mask_kernel(MASK, dropout_p, seed, T, BLOCK: tl.constexpr):
    """keep[bh, i, j] for all scores, from the same Philox stream the attention kernels use (tests only)."""
    off_hz = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = _keep(_philox_key(seed, off_hz), rows, tl.program_id(1) * BLOCK, BLOCK, T, dropout_p)
    MASK += off_hz.to(tl.int64) * T * T
    tl.store(MASK + rows[:, None] * T + cols[None, :], keep.to(tl.int8))


# ----------------------------------------------------------------------------------------------------------------
# Tile configurations
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """One kernel launch shape. For the forward and dq kernels block_m/block_n are the query/key tile; for dk/dv
    block_n is the key tile a program owns and block_m the query tile it steps over. pad_d: run a head dim that
    is not a power of two (96) as one zero-padded part (128) instead of two parts (64 + 32). dropout: also a
    candidate when dropout is on (the Philox rounds need registers: tiles marked False are left out with it)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pad_d: bool = False
    dropout: bool = True
    tma: bool = False
    """load the loops' tiles (keys/values in forward and dq, queries/dO in dk/dv) through TMA tensor descriptors
    (Hopper and later; `tma_ok` says when the inputs allow it) instead of pointers"""

    def meta(self, head_dim: int) -> dict:
        """The kernel's tile constexprs for `head_dim`."""
        if self.pad_d:
            da, db = triton.next_power_of_2(head_dim), 0
        else:
            da, db = split_head_dim(head_dim)
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, DA=da, DB=db, TMA=self.tma)


# Candidates per kernel and head-dim class, first = default; the autotuner times them on the first call. Their
# registers, spilled bytes and shared memory, compiled ahead of time for sm_90 with the GPU machine's and CI's Triton
# as a launch at the 1.5b model's shape specializes them, are recorded by benchmarks/kernel_resources.py (which
# candidates spill: docs/kernels.md, "Rows of addresses"); each kernel's first D = 96 tile compiles spill-free with
# both versions (tests/test_benchmarks.py).
# `dropout=False` marks tiles left out when dropout is on. Hopper's wgmma works on
# 64-row warpgroup tiles: 8 warps pair with 128-row tiles, 4 warps with 64 or 128 rows. What limits dk/dv is
# accumulator pressure: a program holds dk and dv (BLOCK_N x D fp32 each) plus k and v, which is why its 128-key
# tiles use 8 warps and, at D = 128, step over query tiles of 32 or fewer (64-query tiles use all 255 registers).
_NO_DROP = dict(dropout=False)
_SMALL_D = {  # D <= 64
    "fwd": (Tile(128, 64, 8, 3), Tile(128, 128, 8, 3, **_NO_DROP), Tile(128, 64, 4, 3, **_NO_DROP),
            Tile(64, 64, 4, 3), Tile(64, 32, 4, 4)),
    "dq": (Tile(128, 64, 8, 3), Tile(64, 64, 4, 3), Tile(128, 32, 4, 3, **_NO_DROP), Tile(64, 32, 4, 4)),
    "dkdv": (Tile(32, 128, 8, 3), Tile(64, 128, 8, 3, **_NO_DROP), Tile(64, 64, 4, 3, **_NO_DROP),
             Tile(32, 64, 4, 4)),
}
_TMA = dict(tma=True)
_D96 = {  # D = 96 as two parts (64 + 32, no wasted MMA work) or padded to 128. The first tiles of each kernel
    # were the fastest of a wider grid timed at the 1.5b model's shape (benchmarks/attention_tiles.py; the sweeps,
    # with pointer tiles, TMA loads and rows of addresses, in docs/kernels.md: TMA tiles lead the forward and dq,
    # pointer tiles dk/dv, 32 x 64 on 4 warps first for the model's q/k/v views); the rest, the set above.
    "fwd": (Tile(128, 64, 8, 3, **_TMA), Tile(64, 64, 4, 2, **_TMA), Tile(64, 64, 4, 2), Tile(64, 128, 4, 2),
            Tile(128, 64, 8, 3), Tile(128, 64, 8, 3, True), Tile(128, 128, 8, 2, **_NO_DROP), Tile(64, 64, 4, 3),
            Tile(64, 64, 4, 3, True, **_NO_DROP)),
    "dq": (Tile(64, 64, 4, 2, **_TMA, **_NO_DROP), Tile(64, 32, 4, 3, **_TMA), Tile(64, 32, 4, 3),
           Tile(128, 64, 8, 3), Tile(128, 64, 8, 2), Tile(128, 64, 8, 2, True), Tile(128, 32, 8, 3),
           Tile(64, 64, 4, 3, **_NO_DROP), Tile(64, 32, 4, 3, True)),
    "dkdv": (Tile(32, 64, 4, 3), Tile(64, 64, 4, 3, **_NO_DROP), Tile(64, 128, 8, 3), Tile(32, 64, 4, 2),
             Tile(32, 128, 8, 3), Tile(64, 128, 8, 2, **_NO_DROP), Tile(32, 128, 8, 3, True, **_NO_DROP),
             Tile(32, 64, 4, 3, True, **_NO_DROP), Tile(16, 64, 4, 3, True)),
}
_D128 = {
    "fwd": (Tile(128, 64, 8, 3), Tile(128, 128, 8, 2, **_NO_DROP), Tile(64, 64, 4, 3, **_NO_DROP),
            Tile(128, 32, 4, 3, **_NO_DROP), Tile(64, 32, 4, 3)),
    "dq": (Tile(128, 64, 8, 2), Tile(64, 64, 4, 3, **_NO_DROP), Tile(128, 32, 8, 3), Tile(64, 32, 4, 3)),
    "dkdv": (Tile(32, 128, 8, 3, **_NO_DROP), Tile(32, 128, 8, 2), Tile(32, 64, 4, 3, **_NO_DROP),
             Tile(16, 128, 8, 3), Tile(16, 64, 4, 3)),
}
# Exact fp32 dots (input_precision "ieee") run on FMA units, not tensor cores: correctness, not speed. Tiles of
# 16 queries keep them spill-free.
_FP32 = {kind: (Tile(16, 32, 4, 2), Tile(16, 16, 4, 2)) for kind in ("fwd", "dq", "dkdv")}


def candidate_tiles(kind: str, block: int, head_dim: int, dtype: torch.dtype, dropout: bool = False
                    ) -> tuple[Tile, ...]:
    """Tile candidates of one kernel ("fwd" | "dq" | "dkdv"), clipped to tiles that fit inside a sparse block."""
    if dtype == torch.float32:
        table = _FP32
    else:
        table = _SMALL_D if head_dim <= 64 else _D96 if head_dim == 96 else _D128
    tiles = tuple(t for t in table[kind] if t.block_m <= block and t.block_n <= block and (t.dropout or not dropout))
    if not tiles:  # sparse blocks of 16 or 32 tokens: one tile per block
        tiles = (Tile(block, block, 4, 2),)
    return tiles


def interpreter_tiles(block: int, pad_d: bool = False) -> dict[str, Tile]:
    """Tiles used under the Triton interpreter: half a sparse block, so the sub-tile loops and the diagonal's
    partially masked tiles are exercised by the CPU tests; 16 is the smallest tile tl.dot takes."""
    t = max(16, block // 2)
    return {kind: Tile(t, t, 4, 1, pad_d) for kind in ("fwd", "dq", "dkdv")}


_TUNERS: dict[tuple, object] = {}


def _tuned(kernel, kind: str, head_dim: int, tiles: tuple[Tile, ...]):
    """An autotuner over `tiles` for `kernel`, one per candidate set (compiled binaries are shared)."""
    key = (kind, head_dim, tiles)
    if key not in _TUNERS:
        configs = [triton.Config(t.meta(head_dim), num_warps=t.num_warps, num_stages=t.num_stages) for t in tiles]
        # The one-pass backward adds into DQ: every trial of the tuner must start from zeros, and so must the call.
        reset = ["DQ"] if kind == "dkdv_dq" else None
        # Tiles are chosen per sequence length, dropout, stepping and layout width (the most off-diagonal blocks in
        # a row, or column for dk/dv): a causal and a local layout of one length need different tiles.
        width = "COL_WIDTH" if kind.startswith("dkdv") else "ROW_WIDTH"
        _TUNERS[key] = triton.autotune(configs=configs, key=["T", "DROPOUT", "DROPOUT_BITS", "CONTIG", width],
                                       reset_to_zero=reset)(kernel)
    return _TUNERS[key]


def chosen_configs() -> list[dict]:
    """What the autotuner picked so far, per kernel, head dim and key (T, dropout, stepping, layout width, dtypes):
    for benchmark records."""
    out = []
    for (kind, head_dim, _), tuner in _TUNERS.items():
        for key, cfg in getattr(tuner, "cache", {}).items():
            out.append({"kernel": kind, "head_dim": head_dim, "key": [str(k) for k in key], **cfg.kwargs,
                        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return out


def tma_ok(*tensors: torch.Tensor) -> str | None:
    """None when TMA descriptors can read these (B, H, T, D) tensors, else why not: a GPU of compute capability 9
    or later (or the interpreter), 16-bit dtypes, base addresses and the strides of B, H, T 16-byte aligned."""
    x = tensors[0]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {x.dtype} (TMA tiles are used for fp16/bf16)"
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return f"compute capability {torch.cuda.get_device_capability(x.device)} < (9, 0)"
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1:
            return f"a tensor of strides {tuple(t.stride())} has a head dim that is not contiguous"
        if t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:3]):
            return f"a tensor of strides {tuple(t.stride())} at address {t.data_ptr():#x} is not 16-byte aligned"
    return None


def _allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the descriptors the kernels create on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch(kernel, kind: str, T: int, BH: int, tiles: dict[str, Tile] | None, block: int, head_dim: int,
            dtype: torch.dtype, args: tuple, consts: dict) -> None:
    """Launch `kernel` on a (T // tile, B*H) grid: autotuned on a GPU, fixed tiles when `tiles` is given. A launch
    with TMA tiles runs with the descriptors' scratch allocator set in a copy of the current context, so that an
    allocator the caller set stays as it was."""
    owned = "BLOCK_N" if kind.startswith("dkdv") else "BLOCK_M"  # dk/dv programs own keys, the others queries
    tile_kind = "dkdv" if kind == "dkdv_dq" else kind  # the one-pass backward runs the dk/dv kernel's tiles
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if tiles is not None:
        t = tiles[tile_kind]
        meta = t.meta(head_dim)
        if t.tma and (why := tma_ok(*inputs)):
            raise ValueError(f"tile {t} loads through TMA, which cannot read these inputs: {why}")
        launch = lambda: kernel[(T // meta[owned], BH)](*args, **consts, **meta, num_warps=t.num_warps,
                                                        num_stages=t.num_stages)
        tma = t.tma
    else:
        # A kernel reading the mask from bits spends no registers on Philox: every tile is a candidate, as without
        # dropout.
        philox = consts["DROPOUT"] and not consts["DROPOUT_BITS"]
        candidates = candidate_tiles(tile_kind, block, head_dim, dtype, philox)
        if any(c.tma for c in candidates) and tma_ok(*inputs) is not None:
            candidates = tuple(c for c in candidates if not c.tma)  # inputs TMA cannot read: pointer tiles only
        tuner = _tuned(kernel, kind, head_dim, candidates)
        launch = lambda: tuner[lambda meta: (T // meta[owned], BH)](*args, **consts)
        tma = any(c.tma for c in candidates)
    if tma and not _interpreted():
        contextvars.copy_context().run(lambda: (triton.set_allocator(_allocator), launch()))
    else:
        launch()


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """D = DA + DB with DA the largest power of two <= D (96 = 64 + 32; 64 = 64 + 0)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"blocksparse attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    da = 1 << (head_dim.bit_length() - 1)
    return da, head_dim - da


def check_block(block: int) -> None:
    if block not in SUPPORTED_BLOCKS:
        raise ValueError(f"blocksparse attention supports sparse_block in {SUPPORTED_BLOCKS}, got {block}")


# Taken once, at import: code that torch.compile traces (`blocksparse_attention`) then reads a bool, not a Triton
# kernel object (which dynamo wraps as a kernel of its own on a GPU).
_INTERPRETED = isinstance(_attn_fwd, InterpretedFunction)


def _interpreted() -> bool:
    return _INTERPRETED


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lut: BlockLUT, dropout_p: float) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one (B, H, T, D) shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"blocksparse attention supports dtypes {SUPPORTED_DTYPES} (q, k, v alike), got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    B, H, T, D = q.shape
    split_head_dim(D)
    if T % lut.block != 0:
        raise ValueError(f"sequence length {T} is not a multiple of the sparse block {lut.block}")
    if T > lut.n_blocks * lut.block:
        raise ValueError(f"sequence length {T} exceeds the layout's {lut.n_blocks} blocks of {lut.block} tokens")
    if lut.n_heads not in (1, H):
        raise ValueError(f"layout has {lut.n_heads} heads but the input has {H}: expected 1 or {H}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and T > MAX_DROPOUT_T:
        raise ValueError(f"attention dropout supports T <= {MAX_DROPOUT_T} (int32 offsets of its keep mask), "
                         f"got T = {T}")
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(f"blocksparse attention runs on CUDA tensors, got {q.device}; on a CPU set "
                         "TRITON_INTERPRET=1 before triton is imported to run the kernels in Triton's interpreter")
    if not (q.device == k.device == v.device == lut.row_idx.device):
        raise ValueError(f"q, k, v and the lookup table must share a device, got {q.device}, {k.device}, "
                         f"{v.device}, {lut.row_idx.device}")


def _empty_bthd(like: torch.Tensor) -> torch.Tensor:
    """A (B, H, T, D) tensor stored as (B, T, H, D): the model's y.transpose(1, 2).reshape(B, T, C) is then a view."""
    B, H, T, D = like.shape
    return torch.empty(B, T, H, D, dtype=like.dtype, device=like.device).transpose(1, 2)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _constexprs(q: torch.Tensor, lut: BlockLUT, dropout_p: float, bits: torch.Tensor | None) -> dict:
    """The constexprs every kernel takes besides its tile (fp32 inputs take exact "ieee" dots)."""
    return dict(HEAD_DIM=q.shape[-1], SPARSE_BLOCK=lut.block, DROPOUT=dropout_p > 0,
                PREC="ieee" if q.dtype == torch.float32 else "tf32", CONTIG=lut.contiguous,
                DROPOUT_BITS=dropout_p > 0 and bits is not None)


def _seed_arg(seed: int | torch.Tensor, dropout_p: float, like: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    """The seed as a launch takes it. With dropout: a one-element int64 tensor on `like`'s device, which the kernels
    read (an int is copied there). Without: the kernels read no seed, and `unused`, any tensor of the device, stands
    in with no copy."""
    if dropout_p <= 0:
        return unused
    return seed if isinstance(seed, torch.Tensor) else torch.tensor(int(seed), dtype=torch.int64, device=like.device)


def _dropout_bits(q: torch.Tensor, lut: BlockLUT, dropout_p: float, seed: int | torch.Tensor) -> torch.Tensor:
    """The packed keep mask (B * H, T, T / 8) uint8 of `_dropout_bits_kernel` for q's shape: T * T / 8 bytes a
    head (0.5 MB at T = 2048), drawn before the forward and kept for the backward."""
    B, H, T, _ = q.shape
    bits = torch.empty(B * H, T, T // 8, dtype=torch.uint8, device=q.device)
    rows, nbytes = min(64, lut.block), lut.block // 8
    _dropout_bits_kernel[(T // rows, T // 8 // nbytes, B * H)](bits, lut.col_cum, lut.diag, float(dropout_p),
                                                               _seed_arg(seed, dropout_p, q, bits), T, H, lut.n_blocks,
                                                               lut.n_heads,
                                                               SPARSE_BLOCK=lut.block, ROWS=rows, BYTES=nbytes,
                                                               num_warps=4 if rows * nbytes >= 512 else 1)
    return bits


def _forward(q, k, v, lut: BlockLUT, dropout_p: float, seed: int | torch.Tensor, tiles, bits=None):
    B, H, T, D = q.shape
    o = _empty_bthd(q)
    lse = torch.empty(B * H, T, dtype=torch.float32, device=q.device)
    seed = _seed_arg(seed, dropout_p, q, lse)
    args = (q, k, v, o, lse, lut.row_idx, lut.row_off, lut.diag, 1.0 / math.sqrt(D), float(dropout_p), seed,
            lse if bits is None else bits, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            H, T, lut.n_blocks, lut.n_heads, lut.row_idx.shape[1])
    consts = _constexprs(q, lut, dropout_p, bits)
    _launch(_attn_fwd, "fwd", T, B * H, tiles, lut.block, D, q.dtype, args, consts)
    return o, lse


def _backward_dq(do, q, k, v, o, lse, lut: BlockLUT, dropout_p: float, seed: int | torch.Tensor, tiles, bits=None):
    """dq, and delta = rowsum(o * do) for the dk/dv kernel."""
    B, H, T, D = q.shape
    dq, delta = _empty_bthd(q), torch.empty_like(lse)
    consts = _constexprs(q, lut, dropout_p, bits)
    seed = _seed_arg(seed, dropout_p, q, lse)
    args = (q, k, v, o, do, dq, lse, delta, lut.row_idx, lut.row_off, lut.diag, 1.0 / math.sqrt(D), float(dropout_p),
            seed, lse if bits is None else bits, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *o.stride()[:3], *do.stride()[:3], H, T, lut.n_blocks, lut.n_heads, lut.row_idx.shape[1])
    _launch(_attn_bwd_dq, "dq", T, B * H, tiles, lut.block, D, q.dtype, args, consts)
    return dq, delta


def _backward_dkdv(do, q, k, v, lse, delta, lut: BlockLUT, dropout_p: float, seed: int | torch.Tensor, tiles, dq32=None,
                   bits=None):
    """dk, dv; with `dq32` (fp32 zeros in dk's layout) the kernel also adds dq into it atomically."""
    B, H, T, D = q.shape
    dk, dv = _empty_bthd(q), _empty_bthd(q)
    consts = _constexprs(q, lut, dropout_p, bits)
    if dq32 is not None:
        consts["DQ_ATOMIC"] = True
    args = (q, k, v, do, dk, dv, dk if dq32 is None else dq32, lse, delta, lut.col_idx, lut.col_cum, lut.diag,
            1.0 / math.sqrt(D), float(dropout_p), _seed_arg(seed, dropout_p, q, lse),
            lse if bits is None else bits, *q.stride()[:3],
            *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], H, T, lut.n_blocks, lut.n_heads,
            lut.col_idx.shape[1])
    kind = "dkdv" if dq32 is None else "dkdv_dq"
    _launch(_attn_bwd_dkdv, kind, T, B * H, tiles, lut.block, D, q.dtype, args, consts)
    return dk, dv


def _backward_atomic_dq(do, q, k, v, o, lse, lut: BlockLUT, dropout_p: float, seed: int | torch.Tensor, tiles,
                        bits=None):
    """The backward in one pass over the keys: delta from its own small kernel, then dk, dv and dq from the dk/dv
    kernel (dq added atomically in fp32, so in an order that varies from run to run), then dq cast."""
    do, q, k, v = _unit_last(do), _unit_last(q), _unit_last(k), _unit_last(v)
    B, H, T, D = q.shape
    delta = torch.empty_like(lse)
    block_m = 64 if T % 64 == 0 else 16
    _attn_bwd_delta[(T // block_m, B * H)](o, do, delta, *o.stride()[:3], *do.stride()[:3], H, T, HEAD_DIM=D,
                                           BLOCK_D=triton.next_power_of_2(D), BLOCK_M=block_m)
    dq32 = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device).transpose(1, 2)
    dk, dv = _backward_dkdv(do, q, k, v, lse, delta, lut, dropout_p, seed, tiles, dq32, bits)
    return dq32.to(q.dtype), dk, dv


def _backward(do, q, k, v, o, lse, lut: BlockLUT, dropout_p: float, seed: int | torch.Tensor, tiles, bits=None):
    """dq, dk, dv. The caller's q, k, v as given (the forward ran on unit-stride copies of any that were not)."""
    do, q, k, v = _unit_last(do), _unit_last(q), _unit_last(k), _unit_last(v)
    dq, delta = _backward_dq(do, q, k, v, o, lse, lut, dropout_p, seed, tiles, bits)
    dk, dv = _backward_dkdv(do, q, k, v, lse, delta, lut, dropout_p, seed, tiles, bits=bits)
    return dq, dk, dv


def _attention_forward(q, k, v, seed: torch.Tensor, lut: BlockLUT, dropout_p: float, tiles, dropout_mask: str):
    """What the forward of both wrappers below runs: -> o, lse, the packed keep mask (None unless "bits"; its bytes
    outside the layout's blocks are left unwritten: only the backward reads it, inside them)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    bits = _dropout_bits(q, lut, dropout_p, seed) if dropout_p > 0 and dropout_mask == "bits" else None
    o, lse = _forward(q, k, v, lut, dropout_p, seed, tiles, bits)
    return o, lse, bits


class _BlockSparseAttentionFn(torch.autograd.Function):
    """The eager wrapper. The custom op's Python dispatch (below: argument checks, pytrees of its inputs and
    gradients) takes several times this Function's host time per call, which 24 layers pay every step, so eager
    code calls this and only code that torch.compile traces calls the op. Both run `_attention_forward` and
    `_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, seed, lut, dropout_p, tiles, dropout_mask):
        o, lse, bits = _attention_forward(q, k, v, seed, lut, dropout_p, tiles, dropout_mask)
        ctx.save_for_backward(q, k, v, o, lse, bits, seed)
        ctx.lut, ctx.dropout_p, ctx.tiles = lut, dropout_p, tiles
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, bits, seed = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, ctx.lut, ctx.dropout_p, seed, ctx.tiles, bits)
        return dq, dk, dv, None, None, None, None, None


# The operation as two torch custom ops (forward, backward) with the forward's autograd formula registered, for code
# that torch.compile traces (eager code takes `_BlockSparseAttentionFn`), so that torch.compile and DeepSpeed's
# DeepCompile keep it inside their graphs: dynamo sees one opaque node per call and
# its fake (shape-only) version, AOT autograd puts the backward op in the backward graph, and nothing of the Triton
# launcher is traced. The op is a pure function of its inputs: the dropout seed comes in as a one-element int64
# tensor on the device, which the kernels read (`draw_seed` draws it with torch.randint, a random op that torch's
# compiler and checkpointing know how to replay, with no host sync), the lookup table as its five tensors and an int
# list (`_lut_args`), fixed tiles as an int list (`_tile_ints`: empty = autotuned).
_FWD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor seed, Tensor[] lut, int[] lut_meta, float dropout_p, "
               "int[] tiles, str dropout_mask) -> (Tensor, Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor bits, Tensor seed, "
               "Tensor[] lut, int[] lut_meta, float dropout_p, int[] tiles) -> (Tensor, Tensor, Tensor)")
_TILE_KINDS = ("fwd", "dq", "dkdv")


def _lut_args(lut: BlockLUT) -> tuple[list[torch.Tensor], list[int]]:
    return ([getattr(lut, name) for name in LUT_TENSORS],
            [lut.block, lut.n_blocks, lut.n_heads, lut.nnz, int(lut.contiguous)])


def _lut_of(tensors: list[torch.Tensor], meta: list[int]) -> BlockLUT:
    block, n_blocks, n_heads, nnz, contiguous = meta
    return BlockLUT(block, n_blocks, n_heads, nnz, **dict(zip(LUT_TENSORS, tensors)), contiguous=bool(contiguous))


def _tile_ints(tiles: dict[str, Tile] | None) -> list[int]:
    """fwd, dq, dkdv tiles as Tile's fields in order (4 sizes, then the 3 flags) for the op's int list; None: []."""
    return [] if tiles is None else [int(x) for kind in _TILE_KINDS for x in dataclasses.astuple(tiles[kind])]


def _tiles_of(ints: list[int]) -> dict[str, Tile] | None:
    n = len(dataclasses.fields(Tile))
    chunks = [ints[i:i + n] for i in range(0, len(ints), n)]
    return {kind: Tile(*c[:4], *map(bool, c[4:])) for kind, c in zip(_TILE_KINDS, chunks)} if ints else None


@torch.library.custom_op("zero3bench::blocksparse_attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def _attention_fwd_op(q, k, v, seed, lut, lut_meta, dropout_p, tiles, dropout_mask):
    """-> o (B, H, T, D), lse (B * H, T) fp32, the packed keep mask (`_attention_forward`; empty unless "bits")."""
    o, lse, bits = _attention_forward(q, k, v, seed, _lut_of(lut, lut_meta), dropout_p, _tiles_of(tiles),
                                      dropout_mask)
    return o, lse, torch.empty(0, dtype=torch.uint8, device=q.device) if bits is None else bits


@_attention_fwd_op.register_fake
def _(q, k, v, seed, lut, lut_meta, dropout_p, tiles, dropout_mask):
    B, H, T, _ = q.shape
    bits = dropout_p > 0 and dropout_mask == "bits"
    return (_empty_bthd(q), q.new_empty(B * H, T, dtype=torch.float32),
            q.new_empty((B * H, T, T // 8) if bits else (0,), dtype=torch.uint8))


@torch.library.custom_op("zero3bench::blocksparse_attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def _attention_bwd_op(do, q, k, v, o, lse, bits, seed, lut, lut_meta, dropout_p, tiles):
    """-> dq, dk, dv of `_attention_fwd_op`'s output o."""
    return _backward(do, q, k, v, o, lse, _lut_of(lut, lut_meta), dropout_p, seed, _tiles_of(tiles),
                     bits if bits.numel() else None)


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, bits, seed, lut, lut_meta, dropout_p, tiles):
    return _empty_bthd(q), _empty_bthd(q), _empty_bthd(q)


def _setup_context(ctx, inputs, output):
    q, k, v, seed, lut, lut_meta, dropout_p, tiles, _ = inputs
    o, lse, bits = output
    ctx.save_for_backward(q, k, v, o, lse, bits, seed, *lut)
    ctx.lut_meta, ctx.dropout_p, ctx.tiles = lut_meta, dropout_p, tiles


def _backward_formula(ctx, do, *_):
    q, k, v, o, lse, bits, seed, *lut = ctx.saved_tensors
    dq, dk, dv = _attention_bwd_op(do, q, k, v, o, lse, bits, seed, lut, ctx.lut_meta, ctx.dropout_p, ctx.tiles)
    # One gradient per input in the inputs' structure, where torch takes a list of tensors as a list (the table) and
    # any other list as one input: an empty list (the autotuned tiles) counts as a list of no tensors.
    return dq, dk, dv, None, [None] * len(lut), None, None, None if ctx.tiles else [], None


_attention_fwd_op.register_autograd(_backward_formula, setup_context=_setup_context)


def blocksparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lut: BlockLUT,
                          dropout_p: float = 0.0, seed: int | torch.Tensor = 0, tiles: dict[str, Tile] | None = None,
                          dropout_mask: str = "philox") -> torch.Tensor:
    """Block-sparse causal attention of q, k, v (B, H, T, D) -> (B, H, T, D), differentiable, and one custom op
    under torch.compile (no graph break).

    `lut` must live on q's device (BlockLUT.to). `seed` keys the dropout mask (ignored when dropout_p == 0): an int
    in [0, 2^31), or a one-element int64 tensor of such a value on q's device (`draw_seed`), which the kernels read
    there. `tiles` fixes the launch shapes ({"fwd"|"dq"|"dkdv": Tile}); by default the autotuner picks them on a GPU
    and `interpreter_tiles` is used under the interpreter. `dropout_mask` (DROPOUT_MASKS): "philox" draws the mask
    inside each of the three kernels, "bits" draws it once per call into T * T / 8 bytes a head (kept for the
    backward), which the three kernels read; both apply the same mask.
    """
    _check_inputs(q, k, v, lut, dropout_p)
    if dropout_mask not in DROPOUT_MASKS:
        raise ValueError(f"dropout_mask must be one of {DROPOUT_MASKS}, got {dropout_mask!r}")
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype != torch.int64 or seed.device != q.device:
            raise ValueError(f"a seed tensor must be one int64 on q's device {q.device} (draw_seed), got "
                             f"{seed.dtype} of shape {tuple(seed.shape)} on {seed.device}")
    elif not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2^31) (the low word of the kernels' Philox key), got {seed}")
    else:
        seed = _seed_arg(seed, dropout_p, q, lut.row_off)
    if tiles is not None and (missing := {"fwd", "dq", "dkdv"} - set(tiles)):
        raise ValueError(f"tiles must give a Tile for each of fwd, dq and dkdv; missing {sorted(missing)}")
    for kind, t in (tiles or {}).items():
        # a program reads the table of one sparse block: a tile wider than the block would visit its neighbour's
        # keys with that block's table, and a width that does not divide the block would skip some
        sizes = (t.block_m, t.block_n)
        if any(n < 16 or n > lut.block or n & (n - 1) for n in sizes):
            raise ValueError(f"tile {kind} {t}: block_m and block_n must be powers of two from 16 (tl.dot's "
                             f"smallest) to the sparse block {lut.block}, got {sizes}")
    if tiles is None and _interpreted():
        tiles = interpreter_tiles(lut.block)
    if not torch.compiler.is_compiling():
        return _BlockSparseAttentionFn.apply(q, k, v, seed, lut, applied_dropout(dropout_p), tiles, dropout_mask)
    tensors, meta = _lut_args(lut)
    o, _, _ = _attention_fwd_op(q, k, v, seed, tensors, meta, applied_dropout(dropout_p), _tile_ints(tiles),
                                dropout_mask)
    return o


# The rate the kernels apply for dropout_p: the nearest multiple of 1/65536 below 1 (a 16-bit random number per score
# is compared with it), e.g. 0.1 -> 6554/65536 = 0.100006; the dropout-mask kernel's rule, the same draws.
applied_dropout = applied_rate


def dropout_keep_mask(batch: int, heads: int, seq_len: int, dropout_p: float, seed: int,
                      device: torch.device | str) -> torch.Tensor:
    """The bool keep mask (B, H, T, T) that blocksparse_attention applies for (dropout_p, seed): for tests."""
    block = 16 if seq_len % 64 else 64
    mask = torch.empty(batch * heads, seq_len, seq_len, dtype=torch.int8, device=device)
    grid = (seq_len // block, seq_len // block, batch * heads)
    _dropout_mask_kernel[grid](mask, applied_dropout(dropout_p), int(seed), seq_len, BLOCK=block)
    return mask.view(batch, heads, seq_len, seq_len).bool()


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """A dropout seed in [0, 2^31): an int64 scalar drawn on `device` by torch.randint from that device's default
    generator. Reproducible under torch.manual_seed, no host sync, replayed by torch.utils.checkpoint on recompute,
    and traceable: a compiled graph draws it as one random op, which torch's checkpointing also replays."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device)
