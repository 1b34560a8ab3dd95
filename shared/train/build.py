"""The model both paths train, built one way: GPT(train.model()), then under --precision fp8 its blocks' linear layers
converted to torchao's float8 training (shared/model/fp8.py), then under --compile blocks each block compiled
(shared/train/compile.py). The raw loop calls it inside its deepspeed.zero.Init, Lightning inside configure_model
(DeepSpeedStrategy's zero.Init): both before DeepSpeed's engine is built, so the engine, its hooks and the optimizer
see the converted modules, which hold the very Parameter objects GPT(...) made."""

from __future__ import annotations

from shared.model import fp8
from shared.model.gpt import GPT
from shared.train.compile import compile_blocks
from shared.train.config import TrainConfig


def build_model(train: TrainConfig) -> GPT:
    """The GPT of `train`, converted and compiled as the run asks (the caller seeds the RNG first)."""
    model = GPT(train.model())
    model.fp8 = fp8.convert(model, train.fp8_recipe) if train.precision == "fp8" else None
    if train.compile == "blocks":
        compile_blocks(model)
    return model
