"""Sample text from exported weights (`python -m shared.tools.export` or a run's `--export`).

    python -m shared.tools.generate model.safetensors --prompt "In the beginning" --tokens 200 --temperature 0.8

The tokenizer is the one the training data was made with (read from the data's metadata, recorded in the
export); byte-level when the model was trained on synthetic tokens. Runs on CPU or one GPU, no DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from shared.tools.prepare_data import get_tokenizer
from shared.train.checkpoint import load_exported, read_export_meta


def tokenizer_for(meta: dict):
    data = meta.get("data")
    if data and data != "synthetic" and Path(f"{data}.meta.json").is_file():
        dmeta = json.loads(Path(f"{data}.meta.json").read_text())
        tok_file = Path(data).parent / dmeta["tokenizer_file"] if dmeta.get("tokenizer_file") else None
        return get_tokenizer(dmeta["tokenizer"], tok_file)
    return get_tokenizer("byte")


@torch.no_grad()
def generate(model, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Autoregressive sampling; the context is cropped to the model's seq_len."""
    for _ in range(new_tokens):
        logits = model(idx[:, -model.cfg.seq_len:])[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
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
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", "--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ns = p.parse_args(argv)
    if ns.tokens <= 0 or ns.temperature < 0:
        p.error("--tokens must be positive and --temperature >= 0")
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
        encode, decode, vocab = tokenizer_for(meta)
    except ValueError as e:
        p.error(str(e))
    if vocab > model.cfg.vocab_size:
        p.error(f"the tokenizer has {vocab} tokens but the model only {model.cfg.vocab_size}")
    model.to(ns.device)
    ids = encode(ns.prompt) or [0]
    idx = torch.tensor([ids], dtype=torch.long, device=ns.device)
    g = torch.Generator(device=ns.device).manual_seed(ns.seed)
    out = generate(model, idx, ns.tokens, ns.temperature, ns.top_k, g)
    text = decode(out[0].tolist())
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
