"""The LightningModule: a thin wrapper around shared's GPT (its Callbacks: lightning_app/callbacks.py).

The module builds the GPT in `configure_model`, which Lightning calls inside DeepSpeedStrategy's
`model_sharded_context` (deepspeed.zero.Init), so ZeRO-3 partitions the parameters as they are created, exactly
as the raw loop does. Optimizer, LR schedule, seeds, batches, timer, progress lines, checkpoint bookkeeping and
SIGTERM handling come from the same shared functions as the raw loop's.
"""

from __future__ import annotations

import dataclasses
import time

import pytorch_lightning as pl
from torchmetrics import MeanMetric

from shared.model.gpt import GPT
from shared.train.build import build_model
from shared.train.config import TrainConfig
from shared.train.distributed import seed_all
from shared.train.loop import format_validation, validation_figures
from shared.train.optim import build_optimizer, build_scheduler
from shared.train.validation import eager_forward


class GPTModule(pl.LightningModule):
    def __init__(self, train: TrainConfig):
        super().__init__()
        self.train_cfg = train
        self.model_cfg = train.model()
        on = train.overheads
        self.log_loss = "log_loss" in on or "log_sync_dist" in on
        self.sync_dist = "log_sync_dist" in on
        self.val_loss = MeanMetric(sync_on_compute=True)
        self.val_history: list[dict] = []
        self.gpt: GPT | None = None
        self.built_in_init = "model_outside_configure_model" in on
        if self.built_in_init:  # the whole model on every rank until deepspeed.initialize partitions it
            self.gpt = self.build_gpt()

    def build_gpt(self) -> GPT:
        seed_all(self.train_cfg.seed)  # the same RNG state the raw loop builds its model from
        return build_model(self.train_cfg)  # converted to FP8 and compiled as asked, as the raw loop's

    def configure_model(self) -> None:
        if self.gpt is not None:  # Lightning calls this hook again on every fit/validate
            return
        self.gpt = self.build_gpt()

    def compile(self, *args, **kwargs) -> None:
        """What DeepSpeed's engine.compile() calls on its module (`self.module.compile(backend=...)`): compile the
        GPT's forward + loss, the same function the raw loop's engine compiles, and not this module, whose forward
        Lightning redirects to training_step (its logging and bookkeeping stay eager)."""
        self.gpt.compile(*args, **kwargs)

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

    def on_validation_epoch_start(self):
        # DeepSpeedStrategy does not move the LightningModule's own submodules to the GPU under ZeRO-3 (the
        # engine owns placement), so the metric's state would stay on the CPU while the losses are on the GPU
        # (seen on the H200: "Encountered different devices in metric calculation"). Move it explicitly.
        self.val_loss.to(self.trainer.strategy.root_device)
        self._val_t0 = time.perf_counter()  # what a validation pass costs: its figures end in a host sync

    def validation_step(self, batch, batch_idx):
        x, y = batch
        with eager_forward(self.gpt, self.train_cfg.compile == "deepcompile"):  # shared/train/validation.py
            self.val_loss.update(self.gpt(x, y))

    def on_validation_epoch_end(self):
        v = validation_figures(self.trainer.global_step, float(self.val_loss.compute()))  # one sync per validation
        v["seconds"] = time.perf_counter() - self._val_t0
        self.val_loss.reset()
        self.val_history.append(v)
        if self.trainer.global_rank == 0:
            print(format_validation("[lightning] ", v), flush=True)

    def on_save_checkpoint(self, ckpt: dict) -> None:
        # What the export needs to rebuild the plain model (plain data: loads with weights_only=True).
        ckpt["model_config"] = dataclasses.asdict(self.model_cfg)
        ckpt["data"] = self.train_cfg.data
        ckpt["step"] = self.trainer.global_step
