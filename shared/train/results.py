"""RunResult <-> JSON: what one training run measured, written by rank 0 of either path.

Throughput figures are derived here, once, from the PhaseTimer summary and shared/flops.py, so the two paths
cannot compute them differently.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared import patches
from shared.model import flops, fp8, layouts
from shared.model.attention import applied_attention_dropout, sdpa_kernel
from shared.model.config import GPTConfig, fused_paths
from shared.train.config import TrainConfig
from shared.train.sync_check import format_syncs

RESULT_VERSION = 1
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # what attention sees


def versions() -> dict[str, str | None]:
    """Versions of everything that moves the numbers."""
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda}
    for pkg in ("deepspeed", "pytorch-lightning", "lightning", "triton", "xformers", "numpy", "torchao"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def replace_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed over it: a reader (a --keep or --keep_runs that
    continues from the file) sees the old file or the new one, never half of one, whenever the writer is killed."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: str | Path, result: dict, **dumps) -> None:
    """A benchmark's JSON result at `path` (its folder made), and a line saying where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, **dumps))
    print(f"wrote {path}")


def device_info(device: torch.device | None = None) -> dict:
    """What `device` is (default: this machine's, the first GPU where there is one, else the CPU). `uuid` names the
    GPU itself, so that a report whose runs were made over several calls can say which ran on the same card."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        return {"type": "cuda", "name": props.name, "count": torch.cuda.device_count(),
                "memory_gib": props.total_memory / 2**30, "capability": f"{props.major}.{props.minor}",
                "uuid": None if uuid is None else str(uuid)}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count(),
            "memory_gib": None, "capability": None, "uuid": None}


def differences(train: TrainConfig, there_train: dict, there_device: str | None, there_versions: dict) -> list[str]:
    """How a recorded run (its TrainConfig as a dict, device name and package versions) differs from `train` on
    this machine now, one "X there vs Y now" each; the output path does not count, nor what this version no longer
    records (a field or a package version of a removed option: docs/ledger.md), nor a field added since that is at
    its default now (a new option defaults to what runs did before it existed)."""
    here_device, here_versions = device_info()["name"], versions()
    default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    diff = [f"{k} {there_train.get(k)!r} there vs {v!r} now" for k, v in dataclasses.asdict(train).items()
            if k != "out" and there_train.get(k, default[k]) != v]
    if there_device != here_device:
        diff.append(f"device {there_device!r} there vs {here_device!r} now")
    return diff + [f"{pkg} {v!r} there vs {here_versions[pkg]!r} now" for pkg, v in there_versions.items()
                   if pkg in here_versions and v != here_versions[pkg]]


@dataclass
class RunResult:
    """One run of one path. Times in seconds; throughput per GPU (per process on CPU)."""

    path: str  # "deepspeed" | "lightning"
    command: str
    preset: str
    model: dict
    train: dict
    ds_config: dict
    versions: dict
    device: dict
    world_size: int
    attention: str  # the backend that actually ran
    fused: dict  # every optional fused path and whether it ran
    losses: list[float]
    steps: int
    warmup_steps: int
    flops_factor: int
    phases_s: dict[str, float]
    step_time_s: dict[str, float]
    per_step_s: list[float]
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    sparse_tflops_per_gpu: float
    layout_density: float
    mfu: float | None
    peak_mem_gib: float | None
    peak_rss_gib: float
    n_params: int
    ds_breakdown_ms: dict | None = None
    extra: dict = field(default_factory=dict)
    version: int = RESULT_VERSION
    # Fields added later carry a default, so results written before them still load (as None).
    tflops_per_gpu_causal: float | None = None  # exact matmul count, causal attention (shared/flops.causal_flops)
    grad_norms: list[float | None] | None = None  # DeepSpeed's global grad norm (before clipping), per step
    param_checksum: dict | None = None  # sum / sum_sq / numel of all parameters at the end (ds_runtime)
    sdpa_kernel: str | None = None  # the kernel torch's SDPA picked (attention.sdpa_kernel); null for other backends
    # the attention dropout rate that kernel applies (attention.applied_attention_dropout; the model asks for
    # train.model's attn_dropout); null in results written before it was recorded
    attn_dropout_applied: float | None = None
    # --precision fp8: what the conversion did (shared/model/fp8.convert: recipe, converted modules, what stayed bf16)
    # and flops_share, the blocks' linears' share of the step's exact causal matmul FLOPs; null for other precisions
    fp8: dict | None = None
    # --precision fp8: model FLOPs utilisation against the device's FP8 peak (`mfu` is against its bf16 peak); null for
    # other precisions, on a CPU and where the FP8 peak is unknown (shared/model/flops.py)
    mfu_fp8: float | None = None

    def to_json(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, json.dumps(dataclasses.asdict(self), indent=1, allow_nan=False))

    @classmethod
    def from_json(cls, path: str | Path) -> RunResult:
        data = json.loads(Path(path).read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        optional = {f.name for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        missing = names - set(data) - optional
        if missing:
            raise ValueError(f"result {str(path)!r} lacks field(s) {sorted(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


def build_result(*, path: str, train: TrainConfig, model_cfg: GPTConfig, ds_config: dict, world_size: int,
                 device: torch.device, attention: str, losses: list[float], timing: dict,
                 n_params: int, peak_mem_bytes: float | None, ds_breakdown_ms: dict | None = None,
                 extra: dict | None = None, allow_nonfinite: bool = False,
                 grad_norms: list[float | None] | None = None, param_checksum: dict | None = None,
                 fp8_record: dict | None = None) -> RunResult:
    """Assemble a RunResult from a finished run's raw measurements; `fp8_record` is the model's FP8 conversion record
    (shared/model/fp8.convert), which an fp8 run must have and no other may.

    Non-finite losses are an error, except for steps nan_policy=skip skipped (allow_nonfinite): JSON has no NaN,
    so those are written as null.
    """
    if not allow_nonfinite and not all(math.isfinite(x) for x in losses):
        bad = next(i for i, x in enumerate(losses) if not math.isfinite(x))
        raise FloatingPointError(f"loss is not finite at step {bad}: {losses[bad]}")
    if (train.precision == "fp8") != bool(fp8_record):  # never label an unconverted model fp8, or the reverse
        raise ValueError(f"--precision {train.precision} with {'no ' if not fp8_record else ''}FP8 conversion record: "
                         "the model must be built by shared/train/build.build_model")
    losses = [x if math.isfinite(x) else None for x in losses]
    step_time = timing["step_time_s"]["median"]
    global_batch = train.micro_batch * train.grad_accum * world_size
    k = train.flops_factor
    step_flops = flops.step_flops(model_cfg, global_batch, k)
    density = layouts.density(layouts.make_layout(model_cfg))
    sparse_flops = flops.sparse_model_flops(global_batch, model_cfg.seq_len, model_cfg.n_layer, model_cfg.n_embd,
                                            model_cfg.vocab_size, k, density)
    tflops = step_flops / step_time / world_size / 1e12
    causal_flops = flops.step_flops_causal(model_cfg, global_batch, k)
    dev = device_info(device)
    cuda = device.type == "cuda"
    recorded = patches.records()  # what the patches of this process did (DeepCompile's set-up)
    return RunResult(
        path=path,
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        preset=train.preset,
        model=dataclasses.asdict(model_cfg),
        train=dataclasses.asdict(train),
        ds_config=ds_config,
        versions=versions(),
        device=dev,
        world_size=world_size,
        attention=attention,
        fused={**fused_paths(model_cfg), "compile": train.compile,
               "coordinate_descent_tuning": train.coordinate_descent_tuning, **dynamo_stats()},
        losses=losses,
        steps=train.steps,
        warmup_steps=train.warmup_steps,
        flops_factor=k,
        phases_s=timing["phases_s"],
        step_time_s=timing["step_time_s"],
        per_step_s=timing["per_step_s"],
        tokens_per_s_per_gpu=train.micro_batch * train.grad_accum * model_cfg.seq_len / step_time,
        tflops_per_gpu=tflops,
        sparse_tflops_per_gpu=sparse_flops / step_time / world_size / 1e12,
        layout_density=density,
        mfu=flops.mfu(tflops, dev["name"], train.tensor_precision) if cuda else None,  # fp8: bf16's peak
        peak_mem_gib=peak_mem_bytes / 2**30 if peak_mem_bytes is not None else None,
        peak_rss_gib=_peak_rss_gib(),
        n_params=n_params,
        ds_breakdown_ms=ds_breakdown_ms,
        tflops_per_gpu_causal=causal_flops / step_time / world_size / 1e12,
        grad_norms=[g if g is None or math.isfinite(g) else None for g in grad_norms] if grad_norms else None,
        param_checksum=param_checksum,
        sdpa_kernel=(kernel := sdpa_kernel(model_cfg, train.micro_batch, COMPUTE_DTYPES[train.tensor_precision],
                                           device)),
        attn_dropout_applied=applied_attention_dropout(model_cfg, kernel),
        fp8={**fp8_record, "flops_share": flops.fp8_share(model_cfg, global_batch, k)} if fp8_record else None,
        mfu_fp8=flops.mfu(tflops, dev["name"], "fp8") if fp8_record and cuda else None,
        extra={**(extra or {}), "allocator_cache_flushes": allocator_cache_flushes(device),
               "warmup_s": timing.get("warmup_s"), "timed_wall": timing.get("timed_wall"),
               "compile_s": compile_seconds(),
               "compile_cache": compile_cache_counts(),
               "deepcompile_passes_s": _deepcompile_pass_seconds(),
               "deepcompile_persist": recorded["deepcompile_persist"],
               "deepcompile_schedules": getattr(sys.modules.get("shared.train.deepcompile_passes"), "SCHEDULES", None),
               "deepcompile_eager_persist_dropped": recorded["deepcompile_eager_persist_dropped"],
               "deepcompile_cached_walks": recorded["deepcompile_cached_walks"],
               "deepcompile_profilers": recorded["deepcompile_profilers"],
               "deepcompile_op": recorded["deepcompile_op"],
               "patches": patches.installed(),  # every upstream target replaced in this process (shared/patches)
               **({"profile": timing["profile"]} if timing.get("profile") else {}),
               **({"syncs": timing["syncs"]} if timing.get("syncs") else {})},
    )


def _deepcompile_pass_seconds() -> float | None:
    """Seconds DeepCompile spent in its graph passes and their profiling runs (its own clock, per graph and compile:
    deepspeed.compile.backend.opt_pass_times); None where it did not run in this process."""
    times = getattr(sys.modules.get("deepspeed.compile.backend"), "opt_pass_times", None)
    return float(sum(t[-1] for t in times)) if times else None


def allocator_cache_flushes(device: torch.device) -> int | None:
    """cudaMalloc retries after emptying PyTorch's cache: what DeepSpeed's ZeRO-3 warns about as "pytorch allocator
    cache flushes since last step" (it reads the same counter). Each one stalls the step; None on CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def dynamo_stats() -> dict[str, int]:
    """What torch.compile did in this process: graphs compiled, graph breaks, frames it gave up on.

    A compiled path that silently fell back to eager shows up here (breaks, or frames over the recompile limit).
    """
    from torch._dynamo.utils import counters

    unimplemented = counters.get("unimplemented", {})
    return {
        "dynamo_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "dynamo_graph_breaks": int(sum(counters.get("graph_break", {}).values())),
        "dynamo_recompile_limit_hits": int(sum(v for k, v in unimplemented.items() if "recompile" in k.lower())),
    }


def compile_seconds() -> float | None:
    """Seconds torch.compile spent in this process (dynamo + AOT + inductor, all graphs), by dynamo's own clock;
    None where this torch does not report it. Part of the warm-up steps, never of a timed step."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        spent = calculate_time_spent()
    except (ImportError, AttributeError, RuntimeError):
        return None
    return float(spent.get("total_wall_time", sum(spent.values()))) if spent else 0.0


# torch.compile's on-disk caches (TORCHINDUCTOR_CACHE_DIR): dynamo's counter names for inductor's compiled graphs and
# AOT autograd's traced ones
CACHE_COUNTERS = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
                  "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}


def compile_cache_counts() -> dict[str, int]:
    """How often torch.compile found a graph in its on-disk caches in this process, and how often it compiled one
    (miss) or could not cache it (bypass): with compile_s, what a warm cache saved at the warm-up."""
    from torch._dynamo.utils import counters

    return {name: int(counters.get(group, {}).get(name, 0)) for group, names in CACHE_COUNTERS.items()
            for name in names}


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def tflops_convention(k: int) -> str:
    """How a reported TFLOPs figure was counted (shared/flops.py): said wherever one is printed."""
    return f"dense-attention formula, k={k}, median step"


def write_result(result: RunResult, out: str | Path, rank: int) -> None:
    """Rank 0 writes the run's JSON and prints its summary table (every entry point ends this way)."""
    if rank == 0:
        result.to_json(out)
        print(format_summary(result), flush=True)


def _loss_span(losses: list) -> str:
    """First -> last loss of the run; steps skipped by --nan_policy skip (None) are left out and counted."""
    finite = [x for x in losses if x is not None]
    skipped = len(losses) - len(finite)
    if not finite:
        return f"n/a (all {skipped} steps skipped: non-finite loss)"
    span = f"{finite[0]:.4f} -> {finite[-1]:.4f}"
    return span + (f" ({skipped} step(s) skipped: non-finite loss)" if skipped else "")


def format_summary(r: RunResult) -> str:
    """The end-of-run table both paths print."""
    ph = r.phases_s
    mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a (unknown peak)"
    if r.fp8:
        mfu += f" of the bf16 peak, {r.mfu_fp8:.1%} of the FP8 peak" if r.mfu_fp8 is not None else \
            " of the bf16 peak, n/a of the FP8 peak (unknown)"
    mem = f"{r.peak_mem_gib:.2f} GiB" if r.peak_mem_gib is not None else f"host RSS {r.peak_rss_gib:.2f} GiB"
    rows = [
        ("path", f"{r.path}  ({r.world_size} x {r.device['name']})"),
        ("model", f"{r.preset}, {r.n_params / 1e6:.1f}M params, attention={r.attention}"
                  + (f" ({r.sdpa_kernel})" if r.sdpa_kernel else "")
                  + (f", attention dropout applied {r.attn_dropout_applied:.6g}" if r.attn_dropout_applied else "")),
        ("ZeRO / precision", f"stage {r.train['stage']}, {r.train['precision']}, micro-batch {r.train['micro_batch']}"),
        *([("FP8 matmuls", fp8.describe(r.fp8))] if r.fp8 else []),
        ("timed steps", f"{len(r.per_step_s)} (after {r.warmup_steps} warmup)"),
        ("step time", f"{r.step_time_s['median'] * 1e3:.1f} ms median "
                      f"(min {r.step_time_s['min'] * 1e3:.1f}, max {r.step_time_s['max'] * 1e3:.1f})"),
        ("phases (median ms)", "  ".join(f"{p} {ph[p] * 1e3:.1f}" for p in ("data", "forward", "backward", "step"))),
        ("throughput", f"{r.tflops_per_gpu:.2f} TFLOPs/GPU ({tflops_convention(r.flops_factor)}), MFU {mfu}, "
                       f"{r.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"),
        ("exact causal count", f"{r.tflops_per_gpu_causal:.2f} TFLOPs/GPU" if r.tflops_per_gpu_causal is not None
         else "n/a (result written before it was recorded)"),
        ("peak memory", mem + (f", {r.extra['allocator_cache_flushes']} allocator cache flushes"
                                 if r.extra.get("allocator_cache_flushes") is not None else "")),
        ("loss", _loss_span(r.losses)),
    ]
    for key, what in (("val", "validation"), ("saves", "checkpoints")):  # between steps, in no step's time
        seconds = [v["seconds"] for v in (r.extra or {}).get(key) or [] if "seconds" in v]
        if seconds:
            rows.append((what, f"{len(seconds)} x, median {statistics.median(seconds):.2f} s "
                               f"(min {min(seconds):.2f}, max {max(seconds):.2f})"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if syncs := (r.extra or {}).get("syncs"):
        lines += format_syncs(syncs)
    return "\n".join(lines)
