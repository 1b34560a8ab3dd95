"""benchmarks/resume_check.py: a run resumed from a mid-run checkpoint judged against the uninterrupted run."""

import json
import sys

import pytest

from benchmarks import resume_check
from tests.helpers import RAW, ROOT, run

TRAIN = {"preset": "1.5b", "precision": "bf16", "seed": 1234, "data": "kjv", "steps": 20, "micro_batch": 8,
         "grad_accum": 1, "lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 10, "weight_decay": 0.1, "grad_clip": 1.0,
         "stage": 3, "profile": "fast"}


def write_run(path, losses, start=0, saves=(), vals=(), checksum=100.0, **train):
    """A RunResult JSON as the training scripts write it: losses from its start step, the mid-run passes' seconds."""
    run_json = {"path": "deepspeed", "command": "python plain_deepspeed/train.py ...", "device": {"name": "H100"},
                "versions": {"torch": "x"}, "train": {**TRAIN, **train}, "losses": losses,
                "grad_norms": [1.0 + 0.01 * x for x in losses],
                "param_checksum": {"sum": checksum, "sum_sq": checksum ** 2, "numel": 10},
                "step_time_s": {"median": 0.36},
                "extra": {"start_step": start, "saves": [{"step": s, "seconds": 12.0} for s in saves],
                          "val": [{"step": s, "val_loss": 3.0, "seconds": 0.9} for s in vals]}}
    path.write_text(json.dumps(run_json))
    return path


def curve(offset=0.0, steps=20):
    return [3.0 + 8.0 / (1 + i) + offset for i in range(steps)]


def files(tmp_path, resumed_offset=0.0, drift_offset=0.0, **resumed):
    full = write_run(tmp_path / "full.json", curve(), saves=(10, 20), vals=(10, 20))
    res = write_run(tmp_path / "resumed.json", curve(resumed_offset)[10:], start=10, **resumed)
    plain = write_run(tmp_path / "plain.json", curve(drift_offset))
    return full, res, plain


def check(tmp_path, full, res, drift=None):
    args = ["--full", str(full), "--resumed", str(res), "--out", str(tmp_path / "out")]
    return resume_check.main(args + (["--drift", str(drift)] if drift else []))


def test_an_exact_continuation_is_within_the_bounds_and_the_costs_are_in_steps(tmp_path, capsys):
    full, res, plain = files(tmp_path)
    result = check(tmp_path, full, res, plain)
    assert result["ok"] and result["resumed_at"] == 10 and result["steps"] == [10, 20]
    assert result["costs"]["checkpoint"]["median_s"] == 12.0
    assert result["costs"]["checkpoint"]["median_in_steps"] == pytest.approx(12.0 / 0.36)
    assert result["costs"]["validation"]["passes"] == [{"step": 10, "seconds": 0.9}, {"step": 20, "seconds": 0.9}]
    written = json.loads((tmp_path / "out" / "resume_check.json").read_text())
    assert written["command"].startswith("python benchmarks/resume_check.py --full") and written["ok"]
    assert "within the bounds" in capsys.readouterr().out


def test_a_resumed_run_that_parts_more_than_two_uninterrupted_runs_fails(tmp_path, capsys):
    # 0.01 apart with no drift between the two uninterrupted runs: outside the fixed bf16 bound (3e-4)
    full, res, plain = files(tmp_path, resumed_offset=0.01)
    result = check(tmp_path, full, res, plain)
    assert not result["ok"] and "loss" in result["parity"]["failed"]
    assert "OUTSIDE the bounds: loss" in capsys.readouterr().out
    # where two uninterrupted runs part by as much, the bound is 1.5x their drift: the same resumed run passes
    full, res, plain = files(tmp_path, resumed_offset=0.01, drift_offset=0.01)
    assert check(tmp_path, full, res, plain)["parity"]["bound"]["loss"] == pytest.approx(0.015)
    assert "loss" not in check(tmp_path, full, res, plain)["parity"]["failed"]


def test_runs_that_cannot_be_compared_are_refused_by_name(tmp_path, capsys):
    full, res, plain = files(tmp_path)
    cases = [
        (full, full, None, "starts at step 0: not a resumed run"),
        (res, res, None, "is itself resumed (at step 10)"),
        (full, write_run(tmp_path / "s.json", curve()[10:], start=10, seed=7), None, "differ in seed (1234 against 7)"),
        (full, write_run(tmp_path / "e.json", curve()[10:], start=10, profile="eager"), None,
         "differ in profile ('fast' against 'eager')"),
        (full, write_run(tmp_path / "c.json", curve()[10:15], start=10), None, "ended at step 15, not at the last"),
        (full, write_run(tmp_path / "n.json", curve()[15:], start=15), None,
         "resumed at step 15, where " + str(full) + " saved no checkpoint (it saved at [10, 20])"),
        (write_run(tmp_path / "f5.json", curve(), saves=(5, 10)), write_run(tmp_path / "r5.json", curve()[5:], start=5),
         None, "inside the 10-step learning-rate warm-up"),
        (full, res, write_run(tmp_path / "d.json", curve()[10:], start=10), "the drift run must be uninterrupted"),
        (full, tmp_path / "missing.json", None, "is not a readable JSON file"),
    ]
    for f, r, d, message in cases:
        with pytest.raises(SystemExit) as e:
            check(tmp_path, f, r, d)
        assert e.value.code == 2 and message in capsys.readouterr().err, message
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_real_cpu_run_resumed_from_its_mid_run_checkpoint_continues_exactly(tmp_path):
    """The raw path on a CPU (tiny preset, the shipped text): validation and a checkpoint every 5 steps, resumed from
    step 5 without a checkpoint folder (it saves nothing), against an uninterrupted run without the passes."""
    common = [sys.executable, RAW, "--preset", "tiny", "--data", "kjv", "--steps", "10", "--warmup_steps", "2",
              "--lr_warmup_steps", "3"]
    ck = tmp_path / "ck"
    run([*common, "--save_every", "5", "--val_every", "5", "--keep_last", "0", "--ckpt_dir", ck,
         "--out", tmp_path / "full.json"], timeout=150)
    run([*common, "--resume", ck / "step00000005", "--out", tmp_path / "resumed.json"], timeout=150)
    run([*common, "--out", tmp_path / "plain.json"], timeout=150)
    proc = run([sys.executable, ROOT / "benchmarks" / "resume_check.py", "--full", tmp_path / "full.json",
                "--resumed", tmp_path / "resumed.json", "--drift", tmp_path / "plain.json", "--out", tmp_path / "out"],
               timeout=60)
    result = json.loads((tmp_path / "out" / "resume_check.json").read_text())
    assert result["ok"] and result["resumed_at"] == 5 and "within the bounds" in proc.stdout
    assert result["parity"]["max_abs_diff"] == 0  # the eager CPU step is deterministic: an exact continuation
    assert [p["step"] for p in result["costs"]["checkpoint"]["passes"]] == [5, 10]
