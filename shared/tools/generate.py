"""Sample text from exported weights (`python -m shared.tools.export` or a run's `--export`).

    python -m shared.tools.generate model.safetensors --prompt "In the beginning" --tokens 200 --temperature 0.8

The tokenizer is the one the training data was made with, read from PREFIX.meta.json of the data prefix the
export records (relative to the folder the model was trained in; `--data PREFIX` points elsewhere); byte-level
when the model was trained on synthetic tokens. `--temperature 0` is greedy, `--top_k 0` samples from the whole
vocabulary. Runs on CPU or one GPU, no DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from shared.tools.prepare_data import get_tokenizer
from shared.train.checkpoint import load_exported, read_export_meta


def tokenizer_for(meta: dict, data: str | None = None):
    """(encode, decode, vocab_size) of the model's training data: `data`, else the prefix the export records.
    Byte-level only for synthetic tokens (or an export that records no data); a missing PREFIX.meta.json is an
    error, not bytes, since decoding BPE ids as bytes prints garbage."""
    data = data or meta.get("data")
    if data in (None, "synthetic", "kjv"):  # kjv: the shipped text as bytes (shared/train/data.resolve)
        return get_tokenizer("byte")
    meta_path = Path(f"{data}.meta.json")
    if not meta_path.is_file():
        raise ValueError(f"the model was trained on data {data!r} but {str(meta_path.absolute())!r} is not "
                         "found, so its tokenizer is unknown: run from the folder the model was trained "
                         "in, or pass --data PREFIX (the --out given to shared.tools.prepare_data)")
    dmeta = json.loads(meta_path.read_text())
    tok_file = Path(data).parent / dmeta["tokenizer_file"] if dmeta.get("tokenizer_file") else None
    return get_tokenizer(dmeta["tokenizer"], tok_file)


@torch.no_grad()
def generate(model, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Autoregressive sampling; the context is cropped to the model's seq_len."""
    for _ in range(new_tokens):
        logits = model(idx[:, -model.cfg.seq_len:])[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            # shifted to max 0 first: a tiny temperature then gives -inf (probability 0), not inf - inf = nan
            logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("weights", help="a .safetensors file written by the export")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--tokens", type=int, default=200, help="how many tokens to sample (>= 1)")
    p.add_argument("--temperature", type=float, default=0.8, help="finite, >= 0; 0: greedy")
    p.add_argument("--top_k", "--top-k", type=int, default=50, help="sample from the k likeliest tokens; 0: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", help="the training data's prefix (PREFIX.meta.json names the tokenizer), overriding "
                                  "the one recorded in the export")
    ns = p.parse_args(argv)
    if ns.tokens < 1:
        p.error(f"--tokens must be >= 1, got {ns.tokens}")
    if not (math.isfinite(ns.temperature) and ns.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0 (0: greedy), got {ns.temperature}")
    if ns.top_k < 0:
        p.error(f"--top_k must be >= 1, or 0 for no top-k cut, got {ns.top_k}")
    if not -2**63 <= ns.seed < 2**64:
        p.error(f"--seed must fit in 64 bits, got {ns.seed}")
    try:
        device = torch.device(ns.device)
    except RuntimeError as e:
        p.error(f"--device {ns.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {ns.device}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    try:
        # Dense causal models run with sdpa; sparse layouts with the reference (any length, any device).
        layout = read_export_meta(ns.weights)["model_config"]["layout"]
        model, meta = load_exported(ns.weights, attention="sdpa" if layout in ("causal", "dense") else "reference")
        encode, decode, vocab = tokenizer_for(meta, ns.data)
    except ValueError as e:
        p.error(str(e))
    if not ns.data and meta.get("data") is None:
        print("note: the export records no training data; decoding as bytes (pass --data PREFIX if the model was "
              "trained on token files)", file=sys.stderr)
    if vocab > model.cfg.vocab_size:
        p.error(f"the tokenizer has {vocab} tokens but the model only {model.cfg.vocab_size}")
    ids = encode(ns.prompt)
    if not ids:  # no token to condition on: refused rather than replaced by token 0 (a NUL byte, or GPT-2's "!")
        p.error(f"--prompt {ns.prompt!r} encodes to no tokens: give at least one character (the default is a newline)")
    model.to(ns.device)
    idx = torch.tensor([ids], dtype=torch.long, device=ns.device)
    g = torch.Generator(device=ns.device).manual_seed(ns.seed)
    out = generate(model, idx, ns.tokens, ns.temperature, ns.top_k, g)
    text = decode(out[0].tolist())
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
