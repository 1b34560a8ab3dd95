"""Validation between training steps under DeepCompile: run eagerly, outside its compiled graphs.

DeepSpeed 0.19.8's DeepCompile takes a no-grad forward of the trained model for a graph that needs a backward: the
recompile keeps the training frame's id, which its partitioner still lists (deepspeed/compile/backend.py,
`frames_partitioned`), so it switches its backward-capture patch on again and, with no backward to follow, never
off. The next training backward is then compiled anew, and the memory profile of that compile runs DeepCompile's
end-of-backward op on reduce buckets the previous backward released: `DoubleBufferedReduceBucket::swap: Assertion
hasKey(current_buffer_, scalar_type) failed` (docs/training.md). Run eagerly, with every ZeRO-3 parameter gathered
by DeepSpeed's public context, validation compiles nothing and DeepCompile's state stays the training step's.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eager_forward(module: torch.nn.Module, deepcompile: bool):
    """Forwards of `module` inside run eagerly with its parameters gathered (ZeRO-3's own all-gather, partitioned
    again on exit, nothing written back) where `deepcompile`; otherwise nothing changes. Call the module itself
    (engine.module(x, y), not engine(x, y)), so that DeepCompile's launch of its passes stays out, and not under
    torch.inference_mode (a gather there would leave inference tensors in the parameters)."""
    if not deepcompile:
        yield
        return
    import deepspeed

    with torch.compiler.set_stance("force_eager"), deepspeed.zero.GatheredParameters(list(module.parameters())):
        yield
