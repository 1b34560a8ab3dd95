"""benchmarks/ablation.py and benchmarks/plot_training.py as a user runs them (CPU, tiny preset)."""

import sys

import pytest

from tests.helpers import ROOT, load, run

ABLATION = ROOT / "benchmarks" / "ablation.py"
PLOT = ROOT / "benchmarks" / "plot_training.py"


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
