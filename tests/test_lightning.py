"""The Lightning path on CPU (ZeRO-3, gloo) through every launcher, against the raw path."""

import inspect
import sys

import pytest
import torch
from pytorch_lightning.strategies import DeepSpeedStrategy

from lightning_app.strategy import ZeroStrategy
from lightning_app.train import lightning_ds_config
from shared.patches import PATCHES
from shared.train.config import TrainConfig
from shared.train.distributed import free_port
from shared.train.ds_config import build_ds_config
from shared.train.results import RunResult
from tests.helpers import FAST, LIGHTNING, RAW, run, torchrun

PARITY = ["--steps", "6", "--warmup_steps", "2", "--precision", "fp32"]


def test_private_hooks_we_override_still_exist_with_the_same_signature():
    for name in ("setup_environment", "setup_distributed", "_setup_model_and_optimizer"):
        parent = getattr(DeepSpeedStrategy, name)
        assert callable(parent), name
        assert list(inspect.signature(getattr(ZeroStrategy, name)).parameters) == \
            list(inspect.signature(parent).parameters), name


def test_strategy_gets_the_shared_dict_less_only_grad_accum():
    train = TrainConfig(preset="tiny", grad_accum=4)
    raw = build_ds_config(train)
    pl = lightning_ds_config(train)
    assert raw.pop("gradient_accumulation_steps") == 4
    assert pl == raw  # Lightning refuses the key and writes it back from accumulate_grad_batches=4


@pytest.mark.slow
def test_one_process_matches_raw_path_bit_for_bit(tmp_path):
    # with step 1 profiled in both: the profiler and its syncs change no number
    run([sys.executable, RAW, *PARITY, "--profile_step", "1", "--out", tmp_path / "raw.json"])
    run([sys.executable, LIGHTNING, *PARITY, "--profile_step", "1", "--out", tmp_path / "pl.json"])
    raw, pl = RunResult.from_json(tmp_path / "raw.json"), RunResult.from_json(tmp_path / "pl.json")
    assert pl.path == "lightning" and pl.world_size == 1
    assert pl.ds_config == raw.ds_config  # what deepspeed.initialize received, in both paths
    assert pl.losses == raw.losses  # same init, batches, dropout masks and optimizer: identical on CPU
    # both ran the fast ZeRO-3 step (shared/patches/zero3_step.py) the same number of times, never falling back
    assert pl.extra["zero3_step_calls"] == raw.extra["zero3_step_calls"]
    assert raw.extra["zero3_step_calls"]["fast"] > 0 and raw.extra["zero3_step_calls"]["deepspeed"] == 0
    # the Lightning path's hooks on a CPU, on top of the raw loop's patches (shared/patches)
    lightning_hooks = {p.target for p in PATCHES if p.group.startswith("lightning_")}
    assert set(pl.extra["patches"]) == set(raw.extra["patches"]) | lightning_hooks and raw.extra["patches"]
    for r in (raw, pl):  # each path's hooks open and close every phase of the profiled step
        phases = r.extra["profile"]["phases"]
        assert set(phases) == {"data", "forward", "backward", "step"}, r.path
        assert phases["forward"]["kernels"] > 0 and phases["backward"]["kernels"] > 0, r.path


@pytest.mark.slow
@pytest.mark.timeout(900)  # above the sum of its subprocess timeouts (tests/test_timeouts.py)
def test_two_processes_lightning_launcher_and_torchrun(tmp_path):
    run([sys.executable, LIGHTNING, *FAST, "--devices", "2", "--grad_accum", "2", "--out", tmp_path / "a.json"])
    torchrun(LIGHTNING, 2, [*FAST, "--grad_accum", "2", "--out", tmp_path / "b.json"])
    torchrun(RAW, 2, [*FAST, "--grad_accum", "2", "--out", tmp_path / "raw.json"])
    a, b, raw = (RunResult.from_json(tmp_path / f) for f in ("a.json", "b.json", "raw.json"))
    assert a.world_size == b.world_size == 2
    assert a.ds_config == b.ds_config == raw.ds_config
    assert a.ds_config["gradient_accumulation_steps"] == 2
    assert a.losses == pytest.approx(raw.losses, abs=1e-6) and b.losses == pytest.approx(raw.losses, abs=1e-6)


@pytest.mark.slow
def test_fabric_run_launcher(tmp_path):
    pytest.importorskip("click")  # `fabric run` (python -m lightning_fabric.cli) needs click
    # a free port: fabric's default 29400 may be held by a test on the other worker
    run([sys.executable, "-m", "lightning_fabric.cli", "--accelerator", "cpu", "--devices", "2", "--main-port",
         free_port(), LIGHTNING, *FAST, "--out", tmp_path / "f.json"], eager=False)
    result = RunResult.from_json(tmp_path / "f.json")
    assert result.world_size == 2 and result.train["profile"] == "eager"  # the machine's default, on every rank


@pytest.mark.slow
def test_bad_input_exits_2(tmp_path):
    proc = run([sys.executable, LIGHTNING, "--precision", "fp16", "--out", tmp_path / "r.json"], check=False)
    assert proc.returncode == 2 and "fp16 is not supported by DeepSpeed on CPU" in proc.stderr


def test_validation_metric_moves_to_the_strategy_device():
    """Under ZeRO-3 Lightning leaves the module's own metric on the CPU; the hook must move it (the H200 bug)."""
    from types import SimpleNamespace

    from lightning_app.module import GPTModule
    from shared.train.config import TrainConfig

    module = GPTModule(TrainConfig())
    target = torch.device("meta")  # any device other than the CPU the metric starts on
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=target))
    module.on_validation_epoch_start()
    assert module.val_loss.mean_value.device == target


def test_devices_that_disagree_with_the_launchers_processes_are_refused(monkeypatch):
    from lightning_app.train import default_devices
    from shared.train.config import TrainConfig

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_devices(TrainConfig()) == 1 and default_devices(TrainConfig(devices=1)) == 1
    with pytest.raises(ValueError, match="--devices 2: this launcher already started 1 process"):
        default_devices(TrainConfig(devices=2))


def test_a_failed_fit_gives_sigterm_back_to_its_previous_handler():
    # the raw loop restores it in a `finally`; Lightning calls no on_train_end after an exception
    import signal
    from types import SimpleNamespace

    from lightning_app.callbacks import CheckpointCallback

    before = signal.getsignal(signal.SIGTERM)
    ckpt = CheckpointCallback(TrainConfig(), timing=None)
    ckpt.on_train_start(None, SimpleNamespace(device=torch.device("cpu")))
    assert signal.getsignal(signal.SIGTERM) != before
    ckpt.on_exception(None, None, ValueError("micro_batch 64 does not fit"))
    assert signal.getsignal(signal.SIGTERM) == before
