"""Checkpoint bookkeeping both paths share: naming, completion markers, pruning, RNG state, safe loading.

A checkpoint is a folder `CKPT_DIR/stepNNNNNNNN/` holding DeepSpeed's sharded files (written by the path's
engine), one `rng_rankR.pt` per rank, and, written last by rank 0 once every rank has finished, `COMPLETE.json`
with the step, the path that wrote it, the model's config, and the size and BLAKE2b checksum of every file. A
folder without that marker, or whose files no longer match it (a save cut short, a copy cut short, a disk that
filled up, flipped bytes), is never resumed from. Listing and pruning compare sizes only (cheap); the checkpoint a
run is about to resume from is checksummed in full first (BLAKE2b, files in parallel threads: hashlib releases
the GIL), which costs a read of the checkpoint at save and at resume, against a run that would otherwise train on
corrupt optimizer state until it went NaN.

DeepSpeed loads its own files with torch.load(weights_only=False), i.e. by unpickling arbitrary objects. Before
handing a checkpoint to DeepSpeed we open every .pt file with weights_only=True (tensors, containers and a short
list of DeepSpeed/torch types): a file that needs anything else is refused unless the user opts in with
--trust_checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MARKER = "COMPLETE.json"
_TAG = re.compile(r"^step(\d{8})$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _digests(paths: list[Path]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_digest, paths))


def write_marker(folder: Path, step: int, extra: dict | None = None) -> None:
    """Rank 0, after a barrier: record every file of a finished checkpoint (size, checksum); written atomically,
    last."""
    paths = _files(folder)
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "blake2b": d}
             for p, d in zip(paths, _digests(paths))}
    from shared.train.results import replace_text  # the model's imports come with it: only when a save is made

    replace_text(folder / MARKER, json.dumps({"step": step, "files": files, **(extra or {})}, indent=1))


def read_marker(folder: Path) -> dict | None:
    """The completion marker of `folder`, or None when it is missing or unreadable."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None


def problem(folder: Path, checksums: bool = False) -> str | None:
    """Why `folder` is not a complete checkpoint, or None. Sizes always; every file's checksum with `checksums`."""
    marker = read_marker(folder)
    if marker is None:
        return f"no readable {MARKER} (a save that never finished)"
    files = marker["files"]
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"]:
            return f"{name} has {path.stat().st_size} bytes where {meta['bytes']} were written (cut short?)"
    if checksums:
        names = [n for n, meta in files.items() if "blake2b" in meta]  # markers before checksums: sizes only
        for name, digest in zip(names, _digests([folder / n for n in names])):
            if digest != files[name]["blake2b"]:
                return f"{name} does not match the checksum recorded at save (corrupted)"
    return None


def is_complete(folder: Path) -> bool:
    """The marker exists and every file it lists is there with its recorded size (sizes only: cheap)."""
    return problem(folder) is None


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path, bool]]:
    """(step, folder, complete) for every stepNNNNNNNN folder, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _TAG.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p, is_complete(p)))
    return sorted(out)


def latest_complete(ckpt_dir: str | Path) -> Path | None:
    complete = [p for _, p, ok in list_checkpoints(ckpt_dir) if ok]
    return complete[-1] if complete else None


def _say(text: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(text, file=sys.stderr, flush=True)


def resolve_resume(resume: str, ckpt_dir: str | None) -> Path | None:
    """`none` -> None; `auto` -> the newest complete checkpoint in ckpt_dir whose checksums match (None if there is
    none yet; each newer one skipped is named, with the reason); a path -> that checkpoint folder, which must be
    complete and match its checksums."""
    if resume == "none":
        return None
    if resume == "auto":
        if not ckpt_dir:
            raise ValueError("--resume auto needs --ckpt_dir")
        if Path(ckpt_dir).is_dir() and not list_checkpoints(ckpt_dir) and (Path(ckpt_dir) / MARKER).is_file():
            raise ValueError(f"--ckpt_dir {ckpt_dir!r} is itself a checkpoint (it holds {MARKER}); pass the folder "
                             f"that holds the stepNNNNNNNN folders, or --resume {ckpt_dir}")
        skipped = []
        for _, folder, _ok in reversed(list_checkpoints(ckpt_dir)):
            why = problem(folder, checksums=True)
            if why is None:
                for other, reason in skipped:
                    _say(f"[resume] skipped {other}: {reason}; resuming from {folder}")
                return folder
            skipped.append((folder, why))
        for other, reason in skipped:
            _say(f"[resume] skipped {other}: {reason}; no complete checkpoint left, starting from step 0")
        return None
    return step_folder(resume)


def step_folder(path: str) -> Path:
    """The checkpoint folder `path` names: one stepNNNNNNNN folder (not the folder that holds them), complete and
    matching its checksums."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint {path!r} does not exist")
    if not (folder / MARKER).is_file() and list_checkpoints(folder):
        steps = ", ".join(p.name for _, p, _ in list_checkpoints(folder))
        raise ValueError(f"checkpoint {path!r} is not a step folder but holds step folders ({steps}): pass one "
                         "of them")
    why = problem(folder, checksums=True)
    if why is not None:
        raise ValueError(f"checkpoint {path!r} is incomplete or corrupt: {why}")
    return folder


def check_ckpt_dir(train, resume_from: Path | None) -> None:
    """Refuse, before training, a --ckpt_dir holding finished checkpoints that this run would overwrite, or delete
    as it prunes to --keep_last: with --resume none any; resuming from step N of that folder any after N (any at
    all, resuming from another folder). Not with --resume auto: every folder after the one it resumes from failed
    its check and was named as skipped. A folder without a marker is a save that never finished, not a checkpoint.
    Any --resume: a --ckpt_dir that cannot be written (a file in its place or in its path, a folder not writable),
    which DeepSpeed would find only at the first save, after training."""
    if not train.ckpt_dir:
        return
    root = Path(train.ckpt_dir)
    existing = next((a for a in [root, *root.parents] if a.exists()), Path("."))
    if not existing.is_dir():
        raise ValueError(f"--ckpt_dir {train.ckpt_dir!r}: {str(existing)!r} is a file, not a folder to save in")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--ckpt_dir {train.ckpt_dir!r}: the folder {str(existing)!r} is not writable")
    if train.resume == "auto":
        return
    start = (read_marker(resume_from) or {}).get("step", 0) if resume_from is not None else 0
    same = resume_from is not None and resume_from.resolve().parent == Path(train.ckpt_dir).resolve()
    taken = [s for s, p, _ in list_checkpoints(train.ckpt_dir) if (p / MARKER).is_file() and (s > start or not same)]
    if not taken:
        return
    steps = ", ".join(map(str, taken))
    if resume_from is None:
        run = "this run (--resume none) starts from step 0 and"
    elif same:
        run = f"this run resumes from step {start} ({str(resume_from)!r}) and"
    else:
        run = f"this run resumes from {str(resume_from)!r}, another folder, and"
    raise ValueError(f"--ckpt_dir {train.ckpt_dir!r} already holds checkpoints at steps {steps}: {run} would "
                     f"overwrite them or delete them as it keeps the last {train.keep_last}; choose another "
                     "--ckpt_dir, continue from its newest checkpoint with --resume auto, or move those step "
                     "folders away")


# The GPTConfig fields that decide parameter shapes: a checkpoint resumes only into the same ones. A field that
# an older checkpoint did not record reads as its default (SHAPE_DEFAULTS).
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "vocab_multiple", "bias")
SHAPE_DEFAULTS = {"vocab_multiple": 1}
SCRIPTS = {"deepspeed": "plain_deepspeed/train.py", "lightning": "lightning_app/train.py"}
LAUNCH = {"deepspeed": "torchrun --nproc_per_node {n} plain_deepspeed/train.py",
          "lightning": "lightning_app/train.py --devices {n}"}


def check_resumable(folder: Path, path: str, model_config: dict, world: int | None = None) -> None:
    """Refuse, before DeepSpeed loads anything, a checkpoint of the other path, of another number of processes
    (`world`: ZeRO shards are per process, and DeepSpeed fails on a mismatch with a traceback) or of another model
    shape."""
    marker = read_marker(folder) or {}
    written_by = marker.get("path")
    if written_by is not None and written_by != path:
        raise ValueError(f"checkpoint {str(folder)!r} was written by the {written_by} path ({SCRIPTS[written_by]}), "
                         f"whose checkpoint layout this {path} path ({SCRIPTS[path]}) cannot load; resume it with "
                         f"{SCRIPTS[written_by]}, or use another --ckpt_dir")
    saved_world = len(list(folder.glob("rng_rank*.pt")))  # one per process (commit)
    if world is not None and saved_world and saved_world != world:
        procs = f"{saved_world} process" + ("es" if saved_world > 1 else "")
        raise ValueError(f"checkpoint {str(folder)!r} was saved by {procs}, this run has {world}: ZeRO's shards are "
                         f"per process; resume with {procs} (`{LAUNCH[path].format(n=saved_world)}` on one node)")
    saved = marker.get("model_config")
    if saved is None:  # a marker written before model configs were recorded: the model-states file has it
        state = client_state_of(folder)
        saved = state.get("model_config")
    if saved is None:
        return
    saved = {**SHAPE_DEFAULTS, **saved}
    diff = {k: (saved.get(k), model_config.get(k)) for k in SHAPE_FIELDS if saved.get(k) != model_config.get(k)}
    if diff:
        shown = ", ".join(f"{k} {a} in the checkpoint vs {b} now" for k, (a, b) in diff.items())
        raise ValueError(f"checkpoint {str(folder)!r} holds another model shape ({shown}); resume with the flags "
                         "it was trained with (same --preset and overrides), or start a fresh --ckpt_dir")


def prune(ckpt_dir: str | Path, keep_last: int, step: int | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and incomplete ones older than the newest
    complete one (leftovers of an interrupted save). With `step` (the checkpoint just committed) only folders before
    it are candidates: it, and any after it, are kept. Returns what was deleted."""
    entries = [e for e in list_checkpoints(ckpt_dir) if step is None or e[0] <= step]
    complete = [(s, p) for s, p, ok in entries if ok]
    newest = complete[-1][0] if complete else None
    doomed = complete[:-keep_last] if keep_last > 0 else []
    doomed += [(s, p) for s, p, ok in entries if not ok and newest is not None and s < newest]
    doomed = [p for s, p in sorted(doomed) if s != step]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def due(train, step: int) -> bool:
    """Whether a path saves after optimizer step `step`: every save_every steps and at the last one."""
    return bool(train.ckpt_dir) and ((train.save_every and step % train.save_every == 0) or step == train.steps)


def commit(folder: Path, step: int, rank: int, train, path: str, barrier) -> None:
    """After the engine wrote its shards into `folder` (on every rank): each rank's RNG state, then, once all
    ranks are done, rank 0 writes the completion marker last and prunes old checkpoints."""
    save_rng(folder, rank)
    barrier()
    if rank == 0:
        write_marker(folder, step, {"path": path, "model_config": dataclasses.asdict(train.model()),
                                    "schedule": schedule_of(train)})
        pruned = prune(train.ckpt_dir, train.keep_last, step)
        deleted = f"; deleted {', '.join(p.name for p in pruned)} (--keep_last {train.keep_last})" if pruned else ""
        print(f"[{path}] saved checkpoint {folder}{deleted}", flush=True)
    barrier()


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_rng(folder: Path, rank: int) -> None:
    torch.save(rng_state(), folder / f"rng_rank{rank}.pt")


def load_rng(folder: Path, rank: int) -> None:
    path = folder / f"rng_rank{rank}.pt"
    if not path.is_file():
        raise ValueError(f"checkpoint {str(folder)!r} has no RNG state for rank {rank} "
                         "(saved with another world size?)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _safe_globals() -> list:
    """Types DeepSpeed 0.19 puts in its checkpoint files besides tensors and containers."""
    import argparse
    import collections

    allowed: list = [argparse.Namespace, collections.OrderedDict, collections.defaultdict, set, frozenset]
    try:  # imported lazily: shared/ does not depend on DeepSpeed, only recognises its plain data types
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:
        pass
    return allowed


def check_safe_to_load(folder: Path, trust: bool) -> None:
    """Refuse a checkpoint whose .pt files need more than weights_only=True allows, unless `trust`."""
    if trust:
        return
    for path in sorted(folder.rglob("*.pt")):
        try:
            with torch.serialization.safe_globals(_safe_globals()):
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises UnpicklingError (or others) for disallowed content
            raise ValueError(
                f"checkpoint file {str(path)!r} cannot be opened with weights_only=True ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}); DeepSpeed would unpickle it. Pass --trust_checkpoint if you "
                "trust its origin"
            ) from e


# ---------------------------------------------------------------------------------------------------------------
# Consolidated weights: one fp32 .safetensors file a plain (non-DeepSpeed) GPT loads for evaluation or generation.
# ---------------------------------------------------------------------------------------------------------------

TIED = ("head.weight",)  # the LM head is the token embedding (shared/model.py): stored once, as wte.weight


def save_exported(path: str | Path, state_dict: dict, model_config: dict, meta: dict | None = None) -> Path:
    """Write fp32 weights and the GPTConfig (as metadata) to a .safetensors file, atomically.

    A padded vocabulary (GPTConfig.vocab_multiple) is cut back to its vocab_size real rows: the file holds the
    model's function, not its training layout, and loads as vocab_multiple 1."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state_dict.items() if k not in TIED}
    vocab = model_config["vocab_size"]
    if tensors["wte.weight"].shape[0] != vocab:
        tensors["wte.weight"] = tensors["wte.weight"][:vocab].contiguous()
    model_config = {**model_config, "vocab_multiple": 1}
    metadata = {"model_config": json.dumps(model_config), **{k: json.dumps(v) for k, v in (meta or {}).items()}}
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def read_export_meta(path: str | Path) -> dict:
    """The metadata of an exported file (model_config, data, step), without loading the tensors."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"exported weights {str(path)!r} do not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
    except Exception as e:  # safetensors raises its own SafetensorError (header too large, incomplete, not JSON)
        raise ValueError(f"{str(path)!r} is not a readable .safetensors file (truncated, or another format): "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
    if "model_config" not in meta:
        raise ValueError(f"{str(path)!r} has no model_config metadata: not written by this project's export")
    return meta


def load_exported(path: str | Path, attention: str | None = None):
    """(GPT in eval mode with the exported weights, metadata dict). `attention` overrides the saved backend
    (generation on a CPU uses `reference` for sparse layouts, `sdpa` for causal ones).

    The training run's fused paths and compilation are dropped: they compute the same function with the same
    parameters, and generation's growing sequence lengths (and a CPU) suit the plain model."""
    from safetensors.torch import load_file

    from shared.model.config import FUSED_FLAGS, GPTConfig
    from shared.model.gpt import GPT

    meta = read_export_meta(path)
    fields = {f.name for f in dataclasses.fields(GPTConfig)}  # older exports also recorded the compile mode
    cfg_dict = {**{k: v for k, v in meta["model_config"].items() if k in fields}, **dict.fromkeys(FUSED_FLAGS, False)}
    if attention is not None:
        cfg_dict = {**cfg_dict, "attention": attention}
    model = GPT(GPTConfig(**cfg_dict))
    try:
        state = load_file(str(path))
    except Exception as e:  # a header that reads but tensors cut short
        raise ValueError(f"{str(path)!r} is not a readable .safetensors file (truncated?): {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}") from e
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in TIED]
    if missing or unexpected:
        raise ValueError(f"{str(path)!r} does not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval(), meta


SCHEDULE_FIELDS = ("steps", "lr", "min_lr", "lr_warmup_steps")  # what the learning-rate schedule is planned from


def schedule_of(train) -> dict:
    return {name: getattr(train, name) for name in SCHEDULE_FIELDS}


def warn_schedule_change(folder: Path, step: int, train) -> None:
    """Warn when a run resumed from `folder` (saved at `step`) plans its learning-rate schedule otherwise than the run
    that saved it (e.g. a larger --steps stretches the cosine decay): the rate then jumps at the resume."""
    from shared.train.optim import lr_at

    saved = (read_marker(folder) or {}).get("schedule")
    if not saved or saved == schedule_of(train):
        return
    changed = ", ".join(f"--{k} {saved[k]} -> {getattr(train, k)}" for k in SCHEDULE_FIELDS
                        if saved.get(k) != getattr(train, k))
    before = lr_at(step, dataclasses.replace(train, **{k: saved[k] for k in SCHEDULE_FIELDS if k in saved}))
    warnings.warn(f"resuming {folder} with another learning-rate schedule ({changed}): step {step} runs at lr "
                  f"{lr_at(step, train):.3g} where the saved run would have used {before:.3g}", stacklevel=2)


def check_steps_left(folder: Path, step: int, steps: int) -> None:
    """Refuse to resume from `folder`, saved at `step`, a run of `steps` steps that it has already finished."""
    if step >= steps:
        raise ValueError(f"checkpoint {folder} is at step {step}: a run of --steps {steps} has none left to train "
                         f"(it finished there); raise --steps to train on from it, or start afresh with --resume none "
                         "and another --ckpt_dir")


def client_state_of(folder: Path) -> dict:
    """The non-tensor state a path stored in its checkpoint (step, model config, data), read with weights_only."""
    candidates = sorted(folder.rglob("*mp_rank_00_model_states.pt"))
    if not candidates:
        raise ValueError(f"{str(folder)!r} holds no DeepSpeed model-states file")
    with torch.serialization.safe_globals(_safe_globals()):
        state = torch.load(candidates[0], map_location="cpu", weights_only=True)
    return state


def export_live(model, model_config: dict, path: str | Path, meta: dict, rank: int, zero3: bool) -> None:
    """Gather the live weights (ZeRO-3 partitions them across ranks) and write them as fp32 on rank 0.

    Collective under ZeRO-3: every rank must call it. DeepSpeed is imported lazily, only here, only when asked.
    """
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=zero3):
        if rank == 0:
            state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
            save_exported(path, state, model_config, meta)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
