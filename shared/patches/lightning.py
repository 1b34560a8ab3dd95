"""The Lightning path's hooks into pytorch-lightning 2.6.6's internals: what lightning_app/ needs to run at all.

Registered in shared/patches (Groups lightning_cpu, lightning_engine, lightning_sigterm: always on in the Lightning
path) and gated by its version (shared/patches.require); only lightning_app/ imports this module, and it imports
Lightning inside its functions only.

- Lightning refuses DeepSpeed off CUDA ("The DeepSpeed strategy is only supported on CUDA GPUs"), yet DeepSpeed
  itself trains ZeRO-3 on a CPU with gloo. lightning_app/strategy.ZeroStrategy's `setup_environment`,
  `setup_distributed` and `_setup_model_and_optimizer` are one-line delegations to the functions here, which change
  Lightning's code only where it assumes a CUDA device index and, on GPUs, run Lightning's own.
- `_setup_model_and_optimizer` is where Lightning calls deepspeed.initialize; the strategy's own `after_initialize`
  then applies the run's DeepCompile and ZeRO-3 step to the engine, as the raw loop does.
- Since 2.5.2 Lightning broadcasts a SIGTERM flag from rank 0 at the start of every training step when there is
  more than one process, and reads it back with .item(): a collective and a host sync per step (Lightning issue
  #21487). `throttle_sigterm_broadcast` runs it every `every` steps instead, and counts the broadcasts
  (docs/ledger.md, the row of the explain factor `sigterm_check`).
"""

from __future__ import annotations

import argparse

from shared.patches import mark, require


def _on_cpu(strategy) -> bool:
    return strategy.root_device.type == "cpu"


def setup_environment(strategy, parent) -> None:
    """DeepSpeedStrategy.setup_environment; on a CPU, DDPStrategy's (which calls setup_distributed) without
    DeepSpeedStrategy's CUDA-only check. `parent`: Lightning's own, for GPUs."""
    require("lightning_cpu")
    if not _on_cpu(strategy):
        return parent()
    from pytorch_lightning.strategies import DDPStrategy

    mark("lightning_cpu")
    DDPStrategy.setup_environment(strategy)


def setup_distributed(strategy, parent) -> None:
    """DeepSpeedStrategy.setup_distributed; on a CPU without Lightning's check that every parallel device has an
    index (CPU devices have none). `parent`: Lightning's own, for GPUs."""
    require("lightning_cpu")
    if not _on_cpu(strategy):
        return parent()
    from lightning_fabric.utilities.seed import reset_seed

    from shared.train.distributed import release_shm_buffer

    reset_seed()
    strategy.set_world_ranks()
    strategy._init_deepspeed_distributed()
    # DeepSpeed's CPU communication op leaves a shared-memory file per rank unless each rank unlinks its own
    release_shm_buffer(strategy.root_device)


def initialize(strategy, model, optimizer, lr_scheduler):
    """Lightning's deepspeed.initialize (DeepSpeedStrategy._setup_model_and_optimizer); on a CPU as Lightning's, but
    device_rank comes from the local rank: root_device.index is None there. Returns (engine, its optimizer)."""
    from pytorch_lightning.strategies import DeepSpeedStrategy

    if not _on_cpu(strategy):
        return DeepSpeedStrategy._setup_model_and_optimizer(strategy, model, optimizer, lr_scheduler)
    import deepspeed

    engine, ds_optimizer, _, _ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=strategy.local_rank),
        config=strategy.config,
        model=model,
        model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dist_init_required=False,
    )
    return engine, ds_optimizer


def setup_model_and_optimizer(strategy, model, optimizer, lr_scheduler, then):
    """DeepSpeedStrategy._setup_model_and_optimizer: `initialize`, then `then(engine)` (the strategy's own set-up
    of the engine: Lightning 2.6 only calls deepspeed.initialize, and a compile mode that lives in the engine,
    DeepCompile, is applied right after it, as the raw loop does)."""
    require("lightning_engine")
    mark("lightning_engine")
    engine, ds_optimizer = initialize(strategy, model, optimizer, lr_scheduler)
    then(engine)
    return engine, ds_optimizer


class SigtermCheck:
    """Runs Lightning's SIGTERM broadcast every `every` steps instead of every step, and counts the broadcasts.

    every=1 keeps Lightning's behaviour (and still counts). Preemption itself is handled by
    shared/train/preemption.py (lightning_app/callbacks.CheckpointCallback), which replaces Lightning's SIGTERM
    handler at train start.
    """

    def __init__(self, trainer, every: int):
        self.loop = trainer.fit_loop.epoch_loop
        self.broadcast = self.loop._broadcast_sigterm_tensor
        self.every, self.calls = every, 0
        self.loop._broadcast_sigterm_tensor = self

    def __call__(self) -> None:
        if self.loop.global_step % self.every == 0:
            self.calls += 1
            self.broadcast()


def throttle_sigterm_broadcast(trainer, every: int) -> SigtermCheck:
    """Install SigtermCheck on the trainer's training loop; returns it (its `calls` count the broadcasts)."""
    require("lightning_sigterm")
    check = SigtermCheck(trainer, every)
    mark("lightning_sigterm")
    return check
