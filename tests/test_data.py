import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.tools.prepare_data import byte_decode, prepare
from shared.tools.prepare_data import main as prepare_main
from shared.train.config import TrainConfig
from shared.train.data import SyntheticTokens, TokenFile, make_loader, train_loader


def test_synthetic_batches_are_a_function_of_seed_rank_and_step():
    a = SyntheticTokens(256, 16, 2, seed=1, rank=0, length=10)
    b = SyntheticTokens(256, 16, 2, seed=1, rank=0, length=10)
    x, y = a[3]
    assert x.shape == y.shape == (2, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert torch.equal(a[3][0], b[3][0])
    assert not torch.equal(a[3][0], a[4][0])
    assert not torch.equal(a[3][0], SyntheticTokens(256, 16, 2, seed=1, rank=1, length=10)[3][0])
    assert not torch.equal(a[3][0], SyntheticTokens(256, 16, 2, seed=2, rank=0, length=10)[3][0])


def test_loader_does_not_touch_the_global_rng_and_resumes():
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    batches = [x for x, _ in make_loader("synthetic", 256, 16, 2, seed=5, rank=0, micro_steps=6)]
    assert torch.equal(torch.rand(1), expected)  # dropout masks after the loader stay the same
    resumed = [x for x, _ in make_loader("synthetic", 256, 16, 2, seed=5, rank=0, micro_steps=2,
                                         start_micro_step=4)]
    assert all(torch.equal(a, b) for a, b in zip(batches[4:], resumed, strict=True))


@pytest.fixture
def corpus(tmp_path):
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200))
    src = tmp_path / "corpus.txt"
    src.write_text(text)
    return src, text


def test_prepare_and_read_token_files(tmp_path, corpus):
    src, text = corpus
    meta = prepare(src, tmp_path / "c", "byte", val_fraction=0.1)
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    train = np.fromfile(tmp_path / "c.train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "c.val.bin", dtype=np.uint16)
    assert byte_decode(np.concatenate([train, val]).tolist()) == text
    ds = TokenFile(tmp_path / "c", "train", vocab_size=256, seq_len=32, micro_batch=4, seed=0, rank=0, length=3)
    x, y = ds[1]
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(ds[1][0], x)


def test_token_file_errors(tmp_path, corpus):
    src, _ = corpus
    prepare(src, tmp_path / "c", "byte")
    with pytest.raises(ValueError, match="vocab_size 256 but the model has vocab_size 128"):
        TokenFile(tmp_path / "c", "train", vocab_size=128, seq_len=32, micro_batch=1, seed=0, rank=0, length=1)
    with pytest.raises(ValueError, match="metadata .* not found"):
        TokenFile(tmp_path / "missing", "train", 256, 32, 1, 0, 0, 1)
    # a metadata file cut short, or written by another tool: named, not a traceback (KeyError, TypeError)
    for text in ("", '{"vocab_size": 256}', '{"vocab_size": 256, "dtype": "int77"}', "[]"):
        (tmp_path / "c.meta.json").write_text(text)
        with pytest.raises(ValueError, match=r"metadata '.*c\.meta\.json' is not what prepare_data writes"):
            TokenFile(tmp_path / "c", "train", 256, 32, 1, 0, 0, 1)


def test_prepare_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        prepare_main([str(tmp_path / "nope.txt"), "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "neither a file nor a folder" in capsys.readouterr().err
    small = tmp_path / "small.txt"
    small.write_text("tiny")
    with pytest.raises(ValueError, match="is too short: 4 bytes of text make at most 4 tokens, and token files need "
                                         "at least 1000"):
        prepare(small, tmp_path / "x")


def test_prepare_says_an_input_is_empty_or_too_short_not_to_change_val_fraction(tmp_path, capsys):
    # an empty file once got "leaves the train split ... empty: change --val_fraction", which no value fixes
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "docs").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "docs" / name).write_text("")
    (tmp_path / "short.txt").write_text("é" * 10)  # 20 bytes of UTF-8
    for source, message in [("empty.txt", "input '.*empty.txt' is empty: there is no text to tokenize"),
                            ("docs", "the 2 .txt files of '.*docs' are all empty"),
                            ("short.txt", "is too short: 20 bytes of text make at most 20 tokens, and token files "
                                          "need at least 1000")]:
        with pytest.raises(SystemExit) as e:
            prepare_main([str(tmp_path / source), "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err.splitlines()  # the refusal, then where the flags are
        assert e.value.code == 2 and len(err) == 2 and re.search(message, err[0]) and "val_fraction" not in err[0], err
    assert not list(tmp_path.glob("x.*"))


def test_prepare_refuses_a_folder_it_cannot_write_and_existing_token_files_without_force(tmp_path, capsys,
                                                                                         monkeypatch):
    from shared.train import distributed

    text = tmp_path / "source.txt"
    text.write_text("words and more words. " * 100)
    locked = tmp_path / "ro"
    locked.mkdir()
    # a folder without write permission, as a user other than root sees it (root may write anywhere)
    real_access = os.access
    monkeypatch.setattr(distributed.os, "access", lambda p, mode: real_access(p, mode) and not (
        Path(p) == locked and mode & os.W_OK))
    with pytest.raises(SystemExit) as e:
        prepare_main([str(text), "--out", str(locked / "t")])
    assert e.value.code == 2 and f"--out {locked / 't.train.bin'}: the folder {locked} is not writable" in (
        capsys.readouterr().err)
    prepare_main([str(text), "--out", str(tmp_path / "t")])
    before = {f.name: f.read_bytes() for f in tmp_path.glob("t.*")}
    assert sorted(before) == ["t.meta.json", "t.train.bin", "t.val.bin"]
    text.write_text("other words. " * 200)
    with pytest.raises(SystemExit) as e:
        prepare_main([str(text), "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "t.train.bin" in err and "exist already; pass --force to replace them" in err
    # a write that fails half-way (here: a folder where the validation file is staged) leaves the earlier files
    (tmp_path / f"t.val.bin.part{os.getpid()}").mkdir()
    with pytest.raises(SystemExit) as e:
        prepare_main([str(text), "--out", str(tmp_path / "t"), "--force"])
    assert e.value.code == 2 and "cannot write the token files" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in tmp_path.glob("t.*") if f.is_file()} == before
    (tmp_path / f"t.val.bin.part{os.getpid()}").rmdir()
    prepare_main([str(text), "--out", str(tmp_path / "t"), "--force"])
    assert (tmp_path / "t.train.bin").read_bytes() != before["t.train.bin"]


def test_prepare_folder_keeps_whole_documents_for_validation(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(10):
        (folder / f"{i:02d}.txt").write_text(f"document {i} " * 50)
    docs = {i: f"document {i} " * 50 for i in range(10)}
    meta = prepare(folder, tmp_path / "d", val_fraction=0.2, seed=1)
    assert meta["documents"] == 10
    val = byte_decode(np.fromfile(tmp_path / "d.val.bin", dtype=np.uint16).tolist())
    train = byte_decode(np.fromfile(tmp_path / "d.train.bin", dtype=np.uint16).tolist())
    in_val = [i for i, d in docs.items() if d in val]
    assert len(in_val) == 2 and len(val) == 2 * len(docs[0])  # two whole documents
    assert all((d in train) != (i in in_val) for i, d in docs.items())  # no overlap, nothing lost
    prepare(folder, tmp_path / "e", val_fraction=0.2, seed=2)
    other = byte_decode(np.fromfile(tmp_path / "e.train.bin", dtype=np.uint16).tolist())
    assert other != train  # the document order follows the seed


def test_lightning_resume_loader_counts_the_skipped_micro_steps():
    # Lightning ends an epoch when its restored batch counter reaches len(loader): a resumed loader must have the
    # whole run's length yet start at the resume point with the batch the uninterrupted run had there.
    train = TrainConfig(preset="tiny", steps=8, warmup_steps=1, grad_accum=2)
    full = list(train_loader(train, rank=0))
    resumed = train_loader(train, rank=0, start_step=2, count_skipped=True)
    assert len(resumed) == len(full) == 16
    batches = list(resumed)
    assert len(batches) == 12
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, full[4:]))
    assert len(train_loader(train, rank=0, start_step=2)) == 12  # the raw loop's loader: the remaining ones


@pytest.mark.parametrize("n_docs, val_fraction", [(3, 0.9), (2, 0.75)])
def test_prepare_refuses_an_empty_train_split(tmp_path, capsys, n_docs, val_fraction):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(n_docs):
        (folder / f"{i}.txt").write_text(f"document {i} " * 100)
    with pytest.raises(SystemExit) as e:
        prepare_main([str(folder), "--out", str(tmp_path / "d"), "--val_fraction", str(val_fraction)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"val_fraction {val_fraction} puts all {n_docs} documents in the val split" in err
    assert "train split empty: lower --val_fraction" in err and not (tmp_path / "d.train.bin").exists()


def test_prepare_refuses_a_split_of_only_empty_documents(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("words " * 300)
    (folder / "b.txt").write_text("")  # the one validation document of seed 0's order
    with pytest.raises(ValueError, match=r"the val split of .* has 0 tokens \(2 documents, val_fraction 0.1\)"):
        prepare(folder, tmp_path / "d", val_fraction=0.1)


def test_prepare_reads_files_not_folders_named_txt(tmp_path):
    """A sub-folder whose name ends in .txt is walked into, not read as a document."""
    folder = tmp_path / "docs"
    (folder / "notes.txt").mkdir(parents=True)
    (folder / "notes.txt" / "a.txt").write_text("words " * 300)
    (folder / "b.txt").write_text("more words " * 100)
    meta = prepare(folder, tmp_path / "d", val_fraction=0.1)
    assert meta["documents"] == 2


def test_the_shipped_text_is_made_into_token_files_once_on_first_use(tmp_path, monkeypatch):
    """`--data kjv`: data/kjv.txt as byte tokens, made beside it when first asked for (by every rank of a run, and runs
    side by side: one makes the files under a lock, the others read them), then read like any token file."""
    import shutil
    import subprocess
    import sys

    from shared.train import data

    shutil.copy(data.SHIPPED_TEXT, tmp_path / "kjv.txt")
    monkeypatch.setattr(data, "SHIPPED_PREFIX", tmp_path / "kjv")
    monkeypatch.setattr(data, "SHIPPED_TEXT", tmp_path / "kjv.txt")
    assert data.resolve("synthetic") == "synthetic" and data.resolve("my/prefix") == "my/prefix"
    assert data.resolve("kjv") == str(tmp_path / "kjv")
    made = (tmp_path / "kjv.train.bin").stat().st_mtime_ns
    assert data.resolve("kjv") == str(tmp_path / "kjv") and (tmp_path / "kjv.train.bin").stat().st_mtime_ns == made
    x, y = next(iter(train_loader(TrainConfig(preset="tiny", data="kjv", steps=2, warmup_steps=1), rank=0)))
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.max() < 256
    assert sum(chr(int(t)).isalpha() or chr(int(t)) == " " for t in x.flatten()) > 0.8 * x.numel()  # English text
    # four processes at once on a fresh folder: all get the same files, none fails on another's half-made ones
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(tmp_path / "kjv.txt", fresh / "kjv.txt")
    code = ("import sys; from pathlib import Path; from shared.train import data; "
            f"data.SHIPPED_PREFIX = Path({str(fresh / 'kjv')!r}); "
            f"data.SHIPPED_TEXT = Path({str(fresh / 'kjv.txt')!r}); print(data.resolve('kjv'))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=data.SHIPPED_PREFIX.parents[1], stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    assert [p.communicate(timeout=120)[0].strip() for p in procs] == [str(fresh / "kjv")] * 4
    assert all(p.returncode == 0 for p in procs)
    assert np.array_equal(np.fromfile(fresh / "kjv.train.bin", np.uint16), np.fromfile(tmp_path / "kjv.train.bin",
                                                                                        np.uint16))


def test_the_shipped_text_where_its_folder_cannot_be_written_says_what_to_do(tmp_path, monkeypatch):
    from shared.train import data

    monkeypatch.setattr(data, "SHIPPED_PREFIX", tmp_path / "missing_folder" / "kjv")
    with pytest.raises(ValueError, match="--data kjv: cannot write its token files .* or pass --data synthetic"):
        data.resolve("kjv")
    monkeypatch.setattr(data, "SHIPPED_PREFIX", tmp_path / "kjv")
    monkeypatch.setattr(data, "SHIPPED_TEXT", tmp_path / "gone.txt")  # the text itself missing: the tool's own line
    with pytest.raises(ValueError, match="--data kjv: making its token files failed: .*gone.txt"):
        data.resolve("kjv")
