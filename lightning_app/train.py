"""PyTorch Lightning path: the same GPT, optimizer, schedule, batches and DeepSpeed dict as the raw loop.

    python lightning_app/train.py --preset 1.5b --stage 3 --precision bf16 --devices 8   # Lightning's launcher
    torchrun --nproc_per_node 8 lightning_app/train.py --preset 1.5b                     # torchrun
    fabric run --devices 8 lightning_app/train.py --preset 1.5b                          # the old `lightning run model`
    python lightning_app/train.py                          # one CPU process (gloo) when there is no GPU

The original study launched with `lightning run model --devices 8 ...`; that CLI left Lightning in 2.5 and the
Trainer never needed it: `python lightning_app/train.py --devices 8` starts the other ranks itself (Lightning's
subprocess launcher), and torchrun works as well. See docs/paths.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import TQDMProgressBar

if __package__ in (None, ""):
    # Run by path (`python lightning_app/train.py`, torchrun, `fabric run`): Python puts this folder, not the repo
    # root, on sys.path. lightning_app is not installed as a package (the name belongs to the `lightning-app`
    # distribution on PyPI), so the repo root goes first: this folder's modules win over any installed namesake.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_app.callbacks import CheckpointCallback, RunCallback, TimingCallback
from lightning_app.module import GPTModule
from lightning_app.overheads import check_overheads
from lightning_app.strategy import ZeroPrecision, ZeroStrategy
from shared.train import checkpoint
from shared.train.cli import parse_train_config
from shared.train.compile import configure_inductor
from shared.train.config import TrainConfig
from shared.train.data import train_loader, val_loader
from shared.train.distributed import check_before_start, check_precision, oom_message, run_cli
from shared.train.ds_config import autotuning_enabled, build_ds_config, read_user_json
from shared.train.preemption import EXIT_CODE
from shared.train.results import RunResult

LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}


def default_devices(train: TrainConfig) -> int:
    if "LOCAL_WORLD_SIZE" in os.environ:  # under torchrun / fabric run: one process per device, already spawned
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        if train.devices is not None and train.devices != local:
            raise ValueError(f"--devices {train.devices}: this launcher already started {local} process(es) per node; "
                             f"launch {train.devices} (`torchrun --nproc_per_node {train.devices}`) or drop --devices")
        return local
    if train.devices is not None:
        return train.devices
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def lightning_ds_config(train: TrainConfig) -> dict:
    """build_ds_config's dict, less gradient_accumulation_steps: Lightning refuses that key and writes it back
    itself from Trainer(accumulate_grad_batches=...), so deepspeed.initialize gets the same dict as the raw loop.

    The DeepSpeed-side overheads of compare.py --explain are applied here, to the Lightning run only.
    """
    on = train.overheads
    if "original_ds_config" in on:
        train = dataclasses.replace(train, zero_profile="original")
    if train.ds_config and autotuning_enabled(read_user_json(train.ds_config)[0]):
        raise ValueError("DeepSpeed's autotuner drives the raw loop (deepspeed --autotuning tune "
                         "plain_deepspeed/train.py ...); remove the enabled autotuning section for Lightning")
    cfg = build_ds_config(train)
    cfg.pop("gradient_accumulation_steps", None)
    if "ds_throughput_timer" in on:
        cfg["timers"] = {"throughput": {"enabled": True, "synchronized": True}}
    if "ds_wall_clock_breakdown" in on:
        cfg["wall_clock_breakdown"] = True
    if "pl_grad_clip" in on:
        cfg.pop("gradient_clipping", None)  # Lightning writes Trainer(gradient_clip_val=...) into the dict instead
    return cfg


def build_strategy(train: TrainConfig) -> ZeroStrategy:
    precision = ZeroPrecision(LIGHTNING_PRECISION[train.tensor_precision])  # fp8: bf16's, FP8 inside the model
    if "pl_default_ds_config" in train.overheads:
        # What `Trainer(strategy="deepspeed_stage_3")` gives: Lightning's defaults (buckets of 2e8, DeepSpeed's
        # stage-3 defaults for prefetch and persistence, DeepSpeed's synchronized throughput timer). The dict only:
        # the run's ZeRO-3 step (--zero3_step, --grad_norm_check) is the raw loop's still (check_overheads refuses
        # a compile mode that would need the dict).
        return ZeroStrategy(stage=train.stage, logging_batch_size_per_gpu=train.micro_batch,
                            precision_plugin=precision, train=train)
    return ZeroStrategy(config=lightning_ds_config(train), precision_plugin=precision, train=train)


class DataModule(pl.LightningDataModule):
    def __init__(self, train: TrainConfig):
        super().__init__()
        self.train_cfg = train

    def train_dataloader(self):
        cfg = self.train_cfg
        on = cfg.overheads
        start = self.trainer.global_step  # restored from the checkpoint before the loaders are built
        # count_skipped: Lightning's restored batch counter starts at `start`; the epoch must end with the run.
        return train_loader(cfg, self.trainer.global_rank, start,
                            pin_memory=torch.cuda.is_available() and "no_pin_memory" not in on,
                            num_workers=4 if "dataloader_workers" in on else 0, count_skipped=True)

    def val_dataloader(self):
        return val_loader(self.train_cfg, self.trainer.global_rank, pin_memory=torch.cuda.is_available())


def build_trainer(train: TrainConfig, callbacks: list[pl.Callback]) -> pl.Trainer:
    devices = default_devices(train)
    on_gpu = torch.cuda.is_available()
    check_precision(torch.device("cuda" if on_gpu else "cpu"), train.tensor_precision)
    if on_gpu and devices > torch.cuda.device_count():
        raise ValueError(f"{devices} GPU(s) asked for but {torch.cuda.device_count()} available")
    num_nodes = int(os.environ.get("WORLD_SIZE", devices)) // devices if "LOCAL_WORLD_SIZE" in os.environ else 1
    on = train.overheads
    lightning_clips = bool({"pl_grad_clip", "pl_default_ds_config"} & on)
    if "progress_bar" in on:
        callbacks = [*callbacks, TQDMProgressBar(refresh_rate=1)]
    return pl.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=build_strategy(train),
        max_steps=train.steps,
        gradient_clip_val=train.grad_clip if lightning_clips else None,
        accumulate_grad_batches=train.grad_accum,
        callbacks=callbacks,
        # Per-step host syncs the measurement does not need: the progress bar reads the loss every step, a logger
        # flushes metrics; progress comes from shared/train/progress.py instead (async, once per log interval).
        enable_progress_bar="progress_bar" in on,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        # a DeepCompile run validates eagerly with its parameters gathered (shared/train/validation.py), which
        # torch.inference_mode would leave as inference tensors
        inference_mode=train.compile != "deepcompile",
        limit_val_batches=train.val_batches if train.val_every else 0,
        val_check_interval=train.val_every * train.grad_accum if train.val_every else None,
        check_val_every_n_epoch=None if train.val_every else 1,
        # Each rank builds its own (seed, rank, step) batches; a DistributedSampler would reshuffle them.
        use_distributed_sampler=False,
    )


def main(train: TrainConfig) -> RunResult | None:
    """Train with Lightning; rank 0 writes the RunResult JSON to train.out and every rank returns it."""
    if train.nan_policy == "skip":
        raise ValueError("nan_policy skip is not available in the Lightning path: Lightning refuses a training_step "
                         "that returns None in distributed training, and DeepSpeed cannot drop a backward that has "
                         "already reduced NaN gradients; use nan_policy stop, or the raw path")
    check_overheads(train)
    devices = default_devices(train)
    world = int(os.environ["WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else devices
    check_before_start(train, torch.device("cuda" if torch.cuda.is_available() else "cpu"), world, devices,
                       lightning=True)
    resume_from = checkpoint.resolve_resume(train.resume, train.ckpt_dir)
    checkpoint.check_ckpt_dir(train, resume_from)
    if resume_from is not None:
        checkpoint.check_resumable(resume_from, "lightning", dataclasses.asdict(train.model()), world)
        checkpoint.check_safe_to_load(resume_from, train.trust_checkpoint)
        saved_step = checkpoint.client_state_of(resume_from).get("global_step", 0)
        checkpoint.check_steps_left(resume_from, saved_step, train.steps)
        checkpoint.warn_schedule_change(resume_from, saved_step, train)
    configure_inductor(train)
    timing = TimingCallback(train)
    run = RunCallback(train, timing, resume_from)
    ckpt = CheckpointCallback(train, timing)
    trainer = build_trainer(train, [run, timing, ckpt])
    try:  # the library warnings the project cannot fix are filtered in shared/train/distributed.quiet_library_noise
        trainer.fit(GPTModule(train), datamodule=DataModule(train),
                    ckpt_path=str(resume_from) if resume_from else None)
    except torch.OutOfMemoryError as e:
        raise ValueError(oom_message(train, trainer.strategy.root_device)) from e
    if ckpt.preempted:
        raise SystemExit(EXIT_CODE)
    return run.result


def launch_world(ns) -> int:
    """The run's processes as main() will count them (default_devices), from the parsed flags: the profile's rules
    read it before the TrainConfig exists, and every rank must resolve the same settings."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if ns.devices is not None:
        return ns.devices
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def cli(argv: list[str] | None = None) -> None:
    run_cli(main, parse_train_config(argv, __doc__, world=launch_world), "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    cli(sys.argv[1:])
