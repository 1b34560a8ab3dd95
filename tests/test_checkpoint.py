"""Checkpoint bookkeeping without a training run: checksums, what --resume picks and says, and refusals that
name the checkpoint; the exported-weights readers' errors."""

import dataclasses
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

TINY = dataclasses.asdict(TrainConfig().model())


def fake_checkpoint(ck, step: int, path: str = "deepspeed", model_config: dict = TINY):
    """A step folder as commit() leaves it: shard-like files, then the marker."""
    folder = ck / checkpoint.tag_for(step)
    folder.mkdir(parents=True)
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(bytes(range(256)) * 64)
    (folder / "rng_rank0.pt").write_bytes(b"rng" * 10)
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


@pytest.fixture
def exported(tmp_path):
    cfg = GPTConfig()
    return checkpoint.save_exported(tmp_path / "m.safetensors", GPT(cfg).state_dict(), dataclasses.asdict(cfg))


def _generate_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_generate_refuses_truncated_or_foreign_files_with_a_message(tmp_path, exported, capsys):
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(exported.read_bytes()[:2000])
    assert "is not a readable .safetensors file" in _generate_error(capsys, [str(truncated), "--tokens", "2"])
    text = tmp_path / "notes.txt"
    text.write_text("not weights at all\n" * 10)
    assert "is not a readable .safetensors file" in _generate_error(capsys, [str(text), "--tokens", "2"])
    assert generate.main([str(exported), "--tokens", "2", "--device", "cpu"])  # the intact file samples


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without CUDA")
def test_generate_on_cuda_without_cuda_is_a_message(exported, capsys):
    assert "sees no CUDA device; use --device cpu" in _generate_error(capsys, [str(exported), "--device", "cuda"])


def test_bpe_without_tokenizers_is_a_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    src = tmp_path / "t.txt"
    src.write_text("words and more words. " * 400)
    with pytest.raises(ValueError, match=r"needs Hugging Face's tokenizers package.*zero3-bench\[bpe\]"):
        prepare(src, tmp_path / "t", "bpe")
