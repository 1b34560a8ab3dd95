"""--sync_check_step: one step's synchronizing CUDA calls, by phase and Python stack (shared/train/sync_check.py)."""

import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from harness import report as reports
from shared.model import config as model_config
from shared.train.config import TrainConfig
from shared.train.results import RunResult, format_summary
from shared.train.sync_check import SYNC_MESSAGE, SyncCheck, format_syncs, short_path
from shared.train.timing import PHASES, PhaseTimer
from tests.helpers import GPU_BASE, LIGHTNING, RAW, load, torchrun


@pytest.fixture
def debug_mode(monkeypatch):
    """torch.cuda's sync debug mode as a CPU build lacks it: the modes set, in order."""
    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    return modes


def fake_sync():  # what c10 raises at a synchronizing call while the mode is "warn"
    warnings.warn(f"{SYNC_MESSAGE} (Triggered internally at c10/cuda/CUDAFunctions.cpp)", UserWarning, stacklevel=1)


def read_loss():
    fake_sync()


def test_each_call_is_recorded_with_its_phase_and_stack_and_the_rest_passes_through(debug_mode):
    phase = ["forward"]
    before = warnings.showwarning
    check = SyncCheck(7, lambda: phase[0])
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        check.begin()
        assert debug_mode[-1] == "warn"
        for _ in range(3):  # one line three times: counted three times, not once as a default filter would show it
            read_loss()
        phase[0] = "step"
        fake_sync()
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
        record = check.end()
    assert debug_mode[-1] == 0 and warnings.showwarning is before  # mode and warning machinery restored
    assert [str(w.message) for w in shown] == ["an unrelated warning"]
    assert record["step"] == 7 and record["total"] == 4 and record["by_phase"] == {"forward": 3, "step": 1}
    forward, step = record["syncs"]
    assert forward["phase"] == "forward" and forward["calls"] == 3
    assert forward["stack"][-1].endswith(" fake_sync") and forward["stack"][-2].endswith(" read_loss")
    assert forward["stack"][-1].startswith("tests/test_sync_check.py:")  # relative to the repository
    assert step["calls"] == 1 and step["stack"][-2].endswith(" test_each_call_is_recorded_with_its_phase_and_"
                                                             "stack_and_the_rest_passes_through")
    assert not any(f.startswith(("shared/train/sync_check.py", "warnings.py")) or "/warnings.py" in f
                   for f in forward["stack"])
    fake_sync_after = len(check.calls)
    with warnings.catch_warnings(record=True):
        fake_sync()  # after end(): not recorded
    assert len(check.calls) == fake_sync_after


def test_short_paths_start_inside_the_installed_package():
    assert short_path("/venv/lib/python3.12/site-packages/deepspeed/runtime/utils.py") == "deepspeed/runtime/utils.py"
    assert short_path("/usr/lib/python3/dist-packages/torch/_tensor.py") == "torch/_tensor.py"
    assert short_path("/somewhere/else.py") == "/somewhere/else.py"


def test_a_package_on_the_import_path_is_named_from_it(monkeypatch):  # as the GPU image installs DeepSpeed
    monkeypatch.setattr(sys, "path", [*sys.path, "/tmp/tmp.abc", "/tmp/tmp.abc/deep"])
    assert short_path("/tmp/tmp.abc/deepspeed/runtime/utils.py") == "deepspeed/runtime/utils.py"
    assert short_path("/tmp/tmp.abc/deep/x.py") == "x.py"  # the longest entry that holds it


def _step(timer, syncs=()):
    for phase in PHASES:
        if phase in syncs:
            fake_sync()
        timer.mark(phase)


def test_the_timer_checks_only_its_step_and_reports_it(debug_mode):
    timer = PhaseTimer(torch.device("cpu"))
    timer.sync_check_step = 1  # a CPU timer refuses the option (below); its step logic is the same
    with warnings.catch_warnings(record=True):
        timer.start()
        _step(timer, syncs=("data", "forward"))  # step 0: not checked
        _step(timer, syncs=("backward", "step"))  # step 1: checked
        _step(timer, syncs=("step",))  # step 2: not checked
    timer.finish()
    assert debug_mode == [0, "warn", 0]
    s = timer.summary(skip=0)
    assert s["syncs"]["step"] == 1 and s["syncs"]["by_phase"] == {"backward": 1, "step": 1}


def test_a_pause_before_the_checked_step_restarts_the_check_and_a_short_run_warns(debug_mode):
    timer = PhaseTimer(torch.device("cpu"))
    timer.sync_check_step = 1
    with warnings.catch_warnings(record=True):
        timer.start()
        _step(timer)
        fake_sync()  # a validation between steps 0 and 1: not the step's
        timer.start()
        _step(timer, syncs=("step",))
    assert timer.syncs["by_phase"] == {"step": 1}
    short = PhaseTimer(torch.device("cpu"))
    short.sync_check_step = 3
    short.start()
    _step(short)
    with pytest.warns(UserWarning, match="--sync_check_step 3: the run ended before that step did"):
        short.finish()
    assert short.summary(skip=0)["syncs"] is None


def test_bad_settings_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="this machine has no CUDA GPU, so there are none to record: drop it"):
        TrainConfig(steps=10, warmup_steps=5, sync_check_step=3)  # CI's machine: refused before any set-up
    with pytest.raises(ValueError, match="records CUDA synchronizations; this run's device is cpu"):
        PhaseTimer(torch.device("cpu"), sync_check_step=1)
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    with pytest.raises(ValueError, match=r"sync_check_step \(5\) must be >= 0 and below warmup_steps \(5\)"):
        TrainConfig(steps=10, warmup_steps=5, sync_check_step=5)
    with pytest.raises(ValueError, match="sync_check_step and profile_step are both 3"):
        TrainConfig(steps=10, warmup_steps=5, sync_check_step=3, profile_step=3)
    assert TrainConfig(steps=10, warmup_steps=5, sync_check_step=3, profile_step=4).sync_check_step == 3


def test_the_run_summary_lists_the_calls():
    record = {"step": 2, "total": 2, "by_phase": {"step": 2},
              "syncs": [{"phase": "step", "calls": 2, "stack": ["a.py:1 outer", "b.py:2 middle", "c.py:3 inner"]}]}
    lines = format_syncs(record)
    assert lines == ["synchronizing CUDA calls in step 2: 2 (step 2)",
                     "  step     x2  c.py:3 inner <- b.py:2 middle <- a.py:1 outer"]
    assert format_syncs({"step": 2, "total": 0, "by_phase": {}, "syncs": []}) == [
        "synchronizing CUDA calls in step 2: 0"]
    r = RunResult(path="deepspeed", command="", preset="tiny", model={}, train={"stage": 3, "precision": "fp32",
                  "micro_batch": 2}, ds_config={}, versions={}, device={"name": "cpu"}, world_size=1,
                  attention="sdpa", fused={}, losses=[5.0, 4.9], steps=2, warmup_steps=1, flops_factor=3,
                  phases_s=dict.fromkeys(PHASES, 0.025), step_time_s={"median": 0.1, "min": 0.1, "max": 0.1},
                  per_step_s=[0.1], tokens_per_s_per_gpu=10.0, tflops_per_gpu=1.0, sparse_tflops_per_gpu=1.0,
                  layout_density=1.0, mfu=None, peak_mem_gib=None, peak_rss_gib=1.0, n_params=1,
                  extra={"syncs": record})
    assert format_summary(r).endswith("\n".join(lines))
    report = reports.build_report(TrainConfig(precision="fp32"), SimpleNamespace(world=1, repeats=1),
                                  {"deepspeed": [r], "lightning": [r]}, {}, [])
    assert report["syncs"]["deepspeed"] == record
    assert "\n".join(["deepspeed:", *format_syncs(record, indent="  ")]) in reports.format_table(report)


@pytest.mark.gpu
def test_a_gpu_step_records_its_real_syncs_by_phase():
    a = torch.randn(1024, 1024, device="cuda")
    timer = PhaseTimer(torch.device("cuda"), sync_check_step=1)
    timer.start()
    for _ in range(3):
        torch.cuda.synchronize()  # an explicit device-wide wait: not seen by the debug mode (a documented limit)
        timer.mark("data")
        loss = (a @ a).sum()  # queued, no sync
        timer.mark("forward")
        loss.item()  # a device-to-host copy: a sync
        timer.mark("backward")
        a[0, :4].tolist()  # another
        timer.mark("step")
    timer.finish()
    rec = timer.syncs
    assert rec["by_phase"] == {"backward": 1, "step": 1}, rec
    backward = next(c for c in rec["syncs"] if c["phase"] == "backward")
    assert backward["stack"][-1].endswith(" test_a_gpu_step_records_its_real_syncs_by_phase")
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script, check, step_mode", [(RAW, "host", "fast"), (LIGHTNING, "host", "fast"),
                                                      (RAW, "device", "fast"), (RAW, "device", "fused"),
                                                      (LIGHTNING, "device", "fused")],
                         ids=["raw", "lightning", "raw-device-fast", "raw-device-fused", "lightning-device-fused"])
def test_gpu_run_records_the_zero3_steps_norm_check(tmp_path, script, check, step_mode):
    """A ZeRO-3 bf16 run on the GPU: DeepSpeed's step reads its gradient-norm check on the host (a sync) and the
    run's JSON and summary name it; with --grad_norm_check device that call is gone (torch's fused AdamW or the
    AdamW kernel skips an invalid update on the device) and every step counts the device check."""
    out = tmp_path / "r.json"
    proc = torchrun(script, 1, [*GPU_BASE, "--steps", "5", "--warmup_steps", "3", "--compile", "none",
                                "--stage", "3", "--precision", "bf16", "--sync_check_step", "2", "--out", out,
                                "--grad_norm_check", check, "--zero3_step", step_mode],
                    timeout=400)
    result = load(out)
    rec = result["extra"]["syncs"]
    assert rec["step"] == 2 and set(rec["by_phase"]) <= set(PHASES)
    step = [c for c in rec["syncs"] if c["phase"] == "step"]
    named = any("is_invalid_grad_norm" in " ".join(c["stack"]) for c in step)
    assert "synchronizing CUDA calls in step 2:" in proc.stdout
    calls = result["extra"]["zero3_step_calls"]
    if check == "host":
        assert named, rec
        assert "norm_check_device" not in calls
    else:
        assert not named, rec
        assert calls["norm_check_device"] == 5 and calls["norm_check_host"] == 0 and calls["norm_skipped"] == 0
        assert calls["norm_check_sync"] == 0, calls
        assert calls.get("adamw_kernel", 0) > 0 if step_mode == "fused" else calls["unscale_fused"] > 0
