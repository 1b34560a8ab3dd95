"""--precision fp8 (shared/model/fp8.py): its refusals, the conversion both paths build, its DeepSpeed dict, FLOPs and
MFU, its profile rule, an FP8 matmul's and a small FP8 model's error against fp32; on the GPU (`gpu` marker) the same
errors on the tensor cores and both paths' parity.

The CPU tests stand in for the GPU where they must: `device_capability` is monkeypatched to a Hopper's (9.0) where a
test needs a config past the device refusal. torchao's Float8Linear also runs on a CPU (torch._scaled_mm has a CPU
kernel in torch 2.13), so the conversion and its numbers are checked here too."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tomllib

import pytest
import torch

from shared.model import flops, fp8
from shared.tools.prepare_data import prepare
from shared.train import profiles
from shared.train.config import TrainConfig, normalize_precision
from shared.train.ds_config import build_ds_config
from tests.helpers import GPU_BASE, ROOT, run

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao not installed (pip install 'zero3-bench[fp8]')")
TINY = dict(preset="tiny", steps=4, warmup_steps=1)


@pytest.fixture
def fp8_gpu():
    """A GPU test's FP8 device: skipped, with the refusal's words, where this machine has none."""
    if fp8.device_refusal():
        pytest.skip(fp8.device_refusal())


@pytest.fixture
def hopper(monkeypatch):
    """This machine as one with an H100: compute capability 9.0."""
    monkeypatch.setattr(fp8, "device_capability", lambda: (9, 0))


def test_the_aliases_torchao_users_type_are_fp8():
    assert normalize_precision("fp8") == normalize_precision("float8") == normalize_precision("FP8") == "fp8"


def test_a_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(fp8, "device_capability", lambda: None)
    with pytest.raises(ValueError, match="no CUDA GPU: use --precision bf16"):
        TrainConfig(precision="fp8", **TINY)


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(fp8, "device_capability", lambda: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB has 8\.0: use --precision bf16"):
        TrainConfig(precision="fp8", **TINY)
    monkeypatch.setattr(fp8, "device_capability", lambda: (8, 9))  # Ada: the first with FP8 tensor cores
    assert TrainConfig(precision="fp8", **TINY).precision == "fp8"


def test_a_missing_torchao_is_refused_with_the_extra_that_installs_it(monkeypatch, hopper):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"torchao is not installed: run `pip install 'zero3-bench\[fp8\]'`"):
        TrainConfig(precision="fp8", **TINY)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "zero3-bench"  # the name the refusal gives
    assert project["optional-dependencies"]["fp8"] == [f"torchao=={fp8.TORCHAO_VERSION}"]


@pytest.mark.parametrize("flag", sorted(fp8.UNCONVERTIBLE))
def test_the_fused_tails_are_off_under_fp8_and_refused_when_asked_for(hopper, flag):
    model = TrainConfig(precision="fp8", **TINY).model()
    assert not any(getattr(model, name) for name in fp8.UNCONVERTIBLE)
    asked = {flag: True, **({"fused_bias_gelu": True} if flag == "triton_gelu_grad" else {}),
             **({"fused_bias_dropout_add": True} if flag == "triton_dropout" else {})}
    with pytest.raises(ValueError, match="--precision fp8 cannot convert the blocks' linears"):
        TrainConfig(precision="fp8", **TINY, **asked)


def test_a_hidden_size_scaled_mm_cannot_multiply_and_an_unknown_recipe_are_refused(hopper):
    with pytest.raises(ValueError, match="n_embd a multiple of 16"):
        TrainConfig(precision="fp8", n_embd=72, n_head=4, **TINY)
    with pytest.raises(ValueError, match="unknown fp8_recipe 'blockwise'"):
        TrainConfig(precision="fp8", fp8_recipe="blockwise", **TINY)


def test_the_deepspeed_dict_of_fp8_is_bf16s(hopper):
    for stage in (0, 3):
        kw = dict(preset="1.5b", stage=stage, micro_batch=8)
        fp8_dict = build_ds_config(TrainConfig(precision="fp8", **kw))
        assert fp8_dict == build_ds_config(TrainConfig(precision="bf16", **kw))
        assert fp8_dict["bf16"] == {"enabled": True}


@needs_torchao
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_conversion_takes_the_blocks_linears_and_leaves_the_head_bf16(hopper, recipe):
    from torchao.float8.float8_linear import Float8Linear

    from shared.model.gpt import Linear, LMHead
    from shared.train.build import build_model

    train = TrainConfig(precision="fp8", fp8_recipe=recipe, **TINY)
    model = build_model(train)
    names = [f"blocks.{i}.{n}" for i in range(train.model().n_layer) for n in fp8.BLOCK_LINEARS]
    assert model.fp8["converted"] == names and model.fp8["n_converted"] == 4 * train.model().n_layer
    assert model.fp8["recipe"] == recipe and "head (tied LM head)" in model.fp8["skipped"]
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is Float8Linear for n in names)
    assert type(model.head) is LMHead and model.head.weight is model.wte.weight  # still tied, not converted
    assert not any(isinstance(m, Linear) for m in model.modules())  # no block linear left behind
    bf16 = build_model(TrainConfig(precision="bf16", **TINY, fused_bias_gelu=False, fused_bias_dropout_add=False))
    assert bf16.fp8 is None and {n: p.shape for n, p in bf16.named_parameters()} == \
        {n: p.shape for n, p in model.named_parameters()}  # the state dict's names: a bf16 model's


@needs_torchao
def test_a_fused_tail_is_never_skipped_silently():
    from shared.model.config import preset
    from shared.model.gpt import GPT

    with pytest.raises(ValueError, match=r"fused modules .*blocks\.0\.mlp\.fc \(GeluLinear\)"):
        fp8.convert(GPT(preset("tiny", fused_bias_gelu=True)))


@needs_torchao
def test_both_paths_build_the_same_converted_model(hopper):
    """The raw loop's build_model and the LightningModule's build_gpt: the same module types, names and weights."""
    from lightning_app.module import GPTModule
    from shared.train.build import build_model
    from shared.train.distributed import seed_all

    train = TrainConfig(precision="fp8", **TINY)
    seed_all(train.seed)  # as the raw loop does before build_model
    raw = build_model(train)
    lightning = GPTModule(train).build_gpt()
    types = lambda m: {n: type(x).__name__ for n, x in m.named_modules()}
    assert types(raw) == types(lightning) and "Float8Linear" in types(raw).values()
    assert raw.fp8 == lightning.fp8
    assert all(torch.equal(a, b) for a, b in zip(raw.state_dict().values(), lightning.state_dict().values()))


# The error bound of one FP8 matmul against fp32. Rounding to a float format with m mantissa bits makes a relative error
# of at most u = 2^-(m+1): e4m3 2^-4, e5m2 2^-3, bf16 2^-8. Each product term of x @ W^T carries the errors of both
# operands, at most sqrt(u_a^2 + u_b^2) in RMS when they are independent, and a sum of K terms with independent errors
# keeps that RMS relative to the sum's norm: forward (e4m3 x e4m3) sqrt(2) 2^-4 = 0.088; the gradients under
# tensorwise (e5m2 output gradient x e4m3) sqrt(2^-6 + 2^-8) = 0.14, under rowwise (all e4m3) 0.088. Tensorwise
# scales map each tensor's amax to e4m3's 448, so Gaussian data stays in the normal range, where u holds. FP8 must also
# be seen to run: its error must exceed the bf16 bound sqrt(2) 2^-8 = 0.0055 (a matmul left in bf16 stays under it).
FP8_BOUND = {"tensorwise": {"out": 0.088, "grad": 0.14}, "rowwise": {"out": 0.088, "grad": 0.088}}
BF16_BOUND = 0.0055


def fp8_linear_errors(recipe: str, device: str) -> dict[str, float]:
    """Relative (Frobenius) errors of a Float8Linear's output and gradients against the same nn.Linear in fp32."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(512, 1024, bias=False)).to(device)
    x, g = torch.randn(2048, 512, device=device), torch.randn(2048, 1024, device=device)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).backward(g)
    lin = torch.nn.Sequential(torch.nn.Linear(512, 1024, bias=False)).to(device)
    lin.load_state_dict(ref.state_dict())
    lin = convert_to_float8_training(lin.to(torch.bfloat16), config=Float8LinearConfig.from_recipe_name(recipe))
    x8 = x.to(torch.bfloat16).requires_grad_()
    y = lin(x8)
    y.backward(g.to(torch.bfloat16))
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    return {"out": rel(y, ref(x)), "grad_input": rel(x8.grad, x_ref.grad),
            "grad_weight": rel(lin[0].weight.grad, ref[0].weight.grad)}


def assert_within_fp8_bounds(errors: dict, recipe: str) -> None:
    bound = FP8_BOUND[recipe]
    assert BF16_BOUND < errors["out"] <= bound["out"], errors
    for key in ("grad_input", "grad_weight"):
        assert BF16_BOUND < errors[key] <= bound["grad"], (key, errors)


@needs_torchao
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_an_fp8_linear_is_within_its_rounding_bound_on_the_cpu(recipe):
    assert_within_fp8_bounds(fp8_linear_errors(recipe, "cpu"), recipe)


# The whole model: FP8 and bf16 each against the same model in fp32 (the tiny GPT, dropout off, one batch of random
# tokens, forward and backward). Measured on a CPU over three seeds and both recipes: the bf16 model's gradients sit
# 0.47-0.56% from fp32's (all parameters, one Frobenius norm), the FP8 model's 4.1-5.2%, 7-10x as far, as e4m3's
# rounding (2^-4) against bf16's (2^-8) would have it; the losses sit within 3e-5 (bf16) and 2.2e-4 (FP8) of fp32's,
# relative. The tolerance: the FP8 model's gradients within the bound of one FP8 matmul's (FP8_BOUND: the two blocks
# compound no further than one linear's rounding), its loss within 1e-3; and FP8 must be seen to act, its gradients
# at least 2x as far from fp32's as bf16's.
MODEL_LOSS_REL, FP8_OVER_BF16 = 1e-3, 2.0


def fp8_model_errors(recipe: str, device: str, seed: int = 0) -> dict[str, dict[str, float]]:
    """The loss's relative error and the gradients' (all parameters, one Frobenius norm) of a bf16 GPT and of the same
    GPT converted to FP8, each against the model in fp32."""
    import copy

    from shared.model.config import preset
    from shared.model.gpt import GPT

    torch.manual_seed(seed)
    cfg = preset("tiny", dropout=0.0, attn_dropout=0.0, fused_bias_gelu=False, fused_bias_dropout_add=False)
    models = {"fp32": GPT(cfg).to(device)}
    models["bf16"] = copy.deepcopy(models["fp32"]).to(torch.bfloat16)
    models["fp8"] = copy.deepcopy(models["bf16"])
    fp8.convert(models["fp8"], recipe)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), device=device)  # a CPU's FP8 matmul is slow: few tokens
    loss, grads = {}, {}
    for name, m in models.items():
        out = m(idx, idx)
        out.backward()
        loss[name] = out.item()
        grads[name] = torch.cat([p.grad.float().flatten() for _, p in sorted(m.named_parameters())])
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    return {name: {"loss": abs(loss[name] - loss["fp32"]) / loss["fp32"], "grad": rel(grads[name], grads["fp32"])}
            for name in ("bf16", "fp8")}


def assert_fp8_trains_like_bf16(errors: dict, recipe: str) -> None:
    assert FP8_OVER_BF16 * errors["bf16"]["grad"] < errors["fp8"]["grad"] <= FP8_BOUND[recipe]["grad"], errors
    assert errors["fp8"]["loss"] <= MODEL_LOSS_REL and errors["bf16"]["loss"] <= MODEL_LOSS_REL, errors


@needs_torchao
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_an_fp8_model_computes_its_loss_and_gradients_as_bf16_does_on_the_cpu(recipe):
    assert_fp8_trains_like_bf16(fp8_model_errors(recipe, "cpu"), recipe)


def test_fp8_is_counted_by_the_bf16_formula_and_its_mfu_against_both_peaks():
    for name, table in flops.PEAK_FLOPS.items():
        if "fp8" in table:
            assert table["fp8"] == 2 * table["bf16"], name
    h100 = "NVIDIA H100 80GB HBM3"
    assert flops.peak_flops(h100, "fp8") == pytest.approx(132 * 8192 * 1830e6, rel=1e-4)  # SMs x FLOP/clock x clock
    assert flops.mfu(494.7, h100, "bf16") == pytest.approx(0.5) and flops.mfu(494.7, h100, "fp8") == pytest.approx(0.25)
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 tensor cores
    cfg = TrainConfig(preset="1.5b").model()
    share = flops.fp8_share(cfg, 8, 3)
    exact = flops.step_flops_causal(cfg, 8, 3)
    assert share * exact == pytest.approx(3 * 24 * 24 * 8 * 2048 * 2304**2)  # k l 24 B s h^2
    assert 0.7 < share < 1  # the head and the attention products are the rest


@needs_torchao
def test_the_run_json_records_the_conversion_and_refuses_a_missing_one(hopper):
    from shared.train.build import build_model
    from shared.train.results import format_summary
    from tests.test_results import make_result

    train = TrainConfig(precision="fp8", micro_batch=4, **TINY)
    r = make_result(train=train, fp8_record=build_model(train).fp8)
    assert r.fp8["n_converted"] == 8 and r.fp8["flops_share"] == pytest.approx(flops.fp8_share(train.model(), 4, 3))
    assert r.mfu is None and r.mfu_fp8 is None  # a CPU has no peak
    assert r.tflops_per_gpu == make_result(train=TrainConfig(micro_batch=4, **TINY)).tflops_per_gpu  # the same formula
    assert "FP8 matmuls" in format_summary(r) and "attn.qkv, attn.proj, mlp.fc, mlp.proj of 2 blocks" in \
        fp8.describe(r.fp8)
    with pytest.raises(ValueError, match="--precision fp8 with no FP8 conversion record"):
        make_result(train=train)
    with pytest.raises(ValueError, match="--precision bf16 with FP8 conversion record"):
        make_result(train=TrainConfig(**TINY), fp8_record=r.fp8)


@needs_torchao
def test_the_compare_table_of_fp8_runs_gives_mfu_against_both_peaks_and_what_ran_in_fp8(hopper):
    import dataclasses
    from types import SimpleNamespace

    from harness import report as reports
    from shared.train.build import build_model
    from tests.test_results import make_result

    train = TrainConfig(precision="fp8", micro_batch=4, **TINY)
    conversion = build_model(train).fp8
    runs = {p: [dataclasses.replace(make_result(p, train=train, fp8_record=conversion), mfu=0.5, mfu_fp8=0.25)]
            for p in ("deepspeed", "lightning")}
    table = reports.format_table(reports.build_report(train, SimpleNamespace(world=1, repeats=1), runs, {}, []))
    assert re.search(r"^MFU \(bf16 peak\)\s+50\.0%\s+50\.0%", table, re.M), table
    assert re.search(r"^MFU \(FP8 peak\)\s+25\.0%\s+25\.0%", table, re.M), table
    assert f"FP8 matmuls (lightning): {fp8.describe(runs['lightning'][0].fp8)}" in table


def test_the_fast_profile_turns_the_triton_tails_off_under_fp8_and_says_so():
    fast = profiles.resolve({"precision": "fp8"}, "fast", cuda=True, gpus=1)
    assert fast.filled["triton_gelu_grad"] is False and fast.filled["triton_dropout"] is False
    assert fast.filled["compile"] == "deepcompile"  # the rest of the fast profile stands
    assert any(r.startswith("precision == 'fp8'") for r in fast.rules) and "precision == 'fp8'" in fast.line()
    bf16 = profiles.resolve({"precision": "bf16"}, "fast", cuda=True, gpus=1)
    assert bf16.filled["triton_gelu_grad"] is True and not any("fp8" in r for r in bf16.rules)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_an_fp8_linear_is_within_its_rounding_bound_on_the_gpu(recipe, fp8_gpu):
    assert_within_fp8_bounds(fp8_linear_errors(recipe, "cuda"), recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_an_fp8_model_computes_its_loss_and_gradients_as_bf16_does_on_the_gpu(recipe, fp8_gpu):
    assert_fp8_trains_like_bf16(fp8_model_errors(recipe, "cuda"), recipe)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(1000)  # the compare's own limit, 900 s, and the set-up
@pytest.mark.parametrize("profile", ["eager", "fast"])
def test_both_paths_train_fp8_alike(tmp_path, profile, fp8_gpu):
    """A short compare in fp8 (one GPU; eager, and the fast profile's ZeRO-3 + DeepCompile): both paths record the
    same conversion and pass loss parity (the bounds of harness/report.PARITY_TOLERANCE['fp8']); the losses fall."""
    kjv = tmp_path / "kjv"
    prepare(ROOT / "data" / "kjv.txt", kjv, "byte")
    out = tmp_path / "report"
    run([sys.executable, ROOT / "compare.py", *GPU_BASE, "--data", kjv, "--steps", "20", "--warmup_steps", "5",
         "--precision", "fp8", "--profile", profile, "--gpus", "1", "--out", out], timeout=900)
    report = json.loads((out / "report.json").read_text())
    runs = {p: json.loads((out / "runs" / f"{p}_0.json").read_text()) for p in ("deepspeed", "lightning")}
    assert runs["deepspeed"]["fp8"] == runs["lightning"]["fp8"] and runs["deepspeed"]["fp8"]["n_converted"] == 8
    assert all(r["mfu_fp8"] is not None and r["mfu_fp8"] == pytest.approx(r["mfu"] / 2) for r in runs.values())
    assert report["loss_parity"]["ok"], report["loss_parity"]
    assert runs["deepspeed"]["losses"][-1] < runs["deepspeed"]["losses"][0]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(700)
def test_the_bf16_row_runs_beside_an_fp8_compare_and_the_report_rates_fp8_over_it_on_the_gpu(tmp_path, fp8_gpu):
    """`compare.py --precision fp8 --reference bf16` (one GPU, one round, eager): the bf16 row is the raw path at bf16
    with no FP8 conversion, trained from the paths' weights on the same batches; the report gives each fp8 path over
    it."""
    kjv = tmp_path / "kjv"
    prepare(ROOT / "data" / "kjv.txt", kjv, "byte")
    out = tmp_path / "report"
    run([sys.executable, ROOT / "compare.py", *GPU_BASE, "--data", kjv, "--steps", "10", "--warmup_steps", "3",
         "--precision", "fp8", "--profile", "eager", "--gpus", "1", "--repeats", "1", "--reference", "bf16",
         "--out", out], timeout=600)
    report = json.loads((out / "report.json").read_text())
    bf16 = json.loads((out / "runs" / "bf16_0.json").read_text())
    raw = json.loads((out / "runs" / "deepspeed_0.json").read_text())
    assert bf16["train"]["precision"] == "bf16" and not bf16.get("fp8") and raw["fp8"]["n_converted"] == 8
    assert bf16["train"]["micro_batch"] == raw["train"]["micro_batch"] and bf16["path"] == raw["path"]
    assert report["same_start"]["ok"], report["same_start"]
    assert set(report["over_bf16"]) == {"deepspeed", "lightning"}
    assert all(o["n"] == 1 and o["ratio"] > 0 for o in report["over_bf16"].values())
    assert bf16["losses"][-1] < bf16["losses"][0]
