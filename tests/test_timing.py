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
    # the timed steps' place in wall-clock time: from the end of step 0 (the skipped one) to the end of step 2
    start, end = s["timed_wall"]
    assert timer.wall_started < start < end and start == timer.wall_done[0] and end == timer.wall_done[2]
    assert end - start >= 0.5 * sum(s["per_step_s"])  # it spans the two timed steps (slack for the host's delays)
    assert timer.summary(skip=0)["timed_wall"][0] == timer.wall_started


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


def test_innermost_host_operator_timeline():
    from shared.train.step_profile import innermost

    ops = [("outer", 0, 100), ("a", 10, 30), ("a.inner", 15, 20), ("b", 40, 120), ("later", 200, 210)]
    assert [s[:3] for s in innermost(ops)] == [
        (0, 10, "outer"), (10, 15, "a"), (15, 20, "a.inner"), (20, 30, "a"), (30, 40, "outer"), (40, 100, "b"),
        (200, 210, "later")]  # b cut at outer's end
    assert [s[3] for s in innermost(ops)][2] == ("outer", "a", "a.inner")


def test_idle_time_is_split_into_host_late_and_queued_and_credited_to_the_launching_threads_operator():
    from shared.train.step_profile import innermost, summarize

    main, engine = 1, 2
    host = {main: innermost([("aten::mm", 0, 5), ("dc::wait_allgather", 20, 45), ("cudaStreamSynchronize", 90, 100)]),
            engine: innermost([("autograd::engine::evaluate_function", 100, 190), ("aten::mm", 150, 160)])}
    ranges = [("forward", 0, 100), ("backward", 100, 200)]
    kernels = [("gemm", 2, 10, (1, main)),  # times in us; idle 0-2: launched at 1, so 1 host, 1 queued
               ("gemm", 50, 60, (48, main)),  # idle 10-50: host until the launch at 48, then queued
               ("nccl", 52, 58, (3, main)),  # inside the busy time: no gap
               ("fill", 70, 80, None),  # no launch record: counted apart
               ("gemm", 160, 170, (155, engine))]  # backward: 100-155 on the engine thread, 155-160 queued
    s = summarize(kernels, ranges, "cuda", host, main)
    fwd, bwd = s["phases"]["forward"]["idle"], s["phases"]["backward"]["idle"]
    assert fwd["host_ms"] == pytest.approx((1 + 38 + 20) / 1e3)  # 0-1, 10-48, 80-100 (after the last kernel)
    assert fwd["queued_ms"] == pytest.approx((1 + 2) / 1e3) and fwd["unlinked_ms"] == pytest.approx(10 / 1e3)
    ops = {o["name"]: o["ms"] * 1e3 for o in fwd["host_ops"]}
    assert ops == pytest.approx({"aten::mm": 1, "dc::wait_allgather": 25, "cudaStreamSynchronize": 10,
                                 "(no operator)": 10 + 3 + 10})  # 10-20, 45-48, 80-90
    assert bwd["host_ms"] == pytest.approx((55 + 30) / 1e3) and bwd["queued_ms"] == pytest.approx(5 / 1e3)
    assert {o["name"]: o["ms"] * 1e3 for o in bwd["host_ops"]} == pytest.approx(
        {"autograd::engine::evaluate_function": 50, "aten::mm": 5, "(no operator)": 30})  # 170-200: main, no op
    assert {o["name"]: o["ms"] * 1e3 for o in bwd["host_inclusive"]} == pytest.approx(
        {"autograd::engine::evaluate_function": 55, "aten::mm": 5})  # the mm ran inside it
    for p in s["phases"].values():  # every idle microsecond has one cause
        idle = p["idle"]
        assert idle["host_ms"] + idle["queued_ms"] + idle["unlinked_ms"] == pytest.approx(p["idle_ms"])
    from harness.report import format_profiles

    text = format_profiles({"raw": s}, 9)
    assert text.count("idle: host behind") == 2 and "no launch record 0.0" in text  # the forward's fill


def test_a_step_profiled_without_syncs_is_cut_on_the_devices_timeline_by_the_phase_that_launched_each_kernel():
    from shared.train.step_profile import device_ranges, innermost, summarize

    main, engine = 1, 2
    host = {main: innermost([("aten::copy_", 0, 10), ("aten::mm", 10, 50), ("optimizer.step", 90, 100)]),
            engine: innermost([("autograd::engine::evaluate_function", 83, 89)])}
    ranges = [("data", 0, 10), ("forward", 10, 50), ("backward", 50, 90), ("step", 90, 100)]  # host, us
    kernels = [("multi_tensor_apply_adam", -5, 20, (-8, main)),  # the previous step's tail: not this step's
               ("Memcpy HtoD", 22, 24, (5, main)),  # the device ran behind the host: data's kernel at 22
               ("gemm", 24, 60, (12, main)), ("gemm", 62, 80, (40, main)),  # forward; 60-62 queued
               ("fill", 81, 83, None),  # no launch record: in the range it started in (backward), unlinked
               ("gemm", 90, 120, (88, engine)), ("nccl", 110, 130, (89, engine)),  # backward, two streams
               ("multi_tensor_apply_adam", 125, 140, (92, main)),  # the step's, begun while backward's nccl ran
               ("gemm", 141, 150, (101, main))]  # launched after the step's last mark: the next step's
    spans, per, rest = device_ranges(kernels, ranges)
    assert spans == [("data", 20, 24), ("forward", 24, 80), ("backward", 80, 130), ("step", 130, 140)]
    assert [len(ks) for ks in per] == [1, 2, 3, 1] and [k[1] for k in rest] == [-5, 141]
    s = summarize(kernels, ranges, "cuda", host, main, synced=False)
    assert s["synced"] is False and s["unattributed_ms"] == 0  # the tail and the next step lie outside the span
    ph = {p: s["phases"][p] for p in s["phases"]}
    assert [ph[p]["wall_ms"] * 1e3 for p in ph] == pytest.approx([4, 56, 50, 10])
    assert [ph[p]["busy_ms"] * 1e3 for p in ph] == pytest.approx([2, 54, 42, 10])  # the step's cut at 130
    assert ph["step"]["kernel_ms"] * 1e3 == pytest.approx(15)  # kernel time is the kernels' own
    assert s["step"]["wall_ms"] * 1e3 == pytest.approx(120) and s["step"]["idle_ms"] * 1e3 == pytest.approx(12)
    assert ph["data"]["idle"]["queued_ms"] * 1e3 == pytest.approx(2)  # launched long before: the device was busy
    bwd = ph["backward"]["idle"]
    assert (bwd["unlinked_ms"] * 1e3, bwd["host_ms"] * 1e3, bwd["queued_ms"] * 1e3) == pytest.approx((1, 5, 2))
    assert {o["name"]: o["ms"] * 1e3 for o in bwd["host_ops"]} == pytest.approx(
        {"autograd::engine::evaluate_function": 5})  # 83-88 on the engine thread, which launched the gemm
    for p in ph.values():  # every idle microsecond has one cause
        idle = p["idle"]
        assert idle["host_ms"] + idle["queued_ms"] + idle["unlinked_ms"] == pytest.approx(p["idle_ms"])
    # the host's own time per phase, and the device work queued when it began each: data begins with the previous
    # step's adam running to 20; forward at 10 with the copy to 24; backward at 50 with the gemm to 80; the step at 90
    # with the backward's nccl to 130
    assert [ph[p]["host_wall_ms"] * 1e3 for p in ph] == pytest.approx([10, 40, 40, 10])
    assert [ph[p]["host_lead_ms"] * 1e3 for p in ph] == pytest.approx([20, 14, 30, 40])
    with pytest.raises(ValueError, match="no kernel was launched inside the profiled step"):
        summarize([kernels[0]], ranges, "cuda", host, main, synced=False)
    from harness.report import format_profiles

    assert "no syncs" in format_profiles({"raw": s}, 9)
    assert format_profiles({"raw": s}, 9).count("host: its own time 0.0, ahead of the device by 0.0") == 4  # us here
    s["phases"]["step"].update(host_wall_ms=12.5, host_lead_ms=-3.25)
    assert "host: its own time 12.5, ahead of the device by -3.2 when the phase began" in format_profiles({"raw": s}, 9)
    mixed = format_profiles({"raw": s, "ceiling": summarize(kernels, ranges, "cuda", host, main)}, 9)
    assert mixed.count("(no sync)") == 1


def test_profile_sync_false_needs_a_profiled_step_and_skips_the_boundary_syncs(monkeypatch):
    from shared.train.config import TrainConfig
    from shared.train.step_profile import StepProfiler

    with pytest.raises(ValueError, match="profile_sync false changes how the profiled step is recorded"):
        TrainConfig(profile_sync=False)
    assert not TrainConfig(steps=4, warmup_steps=2, profile_step=1, profile_sync=False).profile_sync
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    for synced, expected in ((True, 5), (False, 1)):  # begin and every mark, or only after the last mark
        syncs.clear()
        prof = StepProfiler(cuda=True, phases=("data", "forward", "backward", "step"), synced=synced)
        monkeypatch.setattr(torch.profiler, "profile", lambda **kw: _NullProfiler())
        monkeypatch.setattr(prof, "_summarize", lambda: {})
        prof.begin()
        for phase, last in (("data", False), ("forward", False), ("backward", False), ("step", True)):
            prof.phase(phase, last=last)
        assert len(syncs) == expected, synced


class _NullProfiler:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.gpu
def test_profiled_gpu_step_links_every_gap_to_a_launch():
    a = torch.randn(2048, 2048, device="cuda")
    timer = PhaseTimer(torch.device("cuda"), profile_step=1)
    timer.start()
    _steps(timer, 3, work=lambda: (a @ a).relu_().sum().item())
    timer.finish()
    for p in timer.profile["phases"].values():
        idle = p["idle"]
        assert idle["unlinked_ms"] == 0
        assert idle["host_ms"] + idle["queued_ms"] == pytest.approx(p["idle_ms"], abs=1e-6)
    forward = timer.profile["phases"]["forward"]["idle"]
    assert forward["host_ms"] > 0 and any(o["name"].startswith("aten::") for o in forward["host_ops"])


@pytest.mark.gpu
def test_a_gpu_step_profiled_without_syncs_keeps_every_kernel_it_launched():
    a = torch.randn(4096, 4096, device="cuda")
    timer = PhaseTimer(torch.device("cuda"), profile_step=1, profile_sync=False)
    timer.start()
    _steps(timer, 3, work=lambda: [torch.mm(a, a) for _ in range(20)])  # queued: the host runs ahead
    timer.finish()
    p = timer.profile
    assert p["synced"] is False and p["phases"]["forward"]["kernels"] == 20
    # the 20 queued matmuls (~2 ms each) still run when the host begins the backward: it is well ahead
    assert p["phases"]["backward"]["host_lead_ms"] > 1.0
    assert p["phases"]["backward"]["host_wall_ms"] < p["phases"]["backward"]["host_lead_ms"]
    assert p["step"]["wall_ms"] == pytest.approx(sum(ph["wall_ms"] for ph in p["phases"].values()))
    for ph in p["phases"].values():
        idle = ph["idle"]
        assert idle["host_ms"] + idle["queued_ms"] + idle["unlinked_ms"] == pytest.approx(ph["idle_ms"], abs=1e-6)
    assert timer.summary(skip=2)["n"] == 1


def test_python_frames_are_told_from_launches_and_lengthen_the_lists():
    from shared.train.step_profile import PY_FRAME, TOP_HOST, TOP_WITH_STACK, innermost, summarize

    for name in ("deepspeed/runtime/engine.py(2983): forward", "cuda_utils.py(10): launch",
                 "<built-in method item of Tensor object>", "<built-in function isinstance>"):
        assert PY_FRAME.match(name), name
    for name in ("cudaLaunchKernel", "cuLaunchKernelEx", "aten::mm", "dc::allgather_param", "(no operator)"):
        assert not PY_FRAME.match(name), name
    # 12 host calls, each alone in a gap before the next kernel: more than TOP_HOST
    calls = [(f"model.py({i}): f{i}", 10 * i + 1, 10 * i + 9) for i in range(12)]
    kernels = [("gemm", 10 * i + 9, 10 * i + 10, (10 * i + 8, 1)) for i in range(12)]
    for frames in (False, True):
        s = summarize(kernels, [("forward", 0, 120)], "cuda", {1: innermost(calls)}, 1, python_frames=frames)
        listed = s["phases"]["forward"]["idle"]["host_ops"]  # the 12 calls and "(no operator)" before each
        assert len(listed) == (13 if frames else TOP_HOST) and TOP_WITH_STACK >= 13
        assert s.get("python_frames", False) is frames


def test_profile_stack_needs_a_profiled_step():
    from shared.train.config import TrainConfig

    with pytest.raises(ValueError, match="profile_stack records Python frames in the profiled step"):
        TrainConfig(profile_stack=True)
    assert TrainConfig(steps=4, warmup_steps=2, profile_step=1, profile_stack=True).profile_stack


@pytest.mark.gpu
def test_profile_stack_names_the_python_function_the_device_waited_on():
    a = torch.randn(2048, 2048, device="cuda")

    def host_bound_forward():
        for _ in range(200):  # many tiny launches: the device waits on this loop
            a[:1, :1].add_(1)
        return (a @ a).sum().item()

    timer = PhaseTimer(torch.device("cuda"), profile_step=1, profile_stack=True)
    timer.start()
    _steps(timer, 3, work=host_bound_forward)
    timer.finish()
    assert timer.profile["python_frames"] is True
    frames = [o["name"] for o in timer.profile["phases"]["forward"]["idle"]["host_inclusive"]]
    assert any("host_bound_forward" in f for f in frames), frames


def test_the_python_calls_come_from_the_profilers_event_tree():
    import types

    from shared.train.step_profile import StepProfiler
    from shared.train.timing import PHASES

    def host_side_work():
        return torch.ones(8).add_(1)

    sp = StepProfiler(False, PHASES, with_stack=True)
    sp.begin()
    host_side_work()
    sp.phase("data", last=False)
    sp._range.__exit__(None, None, None)
    sp.prof.__exit__(None, None, None)
    calls = [c for c in sp._python_calls() if c[0].endswith(": host_side_work")]
    events = [e for e in sp.prof.events() if e.name.endswith(": host_side_work")]
    assert len(calls) == 1 and calls[0][1] < calls[0][2]
    if events:  # where events() lists Python calls too, both give the same time and thread
        assert calls[0][1:] == pytest.approx((events[0].time_range.start, events[0].time_range.end,
                                              events[0].thread))
    sp.prof = types.SimpleNamespace(profiler=types.SimpleNamespace())  # a profiler without the event tree
    with pytest.warns(UserWarning, match="cannot read the profiler's Python calls"):
        assert sp._python_calls() == []


def test_the_host_lead_is_negative_where_the_device_waited_and_the_least_over_micro_steps():
    from shared.train.step_profile import host_leads

    # two micro-steps; the host begins the second forward 5 us after the device ran dry (a sync, or a slow host)
    ranges = [("forward", 0, 10), ("backward", 10, 20), ("forward", 30, 40), ("backward", 40, 50)]
    kernels = [("gemm", 2, 25, (1, 0)), ("gemm", 41, 60, (31, 0)), ("fill", 0, 1, None)]
    leads = host_leads(kernels, ranges)
    assert leads["forward"]["host_lead_ms"] * 1e3 == pytest.approx(-5)  # min(None at 0 -> the fill: 1 - 0, 25 - 30)
    assert leads["backward"]["host_lead_ms"] * 1e3 == pytest.approx(15)  # min(25 - 10, 60 - 40)
    assert leads["forward"]["host_wall_ms"] * 1e3 == pytest.approx(20)
    assert host_leads([("gemm", 5, 6, (5, 0))], [("data", 0, 10)])["data"]["host_lead_ms"] is None


def test_a_resumed_run_too_short_for_its_profiled_step_profiles_none_and_still_times_a_step():
    from shared.train.config import TrainConfig
    from shared.train.loop import slowed_step_left

    train = TrainConfig(steps=20, warmup_steps=5, profile_step=1)
    left = lambda first: slowed_step_left(train, first, "profile_step")
    assert left(0) == 1 and left(17) == 1  # 3 left: step 2 is timed
    with pytest.warns(UserWarning, match="resumes with 2 step\\(s\\) left, and profiling step 1 of them would leave"):
        assert left(18) is None
    timer = PhaseTimer(torch.device("cpu"), profile_step=left(17))
    timer.start()
    _steps(timer, 3)
    timer.finish()
    assert timer.summary(skip=min(train.warmup_steps, 20 - 17 - 1))["n"] == 1
    assert slowed_step_left(TrainConfig(steps=20, warmup_steps=5), 19, "profile_step") is None  # none asked: none


def test_the_sync_checked_step_is_never_timed_and_a_resumed_run_too_short_for_it_checks_none(monkeypatch):
    from shared.model import config as model_config
    from shared.train.config import TrainConfig
    from shared.train.loop import slowed_step_left

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)  # --sync_check_step is CUDA's
    train = TrainConfig(steps=20, warmup_steps=5, sync_check_step=3)
    assert slowed_step_left(train, 15, "sync_check_step") == 3  # 5 left: step 3 is checked, step 4 timed
    # 4 left: the warm-up excluded is 3 steps, so the checked step 3 would have been the one timed
    with pytest.warns(UserWarning, match="checking the syncs of step 3 of them would leave none to time"):
        assert slowed_step_left(train, 16, "sync_check_step") is None
    timer = PhaseTimer(torch.device("cpu"))
    timer.start()
    _steps(timer, 6)
    timer.finish()
    timer.sync_check_step, timer.syncs = 3, {"total": 0}  # as a CUDA run that checked step 3 records it
    assert timer.summary(skip=2)["n"] == 2  # steps 4 and 5: the checked step is left out like the warm-up


def test_the_progress_lines_step_time_is_the_median_of_the_interval(tmp_path, capsys):
    import csv

    from shared.train.progress import Progress

    timer = PhaseTimer(torch.device("cpu"))
    progress = Progress(4, torch.device("cpu"), timer, flops_per_step_per_gpu=1e12, log_every=2, enabled=True,
                        csv_path=str(tmp_path / "log.csv"), convention="dense-attention formula, k=3, median step")
    for step, totals in enumerate(([0.1, 0.3], [0.1, 0.3, 0.2, 0.6])):
        timer.steps = [{"total": t} for t in totals]  # the steps the timer has resolved by this line
        progress.record(2 * step, torch.tensor(1.0))
        progress.record(2 * step + 1, torch.tensor(1.0))
    progress.finish()
    rows = list(csv.DictReader((tmp_path / "log.csv").read_text().splitlines()))
    # an even interval: the mean of its middle two, as statistics.median (and the result JSON) takes it
    assert [float(r["step_ms"]) for r in rows] == pytest.approx([200.0, 400.0])
    assert [float(r["tflops_per_gpu"]) for r in rows] == pytest.approx([5.0, 2.5])
    lines = capsys.readouterr().out.splitlines()  # the figures' convention, said once before the first of them
    assert lines[0] == ("ms/step: the median of the last 2 steps (warm-up steps too, the first lines); TFLOPs/GPU: "
                        "dense-attention formula, k=3, median step")
    assert len(lines) == 3 and "ms/step" in lines[1] and "TFLOPs/GPU" in lines[2]
