"""The patch layer (shared/patches): its registry against the code and the docs, the version gate, the upstream
sources' fingerprints, and the rule that no module outside it touches DeepSpeed's or Lightning's internals."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from shared import patches
from shared.patches import GROUPS, PATCHES, TESTED, fingerprints
from shared.train.config import TrainConfig
from tests.helpers import RAW, ROOT, env
from tests.test_layers import MODULES, in_layer

CPU = torch.device("cpu")


# ---- the registry against the code and the docs -----------------------------------------------------------------


def _holder_and_attr(target: str):
    holder, attr = target.rsplit(".", 1)
    return fingerprints.resolve(holder), attr


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target.rsplit(".", 2)[-2] + "." + p.target.rsplit(".")[-1])
def test_every_patch_names_what_exists(patch):
    """Its target exists upstream (an instance attribute: its class sets it), its replacement in this package, its
    group, the docs row that holds its measurement, and every test it names."""
    holder, attr = _holder_and_attr(patch.target)
    assert hasattr(holder, attr) or f"self.{attr} =" in inspect.getsource(holder), patch.target
    module, name = patch.replacement.rsplit(".", 1)
    assert module.startswith("shared.patches") and callable(getattr(importlib.import_module(module), name))
    assert patch.group in GROUPS and GROUPS[patch.group].library == patch.target.split(".")[0]
    assert patch.docs_row in (ROOT / patch.docs).read_text(), (patch.docs, patch.docs_row)
    assert patch.tests and patch.why and patch.fingerprinted
    for test in patch.tests:
        file, func = test.split("::")
        assert re.search(rf"^def {func}\(", (ROOT / file).read_text(), re.M), test


def test_every_group_has_patches_and_says_how_to_turn_it_off():
    for g in GROUPS.values():
        assert any(p.group == g.name for p in PATCHES), g.name
        assert g.library in TESTED and all(r in GROUPS for r in g.requires)
        assert g.always or g.off.startswith("--"), g.name  # a flag the gate's message offers


class _Stage3Optimizer:
    """A ZeRO-3 optimizer as far as installing the step needs one: DeepSpeed's class, no state."""

    def __new__(cls):
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        return object.__new__(DeepSpeedZeroOptimizer_Stage3)


def _registered(group: str) -> set[str]:
    return {p.target.rsplit(".", 1)[1] for p in PATCHES if p.group == group}


@pytest.mark.parametrize("check", ["host", "device"])
def test_the_zero3_step_installs_exactly_its_registered_patches_together(monkeypatch, check):
    """patches.install replaces on the optimizer every method its groups register and nothing else of
    DeepSpeed's, at once; the device check adds its two (stage3's is_invalid_grad_norm, the step) to the step's."""
    import deepspeed.runtime.zero.stage3 as stage3

    monkeypatch.setattr(stage3, "is_invalid_grad_norm", stage3.is_invalid_grad_norm)  # put back after the test
    monkeypatch.setattr(patches, "_INSTALLED", set())
    original = stage3.is_invalid_grad_norm
    zero_opt = _Stage3Optimizer()
    assert patches.install(types.SimpleNamespace(optimizer=zero_opt), TrainConfig(grad_norm_check=check))
    replaced = {name for name in vars(zero_opt) if hasattr(type(zero_opt), name)}
    groups = ["zero3_step"] + (["grad_norm_check"] if check == "device" else [])
    assert replaced | ({"is_invalid_grad_norm"} if stage3.is_invalid_grad_norm is not original else set()) == \
        set().union(*(_registered(g) for g in groups))
    assert patches.installed() == sorted(p.target for p in PATCHES if p.group in groups)


def test_deepcompiles_replacements_install_exactly_their_registered_patches(monkeypatch):
    """after_compile on an engine shaped as DeepCompile leaves it: the eager persistent list emptied, and the
    cached walks replace exactly the fallback's and the optimizer's registered methods."""
    import torch

    from shared.patches import deepcompile

    monkeypatch.setattr(patches, "_INSTALLED", set())
    monkeypatch.setattr(deepcompile, "CACHED_WALKS", None)  # what the run JSON would report: this process's
    monkeypatch.setattr(deepcompile, "EAGER_PERSIST_DROPPED", None)
    fallback = types.SimpleNamespace(_release_unclaimed_tracked_params=list, _outstanding_forward_graph_ids=set(),
                                     _last_pre_forward_released_param_ids=[], _enable_forward_fallback=None,
                                     _disable_forward_fallback=None, release_available_params_for_next_forward=None)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = types.SimpleNamespace(_partition_all_parameters=None, persistent_parameters=[param])
    engine = types.SimpleNamespace(_deepcompile_z3_eager_fallback=fallback, optimizer=optimizer,
                                   module=torch.nn.Linear(1, 1), is_deepcompile_active=lambda: False)
    before = {**vars(fallback), **vars(optimizer)}
    train = types.SimpleNamespace(compile="deepcompile", stage=3, deepcompile_eager_persist="drop",
                                  deepcompile_cached_walks=True)
    patches.after_compile(engine, train)
    changed = {k for k, v in {**vars(fallback), **vars(optimizer)}.items() if v is not before[k]}
    assert changed == _registered("deepcompile_cached_walks") and optimizer.persistent_parameters == []
    assert patches.installed() == sorted(p.target for p in PATCHES
                                         if p.group in ("deepcompile_cached_walks", "deepcompile_eager_persist"))


# ---- the version gate ---------------------------------------------------------------------------------------------


@pytest.fixture
def untested(monkeypatch):
    """This machine with DeepSpeed 0.20.0 and pytorch-lightning 2.7.0 installed."""
    other = {"deepspeed": "0.20.0", "pytorch_lightning": "2.7.0"}
    monkeypatch.setattr(patches, "installed_version", other.get)
    return other


def test_the_tested_versions_are_the_installed_and_pinned_ones():
    assert all(patches.installed_version(lib) == version for lib, version in TESTED.items())
    pins = (ROOT / "pyproject.toml").read_text()
    assert f'"deepspeed=={TESTED["deepspeed"]}"' in pins
    assert f'"pytorch-lightning=={TESTED["pytorch_lightning"]}"' in pins


def test_another_deepspeed_refuses_every_setting_that_needs_a_patch_before_any_work(untested):
    from shared.train.distributed import check_before_start

    with pytest.raises(ValueError) as e:
        check_before_start(TrainConfig(zero3_step="fused", grad_norm_check="device"), CPU, 1, 1)
    msg = str(e.value)
    assert "DeepSpeed 0.20.0" in msg and "deepspeed==0.19.8" in msg and "--profile stock" in msg
    assert "--zero3_step deepspeed" in msg and "--grad_norm_check host" in msg
    check_before_start(TrainConfig(zero3_step="deepspeed"), CPU, 1, 1)  # DeepSpeed's own step: nothing to refuse


def test_no_entry_point_installs_anything_on_another_version(untested, monkeypatch):
    """A caller that skipped the preflight still patches nothing: every entry point checks first."""
    from shared.patches import lightning

    monkeypatch.setattr(patches, "_INSTALLED", set())
    zero_opt = _Stage3Optimizer()
    with pytest.raises(ValueError, match="DeepSpeed 0.20.0"):
        patches.install(types.SimpleNamespace(optimizer=zero_opt), TrainConfig())
    with pytest.raises(ValueError, match="DeepSpeed 0.20.0"):
        patches.persistence_pass(1000)
    with pytest.raises(ValueError, match="pytorch-lightning 2.7.0"):
        lightning.setup_environment(types.SimpleNamespace(), lambda: None)
    assert vars(zero_opt) == {} and patches.installed() == []


def test_the_stock_profile_needs_no_deepspeed_patch_and_runs_on_another_version(untested, monkeypatch):
    from shared.model import config as model_config
    from shared.train import profiles
    from shared.train.distributed import check_before_start

    cpu = TrainConfig(**profiles.resolve({}, "stock", cuda=False, gpus=1).filled, profile="stock")
    assert (cpu.compile, cpu.zero3_step) == ("none", "deepspeed") and patches.needed(cpu) == []
    check_before_start(cpu, CPU, 1, 1)
    with pytest.raises(ValueError, match="--profile stock"):  # the CPU default, eager, runs this project's step
        check_before_start(TrainConfig(**profiles.resolve({}, "eager", cuda=False, gpus=1).filled), CPU, 1, 1)
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    for gpus in (1, 2):
        gpu = TrainConfig(preset="1.5b", profile="stock",
                          **profiles.resolve({"preset": "1.5b"}, "stock", cuda=True, gpus=gpus).filled)
        assert gpu.compile == "deepcompile" and patches.needed(gpu) == []
        fast = TrainConfig(preset="1.5b", **profiles.resolve({"preset": "1.5b"}, "fast", cuda=True, gpus=gpus,
                                                             gpu_memory_gib=139.8).filled)
        assert {"zero3_step", "deepcompile_persist"} <= {g.name for g in patches.needed(fast)}
    # what stock keeps: the schedule's shift for a run resumed under DeepCompile, and the Lightning path's hooks
    resumed = TrainConfig(preset="1.5b", profile="stock", resume="auto", ckpt_dir="ck",
                          **profiles.resolve({"preset": "1.5b"}, "stock", cuda=True, gpus=1).filled)
    assert [g.name for g in patches.needed(resumed)] == ["deepcompile_resume"]
    assert {g.name for g in patches.needed(gpu, lightning=True)} == {"lightning_cpu", "lightning_engine",
                                                                     "lightning_sigterm"}
    doc = inspect.getdoc(profiles)
    assert all(name in doc for name in ("lightning_cpu", "lightning_engine", "lightning_sigterm", "deepcompile_resume"))


def test_another_lightning_refuses_the_lightning_path_only(untested, monkeypatch):
    monkeypatch.setattr(patches, "installed_version", {"deepspeed": "0.19.8", "pytorch_lightning": "2.7.0"}.get)
    train = TrainConfig(zero3_step="deepspeed")
    patches.check_versions(train)  # the raw path
    with pytest.raises(ValueError) as e:
        patches.check_versions(train, lightning=True)
    msg = str(e.value)
    assert "pytorch-lightning 2.7.0" in msg and "pytorch-lightning==2.6.6" in msg and "raw path" in msg


def _raw_path_as_if(deepspeed: str, args: list, timeout: int) -> subprocess.CompletedProcess:
    """The raw path's whole command, DeepSpeed's installed version reported as `deepspeed`."""
    code = ("import importlib.metadata as m, runpy, sys; v = m.version; "
            f"m.version = lambda d: {deepspeed!r} if d == 'deepspeed' else v(d); "
            f"sys.argv = ['train.py', *{[str(a) for a in args]!r}]; "
            f"runpy.run_path({str(RAW)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=ROOT,
                          timeout=timeout)


@pytest.mark.slow
def test_the_raw_path_refuses_an_untested_deepspeed_before_its_process_group_and_stock_runs(tmp_path):
    """With DeepSpeed's version as another release would report it: the eager profile (this project's ZeRO-3 step)
    exits 2 with one message, no process group, no result; the stock profile trains, and replaces nothing."""
    out = tmp_path / "r.json"
    proc = _raw_path_as_if("0.20.0", ["--profile", "eager", "--out", out], timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "this machine has DeepSpeed 0.20.0" in proc.stderr and "--profile stock" in proc.stderr
    assert "Traceback" not in proc.stderr and "init_distributed" not in proc.stdout + proc.stderr
    assert not out.exists()
    proc = _raw_path_as_if("0.20.0", ["--profile", "stock", "--preset", "tiny", "--steps", "4", "--warmup_steps", "2",
                                      "--out", out], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["versions"]["deepspeed"] == "0.20.0" and result["train"]["zero3_step"] == "deepspeed"
    assert result["extra"]["patches"] == [] and result["extra"]["zero3_step_calls"] is None


# ---- the fingerprints ---------------------------------------------------------------------------------------------


def test_the_installed_libraries_hold_the_sources_the_patches_were_written_against():
    changed = fingerprints.changed()
    assert changed == [], "upstream sources differ from shared/patches/fingerprints.json:\n" + "\n".join(changed)
    assert fingerprints.load()["versions"] == TESTED


def test_a_changed_upstream_source_is_named(monkeypatch, capsys):
    from shared.patches.__main__ import main

    name = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3._optimizer_step"
    real = fingerprints.source
    monkeypatch.setattr(fingerprints, "source",
                        lambda n: real(n).replace("optimizer.step()", "optimizer.step(x)") if n == name else real(n))
    assert "optimizer.step()" in real(name)  # the edit changes the text
    [line] = fingerprints.changed()
    assert line.startswith(f"{name}: its source changed")
    assert main([]) == 1 and name in capsys.readouterr().out
    # the same from a changed record, and a record that lacks a source
    monkeypatch.setattr(fingerprints, "source", real)
    record = fingerprints.load()
    other = "pytorch_lightning.strategies.deepspeed.DeepSpeedStrategy._setup_model_and_optimizer"
    record["sources"][other] = "0" * 16
    del record["sources"][name]
    assert [line.split(":")[0] for line in fingerprints.changed(record)] == [name, other]


def test_the_fingerprint_ignores_blank_and_comment_lines_and_reads_past_wrappers(tmp_path, monkeypatch):
    body = textwrap.dedent('''
        import functools

        def wrap(fn):
            def wrapped_fn(*a):
                return fn(*a)
            return wrapped_fn

        class C:
            @wrap
            def m(self, x):
                return x + 1
        ''')
    (tmp_path / "fp_a.py").write_text(body)
    (tmp_path / "fp_b.py").write_text(body.replace("        return x + 1", "\n        # a comment\n\n"
                                                                            "        return x + 1   "))
    (tmp_path / "fp_c.py").write_text(body.replace("x + 1", "x + 2"))
    monkeypatch.syspath_prepend(str(tmp_path))
    a, b, c = (fingerprints.fingerprint(f"fp_{m}.C.m") for m in "abc")
    assert a == b != c
    assert fingerprints.normalized("fp_a.C.m") == "@wrap\ndef m(self, x):\n    return x + 1"  # not wrapped_fn


def test_the_record_is_rewritten_only_for_the_tested_versions(tmp_path, monkeypatch):
    record = tmp_path / "fingerprints.json"
    assert fingerprints.update(record)["sources"] == fingerprints.load()["sources"]
    monkeypatch.setattr(fingerprints, "installed_version", {"deepspeed": "0.20.0"}.get)
    with pytest.raises(ValueError, match="set TESTED"):
        fingerprints.update(tmp_path / "other.json")
    assert not (tmp_path / "other.json").exists()


# ---- the docs ------------------------------------------------------------------------------------------------------


def test_docs_patches_lists_the_registry_and_says_how_to_upgrade():
    from shared.patches.__main__ import table

    doc = (ROOT / "docs" / "patches.md").read_text()
    start = "<!-- python -m shared.patches --list -->\n"
    listed = doc[doc.index(start) + len(start):doc.index("\n<!-- end of the list -->")]
    assert listed == table()
    assert all(v in doc for v in TESTED.values()) and "python -m shared.patches --update" in doc
    assert "--profile stock" in doc


# ---- no private attribute of DeepSpeed or Lightning outside the patch layer --------------------------------------

LIBRARIES = ("deepspeed", "pytorch_lightning", "lightning_fabric", "lightning")
# The names this project gives DeepSpeed's and Lightning's objects: an attribute chain through one of them
# (`engine.optimizer._x`, `self.loop._x`, `trainer.strategy._x`) reaches into theirs.
LIBRARY_OBJECTS = {"engine", "deepspeed_engine", "ds_engine", "zero_opt", "ds_optimizer", "trainer", "strategy",
                   "fallback", "loop", "epoch_loop", "fit_loop", "backend", "dc_util", "stage3", "graph_profile",
                   "pl_module", "lightning_module", "precision_plugin"}
# Where the rule cannot see: an object of theirs under another name (a loop variable over their classes), or an
# instance attribute their class sets in __init__ that a subclass assigns too. The patch layer's own code is the
# place for such access; this rule keeps the rest of the project from it.


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _library_names(tree: ast.Module) -> dict[str, str]:
    """Names bound by importing DeepSpeed or Lightning, each with the dotted object it names."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def _chain(node) -> tuple[list[str], str | None]:
    """The attribute names of `node`'s value chain and its root (a name, "super()", or None)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return names, node.id
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super":
        return names, "super()"
    return names, None


def _base_class(base: ast.expr, bound: dict[str, str]):
    """The DeepSpeed or Lightning class a class statement's base names, imported; None for any other base."""
    names, root = _chain(base)
    if root not in bound:
        return None
    return fingerprints.resolve(".".join([bound[root], *reversed(names)]))


def private_touches(source: str) -> list[str]:
    """`line: what` for every place in `source` that reads or writes a private attribute of a DeepSpeed or Lightning
    object or module, monkeypatches one of theirs, or overrides a private hook of their class without handing it to
    shared/patches/lightning.py in one line."""
    tree = ast.parse(source)
    bound = _library_names(tree)
    delegates = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module == "shared.patches" for a in node.names if a.name == "lightning"}
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    found = []

    def theirs(names: list[str], root: str | None, klass) -> bool:
        return (root in bound or root in LIBRARY_OBJECTS or any(n in LIBRARY_OBJECTS for n in names)
                or (klass is not None and root == "super()"))

    def visit(node, klass, own: set[str]) -> None:
        if isinstance(node, ast.ClassDef):
            parents = [c for c in (_base_class(b, bound) for b in node.bases) if c is not None]
            klass = parents[0] if parents else None
            own = {t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                   and t.value.id == "self" and isinstance(t.ctx, ast.Store)}
            own |= {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            if klass is not None:
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and _private(fn.name) and hasattr(klass, fn.name) and \
                            not _delegates(fn, delegates):
                        found.append(f"{fn.lineno}: overrides {klass.__name__}.{fn.name}")
        if isinstance(node, ast.Attribute) and _private(node.attr):
            names, root = _chain(node.value)
            mine = root == "self" and not names and node.attr in own and not hasattr(klass, node.attr)
            if theirs(names, root, klass) or (klass is not None and root == "self" and not names and not mine):
                found.append(f"{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            key = node.args[1]
            names, root = _chain(node.args[0])
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and _private(key.value) and \
                    theirs(names, root, klass):
                found.append(f"{node.lineno}: {node.func.id} {key.value}")
            elif node.func.id in ("setattr", "delattr") and root in bound:
                found.append(f"{node.lineno}: {node.func.id} on {root}")
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            value = getattr(node, "value", None)
            replaces = isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in functions)
            for t in targets:
                if isinstance(t, ast.Attribute) and not _private(t.attr):
                    names, root = _chain(t.value)
                    if root in bound or (replaces and theirs(names, root, klass)):
                        found.append(f"{t.lineno}: replaces .{t.attr}")
        for child in ast.iter_child_nodes(node):
            visit(child, klass, own)

    visit(tree, None, set())
    return sorted(set(found), key=lambda f: int(f.split(":")[0]))


def _delegates(fn: ast.FunctionDef, delegates: set[str]) -> bool:
    """Whether `fn`'s body is one statement calling a function of shared/patches/lightning.py (bound as one of
    `delegates`), its docstring aside."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr):
        return False
    call = body[0].value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id in delegates)


PLANTED = '''
import argparse
import deepspeed.runtime.zero.stage3 as stage3
from pytorch_lightning.strategies import DeepSpeedStrategy
from shared.patches import lightning as lp


def f(engine, trainer):
    engine.optimizer._partition_all_parameters = None
    x = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor
    y = getattr(engine, "_deepcompile_z3_eager_fallback", None)
    stage3.is_invalid_grad_norm = lambda norm: False
    engine.optimizer.step = f
    trainer.should_stop = True
    parser = argparse.ArgumentParser()
    return x, y, parser._actions, engine.optimizer.persistent_parameters


class Strategy(DeepSpeedStrategy):
    def __init__(self):
        self._mine = 1

    def setup_distributed(self):
        self._init_deepspeed_distributed()
        return self._mine

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        return super()._setup_model_and_optimizer(model, optimizer)

    def _init_deepspeed_distributed(self):
        return lp.setup_distributed(self, None)
'''


def test_the_rule_finds_each_planted_touch_and_nothing_else():
    assert private_touches(PLANTED) == [
        "9: ._partition_all_parameters", "10: ._broadcast_sigterm_tensor", "11: getattr _deepcompile_z3_eager_fallback",
        "12: replaces .is_invalid_grad_norm", "13: replaces .step", "24: ._init_deepspeed_distributed",
        "27: overrides DeepSpeedStrategy._setup_model_and_optimizer", "28: ._setup_model_and_optimizer"]


def _file_of(module: str):
    path = ROOT / module.replace(".", "/")
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


def test_no_module_outside_the_patch_layer_touches_deepspeeds_or_lightnings_internals():
    outside = [m for m in MODULES if not in_layer(m, "shared.patches")]
    assert {"lightning_app.strategy", "lightning_app.callbacks", "shared.train.ds_runtime", "compare"} <= set(outside)
    found = {m: private_touches(_file_of(m).read_text()) for m in outside}
    assert {m: f for m, f in found.items() if f} == {}
    # the rule sees the real touches, where they belong
    for m in ("shared.patches.zero3_step", "shared.patches.deepcompile", "shared.patches.lightning"):
        assert private_touches(_file_of(m).read_text()), m


def test_the_lightning_hooks_are_registered_one_line_delegations():
    """Every hook of Lightning's that ZeroStrategy overrides and the registry names is one line handing the call to
    shared/patches/lightning.py; and every private one it overrides is registered."""
    from pytorch_lightning.strategies import DeepSpeedStrategy

    from lightning_app.strategy import ZeroStrategy

    tree = ast.parse(textwrap.dedent(inspect.getsource(ZeroStrategy)))
    methods = {n.name: n for n in tree.body[0].body if isinstance(n, ast.FunctionDef)}
    registered = {p.target.rsplit(".", 1)[1] for p in PATCHES if p.target.startswith(
        "pytorch_lightning.strategies.deepspeed.DeepSpeedStrategy.")}
    assert registered == {"setup_environment", "setup_distributed", "_setup_model_and_optimizer"}
    for name in registered:
        assert _delegates(methods[name], {"lightning_patches"}), name
    overridden_private = {n for n in methods if _private(n) and hasattr(DeepSpeedStrategy, n)}
    assert overridden_private <= registered
