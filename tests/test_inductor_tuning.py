"""--coordinate_descent_tuning: inductor tunes the block sizes of the Triton kernels it generates.

On CPU: the flag is refused in one line (inductor emits C++ there, so it would change nothing) and, where CUDA is,
it sets inductor's option before anything compiles. On a GPU (`gpu` marker): a run with it trains, and the kernels
it compiled carry configurations found by coordinate descent in the inductor cache.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch._inductor.config as inductor_config

import shared.model.config as model_config
from shared.train.compile import configure_inductor
from shared.train.config import TrainConfig
from tests.helpers import LIGHTNING, RAW, load, run, torchrun

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.skipif(HAS_CUDA, reason="the CPU refusal")
@pytest.mark.parametrize("script", [RAW, LIGHTNING], ids=["raw", "lightning"])
def test_coordinate_descent_tuning_is_refused_without_cuda(tmp_path, script):
    with pytest.raises(ValueError, match="only run on a CUDA GPU"):
        TrainConfig(coordinate_descent_tuning=True)
    proc = run([sys.executable, script, "--coordinate_descent_tuning", "--out", tmp_path / "r.json"], check=False,
               timeout=60)
    assert proc.returncode == 2
    assert "--coordinate_descent_tuning tunes inductor's Triton kernels" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_configure_inductor_sets_the_option_only_when_asked(monkeypatch):
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    monkeypatch.setattr(inductor_config, "coordinate_descent_tuning", False)
    configure_inductor(TrainConfig())
    assert inductor_config.coordinate_descent_tuning is False
    train = TrainConfig(coordinate_descent_tuning=True)
    configure_inductor(train)
    assert inductor_config.coordinate_descent_tuning is True


@pytest.mark.gpu
def test_a_tuned_run_trains_and_its_kernels_were_tuned(tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    out = tmp_path / "run.json"
    torchrun(RAW, 1, ["--preset", "tiny", "--steps", "8", "--warmup_steps", "3", "--compile", "blocks",
                      "--coordinate_descent_tuning", "--out", out], timeout=420)
    result = load(out)
    assert result["train"]["coordinate_descent_tuning"] is True
    assert result["losses"][-1] < result["losses"][0]
    tuned = [json.loads(p.read_text()) for p in cache.rglob("*.best_config")]
    assert tuned and any(c.get("found_by_coordesc") for c in tuned), tuned
