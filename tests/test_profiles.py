"""Speed profiles (shared/train/profiles.py): one table every entry point reads, its rules as data, a flag the user
gives overriding its one setting, and the profile's name in the config every run JSON records."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from shared.model import config as model_config
from shared.train import profiles
from shared.train.config import TrainConfig
from tests.helpers import ROOT, env

FAST = profiles.PROFILES["fast"]


@pytest.fixture
def pretend_gpus(monkeypatch):
    """compare.parse on a machine with 2 H200s (nothing is launched: parse only builds and checks the config)."""
    import compare

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    monkeypatch.setattr(compare.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compare.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(compare, "gpu_memory_gib", lambda: 139.8)  # an H200's, where the profile was measured
    monkeypatch.setattr(compare, "check_before_start", lambda *a, **k: None)
    monkeypatch.setattr(compare, "check_overheads", lambda *a, **k: None)
    return compare


@pytest.fixture
def pretend_cuda(monkeypatch):
    """TrainConfig's CUDA checks answer yes: the settings are validated as on a GPU."""
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)


def resolve(name="fast", gpus=1, memory=139.8, **given):
    return profiles.resolve(given, name, cuda=True, gpus=gpus, gpu_memory_gib=memory)


def test_every_profile_sets_only_speed_fields_that_trainconfig_has():
    fields = set(TrainConfig.__dataclass_fields__)
    assert set(profiles.SPEED_FIELDS) <= fields
    for p in profiles.PROFILES.values():
        assert set(p.settings) <= set(profiles.SPEED_FIELDS), p.name
        for rule in p.rules:
            assert set(rule.set) <= set(profiles.SPEED_FIELDS), rule
            assert rule.use is None or rule.use in profiles.PROFILES, rule
            assert all(w in fields or w in ("gpus", "cuda", "gpu_memory_gib") for w, _, _ in rule.when), rule
            assert all(op in profiles.OPS for _, op, _ in rule.when), rule


def test_fast_is_deepcompile_once_with_the_fused_step_and_the_models_triton_kernels(pretend_cuda):
    r = resolve()
    assert r.used == "fast" and r.rules == [] and r.note == ""
    cfg = TrainConfig(preset="1.5b", **r.filled)
    assert (cfg.compile, cfg.deepcompile_schedule, cfg.micro_batch, cfg.zero3_step) == ("deepcompile", "once", 16,
                                                                                          "fused")
    assert cfg.coordinate_descent_tuning and cfg.triton_gelu_grad and cfg.triton_loss and cfg.triton_dropout
    assert (cfg.vocab_multiple, cfg.deepcompile_backward_wait, cfg.grad_norm_check) == (128, "device", "device")


def test_stock_is_deepspeeds_own_deepcompile_and_step_with_no_kernel_of_this_project(pretend_cuda):
    cfg = TrainConfig(preset="1.5b", **resolve("stock").filled)
    assert (cfg.compile, cfg.deepcompile_schedule, cfg.zero3_step, cfg.grad_norm_check) == (
        "deepcompile", "deepspeed", "deepspeed", "host")
    assert (cfg.deepcompile_persist, cfg.deepcompile_eager_persist, cfg.deepcompile_cached_walks) == (
        "deepspeed", "deepspeed", False)
    assert not (cfg.triton_loss or cfg.triton_dropout or cfg.triton_gelu_grad or cfg.coordinate_descent_tuning)
    assert cfg.micro_batch == TrainConfig.micro_batch  # no micro-batch of its own: the run's


def test_a_flag_the_user_gives_overrides_its_one_setting():
    r = resolve(coordinate_descent_tuning=False, micro_batch=4)
    assert "coordinate_descent_tuning" not in r.filled and "micro_batch" not in r.filled
    assert r.filled["compile"] == "deepcompile" and r.filled["zero3_step"] == "fused"


@pytest.mark.parametrize("given, expected", [
    (dict(), dict(deepcompile_backward_wait="device", grad_norm_check="device")),
    (dict(gpus=2), dict(deepcompile_backward_wait="host", grad_norm_check="host")),
    (dict(stage=2), dict(zero3_step="fast", grad_norm_check="host", compile="deepcompile")),
    (dict(precision="fp16"), dict(grad_norm_check="host", triton_loss=False)),
    (dict(precision="16-mixed"), dict(grad_norm_check="host", triton_loss=False)),
    (dict(precision="fp32"), dict(triton_loss=False, grad_norm_check="device")),
    (dict(fused_bias_dropout_add=False), dict(triton_dropout=False, triton_loss=True)),
    (dict(fused_bias_gelu=False), dict(triton_gelu_grad=False)),
])
def test_the_rules_set_what_cannot_run_or_was_not_measured(given, expected):
    gpus = given.pop("gpus", 1)
    r = resolve(gpus=gpus, **given)
    assert {k: r.filled[k] for k in expected} == expected, r
    assert r.rules or not given


@pytest.mark.parametrize("given", [dict(stage=0), dict(attention="blocksparse"), dict(attention="xformers"),
                                   dict(ds_config="c.json"), dict(compile="blocks")])
def test_what_deepcompile_cannot_run_or_no_run_backs_takes_the_eager_profile(given):
    r = resolve(**given)
    assert r.used == "eager" and len(r.rules) == 1 and "profile eager" in r.rules[0]
    assert r.filled.get("compile", given.get("compile")) != "deepcompile"
    assert "micro_batch" not in r.filled and r.filled.get("zero3_step", "fast") == "fast"


def test_fast_validates_and_saves_between_steps():
    r = resolve(val_every=5, save_every=5, ckpt_dir="ck")
    assert r.used == "fast" and r.rules == [] and r.filled["compile"] == "deepcompile"


def test_the_profiles_micro_batch_follows_the_gpus_memory():
    assert resolve(preset="1.5b").filled["micro_batch"] == 16
    r = resolve(preset="1.5b", memory=79.2)
    assert r.filled["micro_batch"] == 8 and "(micro-batch 16 would peak at about 92 GiB per GPU, over 95%" in r.note
    # on eight such GPUs ZeRO-3's state is divided eightfold and 16 is expected to fit; unsharded it is not
    assert resolve(preset="1.5b", memory=79.2, gpus=8).filled["micro_batch"] == 16
    assert profiles.resolve({"preset": "1.5b"}, "fast", cuda=True, gpus=8, gpu_memory_gib=79.2,
                            sharded_gpus=1).filled["micro_batch"] == 8
    # ZeRO-1 shards only the fp32 master weights and moments (12 of 16 bytes a parameter): 16 is expected at 76 GiB
    r = resolve(preset="1.5b", memory=79.2, gpus=8, stage=1)
    assert r.filled["micro_batch"] == 8 and "would peak at about 76 GiB" in r.note
    # the peaks are the 1.5b preset's in bf16/fp16: another preset or shape, or fp32, keeps the profile's 16
    for given in (dict(preset="760m"), dict(preset="1.5b", seq_len=1024), dict(preset="1.5b", precision="fp32"),
                  dict(preset="1.5b", activation_checkpointing=True)):
        assert resolve(memory=79.2, **given).filled["micro_batch"] == 16, given
    assert "micro_batch" not in resolve(preset="1.5b", memory=79.2, micro_batch=4).filled
    with pytest.raises(ValueError, match=r"does not fit in 95% of this GPU's 39 GiB on 1 GPU\(s\).*16: 92 GiB, "
                                         r"8: 60 GiB.*pass a smaller --micro_batch"):
        resolve(preset="1.5b", memory=39.4)


def test_the_measured_peaks_match_the_committed_runs():
    root = ROOT / "benchmarks" / "results"
    peaks = {}
    for sub, mb, world in (("together_1xh200/compare/runs", 16, 1), ("levers_mb8_1xh100/runs", 8, 1),
                           ("deepcompile_2xh200/runs", 16, 2)):
        for f in (root / sub).glob("*.json"):
            run = json.loads(f.read_text())
            if run["world_size"] == world and not f.name.startswith("fsdp2"):  # FSDP2's row is another stack
                peaks.setdefault((mb, world), []).append(run["peak_mem_gib"])
    # the table holds the largest one-GPU peak of each micro-batch, rounded up to 0.1 GiB
    assert FAST.peak_gib == {16: math.ceil(max(peaks[16, 1]) * 10) / 10, 8: math.ceil(max(peaks[8, 1]) * 10) / 10}
    # with the state sharded over two GPUs it comes within 1 GiB of the two-GPU runs, above them
    assert 0 < profiles.expected_peak_gib(FAST, 16, 2, 3) - max(peaks[16, 2]) < 1.0


def test_bad_profiles_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown --profile 'fastest'; choose one of \('fast', 'stock', 'eager'\)"):
        profiles.resolve({}, "fastest", cuda=True, gpus=1)
    with pytest.raises(ValueError, match="--profile fast needs a CUDA GPU.*use --profile eager"):
        profiles.resolve({}, "fast", cuda=False, gpus=1)
    with pytest.raises(ValueError, match="unknown --profile"):
        TrainConfig(profile="turbo")


def test_the_machine_picks_the_default_profile():
    assert profiles.resolve({}, None, cuda=False, gpus=1).name == "eager"
    assert profiles.resolve({}, None, cuda=True, gpus=1, gpu_memory_gib=80.0).name == "fast"


def test_compare_on_gpus_runs_the_fast_profile_and_says_why(pretend_gpus):
    train, ns = pretend_gpus.parse(["--stage", "3", "--precision", "bf16", "--gpus", "1"])
    assert (train.profile, train.compile, train.micro_batch, train.zero3_step) == ("fast", "deepcompile", 16, "fused")
    assert (train.preset, train.steps, train.warmup_steps) == ("1.5b", 30, 10)
    assert ns.resolved_profile.line().startswith("profile fast: compile=deepcompile, deepcompile_schedule=once")
    assert ns.resolved_profile.to_dict()["used"] == "fast"
    # an 80 GB GPU: micro-batch 8, the line says why; the ceiling row is one unsharded GPU
    pretend_gpus.gpu_memory_gib = lambda: 79.2
    train, ns = pretend_gpus.parse([])
    assert train.micro_batch == 8
    assert "micro_batch=8" in (out := ns.resolved_profile.line()) and "micro-batch 16 would peak" in out
    train, ns = pretend_gpus.parse(["--compile", "blocks"])
    assert train.profile == "fast" and train.zero3_step == "fast" and train.micro_batch == 8
    assert "rule: compile != 'deepcompile': profile eager" in ns.resolved_profile.line()
    # --explain and --autotune start from the eager step unless a profile is asked for
    assert pretend_gpus.parse(["--explain"])[0].profile == "eager"
    assert pretend_gpus.parse(["--profile", "stock"])[0].zero3_step == "deepspeed"


def test_compare_on_a_cpu_runs_the_eager_profile_and_refuses_fast(capsys):
    import compare

    train, _ = compare.parse([])
    assert train.profile == "eager" and train.compile == "none"
    with pytest.raises(SystemExit) as exc:
        compare.parse(["--profile", "fast"])
    assert exc.value.code == 2 and "--profile fast needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["plain_deepspeed/train.py", "lightning_app/train.py"])
@pytest.mark.timeout(900)  # two script starts, each under its own subprocess timeout
def test_the_training_scripts_list_the_profiles_and_refuse_a_bad_one(tmp_path, script):
    run = lambda *a: subprocess.run([sys.executable, script, *a, "--out", str(tmp_path / "r.json")], cwd=ROOT,
                                    env=env(), capture_output=True, text=True, timeout=120)
    listed = run("--profile", "list")
    assert listed.returncode == 0 and "fast: the fastest setup measured" in listed.stdout
    assert "rule: gpus > 1: deepcompile_backward_wait=host" in listed.stdout
    bad = run("--profile", "turbo")
    assert bad.returncode == 2 and "unknown --profile 'turbo'" in bad.stderr and "Traceback" not in bad.stderr


def test_the_training_scripts_resolve_the_profile_for_the_launchers_world(monkeypatch):
    """Every rank resolves the same settings: the raw loop from the launcher's WORLD_SIZE, Lightning from what its
    own launcher will start (--devices, else every GPU)."""
    import argparse

    sys.path.insert(0, str(ROOT))
    from lightning_app.train import launch_world
    from shared.train.distributed import launched_world

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_world() == 4
    assert launch_world(argparse.Namespace(devices=2)) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launch_world(argparse.Namespace(devices=None)) == 4
