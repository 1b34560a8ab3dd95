"""compare.py --explain: every factor switches on what it claims (asserted on effective settings, not timings)."""

import json
import statistics
import sys
from types import SimpleNamespace

import pytest
from pytorch_lightning.callbacks import TQDMProgressBar

from harness import explain
from lightning_app.module import GPTModule
from lightning_app.overheads import LIGHTNING_OVERHEADS
from lightning_app.train import DataModule, build_strategy, build_trainer, lightning_ds_config
from shared.train.config import TrainConfig
from shared.train.results import RunResult
from tests.helpers import ROOT, run

H = 64  # the tiny preset's n_embd


def cfg(factor: str, **kw) -> TrainConfig:
    return explain.factor_config(TrainConfig(preset="tiny", **kw), factor)


def test_every_overhead_has_a_description_and_unknown_factors_fail():
    assert set(explain.FACTORS) >= set(LIGHTNING_OVERHEADS)
    with pytest.raises(ValueError, match="unknown explain factor"):
        explain.parse_factors("progress_bar,warp_drive")


def test_a_factor_named_twice_is_refused_up_front():
    with pytest.raises(ValueError, match=r"\['progress_bar'\] named more than once"):
        explain.parse_factors("progress_bar,log_loss,progress_bar")


def test_deepspeed_side_factors_change_the_lightning_dict_only():
    assert lightning_ds_config(cfg("ds_throughput_timer"))["timers"]["throughput"] == \
        {"enabled": True, "synchronized": True}
    assert lightning_ds_config(cfg("ds_wall_clock_breakdown"))["wall_clock_breakdown"] is True
    tuned = lightning_ds_config(TrainConfig(zero_profile="tuned"))["zero_optimization"]
    original = lightning_ds_config(cfg("original_ds_config", zero_profile="tuned"))["zero_optimization"]
    assert tuned["stage3_prefetch_bucket_size"] > original["stage3_prefetch_bucket_size"] == int(0.9 * H * H)
    assert "gradient_clipping" not in lightning_ds_config(cfg("pl_grad_clip"))
    assert build_trainer(cfg("pl_grad_clip"), []).gradient_clip_val == 1.0
    assert build_trainer(TrainConfig(), []).gradient_clip_val is None


def test_lightning_default_ds_config_factor_uses_lightnings_own_defaults():
    strategy = build_strategy(cfg("pl_default_ds_config"))
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


def figures(*tflops: float) -> list[dict]:
    """Per-round run figures as explain.json stores them (forward time made to follow the throughput)."""
    return [{"tflops_per_gpu": t, "phases_s": {"data": 0.001, "forward": 100.0 / t, "backward": 0.2, "step": 0.05}}
            for t in tflops]


def test_a_factor_is_measured_against_the_same_rounds_lightning_baseline_not_against_raw():
    # Round 0: Lightning itself 10% below raw; the factor 5% below that round's Lightning run.
    runs = {"deepspeed": figures(100.0, 100.0), "fast_default": figures(90.0, 91.0),
            "timer": figures(85.5, 86.45)}
    table = explain.cost_table(runs, {"timer": "a synchronized timer"})
    base, timer = table["rows"]
    assert base["delta_vs_raw"] == pytest.approx(statistics.median([-0.10, -0.09]))
    assert timer["delta_vs_lightning"] == pytest.approx(-0.05) and timer["n"] == 2
    assert timer["delta_min"] == pytest.approx(-0.05) and timer["delta_max"] == pytest.approx(-0.05)
    assert table["baseline_noise"] == pytest.approx(1.0 / 90.5)  # raw did not move; Lightning by 1/90.5
    assert timer["verdict"] == "beyond noise"
    assert timer["phase"] == "forward" and timer["extra_ms_by_phase"]["forward"] > 0


@pytest.mark.parametrize(
    "base, factor, expected",
    [
        ((90.0, 91.0), (85.0, 92.0), "within noise"),  # spread over rounds includes 0
        ((90.0, 99.0), (88.0, 97.0), "within noise"),  # -2% < the baseline's 9.5% round-to-round range
        ((90.0, 91.0), (80.0, 81.0), "beyond noise"),
        ((90.0, 91.0), (80.0,), "beyond noise (1 round, no spread)"),  # factor ran in round 0 only
        ((90.0,), (80.0,), "noise not measured (1 round)"),
    ],
)
def test_costs_inside_the_noise_are_labelled_so(base, factor, expected):
    runs = {"deepspeed": figures(*[100.0] * len(base)), "fast_default": figures(*base), "f": figures(*factor)}
    assert explain.cost_table(runs, {"f": "x"})["rows"][1]["verdict"] == expected


def test_cost_table_refuses_a_factor_without_runs():
    with pytest.raises(ValueError, match="factor 'f' has 0 run"):
        explain.cost_table({"deepspeed": figures(1.0), "fast_default": figures(1.0)}, {"f": "x"})


def test_rounds_alternate_which_path_runs_first(tmp_path):
    order = []

    def launch(path, train, out, log):
        order.append(out.stem)
        return SimpleNamespace(tflops_per_gpu=1.0, device={"name": "cpu"},
                               phases_s={"data": 0.0, "forward": 0.0, "backward": 0.0, "step": 0.0})

    ns = SimpleNamespace(factors="progress_bar,log_loss", repeats=3, factor_repeats=2, world=1)
    report = explain.run_explain(TrainConfig(), ns, launch, tmp_path)
    assert order == ["deepspeed_0", "lightning_0", "progress_bar_0", "log_loss_0",
                     "log_loss_1", "progress_bar_1", "lightning_1", "deepspeed_1",
                     "deepspeed_2", "lightning_2"]
    assert [len(report["runs"][k]) for k in ("deepspeed", "fast_default", "progress_bar")] == [3, 3, 2]


@pytest.mark.parametrize("fails, rounds", [("deepspeed_1", 1), ("lightning_0", 0)])
def test_a_failed_run_leaves_the_report_of_the_finished_rounds_marked_incomplete(tmp_path, fails, rounds):
    from harness.launch import CompareError

    def launch(path, train, out, log):
        if out.stem == fails:
            raise CompareError(f"{path} run failed (exit 1); log: {log}\nreason: error: injected\n--- last lines ---")
        return SimpleNamespace(tflops_per_gpu=1.0, device={"name": "cpu"},
                               phases_s={"data": 0.0, "forward": 0.0, "backward": 0.0, "step": 0.0})

    (tmp_path / "explain.md").write_text("an earlier invocation's report")
    ns = SimpleNamespace(factors="progress_bar,log_loss", repeats=2, factor_repeats=2, world=1)
    with pytest.raises(CompareError) as e:
        explain.run_explain(TrainConfig(), ns, launch, tmp_path)
    assert e.value.reason == "reason: error: injected" and str(tmp_path / "explain.json") in str(e.value)
    report = json.loads((tmp_path / "explain.json").read_text())
    assert report["complete"] is False and report["failed_run"] == fails and report["error"] == "error: injected"
    if rounds:  # round 1 ran log_loss, progress_bar and lightning before deepspeed_1 failed: round 0 is reported
        assert report["finished_runs"][-3:] == ["log_loss_1", "progress_bar_1", "lightning_1"]
        assert report["rounds"] == 1 and [r["factor"] for r in report["rows"]] == ["fast_default", "progress_bar",
                                                                                  "log_loss"]
        assert explain.recompute(tmp_path / "explain.json")["rows"] == report["rows"]
        assert "INCOMPLETE: run deepspeed_1 failed (error: injected)" in (tmp_path / "explain.md").read_text()
    else:  # no round of both baselines: the finished run's figures and the failure, no table
        assert report["finished_runs"] == ["deepspeed_0"] and list(report["runs"]) == ["deepspeed"]
        assert not (tmp_path / "explain.md").exists()
        with pytest.raises(ValueError, match="no cost table: run lightning_0 failed"):
            explain.recompute(tmp_path / "explain.json")


def test_recompute_reads_per_round_figures_from_the_report_or_from_its_run_jsons(tmp_path):
    rows = [{"factor": "fast_default", "what": "baseline"}, {"factor": "timer", "what": "a timer"}]
    old = {"rounds": 2, "factor_rounds": 1, "rows": rows, "raw_tflops_per_gpu": 100.0}
    (tmp_path / "runs").mkdir()
    for stem, fig in [("deepspeed_0", figures(110.0)), ("deepspeed_1", figures(100.0)),
                      ("lightning_0", figures(100.0)), ("lightning_1", figures(104.0)), ("timer_0", figures(97.0))]:
        (tmp_path / "runs" / f"{stem}.json").write_text(json.dumps({**fig[0], "path": "x"}))
    (tmp_path / "explain.json").write_text(json.dumps(old))
    report = explain.recompute(tmp_path / "explain.json")
    timer = report["rows"][1]
    assert timer["delta_vs_lightning"] == pytest.approx(-0.03)  # against lightning_0, not deepspeed_0 (-11.8%)
    assert report["baseline_noise"] == pytest.approx(10.0 / 105.0)  # raw's range is the larger
    assert timer["verdict"] == "within noise"
    (tmp_path / "runs" / "timer_0.json").unlink()
    with pytest.raises(ValueError, match="timer_0.json is missing"):
        explain.recompute(tmp_path / "explain.json")
    new = {**old, "runs": report["runs"]}  # a current report carries its figures: no run JSON needed
    (tmp_path / "explain.json").write_text(json.dumps(new))
    assert explain.recompute(tmp_path / "explain.json")["rows"][1]["delta_vs_lightning"] == pytest.approx(-0.03)
    assert "within noise" in explain.format_explain({**report, "study_artefacts": []})


@pytest.mark.parametrize(
    "world, costs",
    [
        (1, {"python_gc_auto": 9.3, "original_ds_config": -1.9, "ds_throughput_timer": -3.3, "progress_bar": 1.5,
             "log_loss": 4.9, "pl_default_ds_config": 6.6}),
        (2, {"sigterm_check": 3.6, "log_sync_dist": 13.5, "original_ds_config": -1.8}),
    ],
)
def test_committed_explain_reports_recompute_to_the_figures_the_readme_quotes(world, costs):
    report = explain.recompute(ROOT / "benchmarks" / "results" / f"explain_{world}xh200" / "explain.json")
    assert {r["factor"]: round(100 * r["delta_vs_lightning"], 1) for r in report["rows"][1:]} == costs
    assert all(r["n"] == 1 for r in report["rows"][1:])  # one round per factor: to be re-measured


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
