"""The test suite's own time limits agree: a test's subprocess timeouts fit inside its pytest timeout.

A subprocess that hangs must fail through its own timeout (subprocess.TimeoutExpired, with the command, and the
process killed), not through pytest-timeout cutting the test off first with no word on which run hung. So for
each test, the subprocess timeouts it can spend one after the other (the call sites in its body, each counted
once; run() and torchrun() without one count their default) must add up to less than its pytest timeout: the
`timeout` of pyproject's [tool.pytest.ini_options], or the test's own @pytest.mark.timeout.
"""

import ast
import inspect
import tomllib

import pytest

from tests import helpers
from tests.helpers import ROOT

PYTEST_TIMEOUT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
DEFAULTS = {name: inspect.signature(getattr(helpers, name)).parameters["timeout"].default
            for name in ("run", "torchrun")}


def _marker_timeout(fn: ast.FunctionDef) -> int | None:
    for dec in fn.decorator_list:
        if (isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.timeout" and dec.args
                and isinstance(dec.args[0], ast.Constant)):
            return dec.args[0].value
    return None


def _subprocess_budget(fn: ast.FunctionDef) -> int:
    total = 0
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        name = ast.unparse(node.func)
        if "timeout" in kw and isinstance(kw["timeout"], ast.Constant) and isinstance(kw["timeout"].value, int):
            total += kw["timeout"].value
        elif name in DEFAULTS:
            total += DEFAULTS[name]
    return total


def _tests():
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for fn in ast.parse(path.read_text()).body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
                name = f"{path.name}::{fn.name}"
                yield pytest.param(name, fn, id=name)


@pytest.mark.parametrize("name, fn", list(_tests()))
def test_subprocess_timeouts_fit_inside_the_pytest_timeout(name, fn):
    limit = _marker_timeout(fn) or PYTEST_TIMEOUT
    assert _subprocess_budget(fn) < limit, (
        f"{name}: subprocess timeouts add up to {_subprocess_budget(fn)} s, not below its pytest timeout of "
        f"{limit} s: lower them, or give the test @pytest.mark.timeout(...) above their sum")
