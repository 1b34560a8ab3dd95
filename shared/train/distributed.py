"""Process-level set-up shared by both paths: environment defaults, device, seeds, clean exit."""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_env() -> None:
    """Let a plain `python train.py` run as a one-process world (torchrun and the deepspeed launcher set these)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))


def local_world_size() -> int:
    """Processes on this node: torchrun sets LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key):
            return int(os.environ[key])
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def pick_device(require_gpus: int | None = None) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else the CPU; fails clearly when asked-for GPUs are absent."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = local_world_size()
    if require_gpus and require_gpus > n_gpus:
        raise ValueError(f"{require_gpus} GPU(s) asked for but {n_gpus} available")
    if n_gpus == 0:
        return torch.device("cpu")
    if local_world > n_gpus:
        raise ValueError(f"{local_world} processes per node asked for but only {n_gpus} GPU(s) are available")
    torch.cuda.set_device(local_rank())
    return torch.device("cuda", local_rank())


def check_precision(device: torch.device, precision: str) -> None:
    """Refuse, before DeepSpeed starts, a precision the device cannot run (DeepSpeed would fail mid-init)."""
    if device.type == "cpu" and precision == "fp16":
        raise ValueError("precision fp16 is not supported by DeepSpeed on CPU; use --precision bf16 or fp32")
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"precision bf16 is not supported on {name}; use --precision fp16 or fp32")


GiB = 2**30


def memory_capacity(device: torch.device, local_world: int) -> tuple[float, str]:
    """(bytes one process can use at most, where they are): a GPU's whole memory, or the machine's RAM (its
    cgroup limit when lower) shared by the `local_world` processes of this machine."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"{props.name} ({props.total_memory / GiB:.0f} GiB)"
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit.isdigit():
            ram = min(ram, float(limit))
    except OSError:
        pass
    return ram / local_world, f"this machine's {ram / GiB:.1f} GiB of RAM shared by {local_world} process(es)"


def estimate_memory(train, world: int, device_type: str) -> dict[str, float]:
    """A lower bound of what one process of a run holds, in bytes, by term: model and optimizer state, the
    activations backward needs, the fp32 logits, and the attention scores where the backend materializes them.

    State: weights + gradients in the training dtype and AdamW's fp32 moments (plus fp32 master weights under
    mixed precision): 16 bytes per parameter either way, divided over the ranks as the ZeRO stage partitions it
    (optimizer from stage 1, gradients from 2, weights at 3). Activations: at least 10 values of B x T x h per
    block (the inputs of QKV, attention output, MLP in/out, q, k, v) in the training dtype, one per block with
    activation checkpointing; Korthikanti et al. (2022) count 34. Scores: B x n_head x T x T per block, kept for
    backward by the reference backend, and by sdpa on a CPU with attention dropout (torch's math fallback; its
    flash kernel has no dropout there). The 1.5b runs of benchmarks/results/compare_*xh200 peaked at 62.8 GiB
    (1 GPU) and 52.4 GiB (2 GPUs) where this gives 44.5 and 32.2: a bound, meant to refuse only what clearly
    cannot fit.
    """
    from shared.model.flops import megatron_params

    m = train.model()
    n = megatron_params(m.n_layer, m.n_embd, m.vocab_size, m.seq_len)
    dtype_bytes = 4 if train.precision == "fp32" else 2
    weights_grads = 2 * dtype_bytes * n / (world if train.stage >= 3 else 1)
    if train.stage == 2:
        weights_grads = dtype_bytes * n * (1 + 1 / world)
    optimizer = (16 - 2 * dtype_bytes) * n / (world if train.stage >= 1 else 1)
    tokens = train.micro_batch * m.seq_len
    per_block = 1 if m.activation_checkpointing else 10
    activations = per_block * tokens * m.n_embd * dtype_bytes * m.n_layer
    logits = 4.0 * tokens * m.vocab_size
    keeps_scores = m.attention == "reference" or (m.attention == "sdpa" and device_type == "cpu"
                                                  and m.attn_dropout > 0)
    scores = 0.0
    if keeps_scores:
        scores = float(train.micro_batch * m.n_head * m.seq_len**2 * dtype_bytes)
        scores *= 1 if m.activation_checkpointing else m.n_layer
    return {"model and optimizer state": weights_grads + optimizer, "activations": float(activations),
            "logits": logits, "attention scores": scores}


def check_fits(train, device: torch.device, world: int, local_world: int) -> None:
    """Refuse a run whose lower-bound memory (estimate_memory) exceeds what one process has, naming the values."""
    terms = estimate_memory(train, world, device.type)
    need = sum(terms.values())
    have, where = memory_capacity(device, local_world)
    if need <= have:
        return
    m = train.model()
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in terms.items() if v)
    scores = " (attention scores grow with seq_len squared)" if terms["attention scores"] > need / 2 else ""
    raise ValueError(
        f"this run needs at least {need / GiB:.1f} GiB per process ({parts} GiB), more than the "
        f"{have / GiB:.1f} GiB one process has ({where}): preset {train.preset} with seq_len {m.seq_len}, "
        f"micro_batch {train.micro_batch}, n_embd {m.n_embd}, n_layer {m.n_layer}, attention {m.attention}, "
        f"ZeRO-{train.stage}, {train.precision}, {world} process(es); lower --seq_len or --micro_batch{scores}, "
        "or use more GPUs or activation checkpointing"
    )


def extensions_root() -> Path:
    """Where torch JIT-builds extensions (DeepSpeed's ops): TORCH_EXTENSIONS_DIR, else torch's per-user cache
    folder for this Python and accelerator (as torch.utils.cpp_extension._get_build_directory names it)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    acc = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
           f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{acc}"


def _held_open(path: Path) -> bool:
    """Whether any process this user can see has `path` open (a live build holds its lock file open)."""
    target = str(path.resolve())
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd) == target:
                    return True
        except OSError:  # another user's process, or one that just exited
            continue
    return False


def check_build_locks(min_age_s: float = 10.0) -> None:
    """Refuse to start when an extension build left its lock behind.

    torch's FileBaton creates BUILD_DIR/lock, holds it open while one process builds (DeepSpeed's CPU
    communication op on a first CPU run, DeepCompile's op) and removes it when done; every
    other process waits while the file exists, with no timeout and no output. A build killed mid-way leaves the
    file, and every later DeepSpeed start would hang. A lock no process holds open, older than min_age_s, is
    such a leftover. (A build running in another container that shares the cache is invisible here: the
    message says to check.)"""
    root = extensions_root()
    if not root.is_dir():
        return
    for lock in sorted(root.glob("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # released meanwhile
            continue
        if age >= min_age_s and not _held_open(lock):
            raise ValueError(
                f"stale JIT-build lock {lock} ({age:.0f} s old, held open by no process): a build of the "
                f"{lock.parent.name} extension was killed mid-way, and DeepSpeed would wait on this file forever. "
                f"Unless a build in another container shares this folder, remove it: rm {lock}"
            )


def check_before_start(train, device: torch.device, world: int, local_world: int) -> None:
    """Everything that can be refused before a process group or DeepSpeed starts: the precision on this device,
    the token files, a user DeepSpeed JSON, a size that clearly cannot fit, the attention backend with its layout,
    the Triton kernels asked for, a JIT-build lock left behind, output files that cannot be written."""
    from shared.train.data import check_data
    from shared.train.ds_config import build_ds_config

    check_build_locks()
    check_outputs(train)
    check_precision(device, train.precision)
    check_data(train)
    if train.ds_config:
        build_ds_config(train)  # reads and checks the user's JSON
    check_fits(train, device, world, local_world)
    check_attention(train)  # after check_fits: a backend's masks grow with seq_len squared
    check_kernels(train, device)


# The model's Triton-kernel switches: (flag, module in shared/kernels, the op its refusal names)
TRITON_SWITCHES = (("triton_loss", "cross_entropy", "cross_entropy_rows"),
                   ("triton_gelu_grad", "bias_gelu_grad", "bias_gelu_grad"),
                   ("triton_dropout", "dropout_mask", "dropout_keep_mask"))


def check_kernels(train, device: torch.device) -> None:
    """The model's Triton kernels that this run asks for, refused before DeepSpeed starts where they cannot run (a
    CPU without Triton's interpreter) instead of in the first forward."""
    import importlib

    from shared.kernels import require_cuda_or_interpreter

    model = train.model()
    for flag, module, op in TRITON_SWITCHES:
        if getattr(model, flag):
            kernel = importlib.import_module(f"shared.kernels.{module}")
            require_cuda_or_interpreter(op, device, kernel.interpreted(), f"--{flag}")


def check_attention(train) -> None:
    """The attention backend with its layout (a --layout file read and checked), built once here: a backend that
    cannot run this layout, or a layout file that is missing or wrong, is refused before DeepSpeed starts rather than
    inside its model construction."""
    from shared.model.attention import build_attention

    build_attention(train.model())


def check_outputs(train) -> None:
    """The files a run writes at its end (--out, --export) or along the way (--log_csv), refused before it trains
    when they cannot be written: a folder in a file's place, or no writable folder to create it in."""
    for flag, path, example in (("--out", train.out, "result.json"), ("--log_csv", train.log_csv, "metrics.csv"),
                                ("--export", train.export, "model.safetensors")):
        if path:
            check_output(flag, path, example)


def check_output(flag: str, path, example: str) -> None:
    """Raise ValueError, naming the problem, when the file `path` (given as `flag`) cannot be written: a folder in
    its place (`example` names a file to give instead), or no writable folder to create it in."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder: give the file to write, e.g. {p / example}")
    parent = next((a for a in [p.parent, *p.parent.parents] if a.exists()), Path("."))
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder to write it in")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the folder {parent} is not writable")


def oom_message(train, device: torch.device) -> str:
    """What to say when the first steps run out of device memory (a ValueError: exit 2, not a traceback)."""
    where = "the CPU"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    ckpt = ", with activation checkpointing" if train.activation_checkpointing else ""
    hint = "lower --micro_batch" + ("" if train.activation_checkpointing else " or add --activation_checkpointing")
    return (f"micro_batch {train.micro_batch} does not fit in {where}: preset {train.preset}, ZeRO-{train.stage}, "
            f"{train.precision}, seq_len {train.model().seq_len}{ckpt}; {hint}")


# Library output the project cannot fix, dropped precisely (message, category, module): (message regex, category,
# module regex). Matched by message so that any other warning of the same modules still shows.
LIBRARY_NOISE = [
    # DeepSpeed 0.19's ZeRO collectives call torch's deprecated names: once per step (122 of 145 lines of a
    # 60-step run), and nothing the caller can change
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed\.c10d_logger"),
    # pytorch-lightning 2.6 builds torch's deprecated LeafSpec in its own pytree helper
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"pytorch_lightning\."),
    # our loaders are already batched (batch_size=None) and built in microseconds (shared/data.py)
    (r".*does not have many workers", Warning, r"pytorch_lightning\."),
    # a resumed Lightning run's loader starts at the restored micro-step (shared/data.py, _ResumedPositions)
    (r"You're resuming from a checkpoint that ended before the epoch ended", Warning, r"pytorch_lightning\."),
]
# Lightning's advertisements, logged (not warned) at every Trainer construction
LIBRARY_NOISE_LOGS = {"pytorch_lightning.utilities.rank_zero": "💡 Tip:",
                      "lightning_fabric.utilities.rank_zero": "💡 Tip:"}


def quiet_library_noise() -> None:
    """Install the LIBRARY_NOISE filters, once per process (both paths call it through run_cli)."""
    import logging
    import warnings

    for message, category, module in LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefix in LIBRARY_NOISE_LOGS.items():
        logging.getLogger(name).addFilter(lambda record, p=prefix: not str(record.msg).startswith(p))


def run_cli(main, train, device_hint: str) -> None:
    """Run a path's main(train) as a command: a ValueError (bad input) exits 2 with its message, a loss that went
    non-finite (NonFiniteLoss: the run diverged, its last good checkpoint kept) exits 1 with its message; neither
    prints a traceback."""
    from shared.train.progress import NonFiniteLoss

    quiet_library_noise()
    try:
        main(train)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        exit_process(2, torch.device(device_hint))
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        exit_process(1, torch.device(device_hint))
    except SystemExit as e:  # preemption's exit code; DeepSpeed's autotuning experiments exit() after profiling
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr, flush=True)  # as Python prints sys.exit("message")
        exit_process(e.code if isinstance(e.code, int) else 0 if e.code is None else 1, torch.device(device_hint))
    exit_process(0, torch.device(device_hint))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def seed_all(seed: int) -> None:
    """Seed torch's CPU and CUDA generators (model init and dropout); data has its own (shared/data.py)."""
    torch.manual_seed(seed)


def freeze_gc() -> None:
    """Python's GC for the training loop, called after set-up in both paths: one collection, then every object alive
    (modules, parameters, DeepSpeed's and Lightning's bookkeeping) moves to a permanent generation, so automatic
    collections scan only what the steps allocate instead of pausing the host for a full scan of the process whenever
    the oldest generation fills. Python's own policy measured no different (docs/ledger.md); the Lightning path's
    overhead python_gc_auto (compare.py --explain) runs it."""
    gc.collect()
    gc.freeze()


def dropout_seed(seed: int, rank: int) -> int:
    """Seed of the dropout stream of `rank`, set right before the first step in both paths."""
    return seed * 1000 + 17 + rank


def exit_process(code: int, device: torch.device) -> None:
    """Leave the process with `code`.

    On CPU, DeepSpeed 0.19.8's engine leaves a joinable C++ thread behind, and about half of the runs abort at
    interpreter teardown ("terminate called without an active exception", exit -6) after all work is done
    and the result is written. We flush and leave with os._exit there; on GPUs the normal exit path runs.
    """
    if device.type == "cpu":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
