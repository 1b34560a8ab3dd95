"""One driver for the measurements made on a lent GPU machine, one call (at most 10 minutes) at a time.

    python benchmarks/device.py                                    # the stages and what each measures
    python benchmarks/device.py headline --out "$OUT"              # one call of a stage, its results in $OUT
    python benchmarks/device.py headline --out "$OUT" --keep warm  # the next call, on the same machine
    python benchmarks/device.py lever --set configs=baseline,-triton_loss,baseline_again --dry_run

The stages are data (benchmarks/device.toml: the commands, a time budget, the settings they take); this file runs
them as the device scripts before it did (they are in benchmarks/archive/, with the results they made):

  - caches shared by every run of the call: DeepSpeed's JIT ops (TORCH_EXTENSIONS_DIR), inductor's graphs and
    kernels, Triton's binaries; a fresh machine starts from the inductor and Triton caches an earlier call saved
    (benchmarks/compile_cache.py) where `.compile_cache/` came with the repo, and each call saves its own into --out;
  - DeepCompile's two ops built once, side by side, before any run races for them, with the image's
    TORCH_CUDA_ARCH_LIST=9.0a, which DeepSpeed 0.19.8's op builder cannot parse, rewritten to 9.0 for every command
    (shared/train/ds_runtime.normalize_cuda_arch_list);
  - a time budget: a command starts only if the time left is at least what it needs (else it is skipped and said so);
    compare.py and ablation.py get as --time_limit what is left less what the commands after it need (those that
    could still start once it had its own need: a fresh machine's slower run is not cut for one that would not fit
    anyway), so that they stop between runs and a later call continues them; any other command, which would leave
    nothing if cut (a training run writes its JSON at its end), runs until the budget's end; the call's device.json
    records each command's seconds, and the cache restore's and the op builds';
  - DeepSpeed imported through one path on a machine (stable_deepspeed), so that its ops built once serve every
    later call there;
  - continuation: `--keep warm` continues the stage's folder from the copy the last call left on this machine (calls
    back to back keep the machine, and with it the compile caches), `--keep FOLDER` from a folder in the repo (the
    last call's results, committed or carried);
  - results: everything the commands wrote goes into a work folder, packed into --out as <stage>.tar.gz (a call's
    outputs may be capped in number of files), with device.json: the commands as run, their exit status and times.

Exit status: 0 when every command ran and succeeded, 3 when one was skipped or stopped by its time limit (the same
stage with --keep continues it), 1 when one failed, 2 for a bad stage or setting.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run by path: Python puts benchmarks/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))
STAGES = Path(__file__).with_name("device.toml")
WORK = Path("/tmp/zero3bench_device")  # a call's work folder is WORK/<stage>, emptied when the call starts
WARM = Path("/tmp/zero3bench_keep")  # the folders `--keep warm` continues, one per stage and device
CACHES = {"TORCH_EXTENSIONS_DIR": "/tmp/zero3bench_extensions", "TORCHINDUCTOR_CACHE_DIR": "/tmp/zero3bench_inductor",
          "TRITON_CACHE_DIR": "/tmp/zero3bench_triton"}
COMPILE_CACHE = ROOT / ".compile_cache"  # an earlier call's saved caches, where they came with the repo
# Where every call on one machine finds DeepSpeed (a link to the folder this call's wheels were installed in): its
# JIT ops are rebuilt (about a minute each) whenever their sources sit at another path or are newer than the build
STABLE_SITE = Path("/tmp/zero3bench_site")
SOURCES_MTIME = 946684800  # 2000-01-01: the installed sources' time, older than any build of them
# DeepCompile's op and its variant whose compute stream waits for the backward's end (shared/patches/deepcompile_op.py)
OPS = {"op_build.log": "from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load()",
       "op_build_device_wait.log": "from shared.patches.deepcompile_op import builder; builder().load()"}
OPS_S = 300  # the op builds take about a minute each on an H200
PACK_S = 8  # kept out of the budget for packing the results
TIME_LIMIT_MARGIN_S = 20  # compare.py / ablation.py stop this much before their timeout would cut them
GRACE_S = 25  # after a timeout's SIGTERM: compare.py takes up to 15 s to stop the run it has in flight
BUILTINS = ("work", "gpu", "device", "gpu_list", "time_limit")
PLACEHOLDER = re.compile(r"\{(\w+)\}")


class StageError(ValueError):
    """A stage or setting that cannot run: the message says what to change."""


@dataclass
class Command:
    command: str
    log: str
    needs_s: int | str = 60
    when: str | None = None  # "param": runs where it is set; "param=name": where its comma list holds name or all
    env: dict = field(default_factory=dict)
    creates: str | None = None  # a file it writes: where that exists (kept from an earlier call), it is done

    def runs(self, params: dict) -> bool:
        if self.when is None:
            return True
        param, _, name = self.when.partition("=")
        chosen = names(params[param])
        return bool(chosen) and (not name or name in chosen or "all" in chosen)


def names(value: str) -> list[str]:
    """A param's comma list, blanks dropped (`when = "param=name"` chooses commands by these)."""
    return [v.strip() for v in value.split(",") if v.strip()]


@dataclass
class Stage:
    name: str
    question: str
    budget_s: float
    run: list[Command]
    setup: list[Command] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    required: list[str] = field(default_factory=list)
    keep: str | None = None
    env: dict = field(default_factory=dict)
    ops: bool = False
    min_gpus: int = 1
    parallel: bool = False
    exclude: list[str] = field(default_factory=list)

    def commands(self) -> list[Command]:
        return [*self.setup, *self.run]


def load(path: Path = STAGES) -> dict[str, Stage]:
    """The stage table, each stage checked for what it must hold (a wrong table fails here, not mid-call)."""
    stages = {}
    for name, raw in tomllib.loads(path.read_text()).items():
        try:
            setup = [Command(**c) for c in raw.pop("setup", [])]
            run = [Command(**c) for c in raw.pop("run", [])]
            stage = Stage(name=name, run=run, setup=setup, **raw)
        except TypeError as e:
            raise StageError(f"{path}: stage {name!r}: {e}") from e
        check(stage)
        stages[name] = stage
    return stages


def check(stage: Stage) -> None:
    where = f"stage {stage.name!r}"
    if not stage.run:
        raise StageError(f"{where} has no [[{stage.name}.run]] command")
    if not 0 < stage.budget_s <= 600:
        raise StageError(f"{where}: budget_s must be in (0, 600] seconds (a device call), got {stage.budget_s!r}")
    if not set(stage.required) <= set(stage.params):
        raise StageError(f"{where}: required {sorted(set(stage.required) - set(stage.params))} are not params")
    if clash := set(stage.params) & set(BUILTINS):
        raise StageError(f"{where}: params {sorted(clash)} would hide the driver's own placeholders")
    known = set(stage.params) | set(BUILTINS)
    templates = [c.command for c in stage.commands()] + [stage.keep or ""]
    templates += [c.creates for c in stage.commands() if c.creates]
    templates += [v for c in stage.commands() for v in c.env.values()] + list(stage.env.values())
    for text in templates:
        if unknown := set(PLACEHOLDER.findall(text)) - known:
            raise StageError(f"{where}: {sorted(unknown)} in {text!r} are neither params nor {BUILTINS}")
    logs = [c.log for c in stage.commands()]
    if len(set(logs)) != len(logs):
        raise StageError(f"{where}: two commands write the same log")
    for c in stage.commands():
        if c.when is not None and c.when.partition("=")[0] not in stage.params:
            raise StageError(f"{where}: when = {c.when!r} does not name a param")
        if isinstance(c.needs_s, str) and c.needs_s not in stage.params:
            raise StageError(f"{where}: needs_s = {c.needs_s!r} is neither seconds nor a param")
        if isinstance(c.needs_s, int | float) and not 0 < c.needs_s < stage.budget_s:
            raise StageError(f"{where}: needs_s {c.needs_s} of {c.log} must be positive and below budget_s")


def settings(stage: Stage, sets: list[str]) -> dict[str, str]:
    """The stage's params with `--set name=value` applied; an unknown name or a missing required one is refused."""
    params = {k: str(v) for k, v in stage.params.items()}
    for item in sets:
        name, sep, value = item.partition("=")
        if not sep:
            raise StageError(f"--set {item!r}: expected name=value")
        if name not in params:
            raise StageError(f"--set {name}: stage {stage.name!r} takes {sorted(params) or 'no settings'}")
        params[name] = value
    if missing := [r for r in stage.required if not params[r]]:
        raise StageError(f"stage {stage.name!r} needs " + " ".join(f"--set {m}=..." for m in missing))
    for name, choices in choices_of(stage).items():  # a param whose commands are chosen by name: no other value
        if wrong := [v for v in names(params[name]) if v not in (*choices, "all")]:
            raise StageError(f"--set {name}={params[name]}: {', '.join(wrong)} chooses none of its commands; "
                             f"name some of {', '.join(choices)} (comma-separated), or all")
    return params


def choices_of(stage: Stage) -> dict[str, list[str]]:
    """The params whose commands are chosen by name (`when = "param=name"`), with their names."""
    choices: dict[str, list[str]] = {}
    for c in stage.commands():
        param, _, name = (c.when or "").partition("=")
        if name:
            choices.setdefault(param, []).append(name)
    return choices


def needs(stage: Stage, c: Command, params: dict) -> float:
    value = c.needs_s if isinstance(c.needs_s, int | float) else params[c.needs_s]
    try:
        return float(value)
    except ValueError:
        raise StageError(f"{c.log}: needs_s {c.needs_s} = {value!r} is not seconds") from None


def fill(template: str, values: dict) -> str:
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def argv(template: str, values: dict) -> list[str]:
    """The command as this machine runs it: placeholders filled, split like a shell line, python as this one."""
    words = shlex.split(fill(template, values))
    return [sys.executable if words[0] == "python" else words[0], *words[1:]]


def gpu_kind() -> tuple[str, int]:
    """The GPUs' kind as result folders name it ("h200", "h100"; "cpu" without a GPU) and their number."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "cpu", 0
    names = [n.strip() for n in names if n.strip()]
    return (kind_of(names[0]), len(names)) if names else ("cpu", 0)


def kind_of(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100": the model, as result folders name it."""
    m = re.search(r"\b([A-Z]\d{2,3})\b", name)
    return (m.group(1) if m else re.sub(r"\W+", "", name)).lower()


def run_env(stage: Stage, values: dict) -> tuple[dict, str | None]:
    """The environment of every command: the shared caches, this repo importable, the arch list DeepSpeed parses."""
    from shared.train.ds_runtime import normalize_cuda_arch_list

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, default in CACHES.items():
        env.setdefault(key, default)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update({k: fill(v, values) for k, v in stage.env.items()})
    return env, normalize_cuda_arch_list(env)


def stable_deepspeed(env: dict) -> str | None:
    """Let the next call on this machine reuse DeepSpeed's JIT-built ops. Each device call installs the wheels into a
    new temporary folder on PYTHONPATH, so the ops' sources move and are newer than their build: torch rebuilds both
    DeepCompile ops every call. Where DeepSpeed is imported from such a PYTHONPATH folder, its files get one old
    time and the commands import it through STABLE_SITE, a link to that folder (the same wheel gives the same
    sources at the same path). What was done, or None where DeepSpeed is installed otherwise (a virtual env)."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    site, paths = package.parent, env.get("PYTHONPATH", "").split(os.pathsep)
    if str(site) not in paths:
        return None
    for f in package.rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.utime(f, (SOURCES_MTIME, SOURCES_MTIME))
    link = STABLE_SITE.with_name(f"{STABLE_SITE.name}.{os.getpid()}")
    link.unlink(missing_ok=True)
    link.symlink_to(site, target_is_directory=True)
    os.replace(link, STABLE_SITE)
    env["PYTHONPATH"] = os.pathsep.join(str(STABLE_SITE) if p == str(site) else p for p in paths)
    return f"DeepSpeed imported through {STABLE_SITE} -> {site}"


class Call:
    """One call of one stage: its clock, work folder and record."""

    def __init__(self, stage: Stage, params: dict, work: Path, out: Path | None, gpu: str, dry_run: bool):
        self.stage, self.params, self.work, self.out, self.dry_run = stage, params, work, out, dry_run
        self.t0 = time.monotonic()
        gpus = int(params.get("gpus", 1) or 1)
        self.values = {**params, "work": str(work), "gpu": gpu, "device": f"{gpus}x{gpu}",
                       "gpu_list": ",".join(str(i) for i in range(gpus))}
        self.record = {"stage": stage.name, "params": params, "budget_s": stage.budget_s, "device": gpu,
                       "commands": []}

    def done(self, c: Command) -> bool:
        """Whether `c` made its file in an earlier call (`creates`, in the folder --keep continued)."""
        return bool(c.creates) and Path(fill(c.creates, self.values)).is_file()

    def left(self) -> float:
        return self.stage.budget_s - PACK_S - (time.monotonic() - self.t0)

    def run(self, commands: list[Command], env: dict, parallel: bool) -> int:
        """Run `commands` (one after the other, or all at once): the worst exit status (0, 3 or 1)."""
        status, started = 0, []
        for i, c in enumerate(commands):
            # what is left, less what the commands after it need, but never less than it needs itself; a later
            # command that could not start after this one anyway reserves nothing (a run slower than its need,
            # a fresh machine's, is not cut to keep time for it). Only a command told its {time_limit} (compare.py,
            # ablation.py: they stop between runs) keeps time for the later ones: any other, a training run, would
            # leave nothing if cut, so it runs to the budget's end and they are skipped instead
            left, own, stops_itself = self.left(), needs(self.stage, c, self.params), "{time_limit}" in c.command
            after = 0.0 if parallel or not stops_itself else reserved(
                [needs(self.stage, d, self.params) for d in commands[i + 1:] if not self.done(d)], left - own)
            limit = min(left, max(left - after, own))
            # a command cut at its limit gets SIGTERM, then up to GRACE_S to stop before SIGKILL: one that runs to the
            # budget's end is told early enough that the grace, too, ends inside the budget (else the device call's
            # own limit cuts the packing, and every result of the call is lost)
            stop_at = limit if stops_itself else max(limit - GRACE_S, 1)
            values = {**self.values, "time_limit": max(int(limit - TIME_LIMIT_MARGIN_S), 1)}
            cmd, own_env = argv(c.command, values), {k: fill(v, values) for k, v in c.env.items()}
            entry = {"command": shlex.join(cmd), "log": c.log, **({"env": own_env} if own_env else {})}
            self.record["commands"].append(entry)
            print(f"$ {entry['command']}" + (f"    # env {own_env}" if own_env else ""), flush=True)
            if self.done(c):
                entry["done"] = f"{fill(c.creates, self.values)} exists (an earlier call's, continued with --keep)"
                print(f"  done: {entry['done']}", flush=True)
                continue
            if self.dry_run:
                continue
            if left < own:
                entry["skipped"] = f"{max(left, 0):.0f} s left, it needs {own:.0f}: would not fit"
                print(f"  skipped: {entry['skipped']}", flush=True)
                status = max(status, 3)
                continue
            log = open(self.work / c.log, "w")
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, **own_env}, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            started.append((proc, log, entry, stop_at, time.monotonic()))
            if not parallel:
                status = max(status, self.wait(*started.pop()))
        for item in started:
            status = max(status, self.wait(*item))
        return status

    def wait(self, proc, log, entry, limit: float, t: float) -> int:
        try:
            proc.wait(timeout=max(limit - (time.monotonic() - t), 1))
        except subprocess.TimeoutExpired:
            from harness.launch import stop_group  # SIGTERM to the group, then SIGKILL to its whole tree

            stop_group(proc.pid, GRACE_S)
            proc.wait()
            entry["timed_out"] = True
        log.close()
        entry["exit"], entry["seconds"] = proc.returncode, round(time.monotonic() - t, 1)
        print(f"  exit {proc.returncode} after {entry['seconds']:.0f} s"
              + (" (timed out: what was left of the budget)" if entry.get("timed_out") else ""), flush=True)
        if entry.get("timed_out"):  # its exit status can read 0: stop_group reaped it first
            return 3
        return 0 if proc.returncode == 0 else 3 if proc.returncode == 3 else 1


def keep_source(stages: dict[str, Stage], stage: Stage, keep: str | None, device: str) -> Path | None:
    """The folder `--keep` continues: the copy the last call left on this machine (warm) or a folder given."""
    if keep is None:
        return None
    if stage.keep is None:
        raise StageError(f"stage {stage.name!r} has nothing to continue: --keep is for "
                         f"{', '.join(s for s, st in stages.items() if st.keep)}")
    source = WARM / f"{stage.name}_{device}" if keep == "warm" else Path(keep)
    if not source.is_dir():
        raise StageError(f"--keep {keep}: no {source} on this machine" + (
            " (a fresh machine: continue from the last call's folder, --keep FOLDER)" if keep == "warm" else ""))
    return source


def reserved(later: list[float], spare: float) -> float:
    """Of the needs of the commands after one, in order, the sum of those that still fit in `spare` (what is left
    once that one had its need): what that one leaves for them. A command that would not fit reserves nothing."""
    total = 0.0
    for need in later:
        if need <= spare - total:
            total += need
    return total


def side_by_side(commands: dict[str, list[str]], work: Path, env: dict, timeout: float) -> None:
    """Start the commands together (op builds), wait for all, one line each."""
    procs = {log: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(work / log, "w"), stderr=subprocess.STDOUT)
             for log, cmd in commands.items()}
    for log, proc in procs.items():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"  {log}: exit {proc.returncode}" + ("" if proc.returncode == 0 else " (the runs build it again)"),
              flush=True)


def pack(call: Call) -> Path:
    """work/ -> out/<stage>.tar.gz (less the stage's exclusions) and out/device.json."""
    call.out.mkdir(parents=True, exist_ok=True)
    (call.work / "device.json").write_text(json.dumps(call.record, indent=1))
    (call.out / "device.json").write_text(json.dumps(call.record, indent=1))
    skip = {(call.work / e).resolve() for e in call.stage.exclude}
    archive = call.out / f"{call.stage.name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(call.work, arcname=".", filter=lambda ti: None if any(
            (call.work / ti.name).resolve() == s or s in (call.work / ti.name).resolve().parents for s in skip) else ti)
    return archive


def tails(work: Path, lines: int = 25) -> None:
    for log in sorted(work.glob("*.log")):
        print(f"== {log.name}")
        print("\n".join(log.read_text(errors="replace").splitlines()[-lines:]))


def build_parser(stages: dict[str, Stage]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", nargs="?", help=f"the stage to run ({', '.join(stages)}); none: list them")
    p.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                   help="where the packed results go (default: $OUT)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="a setting of the stage (its params in benchmarks/device.toml); repeatable")
    p.add_argument("--keep", default=None, metavar="warm|FOLDER",
                   help="continue the stage's folder: from the last call on this machine (warm) or from FOLDER")
    p.add_argument("--budget_s", type=float, default=None, help="seconds the stage may take (default: its budget_s)")
    p.add_argument("--work", type=Path, default=None, help=f"the call's work folder (default {WORK}/<stage>)")
    p.add_argument("--gpu", default=None, help="the GPUs' kind in folder names (default: nvidia-smi's, e.g. h200)")
    p.add_argument("--save_cache", choices=("true", "false"), default="true",
                   help="save the compile caches into --out at the end (default true)")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--stages", type=Path, default=STAGES, help=argparse.SUPPRESS)  # another table (tests)
    return p


def main(argv_: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--stages", type=Path, default=STAGES)
    table = pre.parse_known_args(argv_)[0].stages
    stages = load(table)
    parser = build_parser(stages)
    ns = parser.parse_args(argv_)
    if ns.stage is None:
        for name, s in stages.items():
            print(f"{name:<13} {s.question} ({s.budget_s:.0f} s)")
        return 0
    try:
        if ns.stage not in stages:
            raise StageError(f"unknown stage {ns.stage!r}; stages: {', '.join(stages)}")
        stage = stages[ns.stage]
        if ns.budget_s is not None:
            stage.budget_s = ns.budget_s
            check(stage)
        params = settings(stage, ns.sets)
        found, n_gpus = gpu_kind()
        gpu = ns.gpu or found
        if not ns.dry_run:
            if ns.out is None:
                raise StageError("--out (or $OUT): where the results go")
            wanted = max(stage.min_gpus, int(params["gpus"])) if "gpus" in params else stage.min_gpus
            if n_gpus < wanted:
                raise StageError(f"stage {stage.name!r} needs {wanted} GPU(s), this machine has {n_gpus}")
        work = ns.work or WORK / stage.name
        call = Call(stage, params, work, ns.out, gpu, ns.dry_run)
        source = keep_source(stages, stage, ns.keep, call.values["device"])
    except StageError as e:
        parser.error(str(e))
    env, note = run_env(stage, call.values)
    print(f"# stage {stage.name}: {stage.question}; budget {stage.budget_s:.0f} s; work {work}; device {gpu}")
    if note:
        print(f"# {note}")
    if not ns.dry_run:
        shutil.rmtree(work, ignore_errors=True)  # a warm machine keeps /tmp: nothing of an earlier call passes
        work.mkdir(parents=True)
        (work / "gpus.txt").write_text(subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.sm", "--format=csv"], capture_output=True,
            text=True).stdout if n_gpus else "no GPU\n")
        if n_gpus and (site := stable_deepspeed(env)):
            call.record["deepspeed_site"] = site
            print(f"# {site}")
    kept = fill(stage.keep, call.values) if stage.keep else None
    if source is not None:
        print(f"# continuing {kept} from {source}")
        if not ns.dry_run:
            shutil.copytree(source, work / kept)
    restore = [sys.executable, "benchmarks/compile_cache.py", "restore", str(COMPILE_CACHE)]
    if COMPILE_CACHE.is_dir():
        print(f"$ {shlex.join(restore)}")
        if not ns.dry_run:
            t = time.monotonic()
            with open(work / "compile_cache.log", "w") as log:
                subprocess.run(restore, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=120)
            call.record["restore_s"] = round(time.monotonic() - t, 1)
    if stage.ops and (n_gpus or ns.dry_run):
        builds = {log: [sys.executable, "-c", code] for log, code in OPS.items()}
        for cmd in builds.values():
            print(f"$ {shlex.join(cmd)}  &")
        if not ns.dry_run:
            t = time.monotonic()
            side_by_side(builds, work, env, min(OPS_S, call.left()))
            call.record["ops_s"] = round(time.monotonic() - t, 1)
    status = call.run(stage.setup, env, parallel=False)
    if status == 0:
        status = call.run([c for c in stage.run if c.runs(params)], env, stage.parallel)
    save = [sys.executable, "benchmarks/compile_cache.py", "save", str(ns.out or "$OUT")]
    if ns.dry_run:
        if ns.save_cache == "true":
            print(f"$ {shlex.join(save)}    # last, in what is left of the call")
        return 0
    print(f"# done at {time.monotonic() - call.t0:.0f} s, exit {status}")
    if kept and (work / kept).is_dir():  # what `--keep warm` continues in the next call on this machine
        warm = WARM / f"{stage.name}_{call.values['device']}"
        shutil.rmtree(warm, ignore_errors=True)
        shutil.copytree(work / kept, warm)
    tails(work)
    print(f"# packed {pack(call)}")
    save_s = stage.budget_s + 15 - (time.monotonic() - call.t0)  # last, in what is left of the device's 600 s
    if ns.save_cache == "true" and n_gpus and save_s >= 10:
        save_compile_cache(save, env, save_s)
    elif ns.save_cache == "true" and n_gpus:
        print(f"# compile cache: not saved, {save_s:.0f} s left")
    return status


def save_compile_cache(save: list[str], env: dict, save_s: float) -> bool:
    """Run the compile cache's save in the `save_s` seconds left of the call; whether it finished. The results are
    packed before it, so a save cut short loses no result: it is said, and the call's exit status stays its
    commands'."""
    try:
        subprocess.run(save, cwd=ROOT, env=env, timeout=save_s)
        return True
    except subprocess.TimeoutExpired:
        print(f"# compile cache: not saved, its save took longer than the {save_s:.0f} s left")
        return False


if __name__ == "__main__":
    sys.exit(main())
