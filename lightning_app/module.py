"""The LightningModule: a thin wrapper around shared's GPT, and the Callback that times it.

The module builds the GPT in `configure_model`, which Lightning calls inside DeepSpeedStrategy's
`model_sharded_context` (deepspeed.zero.Init), so ZeRO-3 partitions the parameters as they are created, exactly
as the raw loop does. Optimizer, LR schedule, seeds and batches come from the same shared functions.
"""

from __future__ import annotations

import gc
import json

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from shared import flops
from shared.config import TrainConfig
from shared.distributed import apply_gc_policy, dropout_seed, seed_all
from shared.ds_runtime import BreakdownCollector
from shared.model import GPT, count_parameters
from shared.optim import build_optimizer, build_scheduler
from shared.progress import Progress
from shared.results import RunResult, build_result, format_summary
from shared.timing import PhaseTimer


class GPTModule(pl.LightningModule):
    def __init__(self, train: TrainConfig):
        super().__init__()
        self.train_cfg = train
        self.model_cfg = train.model()
        on = train.overheads
        self.log_loss = "log_loss" in on or "log_sync_dist" in on
        self.sync_dist = "log_sync_dist" in on
        self.gpt: GPT | None = None
        self.built_in_init = "model_outside_configure_model" in on
        if self.built_in_init:  # the whole model on every rank until deepspeed.initialize partitions it
            seed_all(train.seed)
            self.gpt = GPT(self.model_cfg)

    def configure_model(self) -> None:
        if self.gpt is not None:  # Lightning calls this hook again on every fit/validate
            return
        seed_all(self.train_cfg.seed)  # the same RNG state the raw loop builds its model from
        self.gpt = GPT(self.model_cfg)

    def configure_optimizers(self):
        optimizer = build_optimizer(self.gpt, self.train_cfg, self.device)
        scheduler = build_scheduler(optimizer, self.train_cfg)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.gpt(x, y)
        # Lightning divides what we return by accumulate_grad_batches before backward; the callback records
        # the undivided loss, as the raw loop does.
        self.last_loss = loss.detach()
        if self.log_loss:
            self.log("train_loss", loss, prog_bar=True, sync_dist=self.sync_dist)
        return loss


class SigtermCheck:
    """Runs Lightning's SIGTERM broadcast every `every` steps instead of every step, and counts the broadcasts.

    Since 2.5.2 Lightning broadcasts a SIGTERM flag from rank 0 at the start of every training step when there
    is more than one process, and reads it back with .item(): a collective and a host sync per step (Lightning
    issue #21487). Every rank still checks its own flag after each step; only the rank-0-only case is delayed,
    by at most `every` steps. every=1 keeps Lightning's behaviour (and still counts).
    """

    def __init__(self, trainer: pl.Trainer, every: int):
        self.loop = trainer.fit_loop.epoch_loop
        self.broadcast = self.loop._broadcast_sigterm_tensor  # private API of pytorch-lightning 2.6 (pinned)
        self.every, self.calls = every, 0
        self.loop._broadcast_sigterm_tensor = self

    def __call__(self) -> None:
        if self.loop.global_step % self.every == 0:
            self.calls += 1
            self.broadcast()


class TimingCallback(pl.Callback):
    """Drives shared's PhaseTimer and Progress from Lightning's hooks, and writes the RunResult at the end.

    Phase boundaries, matching the raw loop's marks:
        data      previous step's end -> on_train_batch_start (fetch, host-to-device copy, loop bookkeeping)
        forward   -> on_before_backward
        backward  -> on_after_backward
        step      -> on_train_batch_end (engine.step, LR scheduler, Lightning's post-step bookkeeping)
    """

    def __init__(self, train: TrainConfig):
        self.train = train
        self.result: RunResult | None = None
        self._micro = 0
        self._step_loss = None

    def on_train_start(self, trainer, pl_module):
        on = self.train.overheads
        self.sigterm = SigtermCheck(trainer, 1 if "sigterm_check" in on else self.train.sigterm_check_every)
        apply_gc_policy("auto" if "python_gc_auto" in on else self.train.python_gc)
        device = pl_module.device
        cfg = pl_module.model_cfg
        self.timer = PhaseTimer(device, micro_steps=self.train.grad_accum)
        per_gpu_flops = flops.step_flops(cfg, self.train.micro_batch * self.train.grad_accum, self.train.flops_factor)
        self.progress = Progress(self.train.steps, device, self.timer, per_gpu_flops, self.train.log_every,
                                 enabled=trainer.global_rank == 0, prefix="[lightning] ")
        self._step_loss = torch.zeros((), device=device)
        self.breakdown = BreakdownCollector(trainer.strategy.deepspeed_engine)
        self.timer.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            # The dropout stream starts here, as in the raw loop: right before the first forward.
            torch.manual_seed(dropout_seed(self.train.seed, trainer.global_rank))
        self.timer.mark("data")

    def on_before_backward(self, trainer, pl_module, loss):
        self.timer.mark("forward")
        self._step_loss += pl_module.last_loss

    def on_after_backward(self, trainer, pl_module):
        self.timer.mark("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.timer.mark("step")
        self.breakdown.collect()
        self._micro += 1
        if self._micro % self.train.grad_accum == 0:
            step = self._micro // self.train.grad_accum - 1
            self.progress.record(step, self._step_loss / self.train.grad_accum)
            self._step_loss = torch.zeros((), device=pl_module.device)

    def on_train_end(self, trainer, pl_module):
        losses = self.progress.finish()
        self.timer.finish()
        device = pl_module.device
        engine = trainer.strategy.deepspeed_engine
        peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0,
                            device=device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # once, after the timed region
        ds_config = json.loads(json.dumps(engine.config))  # what DeepSpeed received, after Lightning's formatting
        self.result = build_result(
            path="lightning", train=self.train, model_cfg=pl_module.model_cfg, ds_config=ds_config,
            world_size=trainer.world_size, device=device, attention=pl_module.gpt.attention_backend, fused={},
            losses=losses, timing=self.timer.summary(self.train.warmup_steps),
            n_params=count_parameters(pl_module.gpt),
            ds_breakdown_ms=self.breakdown.summary(self.train.warmup_steps * self.train.grad_accum),
            peak_mem_bytes=peak.item() if device.type == "cuda" else None,
            extra={"lightning": effective_settings(trainer, pl_module, self.sigterm)},
        )
        if trainer.global_rank == 0:
            self.result.to_json(self.train.out)
            print(format_summary(self.result), flush=True)


def effective_settings(trainer: pl.Trainer, pl_module: GPTModule, sigterm: SigtermCheck) -> dict:
    """What the Lightning run actually did, read back from the live objects (tests assert on it)."""
    loader = trainer.train_dataloader
    return {
        "overheads": sorted(pl_module.train_cfg.overheads),
        "progress_bar": trainer.progress_bar_callback is not None,
        "logs_loss": pl_module.log_loss,
        "log_sync_dist": pl_module.sync_dist,
        "sigterm_broadcasts": sigterm.calls,
        "gradient_clip_val": trainer.gradient_clip_val,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "gc_frozen_objects": gc.get_freeze_count(),
        "model_built_in_configure_model": not pl_module.built_in_init,
    }
