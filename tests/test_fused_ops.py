"""Fused elementwise paths (shared/model/fused_ops.py) against their PyTorch references, and in the model.

CPU: the torch.compile'd functions run through inductor's C++ backend; the bf16 numbers are the gpu-marked tests,
run on the H200.
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from shared.model import fused_ops
from shared.model.config import FUSED_FLAGS, FUSED_RESULT_KEYS, preset
from shared.model.gpt import GPT
from shared.train.compile import compile_blocks
from shared.train.config import TrainConfig
from tests.helpers import FAST, LIGHTNING, RAW, load, run, torchrun

P = 0.3


def _keep_rate_and_mask(device, dtype, n=1 << 20, fn=fused_ops.bias_dropout_add, rate=P):
    """Forward keeps ~1-p of the elements, scaled 1/(1-p), and backward passes gradient exactly where it kept.
    fn: the compiled residual dropout under test; rate: the p it applies (a rounded one: tests/test_dropout_mask.py)."""
    x = torch.ones(n // 512, 512, device=device, dtype=dtype, requires_grad=True)
    bias = torch.zeros(512, device=device, dtype=dtype, requires_grad=True)
    residual = torch.zeros_like(x, requires_grad=True)
    out = fn(x, bias, residual, P, True)
    out.backward(torch.ones_like(out))
    kept = out != 0
    kept_rate = kept.float().mean().item()
    assert abs(kept_rate - (1 - rate)) < 5 * (rate * (1 - rate) / n) ** 0.5, kept_rate  # 5 sigma of a binomial
    scale = torch.tensor(1 / (1 - rate), dtype=dtype)
    torch.testing.assert_close(out[kept].float().unique(), scale.float().view(1).to(device))
    assert torch.equal(x.grad != 0, kept)  # the same mask in forward and backward
    torch.testing.assert_close(x.grad[kept].float().unique(), scale.float().view(1).to(device))
    assert torch.all(residual.grad == 1)  # the residual path is never dropped
    torch.testing.assert_close(bias.grad.float(), (kept.float() * scale.float().to(device)).sum(0),
                               rtol=1e-2, atol=1e-2)


def test_bias_dropout_add_keep_rate_and_mask_cpu():
    _keep_rate_and_mask("cpu", torch.float32)


def test_bias_dropout_add_draws_a_new_mask_each_call():
    x = torch.ones(256, 256)
    a = fused_ops.bias_dropout_add(x, None, torch.zeros_like(x), P, True)
    b = fused_ops.bias_dropout_add(x, None, torch.zeros_like(x), P, True)
    assert not torch.equal(a != 0, b != 0)


@pytest.mark.parametrize("bias", [True, False])
def test_bias_dropout_add_without_dropout_matches_the_reference(bias):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(64, 32, generator=g, requires_grad=True), torch.randn(64, 32, generator=g, requires_grad=True)
    b = torch.randn(32, generator=g, requires_grad=True) if bias else None
    for training, p in ((False, P), (True, 0.0)):  # eval, or training at p = 0: the identity dropout
        out = fused_ops.bias_dropout_add(x, b, r, p, training)
        ref = r + (x + b if bias else x)
        torch.testing.assert_close(out, ref)
        grads = torch.autograd.grad(out.square().sum(), [x, r] + ([b] if bias else []))
        refs = torch.autograd.grad(ref.square().sum(), [x, r] + ([b] if bias else []))
        for a, e in zip(grads, refs):
            torch.testing.assert_close(a, e)


def test_bias_gelu_matches_the_reference():
    g = torch.Generator().manual_seed(1)
    x, b = torch.randn(64, 48, generator=g, requires_grad=True), torch.randn(48, generator=g, requires_grad=True)
    out = fused_ops.bias_gelu(x, b)
    ref = F.gelu(x + b, approximate="tanh")
    torch.testing.assert_close(out, ref)
    for a, e in zip(torch.autograd.grad(out.sum(), [x, b]), torch.autograd.grad(ref.sum(), [x, b])):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("flags", [{"fused_bias_dropout_add": True}, {"fused_bias_gelu": True},
                                   {"compile": "blocks"},
                                   {"fused_bias_dropout_add": True, "fused_bias_gelu": True, "compile": "blocks"}])
def test_model_with_fused_paths_matches_the_plain_model(flags):
    from shared.train.results import dynamo_stats

    idx, tgt = torch.randint(0, 256, (2, 128)), torch.randint(0, 256, (2, 128))
    results = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for f in ({}, flags):
        torch.manual_seed(0)
        model = GPT(preset("tiny", dropout=0.0, attn_dropout=0.0, **{k: v for k, v in f.items() if k != "compile"}))
        if f.get("compile") == "blocks":
            compile_blocks(model)
        loss = model(idx, tgt)
        loss.backward()
        results.append((loss.detach(), *(p.grad.clone() for p in model.parameters())))
    assert dynamo_stats()["dynamo_graphs"] >= 1 and dynamo_stats()["dynamo_graph_breaks"] == 0  # it compiled
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fused_model_trains_with_dropout():
    torch.manual_seed(0)
    model = compile_blocks(GPT(preset("tiny", fused_bias_dropout_add=True, fused_bias_gelu=True)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (4, 128))
    losses = []
    for _ in range(8):
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_bad_compile_mode_is_refused():
    with pytest.raises(ValueError, match=r"unknown GPTConfig field\(s\) \['compile'\]"):  # applied from outside
        preset("tiny", compile="blocks")
    with pytest.raises(ValueError, match="unknown compile mode 'graph'"):
        TrainConfig(compile="graph")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # above the sum of its subprocess timeouts (tests/test_timeouts.py)
def test_both_paths_run_the_fused_compiled_model_under_zero3_and_record_it(tmp_path):
    """Both paths, 2 CPU processes, ZeRO-3: same losses as each other and (no dropout) as the plain model; the
    compiled blocks are one graph with no break, recorded with every fused flag."""
    args = [*FAST, "--precision", "fp32", "--dropout", "0"]
    fused = ["--fused_bias_dropout_add", "--fused_bias_gelu", "--compile", "blocks"]
    torchrun(RAW, 2, [*args, "--out", str(tmp_path / "plain.json")], timeout=400)
    torchrun(RAW, 2, [*args, *fused, "--out", str(tmp_path / "raw.json")], timeout=400)
    run([sys.executable, LIGHTNING, *args, *fused, "--devices", "2", "--out", tmp_path / "pl.json"], timeout=400)
    plain_run, raw, pl = (load(tmp_path / f) for f in ("plain.json", "raw.json", "pl.json"))
    for r in (raw, pl):
        assert r["fused"]["bias_dropout_add"] is True and r["fused"]["bias_gelu"] is True
        assert r["fused"]["compile"] == "blocks"
        assert r["fused"]["dynamo_graph_breaks"] == 0 and r["fused"]["dynamo_recompile_limit_hits"] == 0
        assert r["ds_config"]["zero_optimization"]["leaf_module"]["classes"] == ["shared.model.gpt.Block"]
    assert plain_run["fused"]["compile"] == "none" and plain_run["fused"]["dynamo_graphs"] == 0
    # inductor's graphs came from its on-disk cache or were compiled (and counted); the eager run compiled none
    for r in (raw, pl):
        cache = r["extra"]["compile_cache"]
        assert cache["fxgraph_cache_hit"] + cache["fxgraph_cache_miss"] >= 1, cache
    assert not any(plain_run["extra"]["compile_cache"].values())
    assert raw["losses"] == pytest.approx(plain_run["losses"], abs=1e-4)
    assert pl["losses"] == pytest.approx(raw["losses"], abs=1e-6)


def test_every_fused_flag_is_recorded():
    from shared.model.config import fused_paths

    on = dict.fromkeys(FUSED_FLAGS, True)
    assert fused_paths(preset("tiny", **on)) == {FUSED_RESULT_KEYS[k]: True for k in FUSED_FLAGS}
    one_off = fused_paths(preset("tiny", **{**on, "triton_loss": False}))
    assert [k for k, v in one_off.items() if not v] == ["triton_linear_cross_entropy"]
    assert list(fused_paths(preset("tiny"))) == ["triton_linear_cross_entropy", "bias_dropout_add", "bias_gelu",
                                                 "bias_gelu_triton_grad", "dropout_triton_mask"]
    assert set(fused_paths(preset("tiny")).values()) == {False}  # None (the CUDA rule) resolved: off on CPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_dropout_add_keep_rate_and_mask_gpu(dtype):
    _keep_rate_and_mask("cuda", dtype)


def _bf16_inputs():
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8 * 2048, 2304, device=dev, generator=g, dtype=dt, requires_grad=True)
    w = torch.randn(2304, device=dev, generator=g, dtype=dt).requires_grad_()
    b = torch.randn(2304, device=dev, generator=g, dtype=dt).requires_grad_()
    return x, w, b, torch.randn(x.shape, device=dev, generator=g, dtype=dt)


@pytest.mark.gpu
def test_bf16_bias_gelu_matches_the_reference_on_gpu():
    x, _, b, gy = _bf16_inputs()
    out = fused_ops.bias_gelu(x, b)
    ref = F.gelu(x + b, approximate="tanh")
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    got = torch.autograd.grad(out, [x, b], gy)
    exp = torch.autograd.grad(ref, [x, b], gy)
    torch.testing.assert_close(got[0], exp[0], rtol=2e-2, atol=2e-2)
    assert (got[1].float() - exp[1].float()).norm() / exp[1].float().norm() < 1e-2


def test_compiled_blocks_get_a_leaf_module_and_torch_linear_in_the_ds_dict():
    from shared.train.config import TrainConfig
    from shared.train.ds_config import build_ds_config

    zero = build_ds_config(TrainConfig(stage=3, compile="blocks"))["zero_optimization"]
    assert zero["leaf_module"] == {"classes": ["shared.model.gpt.Block"]} and zero["memory_efficient_linear"] is False
    eager = build_ds_config(TrainConfig(stage=3))["zero_optimization"]
    assert "leaf_module" not in eager and "memory_efficient_linear" not in eager  # DeepSpeed's defaults
    assert "leaf_module" not in build_ds_config(TrainConfig(stage=2, compile="blocks"))["zero_optimization"]


def test_the_leaf_class_name_is_the_blocks():
    import importlib

    from shared.model.gpt import Block
    from shared.train.compile import leaf_module_class
    from shared.train.ds_config import build_ds_config

    module, name = leaf_module_class().rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is Block  # what DeepSpeed resolves the name to
    zero = build_ds_config(TrainConfig(stage=3, compile="blocks"))["zero_optimization"]
    assert zero["leaf_module"]["classes"] == [leaf_module_class()]


def test_a_user_ds_config_without_the_leaf_module_is_refused_when_compiling(tmp_path):
    from shared.train.config import TrainConfig
    from shared.train.ds_config import build_ds_config

    train = TrainConfig(stage=3, compile="blocks")
    cfg = build_ds_config(train)
    del cfg["zero_optimization"]["leaf_module"]
    path = tmp_path / "ds.json"
    path.write_text(__import__("json").dumps(cfg))
    with pytest.raises(ValueError, match="leaf_module"):
        build_ds_config(TrainConfig(stage=3, compile="blocks", ds_config=str(path)))
    cfg["zero_optimization"]["leaf_module"] = {"classes": ["Block"]}  # DeepSpeed matches the bare name too
    path.write_text(__import__("json").dumps(cfg))
    assert build_ds_config(TrainConfig(stage=3, compile="blocks", ds_config=str(path)))["zero_optimization"][
        "leaf_module"] == {"classes": ["Block"]}
    del cfg["zero_optimization"]["memory_efficient_linear"]  # DeepSpeed's default (true) would recompile per layer
    path.write_text(__import__("json").dumps(cfg))
    with pytest.raises(ValueError, match="memory_efficient_linear false"):
        build_ds_config(TrainConfig(stage=3, compile="blocks", ds_config=str(path)))


@pytest.mark.gpu
def test_allocator_cache_flushes_are_counted_on_gpu():
    from shared.train.results import allocator_cache_flushes

    torch.ones(1, device="cuda")
    assert allocator_cache_flushes(torch.device("cuda")) == torch.cuda.memory_stats()["num_alloc_retries"]
    assert allocator_cache_flushes(torch.device("cpu")) is None


def test_exported_weights_of_a_fused_gpu_run_load_into_the_plain_model_on_cpu(tmp_path):
    import dataclasses

    from shared.train.checkpoint import load_exported, save_exported

    cfg = preset("tiny", fused_bias_gelu=True, fused_bias_dropout_add=True)
    plain = GPT(preset("tiny"))
    state = {k: v for k, v in plain.state_dict().items() if k != "head.weight"}
    # written by a version with switches since removed (docs/ledger.md): the file still loads
    written = {**dataclasses.asdict(cfg), "fused_layernorm": True, "fused_loss": False, "matmul_bias_grad": False}
    path = save_exported(tmp_path / "w.safetensors", state, written)
    model, meta = load_exported(path)
    assert meta["model_config"]["fused_bias_gelu"] is True  # what the run trained with stays recorded
    assert meta["model_config"]["fused_layernorm"] is True
    idx = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(model(idx), plain.eval()(idx))  # and the plain model runs it on the CPU


def test_compiled_blocks_hold_the_blocksparse_kernel_in_their_one_graph():
    """The kernel is a custom op: the compiled block is one graph for both blocks, with no break, and trains as eager
    code does, attention dropout included (inductor's fallback_random: the seeds' random ops draw eager's values)."""
    import torch._inductor.config as inductor_config

    from shared.train.results import dynamo_stats

    # 64 tokens (4 blocks of 16), not the preset's 128: the Triton interpreter's time grows with the blocks, and the
    # tiny layout is causal-dense at either length
    idx = torch.randint(0, 256, (2, 64))
    results = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for comp in ("none", "blocks"):
        torch.manual_seed(0)
        model = GPT(preset("tiny", attention="blocksparse", dropout=0.0, attn_dropout=0.2, seq_len=64))
        if comp == "blocks":
            compile_blocks(model)
        with inductor_config.patch(fallback_random=True):
            loss = model(idx, idx)
            loss.backward()
        results.append((loss.detach(), model.blocks[0].attn.qkv.weight.grad.clone()))
    stats = dynamo_stats()
    assert stats["dynamo_graphs"] == 1 and stats["dynamo_graph_breaks"] == 0, stats
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_ablation_naive_has_every_switch_off_even_where_cuda_defaults_them_on():
    sys.path.insert(0, str(__import__("tests.helpers", fromlist=["ROOT"]).ROOT / "benchmarks"))
    import ablation

    configs = ablation.configurations()
    off = {"fused_bias_dropout_add": False, "fused_bias_gelu": False, "zero3_step": "deepspeed"}
    assert configs["naive"] == off
    assert configs["+bias_gelu"] == {**off, "fused_bias_gelu": True}
    assert configs["+fast_zero3_step"] == {**off, "zero3_step": "fast"} and configs["all"]["zero3_step"] == "fast"
    assert configs["+compile"]["fused_bias_gelu"] is False and configs["+compile"]["compile"] == "blocks"


def test_explain_with_lightnings_own_ds_dict_refuses_compiled_blocks(tmp_path):
    from tests.helpers import ROOT

    proc = run([sys.executable, ROOT / "compare.py", "--explain", "--compile", "blocks", "--factors",
                "pl_default_ds_config", "--out", tmp_path / "report"], check=False, timeout=60)
    assert proc.returncode == 2 and "pl_default_ds_config cannot run with --compile blocks" in proc.stderr
