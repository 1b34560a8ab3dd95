"""`--compile blocks`: torch.compile each transformer block's forward, applied to a built GPT from outside the model.

Under ZeRO-3 DeepSpeed hooks every module that owns parameters to gather them before its forward; those hooks are
torch.compiler.disable'd, so a compiled region that contains submodules breaks its graph at each one, and
DeepSpeed's release loop adds more breaks and recompiles (what DeepSpeed's engine.compile() hits on this model:
docs/kernels.md, "Fused paths and torch.compile"). build_ds_config therefore makes the block a ZeRO-3 *leaf module* when
compiling (`leaf_module_class`): one hook on the block gathers all its parameters, none fire inside it, and the
compiled forward is one graph with no break, shared by every block (the parameters are graph inputs).

`configure_inductor` sets the inductor options a run asks for (--coordinate_descent_tuning) for every mode that
compiles: blocks, deepcompile, the fused kernels and the reference rows.

torch.compile is called on first use, not at import: importing torch._dynamo costs seconds that a CLI refusal
should not pay.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def compiled_block_forward():
    """Block.forward compiled once per process (dynamic=False: one graph for every block of the model)."""
    from shared.model.gpt import Block

    return torch.compile(Block.forward, dynamic=False)


def compile_blocks(gpt: nn.Module) -> nn.Module:
    """Make every block of `gpt` run the compiled forward; returns gpt. Parameters and state dict are unchanged."""
    forward = compiled_block_forward()
    for block in gpt.blocks:
        block.forward = functools.partial(forward, block)
    return gpt


def configure_inductor(train) -> None:
    """Set the inductor options a TrainConfig asks for; call before anything is compiled in the process."""
    if train.coordinate_descent_tuning:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True


def leaf_module_class() -> str:
    """The block's class as DeepSpeed's leaf_module config names it (module path + qualname), read from the class
    itself so that it cannot go stale when the model moves."""
    from shared.model.gpt import Block

    return f"{Block.__module__}.{Block.__qualname__}"

