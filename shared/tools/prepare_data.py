"""Tokenize local text once into memory-mapped token files for shared/train/data.py.

    python -m shared.tools.prepare_data data/kjv.txt --out data/kjv                      # byte-level (vocab 256)
    python -m shared.tools.prepare_data data/kjv.txt --out data/kjv_bpe --tokenizer bpe  # BPE trained on the text
    python -m shared.tools.prepare_data books/ --out data/books --tokenizer gpt2         # GPT-2 BPE, offline only

Writes PREFIX.train.bin and PREFIX.val.bin (flat uint16 or uint32 token ids) and PREFIX.meta.json (and, for
`bpe`, PREFIX.tokenizer.json). A folder is read as its *.txt files, each file a document, in an order shuffled
by --seed; the validation split is the last `val_fraction` of the documents (whole documents where there are
several, else the end of the single text), so it never overlaps training text. `bpe` trains a byte-level BPE
with Hugging Face `tokenizers` on the training split only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

TOKENIZERS = ("byte", "gpt2", "bpe")
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
    if source.is_file():
        return [source.read_text(encoding="utf-8", errors="replace")]
    if source.is_dir():
        files = sorted(f for f in source.rglob("*.txt") if f.is_file())  # a folder named x.txt is no document
        if not files:
            raise ValueError(f"folder {str(source)!r} holds no .txt files")
        return [f.read_text(encoding="utf-8", errors="replace") for f in files]
    raise ValueError(f"input {str(source)!r} is neither a file nor a folder")


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
            seed: int = 0, bpe_vocab: int = 4096) -> dict:
    """Tokenize `source` and write the token files; returns the metadata written."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {TOKENIZERS}")
    docs = read_documents(Path(source))
    order = np.random.default_rng(seed).permutation(len(docs)) if len(docs) > 1 else [0]
    train_docs, val_docs = split_documents([docs[i] for i in order], val_fraction)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_file = None
    if tokenizer == "bpe":
        if not 256 < bpe_vocab <= 2**16:
            raise ValueError(f"bpe_vocab must be in (256, 65536], got {bpe_vocab}")
        tokenizer_file = Path(f"{out}.tokenizer.json")
        train_bpe(train_docs, bpe_vocab).save(str(tokenizer_file))
    encode, _, vocab = get_tokenizer(tokenizer, tokenizer_file)
    train_ids, val_ids = [encode(d) for d in train_docs], [encode(d) for d in val_docs]
    total = sum(len(x) for x in train_ids + val_ids)
    if total < 1000:
        raise ValueError(f"input {str(source)!r} has only {total} tokens; need at least 1000")
    for split, ids in (("train", train_ids), ("val", val_ids)):
        if not sum(map(len, ids)):  # e.g. only empty documents on one side
            raise ValueError(f"the {split} split of {str(source)!r} has 0 tokens ({len(docs)} documents, "
                             f"val_fraction {val_fraction}): change --val_fraction or add text")
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    counts = {}
    for split, parts in (("train", train_ids), ("val", val_ids)):
        arr = np.concatenate([np.asarray(p, dtype=dtype) for p in parts]) if parts else np.zeros(0, dtype)
        arr.tofile(f"{out}.{split}.bin")
        counts[split] = int(arr.size)
    max_token = max(int(np.max(np.asarray(p))) for p in train_ids + val_ids if len(p))
    meta = {"tokenizer": tokenizer, "vocab_size": vocab, "dtype": np.dtype(dtype).name, "max_token": max_token,
            "tokens": counts, "documents": len(docs), "source": str(source), "seed": seed,
            "tokenizer_file": tokenizer_file.name if tokenizer_file else None}
    Path(f"{out}.meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a text file, or a folder of .txt files")
    p.add_argument("--out", required=True, help="output prefix, e.g. data/corpus")
    p.add_argument("--tokenizer", default="byte", choices=TOKENIZERS)
    p.add_argument("--val_fraction", "--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="shuffles the document order before the split")
    p.add_argument("--bpe_vocab", "--bpe-vocab", type=int, default=4096, help="vocabulary of the trained BPE")
    ns = p.parse_args(argv)
    try:
        meta = prepare(ns.source, ns.out, ns.tokenizer, ns.val_fraction, ns.seed, ns.bpe_vocab)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {ns.out}.train.bin ({meta['tokens']['train']:,} tokens), {ns.out}.val.bin "
          f"({meta['tokens']['val']:,} tokens), vocab {meta['vocab_size']} ({meta['tokenizer']})")


if __name__ == "__main__":
    main(sys.argv[1:])
