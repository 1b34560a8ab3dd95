"""--deepcompile_backward_wait device: DeepCompile's op with the backward's end waited for on the device.

On CPU: the patch of DeepSpeed's installed header (exactly the one wait replaced, anything else refused), the
builder (DeepSpeed's sources under its own name, the patched header first), the refusals, and the op's name in the
run record. The op itself builds and trains on the GPU (tests/test_deepcompile.py, `gpu` marker).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import shared.model.config as model_config
from shared.patches import deepcompile_op
from shared.train.config import TrainConfig

ds = pytest.importorskip("deepspeed")
HEADER = Path(ds.__file__).parent / "ops" / "csrc" / "includes" / "deepcompile.h"
SYNC = "at::cuda::stream_synchronize(rs_stream_);"


def test_the_installed_header_loses_exactly_the_backwards_host_wait():
    original = HEADER.read_text()
    patched = deepcompile_op.device_wait_header(original)
    assert original.count(SYNC) == 2 and patched.count(SYNC) == 1  # the bucket-growth wait stays
    end = patched.index("virtual void endBackward()")
    body = patched[end:patched.index("\n    }\n", end)]
    assert SYNC not in body and "reduce_done.record(rs_stream_);" in body
    assert "reduce_done.block(at::cuda::getCurrentCUDAStream());" in body
    # nothing else changed
    assert patched.replace(deepcompile_op.DEVICE_WAIT, deepcompile_op.HOST_WAIT) == original


@pytest.mark.parametrize("edit", [
    lambda h: h.replace("// This synchronization ensures", "// Ensures"),  # another DeepSpeed's text
    lambda h: h + deepcompile_op.HOST_WAIT,  # twice: which one is meant is not known
])
def test_a_header_other_than_the_one_patched_for_is_refused(edit):
    with pytest.raises(ValueError, match=r"this DeepSpeed changed the op; use --deepcompile_backward_wait host"):
        deepcompile_op.device_wait_header(edit(HEADER.read_text()))


def test_the_builder_builds_deepspeeds_sources_under_its_own_name(tmp_path):
    from deepspeed.ops.op_builder.dc import DeepCompileBuilder

    builder = deepcompile_op.builder(tmp_path / "inc")
    own = DeepCompileBuilder()
    builder.build_for_cpu = own.build_for_cpu = True  # as jit_load sets it here (no CUDA include directory)
    assert builder.name == "dc_device_wait" != own.name
    assert builder.absolute_name() == "deepspeed.ops.dc_device_wait_op"
    assert builder.sources() == own.sources()
    paths = builder.include_paths()
    assert paths[0] == str(tmp_path / "inc") and paths[1:] == own.include_paths()
    written = tmp_path / "inc" / "deepcompile.h"
    assert written.read_text() == deepcompile_op.device_wait_header(HEADER.read_text())
    before = written.stat().st_mtime_ns
    builder.include_paths()  # again (every rank, every build): unchanged text is not rewritten
    assert written.stat().st_mtime_ns == before and [p.name for p in written.parent.iterdir()] == ["deepcompile.h"]


def test_install_refuses_once_deepspeeds_own_op_is_loaded(monkeypatch):
    import deepspeed.compile.util as dc_util

    monkeypatch.setattr(dc_util, "dc_handle", types.ModuleType("dc"))
    assert deepcompile_op.active_op() == "dc"
    with pytest.raises(RuntimeError, match="must be set up before DeepSpeed loads its own DeepCompile op"):
        deepcompile_op.install()
    ours = types.ModuleType("dc_device_wait")
    monkeypatch.setattr(dc_util, "dc_handle", ours)
    assert deepcompile_op.install() is ours and deepcompile_op.active_op() == "dc_device_wait"  # loaded once
    monkeypatch.setattr(dc_util, "dc_handle", None)
    assert deepcompile_op.active_op() is None


def test_bad_settings_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="unknown deepcompile_backward_wait 'stream'"):
        TrainConfig(deepcompile_backward_wait="stream")
    with pytest.raises(ValueError, match="changes DeepCompile's op, which --compile none does not run"):
        TrainConfig(deepcompile_backward_wait="device")
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    train = TrainConfig(compile="deepcompile", warmup_steps=6, deepcompile_backward_wait="device")
    assert train.deepcompile_backward_wait == "device" and TrainConfig().deepcompile_backward_wait == "host"


def test_compile_engine_installs_the_op_before_deepspeed_loads_its_own(monkeypatch):
    from shared.patches import deepcompile
    from shared.train import ds_runtime

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    order = []

    class Engine:
        config = {"compile": {"deepcompile": True}}

        def compile(self, backend, schedule):
            order.append("engine.compile")

        def is_deepcompile_active(self):
            return True

        def zero_param_persistence_threshold(self):
            return 0

    monkeypatch.setattr(deepcompile_op, "install", lambda: order.append("install"))
    for name in ("time_deepcompile_profilers", "drop_eager_persistent", "cache_deepcompile_walks", "align_schedule",
                 "schedule_shift"):
        monkeypatch.setattr(deepcompile, name, lambda *a, **k: None)
    for wait, expected in (("device", ["install", "engine.compile"]), ("host", ["engine.compile"])):
        order.clear()
        ds_runtime.compile_engine(Engine(), TrainConfig(compile="deepcompile", warmup_steps=6, stage=2,
                                                        deepcompile_backward_wait=wait))
        assert order == expected
