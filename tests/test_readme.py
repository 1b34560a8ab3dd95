"""README claims checked against the committed files they quote, and against what the code prints."""

import json
import re

import pytest

import compare
from shared.model.config import PRESETS
from tests.helpers import ROOT

# The README and the docs/ pages it links: the claims below may sit in either.
README = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
RESULTS = ROOT / "benchmarks" / "results"


def _expand(path: str) -> list[str]:
    """`a_{1,2}x` -> a_1x, a_2x (the README's shell-style brace lists)."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def test_every_results_path_the_readme_names_exists():
    mentions = set(re.findall(r"benchmarks/results/[A-Za-z0-9_.\-/*{},]*[A-Za-z0-9_*}/]", README))
    paths = [p for m in sorted(mentions) for p in _expand(m)]
    assert len(paths) > 10
    assert [p for p in paths if not list(ROOT.glob(p.rstrip("/")))] == []


def test_the_loss_parity_tolerance_quoted_is_the_one_the_reports_recorded():
    quoted = re.search(r"Loss parity: max \|diff\| .*? tolerance ([0-9.e-]+)", README, re.S).group(1)
    recorded = {json.loads((RESULTS / f"compare_{n}xh200" / "report.json").read_text())["loss_parity"]["tolerance"]
                for n in (1, 2)}
    assert recorded == {float(quoted)}


def _tflops(folder):
    found = []

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                found.append(v) if k == "tflops_per_gpu" and isinstance(v, float) else walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    for f in folder.rglob("*.json"):
        walk(json.loads(f.read_text()))
    return found


def test_the_best_throughputs_quoted_are_the_best_in_the_tuning_results():
    one, two = re.search(r"best\s+([0-9.]+) on one GPU.*?([0-9.]+) per GPU on\s+two", README, re.S).groups()
    assert float(one) == round(max(_tflops(RESULTS / "tuning_1xh200")), 2)
    winner = json.loads((RESULTS / "tuning_2xh200" / "winner" / "report.json").read_text())
    assert float(two) == round(winner["paths"]["deepspeed"]["tflops_spread"]["max"], 2)


def test_run_files_land_in_the_report_folder_as_the_readme_says(tmp_path, monkeypatch):
    assert "(`OUT/runs/`)" in README and "(`OUT/logs/`)" in README
    seen = []
    monkeypatch.setattr(compare, "launch", lambda path, train, world, out, log, timeout, env=None:
                        seen.append((out, log)) or (_ for _ in ()).throw(compare.CompareError("stop")))
    with pytest.raises(compare.CompareError):
        compare.main(["--out", str(tmp_path / "rep")])
    out, log = seen[0]
    assert out.parent == tmp_path / "rep" / "runs" and log.parent == tmp_path / "rep" / "logs"


def test_compare_help_lists_the_presets_and_the_gpu_defaults():
    text = " ".join(compare.build_parser().format_help().split())
    assert "PRESETS" not in text and " | ".join(PRESETS) in text
    assert "(default on GPUs: 1.5b; without a GPU: tiny)" in text
    assert f"(default on GPUs: {compare.GPU_DEFAULTS['micro_batch']}; without a GPU: 2)" in text


def _quotes(printed: str, value: float) -> bool:
    """Whether `printed` is `value` rounded to as many decimals as it shows."""
    return float(printed) == round(value, len(printed.partition(".")[2]))


def test_the_headline_table_quotes_the_reports_it_names():
    """Every row of the README's headline table that names a committed report (or `same`: the row above's) quotes
    that report's medians, Lightning/DeepSpeed ratio and fractions of the ceiling, rounded as printed."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Headline results"):].split("\n\n")[2]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    checked, source = 0, None
    for name, raw, lightning, ratio, fraction, where in rows:
        if where != "same":
            source = where.strip("`") if where.startswith("`benchmarks/results/") else None
        if source is None:
            continue
        report = json.loads((ROOT / source).read_text())
        if fraction == "1" or name.startswith("torch FSDP2"):  # a reference row of that compare
            ref = report["reference"]["ceiling" if fraction == "1" else "fsdp2"]
            assert _quotes(raw, ref["tflops_per_gpu"]), name
        else:
            paths = ("deepspeed", "lightning")
            assert all(_quotes(x, report["paths"][p]["tflops_per_gpu"]) for x, p in zip((raw, lightning), paths)), name
            assert _quotes(ratio.split()[0], report["ratio_lightning_over_deepspeed"]), name
            pairs = re.search(r"\((\d+) pairs?(?:, ([0-9.]+)-([0-9.]+))?\)", ratio)
            if pairs and report.get("ratio_spread"):  # the pairs' count and the range of their ratios
                spread = report["ratio_spread"]
                assert int(pairs.group(1)) == spread["n"], name
                if pairs.group(2):
                    assert _quotes(pairs.group(2), spread["min"]) and _quotes(pairs.group(3), spread["max"]), name
            if fraction:
                fractions = fraction.split(" / ")
                assert len(fractions) == 2 and all(
                    _quotes(x, report["fraction_of_ceiling"][p]) for x, p in zip(fractions, paths)), name
        checked += 1
    assert checked >= 6


def test_the_in_flight_idle_quoted_is_the_no_sync_profiles():
    folder = RESULTS / "profile_nosync_1xh200"
    m = re.search(r"what a step in flight idles: ([0-9.]+) ms \(raw\) and ([0-9.]+) ms\s+\(Lightning\) of the GPU "
                  r"default's step as it was then \([^)]*\) against the ceiling's ([0-9.]+), and ([0-9.]+) TFLOPs/GPU",
                  README)
    runs = {p: json.loads((folder / "runs" / f"{p}_0.json").read_text())["extra"]["profile"]
            for p in ("deepspeed", "lightning", "ceiling")}
    assert all(prof["synced"] is False for prof in runs.values())
    idle = [round(runs[p]["step"]["idle_ms"], 1) for p in ("deepspeed", "lightning", "ceiling")]
    budget = json.loads((folder / "step_budget.json").read_text())["runs"][0]
    assert budget["row"] == "deepspeed" and budget["profile_synced"] is False
    assert [float(x) for x in m.groups()] == [*idle, round(budget["what_if"]["no_idle"]["tflops_per_gpu"], 1)]


def test_the_sync_counts_quoted_are_the_runs_records():
    m = re.search(r"the GPU default's ZeRO-3 step\s+made (\d+) on both paths, one at the end of the backward", README)
    runs = {p: json.loads((RESULTS / "sync_check_1xh200" / "runs" / f"{p}_0.json").read_text())["extra"]["syncs"]
            for p in ("deepspeed", "lightning", "ceiling")}
    n = int(m.group(1))
    for p in ("deepspeed", "lightning"):
        assert runs[p]["total"] == n and runs[p]["by_phase"] == {"backward": 1, "step": 1}
        step = next(c for c in runs[p]["syncs"] if c["phase"] == "step")
        assert step["stack"][-1].endswith("deepspeed/runtime/utils.py:233 is_invalid_grad_norm")
    assert runs["ceiling"]["total"] == 0 and "the ceiling's step none" in " ".join(README.split())
