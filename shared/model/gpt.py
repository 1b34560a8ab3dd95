"""The GPT both training paths train: token + position embeddings -> n_layer pre-LN blocks -> ln_f -> LM head.

Choices, and why:
- Learned absolute position embeddings (GPT-2, Megatron-LM's GPT and the original study's model). They keep
  the parameter count equal to the Megatron formula's 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)), which counts
  the s x h position table; with them the `1.5b` preset has the study's 1.65B parameters.
- The LM head is tied to the token embedding (GPT-2, Megatron): the formula counts V*h once, and the head is the
  largest single matrix. The tie is a module (`LMHead`) that holds the embedding's own Parameter, so DeepSpeed
  ZeRO-3 gathers it through the head's own forward hook like any other parameter.
- Megatron/BigScience init (Shoeybi et al. 2019, sec. 2.3; GPT-2): every weight ~ N(0, 0.02), the two output
  projections of each block (attention proj, MLP proj) ~ N(0, 0.02/sqrt(2*n_layer)) so the residual stream's
  variance does not grow with depth, biases 0, LayerNorm 1/0. Each layer initializes itself inside its own
  constructor (`reset_parameters`), because under deepspeed.zero.Init a parameter is partitioned as soon as the
  module that owns it is constructed: an `apply(init_fn)` at the end of GPT.__init__ would write into empty
  shards and silently leave the model at PyTorch's default init.
- GELU with the tanh approximation (Megatron's bias_gelu, GPT-2), dropout on embeddings, attention probabilities
  and both residual branches.

No Lightning or DeepSpeed import: the LightningModule wraps this very object and the raw loop trains it directly.
How it is compiled or sharded is applied from outside (shared/train/compile.py, shared/train/ds_config.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared.model import fused_ops
from shared.model.attention import build_attention
from shared.model.config import GPTConfig
from shared.model.linear_cross_entropy import triton_linear_cross_entropy

INIT_STD = 0.02


class Linear(nn.Linear):
    """nn.Linear with Megatron init: weight ~ N(0, std), bias 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float = INIT_STD):
        self.init_std = std  # read by reset_parameters(), which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding with weight ~ N(0, 0.02) instead of PyTorch's N(0, 1); rows from `used` on (a padded
    vocabulary's, GPTConfig.vocab_multiple) are zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, used: int | None = None):
        self.used = num_embeddings if used is None else used  # read by reset_parameters(), called by __init__
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        # the used rows draw exactly what an unpadded table draws: padding changes no other parameter's init
        nn.init.normal_(self.weight[:self.used], mean=0.0, std=INIT_STD)
        with torch.no_grad():
            self.weight[self.used:].zero_()


def residual_std(cfg: GPTConfig) -> float:
    """Init std of a residual branch's output projection (attention proj, MLP proj): 0.02/sqrt(2*n_layer)."""
    return INIT_STD / math.sqrt(2 * cfg.n_layer)


class ResidualLinear(Linear):
    """A residual branch's output projection with its tail fused: residual + dropout(x W^T + b) as one compiled
    kernel (shared/model/fused_ops.py). Its forward reads the weight itself, not through nn.Linear.forward, so a
    conversion that replaces nn.Linear's forward (torchao's float8 training, shared/model/fp8.py) cannot take it:
    without the fusion the projection is a plain Linear and its block applies the tail."""

    def __init__(self, cfg: GPTConfig, in_features: int):
        super().__init__(in_features, cfg.n_embd, cfg.bias, std=residual_std(cfg))
        self.bias_dropout_add = fused_ops.bias_dropout_add_triton if cfg.triton_dropout else fused_ops.bias_dropout_add
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.bias_dropout_add(F.linear(x, self.weight), self.bias, residual, self.dropout.p, self.training)


class GeluLinear(Linear):
    """The MLP's up projection with its GELU (tanh approximation) fused: gelu(x W^T + b) as one compiled kernel. As
    ResidualLinear, it reads the weight itself; without the fusion the MLP holds a plain Linear and applies the GELU."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.n_embd, 4 * cfg.n_embd, cfg.bias)
        self.bias_gelu = fused_ops.bias_gelu_triton_grad if cfg.triton_gelu_grad else fused_ops.bias_gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias_gelu(F.linear(x, self.weight), self.bias)


class ResidualProjection(nn.Module):
    """Base of a block's two residual branches: their output projection `proj` and its tail,
    residual + dropout(proj(x)).

    Fused (cfg.fused_bias_dropout_add) `proj` is a ResidualLinear that runs the tail itself; otherwise `proj` is a
    plain Linear whose forward is the bare product, the module torchao's float8 conversion swaps (shared/model/fp8.py),
    and the tail runs here. Chosen at construction; the parameter names (`proj.weight`, `proj.bias`) are the same."""

    def init_projection(self, cfg: GPTConfig, in_features: int) -> None:
        self.fused_tail = cfg.fused_bias_dropout_add
        if self.fused_tail:
            self.proj = ResidualLinear(cfg, in_features)
        else:
            self.proj = Linear(in_features, cfg.n_embd, cfg.bias, std=residual_std(cfg))
            self.dropout = nn.Dropout(cfg.dropout)

    def project(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x W^T + b)"""
        if self.fused_tail:
            return self.proj(x, residual)
        return residual + self.dropout(self.proj(x))


class CausalSelfAttention(ResidualProjection):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = Linear(cfg.n_embd, 3 * cfg.n_embd, cfg.bias)
        self.init_projection(cfg, cfg.n_embd)
        self.attn = build_attention(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(proj(attention(x)))"""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = self.attn(q, k, v)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.project(y, residual)


class MLP(ResidualProjection):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fused_gelu = cfg.fused_bias_gelu
        self.fc = GeluLinear(cfg) if self.fused_gelu else Linear(cfg.n_embd, 4 * cfg.n_embd, cfg.bias)
        self.init_projection(cfg, 4 * cfg.n_embd)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(proj(gelu(fc(x))))"""
        h = self.fc(x) if self.fused_gelu else F.gelu(self.fc(x), approximate="tanh")  # (B, T, 4C)
        return self.project(h, residual)


class Block(nn.Module):
    """Pre-LN transformer block. `--compile blocks` compiles its forward from outside (shared/train/compile.py),
    where the reason it is the unit of compilation, and a ZeRO-3 leaf module, is written down."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x), residual=x)
        return self.mlp(self.ln_2(x), residual=x)


class LMHead(nn.Module):
    """Logits (or the loss) against the tied token-embedding matrix; owns no new parameter.

    With a padded vocabulary the matmul runs over all rows (whole tiles) and the logits of the padding are cut off
    right after it: the softmax, the loss and every caller see the vocab_size real ones, so the padding is never
    predicted and gets no gradient."""

    def __init__(self, weight: nn.Parameter, vocab_size: int | None = None, triton_loss: bool = False):
        super().__init__()
        self.weight = weight
        self.triton_loss = triton_loss
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        V = self.vocab_size or self.weight.shape[0]
        if targets is not None and self.triton_loss:
            return triton_linear_cross_entropy(x, self.weight, targets, V)
        logits = F.linear(x, self.weight)  # (B, T, padded V)
        if logits.size(-1) != V:
            logits = logits[..., :V]
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.padded_vocab_size, cfg.n_embd, used=cfg.vocab_size)
        self.wpe = Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = LMHead(self.wte.weight, cfg.vocab_size, cfg.triton_loss)
        self.attention_backend = self.blocks[0].attn.attn.backend
        self.fp8: dict | None = None  # what the FP8 conversion did, where one ran (shared/model/fp8.convert)
        self.register_buffer("pos", torch.arange(cfg.seq_len), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab_size), or the mean cross-entropy loss when targets are given."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        x = self.drop(self.wte(idx) + self.wpe(self.pos[:T]))  # (B, T, C)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x), targets)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters, counting a tied weight once; reads DeepSpeed's ds_numel on ZeRO-3 partitioned params."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += getattr(p, "ds_numel", p.numel())
    return total
