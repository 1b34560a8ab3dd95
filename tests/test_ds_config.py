import base64
import json

import pytest

from shared.train.config import TrainConfig
from shared.train.ds_config import build_ds_config


def test_original_profile_is_the_study_config():
    train = TrainConfig(preset="1.5b", stage=3, precision="bf16", micro_batch=8, zero_profile="original")
    cfg = build_ds_config(train)
    h = 2304
    assert cfg["zero_optimization"] == {
        "stage": 3, "contiguous_gradients": True, "overlap_comm": True, "allgather_partitions": True,
        "reduce_scatter": True, "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["train_micro_batch_size_per_gpu"] == 8 and cfg["gradient_accumulation_steps"] == 1
    assert "timers" not in cfg  # DeepSpeed's (synchronized) throughput timer stays at its default here


def test_the_tuned_profile_is_the_default():
    assert build_ds_config(TrainConfig(preset="1.5b")) == build_ds_config(TrainConfig(preset="1.5b",
                                                                                      zero_profile="tuned"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_builds(stage):
    cfg = build_ds_config(TrainConfig(stage=stage))
    assert cfg["zero_optimization"]["stage"] == stage
    assert ("stage3_prefetch_bucket_size" in cfg["zero_optimization"]) == (stage == 3)


def test_precisions():
    assert build_ds_config(TrainConfig(precision="fp16"))["fp16"]["enabled"] is True
    fp32 = build_ds_config(TrainConfig(precision="fp32"))
    assert "fp16" not in fp32 and "bf16" not in fp32


def test_tuned_profile_turns_off_synchronized_timer_and_grows_buckets():
    cfg = build_ds_config(TrainConfig(preset="1.5b", zero_profile="tuned"))
    zero = cfg["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] >= 4 * 2304 * 2304  # at least one MLP weight
    assert cfg["timers"]["throughput"]["enabled"] is False


def test_user_json_replaces_the_built_dict(tmp_path):
    user = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    cfg = build_ds_config(TrainConfig(ds_config=str(path)))
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["gradient_accumulation_steps"] == 1
    # the commands an autotune winner records are how it was made, not DeepSpeed's: dropped, not refused
    path.write_text(json.dumps({**user, "command": "python compare.py --autotune", "commands": ["python ..."]}))
    assert build_ds_config(TrainConfig(ds_config=str(path))) == cfg
    # DeepSpeed still reads bf16 under its older name "bfloat16": a bf16 run takes it
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bfloat16": {"enabled": True}}))
    assert build_ds_config(TrainConfig(ds_config=str(path)))["bfloat16"] == {"enabled": True}


@pytest.mark.parametrize(
    "content, flags, message",
    [
        ({"zero_optimisation": {"stage": 3}}, {}, r"unknown key\(s\) \['zero_optimisation'\]"),
        ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, {},
         "train_micro_batch_size_per_gpu=4 but the run uses micro_batch=2"),
        ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}}, {}, "enables fp16 but the run asks for bf16"),
        # DeepSpeed's older name for bf16, which it still reads
        ({"zero_optimization": {"stage": 3}, "bfloat16": {"enabled": True}}, {"precision": "fp32"},
         "enables bf16 but the run asks for fp32"),
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, {}, "ZeRO stage 2 but the run asks for 3"),
        ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "gradient_clipping": 0.5}, {},
         r"clips gradients at 0.5 \(gradient_clipping\) but the run asks for --grad_clip 1.0; .* --grad_clip 0.5"),
        ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, {"grad_clip": 0.3},
         r"at 0.0 \(gradient_clipping absent: DeepSpeed does not clip\) but the run asks for --grad_clip 0.3"),
        ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, {"reduce_bucket_size": 1000},
         "--reduce_bucket_size has no effect with --ds_config .*: set zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, {"param_persistence_threshold": 7},
         "set zero_optimization.stage3_param_persistence_threshold in the JSON instead"),
        ("[1, 2]", {}, "must hold a JSON object"),
        # DeepSpeed's deprecated boolean form once failed here with an AttributeError's traceback
        ({"zero_optimization": True, "bf16": {"enabled": True}}, {}, "zero_optimization must be a JSON object"),
        ({"zero_optimization": {"stage": 3}, "bf16": True}, {}, "bf16 must be a JSON object .*got true"),
        ("{not json", {}, "not valid JSON"),
        ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "torch_autocast": {"enabled": True}}, {},
         "enables torch_autocast, which runs the forward in another precision than the run's --precision bf16"),
    ],
)
def test_user_json_errors(tmp_path, content, flags, message):
    path = tmp_path / "ds.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=message):
        build_ds_config(TrainConfig(ds_config=str(path), **flags))
    with pytest.raises(ValueError, match="does not exist"):
        build_ds_config(TrainConfig(ds_config=str(tmp_path / "nope.json")))
    long = tmp_path / ("d" * 90) / "nope.json"  # a missing file is named in full, however long its path
    with pytest.raises(ValueError, match=f"{long}' does not exist"):
        build_ds_config(TrainConfig(ds_config=str(long)))


BASE_JSON = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


@pytest.mark.parametrize("batch, flags, world, message", [
    # DeepSpeed would assert train_batch_size == micro x accumulation x world size inside deepspeed.initialize
    ({"train_batch_size": 32}, {}, 2, r"sets train_batch_size=32, but the run's --micro_batch 2 x --grad_accum 1 x 2 "
     r"process\(es\) = 4 .*: pass --micro_batch 16 or --grad_accum 8, or remove train_batch_size from the JSON"),
    # the JSON fixes the accumulation: only the micro-batch flag can make it hold
    ({"train_batch_size": 8, "gradient_accumulation_steps": 1}, {}, 1, r"= 2 .*: pass --micro_batch 8, or remove"),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}, {}, 2, r"= 4 .*world size\): remove "
     "train_batch_size from the JSON"),
    ({"gradient_accumulation_steps": 4}, {}, 1, "sets gradient_accumulation_steps=4 but the run uses grad_accum=1; "
     "pass --grad_accum 4 or remove the key"),
    ({"train_batch_size": "auto"}, {}, 1, 'train_batch_size must be a positive whole number, got "auto"'),
    ({"train_micro_batch_size_per_gpu": 0}, {}, 1, "train_micro_batch_size_per_gpu must be a positive whole number"),
    ({"gradient_accumulation_steps": 1.5}, {}, 1, "gradient_accumulation_steps must be a positive whole number"),
])
def test_a_user_jsons_batch_sizes_must_agree_with_the_flags_and_the_world_size(tmp_path, batch, flags, world,
                                                                                message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE_JSON, **batch}))
    with pytest.raises(ValueError, match=message):
        build_ds_config(TrainConfig(ds_config=str(path), **flags), world)


def test_a_user_jsons_batch_sizes_that_agree_are_taken(tmp_path):
    path = tmp_path / "ds.json"
    for batch, world in [({"train_batch_size": 8}, 2), ({"train_batch_size": 8.0, "gradient_accumulation_steps": 2,
                                                         "train_micro_batch_size_per_gpu": 2}, 2),
                         ({"train_batch_size": None}, 2), ({"train_batch_size": 32}, None)]:  # world unknown
        path.write_text(json.dumps({**BASE_JSON, **batch}))
        cfg = build_ds_config(TrainConfig(ds_config=str(path), grad_accum=2), world)
        assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 2, batch


def test_user_json_as_base64_text_as_deepspeeds_autotuner_passes_it(tmp_path):
    user = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    text = base64.urlsafe_b64encode(json.dumps(user).encode()).decode()
    assert build_ds_config(TrainConfig(ds_config=text))["zero_optimization"] == {"stage": 3}
    with pytest.raises(ValueError, match=r"\(given as base64 text\) sets ZeRO stage 3 but the run asks for 2"):
        build_ds_config(TrainConfig(ds_config=text, stage=2))
    # neither a file nor base64 of a JSON object: the message says both
    for junk in ("bm90IGpzb24=", "x" * 600):
        with pytest.raises(ValueError, match="does not exist .*not base64 of a JSON object") as e:
            build_ds_config(TrainConfig(ds_config=junk))
        assert len(str(e.value)) < 200  # a long blob is shortened in the message
    with pytest.raises(ValueError, match="is not a file"):
        build_ds_config(TrainConfig(ds_config=str(tmp_path)))


def test_autotuning_experiment_must_run_past_its_profile_steps():
    user = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
            "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 4}}
    text = base64.urlsafe_b64encode(json.dumps(user).encode()).decode()
    assert build_ds_config(TrainConfig(ds_config=text, steps=5, warmup_steps=2))["autotuning"]["enabled"]
    with pytest.raises(ValueError, match="end_profile_step=4; --steps 4 ends before it: pass --steps 5"):
        build_ds_config(TrainConfig(ds_config=text, steps=4, warmup_steps=2))
    # its model-info run stops in the first forward: any --steps will do
    user["autotuning"]["model_info"] = {"profile": True}
    text = base64.urlsafe_b64encode(json.dumps(user).encode()).decode()
    assert build_ds_config(TrainConfig(ds_config=text, steps=2, warmup_steps=1))
    for bad in (None, "5", -1):
        user["autotuning"] = {"enabled": True, "end_profile_step": bad}
        text = base64.urlsafe_b64encode(json.dumps(user).encode()).decode()
        with pytest.raises(ValueError, match=f"end_profile_step must be a non-negative integer, got {bad!r}"):
            build_ds_config(TrainConfig(ds_config=text))


def test_lightning_refuses_an_autotuning_config_before_anything_else():
    from lightning_app.train import lightning_ds_config

    user = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
            "autotuning": {"enabled": True, "end_profile_step": 5}}
    text = base64.urlsafe_b64encode(json.dumps(user).encode()).decode()
    # --steps 4 would also be refused for the raw loop; Lightning says first that it is the wrong path
    with pytest.raises(ValueError, match="DeepSpeed's autotuner drives the raw loop"):
        lightning_ds_config(TrainConfig(ds_config=text, steps=4, warmup_steps=2))
    user["autotuning"] = None  # no section: an ordinary user JSON
    text = base64.urlsafe_b64encode(json.dumps(user).encode()).decode()
    assert lightning_ds_config(TrainConfig(ds_config=text))["zero_optimization"] == {"stage": 3}


def test_a_user_json_with_the_runs_clipping_is_taken_and_the_breakdown_diagnostic_applies(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "gradient_clipping": 0.5}))
    assert build_ds_config(TrainConfig(ds_config=str(path), grad_clip=0.5))["gradient_clipping"] == 0.5
    assert "wall_clock_breakdown" not in build_ds_config(TrainConfig(ds_config=str(path), grad_clip=0.5))
    assert build_ds_config(TrainConfig(ds_config=str(path), grad_clip=0.5, wall_clock_breakdown=True))[
        "wall_clock_breakdown"] is True


def test_lightnings_clipping_overhead_takes_a_user_json_without_clipping(tmp_path):
    from lightning_app.train import lightning_ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    cfg = lightning_ds_config(TrainConfig(ds_config=str(path), lightning_overheads="pl_grad_clip"))
    assert "gradient_clipping" not in cfg and cfg["zero_optimization"] == {"stage": 3}
