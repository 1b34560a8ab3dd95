"""Tokenize local text once into memory-mapped token files for shared/train/data.py.

    python -m shared.tools.prepare_data data/kjv.txt --out data/kjv                      # byte-level (vocab 256)
    python -m shared.tools.prepare_data data/kjv.txt --out data/kjv_bpe --tokenizer bpe  # BPE trained on the text
    python -m shared.tools.prepare_data books/ --out data/books --tokenizer gpt2         # GPT-2 BPE, offline only

Writes PREFIX.train.bin and PREFIX.val.bin (flat uint16 or uint32 token ids) and PREFIX.meta.json (and, for
`bpe`, PREFIX.tokenizer.json), all or none of them: files of an earlier run with the same PREFIX are replaced only
with --force. A folder is read as its *.txt files, each file a document, in an order shuffled
by --seed; the validation split is the last `val_fraction` of the documents (whole documents where there are
several, else the end of the single text), so it never overlaps training text. `bpe` trains a byte-level BPE
with Hugging Face `tokenizers` on the training split only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from shared.train.cli import Parser
from shared.train.distributed import check_output

TOKENIZERS = ("byte", "gpt2", "bpe")
# The fewest tokens worth token files. Every tokenizer here makes at most one token per byte of UTF-8 text (byte: one
# each; gpt2 and bpe: byte-level BPEs, whose tokens are one byte or more), so less text than this many bytes is
# refused before anything is tokenized.
MIN_TOKENS = 1000
NO_TOKENIZERS = ("tokenizer 'bpe' needs Hugging Face's tokenizers package, an optional dependency (it brings "
                 "huggingface_hub): pip install 'zero3-bench[bpe]' or pip install tokenizers")


def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def byte_decode(ids: list[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def gpt2_encoding():
    """tiktoken's GPT-2 BPE, only if its files are already on this machine (nothing is downloaded)."""
    try:
        import tiktoken
    except ImportError as e:
        raise ValueError("tokenizer 'gpt2' needs the tiktoken package (pip install tiktoken)") from e
    try:
        import tiktoken_ext.openai_public  # noqa: F401

        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken raises various errors when offline and uncached
        raise ValueError(
            "tokenizer 'gpt2' is not available offline: tiktoken could not load the GPT-2 BPE files "
            f"({type(e).__name__}: {e}); set TIKTOKEN_CACHE_DIR to a folder holding them, or use --tokenizer byte"
        ) from e


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenization) trained on `texts` with Hugging Face tokenizers."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ValueError(NO_TOKENIZERS + "; or use --tokenizer byte") from e

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def get_tokenizer(name: str, tokenizer_file: str | Path | None = None):
    """(encode, decode, vocab_size) of a tokenizer by name; `bpe` needs its tokenizer file."""
    if name == "byte":
        return byte_encode, byte_decode, 256
    if name == "gpt2":
        enc = gpt2_encoding()
        return (lambda t: enc.encode_ordinary(t)), enc.decode, enc.n_vocab
    if name == "bpe":
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # generating from a model trained on bpe token files, without the package
            raise ValueError(NO_TOKENIZERS) from e
        if tokenizer_file is None or not Path(tokenizer_file).is_file():
            raise ValueError(f"tokenizer 'bpe' needs its tokenizer file, {str(tokenizer_file)!r} not found")
        tok = Tokenizer.from_file(str(tokenizer_file))
        return (lambda t: tok.encode(t).ids), tok.decode, tok.get_vocab_size()
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {TOKENIZERS}")


def read_documents(source: Path) -> list[str]:
    try:
        if source.is_file():
            return [source.read_text(encoding="utf-8", errors="replace")]
        if source.is_dir():
            files = sorted(f for f in source.rglob("*.txt") if f.is_file())  # a folder named x.txt is no document
            if not files:
                raise ValueError(f"folder {str(source)!r} holds no .txt files")
            return [f.read_text(encoding="utf-8", errors="replace") for f in files]
    except OSError as e:  # e.g. a file without read permission
        raise ValueError(f"cannot read {str(e.filename or source)!r}: {e.strerror}") from e
    raise ValueError(f"input {str(source)!r} is neither a file nor a folder")


def check_length(docs: list[str], source: str | Path) -> None:
    """Refuse, before the split, text too short for token files of MIN_TOKENS tokens, saying so (no --val_fraction
    fixes it)."""
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    what = f"input {str(source)!r}" if len(docs) == 1 else f"the {len(docs)} .txt files of {str(source)!r}"
    if n_bytes == 0:
        raise ValueError(f"{what} {'is' if len(docs) == 1 else 'are all'} empty: there is no text to tokenize")
    if n_bytes < MIN_TOKENS:
        raise ValueError(f"{what} {'is' if len(docs) == 1 else 'are'} too short: {n_bytes} bytes of text make at "
                         f"most {n_bytes} tokens, and token files need at least {MIN_TOKENS} (about {MIN_TOKENS} "
                         "bytes of text): add text")


def output_files(out: str | Path, tokenizer: str) -> list[Path]:
    """The files prepare writes for the prefix `out`."""
    return [Path(f"{out}.{suffix}") for suffix in ("train.bin", "val.bin", "meta.json",
                                                   *(["tokenizer.json"] if tokenizer == "bpe" else []))]


def check_outputs(out: str | Path, tokenizer: str, force: bool) -> None:
    """Refuse, before anything is read or tokenized, output files that cannot be written (a folder in their place,
    a folder without write permission) or that exist already, unless `force`."""
    files = output_files(out, tokenizer)
    for f in files:
        check_output("--out", f, f"corpus.{f.name.split('.', 1)[1]}")
    if (existing := [str(f) for f in files if f.exists()]) and not force:
        raise ValueError(f"--out {out}: {', '.join(existing)} exist{'s' if len(existing) == 1 else ''} already; "
                         "pass --force to replace them, or give another --out")


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Whole documents for validation (from the end), or the end of a single text; neither split may be empty."""
    if len(docs) > 1:
        n_val = max(1, round(len(docs) * val_fraction))
        if n_val >= len(docs):
            raise ValueError(f"val_fraction {val_fraction} puts all {len(docs)} documents in the val split, leaving "
                             f"the train split empty: lower --val_fraction (below {(len(docs) - 0.5) / len(docs):.3g}) "
                             "or add documents")
        return docs[:-n_val], docs[-n_val:]
    cut = int(len(docs[0]) * (1 - val_fraction))
    for split, text in (("train", docs[0][:cut]), ("val", docs[0][cut:])):
        if not text:
            raise ValueError(f"val_fraction {val_fraction} leaves the {split} split of the single "
                             f"{len(docs[0])}-character text empty: change --val_fraction")
    return [docs[0][:cut]], [docs[0][cut:]]


def prepare(source: str | Path, out: str | Path, tokenizer: str = "byte", val_fraction: float = 0.05,
            seed: int = 0, bpe_vocab: int = 4096, force: bool = False) -> dict:
    """Tokenize `source` and write the token files (existing ones of the prefix only with `force`); returns the
    metadata written."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {TOKENIZERS}")
    if tokenizer == "bpe" and not 256 < bpe_vocab <= 2**16:
        raise ValueError(f"bpe_vocab must be in (256, 65536], got {bpe_vocab}")
    check_outputs(out, tokenizer, force)
    docs = read_documents(Path(source))
    check_length(docs, source)
    order = np.random.default_rng(seed).permutation(len(docs)) if len(docs) > 1 else [0]
    train_docs, val_docs = split_documents([docs[i] for i in order], val_fraction)
    out = Path(out)
    # Every file is written beside its final name first and all are renamed at the end, so a failed write leaves the
    # earlier files of this prefix as they were.
    files = {f.name.removeprefix(out.name + "."): f for f in output_files(out, tokenizer)}
    staged = {key: f.with_name(f"{f.name}.part{os.getpid()}") for key, f in files.items()}
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            meta = _tokenize_and_write(source, docs, train_docs, val_docs, tokenizer, staged, val_fraction, seed,
                                       bpe_vocab)
            meta["tokenizer_file"] = files["tokenizer.json"].name if tokenizer == "bpe" else None
            staged["meta.json"].write_text(json.dumps(meta, indent=1))
            for key, f in staged.items():
                f.replace(files[key])
        except OSError as e:  # a folder that cannot be written (read-only, full disk) after the check above
            raise ValueError(f"cannot write the token files {out}.*: {e.strerror} ({e.filename or out})") from e
    finally:
        for f in staged.values():
            try:
                f.unlink(missing_ok=True)
            except OSError:  # not ours to remove (e.g. a folder of that name)
                pass
    return meta


def _tokenize_and_write(source, docs: list[str], train_docs: list[str], val_docs: list[str], tokenizer: str,
                        staged: dict[str, Path], val_fraction: float, seed: int, bpe_vocab: int) -> dict:
    """Tokenize both splits into the `staged` token files (and the trained BPE's file); returns the metadata."""
    if tokenizer == "bpe":
        train_bpe(train_docs, bpe_vocab).save(str(staged["tokenizer.json"]))
    encode, _, vocab = get_tokenizer(tokenizer, staged.get("tokenizer.json"))
    train_ids, val_ids = [encode(d) for d in train_docs], [encode(d) for d in val_docs]
    total = sum(len(x) for x in train_ids + val_ids)
    if total < MIN_TOKENS:
        raise ValueError(f"input {str(source)!r} makes only {total} tokens with the {tokenizer} tokenizer; token "
                         f"files need at least {MIN_TOKENS}: add text")
    for split, ids in (("train", train_ids), ("val", val_ids)):
        if not sum(map(len, ids)):  # e.g. only empty documents on one side
            raise ValueError(f"the {split} split of {str(source)!r} has 0 tokens ({len(docs)} documents, "
                             f"val_fraction {val_fraction}): change --val_fraction or add text")
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    counts = {}
    for split, parts in (("train", train_ids), ("val", val_ids)):
        arr = np.concatenate([np.asarray(p, dtype=dtype) for p in parts]) if parts else np.zeros(0, dtype)
        arr.tofile(staged[f"{split}.bin"])
        counts[split] = int(arr.size)
    max_token = max(int(np.max(np.asarray(p))) for p in train_ids + val_ids if len(p))
    return {"tokenizer": tokenizer, "vocab_size": vocab, "dtype": np.dtype(dtype).name, "max_token": max_token,
            "tokens": counts, "documents": len(docs), "source": str(source), "seed": seed}


def main(argv: list[str] | None = None) -> None:
    p = Parser(description=__doc__)  # a refusal is its one line, not the usage block before it
    p.add_argument("source", help="a text file, or a folder of .txt files")
    p.add_argument("--out", required=True, help="output prefix, e.g. data/corpus")
    p.add_argument("--tokenizer", default="byte", choices=TOKENIZERS)
    p.add_argument("--val_fraction", "--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="shuffles the document order before the split")
    p.add_argument("--bpe_vocab", "--bpe-vocab", type=int, default=4096, help="vocabulary of the trained BPE")
    p.add_argument("--force", action="store_true", help="replace the token files of an earlier run with this --out")
    ns = p.parse_args(argv)
    try:
        meta = prepare(ns.source, ns.out, ns.tokenizer, ns.val_fraction, ns.seed, ns.bpe_vocab, ns.force)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {ns.out}.train.bin ({meta['tokens']['train']:,} tokens), {ns.out}.val.bin "
          f"({meta['tokens']['val']:,} tokens), vocab {meta['vocab_size']} ({meta['tokenizer']})")


if __name__ == "__main__":
    main(sys.argv[1:])
