"""benchmarks/ablation.py, ds_autotuner.py and plot_training.py as a user runs them (CPU, tiny preset)."""

import json
import sys

import pytest

from tests.helpers import ROOT, load, run

ABLATION = ROOT / "benchmarks" / "ablation.py"
PLOT = ROOT / "benchmarks" / "plot_training.py"
DS_AUTOTUNER = ROOT / "benchmarks" / "ds_autotuner.py"


@pytest.mark.slow
def test_ablation_runs_both_paths_per_configuration_and_sweeps_the_micro_batch(tmp_path):
    proc = run([sys.executable, ABLATION, "--configs", "naive,+bias_dropout_add,all", "--mb_sweep", "4",
                "--out", tmp_path], timeout=900)
    report = load(tmp_path / "ablation.json")
    rows = {(r["config"], r["path"]): r for r in report["rows"]}
    assert set(rows) == {(c, p) for c in ("naive", "+bias_dropout_add", "all") for p in ("deepspeed", "lightning")}
    assert all(r["ok"] for r in rows.values()), [r.get("error") for r in rows.values()]
    assert rows[("+bias_dropout_add", "deepspeed")]["fused"]["bias_dropout_add"] is True
    assert rows[("naive", "lightning")]["fused"]["bias_dropout_add"] is False
    assert rows[("all", "deepspeed")]["fused"]["compile"] == "blocks"
    assert rows[("all", "lightning")]["fused"]["dynamo_graph_breaks"] == 0
    assert "fused_layernorm" not in rows[("all", "deepspeed")]["flags"]  # the CUDA-only switch is left out on CPU
    assert report["largest_micro_batch_without_checkpointing"] == {"naive": 4, "all": 4}
    assert "| naive |" in proc.stdout and (tmp_path / "ablation.md").read_text().count("\n|") >= 4


def test_ablation_refuses_an_unknown_configuration(tmp_path):
    proc = run([sys.executable, ABLATION, "--configs", "naive,+turbo", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "unknown configuration(s) ['+turbo']" in proc.stderr


def test_plot_training_draws_the_committed_h200_runs(tmp_path):
    results = sorted((ROOT / "benchmarks" / "results" / "kjv350m_1xh200").glob("kjv350m_*ing.json")) + \
        sorted((ROOT / "benchmarks" / "results" / "kjv350m_1xh200").glob("kjv350m_deepspeed.json"))
    assert len(results) == 2
    run([sys.executable, PLOT, *results, "--out", tmp_path / "loss.png"], timeout=120)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = run([sys.executable, PLOT, tmp_path / "missing.json", "--out", tmp_path / "x.png"], check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.slow
def test_deepspeeds_autotuner_drives_the_raw_loop_and_meets_our_winner(tmp_path):
    # what compare.py --autotune writes, reduced to what --versus reads: its winner's knobs
    winner = {"micro_batch": 2, "activation_checkpointing": False, "prefetch_bucket_size": 50_000_000,
              "reduce_bucket_size": 500_000_000, "param_persistence_threshold": 1_000_000, "compile": "none"}
    (tmp_path / "autotune.json").write_text(json.dumps({"winner": {"knobs": winner}}))
    out = tmp_path / "dsat"
    flags = ["--steps", "6", "--warmup_steps", "2", "--out", out]
    run([sys.executable, DS_AUTOTUNER, "--mb_list", "1,2", *flags], timeout=900)
    report = load(out / "ds_autotuner.json")
    assert "versus" not in report
    # then the head-to-head against our winner, from the same autotuner results (--reuse: no re-tuning)
    proc = run([sys.executable, DS_AUTOTUNER, *flags, "--versus", tmp_path / "autotune.json", "--repeats", "1",
                "--reuse"], timeout=600)
    report = load(out / "ds_autotuner.json")
    assert "--reuse" in report["versus_command"] and "--reuse" not in report["command"]
    exps = {(e["micro_batch"], e["grad_accum"]): e for e in report["experiments"]}
    # DeepSpeed's fast mode: one experiment per micro-batch, gradient accumulation filling the largest
    assert set(exps) == {(1, 2), (2, 1)} and all(e["status"] == "ok" for e in exps.values()), exps
    assert all(e["tokens_per_s_per_gpu"] > 0 and e["zero_optimization"] == {"stage": 3} for e in exps.values())
    best = max(exps.values(), key=lambda e: e["tokens_per_s_per_gpu"])
    assert (report["optimal"]["micro_batch"], report["optimal"]["grad_accum"]) == (best["micro_batch"],
                                                                                   best["grad_accum"])
    v = report["versus"]
    assert all("error" not in r for rs in v["runs"].values() for r in rs), v["runs"]
    assert v["ratio_ours_over_deepspeed"]["n"] == 1 and v["ratio_ours_over_deepspeed"]["median"] > 0
    theirs = load(out / "versus" / "deepspeed_autotuner_0.json")
    assert theirs["ds_config"]["zero_optimization"]["stage"] == 3 and "autotuning" not in theirs["ds_config"]
    assert load(out / "versus" / "ours_0.json")["ds_config"]["zero_optimization"]["stage3_prefetch_bucket_size"] \
        == 50_000_000
    assert "ours / DeepSpeed's:" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--compile", "blocks"], "--compile blocks cannot be autotuned by DeepSpeed"),
    (["--mb_list", "2,x"], "--mb_list must be comma-separated integers"),
    (["--mb_list", "0,2"], "--mb_list needs positive micro-batches"),
    (["--start_profile_step", "4", "--end_profile_step", "3"], "need 0 <= --start_profile_step <="),
    (["--versus", "nope/autotune.json"], "--versus 'nope/autotune.json' does not exist"),
    (["--ds_config", "x.json"], "this script writes the autotuner's config itself"),
    (["--reuse"], "--reuse needs --versus and a finished autotuner run in --out"),
])
def test_ds_autotuner_bad_input_exits_2_before_any_run(tmp_path, args, message):
    proc = run([sys.executable, DS_AUTOTUNER, *args, "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "ds_autotuner_config.json").exists()
