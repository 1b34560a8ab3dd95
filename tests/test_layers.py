"""The layers' rules, checked from the imports of every project module (parsed, not imported):

  - no import circle among project modules (module-level and function-level imports alike);
  - shared/kernels/ imports nothing of shared/ outside itself: Triton operations only;
  - shared/model/ imports no DeepSpeed, no Lightning and nothing of shared.train / shared.tools: torch only;
  - shared/train/ imports no Lightning, and DeepSpeed only inside functions;
  - shared/patches/ (every replacement of DeepSpeed or Lightning internals) imports both only inside functions, and
    outside it only its entry points are imported: the package itself (shared.patches), and its Lightning hooks
    (shared.patches.lightning) by lightning_app/ alone, so that every patch goes through the version gate;
  - shared/ imports nothing of the paths, the harness or compare.py (arrows point one way);
  - the harness imports neither compare.py nor any private name of it;
  - the library (shared/, harness/) neither imports benchmarks/ nor names a file of it to run: benchmarks are
    scripts on top of the library, not a part of it;
and, by running it, that importing compare.py (the CLI and the harness) does not load torch._dynamo.
"""

import ast
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, env

PACKAGES = ("shared", "harness", "lightning_app", "plain_deepspeed")
TOP_MODULES = ("compare", "explain")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def module_name(path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def project_modules() -> dict[str, ast.Module]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    files += [ROOT / f"{m}.py" for m in TOP_MODULES]
    return {module_name(p): ast.parse(p.read_text(), filename=str(p)) for p in files}


MODULES = project_modules()


def imports(tree: ast.Module, module: str) -> list[tuple[str, str | None, bool]]:
    """(imported module, imported name or None, at module level) for every import statement of `tree`."""
    found = []

    def visit(node, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend((a.name, None, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative import: resolve against this module's package
                    parts = module.split(".") if module in PACKAGE_INITS else module.split(".")[:-1]
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                found.extend((base, a.name, top) for a in child.names)
            visit(child, inner)

    visit(tree, True)
    return found


PACKAGE_INITS = {name for name in MODULES if (ROOT / name.replace(".", "/") / "__init__.py").is_file()}


def targets(module: str) -> set[str]:
    """The project modules `module` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    out = set()
    for base, name, _ in imports(MODULES[module], module):
        if name is not None and f"{base}.{name}" in MODULES:
            out.add(f"{base}.{name}")
        elif base in MODULES:
            out.add(base)
    out.discard(module)
    return out


def in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def test_the_parse_sees_the_layers():
    for name in ("shared.model.gpt", "shared.model.attention", "shared.model.attention.base",
                 "shared.kernels.blocksparse_attention", "shared.train.config", "harness.launch", "compare"):
        assert name in MODULES
    assert "shared.model.attention.base" in targets("shared.model.attention.flex")
    assert "shared.model.layouts" in targets("shared.model.attention.base")  # `from shared.model import layouts`


def test_no_import_circle():
    graph = {m: targets(m) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (circle := walk(n)):
                return circle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            circle = walk(m)
            assert circle is None, " -> ".join(circle)


def _bad(layer: str, rule) -> list[str]:
    return [f"{m} imports {base}" + (f".{name}" if name else "") + ("" if top else " (in a function)")
            for m, tree in MODULES.items() if in_layer(m, layer)
            for base, name, top in imports(tree, m) if rule(base, top)]


def test_kernels_import_nothing_of_shared():
    outside = lambda base, top: in_layer(base, "shared") and not in_layer(base, "shared.kernels")
    assert _bad("shared.kernels", outside) == []


def test_the_model_imports_torch_not_the_training_stack():
    banned = ("deepspeed", *LIGHTNING, "shared.train", "shared.tools")
    assert _bad("shared.model", lambda base, top: any(in_layer(base, b) for b in banned)) == []


def test_the_training_layer_imports_deepspeed_only_inside_functions_and_never_lightning():
    assert _bad("shared.train", lambda base, top: any(in_layer(base, b) for b in LIGHTNING)) == []
    assert _bad("shared.train", lambda base, top: top and in_layer(base, "deepspeed")) == []


def test_the_patch_layer_imports_deepspeed_and_lightning_only_inside_functions():
    libraries = ("deepspeed", *LIGHTNING)
    assert _bad("shared.patches", lambda base, top: top and any(in_layer(base, b) for b in libraries)) == []
    assert "shared.patches.lightning" in MODULES and "shared.patches.zero3_step" in MODULES


def test_outside_the_patch_layer_only_its_entry_points_are_imported():
    allowed = {"shared.patches": None, "shared.patches.lightning": "lightning_app"}  # module -> who may (None: any)
    bad = [f"{m} imports {t}" for m in MODULES if not in_layer(m, "shared.patches")
           for t in targets(m) if in_layer(t, "shared.patches")
           and (t not in allowed or (allowed[t] is not None and not in_layer(m, allowed[t])))]
    assert bad == []
    assert "shared.patches.lightning" in targets("lightning_app.strategy")  # the rule sees such an import


def test_shared_imports_no_path_harness_or_entry_point():
    banned = ("lightning_app", "plain_deepspeed", "harness", *TOP_MODULES)
    assert _bad("shared", lambda base, top: any(in_layer(base, b) for b in banned)) == []


def test_the_harness_imports_nothing_of_compare():
    assert _bad("harness", lambda base, top: in_layer(base, "compare")) == []


def _code_strings(tree: ast.Module) -> list[str]:
    """The string constants of `tree` that code uses: not docstrings or a field's docstring (a bare string
    statement, which may show a command)."""
    bare = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare]


def _runs_a_benchmark(text: str) -> bool:
    """`ROOT / "benchmarks" / ...`, "benchmarks/x.py" or "benchmarks/x.sh", `-m benchmarks.x`: a file of benchmarks/
    to run (a help text may name a results path)."""
    return text == "benchmarks" or re.search(r"benchmarks/[\w/.-]*\.(py|sh)\b|(^|\s)benchmarks\.\w", text) is not None


@pytest.mark.parametrize("layer", ["harness", "shared"])
def test_the_library_neither_imports_nor_runs_benchmarks(layer):
    assert _bad(layer, lambda base, top: in_layer(base, "benchmarks")) == []
    assert [(m, text) for m, tree in MODULES.items() if in_layer(m, layer)
            for text in _code_strings(tree) if _runs_a_benchmark(text)] == []


def test_the_benchmark_rule_sees_a_script_run_by_code_and_not_one_shown_in_a_docstring():
    tree = ast.parse('"""Run `python benchmarks/x.py`."""\nSCRIPT = ROOT / "benchmarks" / "x.py"\n'
                     'CMD = ["-m", "benchmarks.x"]\nNOTE = "listed in benchmarks/results/INDEX.md"\n')
    assert sorted(t for t in _code_strings(tree) if _runs_a_benchmark(t)) == ["benchmarks", "benchmarks.x"]
    assert _runs_a_benchmark("python benchmarks/reference.py --mode ceiling")


@pytest.mark.parametrize("module", ["compare", "shared.train.cli", "harness.report"])
def test_importing_the_cli_or_the_harness_does_not_load_dynamo(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("script", ["lightning_app/train.py", "plain_deepspeed/train.py", "compare.py"])
def test_the_entry_points_run_by_path_from_anywhere(tmp_path, script):
    """As a user runs them (`python lightning_app/train.py`, torchrun, `fabric run`): by path, with no PYTHONPATH.
    lightning_app is not an installed package (its name belongs to PyPI's lightning-app), so the script itself must
    put the repo root first. A refused flag ends before any process group starts: exit 2 and the message."""
    clean = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / script), "--stage", "4", "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=clean,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ZeRO stage must be 0, 1, 2 or 3, got 4" in proc.stderr
