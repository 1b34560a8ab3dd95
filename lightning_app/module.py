"""The LightningModule (a thin wrapper around shared's GPT) and the Callbacks that time, log and checkpoint it.

The module builds the GPT in `configure_model`, which Lightning calls inside DeepSpeedStrategy's
`model_sharded_context` (deepspeed.zero.Init), so ZeRO-3 partitions the parameters as they are created, exactly
as the raw loop does. Optimizer, LR schedule, seeds, batches, timer, progress lines, checkpoint bookkeeping and
SIGTERM handling come from the same shared functions as the raw loop's.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.trainer.states import TrainerFn
from torchmetrics import MeanMetric

from shared.model import flops
from shared.model.gpt import GPT, count_parameters
from shared.train import checkpoint
from shared.train.compile import compile_blocks
from shared.train.config import TrainConfig
from shared.train.distributed import apply_gc_policy, dropout_seed, seed_all
from shared.train.ds_runtime import BreakdownCollector, GradNormRecorder, param_checksum, progress_extras
from shared.train.optim import build_optimizer, build_scheduler
from shared.train.preemption import Preemption
from shared.train.progress import Progress
from shared.train.results import RunResult, build_result, format_summary
from shared.train.timing import PhaseTimer


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
        gpt = GPT(self.model_cfg)
        return compile_blocks(gpt) if self.train_cfg.compile == "blocks" else gpt

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

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_loss.update(self.gpt(x, y))

    def on_validation_epoch_end(self):
        loss = float(self.val_loss.compute())  # one sync per validation
        self.val_loss.reset()
        v = {"step": self.trainer.global_step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
        self.val_history.append(v)
        if self.trainer.global_rank == 0:
            print(f"[lightning] validation at step {v['step']}: loss {loss:.4f}, perplexity {v['val_ppl']:.2f}",
                  flush=True)

    def on_save_checkpoint(self, ckpt: dict) -> None:
        # What the export needs to rebuild the plain model (plain data: loads with weights_only=True).
        ckpt["model_config"] = dataclasses.asdict(self.model_cfg)
        ckpt["data"] = self.train_cfg.data
        ckpt["step"] = self.trainer.global_step


class SigtermCheck:
    """Runs Lightning's SIGTERM broadcast every `every` steps instead of every step, and counts the broadcasts.

    Since 2.5.2 Lightning broadcasts a SIGTERM flag from rank 0 at the start of every training step when there
    is more than one process, and reads it back with .item(): a collective and a host sync per step (Lightning
    issue #21487). every=1 keeps Lightning's behaviour (and still counts). Preemption itself is handled by
    shared/train/preemption.py (CheckpointCallback), which replaces Lightning's SIGTERM handler at train start.
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
    Validation and checkpoint saves happen between steps and are not counted in any phase.
    """

    def __init__(self, train: TrainConfig, resume_from: Path | None = None):
        self.train = train
        self.resume_from = resume_from
        self.result: RunResult | None = None
        self._micro = 0
        self._step_loss = None
        self._first_batch = True

    def on_train_start(self, trainer, pl_module):
        on = self.train.overheads
        self.sigterm = SigtermCheck(trainer, 1 if "sigterm_check" in on else self.train.sigterm_check_every)
        device = pl_module.device
        cfg = pl_module.model_cfg
        self.start = trainer.global_step  # > 0 when resumed
        self.timer = PhaseTimer(device, micro_steps=self.train.grad_accum)
        per_gpu_flops = flops.step_flops(cfg, self.train.micro_batch * self.train.grad_accum, self.train.flops_factor)
        cuda = device.type == "cuda"
        peak = flops.peak_flops(torch.cuda.get_device_name(device), self.train.precision) if cuda else None
        engine = trainer.strategy.deepspeed_engine
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        self.progress = Progress(
            self.train.steps, device, self.timer, per_gpu_flops, self.train.log_every,
            enabled=trainer.global_rank == 0, prefix="[lightning] ", peak_flops=peak, csv_path=self.train.log_csv,
            first_step=self.start, stop_on_nan=self.train.nan_policy == "stop",
            extras=progress_extras(scheduler, engine, device))
        self._step_loss = torch.zeros((), device=device)
        self.breakdown = BreakdownCollector(engine)
        self.grad_norms = GradNormRecorder(engine)
        apply_gc_policy("auto" if "python_gc_auto" in on else self.train.python_gc)
        self.timer.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._first_batch:
            # The dropout stream starts (or, resumed, continues) here, as in the raw loop: right before the
            # first forward.
            if self.resume_from is not None:
                checkpoint.load_rng(self.resume_from, trainer.global_rank)
            else:
                torch.manual_seed(dropout_seed(self.train.seed, trainer.global_rank))
            self._first_batch = False
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
            step = self.start + self._micro // self.train.grad_accum - 1
            self.progress.record(step, self._step_loss / self.train.grad_accum)
            self.grad_norms.record()
            self._step_loss = torch.zeros((), device=pl_module.device)

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == TrainerFn.FITTING:  # validation inside fit (trainer.training is False here)
            self.timer.start()  # validation time is not a training step's

    def on_train_end(self, trainer, pl_module):
        if trainer.global_step < self.train.steps:  # stopped early (SIGTERM): a partial run is no result
            return
        losses = self.progress.finish()
        self.timer.finish()
        device = pl_module.device
        engine = trainer.strategy.deepspeed_engine
        peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0,
                            device=device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # once, after the timed region
        ds_config = json.loads(json.dumps(engine.config))  # what DeepSpeed received, after Lightning's formatting
        timed = max(0, self.train.steps - self.start - 1)
        self.result = build_result(
            path="lightning", train=self.train, model_cfg=pl_module.model_cfg, ds_config=ds_config,
            world_size=trainer.world_size, device=device, attention=pl_module.gpt.attention_backend,
            losses=losses, timing=self.timer.summary(min(self.train.warmup_steps, timed)),
            n_params=count_parameters(pl_module.gpt),
            ds_breakdown_ms=self.breakdown.summary(self.train.warmup_steps * self.train.grad_accum),
            peak_mem_bytes=peak.item() if device.type == "cuda" else None,
            grad_norms=self.grad_norms.values(), param_checksum=param_checksum(pl_module.gpt),
            extra={"lightning": effective_settings(trainer, pl_module, self.sigterm), "start_step": self.start,
                   "resumed_from": str(self.resume_from) if self.resume_from else None,
                   "val": pl_module.val_history},
        )
        if self.train.export:
            checkpoint.export_live(pl_module.gpt, dataclasses.asdict(pl_module.model_cfg), self.train.export,
                                   {"data": self.train.data, "step": trainer.global_step}, trainer.global_rank,
                                   zero3=self.train.stage == 3)
        if trainer.global_rank == 0:
            self.result.to_json(self.train.out)
            print(format_summary(self.result), flush=True)


class CheckpointCallback(pl.Callback):
    """Every save_every steps, at the end and on SIGTERM: Lightning's DeepSpeed checkpoint into
    CKPT_DIR/stepNNNNNNNN/ plus every rank's RNG state, then the completion marker and pruning
    (shared/train/checkpoint.py)."""

    def __init__(self, train: TrainConfig, timing: TimingCallback):
        self.train, self.timing = train, timing
        self.preempted = False

    def on_train_start(self, trainer, pl_module):
        # Replaces Lightning's own SIGTERM handler: the flag is agreed on by all ranks every N steps instead.
        self.preemption = Preemption(pl_module.device, self.train.sigterm_check_every)

    def save(self, trainer, step: int) -> Path:
        self.timing.progress.check_finite(step - 1)  # never save after a non-finite loss
        folder = Path(self.train.ckpt_dir) / checkpoint.tag_for(step)
        # collective: DeepSpeed writes folder/checkpoint/ on every rank; weights_only=False (callbacks and loop
        # state too) is Lightning's default, said explicitly so it does not log that it defaulted at every save
        trainer.save_checkpoint(folder, weights_only=False)
        checkpoint.commit(folder, step, trainer.global_rank, self.train, "lightning", trainer.strategy.barrier)
        self.timing.timer.start()  # the save is not a training step's time
        return folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.train.grad_accum:
            return
        done = trainer.global_step
        saved = checkpoint.due(self.train, done)
        if saved:
            self.save(trainer, done)
        if self.preemption.should_stop(done - 1):
            if self.train.ckpt_dir and not saved:
                self.save(trainer, done)
            if trainer.global_rank == 0:
                print(f"[lightning] SIGTERM: stopped after step {done}", flush=True)
            self.preempted = True
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        self.preemption.restore()


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
