"""DeepSpeedStrategy that also runs on CPU (gloo), for the tiny preset in tests and on laptops.

Lightning refuses DeepSpeed off CUDA ("The DeepSpeed strategy is only supported on CUDA GPUs"), yet DeepSpeed
itself trains ZeRO-3 on CPU with gloo. The smallest honest adaptation overrides three hooks of pytorch_lightning
2.6's DeepSpeedStrategy, each only where it assumes a CUDA device index; on GPUs every override defers to
Lightning's own code. One of them is private API: each override here is one line handing the call to
shared/patches/lightning.py, where the patch layer registers them, checks Lightning's version, and keeps the
fingerprints of the Lightning code they stand in for (tests/test_patches.py; tests/test_lightning.py runs them on 1
and 2 CPU processes).

ZeroPrecision fixes a gradient-scale bug of Lightning + DeepSpeed with accumulate_grad_batches > 1: Lightning's
automatic optimization divides the loss by accumulate_grad_batches (loops/optimization/automatic.py) and
DeepSpeedEngine.backward divides it again by gradient_accumulation_steps, so gradients come out 1/gas^2 instead
of 1/gas (Lightning issue #6170 noted the double scaling in 2021; 2.6.6 still does it). With AdamW that mostly
hides (Adam is scale-invariant) but gradient clipping and eps see 1/gas-times-smaller gradients. We keep
Lightning's division and tell DeepSpeed not to scale again (scale_wrt_gas=False), which gives the raw loop's
gradients exactly.
"""

from __future__ import annotations

from pytorch_lightning.plugins.precision import DeepSpeedPrecision
from pytorch_lightning.strategies import DeepSpeedStrategy

from shared import patches
from shared.patches import lightning as lightning_patches
from shared.train.config import TrainConfig
from shared.train.ds_runtime import compile_engine


class ZeroStrategy(DeepSpeedStrategy):
    strategy_name = "zero3bench_deepspeed"

    def __init__(self, *args, train: TrainConfig | None = None, **kwargs):
        """train: the run's config, whose compile mode that lives in the engine (DeepCompile, with its options) and
        ZeRO-3 optimizer step are applied to the engine as the raw loop applies them; None: neither (Lightning's
        DeepSpeedStrategy as it is)."""
        super().__init__(*args, **kwargs)
        self.train = train

    def setup_environment(self) -> None:
        return lightning_patches.setup_environment(self, super().setup_environment)

    def setup_distributed(self) -> None:
        return lightning_patches.setup_distributed(self, super().setup_distributed)

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        return lightning_patches.setup_model_and_optimizer(self, model, optimizer, lr_scheduler, self.after_initialize)

    def after_initialize(self, engine) -> None:
        """The run's compile mode that lives in the engine (DeepCompile) and its ZeRO-3 step, right after
        deepspeed.initialize, as the raw loop applies them (the engine's module hands compile() to the GPT)."""
        if self.train is not None:
            compile_engine(engine, self.train, self.global_rank)
            patches.install(engine, self.train)  # the raw loop's step (shared/patches/zero3_step.py)

    def load_checkpoint(self, checkpoint_path, *args, **kwargs):
        # Lightning loads a resumed run's checkpoint after the engine was compiled: DeepCompile's pass schedule,
        # counted from the step it was compiled at (0), must start at the loaded step (shared/patches/deepcompile).
        client_state = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        patches.align_schedule(self.deepspeed_engine)
        return client_state


class ZeroPrecision(DeepSpeedPrecision):
    def backward(self, tensor, model, optimizer, *args, **kwargs):
        # Lightning already divided the loss by accumulate_grad_batches: DeepSpeed must not divide again.
        model.trainer.model.backward(tensor, *args, scale_wrt_gas=False, **kwargs)
