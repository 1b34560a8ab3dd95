"""Checkpoint bookkeeping without a training run: checksums, what --resume picks and says, and refusals that
name the checkpoint; the exported-weights readers' errors."""

import dataclasses
import re
import sys

import pytest
import torch

from shared.model.config import GPTConfig
from shared.model.gpt import GPT
from shared.tools import generate
from shared.tools.export import export
from shared.tools.prepare_data import prepare
from shared.train import checkpoint
from shared.train.config import TrainConfig
from tests.helpers import generate_error

TINY = dataclasses.asdict(TrainConfig().model())


def fake_checkpoint(ck, step: int, path: str = "deepspeed", model_config: dict = TINY, world: int = 1):
    """A step folder as commit() leaves it: shard-like files, then the marker."""
    folder = ck / checkpoint.tag_for(step)
    folder.mkdir(parents=True)
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(bytes(range(256)) * 64)
    for rank in range(world):
        (folder / f"rng_rank{rank}.pt").write_bytes(b"rng" * 10)
    checkpoint.write_marker(folder, step, {"path": path, "model_config": model_config})
    return folder


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    data[100:4196] = bytes(b ^ 0xFF for b in data[100:4196])  # 4 KiB flipped, same size
    path.write_bytes(bytes(data))


def test_same_size_corruption_is_detected_and_refused(tmp_path):
    folder = fake_checkpoint(tmp_path / "ck", 4)
    shard = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    flip_bytes(shard)
    assert checkpoint.is_complete(folder)  # the sizes still match
    assert "does not match the checksum recorded at save" in checkpoint.problem(folder, checksums=True)
    with pytest.raises(ValueError, match="is incomplete or corrupt: zero_pp_rank_0.*does not match the checksum"):
        checkpoint.resolve_resume(str(folder), None)


def test_resume_auto_says_which_checkpoint_it_skips_why_and_which_it_uses(tmp_path, capsys):
    ck = tmp_path / "ck"
    good = fake_checkpoint(ck, 2)
    flip_bytes(fake_checkpoint(ck, 4) / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    cut = fake_checkpoint(ck, 6)
    (cut / "rng_rank0.pt").write_bytes(b"r")
    assert checkpoint.resolve_resume("auto", str(ck)) == good
    err = capsys.readouterr().err
    assert f"skipped {ck / 'step00000006'}: rng_rank0.pt has 1 bytes where 30 were written" in err
    assert f"skipped {ck / 'step00000004'}: zero_pp_rank_0_mp_rank_00_optim_states.pt does not match" in err
    assert f"resuming from {good}" in err


def test_a_parent_folder_is_not_a_step_folder(tmp_path):
    ck = tmp_path / "ck"
    fake_checkpoint(ck, 2)
    fake_checkpoint(ck, 4)
    with pytest.raises(ValueError, match=r"not a step folder but holds step folders \(step00000002, step00000004\)"):
        checkpoint.resolve_resume(str(ck), None)
    with pytest.raises(ValueError, match="not a step folder"):
        export(ck, tmp_path / "out.safetensors")  # refused before DeepSpeed's reader is imported
    with pytest.raises(ValueError, match="is itself a checkpoint"):
        checkpoint.resolve_resume("auto", str(ck / "step00000004"))


def test_a_checkpoint_of_the_other_path_or_another_shape_is_refused_by_name(tmp_path):
    raw = fake_checkpoint(tmp_path / "raw", 2, path="deepspeed")
    with pytest.raises(ValueError, match=r"written by the deepspeed path \(plain_deepspeed/train.py\).*lightning"):
        checkpoint.check_resumable(raw, "lightning", TINY)
    pl = fake_checkpoint(tmp_path / "pl", 2, path="lightning")
    with pytest.raises(ValueError, match=r"written by the lightning path \(lightning_app/train.py\)"):
        checkpoint.check_resumable(pl, "deepspeed", TINY)
    checkpoint.check_resumable(raw, "deepspeed", TINY)
    wider = dataclasses.asdict(TrainConfig(n_embd=128).model())
    with pytest.raises(ValueError, match="another model shape \\(n_embd 64 in the checkpoint vs 128 now\\)"):
        checkpoint.check_resumable(raw, "deepspeed", wider)
    other = dataclasses.asdict(TrainConfig(preset="125m").model())
    with pytest.raises(ValueError, match="n_layer 2 in the checkpoint vs 12 now"):
        checkpoint.check_resumable(raw, "deepspeed", other)
    padded = dataclasses.asdict(TrainConfig(vocab_multiple=512).model())
    with pytest.raises(ValueError, match="vocab_multiple 1 in the checkpoint vs 512 now"):
        checkpoint.check_resumable(raw, "deepspeed", padded)
    older = {k: v for k, v in TINY.items() if k != "vocab_multiple"}  # written before padding existed: unpadded
    checkpoint.check_resumable(fake_checkpoint(tmp_path / "old", 2, model_config=older), "deepspeed", TINY)
    # a different backend or dropout trains the same parameters: allowed
    checkpoint.check_resumable(raw, "deepspeed", dataclasses.asdict(TrainConfig(attention="reference").model()))


def test_a_run_refuses_a_ckpt_dir_whose_checkpoints_it_would_overwrite_or_prune(tmp_path):
    ck, other = tmp_path / "ck", tmp_path / "other"
    for step in (2, 4, 6):
        fake_checkpoint(ck, step)
    (ck / "step00000008").mkdir()  # a save that never finished: not a checkpoint, pruned as before
    fresh = TrainConfig(steps=3, warmup_steps=1, ckpt_dir=str(ck), save_every=1, keep_last=2)
    with pytest.raises(ValueError, match=re.escape(f"--ckpt_dir {str(ck)!r} already holds checkpoints at steps 2, "
                                                   "4, 6: this run (--resume none) starts from step 0") +
                       ".*choose another --ckpt_dir, continue from its newest checkpoint with --resume auto, or move"):
        checkpoint.check_ckpt_dir(fresh, None)
    older = dataclasses.replace(fresh, resume=str(ck / "step00000002"), steps=8)
    with pytest.raises(ValueError, match=r"at steps 4, 6: this run resumes from step 2 \('.*step00000002'\)"):
        checkpoint.check_ckpt_dir(older, ck / "step00000002")
    checkpoint.check_ckpt_dir(dataclasses.replace(older, resume=str(ck / "step00000006")), ck / "step00000006")
    checkpoint.check_ckpt_dir(dataclasses.replace(fresh, resume="auto"), ck / "step00000006")
    checkpoint.check_ckpt_dir(dataclasses.replace(fresh, ckpt_dir=str(other)), None)  # not there yet
    checkpoint.check_ckpt_dir(dataclasses.replace(fresh, ckpt_dir=None, save_every=0), None)  # saves nothing
    fake_checkpoint(other, 1)
    with pytest.raises(ValueError, match="at steps 1: this run resumes from .*step00000006', another folder"):
        checkpoint.check_ckpt_dir(dataclasses.replace(older, ckpt_dir=str(other)), ck / "step00000006")
    # a file where the folder (or one above it) would go: DeepSpeed once failed at the first save, after training
    (tmp_path / "file").write_text("notes")
    for where in (tmp_path / "file", tmp_path / "file" / "ck"):
        for resume in ("none", "auto"):
            with pytest.raises(ValueError, match=f"--ckpt_dir '{where}': '{tmp_path / 'file'}' is a file, not a"):
                checkpoint.check_ckpt_dir(dataclasses.replace(fresh, ckpt_dir=str(where), resume=resume), None)


def test_commit_never_deletes_the_checkpoint_it_just_wrote_nor_later_ones(tmp_path, capsys):
    ck = tmp_path / "ck"
    (ck / "step00000001").mkdir(parents=True)  # an interrupted save
    for step in (2, 4, 6):
        fake_checkpoint(ck, step)
    folder = ck / checkpoint.tag_for(3)
    folder.mkdir()
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"shard" * 100)
    train = TrainConfig(steps=3, warmup_steps=1, ckpt_dir=str(ck), save_every=1, keep_last=1)
    checkpoint.commit(folder, 3, 0, train, "deepspeed", barrier=lambda: None)
    assert [(s, ok) for s, _, ok in checkpoint.list_checkpoints(ck)] == [(3, True), (4, True), (6, True)]
    assert f"saved checkpoint {folder}; deleted step00000001, step00000002 (--keep_last 1)" in capsys.readouterr().out


def test_a_checkpoint_of_another_world_size_is_refused_before_deepspeed_starts(tmp_path):
    two = fake_checkpoint(tmp_path / "ck", 2, world=2)
    with pytest.raises(ValueError, match=r"saved by 2 processes, this run has 1: .*`torchrun --nproc_per_node 2 "):
        checkpoint.check_resumable(two, "deepspeed", TINY, world=1)
    with pytest.raises(ValueError, match=r"saved by 2 processes, this run has 4: .*`lightning_app/train.py --devices"):
        checkpoint.check_resumable(fake_checkpoint(tmp_path / "pl", 2, path="lightning", world=2), "lightning", TINY,
                                   world=4)
    checkpoint.check_resumable(two, "deepspeed", TINY, world=2)


def path_main(path: str, monkeypatch):
    """The path's main(), as one process of a launcher would call it."""
    if path == "raw":
        from plain_deepspeed.train import main
    else:
        from lightning_app.train import main
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    return main


@pytest.mark.parametrize("path", ["raw", "lightning"])
def test_both_paths_check_the_ckpt_dir_and_world_size_before_starting(tmp_path, monkeypatch, path):
    main = path_main(path, monkeypatch)
    ck = tmp_path / "ck"
    fake_checkpoint(ck, 2, path="deepspeed" if path == "raw" else "lightning", world=2)
    train = TrainConfig(steps=3, warmup_steps=1, ckpt_dir=str(ck), save_every=1)
    with pytest.raises(ValueError, match="already holds checkpoints at steps 2"):
        main(train)
    with pytest.raises(ValueError, match="saved by 2 processes, this run has 1"):
        main(dataclasses.replace(train, resume=str(ck / "step00000002")))


@pytest.mark.parametrize("path", ["raw", "lightning"])
def test_both_paths_refuse_a_checkpoint_at_the_last_step_before_deepspeed_starts(tmp_path, monkeypatch, path):
    # The raw loop once found out only after deepspeed.initialize and the checkpoint's load (minutes at 1.5b)
    import deepspeed

    main = path_main(path, monkeypatch)

    def started(*args, **kwargs):
        raise AssertionError("DeepSpeed started")

    monkeypatch.setattr(deepspeed, "init_distributed", started)
    monkeypatch.setattr(deepspeed, "initialize", started)
    folder = tmp_path / "ck" / checkpoint.tag_for(3)  # a finished 3-step run, as each path saves its step
    (folder / "checkpoint").mkdir(parents=True)
    torch.save({"global_step": 3, "step": 3}, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    checkpoint.save_rng(folder, 0)
    checkpoint.write_marker(folder, 3, {"path": "deepspeed" if path == "raw" else "lightning", "model_config": TINY})
    train = TrainConfig(steps=3, warmup_steps=1, ckpt_dir=str(tmp_path / "ck"), resume="auto")
    with pytest.raises(ValueError, match="is at step 3: a run of --steps 3 has none left to train .*raise --steps"):
        main(train)


@pytest.mark.parametrize("keyword", ["none", "auto"])
def test_export_takes_a_step_folder_not_a_resume_keyword(tmp_path, monkeypatch, capsys, keyword):
    from shared.tools import export as export_tool

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        export_tool.main([keyword, "--out", str(tmp_path / "w.safetensors")])
    assert e.value.code == 2
    assert f"export takes a stepNNNNNNNN checkpoint folder (e.g. ckpt/step00000200), not '{keyword}'" in (
        capsys.readouterr().err)


def test_export_refuses_a_folder_as_out_before_it_reads_the_checkpoint(tmp_path, capsys):
    from shared.tools import export as export_tool

    folder = fake_checkpoint(tmp_path / "ck", 2)  # its shards would fail weights_only: the --out check comes first
    (tmp_path / "exports").mkdir()
    with pytest.raises(SystemExit) as e:
        export_tool.main([str(folder), "--out", str(tmp_path / "exports")])
    assert e.value.code == 2 and f"--out {tmp_path / 'exports'} is a folder" in capsys.readouterr().err


def test_export_refuses_to_replace_a_file_without_force(tmp_path, capsys):
    from shared.tools import export as export_tool

    folder = fake_checkpoint(tmp_path / "ck", 2)
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"weights of an earlier export")
    with pytest.raises(SystemExit) as e:
        export_tool.main([str(folder), "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and f"--out {out} exists already; pass --force to replace it" in err[0] and len(err) == 2
    # with --force it goes on to the checkpoint, whose fake shards weights_only refuses: the file stays as it was
    with pytest.raises(SystemExit) as e:
        export_tool.main([str(folder), "--out", str(out), "--force"])
    assert e.value.code == 2 and "exists already" not in capsys.readouterr().err
    assert out.read_bytes() == b"weights of an earlier export"


@pytest.fixture
def exported(tmp_path):
    cfg = GPTConfig()
    return checkpoint.save_exported(tmp_path / "m.safetensors", GPT(cfg).state_dict(), dataclasses.asdict(cfg))



def test_generate_refuses_truncated_or_foreign_files_with_a_message(tmp_path, exported, capsys):
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(exported.read_bytes()[:2000])
    assert "is not a readable .safetensors file" in generate_error(capsys, [str(truncated), "--tokens", "2"])
    text = tmp_path / "notes.txt"
    text.write_text("not weights at all\n" * 10)
    assert "is not a readable .safetensors file" in generate_error(capsys, [str(text), "--tokens", "2"])
    assert generate.main([str(exported), "--tokens", "2", "--device", "cpu"])  # the intact file samples


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without CUDA")
def test_generate_on_cuda_without_cuda_is_a_message(exported, capsys):
    assert "sees no CUDA device; use --device cpu" in generate_error(capsys, [str(exported), "--device", "cuda"])


def test_bpe_without_tokenizers_is_a_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    src = tmp_path / "t.txt"
    src.write_text("words and more words. " * 400)
    with pytest.raises(ValueError, match=r"needs Hugging Face's tokenizers package.*zero3-bench\[bpe\]"):
        prepare(src, tmp_path / "t", "bpe")


def test_resuming_with_another_learning_rate_schedule_warns_with_the_jump(tmp_path, recwarn):
    from shared.train.optim import lr_at

    saved = TrainConfig(steps=60, warmup_steps=1, lr=3e-3, min_lr=3e-4)
    folder = tmp_path / "ck" / checkpoint.tag_for(60)
    folder.mkdir(parents=True)
    checkpoint.write_marker(folder, 40, {"path": "deepspeed", "schedule": checkpoint.schedule_of(saved)})
    checkpoint.warn_schedule_change(folder, 40, saved)  # the same schedule: nothing to say
    assert not recwarn.list
    longer = dataclasses.replace(saved, steps=80)
    with pytest.warns(UserWarning, match=r"another learning-rate schedule \(--steps 60 -> 80\): step 40 runs at lr "
                                         f"{lr_at(40, longer):.3g} where the saved run would have used "
                                         f"{lr_at(40, saved):.3g}"):
        checkpoint.warn_schedule_change(folder, 40, longer)
    checkpoint.write_marker(folder, 40, {"path": "deepspeed"})  # a marker from before schedules were recorded
    checkpoint.warn_schedule_change(folder, 40, longer)
    assert not recwarn.list
