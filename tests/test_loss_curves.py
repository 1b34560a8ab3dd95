"""benchmarks/loss_curves.py: a candidate run judged against the drift of two baseline runs, window by window."""

import json
import math
import random

import pytest

from benchmarks import loss_curves
from tests.helpers import ROOT

FP8 = ROOT / "benchmarks" / "results" / "fp8_vs_bf16_1xh100"
RUNS = {precision: FP8 / f"{precision}_1xh100" / "runs" for precision in ("fp8", "bf16")}  # each precision's pair


def curve(seed: int, steps: int = 200, shift: float = 0.0, noise: float = 0.01) -> list[float]:
    """A falling loss with per-step noise of its own seed (one run's drift), plus a constant shift."""
    rng = random.Random(seed)
    return [3.0 + 8.0 * math.exp(-i / 30) + shift + rng.gauss(0, noise) for i in range(steps)]


def write_run(path, losses, precision="bf16", **train):
    run = {"path": "deepspeed", "preset": "1.5b", "world_size": 1, "device": {"name": "NVIDIA H100 80GB HBM3"},
           "command": f"python plain_deepspeed/train.py --precision {precision}", "versions": {"torch": "x"},
           "model": {"n_layer": 24, "n_embd": 2304, "n_head": 24, "seq_len": 2048, "vocab_size": 50257},
           "train": {"precision": precision, "seed": 1234, "data": "kjv", "steps": len(losses), "micro_batch": 8,
                     "grad_accum": 1, "lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 10, "weight_decay": 0.1,
                     "grad_clip": 1.0, "stage": 3, **train},
           "losses": losses, "extra": {"start_step": 0}}
    path.write_text(json.dumps(run))
    return path


def judge(tmp_path, candidate_losses, **candidate_train):
    a = write_run(tmp_path / "a.json", curve(1))
    b = write_run(tmp_path / "b.json", curve(2))
    c = write_run(tmp_path / "c.json", candidate_losses, **{"precision": "fp8", **candidate_train})
    return loss_curves.main(["--baseline", str(a), str(b), "--candidate", str(c), "--out", str(tmp_path / "out")])


def test_a_candidate_like_a_third_baseline_run_is_within_the_bound_and_the_files_say_so(tmp_path):
    result = judge(tmp_path, curve(3))
    assert result["ok"] and len(result["windows"]) == 4  # of 200 steps: the last 40, over half a window, are one
    assert [w["steps"] for w in result["windows"]] == [[10, 60], [60, 110], [110, 160], [160, 200]]
    # independent noise: offset / drift near sqrt(3)/2, as the module's docstring derives
    assert all(0.5 < w["offset"] / w["drift"] < 1.3 for w in result["windows"])
    written = json.loads((tmp_path / "out" / "loss_curves.json").read_text())
    assert written["command"].startswith("python benchmarks/loss_curves.py --baseline")
    assert written["runs"]["candidate"]["precision"] == "fp8" and written["runs"]["baseline_a"]["precision"] == "bf16"
    assert (tmp_path / "out" / "loss_curves.png").stat().st_size > 10_000


def test_a_curve_that_sits_apart_fails_and_names_its_windows(tmp_path, capsys):
    # a shift of three noise sigmas: the drift of two runs is about 0.011, the candidate's offset about 0.03
    result = judge(tmp_path, curve(3, shift=0.03))
    assert not result["ok"] and result["failed_windows"] == [[10, 60], [60, 110], [110, 160], [160, 200]]
    assert all(w["bias"] > 0.02 for w in result["windows"])
    assert "outside (windows [[10, 60]" in capsys.readouterr().out
    # a shift that begins late fails only where it is
    late = curve(3)
    late[110:] = [x + 0.05 for x in late[110:]]
    assert judge(tmp_path, late)["failed_windows"] == [[110, 160], [160, 200]]


@pytest.mark.parametrize(("steps", "expected"), [
    (300, [(10, 60), (60, 110), (110, 160), (160, 210), (210, 260), (260, 300)]),  # 40 left: a window of its own
    (270, [(10, 60), (60, 110), (110, 160), (160, 210), (210, 270)]),  # 10 left: they join the last
    (310, [(10, 60), (60, 110), (110, 160), (160, 210), (210, 260), (260, 310)]),
    (64, [(10, 64)]),
])
def test_every_step_past_the_warm_up_is_in_a_window(steps, expected):
    assert loss_curves.spans(10, steps, 50) == expected


@pytest.mark.parametrize(("change", "message"), [
    ({"seed": 7}, "differ in seed (1234 against 7)"),
    ({"data": "synthetic"}, "differ in data ('kjv' against 'synthetic')"),
    ({"lr": 6e-4}, "differ in lr"),
])
def test_runs_of_another_seed_data_or_schedule_are_refused_by_name(tmp_path, capsys, change, message):
    with pytest.raises(SystemExit) as e:
        judge(tmp_path, curve(3), **change)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_setting_the_candidate_varies_may_be_one_of_those_checked(tmp_path):
    a = write_run(tmp_path / "a.json", curve(1))
    b = write_run(tmp_path / "b.json", curve(2))
    c = write_run(tmp_path / "c.json", curve(3), seed=7)
    result = loss_curves.main(["--baseline", str(a), str(b), "--candidate", str(c), "--vary", "seed",
                               "--out", str(tmp_path / "out")])
    assert result["ok"] and result["runs"]["candidate"]["seed"] == 7 and result["vary"] == "seed"


def test_bad_inputs_are_refused_before_anything_is_written(tmp_path, capsys):
    a = write_run(tmp_path / "a.json", curve(1))
    b = write_run(tmp_path / "b.json", curve(2), precision="fp8")
    short = write_run(tmp_path / "short.json", curve(3, steps=40))
    stopped = write_run(tmp_path / "stopped.json", curve(3, steps=40), steps=200)  # ended early: fewer losses
    resumed = write_run(tmp_path / "resumed.json", curve(3))
    resumed.write_text(resumed.read_text().replace('"start_step": 0', '"start_step": 100'))
    nan = write_run(tmp_path / "nan.json", [*curve(3)[:-1], float("nan")])
    (tmp_path / "text.json").write_text("not json")
    out = tmp_path / "out"
    cases = [
        ([a, b, a], "the baselines differ in precision ('bf16' against 'fp8')"),
        ([a, a, b], "the baselines have the same loss at every step (one run given twice?)"),
        ([a, a, short], "baseline_a and candidate differ in steps (200 against 40)"),
        ([a, a, stopped], "different numbers of losses: baseline_a 200, baseline_b 200, candidate 40"),
        ([a, a, resumed], "resumed at step 100"),
        ([a, a, nan], "a loss is not a finite number"),
        ([a, a, tmp_path / "text.json"], "is not a readable JSON file"),
        ([a, a, tmp_path / "missing.json"], "is not a readable JSON file"),
    ]
    for (x, y, z), message in cases:
        with pytest.raises(SystemExit) as e:
            loss_curves.main(["--baseline", str(x), str(y), "--candidate", str(z), "--out", str(out)])
        assert e.value.code == 2 and message in capsys.readouterr().err, message
    few = [write_run(tmp_path / f"{n}.json", curve(s, steps=40)) for n, s in (("f1", 1), ("f2", 2), ("f3", 3))]
    with pytest.raises(SystemExit):
        loss_curves.main(["--baseline", str(few[0]), str(few[1]), "--candidate", str(few[2]), "--out", str(out)])
    assert "40 steps leave 30 past the 10-step LR warm-up, fewer than one window of 50" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    for flags, message in ((["--window", "0"], "--window must be >= 1"), (["--factor", "-1"], "--factor > 0"),
                           (["--vary", "precison"], "--vary precison: not a setting the runs record"),
                           (["--out", str(tmp_path / "file")], "is a file")):
        with pytest.raises(SystemExit):
            loss_curves.main(["--baseline", str(a), str(a), "--candidate", str(a), "--out", str(out), *flags])
        assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_committed_fp8_and_bf16_runs_compare_step_for_step(tmp_path):
    """The device's first fp8 and bf16 runs (20 steps, one pair each) go through the same checks: comparable, and
    judged in windows past the warm-up."""
    result = loss_curves.main(["--baseline", str(RUNS["bf16"] / "deepspeed_0.json"),
                               str(RUNS["bf16"] / "lightning_0.json"), "--candidate",
                               str(RUNS["fp8"] / "deepspeed_0.json"), "--window", "5", "--out", str(tmp_path)])
    assert [w["steps"] for w in result["windows"]] == [[10, 15], [15, 20]]
    assert result["runs"]["candidate"]["device"] == "NVIDIA H100 80GB HBM3"


def test_the_300_step_judgement_recomputes_from_the_committed_runs(tmp_path):
    committed = json.loads((FP8 / "loss_curves_300_steps" / "loss_curves.json").read_text())
    again = loss_curves.main(committed["command"].split()[2:-2] + ["--out", str(tmp_path)])
    assert again["windows"] == committed["windows"] and again["failed_windows"] == committed["failed_windows"]


def test_the_fp8_page_quotes_the_committed_judgement_and_it_recomputes(tmp_path):
    committed = json.loads((FP8 / "loss_curves_20_steps" / "loss_curves.json").read_text())
    again = loss_curves.main(committed["command"].split()[2:-2] + ["--out", str(tmp_path)])
    assert again["windows"] == committed["windows"] and committed["ok"] is False
    text = " ".join((ROOT / "docs" / "fp8.md").read_text().split())
    quoted = text[text.index("loss_curves_20_steps"):]
    short = lambda x: f"{x:.1e}".replace("e-0", "e-")  # 8.6e-2, as the page writes it
    offsets = [short(w["offset"]) for w in committed["windows"]]
    drifts = [short(w["drift"]) for w in committed["windows"]]
    assert f"(offsets {offsets[0]} and {offsets[1]} against drifts of {drifts[0]} and {drifts[1]})" in quoted
