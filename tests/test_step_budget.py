"""benchmarks/step_budget.py: a profiled step's kernel kinds against the FLOPs formula, the peak and a target."""

import json

import pytest

from benchmarks import step_budget
from shared.model import flops
from tests.helpers import ROOT

# A profiled run on the H200 (one GPU, the 1.5b preset, micro-batch 16), used as a template
CEILING = ROOT / "benchmarks" / "results" / "coordinate_descent_compare_1xh200" / "runs" / "ceiling_0.json"


def _run(tmp_path, name="run.json", **changes):
    data = json.loads(CEILING.read_text())
    for key, value in changes.items():
        if key in ("model", "extra"):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path, data


def test_the_matmul_and_attention_flops_add_up_to_the_exact_count():
    for density in (1.0, flops.causal_density(2048), 0.25):
        for k in (3, 4):
            attention = flops.attention_flops(16, 2048, 24, 2304, k, density)
            total = flops.matmul_flops(16, 2048, 24, 2304, 50257, k, density)
            assert attention == pytest.approx(k * 24 * 4 * density * 16 * 2048**2 * 2304)
            assert total - attention == pytest.approx(k * 24 * 24 * 16 * 2048 * 2304**2 + 6 * 16 * 2048 * 2304 * 50257)


def test_a_target_equal_to_the_runs_own_throughput_leaves_no_gap(tmp_path, capsys):
    path, data = _run(tmp_path)
    report = step_budget.main([str(path), "--target", str(data["tflops_per_gpu"]), "--out", str(tmp_path / "b.json")])
    row = report["runs"][0]
    median_ms = data["step_time_s"]["median"] * 1e3
    assert row["needed_step_ms"] == pytest.approx(median_ms) and abs(row["gap_ms"]) < 1e-6
    kinds = data["extra"]["profile"]["step"]["by_kind_ms"]
    m = data["model"]
    # the two kinds' model FLOPs are the run's exact causal count, their rates those FLOPs over their device time
    causal = flops.causal_flops(16, m["seq_len"], m["n_layer"], m["n_embd"], m["vocab_size"], 3)
    assert row["matmul"]["model_flops"] + row["attention"]["model_flops"] == pytest.approx(causal)
    assert row["attention"]["tflops"] == pytest.approx(row["attention"]["model_flops"] / kinds["attention"] / 1e9)
    assert row["matmul"]["of_peak"] == pytest.approx(row["matmul"]["tflops"] / 989.4)
    # what-ifs: the median step with the idle time removed, or with the attention at the matmuls' rate
    idle_ms = data["extra"]["profile"]["step"]["idle_ms"]
    assert row["what_if"]["no_idle"]["step_ms"] == pytest.approx(median_ms - idle_ms)
    faster = row["what_if"]["attention_at_matmul_rate"]
    assert faster["step_ms"] == pytest.approx(
        median_ms - kinds["attention"] + row["attention"]["model_flops"] / row["matmul"]["tflops"] / 1e9)
    assert faster["tflops_per_gpu"] > data["tflops_per_gpu"]
    assert json.loads((tmp_path / "b.json").read_text())["derived_from"] == [str(path)]
    assert "ceiling" in capsys.readouterr().out


def test_a_sparse_layout_counts_its_blocks_and_an_unknown_device_has_no_peak(tmp_path):
    path, data = _run(tmp_path, model={"layout": "local"}, layout_density=0.25,
                      device={"type": "cuda", "name": "Some Future GPU", "count": 1})
    flops._warned.discard("Some Future GPU")  # warned once per process: an earlier test may have met the name
    with pytest.warns(UserWarning, match="no peak FLOP/s known"):
        row = step_budget.main([str(path)])["runs"][0]
    m = data["model"]
    assert row["attention"]["model_flops"] == pytest.approx(
        flops.attention_flops(16, m["seq_len"], m["n_layer"], m["n_embd"], 3, 0.25))
    assert row["peak_tflops"] is None and row["matmul"]["of_peak"] is None and row["matmul"]["tflops"] > 0


def test_a_run_without_a_profiled_step_is_refused_by_name(tmp_path, capsys):
    path, _ = _run(tmp_path, extra={"profile": None})
    with pytest.raises(SystemExit) as e:
        step_budget.main([str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and "--profile_step" in err
    with pytest.raises(SystemExit):
        step_budget.main([str(tmp_path / "missing.json")])
    assert "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_budget.main([str(path), "--target", "0"])
    cpu, data = _run(tmp_path, "cpu.json")
    data["extra"]["profile"]["device"] = "cpu"
    cpu.write_text(json.dumps(data))
    with pytest.raises(SystemExit):
        step_budget.main([str(cpu)])
    assert "was profiled on 'cpu'" in capsys.readouterr().err


def test_runs_of_one_path_are_named_by_file_and_measured_against_the_baselines_mean(tmp_path, capsys):
    base, data = _run(tmp_path, "baseline.json")
    again, _ = _run(tmp_path, "baseline_again.json")
    kinds = data["extra"]["profile"]["step"]["by_kind_ms"]
    lever, _ = _run(tmp_path, "lever.json", extra={"profile": {**data["extra"]["profile"], "step": {
        **data["extra"]["profile"]["step"], "by_kind_ms": {**kinds, "matmul": kinds["matmul"] + 5.0,
                                                           "compiled (triton)": kinds["compiled (triton)"] - 3.0}}}})
    runs = [str(base), str(lever), str(again)]
    rows = step_budget.main([*runs, "--baseline", str(base), str(again)])["runs"]
    assert [r["row"] for r in rows] == ["baseline", "lever", "baseline_again"]
    delta = rows[1]["vs_baseline_ms"]
    assert delta["matmul"] == pytest.approx(5.0) and delta["compiled (triton)"] == pytest.approx(-3.0)
    assert delta["attention"] == pytest.approx(0.0) and delta["idle"] == pytest.approx(0.0)
    assert all(v == pytest.approx(0.0) for v in rows[0]["vs_baseline_ms"].values())
    assert "lever" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a baseline must be one of the runs named
        step_budget.main([str(base), "--baseline", str(lever)])
    assert "not among the runs named" in capsys.readouterr().err


def test_a_step_profiled_without_syncs_lists_the_hosts_time_and_lead_per_phase(tmp_path, capsys):
    path, data = _run(tmp_path)
    synced = step_budget.main([str(path)])["runs"][0]
    assert "host" not in synced and "the host per phase" not in capsys.readouterr().out
    profile = data["extra"]["profile"]
    phases = {p: {**v, "host_wall_ms": 10.0 + i, "host_lead_ms": None if p == "data" else 5.0 - 4 * i}
              for i, (p, v) in enumerate(profile["phases"].items())}
    nosync, _ = _run(tmp_path, "nosync.json", extra={"profile": {**profile, "synced": False, "phases": phases}})
    row = step_budget.main([str(nosync)])["runs"][0]
    assert row["host"]["forward"] == {"host_wall_ms": 11.0, "host_lead_ms": 1.0}
    assert row["host"]["data"]["host_lead_ms"] is None
    out = capsys.readouterr().out
    assert "data 10.0 / -, forward 11.0 / +1.0, backward 12.0 / -3.0, step 13.0 / -7.0" in out


def test_the_rates_against_the_peak_at_the_clock_the_gpu_held(tmp_path, capsys):
    path, data = _run(tmp_path)
    assert "gpu_telemetry" not in data["extra"]  # the template has none: no held clock, no share of it
    row = step_budget.main([str(path)])["runs"][0]
    assert row["sm_mhz"] is None and row["held_peak_tflops"] is None and row["matmul"]["of_held_peak"] is None
    assert "at the clock the GPU held" not in capsys.readouterr().out
    telemetry = {"readings": 12, "sm_mhz": {"median": 1525.0, "min": 1400.0, "max": 1700.0}}
    held, _ = _run(tmp_path, "held.json", extra={"gpu_telemetry": telemetry})
    row = step_budget.main([str(held)])["runs"][0]
    assert row["sm_mhz"] == 1525.0 and row["held_peak_tflops"] == pytest.approx(989.4 * 1525 / 1830)
    for kind in ("matmul", "attention"):  # the same rates, against the lower peak
        assert row[kind]["of_held_peak"] == pytest.approx(row[kind]["tflops"] / row["held_peak_tflops"])
        assert row[kind]["of_held_peak"] == pytest.approx(row[kind]["of_peak"] * 1830 / 1525)
    out = capsys.readouterr().out
    assert (f"1525 MHz: {989.4 * 1525 / 1830:.1f} TFLOP/s; matmul {row['matmul']['of_held_peak'] * 100:.0f}%, "
            f"attention {row['attention']['of_held_peak'] * 100:.0f}%") in out
    # a device whose datasheet clock is not known gets the datasheet share only, never a guessed held one
    a100, _ = _run(tmp_path, "a100.json", extra={"gpu_telemetry": telemetry},
                   device={"type": "cuda", "name": "NVIDIA A100-SXM4-80GB", "count": 1})
    row = step_budget.main([str(a100)])["runs"][0]
    assert row["matmul"]["of_peak"] is not None and row["held_peak_tflops"] is None
    assert row["matmul"]["of_held_peak"] is None


@pytest.mark.parametrize("target", ["nan", "inf", "-1"])
def test_a_target_that_is_not_a_finite_positive_number_is_refused(tmp_path, capsys, target):
    path, _ = _run(tmp_path)
    with pytest.raises(SystemExit) as e:
        step_budget.main([str(path), "--target", target, "--out", str(tmp_path / "b.json")])
    assert e.value.code == 2 and "--target must be a finite positive TFLOPs/GPU" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
