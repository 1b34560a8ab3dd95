"""Tokenize local text once into memory-mapped token files for shared/data.py.

    python -m shared.prepare_data data/corpus.txt --out data/corpus               # byte-level (vocab 256)
    python -m shared.prepare_data books/ --out data/books --tokenizer gpt2         # GPT-2 BPE, if available offline

Writes PREFIX.train.bin and PREFIX.val.bin (flat uint16 or uint32 token ids) and PREFIX.meta.json. A folder is
read as its *.txt files in sorted order, each file a document; the validation split is the last `val_fraction`
of the documents' tokens (whole documents where there are several), so it never overlaps training text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

TOKENIZERS = ("byte", "gpt2")


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


def get_tokenizer(name: str):
    """(encode, decode, vocab_size) of a tokenizer by name."""
    if name == "byte":
        return byte_encode, byte_decode, 256
    if name == "gpt2":
        enc = gpt2_encoding()
        return (lambda t: enc.encode_ordinary(t)), enc.decode, enc.n_vocab
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {TOKENIZERS}")


def read_documents(source: Path) -> list[str]:
    if source.is_file():
        return [source.read_text(encoding="utf-8", errors="replace")]
    if source.is_dir():
        files = sorted(source.rglob("*.txt"))
        if not files:
            raise ValueError(f"folder {str(source)!r} holds no .txt files")
        return [f.read_text(encoding="utf-8", errors="replace") for f in files]
    raise ValueError(f"input {str(source)!r} is neither a file nor a folder")


def prepare(source: str | Path, out: str | Path, tokenizer: str = "byte", val_fraction: float = 0.05) -> dict:
    """Tokenize `source` and write the token files; returns the metadata written."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    encode, _, vocab = get_tokenizer(tokenizer)
    docs = read_documents(Path(source))
    ids = [encode(d) for d in docs]
    total = sum(len(x) for x in ids)
    if total < 1000:
        raise ValueError(f"input {str(source)!r} has only {total} tokens; need at least 1000")
    if len(ids) > 1:  # whole documents for validation, from the end
        n_val_docs = max(1, round(len(ids) * val_fraction))
        train_ids, val_ids = ids[:-n_val_docs], ids[-n_val_docs:]
    else:
        cut = int(total * (1 - val_fraction))
        train_ids, val_ids = [ids[0][:cut]], [ids[0][cut:]]
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, parts in (("train", train_ids), ("val", val_ids)):
        arr = np.concatenate([np.asarray(p, dtype=dtype) for p in parts]) if parts else np.zeros(0, dtype)
        arr.tofile(f"{out}.{split}.bin")
        counts[split] = int(arr.size)
    meta = {"tokenizer": tokenizer, "vocab_size": vocab, "dtype": np.dtype(dtype).name,
            "tokens": counts, "documents": len(docs), "source": str(source)}
    Path(f"{out}.meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a text file, or a folder of .txt files")
    p.add_argument("--out", required=True, help="output prefix, e.g. data/corpus")
    p.add_argument("--tokenizer", default="byte", choices=TOKENIZERS)
    p.add_argument("--val_fraction", "--val-fraction", type=float, default=0.05)
    ns = p.parse_args(argv)
    try:
        meta = prepare(ns.source, ns.out, ns.tokenizer, ns.val_fraction)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {ns.out}.train.bin ({meta['tokens']['train']:,} tokens), {ns.out}.val.bin "
          f"({meta['tokens']['val']:,} tokens), vocab {meta['vocab_size']} ({meta['tokenizer']})")


if __name__ == "__main__":
    main(sys.argv[1:])
