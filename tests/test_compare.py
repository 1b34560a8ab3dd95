"""compare.py end to end on CPU, and its refusal of bad arguments."""

import json
import sys

import pytest

import compare
from shared.results import RunResult
from tests.helpers import RAW, ROOT, run

COMPARE = ROOT / "compare.py"


@pytest.mark.slow
def test_compare_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "report"
    proc = run([sys.executable, COMPARE, "--repeats", "2", "--steps", "6", "--warmup_steps", "2", "--cross-check",
                "--out", out], timeout=400)
    report = json.loads((out / "report.json").read_text())
    for key in ("command", "preset", "world_size", "device", "versions", "paths", "ratio_lightning_over_deepspeed",
                "loss_parity", "ratio_spread", "cross_check"):
        assert key in report, key
    assert report["preset"] == "tiny" and report["world_size"] == 1
    for path in ("lightning", "deepspeed"):
        p = report["paths"][path]
        for key in ("tflops_per_gpu", "tflops_spread", "mfu", "tokens_per_s_per_gpu", "step_time_s", "phases_s",
                    "peak_mem_gib", "losses"):
            assert key in p, (path, key)
        assert set(p["phases_s"]) == {"data", "forward", "backward", "step"}
        assert p["tflops_spread"]["n"] == 2 and len(p["losses"]) == 6 and len(p["runs"]) == 2
        assert report["cross_check"][path]["ds_wall_clock_breakdown_ms"]["forward"] > 0
        assert p["sdpa_kernel"] == ["MATH"]  # what torch's dispatcher picks on CPU with attention dropout
    ratios = [pl["tflops_per_gpu"] / ds["tflops_per_gpu"]
              for ds, pl in zip(report["paths"]["deepspeed"]["runs"], report["paths"]["lightning"]["runs"])]
    assert report["ratio_lightning_over_deepspeed"] == pytest.approx(sorted(ratios)[0] / 2 + sorted(ratios)[1] / 2)
    lp = report["loss_parity"]
    assert lp["ok"] and len(lp["pairs"]) == 2 and not lp["past_warmup"]  # 6 steps end inside the 10-step LR warm-up
    assert lp["max_abs_diff"] == lp["grad_norm_max_rel_diff"] == lp["checksum_rel_diff"] == 0.0  # bit for bit
    assert report["same_ds_config"]
    # pairs alternate their order: raw first, then Lightning first
    done = {f.stem: f.stat().st_mtime for f in (out / "runs").glob("*_[01].json")}
    assert done["deepspeed_0"] < done["lightning_0"] < done["lightning_1"] < done["deepspeed_1"]
    md = (out / "report.md").read_text()
    assert "Lightning / DeepSpeed throughput" in md and "phases.png" in md
    assert (out / "phases.png").read_bytes()[:4] == b"\x89PNG"
    assert "Lightning / DeepSpeed throughput" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--stage", "4"], "ZeRO stage must be 0, 1, 2 or 3, got 4"),
        (["--micro-batch", "0"], "micro_batch must be a positive integer, got 0"),
        (["--gpus", "1"], "--gpus 1 asked for but 0 GPU(s) available"),
        (["--repeats", "0"], "--repeats must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(args, message):
    proc = run([sys.executable, COMPARE, *args], check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


def test_model_overrides_are_validated_before_any_run(tmp_path):
    # seq_len 100 is not a multiple of the tiny preset's 16-token sparse block
    proc = run([sys.executable, COMPARE, "--seq_len", "100", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "multiple of sparse_block" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_failing_run_is_reported_with_its_log(tmp_path):
    proc = run([sys.executable, COMPARE, "--data", tmp_path / "missing", "--out", tmp_path], check=False,
               timeout=120)
    assert proc.returncode == 1
    assert "deepspeed run failed" in proc.stderr
    assert "reason: error: token file metadata" in proc.stderr and "missing.meta.json" in proc.stderr
    assert (tmp_path / "logs" / "deepspeed_0.log").is_file()


def series(losses, norms=None, checksum=None):
    return {"losses": list(losses), "grad_norms": None if norms is None else list(norms),
            "param_checksum": checksum}


LOSSES = [5.5, 5.4, 5.3, 5.2, 5.1, 5.0, 4.9, 4.8]
NORMS = [2.0, 1.8, 1.6, 1.5, 1.4, 1.3, 1.2, 1.1]
CHECKSUM = {"sum": 12.0, "sum_sq": 400.0, "numel": 1000}


def test_parity_compares_past_the_lr_warmup_in_every_pair():
    same = (series(LOSSES, NORMS, CHECKSUM), series(LOSSES, NORMS, CHECKSUM))
    assert compare.parity([same], "bf16", 3)["ok"]
    warm = series([x + 0.1 if i < 3 else x for i, x in enumerate(LOSSES)], NORMS, CHECKSUM)
    assert compare.parity([(same[0], warm)], "bf16", 3)["ok"]  # differences inside the warm-up are not judged
    late = series([x + 1e-3 if i == 6 else x for i, x in enumerate(LOSSES)], NORMS, CHECKSUM)
    report = compare.parity([same, (same[0], late)], "bf16", 3)  # only the second pair differs
    assert report["failed"] == ["loss"] and report["max_abs_diff"] == pytest.approx(1e-3)
    assert report["pairs"][0]["loss_max_abs_diff"] == 0.0 and report["pairs"][1]["steps"] == [3, 8]
    whole = compare.parity([(same[0], warm)], "bf16", 10)  # runs end inside the warm-up: compared whole
    assert not whole["past_warmup"] and whole["failed"] == ["loss"] and "inside" in compare.format_parity(whole)


@pytest.mark.parametrize(
    "other, failed",
    [
        (series(LOSSES, [n / 2 for n in NORMS], CHECKSUM), ["grad_norm"]),  # gradients scaled twice by 1/gas
        (series(LOSSES, NORMS, {**CHECKSUM, "sum_sq": 400.1}), ["checksum"]),  # 2.5e-4 relative
        (series(LOSSES, NORMS, {**CHECKSUM, "sum": 12.01}), ["checksum"]),  # 0.01 / sqrt(400) = 5e-4
        (series([x * 1.0001 for x in LOSSES], NORMS, CHECKSUM), ["loss"]),  # 5e-4 past warm-up
        (series(LOSSES[:3] + [None] + LOSSES[4:], NORMS, CHECKSUM), ["loss"]),  # a skipped step in one path only
    ],
)
def test_each_measure_fails_the_check_on_its_own(other, failed):
    report = compare.parity([(series(LOSSES, NORMS, CHECKSUM), other)], "bf16", 3)
    assert report["failed"] == failed and not report["ok"]
    assert "MISMATCH in " + ", ".join(failed) in compare.format_parity(report)


def test_fp32_bounds_are_tight_and_unrecorded_measures_are_not_judged():
    off = series([x + 1e-4 for x in LOSSES])  # results written before grad norms and checksums were recorded
    assert compare.parity([(series(LOSSES), off)], "bf16", 3)["ok"]
    fp32 = compare.parity([(series(LOSSES), off)], "fp32", 3)
    assert fp32["failed"] == ["loss"] and fp32["grad_norm_max_rel_diff"] is None
    assert "grad norm max rel diff not recorded" in compare.format_parity(fp32)


# grad_accum 2 so the double scaling shows; a clip of 0.5 binds from step 0 on the tiny preset (its gradient norm
# is ~0.8), else a missing clip changes nothing; bf16, so the check runs at the bounds GPU runs are judged by.
FAULT_RUN = ["--preset", "tiny", "--steps", "8", "--warmup_steps", "2", "--lr_warmup_steps", "3", "--grad_accum",
             "2", "--grad_clip", "0.5", "--log_every", "4", "--precision", "bf16"]


@pytest.mark.slow
def test_parity_catches_a_missing_clip_double_scaled_gradients_and_a_doubled_lr_in_real_runs(tmp_path):
    run([sys.executable, RAW, *FAULT_RUN, "--out", tmp_path / "raw.json"])
    raw = RunResult.from_json(tmp_path / "raw.json")
    assert raw.grad_norms[0] > 0.5 and len(raw.grad_norms) == 8 and raw.param_checksum["numel"] == raw.n_params
    caught = {}
    for fault in ("noclip", "double_scale", "lr2x"):
        run([sys.executable, ROOT / "tests" / "inject.py", "lightning", fault, "--", *FAULT_RUN,
             "--out", tmp_path / f"{fault}.json"])
        report = compare.loss_parity([raw], [RunResult.from_json(tmp_path / f"{fault}.json")], "bf16", 3)
        assert report["past_warmup"] and report["pairs"][0]["steps"] == [3, 8]
        caught[fault] = report["failed"]
    # Measured on CPU: no clip moves the checksum by 4e-4 (loss 7e-5, grad norm 3e-4 stay inside their bounds);
    # the double scaling halves the gradient norm; the doubled LR fails all three.
    assert "checksum" in caught["noclip"]
    assert "grad_norm" in caught["double_scale"]
    assert "loss" in caught["lr2x"]
