import time

import pytest
import torch

from shared.train.timing import PhaseTimer


def test_phases_are_timed_per_step_with_accumulation():
    timer = PhaseTimer(torch.device("cpu"), micro_steps=2)
    timer.start()
    for _ in range(3):
        for _ in range(2):
            for phase, seconds in (("data", 0.001), ("forward", 0.004), ("backward", 0.002), ("step", 0.0)):
                time.sleep(seconds)
                timer.mark(phase)
    timer.finish()
    assert len(timer.steps) == 3
    s = timer.summary(skip=1)
    assert s["n"] == 2
    assert s["phases_s"]["forward"] >= 0.008  # two micro-steps of 4 ms each
    assert s["phases_s"]["forward"] > s["phases_s"]["backward"] > s["phases_s"]["data"]
    assert s["step_time_s"]["median"] == pytest.approx(sum(s["phases_s"].values()), rel=0.2)


def test_marks_out_of_order_are_refused():
    timer = PhaseTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="start"):
        timer.mark("data")
    timer.start()
    with pytest.raises(RuntimeError, match="'forward' marked where 'data' was expected"):
        timer.mark("forward")


def test_summary_needs_timed_steps():
    timer = PhaseTimer(torch.device("cpu"))
    timer.start()
    for phase in ("data", "forward", "backward", "step"):
        timer.mark(phase)
    timer.finish()
    with pytest.raises(ValueError, match="no timed steps"):
        timer.summary(skip=1)


def _steps(timer, n, work=None):
    for _ in range(n):
        timer.mark("data")
        if work is not None:
            work()
        timer.mark("forward")
        timer.mark("backward")
        timer.mark("step")


def test_profile_step_summarizes_that_step_per_phase_and_is_no_timed_steps_time():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    timer = PhaseTimer(torch.device("cpu"), profile_step=1)
    timer.start()
    _steps(timer, 4, work=lambda: a @ b)
    timer.finish()
    p = timer.summary(skip=2)["profile"]
    assert p["device"] == "cpu" and set(p["phases"]) == {"data", "forward", "backward", "step"}
    assert p["unattributed_ms"] == 0
    forward = p["phases"]["forward"]
    assert forward["by_kind_ms"].get("matmul", 0) > 0 and forward["top"][0]["calls"] == 1  # one step profiled
    assert p["phases"]["backward"]["kernels"] == 0
    assert p["step"]["wall_ms"] == pytest.approx(sum(ph["wall_ms"] for ph in p["phases"].values()))


def test_a_pause_before_the_profiled_step_restarts_its_profile_and_a_short_run_drops_it():
    timer = PhaseTimer(torch.device("cpu"), profile_step=1)
    timer.start()
    _steps(timer, 1)
    time.sleep(0.05)  # a validation between steps: the profile begun at the boundary starts again
    timer.start()
    _steps(timer, 1)
    timer.finish()
    assert timer.profile["phases"]["data"]["wall_ms"] < 40
    short = PhaseTimer(torch.device("cpu"), profile_step=3)  # a resumed run that ends before its step 3
    short.start()
    _steps(short, 3)
    with pytest.warns(UserWarning, match="no profile"):
        short.finish()
    assert short.summary(skip=1)["profile"] is None and short._profiler is None


def test_the_profiled_step_is_never_timed_and_a_missed_profile_is_reported():
    timer = PhaseTimer(torch.device("cpu"), profile_step=2)
    timer.start()
    _steps(timer, 4)
    timer.finish()
    assert timer.profile is not None
    assert timer.summary(skip=1)["n"] == 1  # a resumed run excludes fewer steps: the profiled step 2 is still out
    missed = PhaseTimer(torch.device("cpu"), profile_step=5)
    missed.start()
    _steps(missed, 2)
    with pytest.warns(UserWarning, match="--profile_step 5: the run ended before that step"):
        missed.finish()


def test_profile_summary_attributes_kernels_to_phases_and_counts_overlap_once():
    from shared.train.step_profile import kind_of, summarize

    ranges = [("forward", 0, 100), ("backward", 100, 300), ("forward", 300, 400), ("backward", 400, 500)]
    kernels = [("sm90_xmma_gemm_bf16", 10, 60), ("ncclDevKernel_AllGather", 20, 90),  # overlapping streams
               ("triton_poi_fused_add_0", 120, 150), ("cudnn_flash_bwd", 310, 330), ("Memcpy DtoD", 600, 610)]
    s = summarize(kernels, ranges, "cuda")
    fwd, bwd = s["phases"]["forward"], s["phases"]["backward"]
    assert fwd["wall_ms"] == pytest.approx(0.2) and bwd["wall_ms"] == pytest.approx(0.3)  # both micro-steps
    assert fwd["kernels"] == 3 and fwd["kernel_ms"] == pytest.approx(0.14)
    assert fwd["busy_ms"] == pytest.approx(0.1)  # 10-90 and 310-330: the overlap counted once
    assert fwd["by_kind_ms"] == pytest.approx({"communication": 0.07, "matmul": 0.05, "attention": 0.02})
    assert bwd["by_kind_ms"] == pytest.approx({"compiled (triton)": 0.03})
    assert s["unattributed_ms"] == pytest.approx(0.01)  # outside every range: counted apart, not dropped
    assert s["step"]["kernels"] == 4
    assert kind_of("void at::native::vectorized_elementwise_kernel") == "other"
    assert kind_of("triton_poi_fused__to_copy_add_gelu_7") == "compiled (triton)"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "copy and fill"
    with pytest.raises(ValueError, match="no phase ranges"):
        summarize(kernels, [], "cuda")
