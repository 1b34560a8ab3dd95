"""Consolidate a DeepSpeed ZeRO checkpoint (either path's) into one fp32 .safetensors file.

    python -m plain_deepspeed.export ckpt/step00000200 --out model.safetensors
    python -m shared.generate model.safetensors --prompt "In the beginning"

Uses DeepSpeed's own zero_to_fp32 (the fp32 master weights from the optimizer shards, so the result is exact
whatever the training precision). Works for the raw loop's `CKPT_DIR/stepN/` folders and for the Lightning
path's (`stepN/checkpoint/`, Lightning's DeepSpeed layout). ZeRO stages 1-3.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared import checkpoint


def export(folder: str | Path, out: str | Path, trust: bool = False) -> Path:
    folder = checkpoint.resolve_resume(str(folder), None)  # a complete step folder whose checksums match
    checkpoint.check_safe_to_load(folder, trust)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # The raw loop saves CKPT_DIR/<tag>/...; Lightning saves <folder>/checkpoint/... (tag "checkpoint").
    ds_dir, tag = (folder, "checkpoint") if (folder / "checkpoint").is_dir() else (folder.parent, folder.name)
    client = checkpoint.client_state_of(folder)
    if "model_config" not in client:
        raise ValueError(f"{str(folder)!r} was not written by this project (no model_config in its client state)")
    state = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=tag)
    state = {k.removeprefix("gpt."): v for k, v in state.items()}  # Lightning's module holds the GPT as `gpt`
    return checkpoint.save_exported(out, state, client["model_config"],
                                    {"data": client.get("data"), "step": client.get("step", client.get("global_step"))})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a stepNNNNNNNN checkpoint folder")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--trust_checkpoint", "--trust-checkpoint", action="store_true",
                   help="allow files that weights_only=True cannot open (DeepSpeed unpickles them)")
    ns = p.parse_args(argv)
    try:
        path = export(ns.checkpoint, ns.out, ns.trust_checkpoint)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
