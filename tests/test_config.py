import dataclasses
import re

import pytest

from shared.model.config import GPTConfig, preset
from shared.train.cli import LEVERS_TITLE, MORE_TITLE, parse_train_config, to_argv
from shared.train.config import LEVERS, MORE_OPTIONS, TrainConfig, normalize_precision
from shared.train.profiles import PROFILES
from tests.helpers import ROOT


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_embd=100, n_head=3), "divisible by n_head"),
        (dict(seq_len=100, sparse_block=16), "multiple of sparse_block .* use e.g. --seq_len 96"),
        (dict(attention="flash9"), "unknown attention backend 'flash9'"),
        (dict(layout="zigzag"), "unknown layout 'zigzag'"),
        (dict(attn_dropout_mask="bitz"), "unknown attn_dropout_mask 'bitz'"),
        (dict(attn_dropout_mask="bits"), "attn_dropout_mask 'bits' is the blocksparse kernel's; attention 'sdpa'"),
        (dict(n_layer=0), "n_layer must be a positive integer"),
        (dict(dropout=1.0), "dropout must be in"),
    ],
)
def test_gpt_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig(preset="huge")


def test_study_preset_shape():
    cfg = preset("1.5b")
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.seq_len, cfg.vocab_size) == (2304, 24, 24, 2048, 50257)
    assert cfg.sparse_block == 128 and cfg.head_dim == 96


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stage=4), "ZeRO stage must be 0, 1, 2 or 3, got 4"),
        (dict(micro_batch=0), "micro_batch must be a positive integer, got 0"),
        (dict(steps=5, warmup_steps=5), "warmup_steps"),
        (dict(warmup_steps=3, profile_step=3), r"profile_step \(3\) must be >= 0 and below warmup_steps \(3\)"),
        (dict(profile_step=-1), r"profile_step \(-1\)"),
        (dict(precision="fp4"), "unknown precision 'fp4'"),
        (dict(attention="nope"), "unknown attention backend"),
        (dict(attn_dropout_mask="mask"), "unknown attn_dropout_mask 'mask'"),
        (dict(lr=-1.0), "lr must be positive and finite, got -1.0"),
        (dict(lr=float("nan")), "lr must be positive and finite, got nan"),
        (dict(lr=float("inf")), "lr must be positive and finite, got inf"),
        (dict(min_lr=-1e-5), "min_lr must be >= 0"),
        (dict(grad_clip=-1.0), "grad_clip must be >= 0"),
        (dict(weight_decay=float("inf")), "weight_decay must be >= 0 and finite, got inf"),
        (dict(lr=1e-5), r"min_lr 3e-05 is above lr 1e-05: the cosine schedule would rise"),  # min_lr's default
    ],
)
def test_train_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_lightning_precision_names_map_to_deepspeed():
    assert normalize_precision("bf16-mixed") == normalize_precision("bf16-true") == "bf16"
    assert normalize_precision("16-mixed") == "fp16"
    assert normalize_precision("32-true") == "fp32"


def test_cli_flags_are_field_names_with_study_aliases():
    cfg = parse_train_config(["--batch_size_per_gpu", "36", "--attention", "reference", "--precision", "bf16",
                              "--activation-checkpointing"], "test")
    assert cfg.micro_batch == 36 and cfg.attention == "reference" and cfg.activation_checkpointing
    assert cfg.flops_factor == 4
    assert parse_train_config(["--deepspeed_config", "ds.json"], "test").ds_config == "ds.json"  # DeepSpeed's name


def test_cli_bad_value_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_train_config(["--stage", "4"], "test")
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()  # the message and where the flags are, not ~50 lines of usage first
    assert len(err) == 2 and "ZeRO stage must be 0, 1, 2 or 3, got 4" in err[0] and "--help" in err[1]
    with pytest.raises(SystemExit) as e:
        parse_train_config(["--micro_batch", "two"], "test")  # argparse's own type errors too
    assert e.value.code == 2 and len(capsys.readouterr().err.splitlines()) == 2


@pytest.mark.parametrize("value", ["-1e-3", "-3E+2", "-2.", "-1", "-.5", "-inf"])
def test_a_negative_number_is_a_flags_value_and_then_refused_by_its_check(capsys, value):
    # "-1e-3" was taken for an option: "argument --lr: expected one argument"
    with pytest.raises(SystemExit) as e:
        parse_train_config(["--lr", value, "--steps", "4", "--warmup_steps", "1"], "test")
    assert e.value.code == 2
    assert f"lr must be positive and finite, got {float(value)!r}" in capsys.readouterr().err
    assert parse_train_config(["--lr", "1e-3", "--min_lr", "1e-4"], "test").lr == 1e-3
    with pytest.raises(SystemExit):  # an option that is no number stays an option
        parse_train_config(["--lr", "-x"], "test")
    assert "expected one argument" in capsys.readouterr().err


def test_cli_help_keeps_the_examples_lines(capsys):
    doc = "Train.\n\n    torchrun --nproc_per_node 2 train.py --preset tiny\n    python train.py   # one process\n"
    with pytest.raises(SystemExit) as e:
        parse_train_config(["--help"], doc)
    out = capsys.readouterr().out
    assert e.value.code == 0 and "\n    torchrun --nproc_per_node 2 train.py --preset tiny\n" in out
    assert "\n    python train.py   # one process\n" in out


def test_to_argv_round_trips():
    cfg = TrainConfig(preset="tiny", micro_batch=3, dropout=0.0, activation_checkpointing=True, seq_len=64)
    # every field is given, so the machine's profile fills nothing and is only named
    import torch

    from shared.train.profiles import default_name

    assert parse_train_config(to_argv(cfg), "test") == dataclasses.replace(
        cfg, profile=default_name(torch.cuda.is_available()))
    with_profile = dataclasses.replace(cfg, profile="eager")
    assert parse_train_config(to_argv(with_profile), "test") == with_profile


@pytest.mark.parametrize("code, rc, stderr", [(143, 143, ""), (None, 0, ""), ("stopped: reason", 1, "stopped: reason")])
def test_run_cli_keeps_the_exit_code_of_a_system_exit(code, rc, stderr):
    # preemption raises SystemExit(143); DeepSpeed's autotuning experiments call exit() after profiling
    import subprocess
    import sys

    from tests.helpers import ROOT, env

    script = ("from shared.train.distributed import run_cli\n"
              "def main(train):\n"
              f"    raise SystemExit({code!r})\n"
              "run_cli(main, None, 'cpu')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env(), cwd=ROOT,
                          timeout=120)
    assert proc.returncode == rc and proc.stderr.strip().endswith(stderr), proc.stderr


def test_attn_dropout_mask_reaches_the_blocksparse_module():
    from shared.model.attention import build_attention

    argv = ["--preset", "tiny", "--attention", "blocksparse", "--attn_dropout_mask", "bits", "--precision", "fp32"]
    train = parse_train_config(argv, "test")
    cfg = train.model()
    assert cfg.attn_dropout_mask == "bits" and TrainConfig(preset="tiny").model().attn_dropout_mask == "philox"
    attn = build_attention(cfg)
    assert attn.dropout_mask == "bits" and attn.backend == "blocksparse:bits"
    assert build_attention(preset("tiny", attention="blocksparse")).backend == "blocksparse"


def test_the_blocksparse_kernel_in_bf16_is_refused_where_only_tritons_interpreter_runs_it(monkeypatch):
    import shared.model.config as model_config

    with pytest.raises(ValueError, match="bf16 dot products come out wrong: add --precision fp32"):
        TrainConfig(attention="blocksparse")
    assert TrainConfig(attention="blocksparse", precision="fp32").model().attention == "blocksparse"
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    assert TrainConfig(attention="blocksparse").precision == "bf16"  # on a GPU the compiled kernel is right


def test_the_logged_learning_rate_is_the_one_the_last_step_used():
    import types

    import torch

    from shared.train.ds_runtime import progress_extras
    from shared.train.optim import build_scheduler, lr_at

    train = TrainConfig(steps=20, lr_warmup_steps=4)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.lr)
    scheduler = build_scheduler(optimizer, train)
    engine = types.SimpleNamespace(get_global_grad_norm=lambda: None)
    extras = progress_extras(scheduler, engine, device=torch.device("cpu"))
    for step in range(6):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(step, train))  # what step `step` runs with
        optimizer.step()
        scheduler.step()  # as the engine does after each optimizer step, before the progress line is written
        assert extras()["lr"] == pytest.approx(lr_at(step, train)), step  # not the next step's


# Levers measured neutral or superseded and removed (docs/ledger.md), each with a value it once took
REMOVED = {"deepcompile_skip_divide_by_one": "true", "skip_guard_eval": "true", "matmul_bias_grad": "true",
           "fused_loss": "true", "fused_layernorm": "true", "optimizer": "fusedadam", "python_gc": "auto",
           "sigterm_check_every": "1", "max_live_parameters": "1000", "memory_efficient_linear": "false"}


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_removed_lever_is_refused_by_the_parsers_naming_it(name, capsys):
    import compare

    assert name not in {f.name for cls in (TrainConfig, GPTConfig) for f in dataclasses.fields(cls)}
    for flag in (f"--{name}", f"--{name.replace('_', '-')}"):
        for parse in (lambda argv: parse_train_config(argv, "test"), compare.build_parser().parse_args):
            with pytest.raises(SystemExit) as e:
                parse([flag, REMOVED[name]])
            assert e.value.code == 2 and f"unrecognized arguments: {flag} {REMOVED[name]}" in capsys.readouterr().err


def test_the_ledger_keeps_each_removed_levers_measurement_and_has_a_row_for_each_of_the_gpu_default():
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in (ROOT / "docs" / "ledger.md").read_text()
            .splitlines() if line.startswith("| `")]
    of = lambda name: [row for row in rows if re.match(rf"`--{name}\b", row[0])]
    for name in REMOVED:  # what it does, what it measured (or that nothing was), and that it is removed
        assert [(bool(r[1] and r[2]), r[-1].split(":")[0]) for r in of(name)] == [(True, "removed")], name
    for name in set(PROFILES["fast"].settings) - {"micro_batch"}:  # the micro-batch's row is "+mb24"
        assert any(r[2] and r[-1].startswith("kept") for r in of(name)), name


# DeepSpeed's own config key of that name, which the DeepSpeed dict sets false for compiled blocks
DEEPSPEED_KEYS = {("shared/train/ds_config.py", "memory_efficient_linear")}


def test_no_module_names_a_removed_lever():
    packages = ("shared", "harness", "lightning_app", "plain_deepspeed")
    sources = [ROOT / "compare.py", *sorted((ROOT / "benchmarks").glob("*.py")),
               *(f for d in packages for f in sorted((ROOT / d).rglob("*.py")))]
    assert len(sources) > 50
    named = []
    for path in sources:
        text, where = path.read_text(), str(path.relative_to(ROOT))
        for name in REMOVED:
            if name == "optimizer":  # a word of every optimizer step: its flag, value and field only
                patterns = [r"--optimizer\b", r"\bfusedadam\b", r"\b(train|cfg|train_cfg|base)\.optimizer\b"]
            else:
                patterns = [rf"\b{name}\b", rf"--{name.replace('_', '-')}\b"]
            if (where, name) not in DEEPSPEED_KEYS and any(re.search(p, text) for p in patterns):
                named.append((where, name))
    assert named == []


def test_help_lists_the_common_flags_before_the_expert_levers(capsys):
    """--help of the training scripts and of compare.py: the fields in LEVERS in their own group, after every other
    flag; compare.py's GPU default sets levers only, besides its compile mode and micro-batch."""
    import compare

    with pytest.raises(SystemExit):
        parse_train_config(["--help-all"], "Train.")
    for text in (capsys.readouterr().out, compare.build_parser().format_help(everything=True)):
        common, expert = text.split(f"\n{LEVERS_TITLE}:\n")
        expert = expert.split(f"\n{MORE_TITLE}:\n")[0]
        common = common.replace("--help-all", "")
        assert "\noptions:\n" in common and "\n\n" not in common.split("\noptions:\n")[1].rstrip()
        fields = [f.name for f in dataclasses.fields(TrainConfig)]
        flag = lambda name: re.compile(rf"^  --{name}\b", re.M)
        assert [n for n in fields if flag(n).search(expert)] == [n for n in fields if n in LEVERS]
        assert [n for n in fields if flag(n).search(common)] == [n for n in fields
                                                                 if n not in LEVERS | MORE_OPTIONS]
    assert {"--gpus", "--repeats", "--autotune"} <= set(re.findall(r"^  (--\w+)", common, re.M))  # compare's own
    assert set(PROFILES["fast"].settings) - {"compile", "micro_batch"} <= LEVERS



def test_the_default_help_shows_the_common_options_and_points_to_the_rest(capsys):
    """`--help` of compare.py and the training scripts: at most 40 options, the levers and the rest behind
    --help-all, which lists every flag."""
    import compare

    for parser in (compare.build_parser(), None):
        if parser is None:
            with pytest.raises(SystemExit):
                parse_train_config(["--help"], "Train.")
            short = capsys.readouterr().out
            with pytest.raises(SystemExit):
                parse_train_config(["--help-all"], "Train.")
            full = capsys.readouterr().out
        else:
            short, full = parser.format_help(), parser.format_help(everything=True)
        options = lambda text: re.findall(r"^  (-[-\w]+)", text, re.M)
        assert len(options(short)) <= 40 and "--help-all" in short.splitlines()[-1]
        assert LEVERS_TITLE not in short and MORE_TITLE not in short and "--zero3_step" not in options(short)
        assert set(options(short)) < set(options(full)) and "--zero3_step" in options(full)
        n = int(re.search(r"(\d+) more options", short).group(1))
        assert n == len(options(full)) - len(options(short))
