"""Batches both paths train on: seeded synthetic tokens, or windows of a memory-mapped token file.

Every micro-batch is a pure function of (seed, rank, micro_step), so the raw loop and Lightning see identical
batches, a resumed run continues with the batch it would have seen, and no global RNG is touched (a
RandomSampler would draw from torch's global generator and shift every dropout mask after it).

Token files (written by `python -m shared.tools.prepare_data`): `PREFIX.train.bin` / `PREFIX.val.bin`, a flat array
of uint16 (vocab <= 65535) or uint32 token ids, and `PREFIX.meta.json` with the dtype, vocab size and tokenizer.
`--data kjv` names the text shipped with the project (data/kjv.txt) as byte tokens, made into data/kjv_byte.* on
first use: real language for any preset (its 256 byte values fit every vocabulary), with nothing to prepare.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)


def batch_seed(seed: int, rank: int, micro_step: int) -> int:
    """A 63-bit seed unique to (seed, rank, micro_step)."""
    return (seed * _MIX[0] + rank * _MIX[1] + micro_step * _MIX[2]) % (2**63 - 1)


class SyntheticTokens(Dataset):
    """Item i is micro-step i's batch for this rank: (x, y) of shape (micro_batch, seq_len), y = x shifted by one."""

    def __init__(self, vocab_size: int, seq_len: int, micro_batch: int, seed: int, rank: int, length: int):
        self.vocab_size, self.seq_len, self.micro_batch = vocab_size, seq_len, micro_batch
        self.seed, self.rank, self.length = seed, rank, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(batch_seed(self.seed, self.rank, micro_step))
        tokens = torch.randint(0, self.vocab_size, (self.micro_batch, self.seq_len + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]


SHIPPED = "kjv"
# the token files of data/kjv.txt as bytes, apart from data/kjv.* (the name the docs' prepare_data examples write)
SHIPPED_PREFIX = Path(__file__).resolve().parents[2] / "data" / f"{SHIPPED}_byte"
SHIPPED_TEXT = SHIPPED_PREFIX.with_name(f"{SHIPPED}.txt")


def resolve(data: str) -> str:
    """What `data` names: "synthetic", or a token-file prefix; the shipped text's files are made on first use (under a
    lock: every rank of a run, and runs side by side, resolve it), by the prepare_data tool in a process of its own
    (the tools sit above this module: an import would be a circle)."""
    if data != SHIPPED:
        return data
    try:
        lock = open(SHIPPED_PREFIX.with_name(f".{SHIPPED}.lock"), "w")
    except OSError as e:
        raise ValueError(f"--data {SHIPPED}: cannot write its token files beside {SHIPPED_TEXT} ({e.strerror}); "
                         "make them elsewhere with `python -m shared.tools.prepare_data data/kjv.txt --out PREFIX` "
                         "and pass --data PREFIX, or pass --data synthetic") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(Path(f"{SHIPPED_PREFIX}.{part}").is_file() for part in ("train.bin", "val.bin", "meta.json")):
            made = subprocess.run([sys.executable, "-m", "shared.tools.prepare_data", str(SHIPPED_TEXT), "--out",
                                   str(SHIPPED_PREFIX), "--force"], cwd=Path(__file__).resolve().parents[2],
                                  capture_output=True, text=True)
            if made.returncode != 0:  # the tool's own "error: ..." line, else its last
                lines = made.stderr.strip().splitlines() or ["(no message)"]
                said = next((ln for ln in lines if "error:" in ln), lines[-1])
                raise ValueError(f"--data {SHIPPED}: making its token files failed: {said}")
    return str(SHIPPED_PREFIX)


def read_meta(prefix: str | Path) -> dict:
    meta_path = Path(f"{prefix}.meta.json")
    if not meta_path.is_file():
        raise ValueError(
            f"token file metadata {str(meta_path)!r} not found; make it with "
            f"`python -m shared.tools.prepare_data TEXT --out {prefix}`"
        )
    try:
        meta = json.loads(meta_path.read_text())
        np.dtype(meta["dtype"])
        int(meta["vocab_size"])
    except (ValueError, TypeError, KeyError) as e:  # e.g. a file cut short, or written by another tool
        raise ValueError(f"token file metadata {str(meta_path)!r} is not what prepare_data writes ({e!r}); make it "
                         f"again with `python -m shared.tools.prepare_data TEXT --out {prefix}`") from e
    return meta


def check_token_file(prefix: str | Path, split: str, vocab_size: int, seq_len: int) -> dict:
    """The metadata of PREFIX.SPLIT.bin, after checking that the files exist and fit the model (no data read)."""
    meta = read_meta(prefix)
    path = Path(f"{prefix}.{split}.bin")
    if not path.is_file():
        raise ValueError(f"token file {str(path)!r} not found")
    if meta["vocab_size"] > vocab_size:
        raise ValueError(
            f"token file {str(path)!r} was made with vocab_size {meta['vocab_size']} but the model has "
            f"vocab_size {vocab_size}: token ids would index past the embedding; pass --vocab_size "
            f"{meta['vocab_size']}"
        )
    if meta.get("max_token", 0) >= vocab_size:
        raise ValueError(f"token file {str(path)!r} holds token id {meta['max_token']}, outside the model's "
                         f"vocabulary of {vocab_size}")
    n_tokens = path.stat().st_size // np.dtype(meta["dtype"]).itemsize
    if n_tokens < seq_len + 2:
        raise ValueError(f"token file {str(path)!r} has {n_tokens} tokens, fewer than seq_len+2")
    return meta


def check_data(train) -> None:
    """Refuse, before any process starts, token files a TrainConfig's run could not read (synthetic: nothing)."""
    if train.data == "synthetic":
        return
    model = train.model()
    for split in ("train", "val") if train.val_every else ("train",):
        check_token_file(resolve(train.data), split, model.vocab_size, model.seq_len)


class TokenFile(Dataset):
    """Item i: micro_batch random windows of seq_len+1 tokens from a memory-mapped token file."""

    def __init__(self, prefix: str | Path, split: str, vocab_size: int, seq_len: int, micro_batch: int,
                 seed: int, rank: int, length: int):
        meta = check_token_file(prefix, split, vocab_size, seq_len)
        self.vocab_size = vocab_size
        self.tokens = np.memmap(f"{prefix}.{split}.bin", dtype=np.dtype(meta["dtype"]), mode="r")
        self.seq_len, self.micro_batch, self.seed, self.rank, self.length = seq_len, micro_batch, seed, rank, length
        self.split_salt = 0 if split == "train" else 1_000_003

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(batch_seed(self.seed + self.split_salt, self.rank, micro_step))
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.micro_batch,), generator=g)
        rows = np.stack([self.tokens[s: s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64)
        if rows.max() >= self.vocab_size:  # a file edited or corrupted after its metadata was written
            raise ValueError(f"token id {int(rows.max())} at micro-step {micro_step} is outside the model's "
                             f"vocabulary of {self.vocab_size}")
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1], tokens[:, 1:]


class _FromStep(Dataset):
    """View of a dataset starting at micro-step `start` (resume without replaying the data)."""

    def __init__(self, base: Dataset, start: int):
        self.base, self.start = base, start

    def __len__(self) -> int:
        return len(self.base) - self.start

    def __getitem__(self, i: int):
        return self.base[self.start + i]


class _ResumedPositions(Sampler[int]):
    """Micro-steps `start`..`total`-1, in order, with len() = `total`: the loader of a resumed Lightning run.

    Lightning restores its in-epoch batch counter to the checkpoint's micro-step and ends the epoch when that
    counter reaches len(loader). A loader of only the remaining micro-steps ended the epoch after total-start of
    them counted from `start`, and the next epoch replayed the data from the resume point: a resume at step k
    of n diverged from step n-k+1 on whenever k < n/2. Counting the skipped micro-steps in len() makes the
    epoch end with the run."""

    def __init__(self, start: int, total: int):
        self.start, self.total = start, total

    def __iter__(self):
        return iter(range(self.start, self.total))

    def __len__(self) -> int:
        return self.total


def make_dataset(data: str, split: str, vocab_size: int, seq_len: int, micro_batch: int, seed: int, rank: int,
                 length: int) -> Dataset:
    if data == "synthetic":
        salt = 0 if split == "train" else 7_777_777
        return SyntheticTokens(vocab_size, seq_len, micro_batch, seed + salt, rank, length)
    return TokenFile(resolve(data), split, vocab_size, seq_len, micro_batch, seed, rank, length)


def make_loader(data: str, vocab_size: int, seq_len: int, micro_batch: int, seed: int, rank: int,
                micro_steps: int, start_micro_step: int = 0, split: str = "train", pin_memory: bool = False,
                num_workers: int = 0, count_skipped: bool = False) -> DataLoader:
    """The DataLoader both paths iterate: already-batched items, in order, no worker processes.

    Batches are tiny (B x s int64) and built in microseconds, so workers would only add IPC; pinning lets the
    host-to-device copy run asynchronously. count_skipped: len() includes the micro-steps before
    `start_micro_step` (Lightning's resumed epoch, see _ResumedPositions); iteration starts at it either way.
    """
    total = start_micro_step + micro_steps
    ds = make_dataset(data, split, vocab_size, seq_len, micro_batch, seed, rank, total)
    sampler = None
    if count_skipped:
        sampler = _ResumedPositions(start_micro_step, total)
    elif start_micro_step:
        ds = _FromStep(ds, start_micro_step)
    # An own generator: iterating a DataLoader otherwise draws its base seed from torch's global RNG.
    return DataLoader(ds, batch_size=None, shuffle=False, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed))


def train_loader(train, rank: int, start_step: int = 0, pin_memory: bool = False, num_workers: int = 0,
                 count_skipped: bool = False) -> DataLoader:
    """The training batches of a TrainConfig for `rank`, from optimizer step `start_step` (resume) to the end."""
    model = train.model()
    return make_loader(train.data, model.vocab_size, model.seq_len, train.micro_batch, train.seed, rank,
                       (train.steps - start_step) * train.grad_accum, start_micro_step=start_step * train.grad_accum,
                       pin_memory=pin_memory, num_workers=num_workers, count_skipped=count_skipped)


def val_loader(train, rank: int, pin_memory: bool = False) -> DataLoader:
    """The same `val_batches` validation batches every time they are asked for."""
    model = train.model()
    return make_loader(train.data, model.vocab_size, model.seq_len, train.micro_batch, train.seed, rank,
                       train.val_batches, split="val", pin_memory=pin_memory)
