"""The fast ZeRO-3 optimizer step (shared/train/zero3_step.py) against DeepSpeed's own, on CPU (gloo)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from shared.train.config import TrainConfig
from shared.train.zero3_step import _flat_region
from tests.helpers import FAST, RAW, ROOT, load, run, torchrun


def test_flat_region_is_the_buffer_span_that_the_views_tile_in_order():
    buffer = torch.arange(10.0)
    views = [buffer.narrow(0, 2, 3), buffer.narrow(0, 5, 4)]
    assert torch.equal(_flat_region(buffer, views), buffer[2:9])
    assert _flat_region(buffer, views[::-1]) is None  # out of order
    assert _flat_region(buffer, [buffer.narrow(0, 0, 2), buffer.narrow(0, 3, 2)]) is None  # a gap
    assert _flat_region(buffer, [views[0], views[1].clone()]) is None  # another storage
    assert _flat_region(buffer.to(torch.bfloat16), views) is None  # another dtype
    assert _flat_region(None, views) is None and _flat_region(buffer, []) is None


def test_zero3_step_flag_is_validated():
    with pytest.raises(ValueError, match="unknown zero3_step 'quick'"):
        TrainConfig(zero3_step="quick")


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """tests/zero3_step_check.py's figures, one 2-rank run for the tests below."""
    out = tmp_path_factory.mktemp("zero3_step") / "check.json"
    torchrun(ROOT / "tests" / "zero3_step_check.py", 2, [out], timeout=300)
    return load(out)


def test_fast_step_matches_deepspeeds_norm_and_fp32_grads_on_two_ranks(check):
    r = check
    assert r["world"] == 2 and r["n_groups"] >= 1
    for ds, fast in zip(r["ds_norms"], r["fast_norms"], strict=True):
        assert ds > 0 and math.isclose(fast, ds, rel_tol=1e-5), (fast, ds)  # fp32 vs fp64 accumulation
    assert all(r["same_fp32"])  # the same fp32 gradient, in its own memory
    assert r["calls_direct"] == {"fast": 2 * r["n_groups"], "deepspeed": 0, "unscale_fused": 0, "unscale_deepspeed": 0}
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
        assert fast["calls"]["unscale_fused"] == 3 * 2 and fast["calls"]["unscale_deepspeed"] == 0  # 3 steps, 2 groups
        assert ds["calls"] is None and not fast["grad_scale_left"]
        if clip == "0":  # a scale of 1: dividing by it inside the optimizer is exact
            assert fast["losses"] == ds["losses"] and fast["checksum"] == ds["checksum"]
        else:  # clipping: the kernel divides by the scale, DeepSpeed multiplies by its reciprocal (1 ulp apart)
            assert all(n > 0.05 for n in ds["norms"]), ds["norms"]
            assert fast["losses"] == pytest.approx(ds["losses"], rel=1e-6)
            assert fast["checksum"]["sum_sq"] == pytest.approx(ds["checksum"]["sum_sq"], rel=1e-6)
            assert fast["checksum"]["sum_sq"] != fused["fast_clip0"]["checksum"]["sum_sq"]  # the clip did act


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
    for a, b in zip(f["grad_norms"], d["grad_norms"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4), (a, b)
    assert f["losses"] == pytest.approx(d["losses"], rel=1e-4)


FAST_STEPS = int(FAST[FAST.index("--steps") + 1])
