"""`--compile blocks`: torch.compile each transformer block's forward, applied to a built GPT from outside the model.

Under ZeRO-3 DeepSpeed hooks every module that owns parameters to gather them before its forward; those hooks are
torch.compiler.disable'd, so a compiled region that contains submodules breaks its graph at each one, and
DeepSpeed's release loop adds more breaks and recompiles (what DeepSpeed's engine.compile() hits on this model:
docs/kernels.md, "Fused paths and torch.compile"). build_ds_config therefore makes the block a ZeRO-3 *leaf module* when
compiling (`leaf_module_class`): one hook on the block gathers all its parameters, none fire inside it, and the
compiled forward is one graph with no break, shared by every block (the parameters are graph inputs).

`GuardSkip` (--skip_guard_eval) lets the training forward skip dynamo's guard checks once its compiles are done.

`configure_inductor` sets the inductor options a run asks for (--coordinate_descent_tuning) for every mode that
compiles: blocks, deepcompile, the fused kernels and the reference rows.

torch.compile is called on first use, not at import: importing torch._dynamo costs seconds that a CLI refusal
should not pay.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from shared.train.config import TrainConfig, last_compile_step


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


# The global step from which this process's training forwards skip their guards (GuardSkip); None: they never did.
# The run JSON reports it as extra.guard_skip_from.
GUARD_SKIP_FROM: int | None = None


class GuardSkip:
    """--skip_guard_eval: each training forward runs inside `forward(step)`, which skips dynamo's guard checks once
    the compiles are done.

    Before each call of a compiled function dynamo checks its guards (every input's shape, dtype and strides, the
    globals and flags it read) to pick the compiled graph; under DeepCompile the inputs are every parameter of the
    model. torch.compiler.set_stance(skip_guard_eval_unsafe=True) runs only the guards that tell the cached graphs
    apart, none when there is one: unsafe if the forward would have needed a new graph, which would then not be
    compiled. So the forward of the step after the last planned compile (shared/train/config.last_compile_step,
    counted from the first step this process trains) runs with its guards as the check: if it compiles anything the
    run stops with a ValueError (exit status 2, its message, no traceback). From the next step on every training
    forward skips them. Validation, export and the backward run outside `forward` with their guards.
    """

    def __init__(self, train: TrainConfig):
        self.enabled = train.skip_guard_eval
        self.check_at = last_compile_step(train) + 1
        self.first: int | None = None

    def forward(self, step: int):
        """The context to run the training forward of global step `step` in."""
        if not self.enabled:
            return contextlib.nullcontext()
        if self.first is None:
            self.first = step
        local = step - self.first
        if local < self.check_at:
            return contextlib.nullcontext()
        if local == self.check_at:
            return self._check(step)
        global GUARD_SKIP_FROM
        if GUARD_SKIP_FROM is None:
            GUARD_SKIP_FROM = step
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)

    @contextlib.contextmanager
    def _check(self, step: int):
        from shared.train.results import dynamo_stats

        before = dynamo_stats()["dynamo_graphs"]
        yield
        compiled = dynamo_stats()["dynamo_graphs"] - before
        if compiled:
            raise ValueError(  # exits 2 with this message, as a refused flag does
                f"--skip_guard_eval: the training forward of step {step} compiled {compiled} new graph(s) after the "
                f"last planned compile (step {self.first + self.check_at - 1}), so its guards do change between "
                "steps and skipping them would run a stale graph; drop --skip_guard_eval")
