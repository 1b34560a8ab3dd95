"""benchmarks/device.py on a CPU: the stage table holds commands the scripts accept, and a call keeps to its budget,
packs what it wrote and continues a folder."""

import argparse
import ast
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import device
from tests.helpers import ROOT

STAGES = device.load()
# a value for each setting a stage requires, and test files for the pytest stages
SAMPLES = {"configs": "baseline,-triton_loss,baseline_again",
           "versus": "benchmarks/results/tuning_1xh200/autotune/autotune.json",
           "tests": "tests/test_deepcompile.py tests/test_timing.py"}


def commands(stage: device.Stage) -> list[list[str]]:
    """Every command of `stage` with its defaults (and SAMPLES where it takes them), as the driver would run it."""
    params = device.settings(stage, [f"{k}={v}" for k, v in SAMPLES.items() if k in stage.params])
    call = device.Call(stage, params, Path("/tmp/work"), None, "h200", dry_run=True)
    return [device.argv(c.command, {**call.values, "time_limit": 500}) for c in stage.commands()]


def script_flags(path: Path) -> set[str]:
    """The option strings a script's add_argument calls declare (read, not run: ablation.py parses and runs at once)."""
    return {arg.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


@pytest.fixture
def pretend_gpus(monkeypatch):
    """compare.parse as on a machine with two GPUs: it checks every flag and their combinations, starts nothing."""
    import compare
    import shared.model.config as model_config

    monkeypatch.setattr(compare.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compare.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(compare, "gpu_memory_gib", lambda: 139.8)
    monkeypatch.setattr(compare, "check_before_start", lambda *a, **k: None)
    monkeypatch.setattr(compare, "check_overheads", lambda *a, **k: None)
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    return compare


def test_the_table_holds_the_stages_that_are_kept():
    assert set(STAGES) == {"headline", "fp8_curve", "resume", "lever", "gpu_tests", "explain", "compare", "autotune",
                           "ds_autotuner", "train"}
    for name, stage in STAGES.items():
        assert stage.question and 0 < stage.budget_s <= 600, name
        assert all(0 < device.needs(stage, c, stage.params | {"tests_s": "1"}) < stage.budget_s
                   for c in stage.commands()), name


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_command_of_a_stage_is_one_its_script_accepts(name, pretend_gpus, capsys):
    for cmd in commands(STAGES[name]):
        assert cmd[0] == sys.executable
        words = cmd[1:]
        if words[:2] in (["-m", "torch.distributed.run"], ["-m", "deepspeed.launcher.runner"]):
            # torchrun, deepspeed: the script and its flags follow the launcher's own
            words = words[next(i for i, w in enumerate(words) if w.endswith(".py")):]
        if words[0] == "compare.py":
            train, ns = pretend_gpus.parse(words[1:])  # exits 2, naming the flag, if any is wrong
            assert ns.out and Path(ns.out).parent == Path("/tmp/work"), cmd
        elif words[0] == "benchmarks/ablation.py":
            flags = {w.split("=")[0] for w in words[1:] if w.startswith("--")}
            assert flags <= script_flags(ROOT / words[0]), cmd
        elif words[0] == "benchmarks/ds_autotuner.py":
            from benchmarks import ds_autotuner

            ds_autotuner.build_parser().parse_args(words[1:])
        elif words[0] in ("plain_deepspeed/train.py", "lightning_app/train.py"):
            from shared.train.cli import Parser, add_config_args

            parser = Parser()
            add_config_args(parser)
            parser.parse_args(words[1:])
        elif words[:2] == ["-m", "pytest"]:
            assert words[2:4] == ["-m", "gpu"], cmd
            paths = [w.split("::")[0] for w in words[4:] if not w.startswith("-") and w != "no:cacheprovider"]
            assert paths and all((ROOT / p).exists() for p in paths), cmd
        elif words[0] == "-c":  # a line of Python (a stage's clean-up)
            compile(words[1], "<-c>", "exec")
        elif words[0] == "-m":
            assert importlib.util.find_spec(words[1]) is not None, cmd
            assert all((ROOT / w).exists() for w in words[2:] if w.startswith("data/")), cmd
        else:
            pytest.fail(f"no check for {cmd}")


def test_what_a_stage_continues_is_the_folder_its_command_writes():
    for name, stage in STAGES.items():
        if stage.keep is None:
            continue
        kept = device.fill(stage.keep, {**stage.params, "device": "1xh200"})
        if any(c.creates for c in stage.run):  # each run done where its file is kept
            values = {**stage.params, "device": "1xh200", "work": "/tmp/work"}
            made = [device.fill(c.creates, values) for c in stage.run if c.creates]
            assert all(Path(m).parent == Path("/tmp/work", kept) for m in made), name
            runs = commands(stage)[len(stage.setup):]  # the setup's commands come first
            runs = [cmd for c, cmd in zip(stage.run, runs, strict=True) if c.creates]
            assert all(m in cmd for m, cmd in zip(made, runs, strict=True)), name  # its own --out
            continue
        # the command that continues what it finds there (not a setup's)
        first = next(c for c in commands(stage) if {"--keep_runs", "--keep"} & set(c))
        assert first[first.index("--out") + 1] == f"/tmp/work/{kept}", name


def test_a_rowwise_curve_run_lands_beside_the_kept_tensorwise_one():
    """fp8_curve with `--set recipe=rowwise --set candidate=fp8_rowwise`: the fp8 run trains rowwise and writes its own
    JSON, so a kept folder's tensorwise fp8.json (and both bf16 runs) stay done and untouched."""
    stage = STAGES["fp8_curve"]
    params = device.settings(stage, ["recipe=rowwise", "candidate=fp8_rowwise"])
    call = device.Call(stage, params, Path("/tmp/work"), None, "h100", dry_run=True)
    fp8 = device.argv(stage.run[0].command, call.values)
    assert fp8[fp8.index("--fp8_recipe") + 1] == "rowwise"
    assert fp8[fp8.index("--out") + 1] == "/tmp/work/fp8_curve_1xh100/fp8_rowwise.json"
    assert device.fill(stage.run[0].creates, call.values) == "/tmp/work/fp8_curve_1xh100/fp8_rowwise.json"
    assert [device.fill(c.creates, call.values) for c in stage.run[1:3]] == [
        "/tmp/work/fp8_curve_1xh100/bf16_a.json", "/tmp/work/fp8_curve_1xh100/bf16_b.json"]


def test_an_unknown_stage_or_setting_is_refused_by_name(capsys, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    for args, message in ((["nope", "--dry_run"], "unknown stage 'nope'; stages: headline, lever"),
                          (["lever", "--dry_run"], "stage 'lever' needs --set configs=..."),
                          (["headline", "--set", "mb=8", "--dry_run"], "--set mb: stage 'headline' takes"),
                          (["headline", "--set", "mb", "--dry_run"], "--set 'mb': expected name=value"),
                          (["explain", "--keep", "warm", "--dry_run"], "stage 'explain' has nothing to continue"),
                          (["headline", "--budget_s", "0", "--dry_run"], "budget_s must be in (0, 600]"),
                          (["headline"], "--out (or $OUT)")):
        with pytest.raises(SystemExit) as e:
            device.main(args)
        assert e.value.code == 2 and message in capsys.readouterr().err, args


def test_a_table_with_an_unknown_placeholder_is_refused(tmp_path):
    table = tmp_path / "stages.toml"
    table.write_text('[s]\nquestion = "q"\nbudget_s = 10\n[[s.run]]\ncommand = "python x.py {mb}"\nlog = "x.log"\n'
                     "needs_s = 1\n")
    with pytest.raises(device.StageError, match=r"\['mb'\] in 'python x.py \{mb\}' are neither params"):
        device.load(table)


def test_the_dry_run_prints_each_command_with_its_time_limit_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, ROOT / "benchmarks" / "device.py", "lever", "--set", "configs=baseline",
                           "--set", "tests=tests/test_timing.py", "--gpu", "h100", "--out", out, "--dry_run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("$ ")]
    assert any("DeepCompileBuilder().load()" in ln for ln in lines)  # the ops first, side by side
    ablation = next(ln for ln in lines if "benchmarks/ablation.py" in ln)
    # the time left less the 200 s kept for the tests after it, less the margin for stopping between runs
    limit = int(ablation.split("--time_limit ")[1].split()[0])
    assert 565 - device.PACK_S - 200 - device.TIME_LIMIT_MARGIN_S - 5 <= limit <= 565 - 200
    assert "--configs=baseline" in ablation and "CUDA_VISIBLE_DEVICES" in ablation
    assert lines[-2].endswith("-m pytest -m gpu -v -rA -p no:cacheprovider tests/test_timing.py    # env "
                              f"{{'CUDA_VISIBLE_DEVICES': '0', "
                              f"'GPU_TEST_RECORD': '{device.WORK}/lever/gpu_test_record.json'}}")
    assert f"benchmarks/compile_cache.py save {out}" in lines[-1]  # last, the caches for the next machine
    assert not out.exists()


TABLE = """
[probe]
question = "a stage that runs on a CPU"
budget_s = {budget}
min_gpus = 0
keep = "kept"
params = {{ slow = "", big = "500", count = "{count}" }}

[[probe.run]]
command = "python {{count}} {{work}}/kept"
log = "first.log"
needs_s = 1

[[probe.run]]
command = "python -c 'import time; time.sleep(60)'"
log = "slow.log"
needs_s = 1
when = "slow"

[[probe.run]]
command = "python -c 'print(1)'"
log = "big.log"
needs_s = "big"
"""


@pytest.fixture
def call_here(tmp_path, monkeypatch):
    """A driver's call kept to tmp_path: no warm folder or compile cache of this machine, and a second of grace after
    a SIGTERM, as these tables' budgets are seconds."""
    monkeypatch.setattr(device, "WARM", tmp_path / "warm")
    monkeypatch.setattr(device, "COMPILE_CACHE", tmp_path / "none")
    monkeypatch.setattr(device, "GRACE_S", 1)


def test_a_call_skips_what_would_not_fit_packs_its_folder_and_keeps_it_warm(tmp_path, call_here, capsys):
    count = tmp_path / "count.py"  # makes the folder if need be and writes in it how many files it held
    count.write_text("import pathlib, sys\np = pathlib.Path(sys.argv[1])\np.mkdir(exist_ok=True)\n"
                     "(p / 'n').write_text(str(len(list(p.iterdir()))))\n")
    table = tmp_path / "stages.toml"
    table.write_text(TABLE.format(budget=30, count=count))
    args = ["probe", "--stages", str(table), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        device.main([*args, "--keep", "warm"])
    assert e.value.code == 2 and "no " + str(tmp_path / "warm" / "probe_1xcpu") in capsys.readouterr().err
    assert device.main(args) == 3  # the third command needs 500 s of the 30
    record = json.loads((tmp_path / "out" / "device.json").read_text())
    assert [c.get("exit") for c in record["commands"]] == [0, None]  # the slow one is not asked for
    assert "would not fit" in record["commands"][1]["skipped"]
    with tarfile.open(tmp_path / "out" / "probe.tar.gz") as tar:
        assert {"./first.log", "./kept/n", "./device.json"} <= set(tar.getnames())
    assert (tmp_path / "warm" / "probe_1xcpu" / "n").read_text() == "0"  # the kept folder, copied
    # the next call continues the folder the last one left, and a command cut by the budget stops there
    table.write_text(TABLE.format(budget=20, count=count).replace('big = "500"', 'big = "1"'))
    assert device.main([*args, "--keep", "warm", "--set", "slow=yes"]) == 3
    assert (tmp_path / "work" / "kept" / "n").read_text() == "1"
    record = json.loads((tmp_path / "out" / "device.json").read_text())
    slow = record["commands"][1]
    assert slow["timed_out"] and slow["seconds"] < 20 and "skipped" in record["commands"][2]


def test_the_archived_device_scripts_are_a_record_the_driver_replaces():
    archive = ROOT / "benchmarks" / "archive"
    assert not list((ROOT / "benchmarks").glob("h200_*.sh"))
    assert {p.name for p in archive.glob("h200_*.sh")} == {
        "h200_compare.sh", "h200_deepcompile.sh", "h200_explain.sh", "h200_fused.sh", "h200_train_and_scale.sh",
        "h200_tuning.sh"}
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for stage in STAGES:  # every stage is in the benchmarks' README, with its command
        assert f"python benchmarks/device.py {stage}" in readme, stage


def test_result_folders_are_named_by_the_gpus_model():
    assert [device.kind_of(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")] == [
        "h200", "h100", "a100"]


def test_the_driver_parses_its_own_flags_like_the_other_entry_points():
    parser = device.build_parser(STAGES)
    assert isinstance(parser, argparse.ArgumentParser)
    ns = parser.parse_args(["headline", "--set", "repeats=1", "--set", "tests=tests/test_timing.py", "--keep", "warm"])
    assert (ns.stage, ns.sets, ns.keep) == ("headline", ["repeats=1", "tests=tests/test_timing.py"], "warm")


def test_a_compile_cache_save_cut_by_the_calls_end_is_said_and_not_an_error(capsys):
    """The save runs last, in what is left of the call; one that outlasts it (10 MiB of caches took over 16 s on one
    H100) must not turn a call whose results are packed into a traceback and exit status 1."""
    slow = [sys.executable, "-c", "import time; time.sleep(30)"]
    assert not device.save_compile_cache(slow, dict(os.environ), 0.5)
    assert "compile cache: not saved, its save took longer than the 0 s left" in capsys.readouterr().out
    assert device.save_compile_cache([sys.executable, "-c", "pass"], dict(os.environ), 60)



CREATES = """
[runs]
question = "two runs continued over calls"
budget_s = {budget}
min_gpus = 0
keep = "kept"
params = {{ second_s = "{second_s}" }}

[[runs.run]]
command = "python {append} {{work}}/kept/first.json {{work}}/ran.txt first"
log = "first.log"
needs_s = 1
creates = "{{work}}/kept/first.json"

[[runs.run]]
command = "python {append} {{work}}/kept/second.json {{work}}/ran.txt second"
log = "second.log"
needs_s = "second_s"
creates = "{{work}}/kept/second.json"
"""


def test_a_command_whose_file_the_kept_folder_holds_is_done_and_not_run_again(tmp_path, call_here):
    append = tmp_path / "append.py"  # writes its file and notes that it ran
    append.write_text("import pathlib, sys\nout, ran, name = map(pathlib.Path, sys.argv[1:])\n"
                      "out.parent.mkdir(exist_ok=True)\nout.write_text('{}')\n"
                      "ran.open('a').write(f'{name}\\n')\n")
    table = tmp_path / "stages.toml"
    args = ["runs", "--stages", str(table), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    table.write_text(CREATES.format(budget=30, second_s=500, append=append))
    assert device.main(args) == 3  # the second would not fit
    table.write_text(CREATES.format(budget=30, second_s=1, append=append))
    assert device.main([*args, "--keep", "warm"]) == 0
    assert (tmp_path / "work" / "ran.txt").read_text().split() == ["second"]  # the first was not run again
    record = json.loads((tmp_path / "out" / "device.json").read_text())
    assert "first.json exists" in record["commands"][0]["done"] and "exit" not in record["commands"][0]
    assert record["commands"][1]["exit"] == 0 and sorted(p.name for p in (tmp_path / "work" / "kept").iterdir()) == [
        "first.json", "second.json"]


def test_a_command_that_outlasts_its_need_is_not_cut_for_a_later_one_that_could_not_start_anyway(tmp_path, call_here):
    """A fresh machine's run takes longer than the warm one its need_s was set by: where the command after it would
    not fit once this one had its need, nothing is kept for that one, and this one runs to the budget's end."""
    count = tmp_path / "count.py"
    count.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).mkdir(exist_ok=True)\n")
    table = tmp_path / "stages.toml"
    table.write_text(TABLE.format(budget=14, count=count))  # 6 s after packing's share: the slow one needs 1
    args = ["probe", "--stages", str(table), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    assert device.main([*args, "--set", "slow=yes", "--set", "big=25"]) == 3  # big would not fit after slow's 1 s
    first, slow, big = json.loads((tmp_path / "out" / "device.json").read_text())["commands"]
    assert slow["timed_out"] and slow["seconds"] > 4  # cut by the budget's end, not at its own need
    assert "would not fit" in big["skipped"]
    # the reservation: the later needs that still fit after this one's, in order
    assert device.reserved([25.0], 21.0) == 0 and device.reserved([5.0, 25.0, 10.0], 21.0) == 15.0
    assert device.reserved([], 10.0) == 0 and device.reserved([10.0, 1.0], 10.0) == 10.0


def test_a_run_without_a_time_limit_is_not_cut_to_keep_time_for_the_commands_after_it(tmp_path, call_here):
    """A training run cut mid-way leaves nothing (its JSON comes at its end): a fresh machine's run that outlasts its
    need runs on to the budget's end, and the later command that would have fitted after its need is skipped, not
    the run cut for it. Only a command told its --time_limit, which stops between its runs, keeps time for later."""
    count = tmp_path / "count.py"
    count.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).mkdir(exist_ok=True)\n")
    table = tmp_path / "stages.toml"
    table.write_text(TABLE.format(budget=20, count=count))  # 12 s after packing's share: slow needs 1, big 8
    args = ["probe", "--stages", str(table), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    assert device.main([*args, "--set", "slow=yes", "--set", "big=8"]) == 3
    first, slow, big = json.loads((tmp_path / "out" / "device.json").read_text())["commands"]
    assert slow["timed_out"] and slow["seconds"] > 8  # keeping big's 8 s would have cut it after about 4
    assert "would not fit" in big["skipped"]


def test_a_run_that_ignores_sigterm_is_stopped_and_packed_inside_the_budget(tmp_path, call_here, monkeypatch):
    """A run cut at the budget's end gets SIGTERM, then GRACE_S before SIGKILL: the SIGTERM comes early enough that the
    grace ends inside the budget too. Sent at the budget's end, the grace ran past it, and the device call's own
    limit cut the packing: nothing of the call came back."""
    monkeypatch.setattr(device, "GRACE_S", 4)  # more than the fixture's second: a grace the test can see
    count = tmp_path / "count.py"
    count.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).mkdir(exist_ok=True)\n")
    table = tmp_path / "stages.toml"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: None); time.sleep(60)"
    table.write_text(TABLE.format(budget=16, count=count).replace("import time; time.sleep(60)", stubborn))
    args = ["probe", "--stages", str(table), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    assert device.main([*args, "--set", "slow=yes", "--set", "big=1"]) == 3
    first, slow, big = json.loads((tmp_path / "out" / "device.json").read_text())["commands"]
    assert slow["timed_out"] and slow["seconds"] >= device.GRACE_S  # SIGTERM ignored: killed once the grace was over
    # its grace inside what the budget leaves after packing's share (8 s here; SIGTERM at that end: 12 s), give or take
    # the second a loaded machine takes to kill and reap it
    assert slow["seconds"] < 16 - device.PACK_S + 1
    assert (tmp_path / "out" / "probe.tar.gz").is_file()


def test_deepspeed_installed_per_call_is_imported_through_one_path_with_old_sources(tmp_path, monkeypatch):
    """A device call installs the wheels into a new folder: where DeepSpeed comes from such a PYTHONPATH folder, the
    commands import it through one link (its JIT ops' sources at the same path every call) and its files are older
    than any build, so torch does not rebuild the ops a call on the same machine built before."""
    import importlib.machinery
    import importlib.util

    site = tmp_path / "site_call2"
    (site / "deepspeed" / "ops" / "csrc").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text("")
    (site / "deepspeed" / "ops" / "csrc" / "op.cpp").write_text("int f();")
    spec = importlib.machinery.ModuleSpec("deepspeed", None, is_package=True)
    spec.submodule_search_locations = [str(site / "deepspeed")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "deepspeed" else None)
    monkeypatch.setattr(device, "STABLE_SITE", tmp_path / "stable")
    (tmp_path / "site_call1").mkdir()
    (tmp_path / "stable").symlink_to(tmp_path / "site_call1")  # the last call's
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(site), "/elsewhere"])}
    assert device.stable_deepspeed(env) == f"DeepSpeed imported through {tmp_path / 'stable'} -> {site}"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(tmp_path / "stable"), "/elsewhere"]
    assert (tmp_path / "stable").resolve() == site.resolve()
    assert (tmp_path / "stable" / "deepspeed" / "ops" / "csrc" / "op.cpp").stat().st_mtime == device.SOURCES_MTIME
    # DeepSpeed from a virtual env (not a PYTHONPATH folder): nothing to do, nothing changed
    env = {"PYTHONPATH": str(ROOT)}
    assert device.stable_deepspeed(env) is None and env == {"PYTHONPATH": str(ROOT)}


def _commands(stage: device.Stage, sets: list[str]) -> dict[str, list[str]]:
    """The argv of each command a call of `stage` with these settings runs on an H100, by its log."""
    params = device.settings(stage, sets)
    call = device.Call(stage, params, Path("/tmp/work"), None, "h100", dry_run=True)
    return {c.log: device.argv(c.command, {**call.values, "time_limit": 500}) for c in stage.commands()
            if c.runs(params)}


def test_the_headlines_script_runs_can_stand_for_the_resume_stages_drift_runs():
    """Each path's resume runs train with the headline's training-script run's settings (resume_check compares the
    runs' data, steps, seed and the rest): they differ only in the mid-run passes, the timing warm-up and the output,
    so the headline's scripts=all runs are the drift runs and `--set plain=` leaves the stage's own out."""
    def training(cmd: list[str]) -> dict[str, str]:
        words = cmd[next(i for i, w in enumerate(cmd) if w.endswith("train.py")):]
        flags = dict(zip(words[1::2], words[2::2]))
        return {k: v for k, v in flags.items() if k not in ("--out", "--warmup_steps")}

    headline = _commands(STAGES["headline"], ["scripts=all"])
    resume, without = _commands(STAGES["resume"], []), _commands(STAGES["resume"], ["plain="])
    for path in ("raw", "lightning"):
        assert training(resume[f"{path}_plain.log"]) == training(headline[f"{path}_script.log"]), path
        full = training(resume[f"{path}_full.log"])
        assert {k: v for k, v in full.items() if k not in ("--save_every", "--val_every", "--keep_last",
                                                            "--ckpt_dir")} == training(headline[f"{path}_script.log"])
        assert f"{path}_plain.log" not in without and f"{path}_full.log" in without
    assert any("--out /tmp/zero3bench_kjv" in " ".join(c) for c in resume.values())  # the stage prepares the text


def test_a_param_that_chooses_commands_by_name_runs_those_it_names_and_refuses_another_name():
    """`when = "scripts=raw"`: the headline's training scripts run where `scripts` names them (or all), one a call
    where a compare pair and both would not fit; a name that chooses no command is refused before any work."""
    stage = STAGES["headline"]
    logs = {sets: [c.log for c in stage.run if c.runs(device.settings(stage, [sets]))]
            for sets in ("scripts=", "scripts=raw", "scripts=lightning", "scripts=all", "scripts=raw,lightning")}
    assert logs["scripts="] == ["headline.log"]
    assert logs["scripts=raw"] == ["headline.log", "raw_script.log"]
    assert logs["scripts=lightning"] == ["headline.log", "lightning_script.log"]
    assert logs["scripts=all"] == logs["scripts=raw,lightning"] == ["headline.log", "raw_script.log",
                                                                      "lightning_script.log"]
    for wrong in ("scripts=1", "scripts=raw,ligthning"):
        with pytest.raises(device.StageError, match=r"chooses none of its commands; name some of raw, lightning"):
            device.settings(stage, [wrong])
    assert device.choices_of(STAGES["resume"]) == {}  # `when = "plain"`: any value but "" runs it


def test_the_headlines_references_setting_passes_compare_exactly_those_rows_and_none_when_empty():
    """`--set references=` runs the paths alone: the template passes `--reference=<value>`, since a bare
    `--reference` (what an empty value left of `--reference <value>`) asks compare for every reference row."""
    import compare

    for value, rows in (("", []), ("unsharded,ceiling:1", ["unsharded", "ceiling"]), ("stock:2", ["stock"])):
        cmd = _commands(STAGES["headline"], [f"references={value}", "gpus=1"])["headline.log"]
        args = cmd[cmd.index("compare.py") + 1:]
        assert f"--reference={value}" in args
        ns = compare.build_parser().parse_args(args)
        assert compare.parse_references(ns.reference, ns.repeats, None)[0] == rows, value
