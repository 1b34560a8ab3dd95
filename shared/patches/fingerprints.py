"""Fingerprints of the upstream code the patches replace or rely on, and their record (fingerprints.json).

A fingerprint is 16 hex digits of the SHA-256 of a source's normalized text: for a Python function, method or
class, its definition as written in the file of the module or class that holds it (decorators included; read from
the file, so a wrapper, DeepSpeed's own nvtx one or a replacement installed in this process, never stands in for
it), dedented, without blank lines, comment lines and trailing blanks; for a file (a C++ source of DeepSpeed's op),
its lines without blank ones and trailing blanks. The text, not its AST: ast.dump differs between Python versions,
and the record must hold on the CI's Python and the GPU image's alike. `changed()` compares the installed libraries
with the record and names every source that differs; `python -m shared.patches --update` rewrites the record
(shared/patches/__init__.py says when).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import json
import textwrap
from pathlib import Path

from shared.patches import PATCHES, TESTED, installed_version

RECORD = Path(__file__).with_name("fingerprints.json")


def names() -> list[str]:
    """Every upstream source fingerprinted, in the registry's order, each once."""
    return list(dict.fromkeys(s for p in PATCHES for s in p.fingerprinted))


def is_file(name: str) -> bool:
    return "/" in name


def resolve(name: str):
    """The object a dotted name names (the longest importable module, then attributes), or the Path of a file named
    as `package/path/in/it`."""
    if is_file(name):
        package, rest = name.split("/", 1)
        return Path(importlib.import_module(package).__file__).parent / rest
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"nothing of {name!r} can be imported")


def _written(holder, attr: str) -> str | None:
    """The definition of `attr` (def or class, with its decorators) as written in the source of `holder`, a module
    or a class (searched along its bases); None where none of them writes one."""
    for owner in holder.__mro__ if inspect.isclass(holder) else (holder,):
        try:
            text = textwrap.dedent(inspect.getsource(owner))
        except (OSError, TypeError):  # a builtin, or a class without a source file
            continue
        tree = ast.parse(text)
        body = tree.body if inspect.ismodule(owner) else tree.body[0].body
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == attr:
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                return "\n".join(text.splitlines()[start - 1:node.end_lineno])
    return None


def source(name: str) -> str:
    """The source text of `name`: a file's text, or a definition as its module or class writes it; a name its
    holder imports from elsewhere (stage3's is_invalid_grad_norm) is read where it is defined."""
    if is_file(name):
        return resolve(name).read_text()
    holder_name, attr = name.rsplit(".", 1)
    written = _written(resolve(holder_name), attr)
    return written if written is not None else inspect.getsource(inspect.unwrap(resolve(name)))


def normalized(name: str) -> str:
    """The source text of `name`, normalized (see the module's docstring)."""
    lines = source(name).splitlines()
    if not is_file(name):
        lines = [line for line in textwrap.dedent("\n".join(lines)).splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def fingerprint(name: str) -> str:
    return hashlib.sha256(normalized(name).encode()).hexdigest()[:16]


def current() -> dict:
    """The record as the installed libraries would write it."""
    return {"versions": {lib: installed_version(lib) for lib in TESTED},
            "sources": {name: fingerprint(name) for name in names()}}


def load(path: Path = RECORD) -> dict:
    return json.loads(path.read_text())


def changed(record: dict | None = None) -> list[str]:
    """One line for every source whose installed text differs from the record, that the record lacks, or that the
    registry no longer fingerprints; [] when the installed libraries hold what the patches were written against."""
    record = load() if record is None else record
    recorded = record["sources"]
    lines = []
    for name in names():
        if name not in recorded:
            lines.append(f"{name}: not in shared/patches/fingerprints.json (python -m shared.patches --update)")
            continue
        try:
            now = fingerprint(name)
        except (ImportError, AttributeError, OSError, TypeError) as e:
            lines.append(f"{name}: gone from the installed library ({type(e).__name__}: {e})")
            continue
        if now != recorded[name]:
            lines.append(f"{name}: its source changed (fingerprint {recorded[name]} recorded, {now} installed): read "
                         "it against the patch that names it in shared/patches.PATCHES")
    lines += [f"{name}: recorded but no patch fingerprints it any more (python -m shared.patches --update)"
              for name in recorded if name not in names()]
    return lines


def update(path: Path = RECORD) -> dict:
    """Write the installed libraries' fingerprints to the record; refused while they are not the TESTED versions,
    so that the record always holds the tested versions' sources."""
    record = current()
    if record["versions"] != TESTED:
        raise ValueError(f"the installed versions {record['versions']} are not shared/patches.TESTED {TESTED}: "
                         "set TESTED (and the pins in pyproject.toml) to the versions the patches were checked "
                         "against first")
    path.write_text(json.dumps(record, indent=2) + "\n")
    return record
