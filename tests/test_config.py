import pytest

from shared.model.config import GPTConfig, preset
from shared.train.cli import parse_train_config, to_argv
from shared.train.config import TrainConfig, normalize_precision


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
        (dict(precision="fp8"), "unknown precision 'fp8'"),
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


def test_cli_help_keeps_the_examples_lines(capsys):
    doc = "Train.\n\n    torchrun --nproc_per_node 2 train.py --preset tiny\n    python train.py   # one process\n"
    with pytest.raises(SystemExit) as e:
        parse_train_config(["--help"], doc)
    out = capsys.readouterr().out
    assert e.value.code == 0 and "\n    torchrun --nproc_per_node 2 train.py --preset tiny\n" in out
    assert "\n    python train.py   # one process\n" in out


def test_to_argv_round_trips():
    cfg = TrainConfig(preset="tiny", micro_batch=3, dropout=0.0, activation_checkpointing=True, seq_len=64)
    assert parse_train_config(to_argv(cfg), "test") == cfg


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
