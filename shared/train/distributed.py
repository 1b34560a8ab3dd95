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


def launched_rank() -> int:
    """This process's rank under a launcher (torchrun, deepspeed, fabric run): RANK, else 0."""
    return int(os.environ.get("RANK", "0"))


def launched_world() -> int:
    """The processes of a run under a launcher (torchrun, deepspeed, fabric run): WORLD_SIZE, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


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


def gpu_memory_gib() -> float:
    """The first GPU's memory, GiB (what a profile's micro-batch is chosen for)."""
    return memory_capacity(torch.device("cuda", 0), 1)[0] / GiB


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
    flash kernel has no dropout there). A bound, meant to refuse only what clearly cannot fit: it stays below the
    peaks the 1.5b runs measured (docs/results.md, "Results on H200"; tests/test_preflight.py checks it against
    them).
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


def _open_nowhere_else(fd: int) -> bool | None:
    """Whether the file open as `fd` is open nowhere else on this machine, in any process, container or user: the
    kernel grants a write lease (fcntl F_SETLEASE, Linux) only on a file no other open file refers to; the lease is
    given back at once. None where that cannot be asked: not the main thread (a lease break signals the process,
    and SIGIO is only ignored meanwhile from the main thread), a file of another user, a file system without leases
    (NFS, some FUSE)."""
    import errno
    import fcntl
    import signal
    import threading

    if not hasattr(fcntl, "F_SETLEASE") or threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGIO, signal.SIG_IGN)  # an open elsewhere meanwhile signals the holder
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError as e:
        return False if e.errno == errno.EAGAIN else None
    finally:
        signal.signal(signal.SIGIO, previous)


def _remove_if_abandoned(lock: Path, settle_s: float) -> str:
    """Remove `lock` if no process anywhere on this machine holds it open; "removed", "held" (a live build),
    "gone" (released meanwhile) or "unknown" (_open_nowhere_else cannot tell).

    Checkers take turns (flock on the build folder), so two of them never both remove; and a lock found open nowhere
    must still be there, the same file, settle_s later: a build that finishes closes its lock and removes it right
    after, and that removal must not find it gone."""
    import fcntl

    try:
        folder = os.open(lock.parent, os.O_RDONLY)
    except OSError:  # e.g. another user's folder
        return "unknown"
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return "gone"
        except OSError:
            return "unknown"
        try:
            first = _open_nowhere_else(fd)
            if first is not True:
                return "unknown" if first is None else "held"
            time.sleep(settle_s)
            try:
                if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                    return "gone"
            except FileNotFoundError:
                return "gone"
            if _open_nowhere_else(fd) is not True:
                return "held"
            lock.unlink()
            return "removed"
        finally:
            os.close(fd)
    finally:
        os.close(folder)  # releases the flock


def check_build_locks(min_age_s: float = 10.0, settle_s: float = 1.0) -> None:
    """Remove an extension build's lock that its build left behind; refuse to start where that cannot be told.

    torch's FileBaton creates BUILD_DIR/lock, holds it open while one process builds (DeepSpeed's CPU
    communication op on a first CPU run, DeepCompile's op) and removes it when done; every
    other process waits while the file exists, with no timeout and no output. A build killed mid-way (SIGTERM,
    SIGKILL, a timeout) leaves the file, and every later DeepSpeed start would hang. A lock older than min_age_s that
    no process on this machine holds open (the kernel says so: _open_nowhere_else) is such a leftover: it is removed,
    with a line saying so, and the extension is built again. A lock some process holds open is a live build,
    waited for as torch waits. Where the kernel cannot be asked (another user's lock, a network file system, which
    another machine may be building on), a lock no process visible here holds open is refused with the command that
    removes it."""
    root = extensions_root()
    if not root.is_dir():
        return
    for lock in sorted(root.glob("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # released meanwhile
            continue
        if age < min_age_s:  # a build that is starting
            continue
        outcome = _remove_if_abandoned(lock, settle_s)
        if outcome == "removed":
            print(f"removed {lock}: a build of the {lock.parent.name} extension left it {age:.0f} s ago and no process "
                  "holds it open (the build was stopped mid-way); DeepSpeed builds the extension again",
                  file=sys.stderr, flush=True)
        elif outcome == "unknown" and not _held_open(lock):
            raise ValueError(
                f"stale JIT-build lock {lock} ({age:.0f} s old, held open by no process visible here): a build of the "
                f"{lock.parent.name} extension was killed mid-way, and DeepSpeed would wait on this file forever. "
                f"Unless a build on another machine or in another container shares this folder, remove it: rm {lock}"
            )


def with_own_ninja(path: str) -> str:
    """`path` (a PATH value) with the folder of the ninja installed with this interpreter's packages (pip's ninja, a
    DeepSpeed dependency) first, where another ninja would be found first.

    torch JIT-builds DeepSpeed's ops with the `ninja` it finds on PATH. pip's ninja (1.13, in .venv/bin) and a
    system one (1.11, /usr/bin) hash a build's commands differently in .ninja_log, so each took the other's build of
    an op for outdated and built it again (deepspeed_shm_comm: about 20 s on 2 cores) whenever a process started
    from an activated shell followed one started by `make run`, whose PATH lacks .venv/bin. Every training process
    (run_cli) and every process compare.py and the benchmarks start (harness/launch.run_env) use this one."""
    import shutil

    try:
        import ninja
    except ImportError:
        return path
    own = Path(ninja.BIN_DIR or ".") / "ninja"
    if not ninja.BIN_DIR or not own.is_file():
        return path
    found = shutil.which("ninja", path=path)
    if found and Path(found).resolve() == own.resolve():
        return path
    return os.pathsep.join(filter(None, [str(own.parent), path]))


def check_before_start(train, device: torch.device, world: int, local_world: int, lightning: bool = False) -> None:
    """Everything that can be refused before a process group or DeepSpeed starts: first the versions of DeepSpeed
    (and with `lightning`, of pytorch-lightning: the Lightning path's hooks) that the run's patches were written for
    (shared/patches.check_versions), then the precision on this device, the token files, a user DeepSpeed JSON, a
    size that clearly cannot fit, the attention backend with its layout, the Triton kernels asked for, a JIT-build
    lock left behind, output files that cannot be written."""
    from shared import patches
    from shared.train.data import check_data
    from shared.train.ds_config import build_ds_config

    patches.check_versions(train, lightning=lightning)  # before anything is touched: no half-patched run
    check_build_locks()
    check_outputs(train)
    check_precision(device, train.tensor_precision)  # fp8's own refusals: TrainConfig (shared/model/fp8.py)
    check_data(train)
    if train.ds_config:
        build_ds_config(train, world)  # reads and checks the user's JSON, its batch sizes against `world`
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

    os.environ["PATH"] = with_own_ninja(os.environ.get("PATH", ""))  # before DeepSpeed builds an op
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


def shm_buffer_path(rank: int) -> Path:
    """The shared-memory file DeepSpeed's CPU communication op creates for `rank` of the run whose rendezvous is this
    process's MASTER_ADDR and MASTER_PORT (deepspeed/ops/csrc/cpu/comm/shm.cpp, shm_initialize: SHM_BUFFER_NAME,
    the user id, the address, the port and the rank; DeepSpeed 0.19.8)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffer(device: torch.device) -> None:
    """Unlink this rank's shared-memory all-reduce buffer as soon as every rank has mapped every other's.

    DeepSpeed's CPU communication op, built when its process group starts, creates one 66 MB file per rank in
    /dev/shm (shm_buffer_path) when all ranks are on this machine (LOCAL_SIZE, which the deepspeed launcher sets,
    equal to the world size), maps every rank's, and never unlinks them: each run left them behind. A mapping
    outlives its name, so once every rank holds every mapping (a barrier after deepspeed.init_distributed) each rank
    unlinks its own file: nothing of this run stays in /dev/shm however it ends (error, SIGTERM, SIGKILL), and no
    other run's file, whose name has its own port, is touched. Collective: call it on every rank."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if device.type != "cpu" or os.environ.get("LOCAL_SIZE") != str(world):  # the op made no buffer
        return
    if world > 1:
        dist.barrier()
    shm_buffer_path(dist.get_rank()).unlink(missing_ok=True)


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
