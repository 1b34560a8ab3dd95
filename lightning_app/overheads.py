"""The overheads the Lightning path can switch on one at a time (compare.py --explain), and their check.

Lightning-only policy: lightning_app/ implements each one (train.py, module.py, callbacks.py); the harness reads
this list to run them. No Lightning import here, so that reading the list costs nothing.
"""

from __future__ import annotations

LIGHTNING_OVERHEADS = {
    "pl_default_ds_config": "Lightning's own DeepSpeed defaults (DeepSpeedStrategy(stage=...), no config dict)",
    "original_ds_config": "the study's original DS config in Lightning while raw runs the run's profile",
    "progress_bar": "Lightning's TQDM progress bar, refreshed every step",
    "log_loss": "self.log('train_loss', loss, prog_bar=True) every step",
    "log_sync_dist": "self.log('train_loss', loss, prog_bar=True, sync_dist=True) every step",
    "sigterm_check": "Lightning's per-step SIGTERM broadcast + .item() (Lightning >= 2.5.2, issue #21487)",
    "ds_throughput_timer": "DeepSpeed's throughput timer, synchronized (its default: 2 device syncs a step)",
    "ds_wall_clock_breakdown": "DeepSpeed's wall_clock_breakdown (synchronized fwd/bwd/step timers)",
    "pl_grad_clip": "gradient clipping through Trainer(gradient_clip_val) instead of the DS dict",
    "dataloader_workers": "DataLoader with 4 worker processes (the study's num_workers=4)",
    "no_pin_memory": "DataLoader without pinned memory",
    "model_outside_configure_model": "GPT built in __init__, outside zero.Init (partitioned only at initialize)",
    "python_gc_auto": "Python's automatic GC scanning every object (no gc.freeze() after set-up)",
}


def check_overheads(train) -> None:
    """Refuse unknown names in train.lightning_overheads, and combinations the Lightning path cannot run as asked
    (a ValueError naming them), before any process starts."""
    unknown = set(train.overheads) - set(LIGHTNING_OVERHEADS)
    if unknown:
        raise ValueError(f"unknown lightning_overheads {sorted(unknown)}; choose from {sorted(LIGHTNING_OVERHEADS)}")
    # blocks need the dict's leaf module and linear setting under ZeRO-3 only; DeepCompile its compile section always
    if "pl_default_ds_config" in train.overheads and train.compile != "none" and (
            train.stage == 3 or train.compile == "deepcompile"):
        raise ValueError(f"lightning_overheads pl_default_ds_config cannot run with --compile {train.compile} "
                         f"at ZeRO stage {train.stage}: Lightning's own DeepSpeed dict has no compile section, leaf "
                         "module or linear setting, so the Lightning path would compile differently from the raw "
                         "one; pass --compile none")
