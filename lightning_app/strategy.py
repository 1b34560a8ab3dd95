"""DeepSpeedStrategy that also runs on CPU (gloo), for the tiny preset in tests and on laptops.

Lightning refuses DeepSpeed off CUDA ("The DeepSpeed strategy is only supported on CUDA GPUs"), yet DeepSpeed
itself trains ZeRO-3 on CPU with gloo. The smallest honest adaptation overrides three private hooks of
pytorch_lightning 2.6's DeepSpeedStrategy, each only where it assumes a CUDA device index; on GPUs every
override defers to Lightning's own code. They are private API: pyproject pins pytorch-lightning to 2.6.x and
tests/test_lightning.py runs them on 1 and 2 CPU processes.

ZeroPrecision fixes a gradient-scale bug of Lightning + DeepSpeed with accumulate_grad_batches > 1: Lightning's
automatic optimization divides the loss by accumulate_grad_batches (loops/optimization/automatic.py) and
DeepSpeedEngine.backward divides it again by gradient_accumulation_steps, so gradients come out 1/gas^2 instead
of 1/gas (Lightning issue #6170 noted the double scaling in 2021; 2.6.6 still does it). With AdamW that mostly
hides (Adam is scale-invariant) but gradient clipping and eps see 1/gas-times-smaller gradients. We keep
Lightning's division and tell DeepSpeed not to scale again (scale_wrt_gas=False), which gives the raw loop's
gradients exactly.
"""

from __future__ import annotations

import argparse

from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.plugins.precision import DeepSpeedPrecision
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

from shared.train import zero3_step
from shared.train.config import TrainConfig
from shared.train.distributed import release_shm_buffer
from shared.train.ds_runtime import align_schedule, compile_engine


class ZeroStrategy(DeepSpeedStrategy):
    strategy_name = "zero3bench_deepspeed"

    def __init__(self, *args, train: TrainConfig | None = None, **kwargs):
        """train: the run's config, whose compile mode that lives in the engine (DeepCompile, with its options) and
        ZeRO-3 optimizer step are applied to the engine as the raw loop applies them; None: neither (Lightning's
        DeepSpeedStrategy as it is)."""
        super().__init__(*args, **kwargs)
        self.train = train

    @property
    def _on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    def setup_environment(self) -> None:
        if not self._on_cpu:
            return super().setup_environment()
        # Skip DeepSpeedStrategy's CUDA-only check; DDPStrategy's set-up (which calls setup_distributed) remains.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            return super().setup_distributed()
        # Lightning validates that every parallel device has an index; CPU devices have none.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()
        # DeepSpeed's CPU communication op leaves a shared-memory file per rank unless each rank unlinks its own
        release_shm_buffer(self.root_device)

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        engine, ds_optimizer = self._initialize(model, optimizer, lr_scheduler)
        # Lightning 2.6 only calls deepspeed.initialize; a compile mode that lives in the engine (DeepCompile) is
        # applied right after it, as the raw loop does (the engine's module hands compile() to the GPT).
        if self.train is not None:
            compile_engine(engine, self.train, self.global_rank)
            # the raw loop's step (shared/train/zero3_step.py)
            zero3_step.apply(engine, self.train.zero3_step, self.train.grad_norm_check)
        return engine, ds_optimizer

    def load_checkpoint(self, checkpoint_path, *args, **kwargs):
        # Lightning loads a resumed run's checkpoint after the engine was compiled: DeepCompile's pass schedule,
        # counted from the step it was compiled at (0), must start at the loaded step (shared/train/ds_runtime).
        client_state = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        align_schedule(self.deepspeed_engine)
        return client_state

    def _initialize(self, model, optimizer, lr_scheduler):
        if not self._on_cpu:
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        # As Lightning's, but device_rank comes from the local rank: root_device.index is None on CPU.
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer


class ZeroPrecision(DeepSpeedPrecision):
    def backward(self, tensor, model, optimizer, *args, **kwargs):
        # Lightning already divided the loss by accumulate_grad_batches: DeepSpeed must not divide again.
        model.trainer.model.backward(tensor, *args, scale_wrt_gas=False, **kwargs)
