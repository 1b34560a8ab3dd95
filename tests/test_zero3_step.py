"""The fast ZeRO-3 optimizer step (shared/patches/zero3_step.py) against DeepSpeed's own, on CPU (gloo)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from shared.patches import PATCHES
from shared.patches.zero3_step import _flat_region
from shared.train.config import TrainConfig
from tests.helpers import FAST, GPU_BASE, LIGHTNING, RAW, ROOT, load, run, torchrun
from tests.helpers import env as run_env


def test_flat_region_is_the_buffer_span_that_the_views_tile_in_order():
    buffer = torch.arange(10.0)
    views = [buffer.narrow(0, 2, 3), buffer.narrow(0, 5, 4)]
    assert torch.equal(_flat_region(buffer, views), buffer[2:9])
    assert _flat_region(buffer, views[::-1]) is None  # out of order
    assert _flat_region(buffer, [buffer.narrow(0, 0, 2), buffer.narrow(0, 3, 2)]) is None  # a gap
    assert _flat_region(buffer, [views[0], views[1].clone()]) is None  # another storage
    assert _flat_region(buffer.to(torch.bfloat16), views) is None  # another dtype
    assert _flat_region(None, views) is None and _flat_region(buffer, []) is None
    assert _flat_region(buffer, [None, views[1]]) is None  # a parameter without a gradient
    # the same storage but outside the buffer's span: not a region of it (before, the wrong span or an error)
    storage = torch.arange(12.0)
    assert _flat_region(storage[4:8], [storage[0:2], storage[2:4]]) is None
    assert _flat_region(storage[4:8], [storage[6:8], storage[8:10]]) is None
    assert torch.equal(_flat_region(storage[4:8], [storage[5:7]]), storage[5:7])


def test_zero3_step_flag_is_validated():
    with pytest.raises(ValueError, match="unknown zero3_step 'quick'"):
        TrainConfig(zero3_step="quick")


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """tests/zero3_step_check.py's figures, one 2-rank run for the tests below (its equivalence runs train on KJV's
    bytes)."""
    from shared.tools.prepare_data import prepare

    folder = tmp_path_factory.mktemp("zero3_step")
    prepare(ROOT / "data" / "kjv.txt", folder / "kjv", "byte")
    out = folder / "check.json"
    torchrun(ROOT / "tests" / "zero3_step_check.py", 2, [out, folder / "kjv"], timeout=540)
    return load(out)


STEPS = 6  # each equivalence run of tests/zero3_step_check.py (its EQUIV): 6 steps at lr 1e-3
SKIPPED = 1  # the step whose update the norm-check runs make invalid (inf_at)


def assert_trains(r: dict) -> None:
    """The run's loss fell: an equivalence of runs that do not train says little (tests/zero3_step_check.EQUIV)."""
    assert len(r["losses"]) == STEPS and r["losses"][-1] < r["losses"][0] - 0.1, r["losses"]


def assert_moments_close(gaps: list[dict], rel: float) -> None:
    """Per sub-group (tests/zero3_step_check.moments_gap): the same step count, and exp_avg and exp_avg_sq within
    `rel` of the reference's largest magnitude (0: bit for bit)."""
    for g in gaps:
        assert g["step"][0] == g["step"][1], g
        for k in ("exp_avg", "exp_avg_sq"):
            assert g[k]["finite"] and g[k]["max_abs"] > 0, (k, g)
            assert g[k]["max_diff"] <= rel * g[k]["max_abs"], (k, g)


def assert_weight_deltas_close(gap: dict, rel: float) -> None:
    """Two runs from the same 16-bit weights changed them by the same amount, element by element, up to `rel` of the
    reference's change (tests/zero3_step_check.weights_gap): a step that never writes its weights is a whole change
    off."""
    assert gap["same_start"] and gap["delta_norm"] > 0, gap
    assert gap["diff_norm"] <= rel * gap["delta_norm"], gap


# The bf16 AdamW kernel against the fast step (torch's AdamW and DeepSpeed's copy): Triton's interpreter truncates the
# bf16 copy where DeepSpeed rounds it, so from the second step on the two runs take their gradients at weights up to
# 1 ulp apart. Measured: weight changes 4% apart, Adam moments 1% of their largest magnitude apart (KJV, 6 steps).
BF16_KERNEL_DELTA_REL = 0.2
BF16_KERNEL_MOMENTS_REL = 0.05


def test_fast_step_matches_deepspeeds_norm_and_fp32_grads_on_two_ranks(check):
    r = check
    assert r["world"] == 2 and r["n_groups"] >= 1
    for ds, fast in zip(r["ds_norms"], r["fast_norms"], strict=True):
        assert ds > 0 and math.isclose(fast, ds, rel_tol=1e-5), (fast, ds)  # fp32 vs fp64 accumulation
    assert all(r["same_fp32"])  # the same fp32 gradient, in its own memory
    assert r["calls_direct"] == {"fast": 2 * r["n_groups"], "deepspeed": 0, "unscale_fused": 0, "unscale_deepspeed": 0}
    assert r["inf_norm"] == -1.0  # DeepSpeed's mark of an inf/NaN norm, as its own norm gives
    assert math.isclose(r["fallback_norm"], r["ds_norms"][0], rel_tol=1e-12)
    assert r["calls_fallback"]["deepspeed"] == 1
    # engine.step() ran the fast norm and copy, and clipped with the same global norm
    assert r["calls_step"]["fast"] == r["calls_fallback"]["fast"] + 2 * r["n_groups"]
    assert r["calls_step"]["deepspeed"] == 1
    # a non-fused AdamW (CPU's default) cannot take the scale: DeepSpeed's multiply, once per sub-group
    assert r["calls_step"]["unscale_deepspeed"] == r["n_groups"] and r["calls_step"]["unscale_fused"] == 0
    assert math.isclose(r["step_norm"], math.sqrt(sum(n * n for n in r["ds_norms"])), rel_tol=1e-5)
    assert math.isfinite(r["next_loss"])


def test_the_fused_adamw_takes_the_unscale_and_trains_like_deepspeeds_multiply(check):
    fused = check["fused"]
    for clip in ("0", "0.05"):
        fast, ds = fused[f"fast_clip{clip}"], fused[f"deepspeed_clip{clip}"]
        assert fast["calls"]["unscale_fused"] == STEPS * 2 and fast["calls"]["unscale_deepspeed"] == 0  # 2 groups
        assert ds["calls"] is None and not fast["grad_scale_left"]
        assert_trains(fast)
        assert_trains(ds)
        if clip == "0":  # a scale of 1: dividing by it inside the optimizer is exact
            assert fast["losses"] == ds["losses"] and fast["checksum"] == ds["checksum"]
            assert_moments_close(check["moments"]["deepspeed_clip0"], 0.0)  # Adam's moments, bit for bit
            assert_weight_deltas_close(check["weights"]["deepspeed_clip0"], 0.0)
        else:  # clipping: the kernel divides by the scale, DeepSpeed multiplies by its reciprocal (1 ulp apart)
            assert all(n > 0.05 for n in ds["norms"]), ds["norms"]
            # 1 ulp apart, which 6 training steps carry through the bf16 roundings of the weights: measured 5e-6
            assert fast["losses"] == pytest.approx(ds["losses"], rel=2e-5)
            assert fast["checksum"]["sum_sq"] == pytest.approx(ds["checksum"]["sum_sq"], rel=1e-6)
            assert fast["checksum"]["sum_sq"] != fused["fast_clip0"]["checksum"]["sum_sq"]  # the clip did act
            # the 1-ulp scales part bf16 roundings of the weights, which the later gradients carry: measured 0.7%
            assert_moments_close(check["moments"]["deepspeed_clip0.05"], 0.02)
            assert_weight_deltas_close(check["weights"]["deepspeed_clip0.05"], 0.05)


def test_the_adamw_kernel_trains_like_torchs_fused_adamw_and_keeps_its_state(check):
    """--zero3_step fused: the AdamW kernel (Triton's interpreter here) in place of the fp32 gradient copy, torch's
    AdamW and the parameter copy; the same training, and the optimizer state torch's AdamW would have saved."""
    fused = check["fused"]
    for precision in ("", "fp32_"):
        for clip in ("0", "0.05"):
            kernel, fast = fused[f"{precision}fused_clip{clip}"], fused[f"{precision}fast_clip{clip}"]
            calls = kernel["calls"]
            assert calls["adamw_kernel"] == STEPS * 2 and calls["own_optimizer"] == 0  # 2 sub-groups
            assert calls["unscale_fused"] == STEPS * 2 and calls["unscale_deepspeed"] == 0
            assert not kernel["grad_scale_left"]
            assert kernel["state"] == fast["state"]  # step, exp_avg, exp_avg_sq per sub-group, as torch keeps them
            assert_trains(kernel)
            name = f"{precision}fused_clip{clip}"
            if precision:  # fp32: the same update up to the order of fp32 operations (measured: 4e-7)
                assert kernel["losses"] == pytest.approx(fast["losses"], rel=1e-6)
                assert kernel["norms"] == pytest.approx(fast["norms"], rel=1e-6)
                assert kernel["checksum"]["sum_sq"] == pytest.approx(fast["checksum"]["sum_sq"], rel=1e-6)
                assert_moments_close(check["moments"][name], 1e-5)
                assert_weight_deltas_close(check["weights"][name], 1e-4)
            else:  # bf16: the interpreter truncates the bf16 copy where a GPU rounds it (tests/test_adamw_kernel.py)
                assert kernel["losses"] == pytest.approx(fast["losses"], rel=1e-3)
                # the change of the weights, not their checksum: 6 steps move that by less than the truncation does
                assert_weight_deltas_close(check["weights"][name], BF16_KERNEL_DELTA_REL)
                assert_moments_close(check["moments"][name], BF16_KERNEL_MOMENTS_REL)
        assert fused[f"{precision}fused_clip0"]["checksum"] != fused[f"{precision}fused_clip0.05"]["checksum"]


def test_a_fused_step_that_never_writes_the_weights_fails_the_comparison_of_weight_changes():
    """The bf16 kernel-against-fast comparison (BF16_KERNEL_DELTA_REL) on made-up weights: a kernel that truncates
    where DeepSpeed's copy rounds passes; one that never writes the 16-bit weights, whose checksum 3 warm-up steps
    moved by 2e-5 of itself (inside the former rel 1e-2), fails."""
    from tests.zero3_step_check import weights_gap

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(20000, generator=gen) * 0.02
    start = master.to(torch.bfloat16)
    update = torch.randn(20000, generator=gen).sign() * 1e-3  # Adam's steps are about lr each, 6 of them
    moved = master + 6 * update
    rounded = moved.to(torch.bfloat16)  # DeepSpeed's copy
    truncated = (moved.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)  # the interpreter's
    fast = [start.float(), rounded.float()]
    assert_weight_deltas_close(weights_gap([start.float(), truncated.float()], fast), BF16_KERNEL_DELTA_REL)
    with pytest.raises(AssertionError):
        assert_weight_deltas_close(weights_gap([start.float(), start.float()], fast), BF16_KERNEL_DELTA_REL)


def test_the_norm_check_on_the_device_skips_an_invalid_update_like_deepspeeds_host_check(check):
    """--grad_norm_check device: an inf (or NaN) gradient before step 2's update (rank 0 only: the norm's all-reduce
    carries it) leaves every parameter and Adam's moments as DeepSpeed's host check does, with the AdamW kernel, torch's
    fused AdamW (found_inf) and, read on the host, a non-fused AdamW; the engine does not learn of the skip (its
    schedule advances, so the runs part after the skipped step)."""
    runs, moments = check["norm_check"], check["moments"]
    for mode in ("fused", "fast", "unfused", "nan_fused", "nan_fast"):
        host, device = runs[f"{mode}_host"], runs[f"{mode}_device"]
        assert host["calls"] is not None and "norm_check_device" not in host["calls"]
        calls = device["calls"]
        assert calls["norm_check_device"] == STEPS and calls["norm_check_host"] == 0 and calls["norm_skipped"] == 1
        assert calls["norm_check_sync"] == (STEPS * 2 if mode == "unfused" else 0)  # 2 sub-groups
        assert not device["grad_scale_left"] and not device["found_inf_left"]
        for check_name, r in (("host", host), ("device", device)):
            assert all(math.isfinite(n) == (i != SKIPPED) for i, n in enumerate(r["norms"])), r["norms"]
            assert r["checksums"][SKIPPED] == r["checksums"][SKIPPED - 1]  # the update of step 2 changed nothing
            assert_moments_close(moments[f"norm_check_{mode}_{check_name}_skip"], 0.0)  # nor Adam's moments
            assert r["checksums"][-1] != r["checksums"][SKIPPED]  # the steps after it trained
        # the same up to the first update after the skip, whose LR the schedules give differently
        assert device["checksums"][:SKIPPED + 1] == host["checksums"][:SKIPPED + 1]
        assert device["losses"][:SKIPPED + 2] == host["losses"][:SKIPPED + 2]
        assert_moments_close(moments[f"norm_check_{mode}_device_vs_host"], 0.0)
        assert device["state"] == host["state"]  # torch's step counts: one update fewer than steps, on both
        assert all(st[1] == STEPS - 1 for st in device["state"]), device["state"]
        assert host["skipped_steps"] == 1 and device["skipped_steps"] == 0
        assert device["lrs"][SKIPPED] != host["lrs"][SKIPPED]  # the device path's schedule advanced over the skip
    for name in ("fused_host", "fused_device", "fast_host", "fast_device"):  # a NaN is skipped as an inf is
        nan, inf = runs[f"nan_{name}"], runs[name]
        assert nan["checksums"] == inf["checksums"] and nan["losses"] == inf["losses"] and nan["lrs"] == inf["lrs"]
        assert_moments_close(moments[f"norm_check_nan_vs_inf_{name}"], 0.0)
    finite_device, finite_host = runs["fused_device_finite"], runs["fused_host_finite"]
    assert finite_device["calls"]["norm_skipped"] == 0 and finite_device["skipped_steps"] == 0
    assert finite_device["checksums"] == finite_host["checksums"] and finite_device["norms"] == finite_host["norms"]
    assert_moments_close(moments["norm_check_finite"], 0.0)
    assert_trains(finite_device)


def test_the_step_writes_the_updated_master_weights_into_the_16bit_parameters(check):
    """What DeepSpeed's _reassign_or_swap_out_partitioned_parameters does in the step, and the fast step's wrapper of
    it must still do: copy the updated fp32 master partition into the 16-bit one the parameters are. After every
    step of every run the 16-bit weights are the master's rounded to nearest (DeepSpeed's copy) or, the AdamW kernel
    in Triton's interpreter, truncated (within 1 ulp); and most of them moved."""
    for name, r in check["fused"].items():
        assert all(r["lp_within_ulp"]), name
        if not name.startswith(("fused", "fp32_")):  # the bf16 copy of DeepSpeed's step (fast, deepspeed)
            assert all(r["lp_rounds_master"]), name
        assert min(r["lp_moved"]) > 0.5, (name, r["lp_moved"])  # lr 1e-3: most weights move past their rounding


def test_the_norm_check_flag_is_validated():
    with pytest.raises(ValueError, match="unknown grad_norm_check 'gpu'"):
        TrainConfig(grad_norm_check="gpu")
    with pytest.raises(ValueError, match="needs --stage 3 and --zero3_step fast or fused"):
        TrainConfig(grad_norm_check="device", stage=2)
    with pytest.raises(ValueError, match="needs --stage 3 and --zero3_step fast or fused"):
        TrainConfig(grad_norm_check="device", zero3_step="deepspeed")
    with pytest.raises(ValueError, match="cannot be used with --precision fp16"):
        TrainConfig(grad_norm_check="device", precision="fp16")


def test_without_the_eager_persistent_list_the_step_leaves_nothing_gathered(check):
    """Under DeepCompile (persistence off), eager ZeRO-3's persistent list made each step gather those parameters,
    which the next forward then partitioned again; drop_eager_persistent empties it (the run JSON records how many:
    tests/test_deepcompile.py)."""
    r = check["eager_persist"]
    assert r["listed"] > 0  # the tiny preset's biases and LayerNorm weights are under its persistence threshold
    assert "still persistent" in r["refusal"] and r["kept_after_refusal"] == r["listed"]  # refused, nothing lost
    assert r["gathered_after_step"] == [r["listed"], 0]
    assert r["dropped"] == r["listed"] and r["left"] == 0 and r["offload_left"] == 0  # one list, shared
    assert all(math.isfinite(v) for v in r["losses"])


def test_cached_walks_release_and_mark_what_deepspeeds_walks_do(check):
    r = check["cached_walks"]
    assert "lacks" in r["refusal"]  # no DeepCompile fallback context to replace: refused
    assert r["recorded"] == {"modules": r["n_modules"], "parameters": r["n_params"]}  # what the run JSON reports
    assert r["walks_when_partitioned"] == 0  # nothing gathered: DeepSpeed's walk of the tree is skipped
    assert len(r["gathered_before"]) == 2 and r["walk"] == {"walks": 1, "gathered_after": []}  # gathered: it runs
    ds, cached = r["contexts"]["deepspeed"], r["contexts"]["cached"]
    assert ds == cached and ds["released"] == r["expected_released"] and ds["gathered_after"] == []
    assert ds["in_forward_inside"] == [True] and ds["in_forward_after"] == [False]
    assert math.isfinite(r["loss"]) and r["gathered_after_step"] == []


def test_eager_persist_flag_is_validated():
    with pytest.raises(ValueError, match="unknown deepcompile_eager_persist 'keep'"):
        TrainConfig(deepcompile_eager_persist="keep")


def test_the_raw_path_runs_the_fast_step_by_default_records_it_and_trains_like_deepspeeds(tmp_path):
    """(Lightning against the raw path, counts included: tests/test_lightning.py)"""
    fast, ds = tmp_path / "fast.json", tmp_path / "ds.json"
    run([sys.executable, RAW, *FAST, "--out", fast])
    run([sys.executable, RAW, *FAST, "--zero3_step", "deepspeed", "--out", ds])
    f, d = load(fast), load(ds)
    assert f["train"]["zero3_step"] == "fast" and d["train"]["zero3_step"] == "deepspeed"
    assert f["extra"]["zero3_step_calls"]["deepspeed"] == 0
    # one norm and one fp32 copy per sub-group (tiny: 2, the decayed and the undecayed parameters) per step
    assert f["extra"]["zero3_step_calls"]["fast"] == 2 * 2 * FAST_STEPS
    assert d["extra"]["zero3_step_calls"] is None
    # what each process replaced of DeepSpeed's (shared/patches): the step's group, or nothing
    assert f["extra"]["patches"] == sorted(p.target for p in PATCHES if p.group == "zero3_step")
    assert d["extra"]["patches"] == []
    for a, b in zip(f["grad_norms"], d["grad_norms"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4), (a, b)
    assert f["losses"] == pytest.approx(d["losses"], rel=1e-4)


FAST_STEPS = int(FAST[FAST.index("--steps") + 1])


def test_both_paths_run_the_fused_step_and_a_cpu_without_the_interpreter_refuses_it(tmp_path):
    """Both paths with the fused step, the norm check on the host and on the device (--grad_norm_check device)."""
    for script, name in ((RAW, "raw"), (LIGHTNING, "pl")):  # conftest: TRITON_INTERPRET=1
        for check in ("host", "device"):
            run([sys.executable, script, *FAST, "--zero3_step", "fused", "--grad_norm_check", check,
                 "--out", tmp_path / f"{name}_{check}.json"])
    raw, pl = load(tmp_path / "raw_host.json"), load(tmp_path / "pl_host.json")
    for r in (raw, pl):
        assert r["train"]["zero3_step"] == "fused"
        calls = r["extra"]["zero3_step_calls"]
        assert calls["adamw_kernel"] == 2 * FAST_STEPS and calls["own_optimizer"] == 0 and calls["deepspeed"] == 0
    assert all(math.isfinite(v) for v in raw["losses"]) and pl["losses"] == raw["losses"]
    for name, host in (("raw", raw), ("pl", pl)):
        device = load(tmp_path / f"{name}_device.json")
        assert device["train"]["grad_norm_check"] == "device" and host["train"]["grad_norm_check"] == "host"
        calls = device["extra"]["zero3_step_calls"]
        assert calls["norm_check_device"] == FAST_STEPS and calls["norm_skipped"] == 0
        assert calls["norm_check_host"] == 0 and calls["norm_check_sync"] == 0
        assert calls["adamw_kernel"] == 2 * FAST_STEPS
        assert device["losses"] == host["losses"] and device["grad_norms"] == host["grad_norms"]
    env = {k: v for k, v in run_env().items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, RAW, *FAST, "--zero3_step", "fused", "--out", tmp_path / "cpu.json"],
                          capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode != 0 and "zero3_step 'fused' runs its AdamW kernel in Triton" in proc.stderr
    assert not (tmp_path / "cpu.json").exists()


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", [RAW, LIGHTNING], ids=["raw", "lightning"])
def test_gpu_fused_step_trains_like_the_fast_step(tmp_path, script):
    """bf16 on a GPU, each path: the AdamW kernel reads the bf16 gradient partition and writes the bf16 parameters;
    the run trains as the fast step's (torch's fused AdamW and DeepSpeed's copies) up to rounding."""
    from shared.tools.prepare_data import prepare

    data = tmp_path / "kjv"
    prepare(ROOT / "data" / "kjv.txt", data, "byte")
    base = [*GPU_BASE, "--data", data, "--steps", "20", "--warmup_steps", "5", "--compile", "none",
            "--grad_clip", "1.0"]
    runs = {}
    for mode in ("fast", "fused"):
        out = tmp_path / f"{mode}.json"
        torchrun(script, 1, [*base, "--zero3_step", mode, "--out", out], timeout=400)  # two runs: 800 s
        runs[mode] = load(out)
    fast, fused = runs["fast"], runs["fused"]
    calls = fused["extra"]["zero3_step_calls"]
    assert calls["adamw_kernel"] == 2 * 20 and calls["own_optimizer"] == 0 and calls["deepspeed"] == 0
    print("losses fast/fused:", fast["losses"], fused["losses"])
    assert fused["losses"][0] == fast["losses"][0]  # the same first forward
    assert max(abs(a - b) for a, b in zip(fast["losses"], fused["losses"], strict=True)) < 2e-2
    assert fused["losses"][-1] < fused["losses"][0] - 1.0
    assert fused["param_checksum"]["sum_sq"] == pytest.approx(fast["param_checksum"]["sum_sq"], rel=1e-3)
