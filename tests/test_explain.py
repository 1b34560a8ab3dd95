"""compare.py --explain: every factor switches on what it claims (asserted on effective settings, not timings)."""

import json
import sys
from types import SimpleNamespace

import pytest
from pytorch_lightning.callbacks import TQDMProgressBar

import explain
from lightning_app.module import GPTModule
from lightning_app.train import DataModule, build_strategy, build_trainer, lightning_ds_config
from shared.config import LIGHTNING_OVERHEADS, TrainConfig
from shared.results import RunResult
from tests.helpers import ROOT, run

H = 64  # the tiny preset's n_embd


def cfg(factor: str, **kw) -> TrainConfig:
    return explain.factor_config(TrainConfig(preset="tiny", **kw), factor)


def test_every_overhead_has_a_description_and_unknown_factors_fail():
    assert set(explain.FACTORS) >= set(LIGHTNING_OVERHEADS)
    with pytest.raises(ValueError, match="unknown explain factor"):
        explain.parse_factors("progress_bar,warp_drive")


def test_deepspeed_side_factors_change_the_lightning_dict_only():
    assert lightning_ds_config(cfg("ds_throughput_timer"), 1)["timers"]["throughput"] == \
        {"enabled": True, "synchronized": True}
    assert lightning_ds_config(cfg("ds_wall_clock_breakdown"), 1)["wall_clock_breakdown"] is True
    tuned = lightning_ds_config(TrainConfig(zero_profile="tuned"), 1)["zero_optimization"]
    original = lightning_ds_config(cfg("original_ds_config", zero_profile="tuned"), 1)["zero_optimization"]
    assert tuned["stage3_prefetch_bucket_size"] > original["stage3_prefetch_bucket_size"] == int(0.9 * H * H)
    assert "gradient_clipping" not in lightning_ds_config(cfg("pl_grad_clip"), 1)
    assert build_trainer(cfg("pl_grad_clip"), []).gradient_clip_val == 1.0
    assert build_trainer(TrainConfig(), []).gradient_clip_val is None


def test_lightning_default_ds_config_factor_uses_lightnings_own_defaults():
    strategy = build_strategy(cfg("pl_default_ds_config"), 1)
    zero = strategy.config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 200_000_000 and zero["allgather_bucket_size"] == 200_000_000
    assert "stage3_prefetch_bucket_size" not in zero  # DeepSpeed's stage-3 default applies


def test_trainer_module_and_loader_factors():
    bar = build_trainer(cfg("progress_bar"), []).progress_bar_callback
    assert isinstance(bar, TQDMProgressBar) and bar.refresh_rate == 1
    assert build_trainer(TrainConfig(), []).progress_bar_callback is None
    m = GPTModule(cfg("log_sync_dist"))
    assert m.log_loss and m.sync_dist
    assert GPTModule(cfg("log_loss")).log_loss and not GPTModule(cfg("log_loss")).sync_dist
    assert GPTModule(cfg("model_outside_configure_model")).gpt is not None
    assert GPTModule(TrainConfig()).gpt is None  # built in configure_model, under zero.Init
    dm = DataModule(cfg("dataloader_workers"))
    dm.trainer = SimpleNamespace(global_rank=0, global_step=0)
    assert dm.train_dataloader().num_workers == 4
    assert explain.factor_config(TrainConfig(), "grad_accum_2").grad_accum == 2


def test_study_artefacts_multipliers():
    rows = {r["factor"]: r for r in explain.study_artefacts(TrainConfig(preset="1.5b", micro_batch=8), 100.0)}
    assert rows["study_timing_callback"]["multiplier"] == pytest.approx(21 / 20)
    # 1 + s/6h + 65/(16lh) over 1 + s/6h + 50257/(16lh) at the 1.5b preset
    assert rows["study_char_vocab"]["multiplier"] == pytest.approx(1.1482217 / 1.2049526, rel=1e-6)
    assert rows["study_lightning_formula"]["multiplier"] < 0.9


@pytest.mark.slow
def test_explain_end_to_end_two_processes(tmp_path):
    factors = "sigterm_check,log_sync_dist,python_gc_auto,ds_throughput_timer"
    run([sys.executable, ROOT / "compare.py", "--explain", "--nproc", "2", "--repeats", "1", "--steps", "5",
         "--warmup_steps", "1", "--factors", factors, "--out", tmp_path], timeout=500)
    report = json.loads((tmp_path / "explain.json").read_text())
    assert [r["factor"] for r in report["rows"]] == ["fast_default", *factors.split(",")]
    assert len(report["study_artefacts"]) == 4 and report["world_size"] == 2
    assert "Why is Lightning slower" in (tmp_path / "explain.md").read_text()

    def settings(name):
        return RunResult.from_json(tmp_path / "runs" / f"{name}_0.json")

    base = settings("lightning").extra["lightning"]
    assert base["sigterm_broadcasts"] == 1 and base["gc_frozen_objects"] > 0 and not base["logs_loss"]
    assert settings("sigterm_check").extra["lightning"]["sigterm_broadcasts"] == 5  # every step
    assert settings("log_sync_dist").extra["lightning"]["log_sync_dist"] is True
    assert settings("python_gc_auto").extra["lightning"]["gc_frozen_objects"] == 0
    assert settings("ds_throughput_timer").ds_config["timers"]["throughput"]["synchronized"] is True
    assert settings("deepspeed").ds_config["timers"]["throughput"]["enabled"] is False  # the tuned default
