"""compare.py end to end on CPU, and its refusal of bad arguments."""

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import compare
from harness import report as reports
from harness.launch import COLD_ROWS, TimeLimit, TimeLimitReached
from shared.model.config import preset
from shared.tools.prepare_data import prepare
from shared.train.config import TrainConfig
from shared.train.results import RunResult
from tests.helpers import GPU_BASE, LIGHTNING, RAW, ROOT, env, run

COMPARE = ROOT / "compare.py"


@pytest.mark.slow
def test_compare_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "report"
    proc = run([sys.executable, COMPARE, "--repeats", "2", "--steps", "6", "--warmup_steps", "2", "--cross-check",
                "--out", out], timeout=400)
    report = json.loads((out / "report.json").read_text())
    for key in ("command", "preset", "world_size", "device", "versions", "paths", "ratio_lightning_over_deepspeed",
                "loss_parity", "ratio_spread", "cross_check"):
        assert key in report, key
    assert report["preset"] == "tiny" and report["world_size"] == 1
    for path in ("lightning", "deepspeed"):
        p = report["paths"][path]
        for key in ("tflops_per_gpu", "tflops_spread", "mfu", "tokens_per_s_per_gpu", "step_time_s", "phases_s",
                    "peak_mem_gib", "losses"):
            assert key in p, (path, key)
        assert set(p["phases_s"]) == {"data", "forward", "backward", "step"}
        assert p["tflops_spread"]["n"] == 2 and len(p["losses"]) == 6 and len(p["runs"]) == 2
        assert report["cross_check"][path]["ds_wall_clock_breakdown_ms"]["forward"] > 0
        assert p["sdpa_kernel"] == ["MATH"]  # what torch's dispatcher picks on CPU with attention dropout
    P = report["paths"]
    assert report["ratio_lightning_over_deepspeed"] == pytest.approx(P["lightning"]["tflops_per_gpu"] /
                                                                     P["deepspeed"]["tflops_per_gpu"])
    lp = report["loss_parity"]
    assert lp["ok"] and len(lp["pairs"]) == 2 and not lp["past_warmup"]  # 6 steps end inside the 10-step LR warm-up
    assert lp["max_abs_diff"] == lp["grad_norm_max_rel_diff"] == lp["checksum_rel_diff"] == 0.0  # bit for bit
    assert report["same_ds_config"]
    # pairs alternate their order: raw first, then Lightning first
    done = {f.stem: f.stat().st_mtime for f in (out / "runs").glob("*_[01].json")}
    assert done["deepspeed_0"] < done["lightning_0"] < done["lightning_1"] < done["deepspeed_1"]
    md = (out / "report.md").read_text()
    assert "Lightning / DeepSpeed throughput" in md and "phases.png" in md
    assert (out / "phases.png").read_bytes()[:4] == b"\x89PNG"
    assert "Lightning / DeepSpeed throughput" in proc.stdout
    # the speed figures of CPU runs say nothing about GPUs: said in the header, under the table and in the report
    assert report["smoke_test"] and proc.stdout.count("SMOKE TEST: no GPU") == 2 and "SMOKE TEST" in md


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--stage", "4"], "ZeRO stage must be 0, 1, 2 or 3, got 4"),
        (["--micro-batch", "0"], "micro_batch must be a positive integer, got 0"),
        (["--gpus", "1"], "--gpus 1 asked for but 0 GPU(s) available"),
        (["--repeats", "0"], "--repeats must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(tmp_path, args, message):
    proc = run([sys.executable, COMPARE, *args, "--out", tmp_path / "report"], check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


def test_model_overrides_are_validated_before_any_run(tmp_path):
    # seq_len 100 is not a multiple of the tiny preset's 16-token sparse block
    proc = run([sys.executable, COMPARE, "--seq_len", "100", "--out", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "multiple of sparse_block" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused on a CPU only")
def test_what_a_run_would_refuse_is_refused_before_any_run_keeping_the_previous_logs(tmp_path):
    previous = tmp_path / "logs" / "deepspeed_0.log"
    previous.parent.mkdir()
    previous.write_text("the previous report's log\n")
    (tmp_path / "batch.json").write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 3},
                                                     "bf16": {"enabled": True}}))
    (tmp_path / "report.json").write_text("the previous report")
    for args, message in [(["--ds_config", tmp_path / "nope.json"], "nope.json' does not exist"),
                          (["--ds_config", tmp_path / "batch.json"], "sets train_batch_size=32, but the run's "
                           "--micro_batch 2 x --grad_accum 1 x 1 process(es) = 2"),
                          (["--precision", "fp16"], "fp16 is not supported by DeepSpeed on CPU"),
                          (["--data", tmp_path / "missing"], "missing.meta.json' not found")]:
        proc = run([sys.executable, COMPARE, *args, "--out", tmp_path], check=False, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr[-2000:])
    assert previous.read_text() == "the previous report's log\n" and not (tmp_path / "runs").exists()
    assert (tmp_path / "report.json").read_text() == "the previous report"


@pytest.mark.slow
def test_a_failing_run_is_reported_with_its_log(tmp_path):
    # token ids edited after the metadata was written: valid before the run, refused by its first batch
    src = tmp_path / "t.txt"
    src.write_text("words and more words. " * 400)
    prepare(src, tmp_path / "t", "byte")
    np.full(2000, 300, dtype=np.uint16).tofile(tmp_path / "t.train.bin")
    proc = run([sys.executable, COMPARE, "--data", tmp_path / "t", "--out", tmp_path], check=False, timeout=300)
    assert proc.returncode == 1
    assert "deepspeed run failed" in proc.stderr
    assert "reason: error: token id 300" in proc.stderr
    assert (tmp_path / "logs" / "deepspeed_0.log").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--parallel"]], ids=["sequential", "parallel"])
def test_sigterm_to_compare_stops_every_process_it_started(tmp_path, mode):
    import psutil

    out, log_path = tmp_path / "report", tmp_path / "compare.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, COMPARE, "--steps", "100000", "--warmup_steps", "1",
                                 "--log_every", "1", *mode, "--out", out], stdout=log, stderr=subprocess.STDOUT,
                                env=env(), cwd=ROOT, start_new_session=True)
    started = []
    try:
        run_log = out / "logs" / "deepspeed_0.log"
        deadline = time.time() + 240
        while "step 2/" not in (run_log.read_text() if run_log.is_file() else "") and time.time() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.5)
        # torchrun and its training process (which torchrun puts in a session of its own)
        started = psutil.Process(proc.pid).children(recursive=True)
        assert any("train.py" in " ".join(p.cmdline()) for p in started), [p.cmdline() for p in started]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=compare.GRACE_S + 60) == 128 + signal.SIGTERM
        assert "compare.py: stopped by SIGTERM" in log_path.read_text()
        _, alive = psutil.wait_procs(started, timeout=5)
        assert alive == []
    finally:
        for p in [psutil.Process(proc.pid), *started] if proc.poll() is None else started:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=60)

# The unsharded row against the raw path, bf16 with --zero3_step fused on a CPU, the AdamW kernel in Triton's
# interpreter (test_the_unsharded_row_trains_the_fused_steps_model_in_bf16): the first losses are equal (the same
# bf16 weights), the later ones not bit for bit, as the weights that bf16 rounds after an update are not all the
# same; measured max |diff| 1.05e-4 over 4 steps on synthetic tokens (torch 2.13, DeepSpeed 0.19.8, one thread; on
# the shipped text, whose larger gradients round apart sooner, 5.2e-4 at step 3). The bound is the two
# paths' own bf16 loss parity bound (harness/report.PARITY_TOLERANCE), about 3x that.
UNSHARDED_BF16_LOSS_TOL = reports.PARITY_TOLERANCE["bf16"]["loss"]

def _run(tflops: float) -> RunResult:
    """A synthetic RunResult: only its throughput differs from run to run."""
    return RunResult(path="x", command="", preset="tiny", model={}, train={}, ds_config={}, versions={},
                     device={"name": "cpu"}, world_size=1, attention="sdpa", fused={}, losses=[5.0, 4.9], steps=2,
                     warmup_steps=1, flops_factor=3, phases_s={p: 0.1 for p in ("data", "forward", "backward", "step")},
                     step_time_s={"median": 1 / tflops}, per_step_s=[1 / tflops], tokens_per_s_per_gpu=tflops * 1000,
                     tflops_per_gpu=tflops, sparse_tflops_per_gpu=tflops, layout_density=1.0, mfu=None,
                     peak_mem_gib=None, peak_rss_gib=1.0, n_params=1)


def test_headline_ratio_is_the_ratio_of_the_tables_medians_and_unsteady_repeats_are_flagged():
    # the loaded-CPU case: per-pair ratios 3.0, 0.5, 0.7 average 1.4 while Lightning's median is half raw's
    ds = [_run(1.0), _run(4.0), _run(2.0)]
    pl = [_run(3.0), _run(2.0), _run(1.0)]
    train = TrainConfig(precision="fp32")
    ns = SimpleNamespace(world=1, repeats=3)
    report = reports.build_report(train, ns, {"deepspeed": ds, "lightning": pl}, {}, [])
    P = report["paths"]
    assert (P["deepspeed"]["tflops_per_gpu"], P["lightning"]["tflops_per_gpu"]) == (2.0, 2.0)
    assert report["ratio_lightning_over_deepspeed"] == 1.0  # 2.0 / 2.0, not a statistic of the pairs
    assert (report["ratio_spread"]["min"], report["ratio_spread"]["max"]) == (0.5, 3.0)
    assert report["repeats_disagree"] == {"deepspeed": 4.0, "lightning": 3.0}
    text = reports.format_table(report)
    assert "Lightning / DeepSpeed throughput: 1.0000 (ratio of the medians above" in text
    assert "WARNING: the deepspeed runs disagree: max/min TFLOPs/GPU 4.00 > 1.10" in text
    steady = reports.build_report(train, ns, {"deepspeed": [_run(2.0), _run(2.1)], "lightning": [_run(1.0),
                                                                                           _run(1.05)]}, {}, [])
    assert steady["repeats_disagree"] == {} and "WARNING" not in reports.format_table(steady)
    assert steady["ratio_lightning_over_deepspeed"] == pytest.approx(1.025 / 2.05)
    assert "profiles" not in steady and "profiled step" not in reports.format_table(steady)


def test_a_report_names_the_gpu_each_rounds_runs_ran_on_and_warns_when_a_round_spans_two():
    def on(card: str | None, tflops: float = 2.0) -> RunResult:
        r = _run(tflops)
        r.device, r.fused = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "uuid": card}, {"compile": "whole_model"}
        return r

    train, ns = TrainConfig(precision="bf16"), SimpleNamespace(world=1, repeats=2)
    a, b = "GPU-aaaaaaaa-1111", "GPU-bbbbbbbb-2222"
    one = reports.build_report(train, ns, {"deepspeed": [on(a), on(a)], "lightning": [on(a), on(a)]}, {}, [])
    assert one["cards"]["distinct"] == 1 and one["cards"]["each_round_on_one_card"]
    assert "every run on one GPU (GPU-aaaaaaaa)" in reports.format_table(one)
    # a compare continued on another machine: round 1 on one card, round 2 (and its reference) on another
    two = reports.build_report(train, ns, {"deepspeed": [on(a), on(b)], "lightning": [on(a), on(b)],
                                           "unsharded": [on(a), on(b)]}, {}, [])
    assert two["cards"]["distinct"] == 2 and two["cards"]["each_round_on_one_card"]
    assert two["cards"]["rounds"] == [dict.fromkeys(("deepspeed", "lightning", "unsharded"), card)
                                      for card in ("GPU-aaaaaaaa", "GPU-bbbbbbbb")]
    text = reports.format_table(two)
    assert "runs on 2 GPUs (round 1: GPU-aaaaaaaa; round 2: GPU-bbbbbbbb); each round on one GPU" in text
    # a round whose pair was split over two calls on two machines: its ratio compares two machines
    split = reports.build_report(train, ns, {"deepspeed": [on(a), on(a)], "lightning": [on(b), on(b)]}, {}, [])
    assert not split["cards"]["each_round_on_one_card"]
    assert "WARNING: a round's runs span GPUs" in reports.format_table(split)
    # runs that record no card (a CPU, or runs made before the record) leave the report without the entry
    cpu = reports.build_report(train, ns, {"deepspeed": [_run(2.0)], "lightning": [_run(2.0)]}, {}, [])
    assert "cards" not in cpu and "run on one GPU" not in reports.format_table(cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a compare on a machine without GPUs says")
def test_a_compare_without_gpus_says_it_is_a_smoke_test_and_what_the_command_runs_on_gpus(tmp_path, monkeypatch,
                                                                                           capsys):
    def fake_launch(path, train, world, out, log, timeout, env=None):
        r = _run(2.0 if path == "deepspeed" else 1.85)  # a "Lightning 7.5% slower" that means nothing on a CPU
        r.device = {"type": "cpu", "name": "x86_64", "count": 2}
        return r

    monkeypatch.setattr(compare, "launch", fake_launch)
    assert compare.cli(["--stage", "3", "--precision", "bf16", "--repeats", "1", "--steps", "12",
                        "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("compare: SMOKE TEST"))
    # what the command runs on GPUs: compare.py's GPU default for the flags not given (--steps was)
    gpu = " ".join(f"--{k} {v}" for k, v in compare.GPU_DEFAULTS.items() if k != "steps")
    assert "preset tiny in CPU processes" in header and f"({gpu})" in header and "say nothing about" in header
    assert "the fast profile" in header
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["smoke_test"] is True and report["smoke_test_note"] == header.removeprefix("compare: ")
    table = out[out.index("Lightning / DeepSpeed throughput"):]
    assert report["smoke_test_note"] in table  # under the table
    md = (tmp_path / "report.md").read_text()
    assert md.splitlines()[0].endswith("(smoke test on CPU)") and report["smoke_test_note"] in md
    # runs on GPUs are a measurement: no note
    gpu_run = _run(2.0)
    gpu_run.device = {"type": "cuda", "name": "NVIDIA H200", "count": 1}
    measured = reports.build_report(TrainConfig(), SimpleNamespace(world=1, repeats=1),
                                    {"deepspeed": [gpu_run], "lightning": [gpu_run]}, {}, [])
    assert measured["smoke_test"] is False and "SMOKE TEST" not in reports.format_table(measured)


def test_deepcompiles_passes_and_their_profiling_are_reported_per_run():
    train = TrainConfig(precision="bf16")
    runs = {}
    for path, passes, profilers in (("deepspeed", 70.0, {"operators_s": 20.5, "memory_s": 30.25}),
                                    ("lightning", 86.5, None)):  # None: a run JSON written before the timing
        r = dataclasses.replace(_run(2.0))
        r.extra = {"warmup_s": 150.0, "compile_s": 120.0, "deepcompile_passes_s": passes,
                   "deepcompile_profilers": profilers and {**profilers, "operators_runs": 2, "memory_runs": 6}}
        runs[path] = [r]
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=1), runs, {}, [])
    assert report["paths"]["deepspeed"]["deepcompile_profiling_s"] == [50.75]
    assert report["paths"]["lightning"]["deepcompile_profiling_s"] == [None]
    rows = {re.split(r"\s{2,}", line.strip())[0]: line.split() for line in reports.format_table(report).splitlines()}
    assert rows["DeepCompile passes s"][-2:] == ["70.0", "86.5"]
    assert rows["of them profiling s"][-2:] == ["50.8", "n/a"]
    # eager runs: no DeepCompile rows
    eager = reports.build_report(train, SimpleNamespace(world=1, repeats=1),
                                 {"deepspeed": [_run(2.0)], "lightning": [_run(2.0)]}, {}, [])
    assert "DeepCompile passes s" not in reports.format_table(eager)


def test_the_compile_caches_hits_are_reported_per_run():
    train = TrainConfig(precision="bf16")
    runs = {}
    for path, counts in (("deepspeed", [{"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 4, "fxgraph_cache_bypass": 1},
                                        {"fxgraph_cache_hit": 4, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 1}]),
                         ("lightning", [None, {"fxgraph_cache_hit": 5}])):  # None: a run JSON written before it
        runs[path] = []
        for c in counts:
            r = dataclasses.replace(_run(2.0))
            r.extra = {"compile_cache": c}
            runs[path].append(r)
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=2), runs, {}, [])
    rows = {re.split(r"\s{2,}", line.strip())[0]: line.split() for line in reports.format_table(report).splitlines()}
    assert rows["graphs cached/compiled/uncacheable"][-4:] == ["0/4/1,", "4/0/1", "n/a,", "5/0/0"]
    eager = dataclasses.replace(_run(2.0))
    eager.extra = {"compile_cache": dict.fromkeys(("fxgraph_cache_hit", "fxgraph_cache_miss"), 0)}  # compiled none
    eager = reports.build_report(train, SimpleNamespace(world=1, repeats=1),
                                 {"deepspeed": [eager], "lightning": [_run(2.0)]}, {}, [])
    assert "graphs cached" not in reports.format_table(eager)


def test_the_schedule_deepcompile_compiled_is_named_per_run():
    from harness.report import schedule_id

    train = TrainConfig(precision="bf16")
    graph = lambda order: [{"graph": 0, "bwd": False, "order": order, "collectives": "c", "nodes": 9, "gathers": 1,
                            "releases": 1}, {"graph": 0, "bwd": True, "order": "b", "collectives": "d", "nodes": 9,
                                             "gathers": 1, "releases": 1}]
    runs = {}
    for path, schedules in (("deepspeed", [graph("a"), graph("a")]), ("lightning", [graph("x"), None])):
        runs[path] = []
        for sch in schedules:
            r = dataclasses.replace(_run(2.0))
            r.extra = {"deepcompile_passes_s": 70.0, "deepcompile_schedules": sch}
            runs[path].append(r)
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=2), runs, {}, [])
    same, other = schedule_id(graph("a")), schedule_id(graph("x"))
    assert len(same) == 6 and same != other and report["paths"]["deepspeed"]["deepcompile_schedule"] == [same, same]
    assert report["paths"]["lightning"]["deepcompile_schedule"] == [other, None]
    rows = {re.split(r"\s{2,}", line.strip())[0]: line for line in reports.format_table(report).splitlines()}
    assert rows["DeepCompile schedule (per run)"].split()[-4:] == [f"{same},", same, f"{other},", "n/a"]
    assert schedule_id([{"graph": 0, "bwd": False, "error": "AttributeError: x"}]) == "error"
    eager = reports.build_report(train, SimpleNamespace(world=1, repeats=1),
                                 {"deepspeed": [_run(2.0)], "lightning": [_run(2.0)]}, {}, [])
    assert "DeepCompile schedule" not in reports.format_table(eager)


def test_the_clock_each_run_held_is_reported_per_run():
    train = TrainConfig(precision="bf16")
    clock = lambda mhz, w: {"gpus": ["0"], "readings": 30, "sm_mhz": {"median": mhz, "min": mhz - 15, "max": mhz + 15},
                            "power_w": {"median": w, "min": w - 2, "max": w + 2}, "clock_event_reasons": ["0x4"]}
    runs = {}
    for path, tele in (("deepspeed", [clock(1710.0, 690.4), clock(1725.0, 688.0)]),
                       ("lightning", [{"gpus": ["0"], "error": "nvidia-smi not found"}, None]),
                       ("ceiling", [clock(1695.0, 691.0)])):
        runs[path] = []
        for t in tele:
            r = dataclasses.replace(_run(2.0))
            r.extra, r.fused = {"gpu_telemetry": t}, {**r.fused, "compile": "whole_model"}
            runs[path].append(r)
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=2, reference=["ceiling"]), runs, {}, [])
    assert report["paths"]["deepspeed"]["gpu_telemetry"][1]["sm_mhz"]["median"] == 1725.0
    text = reports.format_table(report)
    rows = {re.split(r"\s{2,}", line.strip())[0]: line.split() for line in text.splitlines()}
    assert rows["SM clock MHz, timed steps (per run)"][-4:] == ["1710,", "1725", "?,", "n/a"]
    assert rows["power W (per run)"][-4:] == ["690,", "688", "?,", "n/a"]
    assert "SM clock 1695 MHz" in text  # the ceiling's line
    cpu = reports.build_report(train, SimpleNamespace(world=1, repeats=1),
                               {"deepspeed": [_run(2.0)], "lightning": [_run(2.0)]}, {}, [])
    assert "SM clock" not in reports.format_table(cpu)


def test_profiled_steps_are_reported_per_row():
    from shared.train.step_profile import summarize

    ranges = [("data", 0, 10), ("forward", 10, 110), ("backward", 110, 300), ("step", 300, 320)]
    train = TrainConfig(precision="bf16", steps=4, warmup_steps=2, profile_step=1)
    profiled = dataclasses.replace(_run(2.0), model=dataclasses.asdict(preset("tiny")),
                                   train=dataclasses.asdict(train), device={"type": "cuda", "name": "NVIDIA H200"})
    profiled.extra = {"profile": summarize([("sm90_xmma_gemm", 20, 90), ("triton_poi_fused_add_0", 150, 200)],
                                           ranges, "cuda")}
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=1),
                                  {"deepspeed": [profiled], "lightning": [_run(2.0)]}, {}, [])
    assert list(report["profiles"]) == ["deepspeed"]  # the Lightning run was not profiled
    text = reports.format_table(report)
    assert "profiled step 1 of each row's first run" in text
    assert "deepspeed forward    wall      0.1  busy      0.1  idle     0.0  kernels     1  | matmul 0.1" in text
    # the matmuls' model FLOPs over their 70 us, against the H200's peak; no attention kernel ran
    rates = report["kernel_rates"]["deepspeed"]
    assert rates["matmul"]["ms"] == pytest.approx(0.07) and rates["attention"]["tflops"] is None
    matmul_tflops = rates["matmul"]["model_flops"] / 0.07e-3 / 1e12
    assert rates["matmul"]["tflops"] == pytest.approx(matmul_tflops)
    assert (f"model FLOPs over the kernels' time: matmul {matmul_tflops:.3g} TFLOP/s "
            f"({matmul_tflops / 989.4:.0%} of peak), attention -") in text
    # with the run's telemetry: the share of the peak at the clock the GPU held too (989.4 TFLOP/s at 1830 MHz)
    profiled.extra = {**profiled.extra, "gpu_telemetry": {"readings": 9, "sm_mhz": {"median": 1525.0}}}
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=1),
                                  {"deepspeed": [profiled], "lightning": [_run(2.0)]}, {}, [])
    held = report["kernel_rates"]["deepspeed"]
    assert held["sm_mhz"] == 1525.0 and held["matmul"]["of_held_peak"] == pytest.approx(
        matmul_tflops / (989.4 * 1525 / 1830))
    assert (f"matmul {matmul_tflops:.3g} TFLOP/s ({matmul_tflops / 989.4:.0%} of peak, "
            f"{matmul_tflops / (989.4 * 1525 / 1830):.0%} of the peak at the 1525 MHz held), attention -"
            ) in reports.format_table(report)
    # a CPU profile times nested operators, not kernels: no rates from it
    profiled.extra = {"profile": summarize([("aten::mm", 20, 90)], ranges, "cpu")}
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=1),
                                  {"deepspeed": [profiled], "lightning": [_run(2.0)]}, {}, [])
    assert report["kernel_rates"] == {} and "model FLOPs over" not in reports.format_table(report)


def series(losses, norms=None, checksum=None):
    return {"losses": list(losses), "grad_norms": None if norms is None else list(norms),
            "param_checksum": checksum}


LOSSES = [5.5, 5.4, 5.3, 5.2, 5.1, 5.0, 4.9, 4.8]
NORMS = [2.0, 1.8, 1.6, 1.5, 1.4, 1.3, 1.2, 1.1]
CHECKSUM = {"sum": 12.0, "sum_sq": 400.0, "numel": 1000}


def test_parity_compares_past_the_lr_warmup_in_every_pair():
    same = (series(LOSSES, NORMS, CHECKSUM), series(LOSSES, NORMS, CHECKSUM))
    assert reports.parity([same], "bf16", 3)["ok"]
    warm = series([x + 0.1 if i < 3 else x for i, x in enumerate(LOSSES)], NORMS, CHECKSUM)
    assert reports.parity([(same[0], warm)], "bf16", 3)["ok"]  # differences inside the warm-up are not judged
    late = series([x + 1e-3 if i == 6 else x for i, x in enumerate(LOSSES)], NORMS, CHECKSUM)
    report = reports.parity([same, (same[0], late)], "bf16", 3)  # only the second pair differs
    assert report["failed"] == ["loss"] and report["max_abs_diff"] == pytest.approx(1e-3)
    assert report["pairs"][0]["loss_max_abs_diff"] == 0.0 and report["pairs"][1]["steps"] == [3, 8]
    whole = reports.parity([(same[0], warm)], "bf16", 10)  # runs end inside the warm-up: compared whole
    assert not whole["past_warmup"] and whole["failed"] == ["loss"] and "inside" in reports.format_parity(whole)


@pytest.mark.parametrize(
    "other, failed",
    [
        (series(LOSSES, [n / 2 for n in NORMS], CHECKSUM), ["grad_norm"]),  # gradients scaled twice by 1/gas
        (series(LOSSES, NORMS, {**CHECKSUM, "sum_sq": 402.0}), ["checksum"]),  # 5e-3 relative
        (series(LOSSES, NORMS, {**CHECKSUM, "sum": 12.1}), ["checksum"]),  # 0.1 / sqrt(400) = 5e-3
        (series([x * 1.0001 for x in LOSSES], NORMS, CHECKSUM), ["loss"]),  # 5e-4 past warm-up
        (series(LOSSES[:3] + [None] + LOSSES[4:], NORMS, CHECKSUM), ["loss"]),  # a skipped step in one path only
    ],
)
def test_each_measure_fails_the_check_on_its_own(other, failed):
    report = reports.parity([(series(LOSSES, NORMS, CHECKSUM), other)], "bf16", 3)
    assert report["failed"] == failed and not report["ok"]
    assert "MISMATCH in " + ", ".join(failed) in reports.format_parity(report)


def test_a_path_difference_within_the_same_paths_run_to_run_drift_passes():
    """A compiler that is not deterministic run to run (DeepCompile) moves the checksum between two runs of one path
    as much as between the paths: with >= 2 runs per path the bound is RUN_TO_RUN_FACTOR x that drift."""
    def ck(s):
        return series(LOSSES, NORMS, {**CHECKSUM, "sum": s})

    cross = [(ck(12.0), ck(12.12)), (ck(12.1), ck(12.02))]  # 6e-3 and 4e-3 between the paths
    alone = reports.parity(cross[:1], "bf16", 3)
    assert alone["failed"] == ["checksum"] and alone["run_to_run"] is None
    assert "with one run per path the same path's run-to-run drift is not measured" in reports.format_parity(alone)
    same = [(ck(12.0), ck(12.1)), (ck(12.12), ck(12.02))]  # 5e-3 between runs of one path
    report = reports.parity(cross, "bf16", 3, same)
    assert report["ok"] and report["run_to_run"]["checksum"] == pytest.approx(5e-3)
    assert report["bound"]["checksum"] == pytest.approx(reports.RUN_TO_RUN_FACTOR * 5e-3)
    assert report["bound"]["loss"] == reports.PARITY_TOLERANCE["bf16"]["loss"]  # no drift there: the fixed bound
    assert "same path run to run 5.00e-03 -> bound 7.50e-03" in reports.format_parity(report)
    far = reports.parity([(ck(12.0), ck(12.2))], "bf16", 3, same)  # 1e-2: beyond 1.5x the drift
    assert far["failed"] == ["checksum"] and "drift is not measured" not in reports.format_parity(far)


def test_fp32_bounds_are_tight_and_unrecorded_measures_are_not_judged():
    off = series([x + 1e-4 for x in LOSSES])  # results written before grad norms and checksums were recorded
    assert reports.parity([(series(LOSSES), off)], "bf16", 3)["ok"]
    fp32 = reports.parity([(series(LOSSES), off)], "fp32", 3)
    assert fp32["failed"] == ["loss"] and fp32["grad_norm_max_rel_diff"] is None
    assert "grad norm max rel diff not recorded" in reports.format_parity(fp32)


# grad_accum 2 so the double scaling shows; a clip of 0.5 binds from step 0 on the tiny preset (its gradient norm
# is ~0.8), else a missing clip changes nothing; bf16, so the check runs at the bounds GPU runs are judged by.
FAULT_RUN = ["--preset", "tiny", "--steps", "8", "--warmup_steps", "2", "--lr_warmup_steps", "3", "--grad_accum",
             "2", "--grad_clip", "0.5", "--log_every", "4", "--precision", "bf16"]
# The same on a GPU: the GPU tests' small model (tests/helpers.GPU_BASE) with the eager profile, whose ZeRO-3 step
# calls torch's AdamW.step, where `skip_update` is planted (the fast profile's fused step is one Triton kernel).
GPU_FAULT_RUN = [*GPU_BASE, "--steps", "8", "--warmup_steps", "2", "--lr_warmup_steps", "3", "--grad_accum", "2",
                 "--grad_clip", "0.5", "--log_every", "4", "--precision", "bf16", "--profile", "eager"]
FAULTS = ("noclip", "double_scale", "lr2x", "skip_update@4", "dropout_rate")


def faults_caught(tmp_path, args: list, deterministic: bool = True) -> dict[str, list[str]]:
    """The Lightning path with each fault of FAULTS planted against the raw path, on the shipped text (byte tokens):
    the measures each pair fails, judged as compare judges a pair with two repeats: against the bf16 bounds, or
    against RUN_TO_RUN_FACTOR x the larger drift between two runs of one path (raw, and Lightning without a fault)
    where that is larger. On a CPU each path's two runs must agree within the fixed bounds (`deterministic`); on a
    GPU they need not (cuDNN attention's backward and atomic adds), and their drift is the bound. The Lightning path
    without a fault must pass those bounds first."""
    prepare(ROOT / "data" / "kjv.txt", tmp_path / "kjv", "byte")
    args = [*args, "--data", tmp_path / "kjv"]
    runs = {}
    for name, script in (("raw", RAW), ("raw_again", RAW), ("clean", LIGHTNING), ("clean_again", LIGHTNING)):
        run([sys.executable, script, *args, "--out", tmp_path / f"{name}.json"])
        runs[name] = RunResult.from_json(tmp_path / f"{name}.json")
    raw = runs["raw"]
    assert raw.grad_norms[0] > 0.5 and len(raw.grad_norms) == 8 and raw.param_checksum["numel"] == raw.n_params
    s = {name: reports.parity_series(r) for name, r in runs.items()}
    same = [(s["raw"], s["raw_again"]), (s["clean"], s["clean_again"])]
    for pair in same:
        drift = reports.parity([pair], "bf16", 3)
        print("one path against itself:", reports.format_parity(drift))
        assert drift["ok"] or not deterministic, reports.format_parity(drift)
    judge = lambda out: reports.parity([(s["raw"], reports.parity_series(RunResult.from_json(out)))], "bf16", 3, same)
    # the control: the Lightning path without a fault passes the same bounds, so that a fault's failure is the fault's
    clean = judge(tmp_path / "clean.json")
    print("clean:", reports.format_parity(clean))
    assert clean["ok"] and clean["past_warmup"], reports.format_parity(clean)
    caught = {}
    for fault in FAULTS:
        run([sys.executable, ROOT / "tests" / "inject.py", "lightning", fault, "--", *args,
             "--out", tmp_path / f"{fault}.json"])
        report = judge(tmp_path / f"{fault}.json")
        assert report["past_warmup"] and report["pairs"][0]["steps"] == [3, 8]
        print(f"{fault}:", reports.format_parity(report))
        caught[fault] = report["failed"]
    print("caught:", caught)
    return caught


@pytest.mark.slow
@pytest.mark.timeout(1800)  # nine runs of the tiny model, each with its own subprocess timeout
def test_parity_catches_each_fault_that_trains_another_model_on_real_text(tmp_path):
    """At the bf16 bounds GPU runs are judged by: a missing clip, the gradients scaled twice, a doubled learning
    rate, one skipped update and attention dropout at another rate each fail parity."""
    caught = faults_caught(tmp_path, FAULT_RUN)
    # Measured on CPU: no clip moves the gradient norm past its bound; the double scaling halves it; the doubled LR
    # and the skipped update change the losses after them; the other dropout rate changes every loss.
    assert "grad_norm" in caught["noclip"]
    assert "grad_norm" in caught["double_scale"]
    assert "loss" in caught["lr2x"]
    assert caught["skip_update@4"] and caught["dropout_rate"]


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_parity_catches_each_fault_on_the_gpu(tmp_path):
    """The same five faults on a GPU (bf16, cuDNN attention and its dropout, torch's fused AdamW): each fails parity
    with its bounds widened to 1.5x the paths' own run-to-run drift, as a compare with repeats judges. (With the
    fixed bounds alone, two runs of the raw path failed them on an H100.)"""
    caught = faults_caught(tmp_path, GPU_FAULT_RUN, deterministic=False)
    assert all(caught[f] for f in FAULTS), caught


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_the_reference_rows_start_from_the_paths_weights_on_the_gpu(tmp_path):
    """On a GPU the paths build their model under zero.Init, each parameter made on the GPU and initialized from its
    generator; the reference rows build theirs on the GPU too (harness/reference.init_on), so both reference rows'
    step-0 loss is the raw path's (same_start). Built on the CPU and moved, the rows drew other weights: on the
    shipped text this small model's first loss differs by 0.07-0.33 between draws (three seeds on the CPU), far
    outside the check's 5e-3."""
    out = tmp_path / "report"
    run([sys.executable, COMPARE, *GPU_BASE, "--steps", "3", "--warmup_steps", "1", "--precision", "bf16",
         "--profile", "eager", "--reference", "unsharded,ceiling", "--out", out], timeout=540)
    report = json.loads((out / "report.json").read_text())
    assert report["device"]["type"] == "cuda" and report["train"]["data"] == "kjv"
    start = report["same_start"]
    assert start["ok"] and set(start["abs_diff"]) == {"unsharded", "ceiling"}, start


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_the_stock_row_trains_deepspeed_as_shipped_beside_the_fast_paths_on_the_gpu(tmp_path):
    """--reference stock on a GPU: the raw path under the stock profile (DeepSpeed's own DeepCompile schedule and
    ZeRO-3 step, no replacement of DeepSpeed internals, no Triton kernel of this project) trains beside the fast
    paths in one compare, on the same model and batches, its timed steps past DeepSpeed's step-5 recompile; the
    report rates each path over it."""
    out = tmp_path / "report"
    run([sys.executable, COMPARE, *GPU_BASE, "--steps", "10", "--warmup_steps", "2", "--precision", "bf16",
         "--repeats", "1", "--reference", "stock", "--out", out], timeout=560)
    report = json.loads((out / "report.json").read_text())
    runs = {row: json.loads((out / "runs" / f"{row}_0.json").read_text()) for row in ("deepspeed", "stock")}
    raw, stock = runs["deepspeed"], runs["stock"]
    assert (raw["train"]["profile"], raw["train"]["zero3_step"]) == ("fast", "fused") and raw["extra"]["patches"]
    assert (stock["train"]["profile"], stock["train"]["compile"], stock["train"]["zero3_step"]) == (
        "stock", "deepcompile", "deepspeed")
    assert stock["extra"]["patches"] == [] and stock["warmup_steps"] >= 6 and stock["device"]["type"] == "cuda"
    assert stock["train"]["micro_batch"] == raw["train"]["micro_batch"] == 8
    # the same model from the same weights, trained alike (the dropout masks differ: torch's and the Triton kernel's)
    assert report["train"]["data"] == "kjv" and raw["losses"][-1] < raw["losses"][0]
    assert abs(stock["losses"][0] - raw["losses"][0]) < 0.05 and abs(stock["losses"][-1] - raw["losses"][-1]) < 0.25
    assert set(report["over_stock"]) == {"deepspeed", "lightning"}
    assert all(o["n"] == 1 and o["ratio"] > 0 for o in report["over_stock"].values())


@pytest.mark.slow
def test_the_gpu_defaults_kernels_train_alike_on_every_row(tmp_path):
    """The padded vocabulary, the Triton loss and the Triton dropout masks (compare.py's GPU default; here on a CPU,
    the kernels in Triton's interpreter, fp32, a vocabulary of 300 padded to 384): both paths and both reference rows
    record them, keep the real vocabulary and train to the same losses: the two DeepSpeed paths bit for bit, the
    reference rows to fp32 rounding. Their weights are not ZeRO-3's flat-buffer views, and the interpreter runs the
    kernels' matrix products through numpy: with Triton 3.9.0 and numpy 2.4.6 on one thread the ceiling's third loss
    came out 9.5e-7 from the DeepSpeed paths' (equal on two threads)."""
    out = tmp_path / "report"
    flags = ["--vocab_size", "300", "--vocab_multiple", "128", "--triton_loss", "true", "--triton_dropout", "true",
             "--fused_bias_dropout_add", "true"]
    run([sys.executable, COMPARE, "--repeats", "1", "--steps", "3", "--warmup_steps", "1", "--precision", "fp32",
         "--reference", "ceiling,fsdp2", *flags, "--out", out], timeout=400)
    report = json.loads((out / "report.json").read_text())
    runs = {name: json.loads((out / "runs" / f"{name}_0.json").read_text())
            for name in ("deepspeed", "lightning", "ceiling", "fsdp2")}
    for name, r in runs.items():
        assert r["fused"]["triton_linear_cross_entropy"] and r["fused"]["dropout_triton_mask"], name
        assert (r["model"]["vocab_size"], r["model"]["vocab_multiple"]) == (300, 128), name
        assert r["losses"] == pytest.approx(runs["deepspeed"]["losses"], rel=1e-6, abs=0), name
        assert r["extra"]["launch_s"] > 0, name  # what a continued compare's --time_limit plans with
    assert runs["lightning"]["losses"] == runs["deepspeed"]["losses"]
    assert report["loss_parity"]["ok"] and set(report["reference"]) == {"ceiling", "fsdp2"}


@pytest.mark.slow
def test_reference_rows_train_the_same_model_on_the_same_batches(tmp_path):
    """--reference: the unsharded (the paths' fp32 masters and step, no sharding), ceiling (plain PyTorch, unsharded)
    and FSDP2 rows train the very model, seed, batches and dropout stream of the DeepSpeed paths: in fp32 on a CPU
    their losses equal the raw loop's bit for bit. --parallel runs each group side by side; --reference_rounds 1 runs
    the rows in the first of the 2 rounds only."""
    out = tmp_path / "report"
    # synthetic tokens: on the shipped text the unsharded row's fp32 losses differ from the raw loop's in the 7th
    # digit by step 3 (the order of fp32 sums), which a bit-for-bit check cannot allow
    args = ["--repeats", "2", "--steps", "4", "--warmup_steps", "1", "--precision", "fp32", "--reference",
            "--reference_rounds", "1", "--parallel", "--data", "synthetic", "--out", out]
    run([sys.executable, COMPARE, *args], timeout=280)
    report = json.loads((out / "report.json").read_text())
    assert report["parallel"] and set(report["reference"]) == {"unsharded", "ceiling", "fsdp2"}
    raw = report["paths"]["deepspeed"]["losses"]
    for name, ref in report["reference"].items():
        assert ref["losses"] == raw, name
        assert ref["world_size"] == 1 and ref["compile"] == "none"  # nothing is compiled on a CPU, and it says so
    assert report["same_start"]["ok"] and {d for ds in report["same_start"]["abs_diff"].values() for d in ds} == {0.0}
    assert report["reference"]["unsharded"]["fused"]["optimizer_step"] == "torch_adamw"  # the CPU default: fast
    frac = report["fraction_of_ceiling"]  # the reference rows ran round 1 only: each fraction divides round 1's runs
    raw_round_1 = json.loads((out / "runs" / "deepspeed_0.json").read_text())["tflops_per_gpu"]
    ceiling = report["reference"]["ceiling"]["tflops_per_gpu"]
    assert frac["deepspeed"] == pytest.approx(raw_round_1 / ceiling)
    assert set(frac) == {"deepspeed", "lightning", "fsdp2"}
    of_unsharded = report["fraction_of_unsharded"]
    unsharded = report["reference"]["unsharded"]["tflops_per_gpu"]
    assert of_unsharded["deepspeed"]["ratio"] == pytest.approx(raw_round_1 / unsharded)
    assert set(of_unsharded) == {"deepspeed", "lightning", "fsdp2", "ceiling"} and of_unsharded["lightning"]["n"] == 1
    assert "fraction of unsharded" in (out / "report.md").read_text()
    assert (out / "runs" / "ceiling_0.json").is_file() and (out / "logs" / "fsdp2_0.log").is_file()
    assert (out / "runs" / "unsharded_0.json").is_file()
    assert (out / "runs" / "deepspeed_1.json").is_file() and not (out / "runs" / "ceiling_1.json").exists()

    # --keep_runs: a cut compare (here: its last Lightning run lost) runs only what is missing and keeps the rest
    before = {f.name: f.stat().st_mtime for f in (out / "runs").glob("*.json")}
    (out / "runs" / "lightning_1.json").unlink()
    proc = run([sys.executable, COMPARE, *args, "--keep_runs"], timeout=160)
    assert "deepspeed (round 2): kept from" in proc.stdout and "lightning (round 2): kept" not in proc.stdout
    after = {f.name: f.stat().st_mtime for f in (out / "runs").glob("*.json")}
    assert {k for k in after if after[k] != before.get(k)} == {"lightning_1.json"}
    resumed = json.loads((out / "report.json").read_text())
    assert resumed["kept_runs"] == ["ceiling_0", "deepspeed_0", "deepspeed_1", "fsdp2_0", "lightning_0",
                                    "unsharded_0"]
    assert resumed["paths"]["lightning"]["losses"] == report["paths"]["lightning"]["losses"]
    assert "earlier invocation of this command (--keep_runs): ceiling_0" in proc.stdout
    # runs made with other settings are refused by name before anything runs
    other = [a if a != "4" else "5" for a in args]
    proc = run([sys.executable, COMPARE, *other, "--keep_runs"], check=False, timeout=60)
    assert proc.returncode == 2
    assert "deepspeed_0.json was made with other settings (steps 4 there vs 5 now" in proc.stderr
    kept = json.loads((out / "runs" / "ceiling_0.json").read_text())
    (out / "runs" / "ceiling_0.json").write_text(json.dumps({**kept, "versions": {**kept["versions"], "torch": "1.0"}}))
    proc = run([sys.executable, COMPARE, *args, "--keep_runs"], check=False, timeout=60)
    assert proc.returncode == 2 and "ceiling_0.json was made with other settings (torch '1.0' there vs" in proc.stderr


@pytest.mark.slow
def test_the_unsharded_row_trains_the_fused_steps_model_in_bf16(tmp_path):
    """--zero3_step fused in bf16: the unsharded row steps with the project's AdamW kernel (here in Triton's
    interpreter) on fp32 masters and bf16 weights, as the raw path's ZeRO-3 step does, and trains to its losses.
    Not bit for bit: LOSS_TOL (written down below) bounds the difference."""
    out = tmp_path / "report"
    run([sys.executable, COMPARE, "--repeats", "1", "--steps", "4", "--warmup_steps", "1", "--precision", "bf16",
         "--zero3_step", "fused", "--reference", "unsharded", "--data", "synthetic", "--out", out], timeout=400)
    report = json.loads((out / "report.json").read_text())
    row = report["reference"]["unsharded"]
    assert row["fused"]["optimizer_step"] == "adamw_kernel" and row["compile"] == "none"
    raw = report["paths"]["deepspeed"]["losses"]
    assert row["losses"] == pytest.approx(raw, rel=0, abs=UNSHARDED_BF16_LOSS_TOL)
    assert set(report["fraction_of_unsharded"]) == {"deepspeed", "lightning"}
    assert "fraction_of_ceiling" not in report and "the project's AdamW kernel" in report["unsharded_vs_ceiling"]


def test_fractions_of_unsharded_are_per_round_and_say_what_the_baseline_differs_in():
    """Each fraction divides the rounds both rows ran: here the paths ran three rounds, the unsharded row two (a compare
    cut before round 3's reference run) and the baseline one (`ceiling:1`). Round 3's slow runs (1.0) stay out: a
    median over three rounds over a median over two mixes machines and clocks, and once put a fraction outside its own
    per-round range (docs/results.md, "The reference rows")."""
    runs = {"deepspeed": [_run(2.0), _run(2.4), _run(1.0)], "lightning": [_run(1.8), _run(2.2), _run(1.0)],
            "unsharded": [_run(2.0), _run(2.0)], "ceiling": [_run(1.9)]}
    for name in ("unsharded", "ceiling"):
        for r in runs[name]:
            r.fused = {"compile": "whole_model"}
    train = TrainConfig(precision="bf16", zero3_step="fused")
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=3), runs, {}, [])
    f = report["fraction_of_unsharded"]
    assert f["deepspeed"]["ratio"] == pytest.approx(2.2 / 2.0)
    assert (f["deepspeed"]["min"], f["deepspeed"]["max"], f["deepspeed"]["n"]) == (1.0, pytest.approx(1.2), 2)
    for row in f.values():
        assert row["min"] <= row["ratio"] <= row["max"], row
    assert f["ceiling"] == {"ratio": pytest.approx(0.95), "min": pytest.approx(0.95), "max": pytest.approx(0.95),
                            "n": 1}
    assert report["fraction_of_ceiling"] == {"deepspeed": pytest.approx(2.0 / 1.9),
                                             "lightning": pytest.approx(1.8 / 1.9)}
    text = reports.format_table(report)
    assert "fraction of unsharded (what ZeRO-3 costs; median TFLOPs / unsharded median over the rounds both ran; " \
           "per round [min, max]): deepspeed 1.100 [1.000, 1.200], lightning 1.000 [0.900, 1.100]" in text
    assert "reference ceiling (the PyTorch user's baseline) (1 x, compile whole_model)" in text
    assert "fraction of the PyTorch user's baseline (ceiling row; median TFLOPs / its median over the rounds both " \
           "ran): deepspeed 1.053, lightning 0.947" in text
    line = report["unsharded_vs_ceiling"]
    assert line in text and "bf16 weights and gradients with fp32 master weights" in line
    assert "the project's AdamW kernel" in line and "torch's AdamW" in line  # the smoke test's device is a CPU


def test_a_reference_row_that_starts_from_other_weights_is_named_in_the_report():
    """As on one H100 before the reference rows built their model on the GPU: the paths' step-0 loss 11.3697, the
    unsharded row's 11.1117 and the baseline's 11.1115 (other initial weights). The report says which row, and that
    its speed still compares; rows within the tolerance (here the baseline at 2e-4 of the paths) pass."""
    def first(loss: float, tflops: float = 2.0) -> RunResult:
        r = _run(tflops)
        r.losses, r.fused = [loss, 10.0], {"compile": "whole_model"}
        return r

    # a compare continued after the fix: round 1's unsharded run drew other weights, round 2's the paths'
    runs = {"deepspeed": [first(11.3697)] * 2, "lightning": [first(11.3697)] * 2,
            "unsharded": [first(11.1117), first(11.3696)], "ceiling": [first(11.3699)]}
    report = reports.build_report(TrainConfig(precision="bf16"), SimpleNamespace(world=1, repeats=2), runs, {}, [])
    s = report["same_start"]
    assert not s["ok"] and s["abs_diff"]["unsharded"] == pytest.approx([0.258, 1e-4])
    assert s["abs_diff"]["ceiling"][0] < 1e-3
    assert "WARNING: a reference row did not start from the paths' weights: its step-0 loss is off the raw " \
           "path's 11.3697 by more than 0.005 (unsharded 2.58e-01 / 1.00e-04, ceiling 2.00e-04)" \
           in reports.format_table(report)
    runs["unsharded"] = [first(11.3696)] * 2
    fixed = reports.build_report(TrainConfig(precision="bf16"), SimpleNamespace(world=1, repeats=2), runs, {}, [])
    assert fixed["same_start"]["ok"] and "start from the paths' weights" in reports.format_table(fixed)
    # on two GPUs the paths' losses average two ranks' batches, the reference row's is one rank's: no check
    two = reports.build_report(TrainConfig(precision="bf16"), SimpleNamespace(world=2, repeats=2), runs, {}, [])
    assert "same_start" not in two and "paths' weights" not in reports.format_table(two)


def test_each_reference_row_runs_in_the_rounds_it_names():
    """`--reference unsharded,ceiling:1`: the unsharded row every round (what ZeRO-3 costs, round by round), the
    ceiling once; --reference_rounds is the default of the rows that name no rounds."""
    rows, rounds = compare.parse_references("unsharded, ceiling:1", 3, None)
    assert rows == ["unsharded", "ceiling"] and rounds == {"unsharded": 3, "ceiling": 1}
    ns = SimpleNamespace(references=rows, rounds_of=rounds)
    assert [compare.round_references(ns, i) for i in range(3)] == [["unsharded", "ceiling"], ["unsharded"],
                                                                   ["unsharded"]]
    assert compare.parse_references("stock:2,unsharded", 3, 1)[1] == {"stock": 2, "unsharded": 1}


def test_reference_and_parallel_flags_are_checked_before_any_run(tmp_path):
    for args, match in [(["--reference", "ceiling,huge"], "unknown --reference row"),
                        (["--parallel", "--explain"], "--parallel runs compare pairs side by side"),
                        (["--reference_rounds", "1"], "--reference_rounds 1 needs --reference"),
                        (["--keep_runs", "--explain"], "--keep_runs continues a compare run or an autotune search"),
                        (["--reference", "--repeats", "2", "--reference_rounds", "3"], "a value from 1 to --repeats"),
                        (["--reference", "ceiling:3", "--repeats", "2"], "--reference ceiling:3: the rounds after"),
                        (["--reference", "ceiling:x"], "--reference ceiling:x: the rounds after"),
                        (["--reference", "ceiling,ceiling:1"], "names 'ceiling' twice")]:
        proc = run([sys.executable, COMPARE, *args, "--out", tmp_path], check=False, timeout=60)
        assert proc.returncode == 2 and match in proc.stderr, proc.stderr[-1000:]


def test_time_limit_stops_between_runs_when_the_longest_would_not_fit(tmp_path, monkeypatch, capsys):
    """--time_limit: a run starts only if its row's longest run so far still fits in the time left; compare
    then stops with TIME_LIMIT_EXIT, writes the report of the pairs that finished, marked partial, and prints the
    command that runs the rest (--keep_runs). Runs take 100 s of a fake clock here, so the test does not depend on
    the machine's speed."""
    from tests.test_results import make_result

    clock, launched = [1000.0], []

    def fake_launch(path, train, world, out, log, timeout, env=None):
        launched.append(out.name)
        clock[0] += 100.0
        return make_result(path, train=dataclasses.replace(train, steps=6, warmup_steps=2))

    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(compare, "launch", fake_launch)
    base = ["--repeats", "3", "--out", str(tmp_path)]
    assert compare.cli([*base, "--time_limit", "350"]) == compare.TIME_LIMIT_EXIT
    # 0 -> 100 -> 200 -> 300 s; 50 s left < the longest run (100 s): the fourth is not started
    assert launched == ["deepspeed_0.json", "lightning_0.json", "lightning_1.json"]
    captured = capsys.readouterr()
    assert "--time_limit 350: 50 s left, and the longest run of deepspeed took 100 s; stopped before deepspeed " \
           "(round 2), " \
           "3 run(s) left" in captured.err
    assert f"to run the rest: python compare.py {' '.join(base)} --time_limit 350 --keep_runs" in captured.err
    assert "The report above covers the 1 pair(s) that finished." in captured.err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["partial"]["pairs"] == 1 and report["partial"]["repeats"] == 3
    assert report["paths"]["lightning"]["tflops_spread"]["n"] == 1 and report["ratio_spread"]["n"] == 1  # round 2 out
    assert "PARTIAL: 1 of 3 pair(s); --time_limit 350" in captured.out
    assert "1 of 3 interleaved repeats per path (partial" in (tmp_path / "report.md").read_text()
    launched.clear()
    assert compare.cli([*base, "--time_limit", "1"]) == compare.TIME_LIMIT_EXIT
    assert launched == ["deepspeed_0.json"]  # the first run always starts: nothing to estimate from
    assert not (tmp_path / "report.json").exists()  # no pair finished: no report (the earlier one was replaced)
    assert "The report above" not in capsys.readouterr().err


def test_time_limit_counts_the_runs_an_earlier_invocation_left(monkeypatch):
    """A continued compare plans with its kept runs' durations too. As on one H100: the first call's raw run compiled
    cold (280 s with start-up); in the second, the Lightning run took 207 s, warm, and the unsharded row, never run
    before, would have started with 269 s left and been cut by the call's end. Counting the kept run, it is not
    started; counting only this invocation's runs, as before, it would be."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    def second_call(kept_s):
        limit = TimeLimit(476, 0.0, 3, ROOT / "runs", ["python", "compare.py"], ("--keep_runs",), kept_s=kept_s)
        clock[0] = 0.0
        limit.before("lightning (round 1)", rows=("lightning",))
        clock[0] = 207.0
        limit.after(1)
        limit.before("unsharded (round 1)", rows=("unsharded",))

    with pytest.raises(TimeLimitReached, match="269 s left, and the longest run so far took 280 s; stopped before "
                                               "unsharded"):
        second_call([("deepspeed", 280.0)])
    second_call([])  # nothing kept to plan with: only this invocation's 207 s


def test_time_limit_plans_a_row_at_its_own_longest_run(monkeypatch):
    """A row that has run is planned at its own longest run, not at another row's. As in the fp8 compare on one H100:
    the raw run compiled cold (350 s with start-up), the Lightning run took 247 s. In the next call (here a 540 s
    limit, and a raw run of 230 s) the Lightning run, planned at the raw row's 350 s, would not start with 310 s left,
    and every call would measure one run; at its own 247 s it does. A row is never planned below its longest run (the
    committed runs of a row grew from call to call: 350 -> 361 s raw, 247 -> 287 s Lightning), and a row not run yet
    is planned at the longest run of any row."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    limit = TimeLimit(540, 0.0, 5, ROOT / "runs", ["python", "compare.py"], ("--keep_runs",),
                      kept_s=[("deepspeed", 350.0), ("lightning", 247.0)])
    assert limit.planned_s(("lightning",)) == 247.0 and limit.planned_s(("unsharded",)) == 350.0
    assert limit.planned_s(("deepspeed", "lightning")) == 350.0  # a group side by side: its longest row
    limit.before("deepspeed (round 2)", rows=("deepspeed",))
    clock[0] = 230.0
    limit.after(1)
    assert limit.planned_s(("deepspeed",)) == 350.0  # a shorter run does not lower the row's plan
    limit.before("lightning (round 2)", rows=("lightning",))  # 310 s left >= 247 s
    clock[0] = 520.0
    limit.after(1)
    assert limit.row_s == {"deepspeed": 350.0, "lightning": 290.0}  # a longer one raises it
    with pytest.raises(TimeLimitReached, match="20 s left, and the longest run of deepspeed took 350 s; stopped "
                                               "before deepspeed \\(round 3\\), 3 run\\(s\\) left"):
        limit.before("deepspeed (round 3)", rows=("deepspeed",))
    with pytest.raises(TimeLimitReached, match="20 s left, and the longest run so far took 350 s; stopped before "
                                               "unsharded"):
        limit.before("unsharded (round 2)", rows=("unsharded",))


def test_time_limit_plans_a_reference_rows_first_run_as_a_cold_compile(monkeypatch):
    """As on one H100: the paths' runs took 138 and 144 s with warm caches; the unsharded row, planned at 144 s, was
    started with about 195 s left and cut at 216 s by the call's end, every second of it lost. A reference row's
    first run compiles graphs no path compiled: planned at COLD_FACTOR x the longest run so far, it is not started
    there; once it has run, its own longest run plans it. The paths keep the plain plan."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    def first_call(cold_rows):
        limit = TimeLimit(477, 0.0, 4, ROOT / "runs", ["python", "compare.py"], ("--keep_runs",), cold_rows=cold_rows)
        for row, took in (("deepspeed", 138.0), ("lightning", 144.0)):
            limit.before(f"{row} (round 1)", rows=(row,))
            clock[0] += took
            limit.after(1)
        return limit

    clock[0] = 0.0
    limit = first_call(COLD_ROWS)
    assert limit.planned_s(("unsharded",)) == pytest.approx(144.0 * TimeLimit.COLD_FACTOR)
    assert limit.planned_s(("deepspeed",)) == 138.0
    with pytest.raises(TimeLimitReached, match=r"195 s left, and a first run of unsharded compiles cold: planned "
                                               r"at 1.8x the longest run so far \(144 s\), 259 s; stopped before"):
        limit.before("unsharded (round 1)", rows=("unsharded",))
    clock[0] = 0.0
    first_call({}).before("unsharded (round 1)", rows=("unsharded",))  # the plain plan: 144 s, started
    # after its first run the row is planned at its own time (127 s in the next call), not at the factor
    limit = TimeLimit(375, 0.0, 4, ROOT / "runs", ["python", "compare.py"], ("--keep_runs",), cold_rows=COLD_ROWS,
                      kept_s=[("deepspeed", 138.0), ("lightning", 144.0), ("unsharded", 127.0)])
    assert limit.planned_s(("unsharded",)) == 127.0


def test_time_limit_plans_the_stock_rows_first_run_from_the_paths_runs(monkeypatch):
    """The stock row compiles the paths' model with DeepCompile: its first run is planned at COLD_FACTOR x the paths'
    longest run, not at a whole-model row's cold compile. As on one H100, a three-round compare kept the paths' runs
    (up to 200 s) and an unsharded run of 310 s: planned from every row, a first stock run needed 558 s, more than a
    warm call's 541, so no call could add it; from the paths' runs it needs 360 s. Another reference row not run yet
    keeps the plan from every row."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    kept = [("deepspeed", 172.7), ("lightning", 200.0), ("unsharded", 310.0), ("ceiling", 222.0)]
    limit = TimeLimit(541, 0.0, 2, ROOT / "runs", ["python", "compare.py"], ("--keep_runs",), kept_s=kept,
                      cold_rows=COLD_ROWS)
    assert limit.planned_s(("stock",)) == pytest.approx(200.0 * TimeLimit.COLD_FACTOR)
    assert limit.planned_s(("fsdp2",)) == pytest.approx(310.0 * TimeLimit.COLD_FACTOR)
    limit.before("stock (round 1)", rows=("stock",))  # 541 s left >= 360 s: started
    clock[0] = 300.0
    limit.after(1)
    assert limit.planned_s(("stock",)) == 300.0  # then its own run plans it
    with pytest.raises(TimeLimitReached, match=r"241 s left, and the longest run of stock took 300 s"):
        limit.before("stock (round 2)", rows=("stock",))
    clock[0] = 0.0
    limit = TimeLimit(300, 0.0, 1, ROOT / "runs", ["python", "compare.py"], ("--keep_runs",), kept_s=kept,
                      cold_rows=COLD_ROWS)
    with pytest.raises(TimeLimitReached, match=r"300 s left, and a first run of stock compiles cold: planned at 1.8x "
                                               r"the longest run so far of deepspeed and lightning \(200 s\), 360 s"):
        limit.before("stock (round 1)", rows=("stock",))


def test_time_limit_plans_the_bf16_rows_first_run_at_the_fp8_paths_longest(monkeypatch):
    """The bf16 row compiles the fp8 paths' model without the casts: its first run is planned at the paths' longest
    run, not at 1.8x it. As on one H100, the raw fp8 run compiled cold in 331 s and the Lightning run took 279 s in
    the next call; at 1.8x (596 s) no call under 10 minutes could ever start the bf16 row."""
    from harness.launch import COLD_FACTORS

    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    kept = [("deepspeed", 331.0), ("lightning", 279.0)]
    limit = TimeLimit(541, 0.0, 4, ROOT / "runs", ["python", "compare.py"], ("--keep_runs",), kept_s=kept,
                      cold_rows=COLD_ROWS, cold_factors=COLD_FACTORS)
    assert limit.planned_s(("bf16",)) == 331.0
    assert limit.planned_s(("stock",)) == pytest.approx(331.0 * TimeLimit.COLD_FACTOR)  # the others keep 1.8x
    limit.before("bf16 (round 1)", rows=("bf16",))  # 541 s left >= 331 s: started
    clock[0] = 136.0
    limit.after(1)
    assert limit.planned_s(("bf16",)) == 136.0  # then its own run plans it
    clock[0] = 0.0
    limit = TimeLimit(300, 0.0, 1, ROOT / "runs", ["python", "compare.py"], ("--keep_runs",), kept_s=kept,
                      cold_rows=COLD_ROWS, cold_factors=COLD_FACTORS)
    with pytest.raises(TimeLimitReached, match=r"300 s left, and a first run of bf16 compiles cold: planned at 1x "
                                               r"the longest run so far of deepspeed and lightning \(331 s\), 331 s"):
        limit.before("bf16 (round 1)", rows=("bf16",))


@pytest.mark.parametrize("args, match", [(["--time_limit", "0", "--out", "r"], "--time_limit must be positive"),
                                         (["--time_limit", "60"], "got --time_limit 60 without --out"),
                                         (["--time_limit", "60", "--out", "r", "--explain"], "--explain/--autotune"),
                                         (["--time_limit", "60", "--out", "r", "--cross_check"], "--cross_check")])
def test_time_limit_is_checked_before_any_run(args, match, capsys):
    with pytest.raises(SystemExit) as e:
        compare.cli(args)
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--timeout", "0"], "--timeout must be positive (seconds a run may take), got 0"),
    (["--mb_grid", "1,2"], "--mb_grid is an option of --autotune, which this command does not ask for"),
    (["--budget_s", "100"], "--budget_s is an option of --autotune"),
    (["--factors", "gc"], "--factors is an option of --explain"),
    (["--autotune", "--budget_s", "0"], "--budget_s must be positive, got 0"),  # 0 is not "unset"
    (["--autotune", "--budget_s", "nan"], "--budget_s must be positive, got nan"),
])
def test_flags_a_mode_ignores_and_empty_limits_are_refused_in_process(args, message, capsys):
    from compare import parse

    with pytest.raises(SystemExit) as e:
        parse(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_help_calls_out_a_report_folder():
    from compare import build_parser

    out = next(a for a in build_parser()._actions if a.dest == "out")
    assert out.help.startswith("the report's folder") and "reports/latest" in out.help


def test_a_failed_cross_check_run_leaves_the_report_of_the_pairs_written(tmp_path, monkeypatch, capsys):
    from shared.train.results import RunResult

    made = ROOT / "benchmarks" / "results" / "together_1xh200" / "compare" / "runs"

    def fake_launch(path, train, world, out, log, timeout, env=None):
        if out.name.endswith("_breakdown.json"):
            raise compare.CompareError(f"{path} run failed; reason: injected")
        return RunResult.from_json(made / f"{path}_0.json")

    monkeypatch.setattr(compare, "launch", fake_launch)
    assert compare.cli(["--repeats", "1", "--cross_check", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["paths"]) == {"deepspeed", "lightning"} and "cross_check" not in report
    assert (tmp_path / "report.md").exists()
    assert "the cross-check failed (deepspeed run failed; reason: injected); the report above was written without it" \
           in capsys.readouterr().err


@pytest.mark.parametrize("log, reason", [
    # raised before the process group started: no rank prefix; torchrun's own ChildFailedError comes after it
    ("Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\nImportError: cannot import name "
     "'x'\nTraceback (most recent call last):\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
     "ImportError: cannot import name 'x'"),
    # the exception line, not the source line above it that names the error
    ("[rank0]: Traceback (most recent call last):\n[rank0]:     raise pickle.UnpicklingError(msg) from None\n"
     "[rank0]: _pickle.UnpicklingError: Weights only load failed\n[rank1]: RuntimeError: Connection closed by peer\n",
     "_pickle.UnpicklingError: Weights only load failed"),
    ("[rank0]: error: micro_batch 8 does not fit in H200\n", "error: micro_batch 8 does not fit in H200"),
])
def test_a_failed_runs_reason_is_its_last_exception_line(tmp_path, monkeypatch, log, reason):
    from harness import launch

    def fake_run(path, cmd, env, log_path, timeout):
        log_path.write_text(" ".join(cmd) + "\n" + log)
        return 1

    monkeypatch.setattr(launch, "_run", fake_run)
    with pytest.raises(launch.CompareError) as e:
        launch.launch("deepspeed", TrainConfig(), 1, tmp_path / "r.json", tmp_path / "r.log", 60)
    assert e.value.reason == f"reason: {reason}"


def test_a_new_compare_clears_the_earlier_ones_report_runs_and_logs_only(tmp_path):
    for name in ("report.json", "report.md", "phases.png", "notes.txt", "runs/deepspeed_0.json",
                 "runs/lightning_1.json", "runs/ceiling_0.json", "runs/deepspeed_breakdown.json",
                 "logs/fsdp2_0.log", "runs/mine.json", "logs/deepspeed_old.log"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("earlier")
    gone = compare.clear_previous_report(tmp_path)
    assert len(gone) == 8 and not (tmp_path / "report.json").exists()
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["logs/deepspeed_old.log", "notes.txt", "runs/mine.json"]  # not a compare's: kept


def test_the_stock_row_is_the_raw_path_under_the_stock_profile_and_the_report_rates_each_path_over_it(monkeypatch):
    """--reference stock: the raw path with the stock profile's settings (its rules applied) and the compare's own
    model, micro-batch and warm-up; the report gives each path over it as the ratio of medians with the per-round
    range, and the table prints it."""
    from harness.launch import row_config
    from shared.model import config as model_config
    from shared.train.profiles import PROFILES

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fast = TrainConfig(preset="1.5b", micro_batch=16, warmup_steps=10, steps=20, profile="fast",
                       **{k: v for k, v in PROFILES["fast"].settings.items() if k != "micro_batch"})
    stock = row_config("stock", fast, 1)
    assert stock.profile == "stock" and (stock.micro_batch, stock.warmup_steps, stock.preset) == (16, 10, "1.5b")
    assert all(getattr(stock, k) == v for k, v in PROFILES["stock"].settings.items() if k != "warmup_steps")
    assert row_config("deepspeed", fast, 1) is fast and row_config("ceiling", fast, 1) is fast
    stage0 = row_config("stock", TrainConfig(preset="1.5b", stage=0, warmup_steps=10, steps=20), 1)
    assert stage0.compile == "none" and stage0.zero3_step == "deepspeed"  # its rule: no ZeRO pass at stage 0
    runs = {"deepspeed": [_run(2.0), _run(2.2)], "lightning": [_run(2.1), _run(2.0)], "stock": [_run(1.6), _run(2.0)]}
    for r in runs["stock"]:
        r.fused = {"compile": "deepcompile"}
    report = reports.build_report(TrainConfig(precision="fp32"), SimpleNamespace(world=1, repeats=2), runs, {}, [])
    over = report["over_stock"]["deepspeed"]
    assert over["ratio"] == pytest.approx(2.1 / 1.8) and (over["min"], over["max"], over["n"]) == (
        pytest.approx(1.1), pytest.approx(1.25), 2)
    assert "deepspeed over the stock row (DeepSpeed as shipped): 1.167x [1.100, 1.250] over 2 round(s)" in \
        reports.format_table(report)
    # its dropout masks are torch's, not the paths' kernel's: its step-0 loss moves by their noise, not by another draw
    # of the weights (the measurements: docs/results.md, "What the fast profile adds over DeepSpeed as shipped")
    runs["stock"][0].losses = [runs["deepspeed"][0].losses[0] + 7e-3, 1.0]
    report = reports.build_report(TrainConfig(precision="fp32"), SimpleNamespace(world=1, repeats=2), runs, {}, [])
    assert report["same_start"]["ok"] and report["same_start"]["tolerances"] == {"stock": 5e-2}
    assert "stock 7.00e-03 / 0.00e+00 (within 0.05)" in reports.format_table(report)
    runs["stock"][0].losses = [runs["deepspeed"][0].losses[0] + 0.1, 1.0]
    assert not reports.build_report(TrainConfig(precision="fp32"), SimpleNamespace(world=1, repeats=2), runs, {},
                                    [])["same_start"]["ok"]


def test_the_bf16_row_is_the_raw_path_at_bf16_under_the_paths_profile_and_the_report_rates_fp8_over_it(monkeypatch):
    """--precision fp8 --reference bf16: the raw path at bf16 with the settings the paths' profile gives bf16 (its fp8
    rule, the unfused tails, does not carry over), the user's own flags, micro-batch and warm-up kept; refused beside
    a compare that is not fp8. The report gives each fp8 path over it, round by round, and judges its step-0 loss
    within a tolerance of its own (FP8's forward rounds further from bf16's than bf16's own precision)."""
    from harness.launch import BF16_ROW_REFUSAL, COLD_ROWS, PATHS, row_config
    from shared.model import config as model_config
    from shared.model import fp8
    from shared.train import profiles

    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fp8, "device_capability", lambda: (9, 0))
    given = dict(preset="1.5b", precision="fp8", fp8_recipe="rowwise", micro_batch=8, triton_loss=False,
                 warmup_steps=10, steps=20)
    resolved = profiles.resolve(given, "fast", cuda=True, gpus=1)
    train = TrainConfig(**given, **resolved.filled, profile="fast")
    assert not train.triton_gelu_grad and not train.triton_dropout  # the fast profile's fp8 rule
    bf16 = row_config("bf16", train, 1, resolved.filled)
    fast_bf16 = profiles.resolve({**given, "precision": "bf16"}, "fast", cuda=True, gpus=1).filled
    assert (bf16.precision, bf16.profile, bf16.fp8_recipe) == ("bf16", "fast", TrainConfig.fp8_recipe)
    assert bf16.triton_gelu_grad and bf16.triton_dropout and bf16.compile == fast_bf16["compile"] == "deepcompile"
    assert (bf16.triton_loss, bf16.micro_batch, bf16.warmup_steps, bf16.preset) == (False, 8, 10, "1.5b")
    assert all(getattr(bf16, k) == v for k, v in fast_bf16.items() if k not in given)
    assert COLD_ROWS["bf16"] == PATHS  # its first run compiles the paths' model with DeepCompile, as theirs did
    with pytest.raises(ValueError, match=re.escape(BF16_ROW_REFUSAL.format(precision="bf16"))):
        row_config("bf16", TrainConfig(preset="1.5b", precision="bf16"), 1, resolved.filled)

    runs = {"deepspeed": [_run(2.2), _run(2.4)], "lightning": [_run(2.3), _run(2.2)], "bf16": [_run(2.0), _run(2.0)]}
    for r in runs["bf16"]:
        r.fused = {"compile": "deepcompile"}
    runs["bf16"][0].losses = [5.02, 4.9]  # 0.02 from the raw path's step-0 loss: inside the bf16 row's tolerance
    report = reports.build_report(train, SimpleNamespace(world=1, repeats=2), runs, {}, [])
    over = report["over_bf16"]["deepspeed"]
    assert over["ratio"] == pytest.approx(2.3 / 2.0) and (over["min"], over["max"], over["n"]) == (
        pytest.approx(1.1), pytest.approx(1.2), 2)
    table = reports.format_table(report)
    assert "deepspeed in fp8 over the bf16 row (the same profile at bf16): 1.150x [1.100, 1.200] over 2 round(s)" \
        in table
    assert report["same_start"]["ok"]
    assert report["same_start"]["tolerances"] == {"bf16": reports.START_TOLERANCES["bf16"]}
    assert "bf16 2.00e-02 / 0.00e+00 (within 0.05)" in table
    runs["bf16"][0].losses = [5.2, 4.9]  # another draw of the weights
    assert not reports.build_report(train, SimpleNamespace(world=1, repeats=2), runs, {}, [])["same_start"]["ok"]


def test_the_bf16_row_is_refused_beside_a_bf16_compare_and_left_out_of_its_bare_reference_flag(capsys):
    with pytest.raises(SystemExit) as e:
        compare.parse(["--reference", "bf16"])
    assert e.value.code == 2
    assert "--reference bf16 runs the raw path at bf16 beside an FP8 compare" in capsys.readouterr().err
    assert "bf16" not in compare.parse(["--reference"])[1].references


def test_the_bare_reference_flag_leaves_the_stock_row_out_on_a_cpu_where_it_runs_deepspeeds_eager_step():
    assert compare.parse(["--reference"])[1].references == ["unsharded", "ceiling", "fsdp2"]
    train, ns = compare.parse(["--reference", "stock"])
    assert ns.references == ["stock"]
    from harness.launch import row_config

    stock = row_config("stock", train, 1)
    assert (stock.profile, stock.compile, stock.zero3_step) == ("stock", "none", "deepspeed")


def test_compare_trains_on_the_shipped_text_unless_told_otherwise():
    """Loss parity on random tokens hardly tests training (the loss barely moves from the uniform floor): compare.py
    runs on the shipped text by default, and --data still picks synthetic tokens or a token file."""
    assert compare.parse([])[0].data == "kjv"
    assert compare.parse(["--data", "synthetic"])[0].data == "synthetic"
    data = next(a for a in compare.build_parser()._actions if a.dest == "data")
    assert "(default in compare.py: kjv, so that loss parity judges real training)" in data.help
