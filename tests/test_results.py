"""RunResult: what a run records, how it is labelled where it is reported, and that old results still load."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from harness import report as reports
from shared.model import flops
from shared.train.config import TrainConfig
from shared.train.results import RunResult, build_result, format_summary
from tests.helpers import ROOT

TIMING = {"step_time_s": {"median": 0.5, "min": 0.4, "max": 0.6},
          "phases_s": {"data": 0.001, "forward": 0.2, "backward": 0.25, "step": 0.049}, "per_step_s": [0.5] * 4}


def make_result(path: str = "deepspeed", train: TrainConfig | None = None, **measured) -> RunResult:
    """A RunResult assembled by build_result from made-up measurements (no training run)."""
    train = train or TrainConfig(preset="tiny", steps=6, warmup_steps=2)
    kw = dict(losses=[5.5, 5.4, 5.3, 5.2, 5.1, 5.0], timing=TIMING)
    kw.update(measured)
    return build_result(path=path, train=train, model_cfg=train.model(), ds_config={}, world_size=1,
                        device=torch.device("cpu"), attention="sdpa", n_params=1000, peak_mem_bytes=None, **kw)


def test_every_result_states_its_flops_convention_and_the_exact_causal_count():
    r = make_result(train=TrainConfig(preset="tiny", steps=6, warmup_steps=2, micro_batch=4))
    cfg = r.model
    dense = flops.megatron_flops(4, cfg["seq_len"], cfg["n_layer"], cfg["n_embd"], cfg["vocab_size"], 3)
    causal = flops.causal_flops(4, cfg["seq_len"], cfg["n_layer"], cfg["n_embd"], cfg["vocab_size"], 3)
    assert r.tflops_per_gpu == pytest.approx(dense / 0.5 / 1e12)
    assert r.tflops_per_gpu_causal == pytest.approx(causal / 0.5 / 1e12)
    summary = format_summary(r)
    assert "dense-attention formula, k=3, median step" in summary
    assert f"{r.tflops_per_gpu_causal:.2f} TFLOPs/GPU" in summary


def test_results_written_before_new_fields_still_load(tmp_path):
    old = RunResult.from_json(ROOT / "benchmarks" / "results" / "compare_1xh200" / "runs" / "deepspeed_0.json")
    assert old.tflops_per_gpu_causal is None and old.tflops_per_gpu > 300
    assert "n/a" in format_summary(old)
    data = dataclasses.asdict(make_result())
    del data["losses"]  # a field without a default is still required
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['losses'\]"):
        RunResult.from_json(tmp_path / "bad.json")


def test_a_result_recorded_with_options_since_removed_loads_and_differs_only_in_what_is_still_recorded(tmp_path):
    """A run JSON written before an option was removed (docs/ledger.md) records its field and, for liger's LayerNorm,
    a package version this version no longer records: it still loads, and compare.py --keep_runs and autotune's
    continuation (differences) do not count either as a difference."""
    from shared.train.results import device_info, differences, versions

    result = make_result()
    data = dataclasses.asdict(result)
    data["train"].update(fused_layernorm=True, python_gc="freeze", sigterm_check_every=50, optimizer="adamw")
    data["versions"]["liger-kernel"] = "0.8.5"
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = RunResult.from_json(tmp_path / "old.json")
    train = TrainConfig(preset="tiny", steps=6, warmup_steps=2)
    here = device_info()["name"]
    assert differences(train, old.train, here, old.versions) == []
    changed = differences(train, {**old.train, "steps": 7}, here, {**old.versions, "torch": "1.0"})
    assert changed == ["steps 7 there vs 6 now", f"torch '1.0' there vs {versions()['torch']!r} now"]
    # a field added since the run was recorded: no difference at its default (what the run did), one when set
    before = {k: v for k, v in old.train.items() if k != "grad_clip"}
    assert differences(train, before, here, old.versions) == []
    assert differences(dataclasses.replace(train, grad_clip=0.5), before, here, old.versions) == [
        "grad_clip None there vs 0.5 now"]


def test_compare_table_and_report_label_the_convention(tmp_path):
    train = TrainConfig(preset="tiny", steps=6, warmup_steps=2)
    results = {"deepspeed": [make_result("deepspeed")], "lightning": [make_result("lightning")]}
    ns = SimpleNamespace(world=1, repeats=1)
    report = reports.build_report(train, ns, results, {}, [])
    table = reports.format_table(report)
    assert "TFLOPs/GPU (dense-attention formula, k=3, median step)" in table
    assert "TFLOPs/GPU (exact causal count)" in table
    assert report["paths"]["deepspeed"]["tflops_per_gpu_causal"] == pytest.approx(
        results["deepspeed"][0].tflops_per_gpu_causal)
    reports.write_markdown({**report, "versions": {}}, tmp_path / "report.md", "phases.png")
    assert "dense-attention formula, k=3, median step" in (tmp_path / "report.md").read_text()


def test_grad_norms_are_kept_on_the_device_and_read_once_at_the_end():
    from shared.train.ds_runtime import GradNormRecorder

    engine = SimpleNamespace(norm=None)
    engine.get_global_grad_norm = lambda: engine.norm
    rec = GradNormRecorder(engine)
    for norm in (torch.tensor(1.5), 0.25, None, torch.tensor([2.0])):
        engine.norm = norm
        rec.record()
    assert all(a is b for a, b in zip(rec.norms, (rec.norms[0], 0.25, None, rec.norms[3])))  # no copy to host yet
    assert rec.values() == [1.5, 0.25, None, 2.0]
    assert make_result(grad_norms=[1.0, float("inf")]).grad_norms == [1.0, None]  # JSON has no inf


def test_param_checksum_counts_a_tied_weight_once():
    from shared.model.gpt import GPT
    from shared.train.ds_runtime import param_checksum

    torch.manual_seed(0)
    model = GPT(TrainConfig(preset="tiny").model())
    params = list({id(p): p for p in model.parameters()}.values())
    flat = torch.cat([p.detach().double().reshape(-1) for p in params])
    got = param_checksum(model)
    assert got["numel"] == flat.numel() == sum(p.numel() for p in params)
    assert got["sum"] == pytest.approx(flat.sum().item(), rel=1e-12)
    assert got["sum_sq"] == pytest.approx((flat * flat).sum().item(), rel=1e-12)


@pytest.mark.parametrize(
    "overrides, kernel",
    [
        ({}, "MATH"),  # the tiny preset trains with attention dropout 0.1: torch's CPU flash kernel has no dropout
        ({"dropout": 0.0}, "FLASH_ATTENTION"),  # without dropout torch picks its CPU flash kernel
        ({"attention": "reference"}, None),  # not SDPA: `attention` names the backend
    ],
)
def test_every_result_records_the_sdpa_kernel_torch_picked(overrides, kernel):
    from torch.nn.attention import SDPBackend

    train = TrainConfig(preset="tiny", steps=6, warmup_steps=2, **overrides)
    r = make_result(train=train)
    assert r.sdpa_kernel == kernel
    if kernel is not None:
        assert kernel in SDPBackend.__members__
        assert f"attention=sdpa ({kernel})" in format_summary(r)
        report = reports.build_report(train, SimpleNamespace(world=1, repeats=1),
                                      {"deepspeed": [r], "lightning": [r]}, {}, [])
        assert f"sdpa ({kernel})" in reports.format_table(report)


def test_the_compile_cache_counts_say_whether_a_graph_came_from_disk(tmp_path, monkeypatch):
    """A fresh cache folder: the first compile of a function misses and stores it; after dynamo forgets it (as a
    new process would), the same function is found on disk: what `extra.compile_cache` reports per run."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from shared.train.results import compile_cache_counts

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters.clear()
    torch._dynamo.reset()

    def f(x):
        return torch.nn.functional.gelu(x) * 3 + 1

    x = torch.randn(64)
    expected = f(x)
    # torch's own patch, undone on exit (a monkeypatch of its config module would hide the entries it restores)
    with inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        assert torch.allclose(torch.compile(f)(x), expected)
        first = compile_cache_counts()
        torch._dynamo.reset()
        counters.clear()
        assert torch.allclose(torch.compile(f)(x), expected)
        second = compile_cache_counts()
        torch._dynamo.reset()
    assert first["fxgraph_cache_miss"] == 1 and first["fxgraph_cache_hit"] == 0, first
    assert second["fxgraph_cache_hit"] == 1 and second["fxgraph_cache_miss"] == 0, second
    assert set(first) == {f"{k}_cache_{o}" for k in ("fxgraph", "autograd") for o in ("hit", "miss", "bypass")}


def test_the_summary_of_a_run_whose_first_or_last_step_was_skipped_names_the_skips():
    nan = float("nan")
    for losses, expected in (([nan, 5.4, 5.3, 5.2, 5.1, nan], "5.4000 -> 5.1000 (2 step(s) skipped: non-finite loss)"),
                             ([5.5, 5.4, 5.3, 5.2, 5.1, 5.0], "5.5000 -> 5.0000"),
                             ([nan] * 6, "n/a (all 6 steps skipped: non-finite loss)")):
        r = make_result(losses=losses, allow_nonfinite=True)
        line = next(x for x in format_summary(r).splitlines() if x.startswith("loss"))
        assert line.split(None, 1)[1] == expected


def test_a_diverged_run_exits_1_with_its_message_and_bad_input_exits_2(monkeypatch, capsys):
    from shared.train import distributed
    from shared.train.progress import NonFiniteLoss

    codes = []
    monkeypatch.setattr(distributed, "exit_process", lambda code, device: codes.append(code))

    def diverged(train):
        raise NonFiniteLoss("loss is nan at step 5; stopping (nan_policy=stop)")

    def refused(train):
        raise ValueError("micro_batch 0 must be >= 1")

    distributed.run_cli(diverged, None, "cpu")
    distributed.run_cli(refused, None, "cpu")
    assert codes == [1, 0, 2, 0]  # each run_cli ends with exit_process(0), here not leaving the process
    err = capsys.readouterr().err
    assert "error: loss is nan at step 5" in err and "error: micro_batch 0" in err and "Traceback" not in err


def test_a_writer_killed_mid_write_leaves_the_previous_report_whole(tmp_path, monkeypatch):
    """autotune.json, ablation.json, compare's report.json and every run JSON are replaced through a temporary file
    (results.replace_text): --keep / --keep_runs read them back, so a half-written file would stop the next call."""
    from pathlib import Path

    from harness.autotune import Search
    from shared.train.results import replace_text

    search = Search(TrainConfig(), SimpleNamespace(budget_s=60), launch=None, out_dir=tmp_path)
    search.report = {"command": "python compare.py --autotune"}
    search.write(complete=False)
    before = (tmp_path / "autotune.json").read_text()
    real = Path.write_text

    def killed(self, text, *args, **kwargs):  # half the text reaches the disk, then the process dies
        real(self, text[:len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        search.write(complete=True)
    with pytest.raises(KeyboardInterrupt):
        replace_text(tmp_path / "autotune.json", "{}")
    monkeypatch.undo()
    assert (tmp_path / "autotune.json").read_text() == before and not json.loads(before)["complete"]
    replace_text(tmp_path / "r.json", "{}")
    assert (tmp_path / "r.json").read_text() == "{}"
