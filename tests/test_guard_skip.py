"""--skip_guard_eval (shared/train/compile.GuardSkip): the training forward skips dynamo's guards once the compiles
are done, after one checked step; both paths train exactly as with the guards."""

import sys

import pytest
import torch

from shared.model import config as model_config
from shared.train import compile as train_compile
from shared.train.compile import GuardSkip
from shared.train.config import TrainConfig, last_compile_step
from shared.train.results import dynamo_stats
from tests.helpers import LIGHTNING, RAW, load, run


def skipping() -> bool:
    return torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe


@pytest.fixture
def fresh(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(train_compile, "GUARD_SKIP_FROM", None)
    yield
    torch._dynamo.reset()


SCALE = 2.0


def scaled(x):
    return x * SCALE  # dynamo guards on the global it reads


def test_nothing_compiled_is_refused_and_a_compiled_run_is_not(monkeypatch):
    monkeypatch.setattr(model_config, "cuda_available", lambda: False)
    with pytest.raises(ValueError, match="--skip_guard_eval skips torch.compile's guard checks, and nothing is"):
        TrainConfig(skip_guard_eval=True)
    assert TrainConfig(skip_guard_eval=True, compile="blocks").skip_guard_eval
    assert TrainConfig(skip_guard_eval=True, fused_bias_gelu=True).skip_guard_eval
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)  # the bias fusions are on by default there
    assert TrainConfig(skip_guard_eval=True).skip_guard_eval


def test_the_check_comes_after_deepcompiles_recompile_under_its_own_schedule(monkeypatch):
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    own = TrainConfig(compile="deepcompile", deepcompile_schedule="deepspeed", stage=3, warmup_steps=6, steps=10)
    assert last_compile_step(own) == 5 and GuardSkip(own).check_at == 6
    assert last_compile_step(TrainConfig(compile="deepcompile", deepcompile_schedule="once", warmup_steps=2)) == 0
    assert last_compile_step(TrainConfig(compile="deepcompile", stage=2, warmup_steps=2)) == 0  # ZeRO 1/2: once
    assert last_compile_step(TrainConfig(compile="blocks")) == 0


def test_guards_are_checked_then_skipped_from_the_step_after_the_check(fresh, monkeypatch):
    global SCALE
    f = torch.compile(scaled, backend="eager")
    guards = GuardSkip(TrainConfig(compile="blocks", skip_guard_eval=True))
    x = torch.ones(3)
    for step in (7, 8):  # a resumed process: its first step compiles, its second is the check
        with guards.forward(step):
            assert not skipping()
            f(x)
    assert train_compile.GUARD_SKIP_FROM is None
    graphs = dynamo_stats()["dynamo_graphs"]
    with guards.forward(9):
        assert skipping()
        monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
        assert f(x).tolist() == [2.0] * 3  # the guard on SCALE was skipped: the stale graph ran, nothing compiled
        assert dynamo_stats()["dynamo_graphs"] == graphs
    assert not skipping() and train_compile.GUARD_SKIP_FROM == 9
    assert f(x).tolist() == [3.0] * 3  # outside the training forward the guards run and recompile
    assert dynamo_stats()["dynamo_graphs"] == graphs + 1


def test_a_compile_in_the_checked_step_stops_the_run(fresh):
    f = torch.compile(scaled, backend="eager", dynamic=False)
    guards = GuardSkip(TrainConfig(compile="blocks", skip_guard_eval=True))
    with guards.forward(0):
        f(torch.ones(3))
    with pytest.raises(ValueError, match=r"the training forward of step 1 compiled 1 new graph\(s\) after the last "
                                           r"planned compile \(step 0\).*drop --skip_guard_eval"):
        with guards.forward(1):
            f(torch.ones(4))  # a new shape: a new graph
    assert train_compile.GUARD_SKIP_FROM is None and not skipping()


def test_off_by_default_it_never_skips(fresh):
    guards = GuardSkip(TrainConfig(compile="blocks"))
    for step in range(4):
        with guards.forward(step):
            assert not skipping()
    assert train_compile.GUARD_SKIP_FROM is None


@pytest.mark.slow
def test_both_paths_train_and_validate_with_skipped_guards_as_with_guards(tmp_path):
    """Compiled blocks, dropout on, validation between steps (eval-mode graphs beside the training ones): the same
    losses and validation losses with the guards skipped from step 2 as with every guard checked."""
    args = ["--preset", "tiny", "--precision", "fp32", "--steps", "6", "--warmup_steps", "2", "--log_every", "3",
            "--compile", "blocks", "--val_every", "2", "--val_batches", "2"]
    runs = {}
    for name, script, extra in (("guards", RAW, []), ("raw", RAW, ["--skip_guard_eval", "true"]),
                                ("lightning", LIGHTNING, ["--skip_guard_eval", "true"])):
        run([sys.executable, script, *args, *extra, "--out", tmp_path / f"{name}.json"], timeout=400)
        runs[name] = load(tmp_path / f"{name}.json")
    assert runs["guards"]["extra"]["guard_skip_from"] is None
    assert runs["raw"]["extra"]["guard_skip_from"] == runs["lightning"]["extra"]["guard_skip_from"] == 2
    assert runs["raw"]["losses"] == runs["guards"]["losses"]
    val = {name: [v["val_loss"] for v in r["extra"]["val"]] for name, r in runs.items()}
    assert val["raw"] == val["guards"]
    assert runs["lightning"]["losses"] == pytest.approx(runs["raw"]["losses"], abs=1e-6)
    for r in runs.values():
        assert r["fused"]["dynamo_graph_breaks"] == 0 and len(r["extra"]["val"]) == 3
