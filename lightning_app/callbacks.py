"""The Lightning path's Callbacks, one concern each:

  RunCallback         the run around the steps, as the raw loop does it: Lightning's SIGTERM check every N steps,
                      the GC policy, the dropout seed before the first forward, and at the end the RunResult (and
                      the weights' export)
  TimingCallback      shared's PhaseTimer and Progress driven from Lightning's hooks: timing only
  CheckpointCallback  saves every save_every steps, at the end and on SIGTERM (shared/train/checkpoint.py)
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_app.module import GPTModule
from shared import patches
from shared.model.gpt import count_parameters
from shared.patches import lightning as lightning_patches
from shared.train import checkpoint, preemption
from shared.train.config import TrainConfig
from shared.train.distributed import dropout_seed, freeze_gc
from shared.train.ds_runtime import BreakdownCollector, GradNormRecorder, param_checksum
from shared.train.loop import peak_memory_bytes, start_progress
from shared.train.preemption import Preemption
from shared.train.results import RunResult, build_result, write_result


class TimingCallback(pl.Callback):
    """Drives shared's PhaseTimer and Progress from Lightning's hooks (the raw loop calls them inline).

    Phase boundaries, matching the raw loop's marks:
        data      previous step's end -> on_train_batch_start (fetch, host-to-device copy, loop bookkeeping)
        forward   -> on_before_backward
        backward  -> on_after_backward
        step      -> on_train_batch_end (engine.step, LR scheduler, Lightning's post-step bookkeeping)
    Validation and checkpoint saves happen between steps and are not counted in any phase.
    """

    def __init__(self, train: TrainConfig):
        self.saves: list[dict] = []  # each checkpoint's step and seconds (CheckpointCallback)
        self.train = train
        self._micro = 0
        self._step_loss = None

    def on_train_start(self, trainer, pl_module):
        device = pl_module.device
        self.start = trainer.global_step  # > 0 when resumed
        engine = trainer.strategy.deepspeed_engine
        self.timer, self.progress = start_progress(self.train, device, trainer.global_rank, "[lightning] ",
                                                   trainer.lr_scheduler_configs[0].scheduler, engine, self.start)
        self._step_loss = torch.zeros((), device=device)
        self.breakdown = BreakdownCollector(engine)
        self.grad_norms = GradNormRecorder(engine)
        self.timer.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
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

    def on_exception(self, trainer, pl_module, exception):
        if hasattr(self, "timer"):
            self.timer.close()  # a profile in progress (--profile_step) stops with the run

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == TrainerFn.FITTING:  # validation inside fit (trainer.training is False here)
            self.timer.start()  # validation time is not a training step's


class RunCallback(pl.Callback):
    """The run around the steps, in the raw loop's order: before the first step the SIGTERM check's cadence and the
    GC policy, right before the first forward the dropout stream, after the last step the RunResult and the export.
    Listed before TimingCallback, so that its hooks run first."""

    def __init__(self, train: TrainConfig, timing: TimingCallback, resume_from: Path | None = None):
        self.train, self.timing, self.resume_from = train, timing, resume_from
        self.result: RunResult | None = None
        self._first_batch = True

    def on_train_start(self, trainer, pl_module):
        on = self.train.overheads
        # Lightning's per-step SIGTERM broadcast, every CHECK_EVERY steps (shared/patches/lightning.py)
        self.sigterm = lightning_patches.throttle_sigterm_broadcast(
            trainer, 1 if "sigterm_check" in on else preemption.CHECK_EVERY)
        if "python_gc_auto" not in on:
            freeze_gc()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._first_batch:
            # The dropout stream starts (or, resumed, continues) here, as in the raw loop: right before the
            # first forward.
            if self.resume_from is not None:
                checkpoint.load_rng(self.resume_from, trainer.global_rank)
            else:
                torch.manual_seed(dropout_seed(self.train.seed, trainer.global_rank))
            self._first_batch = False

    def on_train_end(self, trainer, pl_module):
        if trainer.global_step < self.train.steps:  # stopped early (SIGTERM): a partial run is no result
            return
        timing = self.timing
        losses = timing.progress.finish()
        timing.timer.finish()
        device = pl_module.device
        engine = trainer.strategy.deepspeed_engine
        peak = peak_memory_bytes(device)  # once, after the timed region
        ds_config = json.loads(json.dumps(engine.config))  # what DeepSpeed received, after Lightning's formatting
        timed = max(0, self.train.steps - timing.start - 1)
        self.result = build_result(
            path="lightning", train=self.train, model_cfg=pl_module.model_cfg, ds_config=ds_config,
            world_size=trainer.world_size, device=device, attention=pl_module.gpt.attention_backend,
            losses=losses, timing=timing.timer.summary(min(self.train.warmup_steps, timed)),
            n_params=count_parameters(pl_module.gpt),
            ds_breakdown_ms=timing.breakdown.summary(self.train.warmup_steps * self.train.grad_accum),
            peak_mem_bytes=peak,
            grad_norms=timing.grad_norms.values(), param_checksum=param_checksum(pl_module.gpt),
            fp8_record=pl_module.gpt.fp8,
            extra={"lightning": effective_settings(trainer, pl_module, self.sigterm), "start_step": timing.start,
                   "resumed_from": str(self.resume_from) if self.resume_from else None,
                   "val": pl_module.val_history, "saves": timing.saves,
                   "zero3_step_calls": patches.step_calls(engine)},
        )
        if self.train.export:
            checkpoint.export_live(pl_module.gpt, dataclasses.asdict(pl_module.model_cfg), self.train.export,
                                   {"data": self.train.data, "step": trainer.global_step}, trainer.global_rank,
                                   zero3=self.train.stage == 3)
        write_result(self.result, self.train.out, trainer.global_rank)


class CheckpointCallback(pl.Callback):
    """Every save_every steps, at the end and on SIGTERM: Lightning's DeepSpeed checkpoint into
    CKPT_DIR/stepNNNNNNNN/ plus every rank's RNG state, then the completion marker and pruning
    (shared/train/checkpoint.py)."""

    def __init__(self, train: TrainConfig, timing: TimingCallback):
        self.train, self.timing = train, timing
        self.preempted = False
        # each save's step and seconds, where the run's record reads them (a callback without timing keeps its own)
        self.saves = timing.saves if timing is not None else []

    def on_train_start(self, trainer, pl_module):
        # Replaces Lightning's own SIGTERM handler: the flag is agreed on by all ranks every N steps instead.
        self.preemption = Preemption(pl_module.device)

    def save(self, trainer, step: int) -> Path:
        self.timing.progress.check_finite(step - 1)  # never save after a non-finite loss
        folder = Path(self.train.ckpt_dir) / checkpoint.tag_for(step)
        # collective: DeepSpeed writes folder/checkpoint/ on every rank; weights_only=False (callbacks and loop
        # state too) is Lightning's default, said explicitly so it does not log that it defaulted at every save
        t0 = time.perf_counter()  # what a checkpoint costs: the save ends in a barrier
        trainer.save_checkpoint(folder, weights_only=False)
        checkpoint.commit(folder, step, trainer.global_rank, self.train, "lightning", trainer.strategy.barrier)
        self.saves.append({"step": step, "seconds": time.perf_counter() - t0})
        self.timing.timer.start()  # the save is not a training step's time
        return folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.train.grad_accum:
            return
        done = trainer.global_step
        saved = checkpoint.due(self.train, done)
        if saved:
            self.save(trainer, done)
        # the last step is the run's end, not a preemption: the run finishes (result, export, exit 0), as the raw loop
        if done < self.train.steps and self.preemption.should_stop(done - 1):
            if self.train.ckpt_dir and not saved:
                self.save(trainer, done)
            if trainer.global_rank == 0:
                print(f"[lightning] SIGTERM: stopped after step {done}", flush=True)
            self.preempted = True
            trainer.should_stop = True
            if not (self.train.val_every and done % self.train.val_every == 0):
                # Lightning validates when should_stop is set (training_epoch_loop._should_check_val_fx); the raw
                # loop leaves at once: no validation but the one due at this step
                trainer.limit_val_batches = 0

    def on_train_end(self, trainer, pl_module):
        self.preemption.restore()

    def on_exception(self, trainer, pl_module, exception):
        if hasattr(self, "preemption"):  # SIGTERM terminates again, as after the raw loop's `finally`
            self.preemption.restore()


def effective_settings(trainer: pl.Trainer, pl_module: GPTModule, sigterm: lightning_patches.SigtermCheck) -> dict:
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
