"""benchmarks/ablation.py, ds_autotuner.py and plot_training.py as a user runs them (CPU, tiny preset)."""

import dataclasses
import importlib.util
import json
import signal
import subprocess
import sys
import time

import pytest

from harness.budget import kinds_ms
from shared.train.config import TrainConfig
from tests.helpers import ROOT, load, python_without_interpreter, run
from tests.helpers import env as run_env

ABLATION = ROOT / "benchmarks" / "ablation.py"
PLOT = ROOT / "benchmarks" / "plot_training.py"
DS_AUTOTUNER = ROOT / "benchmarks" / "ds_autotuner.py"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # above the sum of its subprocess timeouts (tests/test_timeouts.py)
def test_ablation_runs_both_paths_per_configuration_and_sweeps_the_micro_batch(tmp_path):
    # a first call measures naive and +bias_dropout_add; the second keeps both (--keep), reusing the one it names
    # step 1 profiled in every run (a warm-up step): the report adds the profiled step by kind of kernel
    run([sys.executable, ABLATION, "--configs", "naive,+bias_dropout_add", "--mb_sweep", "", "--profile_step", "1",
         "--out", tmp_path], timeout=300)
    first = {r["path"]: r["tflops_per_gpu"] for r in load(tmp_path / "ablation.json")["rows"] if r["config"] == "naive"}
    proc = run([sys.executable, ABLATION, "--configs", "+bias_dropout_add,all", "--mb_sweep", "4", "--keep",
                "--profile_step", "1", "--out", tmp_path], timeout=600)
    report = load(tmp_path / "ablation.json")
    rows = {(r["config"], r["path"]): r for r in report["rows"]}
    assert set(rows) == {(c, p) for c in ("naive", "+bias_dropout_add", "all") for p in ("deepspeed", "lightning")}
    assert all(r["ok"] for r in rows.values()), [r.get("error") for r in rows.values()]
    assert report["kept"] == ["+bias_dropout_add", "naive"] and "+bias_dropout_add: kept from" in proc.stdout
    assert {p: rows[("naive", p)]["tflops_per_gpu"] for p in first} == first
    assert not rows[("all", "deepspeed")].get("kept")
    assert rows[("+bias_dropout_add", "deepspeed")]["fused"]["bias_dropout_add"] is True
    assert rows[("naive", "lightning")]["fused"]["bias_dropout_add"] is False
    assert rows[("all", "deepspeed")]["fused"]["compile"] == "blocks"
    assert rows[("all", "deepspeed")]["fused"]["coordinate_descent_tuning"] is False  # CPU: inductor emits C++
    assert rows[("naive", "deepspeed")]["flags"]["zero3_step"] == "deepspeed"
    assert rows[("all", "deepspeed")]["flags"]["zero3_step"] == "fast"
    assert rows[("all", "lightning")]["fused"]["dynamo_graph_breaks"] == 0
    assert report["largest_micro_batch_without_checkpointing"] == {"all": 4}  # naive, not named, is not swept
    assert "| naive |" in proc.stdout and (tmp_path / "ablation.md").read_text().count("\n|") >= 4
    assert set(rows[("all", "deepspeed")]["profiled_step_ms"]) == {"matmul", "attention", "compiled (triton)", "other",
                                                                   "idle"}
    assert "| naive | Lightning | " in (tmp_path / "ablation.md").read_text()  # the profiled-step table


def test_ablation_refuses_an_unknown_configuration(tmp_path):
    proc = run([sys.executable, ABLATION, "--configs", "naive,+turbo", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "unknown configuration(s) ['+turbo']" in proc.stderr
    # a list that starts with a lever taking something off is the option's value, not an option
    proc = run([sys.executable, ABLATION, "--configs", "-compile,naive", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "unknown configuration(s) ['-compile']" in proc.stderr
    proc = run([sys.executable, ABLATION, "--paths", "deepspeed,fsdp", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "--paths takes a comma-separated subset" in proc.stderr
    proc = run([sys.executable, ABLATION, "--profile_sync", "false", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "profile_sync false changes how the profiled step is recorded" in proc.stderr


def test_ablation_last_mile_set_needs_cuda_and_keep_refuses_other_settings(tmp_path):
    proc = run([sys.executable, ABLATION, "--set", "last_mile", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "DeepCompile, which needs a CUDA GPU" in proc.stderr  # one line, no run
    assert not (tmp_path / "ablation.json").exists()
    proc = run([sys.executable, ABLATION, "--set", "last_mile", "--mb_sweep", "24", "--out", tmp_path], check=False,
               timeout=60)
    assert proc.returncode == 2 and "--mb_sweep sweeps the naive and all configurations" in proc.stderr
    # an ablation.json of other settings (here another micro-batch) is never mixed in
    ablation = load_module("ablation", ABLATION)
    cpu_base = TrainConfig(preset="tiny", stage=3, precision="fp32", micro_batch=2, steps=6, warmup_steps=2,
                           zero_profile="original", log_every=3)  # what the command below runs
    earlier = {"base": dataclasses.asdict(dataclasses.replace(cpu_base, micro_batch=4)),
               "versions": ablation.versions(), "device": None, "rows": [{"config": "naive", "ok": True}]}
    (tmp_path / "ablation.json").write_text(json.dumps(earlier))
    proc = run([sys.executable, ABLATION, "--configs", "naive", "--keep", "--out", tmp_path], check=False,
               timeout=60)
    assert proc.returncode == 2 and "was measured with other base settings (micro_batch)" in proc.stderr
    # one written before options were removed (docs/ledger.md) records their settings and packages: not a difference
    earlier.update(base={**dataclasses.asdict(cpu_base), "python_gc": "freeze", "fused_loss": False},
                   versions={**ablation.versions(), "liger-kernel": "0.8.5"})
    (tmp_path / "ablation.json").write_text(json.dumps(earlier))
    assert ablation.earlier_report(tmp_path / "ablation.json", cpu_base) == earlier


def test_every_last_mile_lever_is_a_valid_change_of_compare_gpu_default(monkeypatch):
    """Each lever of --set last_mile on compare.py's GPU default is a config the runs accept: a lever that clashes
    with a default (DeepSpeed's own optimizer step against the norm check on the device) turns that default off."""
    from shared.model import config as model_config
    from shared.train.profiles import PROFILES

    GPU_DEEPCOMPILE_DEFAULTS = PROFILES["fast"].settings

    ablation = load_module("ablation", ABLATION)
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)  # DeepCompile and the fusions' defaults
    base = TrainConfig(preset="1.5b", stage=3, precision="bf16", **GPU_DEEPCOMPILE_DEFAULTS)
    for name, flags in ablation.LAST_MILE.items():
        cfg = TrainConfig(preset="1.5b", stage=3, precision="bf16", **{**GPU_DEEPCOMPILE_DEFAULTS, **flags})
        assert all(getattr(cfg, k) == v for k, v in flags.items()), name
        # every lever changes the default (one that repeats it would rate the baseline against itself)
        assert name.startswith("baseline") or cfg != base, name
    assert GPU_DEEPCOMPILE_DEFAULTS["triton_gelu_grad"] and ablation.LAST_MILE["-triton_gelu_grad"] == {
        "triton_gelu_grad": False}
    # the ablation's runs are one-GPU runs, whose default waits for the backward's end on the device
    assert GPU_DEEPCOMPILE_DEFAULTS["deepcompile_backward_wait"] == "device"
    assert ablation.LAST_MILE["-device_backward_wait"] == {"deepcompile_backward_wait": "host"}
    assert GPU_DEEPCOMPILE_DEFAULTS["grad_norm_check"] == "device"
    assert ablation.LAST_MILE["-device_norm_check"] == {"grad_norm_check": "host"}
    # the padded vocabulary, the Triton loss and the Triton dropout are in the default; -together is exactly the
    # three single levers that turn them off
    assert (GPU_DEEPCOMPILE_DEFAULTS["vocab_multiple"], GPU_DEEPCOMPILE_DEFAULTS["triton_loss"],
            GPU_DEEPCOMPILE_DEFAULTS["triton_dropout"]) == (128, True, True)
    assert ablation.LAST_MILE["-together"] == {**ablation.LAST_MILE["-vocab128"], **ablation.LAST_MILE["-triton_loss"],
                                               **ablation.LAST_MILE["-triton_dropout"]}


def test_ablation_table_rates_each_lever_against_the_mean_of_the_baseline_runs():
    ablation = load_module("ablation", ABLATION)

    def row(config, tflops, mb=16, ok=True):
        return {"config": config, "path": "deepspeed", "ok": ok, "micro_batch": mb, "tflops_per_gpu": tflops,
                "peak_mem_gib": 90.0, "step_time_s": {"min": 0.7, "max": 0.8}, "oom": not ok, "error": "oom"}

    report = {"reference": "baseline", "base": {"micro_batch": 16}, "largest_micro_batch_without_checkpointing": {},
              "rows": [row("baseline", 480.0), row("-vocab128", 490.0), row("+mb24", 0, 24, False),
                       row("baseline_again", 484.0)]}
    text = ablation.table(report)
    assert "| -vocab128 | 490.0 [700-800 ms] | 1.017 | 90.0 |" in text  # 490 / 482
    assert "| +mb24 | failed, mb 24: out of memory |" in text
    assert "raw baseline runs: 480.0, 484.0 TFLOPs/GPU" in text and "differ by 0.83%" in text
    assert "Lightning" not in text  # one path measured: no Lightning columns
    assert "Profiled step" not in text  # no run was profiled


def test_ablation_table_shows_each_profiled_step_by_kind_against_the_baselines():
    ablation = load_module("ablation", ABLATION)

    def row(config, matmul, triton, idle, profiled=True):
        r = {"config": config, "path": "deepspeed", "ok": True, "micro_batch": 16, "tflops_per_gpu": 500.0,
             "peak_mem_gib": 90.0, "step_time_s": {"min": 0.7, "max": 0.8}}
        kinds = {"matmul": matmul, "attention": 120.0, "compiled (triton)": triton, "optimizer": 11.0, "other": 2.0}
        if profiled:
            r["profiled_step_ms"] = {**kinds_ms(kinds), "idle": idle}
        return r

    report = {"reference": "baseline", "base": {"micro_batch": 16}, "largest_micro_batch_without_checkpointing": {},
              "rows": [row("baseline", 440.0, 64.0, 30.0), row("+lever", 450.0, 58.0, 31.0),
                       row("kept_unprofiled", 0, 0, 0, profiled=False), row("baseline_again", 444.0, 64.0, 26.0)]}
    text = ablation.table(report)
    assert "| configuration | path | matmul | attention | compiled (triton) | other | idle |" in text
    # against the baselines' mean: matmul 442, triton 64, other 11 + 2, idle 28
    assert "| +lever | raw | 450.0 (+8.0) | 120.0 (+0.0) | 58.0 (-6.0) | 13.0 (+0.0) | 31.0 (+3.0) |" in text
    assert "| baseline | raw | 440.0 (-2.0) |" in text and "kept_unprofiled | raw" not in text


def test_plot_training_draws_the_committed_h200_runs(tmp_path):
    results = sorted((ROOT / "benchmarks" / "results" / "kjv350m_1xh200").glob("kjv350m_*ing.json")) + \
        sorted((ROOT / "benchmarks" / "results" / "kjv350m_1xh200").glob("kjv350m_deepspeed.json"))
    assert len(results) == 2
    run([sys.executable, PLOT, *results, "--out", tmp_path / "loss.png"], timeout=120)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = run([sys.executable, PLOT, tmp_path / "missing.json", "--out", tmp_path / "x.png"], check=False, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    (tmp_path / "train.log").write_text("step 1 loss 10.8\n")  # not a RunResult JSON: named, no traceback
    proc = run([sys.executable, PLOT, tmp_path / "train.log", "--out", tmp_path / "x.png"], check=False, timeout=120)
    assert proc.returncode == 2 and "train.log is not a readable JSON file" in proc.stderr
    run([sys.executable, PLOT, results[0], "--out", tmp_path / "curves"], timeout=120)  # no suffix: that file, a PNG
    assert (tmp_path / "curves").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "curves.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # above the sum of its subprocess timeouts (tests/test_timeouts.py)
def test_deepspeeds_autotuner_drives_the_raw_loop_and_meets_our_winner(tmp_path):
    # what compare.py --autotune writes, reduced to what --versus reads: its winner's knobs
    winner = {"micro_batch": 2, "activation_checkpointing": False, "prefetch_bucket_size": 50_000_000,
              "reduce_bucket_size": 500_000_000, "param_persistence_threshold": 1_000_000, "compile": "none"}
    (tmp_path / "autotune.json").write_text(json.dumps({"winner": {"knobs": winner}}))
    out = tmp_path / "dsat"
    flags = ["--steps", "6", "--warmup_steps", "2", "--out", out]
    run([sys.executable, DS_AUTOTUNER, "--mb_list", "1,2", *flags], timeout=900)
    report = load(out / "ds_autotuner.json")
    assert "versus" not in report
    # then the head-to-head against our winner, from the same autotuner results (--reuse: no re-tuning)
    proc = run([sys.executable, DS_AUTOTUNER, *flags, "--versus", tmp_path / "autotune.json", "--repeats", "1",
                "--reuse"], timeout=600)
    report = load(out / "ds_autotuner.json")
    assert "--reuse" in report["versus_command"] and "--reuse" not in report["command"]
    exps = {(e["micro_batch"], e["grad_accum"]): e for e in report["experiments"]}
    # DeepSpeed's fast mode: one experiment per micro-batch, gradient accumulation filling the largest
    assert set(exps) == {(1, 2), (2, 1)} and all(e["status"] == "ok" for e in exps.values()), exps
    assert all(e["tokens_per_s_per_gpu"] > 0 and e["zero_optimization"] == {"stage": 3} for e in exps.values())
    best = max(exps.values(), key=lambda e: e["tokens_per_s_per_gpu"])
    assert (report["optimal"]["micro_batch"], report["optimal"]["grad_accum"]) == (best["micro_batch"],
                                                                                   best["grad_accum"])
    v = report["versus"]
    assert all("error" not in r for rs in v["runs"].values() for r in rs), v["runs"]
    assert v["ratio_ours_over_deepspeed"]["n"] == 1 and v["ratio_ours_over_deepspeed"]["median"] > 0
    theirs = load(out / "versus" / "deepspeed_autotuner_0.json")
    assert theirs["ds_config"]["zero_optimization"]["stage"] == 3 and "autotuning" not in theirs["ds_config"]
    assert load(out / "versus" / "ours_0.json")["ds_config"]["zero_optimization"]["stage3_prefetch_bucket_size"] \
        == 50_000_000
    assert "ours / DeepSpeed's:" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--compile", "blocks"], "--compile blocks cannot be autotuned by DeepSpeed"),
    (["--mb_list", "2,x"], "--mb_list must be comma-separated integers"),
    (["--mb_list", "0,2"], "--mb_list needs positive micro-batches"),
    (["--start_profile_step", "4", "--end_profile_step", "3"], "need 0 <= --start_profile_step <="),
    (["--versus", "nope/autotune.json"], "--versus 'nope/autotune.json' does not exist"),
    (["--ds_config", "x.json"], "this script writes the autotuner's config itself"),
    (["--reuse"], "--reuse needs --versus and a finished autotuner run in --out"),
    (["--tuner_timeout", "0"], "--tuner_timeout and --timeout must be positive seconds, got 0 and 900"),
])
def test_ds_autotuner_bad_input_exits_2_before_any_run(tmp_path, args, message):
    proc = run([sys.executable, DS_AUTOTUNER, *args, "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_ds_autotuner_refuses_a_file_as_its_out_folder(tmp_path, capsys):
    (tmp_path / "ds.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        _ds_autotuner().parse(["--out", str(tmp_path / "ds.json")])
    assert e.value.code == 2 and f"--out {tmp_path / 'ds.json'} is a file" in capsys.readouterr().err


def load_module(name, path):
    """A benchmark script imported as a module (they live outside the installed packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ds_autotuner():
    return load_module("ds_autotuner", DS_AUTOTUNER)


def test_ds_autotuner_reads_partial_and_failed_experiments(tmp_path):
    mod = _ds_autotuner()
    (tmp_path / "profile_model_info").mkdir()
    (tmp_path / "profile_model_info" / "stderr.log").write_text("RuntimeError: NCCL boom\n")
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3}}
    for name, metrics, stderr in (("ok", '{"throughput": 10.0, "latency": 1600000.0}', ""),
                                  ("cut", '{"throughput": 1', "warning only\n"),
                                  ("oom", None, "error: micro_batch 8 does not fit in NVIDIA H200 (140 GiB)\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "exp.json").write_text(json.dumps({"ds_config": ds}))
        (tmp_path / name / "stderr.log").write_text(stderr)
        if metrics is not None:
            (tmp_path / name / "metrics.json").write_text(metrics)
    (tmp_path / "never").mkdir()  # scheduled, killed before it wrote exp.json
    rows = {r["name"]: r for r in mod.read_experiments(tmp_path, seq_len=2048, world=2)}
    assert rows["ok"]["status"] == "ok" and rows["ok"]["tokens_per_s_per_gpu"] == 10.0 * 2048 / 2
    assert rows["ok"]["latency_ms"] == 1600.0 and rows["ok"]["grad_accum"] == 2
    assert rows["cut"] == {**rows["cut"], "status": "failed", "error": "no readable metrics.json"}
    assert rows["oom"]["status"] == "oom" and "does not fit" in rows["oom"]["error"]
    assert rows["never"]["status"] == "failed" and rows["profile_model_info"]["error"] == "NCCL boom"
    assert mod.read_experiments(tmp_path, 2048, 2)[0]["name"] == "ok"  # best first


def test_ds_autotuner_head_to_head_when_one_side_fails(tmp_path, monkeypatch):
    from harness.launch import CompareError
    from shared.train.results import RunResult

    mod = _ds_autotuner()
    winner = {"micro_batch": 2, "activation_checkpointing": False, "prefetch_bucket_size": 50_000_000,
              "reduce_bucket_size": 500_000_000, "param_persistence_threshold": 1_000_000, "compile": "none"}
    versus = lambda world: json.dumps({"preset": "tiny", "world_size": world, "winner": {"knobs": winner}})
    (tmp_path / "autotune.json").write_text(versus(1))
    order = []

    def fake_launch(path, cfg, world, out, log, timeout):
        order.append(out.stem)
        if cfg.ds_config:  # DeepSpeed's optimal config
            raise CompareError(f"deepspeed run failed (exit 1); log: {log}\nreason: error: micro_batch 2 does not fit")
        return RunResult(**{**load(ROOT / "benchmarks" / "results" / "tuning_2xh200" / "winner" / "runs" /
                                   "deepspeed_0.json"), "tokens_per_s_per_gpu": 100.0})

    monkeypatch.setattr(mod, "launch", fake_launch)
    train, ns = mod.parse(["--versus", str(tmp_path / "autotune.json"), "--repeats", "2", "--out", str(tmp_path)])
    v = mod.head_to_head(train, ns, {"micro_batch": 2, "grad_accum": 1}, tmp_path / "opt.json")
    assert order == ["deepspeed_autotuner_0", "ours_0", "ours_1", "deepspeed_autotuner_1"]  # alternating
    assert v["ratio_ours_over_deepspeed"] is None and v["tokens_per_s_per_gpu"] == {"ours": 100.0,
                                                                                     "deepspeed_autotuner": None}
    assert v["runs"]["deepspeed_autotuner"][0]["oom"]
    text = mod.format_report({"experiments": [], "optimal": None, "versus": v})
    assert "every run failed: reason: error: micro_batch 2 does not fit" in text and "no pair of runs" in text
    # a winner found for another GPU count is refused
    (tmp_path / "autotune.json").write_text(versus(2))
    with pytest.raises(ValueError, match="found for world_size 2, this run has 1"):
        mod.head_to_head(train, ns, {"micro_batch": 2, "grad_accum": 1}, tmp_path / "opt.json")
    # and so is the best-so-far of a search that is still running (autotune.json is rewritten per candidate)
    (tmp_path / "autotune.json").write_text(json.dumps({**json.loads(versus(1)), "complete": False}))
    with pytest.raises(ValueError, match="its search has not finished"):
        mod.head_to_head(train, ns, {"micro_batch": 2, "grad_accum": 1}, tmp_path / "opt.json")


def test_ds_autotuner_reuse_of_a_run_without_an_optimal_config_exits_1(tmp_path):
    (tmp_path / "autotune.json").write_text(json.dumps({"winner": None}))
    (tmp_path / "ds_autotuner.json").write_text(json.dumps({"optimal": None, "autotuner_exit": 1, "experiments": [],
                                                            "versus": {"stale": True}}))
    proc = run([sys.executable, DS_AUTOTUNER, "--versus", tmp_path / "autotune.json", "--reuse", "--out", tmp_path],
               check=False, timeout=60)
    assert proc.returncode == 1 and "wrote no optimal config (exit 1)" in proc.stderr, proc.stderr
    assert "versus" not in load(tmp_path / "ds_autotuner.json")  # an earlier head-to-head is not passed on


def test_scaling_model_states_that_its_inputs_mix_two_device_calls(tmp_path):
    module = load_module("scaling_model", ROOT / "benchmarks" / "scaling_model.py")
    report = module.main(["--out", str(tmp_path / "s.json")])
    assert "two device calls" in report["inputs_caveat"]
    committed = ROOT / "benchmarks" / "results" / "scaling_model_2xh200" / "scaling_model.json"
    assert load(tmp_path / "s.json") == load(committed)


def test_readme_quotes_the_committed_ablation_ratios_and_targets_as_measured():
    ratios = []
    for call in ("ablation_first_1xh200", "ablation_1xh200"):
        rows = load(ROOT / "benchmarks" / "results" / call / "ablation.json")["rows"]
        by = {}
        for r in rows:
            by.setdefault(r["config"], {})[r["path"]] = r.get("tflops_per_gpu")
        ratios += [v["lightning"] / v["deepspeed"] for v in by.values() if v.get("lightning") and v.get("deepspeed")]
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    assert f"({min(ratios):.3f}-{max(ratios):.3f}, each one run" in readme  # 0.916-1.083
    rows = load(ROOT / "benchmarks" / "results" / "attention_backends_1xh200" / "attention.json")["rows"]
    vs_flex = sorted(r["speedup_vs_flex"] for r in rows if "speedup_vs_flex" in r)
    met, missed = [v for v in vs_flex if v >= 1.3], [v for v in vs_flex if v < 1.3]
    assert len(vs_flex) == 9
    if missed:  # the rows below the target are named with their figure, as quoted
        assert f"met on {len(met)} of the 9 rows ({met[0]:.2f}-{met[-1]:.2f}x)" in readme
        assert all(f"is {v:.2f}x" in readme for v in missed)
    else:
        assert f"met on all 9 rows ({met[0]:.2f}-{met[-1]:.2f}x)" in readme
    vs_sdpa = sorted(r["speedup_vs_sdpa"] for r in rows if r.get("speedup_vs_sdpa"))
    assert len(vs_sdpa) == 3 and vs_sdpa[-1] < 1.0  # the causal rows, below the target, as quoted
    assert f"({vs_sdpa[0]:.2f}-{vs_sdpa[-1]:.2f}x; SDPA dispatches to cuDNN" in readme


OPTIMIZER_STEP = ROOT / "benchmarks" / "optimizer_step.py"


def test_optimizer_step_profile_times_every_part_of_deepspeeds_zero3_step(tmp_path):
    out = tmp_path / "step.json"
    proc = run([sys.executable, OPTIMIZER_STEP, "--preset", "tiny", "--steps", "6", "--warmup_steps", "2",
                "--out", out], timeout=300)
    r = load(out)
    assert r["step_ms"]["n"] == 2 and r["step_ms"]["median"] > 0  # steps 2 and 4 plain, 3 and 5 profiled
    parts = r["parts_ms_per_step"]
    for name in ("_get_norm_groups", "_optimizer_step", "_prepare_sub_group", "_partition_all_parameters"):
        assert parts[name] > 0, name
    # once per sub-group in one step
    assert r["parts_calls_per_step"]["_optimizer_step"] == r["n_sub_groups"] >= 1
    assert r["top_kernels"] and "optimizer step:" in proc.stdout
    # the fast step's own methods survive the timers: every step of the run went through them
    assert r["zero3_step_calls"]["fast"] == 2 * 6 * r["n_sub_groups"]  # a norm and a copy per sub-group and step
    fused = tmp_path / "fused.json"
    run([sys.executable, OPTIMIZER_STEP, "--preset", "tiny", "--steps", "6", "--warmup_steps", "2",
         "--zero3_step", "fused", "--out", fused], timeout=240)  # the AdamW kernel in Triton's interpreter
    assert load(fused)["zero3_step_calls"]["adamw_kernel"] == 6 * r["n_sub_groups"]


def test_adamw_step_benchmark_times_both_modes_and_they_agree(tmp_path):
    out = tmp_path / "adamw.json"
    run([sys.executable, ROOT / "benchmarks" / "adamw_step.py", "--numel", "3000", "--repeats", "2", "--warmup", "1",
         "--out", out], timeout=300)  # the kernel in Triton's interpreter
    r = load(out)
    assert r["numel"] == 3000 and "adamw_step.py" in r["command"] and r["versions"]
    for mode in ("fast", "fused"):
        assert len(r["ms"][mode]["all"]) == 2 and r["ms"][mode]["median"] > 0
    assert r["fused_over_fast"] > 0
    # three identical steps each from the same start (the interpreter truncates the bf16 copy, not the fp32 update)
    assert r["max_abs_param_difference"] <= 1e-6 * max(1.0, r["max_abs_param"])
    proc = run([sys.executable, ROOT / "benchmarks" / "adamw_step.py", "--numel", "0"], check=False, timeout=60)
    assert proc.returncode != 0 and "--numel and --repeats must be >= 1" in proc.stderr
    # a CPU without Triton's interpreter: refused before the buffers are made and the fast mode runs
    proc = python_without_interpreter(f"import runpy, sys; sys.argv = ['adamw_step.py', '--numel', '1000']; "
                                      f"runpy.run_path({str(ROOT / 'benchmarks' / 'adamw_step.py')!r}, "
                                      "run_name='__main__')")
    assert proc.returncode == 2 and "on a CPU TRITON_INTERPRET=1" in proc.stderr and "Traceback" not in proc.stderr


def test_optimizer_step_profile_refuses_what_it_cannot_time(tmp_path):
    proc = run([sys.executable, OPTIMIZER_STEP, "--preset", "tiny", "--stage", "2"], check=False, timeout=60)
    assert proc.returncode != 0 and "use --stage 3" in proc.stderr
    # more micro-batches than optimizer steps would time engine.step() calls that step nothing
    proc = run([sys.executable, OPTIMIZER_STEP, "--preset", "tiny", "--grad_accum", "2"], check=False, timeout=60)
    assert proc.returncode != 0 and "use --grad_accum 1, got 2" in proc.stderr and "Traceback" not in proc.stderr
    proc = run([sys.executable, OPTIMIZER_STEP, "--preset", "tiny", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode != 0 and f"--out {tmp_path} is a folder" in proc.stderr and "Traceback" not in proc.stderr


# each benchmark's argument parser (or main, where it parses and writes at once), called with argv
PARSERS = {"attention": "parse_args", "attention_layout": "parse_args", "attention_tiles": "parse_args",
           "adamw_step": "parse_args", "lm_loss": "parse", "mlp_tail": "parse", "sustained_clock": "parse_args",
           "kernel_resources": "parse_args", "scaling_model": "main", "plot_training": "main", "reference": "cli"}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_folder_or_a_file_in_a_folders_place_as_out_is_refused_before_the_benchmark_runs(tmp_path, capsys, name):
    where = ROOT / ("harness" if name == "reference" else "benchmarks") / f"{name}.py"  # the reference rows: harness/
    parse = getattr(load_module(f"{name}_out", where), PARSERS[name])
    first = {"plot_training": [str(ROOT / "benchmarks" / "results" / "kjv350m_1xh200" / "kjv350m_deepspeed.json")],
             "reference": ["--mode", "ceiling"]}.get(name, [])
    (tmp_path / "notes.txt").write_text("a file where a folder would be")
    for out, message in ((tmp_path, f"--out {tmp_path} is a folder"),
                         (tmp_path / "notes.txt" / "r.json", "notes.txt is a file, not a folder to write it in")):
        with pytest.raises(SystemExit) as e:
            parse([*first, "--out", str(out)])
        assert e.value.code == 2 and message in capsys.readouterr().err, name


def test_mlp_tail_refuses_a_flag_value_that_is_not_a_boolean(capsys):
    mlp_tail = load_module("mlp_tail_bool", ROOT / "benchmarks" / "mlp_tail.py")
    assert mlp_tail.parse(["--coordinate_descent_tuning", "off"]).coordinate_descent_tuning is False
    assert mlp_tail.parse(["--coordinate_descent_tuning", "on"]).coordinate_descent_tuning is True  # as training's
    with pytest.raises(SystemExit) as e:
        mlp_tail.parse(["--coordinate_descent_tuning", "ture"])  # a typo is not "off"
    assert e.value.code == 2 and "expected a boolean (true/false), got 'ture'" in capsys.readouterr().err


def test_sustained_clock_refuses_a_run_too_short_for_two_windows(capsys):
    clock = load_module("sustained_clock", ROOT / "benchmarks" / "sustained_clock.py")
    with pytest.raises(SystemExit) as e:
        clock.parse_args(["--seconds", "1.5", "--window", "1", "--out", ""])
    assert e.value.code == 2 and "--seconds 1.5 must be at least twice --window 1" in capsys.readouterr().err
    assert clock.parse_args(["--seconds", "2", "--window", "1", "--out", ""]).seconds == 2


def test_scaling_model_writes_into_a_folder_it_makes(tmp_path):
    module = load_module("scaling_model_out", ROOT / "benchmarks" / "scaling_model.py")
    module.main(["--out", str(tmp_path / "new" / "s.json")])
    assert load(tmp_path / "new" / "s.json")["predictions"]


def _attention_bench():
    return load_module("attention_bench", ROOT / "benchmarks" / "attention.py")


def test_attention_benchmark_compares_backends_at_the_same_dropout_rate():
    bench = _attention_bench()
    row = lambda backend, p, ms: {"seq": 2048, "layout": "causal", "backend": backend, "dropout": p, "status": "ok",
                                  "fwd_bwd_ms": ms, "nnz_blocks": 136}
    rows = [row("blocksparse:autotuned", 0.0, 2.0), row("sdpa", 0.0, 1.6), row("sdpa:flash", 0.1, 2.4),
            row("blocksparse:autotuned", 0.1, 2.2), row("sdpa", 0.1, 3.3)]
    bench.add_ratios(rows)
    assert rows[0]["speedup_vs_sdpa"] == pytest.approx(0.8) and rows[3]["speedup_vs_sdpa"] == pytest.approx(1.5)
    assert rows[3]["time_vs_no_dropout"] == pytest.approx(1.1)
    assert rows[4]["time_vs_no_dropout"] == pytest.approx(3.3 / 1.6)
    assert "time_vs_no_dropout" not in rows[2]  # a pinned kernel is its own backend: no row without dropout here
    with pytest.raises(SystemExit):
        bench.parse_args(["--backends", "sdpa:mem"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--dropouts", "1.0"])
    args = bench.parse_args(["--backends", "sdpa:cudnn", "blocksparse", "--dropouts", "0", "0.1"])
    assert args.dropouts == [0.0, 0.1] and bench.model_cfg(args, 2048, "causal", "sdpa:cudnn", 0.1).attn_dropout == 0.1


def test_attention_benchmark_refuses_an_unknown_layout_before_the_rows_before_it_run(capsys):
    bench = _attention_bench()
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--layouts", "causal", "bigbird", "--out", ""])
    assert e.value.code == 2 and "unknown layout 'bigbird'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # --quick's seq 2048 is checked against the block too
        bench.parse_args(["--quick", "--seqs", "1920", "--block", "96", "--out", ""])
    assert e.value.code == 2 and "seq_len (2048) must be a multiple of sparse_block (96)" in capsys.readouterr().err
    assert bench.parse_args(["--layouts", "local", "strided", "--out", ""]).layouts == ["local", "strided"]


def test_attention_benchmark_keeps_the_bits_mode_apart():
    bench = _attention_bench()
    row = lambda backend, ms: {"seq": 2048, "layout": "local", "backend": backend, "dropout": 0.1, "status": "ok",
                               "fwd_bwd_ms": ms, "nnz_blocks": 58}
    rows = [row("blocksparse", 2.6), row("blocksparse:bits", 2.3), row("flex", 4.6)]
    bench.add_ratios(rows)
    assert rows[0]["speedup_vs_flex"] == pytest.approx(4.6 / 2.6) and rows[1]["speedup_vs_flex"] == pytest.approx(2)
    args = bench.parse_args(["--backends", "blocksparse", "blocksparse:bits", "--dropouts", "0.1"])
    assert bench.model_cfg(args, 2048, "local", "blocksparse:bits", 0.1).attn_dropout_mask == "bits"
    assert bench.model_cfg(args, 2048, "local", "blocksparse", 0.1).attn_dropout_mask == "philox"


def test_attention_dropout_sums_each_modes_kernels_per_round():
    import torch

    bench = load_module("attention_dropout", ROOT / "benchmarks" / "attention_dropout.py")
    times = {"none/fwd": [1.0, 1.2], "none/dq": [1.0, 1.0], "philox/fwd": [2.0, 2.0], "philox/dq": [2.0, 3.0],
             "bits/fwd": [1.5, 1.5], "bits/mask_bits": [0.5, 0.7], "sdpa_none/fwd_bwd": [1.8, 2.2],
             "sdpa_dropout/fwd_bwd": [3.0, 3.0], "sdpa_dropout/fwd": [1.0, 1.0]}
    sums, ratios = bench.summarize(times)
    assert sums["none"]["range_ms"] == [2.0, 2.2] and sums["philox"]["median_ms"] == pytest.approx(4.5)
    assert sums["bits"]["kernels"] == ["bits/fwd", "bits/mask_bits"] and sums["bits"]["range_ms"] == [2.0, 2.2]
    assert sums["sdpa_dropout"]["median_ms"] == 3.0  # its forward-only row is not added in
    assert ratios["bits_vs_philox"] == pytest.approx(4.5 / 2.1)
    assert ratios["none_vs_sdpa_none"] == pytest.approx(2.0 / 2.1)
    with pytest.raises(SystemExit):
        bench.parse_args(["--dropout", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--seq", "2000"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(bench.parse_args([]))


def test_attention_tiles_sums_each_kernels_fastest_tile_per_path_and_rate():
    tiles = load_module("attention_tiles", ROOT / "benchmarks" / "attention_tiles.py")
    row = lambda kernel, path, p, bm, ms, status="ok": {"kernel": kernel, "path": path, "dropout": p, "block_m": bm,
                                                       "block_n": 64, "num_warps": 4, "num_stages": 2,
                                                       "pad_d": False, "status": status, "ms": ms}
    rows = [row("fwd", "affine", 0.0, 64, 1.0), row("fwd", "affine", 0.0, 128, 0.9), row("dq", "affine", 0.0, 64, 1.2),
            row("dkdv", "affine", 0.0, 32, 2.0), row("dkdv", "affine", 0.0, 64, 0.1, status="error"),
            row("fwd", "affine", 0.1, 64, 2.0), row("dq", "affine", 0.1, 64, 2.2)]  # no dk/dv at 0.1: no sum
    sdpa = {"0.0": {"fwd_ms": 0.72, "fwd_bwd_ms": 3.1}, "0.1": {"fwd_ms": 1.5, "fwd_bwd_ms": 4.2}}
    (summary,) = tiles.summarize(rows, sdpa)
    assert summary["dropout"] == 0.0 and summary["best_sum_ms"] == pytest.approx(0.9 + 1.2 + 2.0)
    assert summary["best"]["fwd"]["block_m"] == 128  # the failed 0.1 ms row is not a candidate
    assert summary["speedup_vs_sdpa_cudnn"] == pytest.approx(3.1 / 4.1)
    assert summary["fwd_speedup_vs_sdpa_cudnn"] == pytest.approx(0.72 / 0.9)
    assert "atomic_dq" not in summary  # no one-pass backward rows
    (with_atomic,) = tiles.summarize(rows + [row(tiles.ATOMIC, "affine", 0.0, 64, 2.5), row(tiles.ATOMIC, "affine", 0.0,
                                                                                          32, 3.5)], sdpa)
    atomic = with_atomic["atomic_dq"]
    assert atomic["best"]["block_m"] == 64 and atomic["sum_ms"] == pytest.approx(0.9 + 2.5)
    assert atomic["vs_two_kernel_backward"] == pytest.approx((1.2 + 2.0) / 2.5)
    assert atomic["speedup_vs_sdpa_cudnn"] == pytest.approx(3.1 / 3.4)
    (dkdv_only,) = tiles.summarize(rows, sdpa, ("dkdv",))  # --kernels dkdv: its best tile, no sum
    assert dkdv_only["best"]["dkdv"]["block_m"] == 32 and "best_sum_ms" not in dkdv_only
    assert tiles.parse_args(["--kernels", "dkdv"]).kernels == ["dkdv"]
    for kind in tiles.KINDS:  # the wide grid holds the tuner's candidates' shapes class and Hopper-sized tiles
        grid = tiles.wide_grid(kind, 96)
        assert grid and len(set(grid)) == len(grid) and any(t.pad_d for t in grid)
    args = tiles.parse_args(["--grid", "wide", "--tma", "both"])
    for kind in (*tiles.KINDS, tiles.ATOMIC):  # each shape timed once per load, whatever its dropout flag
        shapes = [dataclasses.replace(t, dropout=True) for t in tiles.grid(args, kind, False)]
        assert len(shapes) == len(set(shapes)) and {t.tma for t in shapes} == {False, True}
        assert len(shapes) == 2 * len({dataclasses.replace(t, tma=False) for t in shapes})
    with pytest.raises(SystemExit):
        tiles.parse_args(["--seq", "2000"])
    for bad in (["--inputs", "bthd"], ["--head_dim", "80"], ["--block", "96", "--seq", "1920"]):
        with pytest.raises(SystemExit):
            tiles.parse_args(bad)


def test_kernel_resources_first_candidates_compile_for_hopper_without_spilling(tmp_path):
    """The autotuner's first tile of each block-sparse kernel (D = 96, bf16, with and without dropout), compiled
    ahead of time for sm_90 with the installed Triton, spills no registers (benchmarks/kernel_resources.py, in its
    own process: compiling needs Triton without the interpreter, and no GPU)."""
    res = load_module("kernel_resources", ROOT / "benchmarks" / "kernel_resources.py")
    assert res.parse_usage("Function _attn_bwd_dkdv:\n REG:255 STACK:440 SHARED:1024 LOCAL:0") == {
        "registers": 255, "spill_bytes": 440}
    with pytest.raises(ValueError, match="no REG/STACK"):
        res.parse_usage("cuobjdump info    : File 'x.cubin' does not contain device code")
    for bad in (["--head_dim", "80"], ["--first", "-1"], ["--kernels", "dk"], ["--seq", "2000"]):
        with pytest.raises(SystemExit):
            res.parse_args(bad)
    out = tmp_path / "resources.json"
    env = {k: v for k, v in run_env().items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, ROOT / "benchmarks" / "kernel_resources.py", "--first", "1", "--out", out],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["kernel"], r["dropout"]) for r in rows] == [(k, d) for d in (False, True) for k in ("fwd", "dq", "dkdv")]
    # compiled as a launch at the 1.5b shape specializes it: one layout head (a constant 1), 16-aligned addresses
    # and strides, T = 2048 divisible by 16, 24 heads and the causal layout's 15-block rows not
    dkdv = result["specialized"]["dkdv dropout=1"]
    assert dkdv["constants"]["LUT_HEADS"] == 1 and dkdv["constants"]["DROPOUT"] is True
    assert {"Q", "K", "DK", "LSE", "SEED", "stride_qt", "stride_kt", "T"} <= set(dkdv["divisible_by_16"])
    assert not {"H", "COL_WIDTH"} & set(dkdv["divisible_by_16"])
    for r in rows:
        assert "error" not in r and r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, r


def test_the_other_triton_kernels_compile_for_hopper_without_spilling(tmp_path):
    """Every autotuner configuration of the AdamW step, the bias + GELU backward, the cross-entropy and the dropout
    keep mask, compiled ahead of time for sm_90 at the 1.5b shapes: the compiler refuses what Triton's interpreter
    (the CPU tests') accepts, such as a kernel reading a Python global."""
    out = tmp_path / "others.json"
    env = {k: v for k, v in run_env().items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, ROOT / "benchmarks" / "kernel_resources.py", "--others", "--kernels", "fwd",
                           "--dropouts", "0", "--first", "1", "--out", out],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["kernel"] != "fwd"]
    from shared.kernels import bias_gelu_grad, cross_entropy, dropout_mask

    assert [r["kernel"] for r in rows] == (["adamw"] + ["bias_gelu_grad"] * len(bias_gelu_grad.CONFIGS)
                                           + ["cross_entropy"] * len(cross_entropy.CONFIGS)
                                           + ["dropout_mask"] * len(dropout_mask.CONFIGS))
    for r in rows:
        assert "error" not in r and r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, r


def _small_benchmark(tmp_path, name: str, *args: str, timeout: int = 200) -> dict:
    """benchmarks/<name>.py at a small fp32 shape, two rounds on this CPU: its JSON, which records the command."""
    out = tmp_path / f"{name}.json"
    r = run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args, "--dtype", "fp32", "--rounds", "2",
             "--rep", "5", "--out", str(out)], timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["command"].endswith("--out " + str(out)) and res["versions"]["torch"] and res["device"]["type"] == "cpu"
    return res


def test_mlp_tail_times_both_backwards_and_checks_them_against_float32(tmp_path):
    res = _small_benchmark(tmp_path, "mlp_tail", "--rows", "64", "--cols", "48")
    assert set(res["variants"]) == {"inductor", "triton_grad"}  # the kernel in Triton's interpreter
    for v in res["variants"].values():
        assert len(v["ms"]) == 2 and v["min_ms"] <= v["median_ms"] <= v["max_ms"]
        assert v["errors"]["dx"] < 1e-5 and v["errors"]["db_relative"] < 1e-5  # fp32 against fp32
    assert res["variants"]["inductor"]["speedup_vs_inductor_per_round"] == [1.0, 1.0]


def test_lm_loss_times_both_losses_and_checks_them_against_float32(tmp_path):
    res = _small_benchmark(tmp_path, "lm_loss", "--rows", "40", "--hidden", "24", "--vocab", "300",
                           "--vocab_multiple", "128", timeout=300)
    assert res["shape"]["padded_vocab"] == 384
    assert set(res["variants"]) == {"inductor", "triton"}  # the kernel in Triton's interpreter
    for v in res["variants"].values():
        assert len(v["ms"]) == 2 and v["min_ms"] <= v["median_ms"] <= v["max_ms"]
        assert v["errors"]["loss"] < 1e-5 and v["errors"]["dx_relative"] < 1e-5 and v["errors"]["dw_relative"] < 1e-5


def test_mlp_tail_refuses_bad_sizes():
    r = run([sys.executable, str(ROOT / "benchmarks" / "mlp_tail.py"), "--rows", "0"], check=False, timeout=60)
    assert r.returncode == 2 and "--rows must be >= 1, got 0" in r.stderr


def test_ablation_time_limit_stops_between_configurations_and_keep_runs_the_rest(tmp_path, monkeypatch):
    """--time_limit: a configuration starts only if the longest so far fits in the time left; what ran is written,
    and the printed command (with --keep) runs only the rest. Runs take 100 s of a fake clock (no real run)."""
    import time

    ablation = load_module("ablation", ABLATION)
    clock, ran = [50.0], []

    def fake_run(base, name, flags, path, out, gpu, timeout):
        ran.append(name)
        clock[0] += 100.0
        return {"config": name, "path": path, "flags": flags, "micro_batch": base.micro_batch, "ok": True,
                "tflops_per_gpu": 1.0 + len(ran), "step_time_s": {"min": 0.1, "max": 0.2}, "peak_mem_gib": 1.0,
                "device": None}

    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ablation, "run_one", fake_run)
    args = ["--configs", "naive,+bias_dropout_add,+bias_gelu", "--paths", "deepspeed", "--mb_sweep", "",
            "--out", str(tmp_path)]
    with pytest.raises(ablation.TimeLimitReached, match=r"stopped before \+bias_gelu, 1 run\(s\) left") as e:
        ablation.main([*args, "--time_limit", "250"])
    assert ran == ["naive", "+bias_dropout_add"]
    assert {r["config"] for r in load(tmp_path / "ablation.json")["rows"]} == {"naive", "+bias_dropout_add"}
    assert str(e.value).endswith(" ".join(["python", "benchmarks/ablation.py", *args, "--time_limit", "250", "--keep"]))
    report = ablation.main([*args, "--time_limit", "250", "--keep"])  # the printed command: only the rest runs
    assert ran == ["naive", "+bias_dropout_add", "+bias_gelu"] and report["kept"] == ["+bias_dropout_add", "naive"]
    assert [r["config"] for r in report["rows"]] == ["naive", "+bias_dropout_add", "+bias_gelu"]


def test_ablation_time_limit_is_checked_before_any_run(tmp_path):
    for args, match in [(["--time_limit", "-1"], "--time_limit must be positive"),
                        (["--time_limit", "60", "--mb_sweep", "4"], "got --time_limit 60 with --mb_sweep 4")]:
        proc = run([sys.executable, ABLATION, *args, "--out", tmp_path], check=False, timeout=60)
        assert proc.returncode == 2 and match in proc.stderr, proc.stderr[-500:]


def test_residual_dropout_times_both_masks_against_their_inductor_parts_and_checks_them(tmp_path):
    res = _small_benchmark(tmp_path, "residual_dropout", "--rows", "64", "--cols", "48", timeout=300)
    assert res["shape"]["applied_p_triton_mask"] == 6554 / 65536
    parts = ("forward", "forward_backward")
    assert set(res["variants"]) == {f"{w}_{p}" for w in ("inductor", "triton_mask") for p in parts} | {"mask_kernel"}
    for part in parts:  # each way against inductor's same part, per round
        assert res["variants"][f"inductor_{part}"][f"speedup_vs_inductor_{part}_per_round"] == [1.0, 1.0]
        assert len(res["variants"][f"triton_mask_{part}"][f"speedup_vs_inductor_{part}_per_round"]) == 2
    for name in ("inductor_forward", "triton_mask_forward"):
        err = res["variants"][name]["errors"]
        assert err["h"] < 1e-5 and err["layer_norm"] < 1e-4  # fp32 against fp32, given the mask h shows
    assert len(res["variants"]["mask_kernel"]["ms"]) == 2


def test_residual_dropout_refuses_a_rate_it_cannot_check():
    r = run([sys.executable, str(ROOT / "benchmarks" / "residual_dropout.py"), "--p", "0"], check=False, timeout=60)
    assert r.returncode == 2 and "--p must be in (0, 1), got 0.0" in r.stderr


def test_spread_runs_each_gpus_references_around_the_levers_it_takes():
    """--gpus: every GPU runs the references named before the levers first and those after last, on itself; each
    lever runs once, on the first GPU free; once a run would not fit, no GPU starts another."""
    import threading
    import time

    ablation = load_module("ablation", ABLATION)
    ran, lock = [], threading.Lock()

    def run(task, gpu):
        time.sleep(0.01 * (1 + gpu))  # GPU 1 is slower: it takes fewer levers
        with lock:
            ran.append((task, gpu))

    levers = [(f"+l{i}", "deepspeed") for i in range(5)]
    refs = lambda name: lambda gpu: [(name, "deepspeed")]
    assert ablation.spread(refs("baseline"), levers, refs("baseline_again"), 2, run, lambda: True) == []
    for gpu in (0, 1):
        mine = [t for t, g in ran if g == gpu]
        assert mine[0] == ("baseline", "deepspeed") and mine[-1] == ("baseline_again", "deepspeed"), mine
    assert sorted(t for t, g in ran if t[0].startswith("+")) == levers
    # a time limit: the third start does not fit; what was never started is returned, levers without a GPU
    ran.clear()
    starts = []
    fits = lambda: starts.append(1) or len(starts) <= 2
    skipped = ablation.spread(refs("baseline"), levers, refs("baseline_again"), 2, run, fits)
    assert sorted(ran) == [(("baseline", "deepspeed"), 0), (("baseline", "deepspeed"), 1)]
    assert sorted(t for t, _ in skipped if t[0].startswith("+")) == levers  # each lever once, none started
    assert sorted((t, g) for t, g in skipped if not t[0].startswith("+")) == [
        (("baseline_again", "deepspeed"), 0), (("baseline_again", "deepspeed"), 1)]


def _fake_cuda_ablation(monkeypatch, uuids: list[str]):
    """ablation.py as on a machine with len(uuids) GPUs (faked: no run starts), and a fake run_one: GPU 1 runs
    everything 10% faster, -vocab128 is 2% faster, every other configuration changes nothing."""
    import torch

    from shared.model import config as model_config

    ablation = load_module("ablation", ABLATION)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    monkeypatch.setattr(ablation, "device_info", lambda: {"name": "FakeGPU"})
    monkeypatch.setattr(ablation, "gpu_uuids", lambda n: uuids[:n])
    monkeypatch.setattr(ablation, "gpu_memory_gib", lambda: 139.8)  # an H200's: compare.py's default micro-batch 16
    ran = []

    def fake_run(base, name, flags, path, out, gpu, timeout, suffix=""):
        ran.append((name, path, gpu, suffix))
        tflops = 500.0 * (1.1 if gpu == 1 else 1.0) * (1.02 if name == "-vocab128" else 1.0)
        return {"config": name, "path": path, "flags": flags, "micro_batch": base.micro_batch, "gpu": gpu, "ok": True,
                "tflops_per_gpu": tflops, "step_time_s": {"min": 0.7, "max": 0.8}, "peak_mem_gib": 90.0,
                "device": "FakeGPU"}

    return ablation, ran, fake_run


def test_ablation_over_gpus_rates_each_lever_against_its_own_gpus_baselines(tmp_path, monkeypatch):
    """--gpus 2: the baselines run on both GPUs, each lever once, and its ratio is against its own GPU's baselines
    (GPU 1 is 10% faster: a lever that changes nothing rates 1.000 on either). The GPUs run in step here, so each
    takes one lever, and both placements are checked row by row."""
    import threading

    ablation, ran, fake_run = _fake_cuda_ablation(monkeypatch, ["GPU-a0", "GPU-a1"])
    step = threading.Barrier(2, timeout=10)
    monkeypatch.setattr(ablation, "run_one", lambda *a, **k: step.wait() * 0 or fake_run(*a, **k))
    report = ablation.main(["--set", "last_mile", "--gpus", "2", "--configs",
                            "baseline,+mb24,-vocab128,baseline_again", "--out", str(tmp_path)])
    for gpu in (0, 1):
        assert [n for n, _, g, _ in ran if g == gpu][::2] == ["baseline", "baseline_again"]
    assert sorted((n, s) for n, _, _, s in ran) == sorted(
        [("baseline", "_gpu0"), ("baseline", "_gpu1"), ("baseline_again", "_gpu0"), ("baseline_again", "_gpu1"),
         ("+mb24", ""), ("-vocab128", "")])
    text = ablation.table(report)
    where = {r["config"]: r["gpu"] for r in report["rows"] if not r["config"].startswith("baseline")}
    assert sorted(where.values()) == [0, 1] and {r["gpu_uuid"] for r in report["rows"]} == {"GPU-a0", "GPU-a1"}
    for name, factor in (("+mb24", 1.0), ("-vocab128", 1.02)):
        g = where[name]
        assert f"| {name} (GPU {g}) | {500 * (1.1 if g else 1) * factor:.1f} [700-800 ms] | {factor:.3f} | 90.0 |" \
            in text, text
    assert "vs baseline of its GPU" in text
    assert "raw baseline runs on GPU 0: 500.0, 500.0" in text and "raw baseline runs on GPU 1: 550.0, 550.0" in text


def test_ablation_last_mile_starts_from_compares_micro_batch_for_the_gpus_memory(tmp_path, monkeypatch, capsys):
    ablation, ran, fake_run = _fake_cuda_ablation(monkeypatch, ["GPU-a0"])
    monkeypatch.setattr(ablation, "run_one", fake_run)
    args = ["--set", "last_mile", "--configs", "baseline", "--out", str(tmp_path)]
    assert ablation.main(args)["rows"][0]["micro_batch"] == 16
    monkeypatch.setattr(ablation, "gpu_memory_gib", lambda: 79.2)  # an 80 GB GPU: 16's measured peak does not fit
    assert ablation.main(args)["rows"][0]["micro_batch"] == 8
    assert "ablation.py: --micro_batch 8 (micro-batch 16 would peak at about 92 GiB" in capsys.readouterr().out
    assert ablation.main([*args, "--micro_batch", "12"])["rows"][0]["micro_batch"] == 12  # asked for: kept
    monkeypatch.setattr(ablation, "gpu_memory_gib", lambda: 39.4)
    with pytest.raises(SystemExit):
        ablation.main(args)
    assert "does not fit in 95% of this GPU's 39 GiB" in capsys.readouterr().err


def test_ablation_over_gpus_stops_in_time_and_keep_runs_a_gpus_baselines_again_only_where_it_has_none(
        tmp_path, monkeypatch):
    import time

    ablation, ran, fake_run = _fake_cuda_ablation(monkeypatch, ["GPU-a0", "GPU-a1"])
    clock = [0.0]

    def timed_run(*a, **k):
        clock[0] += 100.0
        return fake_run(*a, **k)

    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ablation, "run_one", timed_run)
    args = ["--set", "last_mile", "--gpus", "2", "--configs", "baseline,+mb24,-vocab128,baseline_again",
            "--out", str(tmp_path)]
    with pytest.raises(ablation.TimeLimitReached, match="not started: ") as e:
        ablation.main([*args, "--time_limit", "250"])
    assert str(e.value).endswith(" ".join(["python", "benchmarks/ablation.py", *args, "--time_limit", "250",
                                           "--keep"]))
    first = load(tmp_path / "ablation.json")
    assert first["gpus"] == 2 and {r["config"] for r in first["rows"]} < {"baseline", "+mb24", "-vocab128"}
    n_first = len(ran)
    report = ablation.main([*args, "--keep"])  # the same machine: its baselines are not run again
    done = [(n, g) for n, _, g, _ in ran[:n_first]]
    assert not set(done) & {(n, g) for n, _, g, _ in ran[n_first:]}
    assert sorted((r["config"], r["gpu"]) for r in report["rows"] if r["config"].startswith("baseline")) == [
        ("baseline", 0), ("baseline", 1), ("baseline_again", 0), ("baseline_again", 1)]
    # another machine (other UUIDs), one more lever: the baselines run again on both of its GPUs, the rows measured
    # on the first machine stay, each rated against its own GPU's baselines
    monkeypatch.setattr(ablation, "gpu_uuids", lambda n: ["GPU-b0", "GPU-b1"][:n])
    n_second = len(ran)
    report = ablation.main([*args[:5], "baseline,+mb24,-vocab128,-triton_loss,baseline_again",
                            "--out", str(tmp_path), "--keep"])
    assert sorted((n, g) for n, _, g, _ in ran[n_second:]) == [
        ("-triton_loss", 0), ("baseline", 0), ("baseline", 1), ("baseline_again", 0), ("baseline_again", 1)] or \
        sorted((n, g) for n, _, g, _ in ran[n_second:]) == [
        ("-triton_loss", 1), ("baseline", 0), ("baseline", 1), ("baseline_again", 0), ("baseline_again", 1)]
    assert len([r for r in report["rows"] if r["config"] == "baseline"]) == 4
    text = ablation.table(report)
    assert "raw baseline runs on GPU 1 ...GPU-b1: 550.0, 550.0" in text and "GPU 0 ...GPU-a0" in text
    assert text.count("| 1.000 |") == 8 + 2 and "| 1.020 |" in text  # 8 baselines, 2 levers that change nothing


def test_ablation_over_gpus_runs_a_configurations_paths_on_one_gpu_and_refuses_bad_counts(tmp_path, monkeypatch,
                                                                                          capsys):
    ablation, ran, fake_run = _fake_cuda_ablation(monkeypatch, ["GPU-a0", "GPU-a1"])
    monkeypatch.setattr(ablation, "run_one", fake_run)
    report = ablation.main(["--set", "fusions", "--gpus", "2", "--configs", "naive,+bias_gelu,+compile",
                            "--mb_sweep", "", "--out", str(tmp_path)])
    for name in ("+bias_gelu", "+compile"):
        assert len({(g) for n, _, g, _ in ran if n == name}) == 1  # both paths on one GPU
    assert "| Lightning/raw |" in ablation.table(report) and " 1.000 |\n" in ablation.table(report)
    for bad, match in ((["--gpus", "3"], "--gpus takes 1 up to the GPUs this machine has (2), got 3"),
                       (["--gpus", "0"], "--gpus takes 1 up to"),
                       (["--gpus", "2", "--mb_sweep", "24"], "the micro-batch sweep runs on one GPU")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            ablation.main(["--set", "fusions", *bad, "--out", str(tmp_path / "x")])
        assert match in capsys.readouterr().err and not (tmp_path / "x" / "ablation.json").exists()


def test_ablation_runs_by_path_from_the_repo_root_without_pythonpath():
    """`python benchmarks/ablation.py` as documented: Python puts benchmarks/, not the root, on sys.path."""
    e = {k: v for k, v in run_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ABLATION), "--help"], capture_output=True, text=True, env=e, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0 and "usage: ablation.py" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--mb_sweep", "abc"], "--mb_sweep must be comma-separated integers, got 'abc'"),
    (["--mb_sweep", "4,0"], "--mb_sweep needs positive micro-batches, got '4,0'"),
    (["--mb_sweep", "-2"], "--mb_sweep needs positive micro-batches, got '-2'"),
    (["--timeout", "0"], "--timeout must be positive seconds, got 0"),
    (["--timeout", "-5"], "--timeout must be positive seconds, got -5"),
])
def test_ablation_refuses_a_bad_sweep_or_timeout_before_any_run(tmp_path, monkeypatch, capsys, args, message):
    ablation = load_module("ablation", ABLATION)
    monkeypatch.setattr(ablation, "run_one", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as e:
        ablation.main(["--configs", "naive", "--paths", "deepspeed", *args, "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out" / "ablation.json").exists()


# A training script that stands in for the raw path's: the first configuration's run writes a committed run JSON,
# the second's sleeps until it is stopped.
FAKE_TRAIN = """
import os, shutil, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
if os.path.basename(out).startswith("naive"):
    os.makedirs(os.path.dirname(out), exist_ok=True)
    shutil.copy({template!r}, out)
else:
    open({started!r}, "w").write(str(os.getpid()))
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_ablation_stops_its_run_and_keeps_the_configurations_finished(tmp_path, sig):
    """SIGTERM (or Ctrl-C's SIGINT) to ablation.py: the run in progress (torchrun and the training process, each in
    a session of its own) is stopped with it, it exits 128 + the signal, and ablation.json keeps what finished."""
    import psutil

    from harness.launch import GRACE_S

    template = ROOT / "benchmarks" / "results" / "coordinate_descent_compare_1xh200" / "runs" / "deepspeed_0.json"
    fake, started, out = tmp_path / "fake_train.py", tmp_path / "started", tmp_path / "out"
    fake.write_text(FAKE_TRAIN.format(template=str(template), started=str(started)))
    argv = ["benchmarks/ablation.py", "--configs", "naive,+bias_gelu", "--paths", "deepspeed", "--mb_sweep", "",
            "--out", str(out)]
    # Ctrl-C's handler as a terminal's process has it, also where pytest was started without job control (`cmd &`
    # in a script), which starts every process under it with SIGINT ignored
    code = (f"import runpy, signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"from harness import launch\nlaunch.SCRIPTS['deepspeed'] = {str(fake)!r}\n"
            f"sys.argv = {argv!r}\nrunpy.run_path({str(ABLATION)!r}, run_name='__main__')\n")
    log_path = tmp_path / "ablation.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=run_env(),
                                cwd=ROOT, start_new_session=True)
    children = []
    try:
        deadline = time.time() + 120
        while not started.exists() and time.time() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(0.5)  # the pid written: the sleeper is up
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any(str(fake) in " ".join(p.cmdline()) for p in children), [p.cmdline() for p in children]
        proc.send_signal(sig)
        assert proc.wait(timeout=GRACE_S + 30) == 128 + sig, log_path.read_text()[-3000:]
        assert f"ablation.py: stopped by {sig.name}" in log_path.read_text()
        _, alive = psutil.wait_procs(children, timeout=5)
        assert alive == []
        rows = load(out / "ablation.json")["rows"]
        assert [(r["config"], r["ok"]) for r in rows] == [("naive", True)]
    finally:
        for p in [psutil.Process(proc.pid), *children] if proc.poll() is None else children:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=60)


def test_spread_stops_every_gpus_run_on_ctrl_c_and_starts_no_other(tmp_path):
    """--gpus: Ctrl-C (or SIGTERM, as Stopped) reaches the main thread only, which waits on the GPUs' threads: it
    stops the run each GPU's thread waits on, and no GPU starts another."""
    import os
    import threading

    from harness import launch

    ablation = load_module("ablation", ABLATION)
    ran = []

    def run(task, gpu):  # a run as harness.launch starts it: its own process group, listed in RUNNING
        ran.append(task)
        launch._run("deepspeed", [sys.executable, "-c", "import time; time.sleep(120)"], run_env(),
                    tmp_path / f"{task}.log", 120)

    def interrupt():
        deadline = time.time() + 30
        while len(launch.RUNNING) < 2 and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as above: also under `pytest &`
    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.time()
    try:
        with pytest.raises(KeyboardInterrupt):
            ablation.spread(lambda gpu: [f"ref{gpu}"], ["l1", "l2", "l3"], lambda gpu: [], 2, run, lambda: True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(ran) == ["ref0", "ref1"] and not launch.RUNNING and time.time() - t0 < 30
