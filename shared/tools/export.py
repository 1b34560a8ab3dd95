"""Consolidate a DeepSpeed ZeRO checkpoint (either path's) into one fp32 .safetensors file.

    python -m shared.tools.export ckpt/step00000200 --out model.safetensors
    python -m shared.tools.generate model.safetensors --prompt "In the beginning"

Uses DeepSpeed's own zero_to_fp32 (the fp32 master weights from the optimizer shards, so the result is exact
whatever the training precision). Works for either path's stepNNNNNNNN folders (LAYOUTS says how each lays its
checkpoint out). ZeRO stages 1-3.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from shared.train import checkpoint
from shared.train.cli import Parser
from shared.train.distributed import check_output


@dataclass(frozen=True)
class Layout:
    """Where a path's DeepSpeed checkpoint lies in a stepNNNNNNNN folder, and how its parameters are named."""

    in_subfolder: str | None
    """None: DeepSpeed's tag is the step folder itself (CKPT_DIR/<tag>/...); else the subfolder that is the tag"""
    prefix: str
    """what the path's training module puts before the GPT's own parameter names"""


# The one place that knows each path's checkpoint layout: the raw loop saves engine.save_checkpoint(CKPT_DIR,
# tag=stepN); Lightning's DeepSpeedStrategy saves into stepN/checkpoint/ (tag "checkpoint"), and its
# LightningModule (lightning_app/module.py) holds the GPT as `gpt`.
LAYOUTS = {"deepspeed": Layout(in_subfolder=None, prefix=""),
           "lightning": Layout(in_subfolder="checkpoint", prefix="gpt.")}


def layout_of(folder: Path) -> Layout:
    """The layout of a complete step folder: the path its completion marker names, else what lies in it (markers
    written before they named the path)."""
    written_by = (checkpoint.read_marker(folder) or {}).get("path")
    if written_by in LAYOUTS:
        return LAYOUTS[written_by]
    return LAYOUTS["lightning"] if (folder / "checkpoint").is_dir() else LAYOUTS["deepspeed"]


def export(folder: str | Path, out: str | Path, trust: bool = False, force: bool = False) -> Path:
    """Write the fp32 weights of the checkpoint `folder` to `out`; an existing `out` is replaced only with `force`
    (the file is written whole, then renamed over it)."""
    if str(folder) in ("none", "auto") and not Path(folder).exists():
        raise ValueError(f"export takes a stepNNNNNNNN checkpoint folder (e.g. ckpt/step00000200), not "
                         f"{str(folder)!r}: --resume's keywords do not apply here")
    # refused before the checkpoint is read and consolidated
    check_output("--out", out, "model.safetensors")
    if Path(out).exists() and not force:
        raise ValueError(f"--out {out} exists already; pass --force to replace it, or give another --out")
    folder = checkpoint.step_folder(str(folder))  # a complete step folder whose checksums match
    checkpoint.check_safe_to_load(folder, trust)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    layout = layout_of(folder)
    ds_dir, tag = (folder, layout.in_subfolder) if layout.in_subfolder else (folder.parent, folder.name)
    client = checkpoint.client_state_of(folder)
    if "model_config" not in client:
        raise ValueError(f"{str(folder)!r} was not written by this project (no model_config in its client state)")
    state = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=tag)
    state = {k.removeprefix(layout.prefix): v for k, v in state.items()}
    return checkpoint.save_exported(out, state, client["model_config"],
                                    {"data": client.get("data"), "step": client.get("step", client.get("global_step"))})


def main(argv: list[str] | None = None) -> None:
    p = Parser(description=__doc__)  # a refusal is its one line, not the usage block before it
    p.add_argument("checkpoint", help="a stepNNNNNNNN checkpoint folder")
    p.add_argument("--out", required=True, help="the .safetensors file to write (not an existing one: see --force)")
    p.add_argument("--trust_checkpoint", "--trust-checkpoint", action="store_true",
                   help="allow files that weights_only=True cannot open (DeepSpeed unpickles them)")
    p.add_argument("--force", action="store_true", help="replace the file --out if it exists")
    ns = p.parse_args(argv)
    try:
        path = export(ns.checkpoint, ns.out, ns.trust_checkpoint, ns.force)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
