"""Block layouts for sparse attention, as pure tensor functions.

A layout is a bool tensor of shape (n_head or 1, n_blocks, n_blocks): layout[h, i, j] says whether query block i
of head h may attend to key block j. Every backend reads the same layout: `reference` expands it to a token mask,
`blocksparse` builds its lookup table from it, `flex` its BlockMask, `xformers` its bias.

Convention: the model is autoregressive, so the token-level mask is always `expand(layout) & causal`; inside a
diagonal block the causal mask applies, blocks above the diagonal are not allowed (they could only ever be
masked out, and a kernel would waste time on them), and every block row needs at least one block at or left of
the diagonal, or the queries of that row would have no key at all.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model.config import GPTConfig


def causal(n_blocks: int) -> torch.Tensor:
    """Lower-triangular layout: the original study's layout over 128-token blocks (dense causal attention)."""
    return torch.ones(n_blocks, n_blocks, dtype=torch.bool, device="cpu").tril().unsqueeze(0)


def local(n_blocks: int, window: int) -> torch.Tensor:
    """Sliding window: query block i sees key blocks i-window+1 .. i."""
    if window <= 0:
        raise ValueError(f"local window must be >= 1 block, got {window}")
    i = torch.arange(n_blocks, device="cpu").unsqueeze(1)
    j = torch.arange(n_blocks, device="cpu").unsqueeze(0)
    return ((j <= i) & (j > i - window)).unsqueeze(0)


def strided(n_blocks: int, stride: int, n_summary: int = 1) -> torch.Tensor:
    """Sparse Transformer 'fixed' pattern (Child et al. 2019, sec. 4.3) at block granularity.

    Query block i sees every earlier block of its own segment of `stride` blocks, and the last `n_summary`
    blocks of every earlier segment (the 'summary' blocks that carry information across segments).
    """
    if stride <= 0 or not 0 < n_summary <= stride:
        raise ValueError(f"strided layout needs stride >= 1 and 1 <= n_summary <= stride, got {stride}, {n_summary}")
    i = torch.arange(n_blocks, device="cpu").unsqueeze(1)
    j = torch.arange(n_blocks, device="cpu").unsqueeze(0)
    same_segment = (j // stride) == (i // stride)
    summary = (j % stride) >= (stride - n_summary)
    return ((j <= i) & (same_segment | summary)).unsqueeze(0)


def validate(layout: torch.Tensor, n_head: int, n_blocks: int) -> torch.Tensor:
    """Check a user layout and return it as a CPU bool tensor of shape (n_head or 1, n_blocks, n_blocks).

    Layouts always live on the CPU (they describe the computation; backends copy what they need to the device),
    also when built under a default-device context such as deepspeed.zero.Init or torch.device("meta").
    """
    if not isinstance(layout, torch.Tensor):
        raise ValueError(f"a layout must be a torch.Tensor, got {type(layout).__name__}")
    if layout.dim() == 2:
        layout = layout.unsqueeze(0)
    if layout.dim() != 3 or layout.shape[1:] != (n_blocks, n_blocks) or layout.shape[0] not in (1, n_head):
        raise ValueError(
            f"layout shape {tuple(layout.shape)} does not fit: expected ({n_head} or 1, {n_blocks}, {n_blocks}) "
            f"for {n_head} heads and {n_blocks} blocks"
        )
    if layout.dtype != torch.bool:
        if layout.is_floating_point() or not ((layout == 0) | (layout == 1)).all():
            raise ValueError(f"layout must be bool or 0/1 integers, got dtype {layout.dtype}")
        layout = layout.bool()
    layout = layout.cpu()
    above = layout & ~torch.ones(n_blocks, n_blocks, dtype=torch.bool, device="cpu").tril()
    if above.any():
        h, i, j = above.nonzero()[0].tolist()
        raise ValueError(
            f"layout has a block above the diagonal (head {h}, query block {i}, key block {j}); "
            "a causal model never attends to future blocks"
        )
    empty = ~layout.any(dim=-1)
    if empty.any():
        h, i = empty.nonzero()[0].tolist()
        raise ValueError(f"layout row is empty (head {h}, query block {i}): those queries would attend to no key")
    return layout.contiguous()


def make_layout(cfg: GPTConfig) -> torch.Tensor:
    """The layout named by cfg.layout, validated, on the CPU."""
    nb = cfg.n_blocks
    if cfg.layout in ("causal", "dense"):
        layout = causal(nb)
    elif cfg.layout == "local":
        layout = local(nb, cfg.local_blocks)
    elif cfg.layout == "strided":
        layout = strided(nb, cfg.stride_blocks)
    else:
        path = Path(cfg.layout)
        if not path.is_file():
            raise ValueError(f"layout file {cfg.layout!r} does not exist")
        try:
            layout = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # not a torch.save file, or one that holds more than tensors (pickled objects)
            raise ValueError(f"layout file {cfg.layout!r} is not a tensor saved with torch.save (torch.load with "
                             f"weights_only=True failed: {type(e).__name__}); expected a bool or 0/1 tensor of "
                             f"shape ({cfg.n_head} or 1, {nb}, {nb})") from None
        try:
            return validate(layout, cfg.n_head, nb)
        except ValueError as e:
            raise ValueError(f"layout file {cfg.layout!r}: {e}") from None
    return validate(layout, cfg.n_head, nb)


def is_causal(layout: torch.Tensor) -> bool:
    """True when the layout is the full lower triangle for every head (plain causal attention)."""
    nb = layout.shape[-1]
    return bool((layout == causal(nb)).all())


def density(layout: torch.Tensor) -> float:
    """Fraction of the full n_blocks x n_blocks grid the layout visits, averaged over heads.

    The Megatron formula counts attention as a dense s x s product; this is the factor that scales that term to
    the blocks a sparse kernel computes (a causal layout gives (n+1)/(2n), just over one half).
    """
    return float(layout.float().mean())


def token_mask(layout: torch.Tensor, block: int, seq_len: int | None = None) -> torch.Tensor:
    """Expand a block layout to a bool token mask (n_head or 1, T, T), causal inside diagonal blocks."""
    nb = layout.shape[-1]
    T = nb * block
    mask = layout.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)
    mask = mask & torch.ones(T, T, dtype=torch.bool, device=layout.device).tril()
    if seq_len is not None:
        mask = mask[:, :seq_len, :seq_len]
    return mask
