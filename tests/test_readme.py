"""README claims checked against the committed files they quote, and against what the code prints."""

import json
import re
import statistics

import pytest

import compare
from harness import report as reports
from shared.model.config import PRESETS
from tests.helpers import ROOT

# The README and the docs/ pages it links: the claims below may sit in either.
README = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
RESULTS = ROOT / "benchmarks" / "results"
PATHS = ("deepspeed", "lightning")


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
    """Whether `printed` is `value` rounded to as many decimals as it shows (in scientific notation, "3.2e-3", as many
    as its mantissa shows)."""
    mantissa, e, _ = printed.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return float(printed) == (float(f"{value:.{decimals}e}") if e else round(value, decimals))


def _fp8_compare(folder: str, gpu: str) -> dict:
    """An fp8 compare's report under RESULTS/folder, checked whole: every pair finished, parity passed, on `gpu`."""
    report = json.loads((RESULTS / folder / "report.json").read_text())
    assert "partial" not in report and report["ratio_spread"]["n"] == report["repeats"] and report["loss_parity"]["ok"]
    assert gpu in report["device"]["name"] and report["train"]["precision"] == "fp8"
    return report


def _fp8_bf16_compare() -> dict:
    """The one-card fp8 compare with its bf16 row in every round: whole (`_fp8_compare`), every run of a round on
    one card and all on the same one, the bf16 row in each round, the fast profile at micro-batch 8."""
    report = _fp8_compare("fp8_bf16_1xh100", "H100")
    assert report["cards"]["distinct"] == 1 and report["cards"]["each_round_on_one_card"]
    assert report["reference"]["bf16"]["tflops_spread"]["n"] == report["repeats"] == 2
    assert all(report["over_bf16"][p]["n"] == 2 for p in ("deepspeed", "lightning"))
    assert (report["train"]["profile"], report["train"]["micro_batch"]) == ("fast", 8)
    return report


def _pairs_runs() -> dict[str, list[dict]]:
    """The runs of the headline compare with both reference rows, per row in round order."""
    folder = RESULTS / "headline_pairs_1xh100/headline_1xh100" / "runs"
    return {row: [json.loads(f.read_text()) for f in sorted(folder.glob(f"{row}_*.json"))]
            for row in ("deepspeed", "lightning", "unsharded", "ceiling")}


def _stock_runs() -> list[dict]:
    """The headline compare's stock runs (DeepSpeed as shipped), in round order."""
    folder = RESULTS / "headline_pairs_1xh100/headline_1xh100" / "runs"
    return [json.loads(f.read_text()) for f in sorted(folder.glob("stock_*.json"))]


def _of_unsharded(runs: dict[str, list[dict]], row: str) -> list[float]:
    """Each run of `row` over the same round's unsharded run, in the rounds that ran one."""
    return [r["tflops_per_gpu"] / u["tflops_per_gpu"] for r, u in zip(runs[row], runs["unsharded"])]


def _one_card_rounds(runs: dict[str, list[dict]]) -> list[int]:
    """The rounds (0-based) whose runs, every row's, ran on one card: where a path's fraction of the unsharded row
    compares setups, not machines."""
    cards = lambda i: {rs[i]["device"]["uuid"] for rs in runs.values() if i < len(rs)}
    return [i for i in range(len(runs["deepspeed"])) if len(cards(i)) == 1]


def _one_card_fractions(runs: dict[str, list[dict]]) -> list[float]:
    """Both paths' fractions of the unsharded row in the rounds run on one card (what ZeRO-3 costs, quoted as a
    range)."""
    return [_of_unsharded(runs, p)[i] for p in ("deepspeed", "lightning") for i in _one_card_rounds(runs)]


def _sm_mhz(run: dict) -> float:
    """The median SM clock a run held over its timed steps (compare's clock reader)."""
    return run["extra"]["gpu_telemetry"]["sm_mhz"]["median"]


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows of the first table under `heading` (cells stripped)."""
    section = text[text.index(heading):]
    lines = [ln for ln in section[section.index("\n|"):].split("\n\n")[0].strip().splitlines()]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def _source(name: str, where: str, above: dict | None, folder, prefix: str, problems: list[str]) -> dict | None:
    """The report a table row quotes (`same`: the row above's), or None with the problem noted: a source that is no
    committed file, `same` under no readable row; `its own report` is the 2022 study's row only, and quotes none."""
    if where == "its own report":
        if "2022 study" not in name:
            problems.append(f"{name}: no source")
        return None
    if where == "same":
        if above is None:
            problems.append(f"{name}: no readable source above")
        return above
    path = folder / where.strip("`")
    if not where.startswith(prefix) or not path.is_file():
        problems.append(f"{name}: source {where} is not a committed file")
        return None
    return json.loads(path.read_text())


def _check_medians(name: str, raw: str, lightning: str, ratio: str, report: dict, problems: list[str]) -> None:
    """A row's two medians and their ratio, each as the report has it, rounded as printed."""
    if not all(_quotes(x, report["paths"][p]["tflops_per_gpu"]) for x, p in zip((raw, lightning), PATHS)):
        problems.append(f"{name}: {raw} / {lightning}")
    if not _quotes(ratio.split()[0], report["ratio_lightning_over_deepspeed"]):
        problems.append(f"{name}: ratio {ratio}")


def headline_problems(text: str) -> list[str]:
    """What in the README's headline table disagrees with the report each row names (`same`: the row above's):
    medians, Lightning / DeepSpeed ratio with its pairs and range, GPUs, micro-batch, failed parity checks, and the
    fast profile's settings; a row without a readable source is a problem unless it is the 2022 study's."""
    from shared.train.profiles import PROFILES

    problems, report = [], None
    for row in _table(text, "## Headline results"):
        name, gpus, mb, raw, lightning, ratio, failed, where = row
        report = _source(name, where, report, RESULTS, "`", problems)
        if report is None:
            continue
        n, _, device = gpus.partition(" x ")
        reference = next((row for label, row in (("plain PyTorch reference", "ceiling"), ("unsharded", "unsharded"),
                                                 ("DeepSpeed as shipped", "stock")) if name.startswith(label)), None)
        world = 1 if reference else report["world_size"]
        if int(n) != world or device not in report["device"]["name"]:
            problems.append(f"{name}: GPUs {gpus} vs {world} x {report['device']['name']}")
        if int(mb) != report["train"]["micro_batch"]:
            problems.append(f"{name}: micro-batch {mb} vs {report['train']['micro_batch']}")
        if reference:
            if not _quotes(raw, report["reference"][reference]["tflops_per_gpu"]):
                problems.append(f"{name}: {raw}")
            continue
        _check_medians(name, raw, lightning, ratio, report, problems)
        spread = report["ratio_spread"]
        m = re.search(r"\((\d+)(?:: ([0-9.]+)-([0-9.]+))?\)", ratio)
        if not m or int(m.group(1)) != spread["n"] or (m.group(2) and not (
                _quotes(m.group(2), spread["min"]) and _quotes(m.group(3), spread["max"]))):
            problems.append(f"{name}: pairs {ratio} vs {spread}")
        parity = report["loss_parity"]  # reports before the `failed` list record `ok` alone
        failed_checks = parity.get("failed", [] if parity["ok"] else ["unnamed"])
        if (failed == "none") != (not failed_checks) or (failed != "none" and failed.split(", ") != failed_checks):
            problems.append(f"{name}: parity failed {failed} vs {failed_checks}")
        if name.startswith("fast profile"):
            settings = {k: v for k, v in PROFILES["fast"].settings.items() if k != "micro_batch"}
            ran = {k: report["train"].get(k) for k in settings}
            if ran != settings:
                problems.append(f"{name}: ran {ran}, the fast profile is {settings}")
    return problems


def test_the_headline_table_quotes_the_reports_it_names():
    text = (ROOT / "README.md").read_text()
    assert len(_table(text, "## Headline results")) == 8
    assert headline_problems(text) == []


@pytest.mark.parametrize("old, new, what", [
    ("| 539.4 | 539.0 |", "| 539.4 | 539.1 |", "539.1"),
    ("| 8 | 514.69 |", "| 8 | 514.70 |", "514.70"),
    ("1.003 (3: 0.991-1.003)", "1.003 (2: 0.991-1.003)", "pairs"),
    ("| 1 x H200 | 16 | 539.4", "| 2 x H200 | 16 | 539.4", "GPUs"),
    ("| 1 x H200 | 16 | 539.4", "| 1 x H200 | 8 | 539.4", "micro-batch"),
    ("0.997 (1) | checksum |", "0.997 (1) | none |", "parity"),
    ("0.953 (2: 0.950-0.956)", "0.953 (2: 0.950-0.957)", "pairs"),
    ("`compare_1xh200/report.json`", "`compare_9xh200/report.json`", "not a committed file"),
    ("| the 2022 study, its own scripts and formula |", "| the study |", "no source"),
])
def test_the_headline_check_fails_on_a_changed_number_label_or_condition(old, new, what):
    text = (ROOT / "README.md").read_text()
    assert old in text
    problems = headline_problems(text.replace(old, new, 1))
    assert problems and what in " ".join(problems), problems


def docs_table_problems(text: str) -> list[str]:
    """What in docs/results.md's table of every compare disagrees with the report each row names (`same`: the row
    above's): medians, ratio with its pairs and range, fractions of the reference row; a reference row (fraction 1,
    or FSDP2) quotes that report's reference. A row without a readable source is a problem unless it is the 2022
    study's."""
    problems, report = [], None
    for name, raw, lightning, ratio, fraction, where in _table(text, "## Every compare of the GPU default's history"):
        report = _source(name, where, report, ROOT, "`benchmarks/results/", problems)
        if report is None:
            continue
        if fraction == "1" or name.startswith("torch FSDP2"):
            ref = report["reference"]["ceiling" if fraction == "1" else "fsdp2"]
            if not _quotes(raw, ref["tflops_per_gpu"]):
                problems.append(f"{name}: {raw}")
            continue
        _check_medians(name, raw, lightning, ratio, report, problems)
        pairs = re.search(r"\((\d+) pairs?(?:, ([0-9.]+)-([0-9.]+))?\)", ratio)
        spread = report.get("ratio_spread")
        if pairs and spread and (int(pairs.group(1)) != spread["n"] or (pairs.group(2) and not (
                _quotes(pairs.group(2), spread["min"]) and _quotes(pairs.group(3), spread["max"])))):
            problems.append(f"{name}: pairs {ratio} vs {spread}")
        if fraction and not all(_quotes(x, report["fraction_of_ceiling"][p])
                                for x, p in zip(fraction.split(" / "), PATHS)):
            problems.append(f"{name}: fractions {fraction}")
    return problems


def test_the_docs_table_of_every_compare_quotes_the_reports_it_names():
    text = (ROOT / "docs" / "results.md").read_text()
    assert len(_table(text, "## Every compare of the GPU default's history")) >= 15
    assert docs_table_problems(text) == []
    source = next(row[-1] for row in _table(text, "## Every compare of the GPU default's history")
                  if row[-1].startswith("`"))
    for old, new, what in (("| 539.4 | 539.0 |", "| 539.4 | 539.2 |", "539.2"),
                           ("| 1.043 / 1.042 |", "| 1.043 / 1.049 |", "fractions"),
                           (source, source.replace("report.json", "moved.json"), "not a committed file")):
        assert old in text, old
        assert what in " ".join(docs_table_problems(text.replace(old, new, 1))), (old, new)


def test_the_reference_rows_section_quotes_the_headline_pairs_runs():
    """docs/results.md, "The reference rows": its table (each row's runs per round, each path's fraction of the same
    round's unsharded run), the costs and the step-0 losses, recomputed from the runs and the report."""
    text = (ROOT / "docs" / "results.md").read_text()
    report = json.loads((RESULTS / "headline_pairs_1xh100/headline_1xh100" / "report.json").read_text())
    names = {"raw path": "deepspeed", "Lightning path": "lightning", "unsharded": "unsharded",
             "PyTorch user's baseline (`ceiling`)": "ceiling"}
    runs = _pairs_runs()
    table = _table(text, "## The reference rows")
    assert [r[0] for r in table] == list(names)
    for name, tflops, step_ms, fraction in table:
        rs = runs[names[name]]
        assert tflops.split(" / ") and len(tflops.split(" / ")) == len(rs) == len(step_ms.split(" / ")), name
        assert all(_quotes(x, r["tflops_per_gpu"]) for x, r in zip(tflops.split(" / "), rs)), name
        assert all(_quotes(x, r["step_time_s"]["median"] * 1e3) for x, r in zip(step_ms.split(" / "), rs)), name
        of = _of_unsharded(runs, names[name])
        assert len(fraction.split(" / ")) == len(of) and all(_quotes(x, f) for x, f in zip(fraction.split(" / "), of))
    prose = " ".join(text.split())
    step = {row: [r["step_time_s"]["median"] * 1e3 for r in runs[row]] for row in ("deepspeed", "unsharded")}
    assert _one_card_rounds(runs) == [0, 1] and len(runs["unsharded"]) == 3  # round 3's unsharded run: another card
    m = re.search(r"ZeRO-3 costs the raw path ([0-9.]+) and ([0-9.]+) ms of its step on one GPU in the rounds whose "
                  r"runs shared a card \(1 and 2\), ([0-9.]+)-([0-9.]+)% of the unsharded row's speed over both paths. "
                  r"Round 3's unsharded run came from a third card, which held (\d+) MHz over its timed steps against "
                  r"(\d+) and (\d+) for that round's paths: its fractions, ([0-9.]+) and ([0-9.]+), .*? The report's "
                  r"`fraction_of_unsharded` ratios \(([0-9.]+) raw, ([0-9.]+) Lightning\)", prose)
    of = {p: _of_unsharded(runs, p) for p in ("deepspeed", "lightning")}
    shared = _one_card_fractions(runs)
    clocks = [_sm_mhz(runs[row][2]) for row in ("unsharded", "deepspeed", "lightning")]
    quoted = [step["deepspeed"][i] - step["unsharded"][i] for i in _one_card_rounds(runs)] + [
        100 * (1 - max(shared)), 100 * (1 - min(shared)), *clocks, of["deepspeed"][2], of["lightning"][2],
        *(report["fraction_of_unsharded"][p]["ratio"] for p in ("deepspeed", "lightning"))]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 11
    assert all(report["fraction_of_unsharded"][p]["n"] == 3 and report["fraction_of_unsharded"][p]["max"] < 1
               for p in ("deepspeed", "lightning"))
    first = {p: [r["losses"][0] for r in rs] for p, rs in runs.items()}
    m = re.search(r"was ([0-9.]+) \(unsharded\) and ([0-9.]+) \(baseline\) against the paths' ([0-9.]+)", prose)
    assert m and [_quotes(x, first[p][0]) for x, p in zip(m.groups(), ("unsharded", "ceiling", "deepspeed"))] \
        == [True] * 3
    assert first["deepspeed"][0] == first["lightning"][0]
    m = re.search(r"round 2's unsharded run started ([0-9.e-]+) from the raw path's first run", prose)
    diff = abs(first["unsharded"][1] - first["deepspeed"][0])
    assert m and _quotes(m[1].split("e")[0], diff * 1e4) and m[1].endswith("e-4")
    assert report["same_start"]["abs_diff"]["unsharded"][1] == diff and not report["same_start"]["ok"]


def test_the_stock_section_quotes_the_stock_runs_and_the_paths_beside_them():
    """docs/results.md, "What the fast profile adds over DeepSpeed as shipped": each row's runs per round (TFLOPs, step
    ms, SM clock), the report's over_stock, the profiled step's figures and the stock row's step-0 loss."""
    text = (ROOT / "docs" / "results.md").read_text()
    report = json.loads((RESULTS / "headline_pairs_1xh100/headline_1xh100" / "report.json").read_text())
    runs = {"stock": _stock_runs(), **_pairs_runs()}
    names = {"stock": "stock", "raw path": "deepspeed", "Lightning path": "lightning"}
    table = _table(text, "### What the fast profile adds over DeepSpeed as shipped")
    assert [r[0] for r in table] == list(names)
    for name, tflops, step_ms, mhz in table:
        rs = runs[names[name]][:2]
        for printed, value in ((tflops, lambda r: r["tflops_per_gpu"]),
                               (step_ms, lambda r: r["step_time_s"]["median"] * 1e3), (mhz, _sm_mhz)):
            assert [_quotes(x, value(r)) for x, r in zip(printed.split(" / "), rs)] == [True, True], (name, printed)
    for r in runs["stock"]:
        assert (r["train"]["profile"], r["extra"]["patches"], r["train"]["micro_batch"]) == ("stock", [], 8)
    prose = " ".join(text.split())
    m = re.search(r"raw ([0-9.]+)x \[([0-9.]+), ([0-9.]+)\], Lightning ([0-9.]+)x \[([0-9.]+), ([0-9.]+)\]\. The stock "
                  r"runs' card held the higher clock", prose)
    over = report["over_stock"]
    assert m and [_quotes(x, over[p][k]) for x, (p, k) in zip(m.groups(), [(p, k) for p in PATHS for k in (
        "ratio", "min", "max")])] == [True] * 6
    table_md = (RESULTS / "headline_pairs_1xh100/headline_1xh100/report.md").read_text()
    profiled = {row: re.search(rf"  {row} +whole step wall +[0-9.]+ +busy +([0-9.]+) .*?compiled \(triton\) "
                               rf"([0-9.]+).*?copy and fill ([0-9.]+)", table_md).groups()
                for row in ("deepspeed", "stock")}
    m = re.search(r"busy ([0-9.]+) ms against the raw path's ([0-9.]+): inductor's generated kernels ([0-9.]+) ms "
                  r"against ([0-9.]+) .*? copies ([0-9.]+) against ([0-9.]+)", prose)
    assert m and list(m.groups()) == [profiled[r][i] for i in range(3) for r in ("stock", "deepspeed")]
    m = re.search(r"Its step-0 loss sits ([0-9.e-]+) off the raw path's \(([0-9.]+) against ([0-9.]+)\)", prose)
    first = runs["stock"][0]["losses"][0], runs["deepspeed"][0]["losses"][0]
    assert m and _quotes(m[1], abs(first[0] - first[1]))
    assert _quotes(m[2], first[0]) and _quotes(m[3], first[1])
    assert all(d <= reports.START_TOLERANCES["stock"] for d in report["same_start"]["abs_diff"]["stock"])


def test_the_training_pages_checkpoint_costs_are_the_raw_full_run():
    """docs/training.md quotes the 1.5b raw run that validated and saved mid-run, and the run without those passes."""
    text = " ".join((ROOT / "docs" / "training.md").read_text().split())
    full = json.loads((RESULTS / "resume_1xh100" / "raw_full.json").read_text())
    plain = json.loads((RESULTS / "entry_points_same_call_1xh100" / "raw_script.json").read_text())
    m = re.search(r"a checkpoint took ([0-9.]+) s \(median of (\d), about (\d+) of the run's ([0-9.]+) ms median "
                  r"steps\), a validation pass ([0-9.]+) s, and the run trained within ([0-9.e-]+) of the losses of a "
                  r"run without the mid-run passes, at ([0-9.]+) TFLOPs/GPU against that run's ([0-9.]+), on another "
                  r"card", text)
    saves = [s["seconds"] for s in full["extra"]["saves"]]
    step = full["step_time_s"]["median"]
    assert m and _quotes(m[1], statistics.median(saves)) and int(m[2]) == len(saves)
    assert int(m[3]) == round(statistics.median(saves) / step) and _quotes(m[4], step * 1e3)
    assert _quotes(m[5], statistics.median(v["seconds"] for v in full["extra"]["val"]))
    diff = max(abs(a - b) for a, b in zip(full["losses"], plain["losses"]))
    assert _quotes(m[6], diff)
    assert _quotes(m[7], full["tflops_per_gpu"]) and _quotes(m[8], plain["tflops_per_gpu"])
    assert full["device"]["uuid"] != plain["device"]["uuid"] and full["train"]["profile"] == plain["train"]["profile"]
    assert [v["step"] for v in full["extra"]["val"]] == [s["step"] for s in full["extra"]["saves"]] == [10, 20]


def test_the_training_pages_resumes_are_the_resume_checks():
    """docs/training.md and docs/results.md quote each path's 1.5b resume from its step-10 checkpoint: the resume
    checks' parity and costs, both paths on one card."""
    text = " ".join((ROOT / "docs" / "training.md").read_text().split())
    results = " ".join((ROOT / "docs" / "results.md").read_text().split())
    checks = {path: json.loads((RESULTS / "resume_1xh100" / call / "resume_check.json").read_text())
              for path, call in (("raw", "call3"), ("lightning", "call4"))}
    m = re.search(r"over steps 10-19 the resumed runs' losses sat ([0-9.e-]+) \(raw\) and ([0-9.e-]+) \(Lightning\) "
                  r"from the full runs', gradient norms ([0-9.e-]+) and ([0-9.e-]+) relative, final checksums "
                  r"([0-9.e-]+) and ([0-9.e-]+) relative, all inside resume_check's bounds", text)
    assert m
    quoted = [checks[path]["parity"][key] for key in ("max_abs_diff", "grad_norm_max_rel_diff", "checksum_rel_diff")
              for path in ("raw", "lightning")]
    assert [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 6, m.groups()
    assert all(c["ok"] and c["resumed_at"] == 10 and c["steps"] == [10, 20] for c in checks.values())
    m = re.search(r"Lightning's checkpoint took ([0-9.]+) s \(median of (\d)\) and its validation pass ([0-9.]+) s, "
                  r"the raw path's ([0-9.]+) s and ([0-9.]+) s", text)
    costs = {path: c["costs"] for path, c in checks.items()}
    assert m and _quotes(m[1], costs["lightning"]["checkpoint"]["median_s"])
    assert int(m[2]) == len(costs["lightning"]["checkpoint"]["passes"])
    assert _quotes(m[3], costs["lightning"]["validation"]["median_s"])
    assert _quotes(m[4], costs["raw"]["checkpoint"]["median_s"])
    assert _quotes(m[5], costs["raw"]["validation"]["median_s"])
    runs = [json.loads((RESULTS / "resume_1xh100" / name).read_text()) for name in (
        "call3/raw_full.json", "call3/raw_resumed.json", "call4/lightning_full.json", "call4/lightning_resumed.json")]
    assert len({r["device"]["uuid"] for r in runs}) == 1 and {r["train"]["profile"] for r in runs} == {"fast"}
    assert [r["path"] for r in runs] == ["deepspeed", "deepspeed", "lightning", "lightning"]
    m = re.search(r"each path resumed from step 10 trained within ([0-9.e-]+) of its full run's losses", results)
    assert m and all(c["parity"]["max_abs_diff"] < float(m[1]) for c in checks.values())


def test_every_link_of_the_readme_and_docs_leads_somewhere():
    """Relative links of README.md, docs/*.md and benchmarks/README.md: the file exists, and so does the heading an
    anchor names (GitHub's slugs)."""
    slug = lambda h: re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
    bad = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if link.startswith(("http://", "https://")):
                continue
            path, _, anchor = link.partition("#")
            target = page.parent / path if path else page
            if not target.exists():
                bad.append((page.name, link))
            elif anchor and target.suffix == ".md" and anchor not in {
                    slug(h) for h in re.findall(r"^#+ (.*)$", target.read_text(), re.M)}:
                bad.append((page.name, link))
    assert bad == []


def test_the_readmes_prose_numbers_are_their_sources():
    """The figures the README's prose quotes, each recomputed from the JSON it names."""
    text = " ".join((ROOT / "README.md").read_text().split())
    top = json.loads((RESULTS / "together_1xh200" / "compare" / "report.json").read_text())
    ds, pl = (top["paths"][p]["tflops_per_gpu"] for p in ("deepspeed", "lightning"))
    pairs = json.loads((RESULTS / "headline_pairs_1xh100/headline_1xh100" / "report.json").read_text())
    m = re.search(r"([0-9.]+) against raw DeepSpeed's ([0-9.]+) TFLOPs/GPU over (\d) interleaved pairs on one H100 "
                  r"\(ratio ([0-9.]+), pairs ([0-9.]+)-([0-9.]+)\), ([0-9.]+) against ([0-9.]+) on one H200 \(ratio "
                  r"([0-9.]+), one pair, inside one run's own step spread\), ([0-9.]+) on two H200s", text)
    two = json.loads((RESULTS / "deepcompile_2xh200" / "report.json").read_text())["ratio_lightning_over_deepspeed"]
    spread = pairs["ratio_spread"]
    quoted = (pairs["paths"]["lightning"]["tflops_per_gpu"], pairs["paths"]["deepspeed"]["tflops_per_gpu"],
              spread["n"], pairs["ratio_lightning_over_deepspeed"], spread["min"], spread["max"], pl, ds,
              top["ratio_lightning_over_deepspeed"], two)
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 10
    assert "partial" not in pairs or pairs["partial"]["pairs"] == pairs["repeats"]  # every pair finished
    steps = [json.loads((RESULTS / "together_1xh200" / "compare" / "runs" / f"{p}_0.json").read_text())["per_step_s"]
             for p in ("deepspeed", "lightning")]
    lo, hi = re.search(r"step spread \((\d+)-(\d+) ms\)", text).groups()
    assert int(lo) == round(min(min(s) for s in steps) * 1e3) and int(hi) == round(max(max(s) for s in steps) * 1e3)
    # what ZeRO-3 costs: each path's run over the same round's unsharded run, in the rounds that ran it
    pair_runs = _pairs_runs()
    tflops = {row: [r["tflops_per_gpu"] for r in rs] for row, rs in pair_runs.items()}
    of = {row: _of_unsharded(pair_runs, row) for row in ("deepspeed", "lightning", "ceiling")}
    one_card = _one_card_rounds(pair_runs)
    m = re.search(r"In rounds 1 and 2 \(two cards\) the raw path ran at ([0-9.]+)-([0-9.]+) of it, Lightning at "
                  r"([0-9.]+)-([0-9.]+), the PyTorch user's baseline \(.*?\) at ([0-9.]+): no ceiling. Round 3's "
                  r"unsharded run had a third card, at a higher clock: ([0-9.]+) and ([0-9.]+)", text)
    shared = {p: [of[p][i] for i in one_card] for p in ("deepspeed", "lightning")}
    quoted = (min(shared["deepspeed"]), max(shared["deepspeed"]), min(shared["lightning"]), max(shared["lightning"]),
              *of["ceiling"], of["deepspeed"][2], of["lightning"][2])
    assert m and one_card == [0, 1] and len(tflops["unsharded"]) == 3
    assert [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 7
    assert pairs["cards"]["distinct"] == 4 and not pairs["cards"]["each_round_on_one_card"]
    assert _sm_mhz(pair_runs["unsharded"][2]) > _sm_mhz(pair_runs["deepspeed"][2])  # "at a higher clock"
    lo, hi = re.search(r"ZeRO-3 itself costs ([0-9.]+)-([0-9.]+)% on one GPU \(rounds run on one card\)", text).groups()
    paths = _one_card_fractions(pair_runs)
    assert _quotes(lo, 100 * (1 - max(paths))) and _quotes(hi, 100 * (1 - min(paths)))
    # over DeepSpeed as shipped: the report's over_stock, and the clocks of the stock runs and of the paths' runs beside
    over, stock = pairs["over_stock"], _stock_runs()
    m = re.search(r"The fast profile runs ([0-9.]+)x \(raw\) and ([0-9.]+)x \(Lightning\) DeepSpeed as shipped", text)
    assert m and [_quotes(x, over[p]["ratio"]) for x, p in zip(m.groups(), PATHS)] == [True] * 2
    m = re.search(r"ran at ([0-9.]+)x it \(raw, rounds ([0-9.]+)-([0-9.]+)\) and ([0-9.]+)x \(Lightning, ([0-9.]+)-"
                  r"([0-9.]+)\)\. The stock runs had a fourth card, which held a higher clock \((\d+) and (\d+) MHz "
                  r"against (\d+)-(\d+)\)", text)
    beside = [_sm_mhz(pair_runs[p][i]) for p in PATHS for i in range(len(stock))]
    quoted = [over[p][k] for p in PATHS for k in ("ratio", "min", "max")] + [_sm_mhz(r) for r in stock] + [
        min(beside), max(beside)]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 10
    assert all(over[p]["n"] == len(stock) == 2 for p in PATHS) and min(_sm_mhz(r) for r in stock) > max(beside)
    m = re.search(r"the H100 row's runs spread ([0-9.]+)-([0-9.]+) \(raw\) and ([0-9.]+)-([0-9.]+) \(Lightning\)", text)
    quoted = (min(tflops["deepspeed"]), max(tflops["deepspeed"]), min(tflops["lightning"]), max(tflops["lightning"]))
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 4
    entry = RESULTS / "entry_points_same_call_1xh100"
    scripts = [json.loads((entry / f"{p}_script.json").read_text()) for p in ("raw", "lightning")]
    runs = RESULTS / "entry_points_same_call_1xh100/headline_1xh100/runs"
    # each script ran in the call of one compare round: raw after round 1, Lightning after round 2
    compared = [json.loads((runs / f"{r}.json").read_text()) for r in ("deepspeed_0", "lightning_1")]
    assert [s["device"]["uuid"] for s in scripts] == [c["device"]["uuid"] for c in compared]  # "in the same call"
    m = re.search(r"ran at ([0-9.]+) and ([0-9.]+) TFLOPs/GPU: ([0-9.]+) and ([0-9.]+) of a compare's run of the same "
                  r"path in the same call", text)
    quoted = [s["tflops_per_gpu"] for s in scripts] + [s["tflops_per_gpu"] / c["tflops_per_gpu"]
                                                       for s, c in zip(scripts, compared)]
    assert [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 4
    for r in scripts + compared:
        assert (r["train"]["profile"], r["train"]["micro_batch"]) == ("fast", 8) and "H100" in r["device"]["name"]
    assert all("--compile" not in s["command"] and "--profile" not in s["command"] for s in scripts)  # no speed flag
    fp8_runs = RESULTS / "fp8_vs_bf16_1xh100"
    fp8 = _fp8_bf16_compare()
    m = re.search(r"`--precision fp8` ran ([0-9.]+) \(raw\) and ([0-9.]+) \(Lightning\) TFLOPs/GPU on one H100 "
                  r"\((\d) pairs\), ([0-9.]+)x the same compare's bf16 row", text)
    quoted = [fp8["paths"][p]["tflops_spread"]["median"] for p in ("deepspeed", "lightning")]
    quoted += [fp8["repeats"], fp8["over_bf16"]["deepspeed"]["ratio"]]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 4
    h200 = _fp8_compare("fp8_vs_bf16_1xh200/fp8_1xh200", "H200")
    m = re.search(r"and ([0-9.]+) and ([0-9.]+) on one H200 \((\d) pairs\)", text)
    quoted = [h200["paths"][p]["tflops_spread"]["median"] for p in ("deepspeed", "lightning")] + [h200["repeats"]]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 3
    curve = json.loads((fp8_runs / "loss_curves_300_steps" / "loss_curves.json").read_text())
    m = re.search(r"its loss lags bf16's for (\d+) steps, then matches", text)
    assert m and [w["steps"] for w in curve["windows"] if not w["ok"]] == [[10, 10 + int(m[1])]]
    parity = json.loads((RESULTS / "deepcompile_2xh200" / "report.json").read_text())["loss_parity"]
    diff, bound = re.search(r"checksums differed by ([0-9.e-]+), over the ([0-9.e-]+) bound", text).groups()
    assert _quotes(diff.split("e")[0], parity["checksum_rel_diff"] * 1e3)
    assert float(bound) == parity["tolerance"]["checksum"]
    budget = json.loads((RESULTS / "together_1xh200" / "compare" / "step_budget.json").read_text())["runs"][0]
    m = re.search(r"matmuls run at (\d+)% of the H200's bf16 peak \((\d+)% of the peak at the (\d+) MHz its 700 W "
                  r"power cap held\) and the attention kernels \(cuDNN, with dropout\) at (\d+)%", text)
    assert [int(x) for x in m.groups()] == [round(100 * budget["matmul"]["of_peak"]),
                                            round(100 * budget["matmul"]["of_held_peak"]), round(budget["sm_mhz"]),
                                            round(100 * budget["attention"]["of_peak"])]


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


def test_the_fp8_pages_h100_figures_are_its_one_card_compare():
    """docs/fp8.md's H100 section: the table's medians, spreads, MFUs, steps, clocks and peak memory per row, the
    ratios over the bf16 row and between the paths, the gap to 620 and the kernel times, from the compare's report,
    its runs and its step_budget.json."""
    raw_text = (ROOT / "docs" / "fp8.md").read_text()
    text = " ".join(raw_text.split())
    assert "](../benchmarks/results/fp8_bf16_1xh100/)" in raw_text
    report = _fp8_bf16_compare()
    runs = {row: [json.loads(f.read_text()) for f in sorted((RESULTS / "fp8_bf16_1xh100/runs").glob(f"{row}_*.json"))]
            for row in ("deepspeed", "lightning", "bf16")}
    rows = _table(raw_text, "## Measured: one H100")
    assert [r[0] for r in rows] == ["raw, fp8 (tensorwise)", "Lightning, fp8 (tensorwise)", "raw, bf16"]
    sources = [report["paths"]["deepspeed"], report["paths"]["lightning"], report["reference"]["bf16"]]
    for row, src, name in zip(rows, sources, runs):
        spread = src["tflops_spread"]
        m = re.fullmatch(r"([0-9.]+) \[([0-9.]+)-([0-9.]+)\]", row[1])
        assert m and [_quotes(x, spread[k]) for x, k in zip(m.groups(), ("median", "min", "max"))] == [True] * 3, row
        mfus = [x.strip().rstrip("%") for x in row[2].split("/")]
        expected = [src["mfu"]] + ([src["mfu_fp8"]] if src["mfu_fp8"] else [])
        assert len(mfus) == len(expected) and all(_quotes(x, 100 * v) for x, v in zip(mfus, expected)), row
        assert _quotes(row[3], 1e3 * src["step_time_s"]["median"]), row
        clocks = row[4].split(",")
        assert len(clocks) == 2 and all(_quotes(x.strip(), _sm_mhz(r)) for x, r in zip(clocks, runs[name])), row
        assert _quotes(row[5], src["peak_mem_gib"]), row
    over, ratio = report["over_bf16"], report["ratio_spread"]
    m = re.search(r"fp8 over bf16, round by round on the same card: ([0-9.]+)x \[([0-9.]+)-([0-9.]+)\] \(raw\) and "
                  r"([0-9.]+)x \[([0-9.]+)-([0-9.]+)\] \(Lightning\)", text)
    quoted = [over[p][k] for p in ("deepspeed", "lightning") for k in ("ratio", "min", "max")]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 6
    m = re.search(r"Lightning / raw in fp8: ([0-9.]+), per pair ([0-9.]+) and ([0-9.]+)", text)
    quoted = [report["ratio_lightning_over_deepspeed"], ratio["min"], ratio["max"]]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 3
    parity = report["loss_parity"]
    m = re.search(r"\(loss ([0-9.e-]+) against ([0-9.e-]+)\)", text)
    assert m and _quotes(m[1], parity["max_abs_diff"]) and _quotes(m[2], parity["bound"]["loss"]) and parity["ok"]
    budget = json.loads((RESULTS / "fp8_bf16_1xh100" / "step_budget.json").read_text())["runs"]
    fp8, bf16 = budget[0], budget[2]
    assert (fp8["row"], fp8["precision"], bf16["precision"]) == ("deepspeed_0", "fp8", "bf16")
    assert fp8["target_tflops_per_gpu"] == 620
    m = re.search(r"the raw fp8 step needs to be ([0-9.]+) ms \(([0-9.]+)%\) shorter", text)
    assert m and _quotes(m[1], fp8["gap_ms"]) and _quotes(m[2], 100 * fp8["gap_ms"] / fp8["median_step_ms"])
    kinds, delta = fp8["by_kind_ms"], fp8["vs_baseline_ms"]
    m = re.search(r"the FP8 matmuls take ([0-9.]+) ms against bf16's ([0-9.]+), but inductor's generated kernels "
                  r"grow from ([0-9.]+) to ([0-9.]+) ms.*?The casts take back ([0-9.]+) of the ([0-9.]+) ms the "
                  r"matmuls save", text)
    quoted = [kinds["matmul"], bf16["by_kind_ms"]["matmul"], bf16["by_kind_ms"]["compiled (triton)"],
              kinds["compiled (triton)"], delta["compiled (triton)"], -delta["matmul"]]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 6


def test_the_fp8_pages_gelu_kernels_are_the_profiled_steps():
    """docs/fp8.md's GELU kernels table: every "ms (calls)" it quotes is a kernel of that phase's top list in the
    run it names (bf16, then fp8), each row's difference is theirs, and the sum is set against the gap to 620."""
    raw_text = (ROOT / "docs" / "fp8.md").read_text()
    folder = RESULTS / "fp8_bf16_1xh100" / "runs"
    runs = {p: json.loads((folder / f"{p}_0.json").read_text())["extra"]["profile"]["phases"]
            for p in ("deepspeed", "bf16")}
    rows = _table(raw_text, "The casts, kernel by kernel")
    assert [r[0] for r in rows] == ["forward", "backward"]
    total = 0.0
    for phase, bf16_cell, fp8_cell, more in rows:
        sums = []
        for cell, run in ((bf16_cell, "bf16"), (fp8_cell, "deepspeed")):
            quoted = re.findall(r"([0-9.]+) \((\d+)[ )]", cell)
            assert quoted, cell
            top = [(round(k["ms"], 2), k["calls"]) for k in runs[run][phase]["top"]]
            assert all((float(ms), int(calls)) in top for ms, calls in quoted), (phase, run, quoted, top)
            sums.append(sum(float(ms) for ms, _ in quoted))
        assert _quotes(more, sums[1] - sums[0]), (phase, more, sums)
        total += float(more)
    text = " ".join(raw_text.split())
    budget = json.loads((RESULTS / "fp8_bf16_1xh100" / "step_budget.json").read_text())["runs"][0]
    m = re.search(r"fp8's GELU kernels take ([0-9.]+) ms more than bf16's, against the ([0-9.]+) ms the step is "
                  r"short of 620", text)
    assert m and _quotes(m[1], total) and _quotes(m[2], budget["gap_ms"])


def test_the_fp8_pages_cross_machine_figures_are_their_runs():
    """docs/fp8.md's earlier H100 measurement across three machines: the two-pair compare's medians and ratio, and
    fp8 over the median of the three bf16 raw runs."""
    text = " ".join((ROOT / "docs" / "fp8.md").read_text().split())
    fp8 = _fp8_compare("fp8_vs_bf16_1xh100/fp8_1xh100", "H100")
    curve_runs = sorted((RESULTS / "fp8_vs_bf16_1xh100/fp8_curve_1xh100").glob("bf16_*.json"))
    bf16 = [json.loads(f.read_text())
            for f in [RESULTS / "fp8_vs_bf16_1xh100/bf16_1xh100/runs/deepspeed_0.json", *curve_runs]]
    for r in bf16:
        assert "H100" in r["device"]["name"] and r["train"]["profile"] == "fast" and r["train"]["micro_batch"] == 8
        assert r["train"]["precision"] == "bf16" and r["path"] == "deepspeed"
    ds, pl = (fp8["paths"][p]["tflops_spread"] for p in ("deepspeed", "lightning"))
    m = re.search(r"an fp8 compare of two pairs \(raw ([0-9.]+) \[([0-9.]+)-([0-9.]+)\], Lightning ([0-9.]+) "
                  r"\[([0-9.]+)-([0-9.]+)\], Lightning / raw ([0-9.]+)\) over the median of three bf16 raw runs, one "
                  r"per machine \(([0-9.]+)\), ([0-9.]+)x", text)
    bf16_median = statistics.median(r["tflops_per_gpu"] for r in bf16)
    quoted = [ds["median"], ds["min"], ds["max"], pl["median"], pl["min"], pl["max"],
              fp8["ratio_lightning_over_deepspeed"], bf16_median, ds["median"] / bf16_median]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * len(quoted)


def test_the_fp8_pages_h200_figures_are_its_compare_and_step_budget():
    """docs/fp8.md's H200 paragraph: the two-pair compare's medians, spreads and ratios, the gap to 620, the ratio
    over the bf16 compare it names, and the profiled step's kernel times from step_budget.json."""
    text = " ".join((ROOT / "docs" / "fp8.md").read_text().split())
    folder = RESULTS / "fp8_vs_bf16_1xh200"
    assert "](../benchmarks/results/fp8_vs_bf16_1xh200/)" in text
    report = _fp8_compare("fp8_vs_bf16_1xh200/fp8_1xh200", "H200")
    ds, pl = (report["paths"][p]["tflops_spread"] for p in ("deepspeed", "lightning"))
    m = re.search(r"Raw ([0-9.]+) \[([0-9.]+)-([0-9.]+)\], Lightning ([0-9.]+) \[([0-9.]+)-([0-9.]+)\] TFLOPs/GPU; "
                  r"Lightning / raw ([0-9.]+), per pair ([0-9.]+) and ([0-9.]+); MFU ([0-9.]+)% of the bf16 peak "
                  r"\(([0-9.]+)% of FP8's\)", text)
    ratio = report["ratio_spread"]
    quoted = [ds["median"], ds["min"], ds["max"], pl["median"], pl["min"], pl["max"],
              report["ratio_lightning_over_deepspeed"], ratio["min"], ratio["max"],
              100 * report["paths"]["deepspeed"]["mfu"], 100 * report["paths"]["deepspeed"]["mfu_fp8"]]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * len(quoted)
    assert report["repeats"] == 2
    budget = json.loads((folder / "step_budget.json").read_text())["runs"]
    fp8, bf16 = budget[0], budget[2]
    assert fp8["precision"] == "fp8" and bf16["precision"] == "bf16" and fp8["target_tflops_per_gpu"] == 620
    m = re.search(r"the step \(([0-9.]+) ms, raw\) needs to be ([0-9.]+) ms \(([0-9.]+)%\) shorter", text)
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), [fp8["median_step_ms"], fp8["gap_ms"],
                                                           100 * fp8["gap_ms"] / fp8["median_step_ms"]])] == [True] * 3
    baseline = {p: json.loads((RESULTS / "together_1xh200/compare/runs" / f"{p}_0.json").read_text())["tflops_per_gpu"]
                for p in ("deepspeed", "lightning")}
    m = re.search(r"\(([0-9.]+) raw, ([0-9.]+) Lightning: one pair[^)]*\) fp8 is ([0-9.]+)x \(raw\) and "
                  r"([0-9.]+)x", text)
    quoted = [baseline["deepspeed"], baseline["lightning"], ds["median"] / baseline["deepspeed"],
              pl["median"] / baseline["lightning"]]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * 4
    delta, kinds = fp8["vs_baseline_ms"], fp8["by_kind_ms"]
    m = re.search(r"the FP8 matmuls save ([0-9.]+) ms \(([0-9.]+) against ([0-9.]+)\), inductor's kernels add "
                  r"([0-9.]+) \(([0-9.]+) against ([0-9.]+)\): the casts take back (\d+)% of the savings, and the bf16 "
                  r"attention \(([0-9.]+) ms\)", text)
    quoted = [-delta["matmul"], kinds["matmul"], bf16["by_kind_ms"]["matmul"], delta["compiled (triton)"],
              kinds["compiled (triton)"], bf16["by_kind_ms"]["compiled (triton)"],
              100 * delta["compiled (triton)"] / -delta["matmul"], kinds["attention"]]
    assert m and [_quotes(x, v) for x, v in zip(m.groups(), quoted)] == [True] * len(quoted)


def test_the_fp8_pages_300_step_figures_are_the_curve_runs():
    """docs/fp8.md's figures from the loss curve's runs (fp8_curve_1xh100): each run's TFLOPs/GPU and their ratio,
    fp8's distance from bf16 at the end of the warm-up and from step 20 on, and the losses both end at."""
    text = " ".join((ROOT / "docs" / "fp8.md").read_text().split())
    runs = {n: json.loads((RESULTS / "fp8_vs_bf16_1xh100/fp8_curve_1xh100" / f"{n}.json").read_text())
            for n in ("fp8", "bf16_a")}
    fp8, bf16 = runs["fp8"], runs["bf16_a"]
    assert fp8["train"]["precision"] == "fp8" and bf16["train"]["precision"] == "bf16"
    assert fp8["train"]["steps"] == bf16["train"]["steps"] == 300 and fp8["train"]["data"] == bf16["train"]["data"]
    m = re.search(r"over 290 timed steps each: fp8 ([0-9.]+), bf16 ([0-9.]+), ([0-9.]+)x", text)
    assert m and _quotes(m[1], fp8["tflops_per_gpu"]) and _quotes(m[2], bf16["tflops_per_gpu"])
    assert _quotes(m[3], fp8["tflops_per_gpu"] / bf16["tflops_per_gpu"])
    assert fp8["steps"] - fp8["warmup_steps"] == bf16["steps"] - bf16["warmup_steps"] == 290
    m = re.search(r"fp8 sits ([0-9.]+) above bf16 at step (\d+), the end of the learning-rate warm-up, then within "
                  r"([0-9.]+) of it from step (\d+) on, and both end at ([0-9.]+)-([0-9.]+) at step (\d+)", text)
    assert m, "the curve runs' sentence"
    f, b = fp8["losses"], bf16["losses"]
    at = int(m[2])
    assert at == fp8["train"]["lr_warmup_steps"] and _quotes(m[1], f[at] - b[at])
    assert max(abs(x - y) for x, y in zip(f[int(m[4]):], b[int(m[4]):])) < float(m[3])
    assert int(m[7]) == len(f) - 1 and [float(m[5]), float(m[6])] == sorted([round(f[-1], 3), round(b[-1], 3)])


def test_the_fp8_pages_loss_curve_is_its_judgement():
    """docs/fp8.md's loss-curve table is loss_curves.py's judgement row by row (steps, drift, offset, bound, bias,
    verdict), and it shows the plot that judgement wrote."""
    text = (ROOT / "docs" / "fp8.md").read_text()
    folder = RESULTS / "fp8_vs_bf16_1xh100"
    curve = json.loads((folder / "loss_curves_300_steps" / "loss_curves.json").read_text())
    assert "](../benchmarks/results/fp8_vs_bf16_1xh100/loss_curves_300_steps/loss_curves.png)" in text
    assert curve["vary"] == "precision" and curve["window"] == 50 and curve["factor"] == 2.0
    rows = _table(text, "![fp8 against two bf16 runs")
    assert len(rows) == len(curve["windows"])
    for row, w in zip(rows, curve["windows"]):
        assert row[0] == f"{w['steps'][0]}-{w['steps'][1]}", row
        for cell, key in zip(row[1:5], ("drift", "offset", "bound", "bias")):
            assert float(cell) == float(f"{w[key]:.2e}"), (row, key)
        assert row[5] == ("yes" if w["ok"] else "no"), row


def test_the_training_scripts_section_quotes_each_script_and_the_compare_run_beside_it():
    """docs/results.md, "The training scripts beside compare": each script's TFLOPs, the compare run of the same path
    it names in the folder's `headline_1xh100/runs/`, their ratio, and that the script ran the fast profile with that
    run's settings but the profiled warm-up step; a script "the same call" as its run trained on that run's card; the
    prose's loss gaps and range of ratios are the table's."""
    text = (ROOT / "docs" / "results.md").read_text()
    table = _table(text, "## The training scripts beside compare")
    assert len(table) == 4
    beside_runs = {"entry_points_same_call_1xh100": "entry_points_same_call_1xh100/headline_1xh100/runs",
                   "fast_profile_entry_points_1xh100": "fast_profile_entry_points_1xh100/headline_1xh100/runs"}
    ratios, gaps = [], {}
    for script, tflops, beside, ratio, source in table:
        path = ROOT / source.strip("`")
        run = json.loads(path.read_text())
        row = {"raw_script.json": "deepspeed", "lightning_script.json": "lightning"}[path.name]
        name = re.search(r"\(`(\w+)`\)", beside)[1]
        assert name.startswith(row + "_"), (source, name)
        compared = json.loads((RESULTS / beside_runs[path.parent.name] / f"{name}.json").read_text())
        assert ("plain_deepspeed" if row == "deepspeed" else "lightning_app") in script
        assert _quotes(beside.split(" ")[0], compared["tflops_per_gpu"]) and _quotes(tflops, run["tflops_per_gpu"])
        ratios.append(run["tflops_per_gpu"] / compared["tflops_per_gpu"])
        assert _quotes(ratio, ratios[-1]), (source, ratio)
        assert run["train"]["profile"] == "fast" and run["train"]["micro_batch"] == 8
        differ = {k for k in compared["train"] if compared["train"][k] != run["train"].get(k)}
        assert differ <= {"profile_step", "out"}, (source, differ)
        if "the same call" in beside:
            assert run["device"]["uuid"] == compared["device"]["uuid"], source
            timed = slice(run["warmup_steps"], None)
            gaps[row] = max(abs(a - b) for a, b in zip(run["losses"][timed], compared["losses"][timed]))
    assert set(gaps) == {"deepspeed", "lightning"}
    m = re.search(r"its losses stayed within ([0-9.e-]+) \(raw\) and ([0-9.e-]+)\s+\(Lightning\)", text)
    assert m and _quotes(m[1], gaps["deepspeed"]) and _quotes(m[2], gaps["lightning"])
    m = re.search(r"Every script ran ([0-9.]+)-([0-9.]+)% below compare's run of its path", text)
    assert m and _quotes(m[1], 100 * (1 - max(ratios))) and _quotes(m[2], 100 * (1 - min(ratios)))
    assert max(ratios) < 1
