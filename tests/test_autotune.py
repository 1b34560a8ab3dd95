"""compare.py --autotune: the search logic on a fake launcher, and a real sweep of the tiny preset on CPU."""

import sys
from types import SimpleNamespace

import pytest

from harness import autotune
from harness.launch import CompareError
from shared.train.config import TrainConfig
from tests.helpers import FAST, LIGHTNING, RAW, ROOT, load, run


def fake_launch(fits_up_to: int, calls: list):
    """Throughput grows with the micro-batch; larger than `fits_up_to` runs out of memory without checkpointing."""

    def launch(path, cfg, out, log):
        calls.append(cfg)
        if cfg.micro_batch > fits_up_to and not cfg.activation_checkpointing:
            raise CompareError("deepspeed run failed; reason: error: micro_batch 16 does not fit in H200")
        speed = 1000.0 * cfg.micro_batch * (0.7 if cfg.activation_checkpointing else 1.0)
        speed *= 1.1 if cfg.prefetch_bucket_size == 1_000_000_000 else 1.0
        speed *= 1.05 if cfg.compile == "blocks" else 1.0
        return SimpleNamespace(tokens_per_s_per_gpu=speed, tflops_per_gpu=speed / 100, mfu=None, peak_mem_gib=1.0,
                               step_time_s={"median": 1.0 / speed})

    return launch


def test_search_stops_at_the_first_oom_then_tries_checkpointing_then_the_knobs(tmp_path):
    calls = []
    ns = SimpleNamespace(mb_grid="4,8,16,32", budget_s=1e9, world=1)
    report = autotune.run_autotune(TrainConfig(preset="tiny"), ns, fake_launch(8, calls), tmp_path)
    tried = [(c.micro_batch, c.activation_checkpointing) for c in calls]
    # 16 runs out of memory; 32 without checkpointing is never tried
    assert tried[:5] == [(4, False), (8, False), (16, False), (16, True), (32, True)]
    assert [c.compile for c in calls[:6]] == ["none"] * 5 + ["blocks"]  # then compiled blocks on the best
    assert all(c.compile == "blocks" for c in calls[6:])  # the knobs are tuned on the compiled model
    statuses = {r["i"]: r["status"] for r in report["ranking"]}
    assert statuses[2] == "oom" and {s for i, s in statuses.items() if i != 2} == {"ok"}
    w = report["winner"]["knobs"]
    assert (w["micro_batch"], w["activation_checkpointing"], w["prefetch_bucket_size"]) == (32, True, 1_000_000_000)
    assert "--micro_batch 32 --activation_checkpointing --compile blocks" in report["winner_flags"]
    assert "+blocks" in autotune.format_autotune(report)
    assert (tmp_path / "winner_ds_config.json").is_file() and (tmp_path / "autotune.json").is_file()


def test_search_tries_deepcompile_from_the_best_micro_batch_upwards_where_cuda_is(tmp_path, monkeypatch, capsys):
    from shared.model import config as model_config

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)  # the config checks only; nothing runs
    calls = []

    def launch(path, cfg, out, log):
        calls.append(cfg)
        if cfg.micro_batch > (24 if cfg.compile == "deepcompile" else 16):
            raise CompareError("deepspeed run failed; reason: error: out of memory")
        eager = {4: 4000.0, 8: 8000.0, 16: 7500.0}  # eager stops paying above 8
        speed = 1300.0 * cfg.micro_batch if cfg.compile == "deepcompile" else eager[cfg.micro_batch]
        return SimpleNamespace(tokens_per_s_per_gpu=speed, tflops_per_gpu=speed / 100, mfu=None, peak_mem_gib=1.0,
                               step_time_s={"median": 1.0 / speed})

    ns = SimpleNamespace(mb_grid="4,8,16,32", budget_s=1e9, world=1)
    report = autotune.run_autotune(TrainConfig(preset="tiny", warmup_steps=2), ns, launch, tmp_path)
    dc = [(c.micro_batch, c.deepcompile_schedule) for c in calls if c.compile == "deepcompile"]
    assert dc[:3] == [(8, "once"), (16, "once"), (32, "once")]  # from the best (8) up to OOM
    # the knobs of the DeepCompile winner: the reduce bucket and persistence, never the prefetch bucket (its
    # passes schedule their own prefetch)
    tried = [autotune.knobs(c) for c in calls]  # effective values, the profile's filled in
    knob_phase = [k for k in tried if (k["reduce_bucket_size"], k["param_persistence_threshold"]) !=
                  (tried[0]["reduce_bucket_size"], tried[0]["param_persistence_threshold"])]
    # the reduce buckets other than the best's; of the thresholds only 1e4 keeps another set of the tiny model's
    # parameters gathered than the best's 1e6 (1e5 and 1e7 keep all 28, like 1e6)
    assert [(k["reduce_bucket_size"], k["param_persistence_threshold"]) for k in knob_phase] == [
        (50_000_000, 1_000_000), (200_000_000, 1_000_000), (500_000_000, 10_000)]
    assert all(k["compile"] == "deepcompile" and k["micro_batch"] == 16 for k in knob_phase)
    assert {k["prefetch_bucket_size"] for k in tried} == {tried[0]["prefetch_bucket_size"]}
    out = capsys.readouterr().out
    assert "prefetch bucket not tried: DeepCompile schedules its own prefetch" in out
    assert "persistence 1e+05 not tried: it keeps the same 28 parameters gathered" in out
    w = report["winner"]["knobs"]
    assert (w["compile"], w["micro_batch"]) == ("deepcompile", 16)
    assert "--micro_batch 16 --compile deepcompile --deepcompile_schedule once" in report["winner_flags"]
    assert "--coordinate_descent_tuning" not in report["winner_flags"]
    assert "+deepcompile" in autotune.format_autotune(report)


def test_persistence_thresholds_are_told_apart_by_the_parameters_they_keep_gathered():
    import torch

    from shared.model.gpt import GPT

    with torch.device("meta"):
        sizes = [p.numel() for p in GPT(TrainConfig(preset="1.5b").model()).parameters()]
    # biases and LayerNorm weights (<= 9216 elements) at 1e4 to 1e6; 1e7 adds the position embedding (4.7M) and
    # the 24 attention output projections (5.3M each)
    assert [autotune.persisted(sizes, t) for t in autotune.PERSISTENCE] == [194, 194, 194, 219]
    assert autotune.persisted(sizes, 2304) == 146 and autotune.persisted(sizes, 2303) == 0  # at most: inclusive


def test_search_without_cuda_says_deepcompile_was_not_tried(tmp_path, capsys):
    calls = []
    ns = SimpleNamespace(mb_grid="4", budget_s=1e9, world=1)
    autotune.run_autotune(TrainConfig(preset="tiny"), ns, fake_launch(8, calls), tmp_path)
    assert all(c.compile != "deepcompile" and c.zero3_step == "fast" for c in calls)
    out = capsys.readouterr().out
    assert "DeepCompile not tried: --compile deepcompile needs a CUDA GPU" in out
    assert "fused optimizer step not tried: its Triton kernel needs a CUDA GPU to be timed" in out
    assert "bias + GELU backward kernel not tried: its Triton kernel needs a CUDA GPU to be timed" in out
    assert not any(c.triton_gelu_grad for c in calls)
    assert "padded vocabulary, Triton loss and dropout not tried: the Triton kernels need a CUDA GPU" in out
    assert not any(c.triton_loss or c.triton_dropout or c.vocab_multiple for c in calls)


def speed_with_the_fused_step(calls: list, gain: float, gelu_gain: float = 1.0, together_gain: float = 1.0):
    """DeepCompile 1.3x eager, the fused optimizer step `gain` on top, the bias + GELU kernel `gelu_gain`, the
    padded vocabulary with the Triton loss and dropout `together_gain`; every micro-batch fits."""

    def launch(path, cfg, out, log):
        calls.append(cfg)
        speed = 1000.0 * cfg.micro_batch * (1.3 if cfg.compile == "deepcompile" else 1.0)
        speed *= gain if cfg.zero3_step == "fused" else 1.0
        speed *= gelu_gain if cfg.triton_gelu_grad else 1.0
        speed *= together_gain if cfg.vocab_multiple == 128 and cfg.triton_loss and cfg.triton_dropout else 1.0
        return SimpleNamespace(tokens_per_s_per_gpu=speed, tflops_per_gpu=speed / 100, mfu=None, peak_mem_gib=1.0,
                               step_time_s={"median": 1.0 / speed})

    return launch


def search_on_a_pretend_gpu(tmp_path, monkeypatch, launch, **train) -> dict:
    """The search over micro-batches 4 and 8 of the tiny preset as if CUDA were there (the config checks only;
    nothing runs on a GPU), its runs `launch`'s."""
    from shared.model import config as model_config

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    return autotune.run_autotune(TrainConfig(preset="tiny", warmup_steps=2, **train),
                                 SimpleNamespace(mb_grid="4,8", budget_s=1e9, world=1), launch, tmp_path)


@pytest.mark.parametrize("gain", [1.015, 0.98])
def test_search_tries_the_fused_optimizer_step_on_the_best_where_cuda_is(tmp_path, monkeypatch, gain):
    from shared.model import config as model_config

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)  # the config checks only; nothing runs
    calls = []
    ns = SimpleNamespace(mb_grid="4,8", budget_s=1e9, world=1)
    report = autotune.run_autotune(TrainConfig(preset="tiny", warmup_steps=2), ns,
                                   speed_with_the_fused_step(calls, gain), tmp_path)
    i = next(i for i, c in enumerate(calls) if c.zero3_step == "fused")
    assert all(c.zero3_step == "fast" for c in calls[:i])  # tried after DeepCompile, on the best so far
    assert (calls[i].compile, calls[i].micro_batch) == ("deepcompile", 8)
    knob_phase = calls[i + 1:]  # the ZeRO-3 knobs, from the faster of the two steps
    assert knob_phase and {c.zero3_step for c in knob_phase} == {"fused" if gain > 1 else "fast"}
    w = report["winner"]["knobs"]
    assert w["zero3_step"] == ("fused" if gain > 1 else "fast")
    assert ("--zero3_step fused" in report["winner_flags"]) == (gain > 1)
    assert "step fused" in autotune.format_autotune(report)


@pytest.mark.parametrize("gelu_gain", [1.01, 0.99])
def test_search_tries_the_bias_gelu_kernel_after_the_optimizer_step(tmp_path, monkeypatch, gelu_gain):
    calls = []
    report = search_on_a_pretend_gpu(tmp_path, monkeypatch, speed_with_the_fused_step(calls, 1.015, gelu_gain))
    i = next(i for i, c in enumerate(calls) if c.triton_gelu_grad)
    assert not any(c.triton_gelu_grad for c in calls[:i])
    # on the best so far: DeepCompile, the largest micro-batch, the fused step
    assert (calls[i].compile, calls[i].micro_batch, calls[i].zero3_step) == ("deepcompile", 8, "fused")
    assert {c.triton_gelu_grad for c in calls[i + 1:]} == {gelu_gain > 1}  # the ZeRO-3 knobs from the faster one
    assert report["winner"]["knobs"]["triton_gelu_grad"] is (gelu_gain > 1)
    assert ("--triton_gelu_grad" in report["winner_flags"]) == (gelu_gain > 1)
    assert "+gelu_kernel" in autotune.format_autotune(report)


@pytest.mark.parametrize("together_gain", [1.017, 0.99])
def test_search_tries_the_gpu_defaults_vocabulary_loss_and_dropout_kernels_last(tmp_path, monkeypatch, together_gain):
    calls = []
    report = search_on_a_pretend_gpu(tmp_path, monkeypatch,
                                     speed_with_the_fused_step(calls, 1.015, 1.01, together_gain))
    i = next(i for i, c in enumerate(calls) if c.triton_loss)
    assert not any(c.triton_loss or c.triton_dropout or c.vocab_multiple for c in calls[:i])
    # on the best so far (DeepCompile, the largest micro-batch, both kernels), the three together
    c = calls[i]
    assert (c.compile, c.micro_batch, c.zero3_step, c.triton_gelu_grad) == ("deepcompile", 8, "fused", True)
    assert (c.vocab_multiple, c.triton_loss, c.triton_dropout) == (128, True, True)
    won = together_gain > 1
    assert {(c.vocab_multiple, c.triton_loss) for c in calls[i + 1:]} == {(128, True) if won else (None, False)}
    w = report["winner"]["knobs"]
    assert (w["vocab_multiple"], w["triton_loss"], w["triton_dropout"]) == ((128, True, True) if won else
                                                                            (None, False, False))
    assert ("--vocab_multiple 128 --triton_loss --triton_dropout" in report["winner_flags"]) == won
    assert "+vocab128 +triton_loss +triton_dropout" in autotune.format_autotune(report)


def test_search_leaves_out_of_those_kernels_what_the_flags_rule_out(tmp_path, monkeypatch):
    """fp16: no Triton loss (measured in bf16 only); no fused bias + dropout + add: no Triton dropout; a padding asked
    for is kept."""
    from shared.model import config as model_config

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    for n, (overrides, expect) in enumerate(((dict(precision="fp16"), (128, False, True)),
                              (dict(fused_bias_dropout_add=False, vocab_multiple=64), (64, True, False)),
                              # asked for in fp16, the Triton loss stays on: the candidate only turns kernels on
                              (dict(precision="fp16", triton_loss=True), (128, True, True)))):
        calls, out = [], tmp_path / str(n)
        out.mkdir()
        base = TrainConfig(preset="tiny", warmup_steps=2, **overrides)
        autotune.run_autotune(base, SimpleNamespace(mb_grid="4", budget_s=1e9, world=1),
                              speed_with_the_fused_step(calls, 1.0), out)
        kernels = ("vocab_multiple", "triton_loss", "triton_dropout")
        last = next(c for c in calls if any(getattr(c, k) != getattr(base, k) for k in kernels))
        assert (last.vocab_multiple, last.triton_loss, last.triton_dropout) == expect, overrides
        if overrides.get("triton_loss"):  # asked for: no candidate turns it off
            assert all(c.triton_loss for c in calls)


@pytest.mark.parametrize("overrides, message", [
    (dict(fused_bias_gelu=False), "it is the backward of the fused bias + GELU, and --fused_bias_gelu is false")])
def test_search_does_not_try_the_bias_gelu_kernel_where_it_cannot_run(tmp_path, monkeypatch, capsys, overrides,
                                                                      message):
    from shared.model import config as model_config

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    calls = []
    autotune.run_autotune(TrainConfig(preset="tiny", warmup_steps=2, **overrides),
                          SimpleNamespace(mb_grid="4", budget_s=1e9, world=1),
                          speed_with_the_fused_step(calls, 1.0, 1.5), tmp_path)
    assert calls and not any(c.triton_gelu_grad for c in calls)
    assert f"bias + GELU backward kernel not tried: {message}" in capsys.readouterr().out


def test_the_winner_flags_keep_the_kernel_tuning_its_compiled_candidates_ran_with(tmp_path, monkeypatch):
    from shared.model import config as model_config

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    report = autotune.run_autotune(TrainConfig(preset="tiny", warmup_steps=2, coordinate_descent_tuning=True),
                                   SimpleNamespace(mb_grid="4", budget_s=1e9, world=1),
                                   speed_with_the_fused_step([], 1.0), tmp_path)
    assert report["winner"]["knobs"]["compile"] == "deepcompile"
    assert "--compile deepcompile --deepcompile_schedule once --coordinate_descent_tuning" in report["winner_flags"]


@pytest.mark.parametrize("overrides, message", [
    (dict(zero3_step="deepspeed"), "--zero3_step deepspeed asks for DeepSpeed's own step"),
    (dict(stage=2), None)])  # ZeRO 1/2 run no ZeRO-3 step: nothing to say
def test_search_does_not_try_the_fused_step_for_another_step_or_stage(tmp_path, monkeypatch, capsys,
                                                                              overrides, message):
    from shared.model import config as model_config

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    calls = []
    train = TrainConfig(preset="tiny", warmup_steps=2, **overrides)
    autotune.run_autotune(train, SimpleNamespace(mb_grid="4", budget_s=1e9, world=1),
                          speed_with_the_fused_step(calls, 1.5), tmp_path)
    assert calls and {c.zero3_step for c in calls} == {train.zero3_step}
    out = capsys.readouterr().out
    if message:  # ZeRO-3 with DeepSpeed's step: said once, with its reason
        assert out.count("fused optimizer step not tried:") == 1, out
        assert f"fused optimizer step not tried: {message}" in out, out
    else:  # ZeRO 1/2: no ZeRO-3 step to replace, so the fused step is neither tried nor said to be left out
        assert "optimizer step" not in out, out


def test_keep_runs_takes_a_search_written_with_other_knobs(tmp_path):
    import json

    train, ns = TrainConfig(preset="tiny"), SimpleNamespace(mb_grid="4,8", budget_s=1e9, world=1)
    first = autotune.run_autotune(train, ns, fake_launch(8, []), tmp_path)
    path = tmp_path / "autotune.json"
    earlier = json.loads(path.read_text())
    for r in earlier["ranking"]:
        del r["knobs"]["zero3_step"], r["knobs"]["triton_gelu_grad"]
        r["knobs"]["fused_loss"] = False  # a knob until the chunked loss was removed
    best = earlier["ranking"][0]  # the fastest, run again with the chunked loss: no configuration of this version
    earlier["ranking"].append({**best, "i": 99, "tokens_per_s_per_gpu": 2 * best["tokens_per_s_per_gpu"],
                               "knobs": {**best["knobs"], "fused_loss": True}})
    path.write_text(json.dumps(earlier))
    kept, _ = autotune.kept_candidates(train, 1, tmp_path)
    assert len(kept) == len(first["ranking"]) and {r["knobs"]["zero3_step"] for r in kept} == {"fast"}
    assert {r["knobs"]["triton_gelu_grad"] for r in kept} == {False}
    assert not any("fused_loss" in r["knobs"] for r in kept) and 99 not in {r["i"] for r in kept}
    calls = []
    report = autotune.run_autotune(train, ns, fake_launch(8, calls), tmp_path, kept)
    assert calls == [] and report["winner"]["knobs"] == first["winner"]["knobs"]  # nothing measured twice


def test_search_under_zero2_has_no_zero3_knobs_and_formats(tmp_path):
    calls = []
    ns = SimpleNamespace(mb_grid="4,8", budget_s=1e9, world=1)
    report = autotune.run_autotune(TrainConfig(preset="tiny", stage=2), ns, fake_launch(8, calls), tmp_path)
    assert len(calls) == 3  # micro-batches 4 and 8, compiled blocks: no ZeRO-3 knob phase
    text = autotune.format_autotune(report)
    assert "reduce 5e+08" in text and "prefetch" not in text and "persist" not in text


def test_search_respects_the_budget(tmp_path):
    calls = []
    ns = SimpleNamespace(mb_grid="4,8,16,32", budget_s=0.0, world=1)
    report = autotune.run_autotune(TrainConfig(preset="tiny"), ns, fake_launch(64, calls), tmp_path)
    assert calls == [] and report["winner"] is None and report["budget_stopped_before"]["micro_batch"] == 4
    text = autotune.format_autotune(report)
    assert "no candidate ran" in text and "budget spent: the search stopped before mb 4" in text


def test_a_budget_spent_in_the_knob_phase_ends_the_search_there(tmp_path, monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(autotune, "persisted", lambda sizes, threshold: 7)  # every threshold would be announced
    launch = fake_launch(8, [])

    def ten_seconds_each(path, cfg, out, log):
        clock[0] += 10.0
        return launch(path, cfg, out, log)

    ns = SimpleNamespace(mb_grid="4,8", budget_s=55.0, world=1)
    report = autotune.run_autotune(TrainConfig(preset="tiny"), ns, ten_seconds_each, tmp_path)
    # eager 4 and 8, compiled blocks, prefetch 5e7 and 2e8: the sixth would end past 55 s
    assert len(report["ranking"]) == 5 and report["budget_stopped_before"]["prefetch_bucket_size"] == 1_000_000_000
    out = capsys.readouterr().out
    assert "persistence 1e" not in out  # no later knob announced once the budget is spent
    assert "budget spent: the search stopped before mb 8 +blocks prefetch 1e+09" in autotune.format_autotune(report)


class Cut(BaseException):
    """The search killed mid-candidate (a time limit, Ctrl-C): nothing of that candidate is recorded."""


def test_a_cut_search_continues_with_keep_runs_and_measures_each_candidate_once(tmp_path):
    train, ns = TrainConfig(preset="tiny"), SimpleNamespace(mb_grid="4,8,16,32", budget_s=1e9, world=1)
    whole = []
    (tmp_path / "whole").mkdir()
    expected = autotune.run_autotune(train, ns, fake_launch(8, whole), tmp_path / "whole")  # uninterrupted
    first, launch = [], fake_launch(8, [])

    def cut_at_the_fourth(path, cfg, out, log):
        if len(first) == 3:
            raise Cut
        first.append(cfg)
        return launch(path, cfg, out, log)

    ns.commands = ["python compare.py --autotune (first)"]
    with pytest.raises(Cut):
        autotune.run_autotune(train, ns, cut_at_the_fourth, tmp_path)
    on_disk = load(tmp_path / "autotune.json")  # rewritten after each finished candidate
    assert on_disk["complete"] is False and len(on_disk["ranking"]) == 3 and on_disk["winner"]["i"] == 1

    ns.commands = ["python compare.py --autotune (first)"]  # compare.py's: the invocations of the search
    kept, commands = autotune.kept_candidates(train, 1, tmp_path)
    assert commands == ["python compare.py --autotune (first)"]
    ns.commands = [*commands, "python compare.py --autotune --keep_runs"]
    second = []
    report = autotune.run_autotune(train, ns, fake_launch(8, second), tmp_path, kept)
    assert first + second == whole  # every candidate measured once, in the uninterrupted search's order
    assert report["complete"] and report["kept_candidates"] == 3 and load(tmp_path / "autotune.json")["complete"]
    assert report["commands"] == ["python compare.py --autotune (first)", "python compare.py --autotune --keep_runs"]
    winner = load(tmp_path / "winner_ds_config.json")
    assert (winner["command"], winner["commands"]) == (report["commands"][-1], report["commands"])
    assert sorted(r["i"] for r in report["ranking"]) == list(range(len(whole)))  # kept ones keep their numbers
    assert report["winner"]["knobs"] == expected["winner"]["knobs"]
    assert sum(bool(r.get("kept")) for r in report["ranking"]) == 3
    text = autotune.format_autotune(report)
    assert f"searched {len(second)} candidates" in text and "3 kept from an earlier search" in text
    assert "(kept)" in text


def test_keep_runs_runs_a_failed_candidate_again_and_keeps_its_log(tmp_path):
    train, ns = TrainConfig(preset="tiny"), SimpleNamespace(mb_grid="4,8", budget_s=1e9, world=1)
    launch = fake_launch(8, [])

    def mb8_times_out(path, cfg, out, log):
        if cfg.micro_batch == 8 and not cfg.activation_checkpointing:
            raise CompareError(f"deepspeed run timed out after 400 s; log: {log}")
        return launch(path, cfg, out, log)

    first = autotune.run_autotune(train, ns, mb8_times_out, tmp_path)
    failed = [r for r in first["ranking"] if r["status"] == "failed"]
    assert [r["knobs"]["micro_batch"] for r in failed] == [8]
    kept, _ = autotune.kept_candidates(train, 1, tmp_path)
    assert failed[0]["i"] not in [r["i"] for r in kept] and len(kept) == len(first["ranking"]) - 1
    calls = []
    report = autotune.run_autotune(train, ns, fake_launch(8, calls), tmp_path, kept)
    assert calls and calls[0].micro_batch == 8  # the failed candidate first, as in the search's order
    numbers = [r["i"] for r in report["ranking"]]
    assert len(numbers) == len(set(numbers)) and min(n for n in numbers if n not in [r["i"] for r in kept]) > max(
        r["i"] for r in kept)  # new numbers after every kept one: the failed run's log is not overwritten
    assert all(r["status"] == "ok" for r in report["ranking"])


def test_keep_runs_refuses_a_search_made_with_other_settings(tmp_path):
    train, ns = TrainConfig(preset="tiny"), SimpleNamespace(mb_grid="4", budget_s=1e9, world=1)
    assert autotune.kept_candidates(train, 1, tmp_path) == ([], [])  # nothing to keep: a fresh search
    report = autotune.run_autotune(train, ns, fake_launch(8, []), tmp_path)
    assert [r["i"] for r in autotune.kept_candidates(train, 1, tmp_path)[0]] == list(range(len(report["ranking"])))
    with pytest.raises(ValueError, match="other settings \\(seed 1234 there vs 7 now\\)"):
        autotune.kept_candidates(TrainConfig(preset="tiny", seed=7), 1, tmp_path)
    with pytest.raises(ValueError, match="world_size 1 there vs 2 now"):
        autotune.kept_candidates(train, 2, tmp_path)
    (tmp_path / "autotune.json").write_text('{"winner": null}')  # an older report: no settings recorded
    with pytest.raises(ValueError, match="is not an autotune report this version wrote"):
        autotune.kept_candidates(train, 1, tmp_path)


def test_keep_runs_with_autotune_checks_the_earlier_search_before_any_run(tmp_path):
    (tmp_path / "autotune.json").write_text("not json")
    before = (tmp_path / "autotune.json").read_text()
    proc = run([sys.executable, ROOT / "compare.py", "--autotune", "--keep_runs", "--out", tmp_path], check=False,
               timeout=120)
    assert proc.returncode == 2 and "--keep_runs: " in proc.stderr and "is not an autotune report" in proc.stderr
    assert (tmp_path / "autotune.json").read_text() == before  # nothing lost


@pytest.mark.parametrize("args, message", [(["--mb_grid", "a,b"], "--mb_grid must be comma-separated integers"),
                                           (["--explain", "--autotune"], "separate modes"),
                                           (["--keep_runs"], "it needs --out")])
def test_bad_autotune_arguments(tmp_path, args, message):
    out = [] if "--keep_runs" in args else ["--out", tmp_path / "report"]  # that refusal is of the missing --out
    proc = run([sys.executable, ROOT / "compare.py", "--autotune", *args, *out], check=False, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)  # above the sum of its subprocess timeouts (tests/test_timeouts.py)
def test_autotune_sweep_on_cpu_and_both_paths_accept_the_winner(tmp_path):
    # The candidates are fixed by the search, not by the machine's speed: a budget that never binds, and ZeRO-2
    # (no ZeRO-3 knob phase): micro-batches 1 and 2 (both fit on a CPU), then compiled blocks on the faster.
    run([sys.executable, ROOT / "compare.py", "--autotune", "--mb_grid", "1,2", "--stage", "2", "--steps", "3",
         "--warmup_steps", "1", "--budget_s", "1000000", "--out", tmp_path], timeout=400)
    report = load(tmp_path / "autotune.json")
    assert report["complete"] and report["winner"] is not None and len(report["ranking"]) == 3
    assert len(report["commands"]) == 1 and report["commands"][0] == report["command"]
    assert load(tmp_path / "winner_ds_config.json")["command"] == report["command"]  # how to make it again
    assert all(r["status"] == "ok" for r in report["ranking"])
    assert sorted(r["knobs"]["micro_batch"] for r in report["ranking"] if r["knobs"]["compile"] == "none") == [1, 2]
    assert sum(r["knobs"]["compile"] == "blocks" for r in report["ranking"]) == 1
    flags = report["winner_flags"].split()  # what the printed winner line tells the user to pass
    assert flags[:2] == ["--ds_config", str(tmp_path / "winner_ds_config.json")]
    for script, out in ((RAW, "raw.json"), (LIGHTNING, "pl.json")):
        run([sys.executable, script, *FAST, "--stage", "2", *flags, "--out", tmp_path / out])
    assert load(tmp_path / "raw.json")["ds_config"] == load(tmp_path / "pl.json")["ds_config"]
    assert load(tmp_path / "raw.json")["ds_config"]["zero_optimization"]["reduce_bucket_size"] == \
        report["winner"]["knobs"]["reduce_bucket_size"]


def test_the_header_says_what_the_search_runs(tmp_path, monkeypatch, capsys):
    import compare

    def stop(*args, **kwargs):
        raise SystemExit(0)

    monkeypatch.setattr(compare.autotune, "run_autotune", stop)
    with pytest.raises(SystemExit):
        compare.main(["--autotune", "--mb_grid", "1,2", "--steps", "3", "--warmup_steps", "1", "--out", str(tmp_path)])
    header = capsys.readouterr().out.splitlines()[0]
    assert "--autotune over micro-batches 1,2, one run per candidate" in header and "repeats" not in header
