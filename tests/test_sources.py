"""Measured figures live in docs/, not in code (STYLE.md, Comments).

A throughput, a ratio or a results folder quoted in a docstring, a comment or a --help string goes stale as soon as
the figure is measured again. Code says what a thing does and why, and names the docs page that holds the measurement
(docs/ledger.md for the levers; docs/results.md, kernels.md, tuning.md, training.md). This scans the comments and
string constants of every module of shared/, harness/, lightning_app/, plain_deepspeed/ and the entry points for the
forms such a quote takes: a figure in TFLOPs or TFLOP/s, a decimal ratio (1.005x), a signed percentage (+4.1%), a
path under benchmarks/results/. A printed message is scanned too: a run's output names no committed results file.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("shared", "harness", "lightning_app", "plain_deepspeed")
TOP_MODULES = ("compare.py", "explain.py")

# Files whose docstrings are not scrubbed yet: none (the set stays, for a file that needs a grace period, with the
# reason beside it).
NOT_YET_SCRUBBED: frozenset[str] = frozenset()

# Figures that are definitions, not measurements: they stay in code, each kept true by a test.
DEFINITIONS = {
    ("shared/model/flops.py", "989.4 TFLOP"):
        "H100 SXM / H200 datasheet peak = SMs x FLOP per clock x clock (tests/test_flops.py recomputes it)",
    ("shared/model/flops.py", "1.048x"):
        "the formula over the exact causal count at the 1.5b preset, arithmetic (tests/test_flops.py recomputes it)",
}

QUOTES = {
    "a TFLOPs figure": re.compile(r"\d(?:[\d.,]*\d)?\s*(?:TFLOPs?|TFLOPS|TFLOP/s)"),
    "a ratio": re.compile(r"(?<![\w.])\d+\.\d+x\b"),
    "a signed percentage": re.compile(r"(?<![\w.%])[+-]\d+(?:\.\d+)?%"),
    "a results path": re.compile(r"benchmarks/results\b"),
}


def scanned_files(root: Path) -> list[Path]:
    files = [p for pkg in PACKAGES if (root / pkg).is_dir() for p in sorted((root / pkg).rglob("*.py"))]
    return files + [root / m for m in TOP_MODULES if (root / m).is_file()]


def texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string constant (docstrings, help strings, messages) of `source`; the
    format specs of f-strings ({x:+.2%}) are code, not text."""
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    tree = ast.parse(source)
    specs = {id(c) for node in ast.walk(tree) if isinstance(node, ast.FormattedValue) and node.format_spec
             for c in ast.walk(node.format_spec)}
    found += [(node.lineno, node.value) for node in ast.walk(tree)
              if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in specs]
    return found


def quoted_figures(root: Path, skip=NOT_YET_SCRUBBED) -> list[str]:
    """'path:line: kind 'quote'' for every measured figure quoted in the scanned modules under `root`."""
    hits = []
    for path in scanned_files(root):
        rel = path.relative_to(root).as_posix()
        if rel in skip:
            continue
        for line, text in texts(path.read_text()):
            for kind, pattern in QUOTES.items():
                hits += [(rel, line, kind, m.group(0)) for m in pattern.finditer(text)
                         if (rel, m.group(0)) not in DEFINITIONS]
    return [f"{rel}:{line}: {kind} {quote!r}" for rel, line, kind, quote in sorted(set(hits))]


def test_no_module_quotes_a_measured_figure():
    files = {p.relative_to(ROOT).as_posix() for p in scanned_files(ROOT)}
    assert len(files) > 40 and {"compare.py", "shared/model/flops.py", "harness/report.py"} <= files
    assert quoted_figures(ROOT) == [], ("point to the docs page that holds the measurement (docs/ledger.md, "
                                        "docs/results.md, ...) instead of quoting it; move a figure no page holds "
                                        "there, with its source")


def test_a_planted_quote_is_caught(tmp_path):
    (tmp_path / "shared" / "train").mkdir(parents=True)
    # a results folder's path, not written whole here: tests/test_results_index.py reads this file for paths
    planted = "benchmarks" + "/results/planted_" + "1xh200"
    (tmp_path / "shared" / "train" / "planted.py").write_text('''"""A lever: 523.6 TFLOPs/GPU on one H200."""
from dataclasses import dataclass

# 1.005x the baselines' mean ({planted}/)


@dataclass
class Planted:
    lever: bool = False
    """faster by +4.1% raw, 410 TFLOP/s matmuls"""


def main(parser, tflops, delta):
    parser.add_argument("--lever", help="see {planted}")
    print(f"{tflops:.2f} TFLOPs/GPU {delta:+.2%} {delta:>+12.2%}, k=4, 2x backward, 0x4, 1e-3, 0.9 h^2")
'''.replace("{planted}", planted))
    (tmp_path / "compare.py").write_text("# quoted in an entry point too: 0.997x\n")
    assert quoted_figures(tmp_path) == [
        "compare.py:1: a ratio '0.997x'",
        "shared/train/planted.py:1: a TFLOPs figure '523.6 TFLOPs'",
        "shared/train/planted.py:4: a ratio '1.005x'",
        "shared/train/planted.py:4: a results path 'benchmarks/results'",
        "shared/train/planted.py:10: a TFLOPs figure '410 TFLOP'",
        "shared/train/planted.py:10: a signed percentage '+4.1%'",
        "shared/train/planted.py:14: a results path 'benchmarks/results'",
    ]
    # a file of the exempt set is passed over, whatever it quotes
    assert quoted_figures(tmp_path, skip={"shared/train/planted.py", "compare.py"}) == []


def test_the_exemptions_still_name_what_they_exempt():
    assert [p for p in sorted(NOT_YET_SCRUBBED) if not (ROOT / p).is_file()] == [], (
        "a file of NOT_YET_SCRUBBED is gone (moved and scrubbed): empty the set")
    assert [q for q in DEFINITIONS if q[1] not in (ROOT / q[0]).read_text()] == []
