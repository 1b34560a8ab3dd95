"""How far a profiled step is from the hardware: the matmuls' and the attention's achieved rates, and the step a
target throughput needs.

Pure functions of a RunResult written with --profile_step (its step's device time by kind of kernel,
shared/train/step_profile.py). The rates are model FLOPs (shared/model/flops.py: the linear layers and the LM head;
the attention's score and value products over the causal triangle, or over the layout's blocks for a sparse
layout) over the kind's device time in the profiled step; a flash-style backward that recomputes the scores does
7/6 of the attention FLOPs counted. The profiled step synchronizes at each phase boundary (unless it ran with
--profile_sync false), so its wall time is close to, not equal to, the run's median step, and its idle time includes
the host's work at each boundary that a step in flight may hide behind queued kernels: the no-idle what-if of a
synced profile is an upper bound. compare.py's report prints the rates of every profiled row;
benchmarks/step_budget.py adds the target and the what-ifs.
"""

from __future__ import annotations

from harness import telemetry
from shared.model import flops
from shared.train.results import RunResult

TRIANGLE_LAYOUTS = ("causal", "dense")  # layouts whose attention is the causal triangle (shared/model/layouts.py)
KINDS = ("matmul", "attention", "compiled (triton)")  # the kinds reported apart; the rest is summed as "other"


def kinds_ms(by_kind_ms: dict) -> dict:
    """A profiled step's device time in the kinds that move apart: the matmuls and the attention (compute-bound, so
    moved alike by the GPU's clock in every run), inductor's generated kernels, and the rest (this project's Triton
    kernels, the optimizer, copies) as "other"."""
    other = sum(v for k, v in by_kind_ms.items() if k not in KINDS)
    return {**{k: by_kind_ms.get(k, 0.0) for k in KINDS}, "other": other}


def minus_mean(ms: dict, baselines: list[dict]) -> dict:
    """Each entry of `ms` minus its mean over `baselines` (dicts with the same keys)."""
    return {k: v - sum(b[k] for b in baselines) / len(baselines) for k, v in ms.items()}


def attention_density(run: RunResult) -> float:
    """The share of the s x s score grid the model's attention needs: the causal triangle, or the layout's blocks."""
    if run.model["layout"] in TRIANGLE_LAYOUTS:
        return flops.causal_density(run.model["seq_len"])
    return run.layout_density


def is_gpu_profile(profile: dict) -> bool:
    """Whether a profiled step timed kernels (a GPU run): a CPU profile times operators, which nest."""
    return profile.get("device") == "cuda"


def _profiled_step(run: RunResult, source: str) -> dict:
    profile = (run.extra or {}).get("profile")
    if not profile or "step" not in profile:
        raise ValueError(f"{source} has no profiled step: rerun it with --profile_step N (a step past the warm-up)")
    if not is_gpu_profile(profile):
        raise ValueError(f"{source} was profiled on {profile.get('device')!r}: a CPU profile times operators, which "
                         "nest, not kernels, so rates from it would mean nothing; profile a GPU run")
    return profile["step"]


def _shape(run: RunResult) -> tuple[int, int, int, int]:
    """(global batch, seq, layers, hidden) of one optimizer step."""
    m, t = run.model, run.train
    return t["micro_batch"] * t["grad_accum"] * run.world_size, m["seq_len"], m["n_layer"], m["n_embd"]


def kernel_rates(run: RunResult, source: str = "this run") -> dict:
    """Per GPU: the model FLOPs, device ms, TFLOP/s and share of the device's peak of the matmuls and the attention
    kernels in the profiled step of a GPU run (TFLOP/s None where the profile has no kernel of that kind, the share
    None where the device is not in flops.PEAK_FLOPS); and the share of the peak at the clock the GPU held over the
    timed steps (`of_held_peak`; None without telemetry or where flops.PEAK_CLOCK_MHZ lacks the device): how far the
    kernels are from what the power cap leaves, apart from the clock it costs."""
    by_kind = _profiled_step(run, source)["by_kind_ms"]
    density, shape = attention_density(run), _shape(run)
    attention = flops.attention_flops(*shape, run.flops_factor, density)
    linear = flops.matmul_flops(*shape, run.model["vocab_size"], run.flops_factor, density) - attention
    name, precision, sm_mhz = run.device.get("name"), run.train["precision"], telemetry.held_sm_mhz(run.extra)
    peak = flops.peak_flops(name, precision)
    held = flops.peak_flops_at_clock(name, precision, sm_mhz)

    def rate(model_flops: float, kind: str) -> dict:
        per_gpu, ms = model_flops / run.world_size, by_kind.get(kind)
        tflops = per_gpu / (ms * 1e-3) / 1e12 if ms else None
        return {"model_flops": per_gpu, "ms": ms, "tflops": tflops,
                "of_peak": tflops * 1e12 / peak if tflops is not None and peak else None,
                "of_held_peak": tflops * 1e12 / held if tflops is not None and held else None}

    return {"peak_tflops": peak / 1e12 if peak else None, "sm_mhz": sm_mhz,
            "held_peak_tflops": held / 1e12 if held else None,
            "matmul": rate(linear, "matmul"), "attention": rate(attention, "attention")}


def step_budget(run: RunResult, target: float, source: str = "this run") -> dict:
    """kernel_rates, the median step `target` TFLOPs/GPU needs (the reported convention, shared/model/flops.py) and
    its gap to the run's, and what-ifs: the median step with the attention at the matmuls' rate, and without idle
    time, each with the TFLOPs/GPU it would give."""
    step = _profiled_step(run, source)
    rates = kernel_rates(run, source)
    formula = flops.megatron_flops(*_shape(run), run.model["vocab_size"], run.flops_factor) / run.world_size
    median_ms = run.step_time_s["median"] * 1e3
    needed_ms = formula / (target * 1e12) * 1e3

    def at(ms: float) -> dict:
        return {"step_ms": ms, "tflops_per_gpu": formula / (ms * 1e-3) / 1e12}

    matmul, attn = rates["matmul"], rates["attention"]
    what_if = {}
    if matmul["tflops"] and attn["ms"] is not None:
        what_if["attention_at_matmul_rate"] = at(median_ms - attn["ms"] + attn["model_flops"] / matmul["tflops"] / 1e9)
    what_if["no_idle"] = at(median_ms - step["idle_ms"])
    # a step profiled without syncs: the host's own time per phase and its lead when each began (step_profile)
    host = {p: {k: v[k] for k in ("host_wall_ms", "host_lead_ms")}
            for p, v in run.extra["profile"].get("phases", {}).items() if "host_wall_ms" in v}
    return {**({"host": host} if host else {}),
            "source": source, "row": run.path, "command": run.command, "device": run.device.get("name"),
            "precision": run.train["precision"], "world_size": run.world_size, "tflops_per_gpu": run.tflops_per_gpu,
            "median_step_ms": median_ms, "profiled_step_ms": step["wall_ms"], "idle_ms": step["idle_ms"],
            "profile_synced": run.extra["profile"].get("synced", True),
            "by_kind_ms": step["by_kind_ms"], **rates, "target_tflops_per_gpu": target, "needed_step_ms": needed_ms,
            "gap_ms": median_ms - needed_ms, "what_if": what_if}
