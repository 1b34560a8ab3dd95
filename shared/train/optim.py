"""The optimizer and LR schedule both paths use: the same functions, called by each path, never copied."""

from __future__ import annotations

import math

import torch
from torch import nn

from shared.train.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (Linear weights, embeddings); not biases or LayerNorm parameters (nanoGPT, Megatron).

    Under ZeRO-3 a parameter's data is an empty shard; its real shape is `ds_shape`.
    """
    seen, decay, no_decay = set(), [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        ndim = len(getattr(p, "ds_shape", p.shape))
        (decay if ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, train: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """torch's AdamW(betas 0.9/0.95, eps 1e-8) over param_groups, with its fused CUDA kernel (one launch for all
    tensors) on a GPU. DeepSpeed's FusedAdam measured no different (docs/ledger.md), and the ZeRO-3 step's fused
    kernel (shared/kernels/adamw.py) is AdamW's."""
    groups = param_groups(model, train.weight_decay)
    return torch.optim.AdamW(groups, fused=device.type == "cuda", lr=train.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, train: TrainConfig) -> float:
    """The learning rate of step `step` (0-based): linear warmup to lr over lr_warmup_steps, then cosine decay toward
    min_lr, reached at step `steps` (one past the last step, which trains just above it)."""
    if step < train.lr_warmup_steps:
        return train.lr * (step + 1) / train.lr_warmup_steps
    decay_steps = max(1, train.steps - train.lr_warmup_steps)
    progress = min(1.0, (step - train.lr_warmup_steps) / decay_steps)
    return train.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (train.lr - train.min_lr)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_at, stepped once per optimizer step (by DeepSpeed's engine in both paths)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, train) / train.lr)
