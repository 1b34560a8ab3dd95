"""FLOPs of a GPT training step, and the peak a device can do: the one place both are written.

Matmul FLOPs of shared.model.gpt.GPT, term by term. For a batch of B sequences of s tokens, l layers, hidden size h
and vocabulary V, one forward pass of one transformer layer multiplies
  - QKV projection        2*B*s*h*3h   = 6  B s h^2
  - attention scores QK^T  2*B*s*s*h    = 2  B s^2 h   (dense: every query against every key)
  - scores x V            2*B*s*s*h    = 2  B s^2 h
  - output projection     2*B*s*h*h    = 2  B s h^2
  - MLP (h -> 4h -> h)    2*2*B*s*h*4h = 16 B s h^2
  per layer 24 B s h^2 + 4 B s^2 h = 24 B s h^2 (1 + s/(6h)); the tied LM head adds 2 B s h V once.
Summed over l layers, one forward is 24 B s l h^2 (1 + s/(6h) + V/(12 l h)) (the head: 2BshV / 24Bslh^2).
Backward costs twice the forward (a gradient for the input and one for the weight of every matmul); with
activation recomputation (--activation_checkpointing, which checkpoints the blocks, not the head) the blocks'
forward runs again in backward. The exact matmul count of a step is therefore (`matmul_flops`)

    F_exact = k * l * (24 B s h^2 + 4 d B s^2 h) + 6 B s h V,     k = 3 (4 with recomputation),

with d the share of the s x s score grid the attention computes: 1 for dense, (s+1)/(2s) for the causal lower
triangle with its diagonal (`causal_flops`), a layout's density for sparse layouts.

The reported convention (`megatron_flops`) is the Megatron/BigScience formula (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", sec. 5.1), used by BigScience and by the original min-LLM
study, kept so that every figure here compares with theirs and with each other:

    F = 24 * k * B * s * l * h^2 * (1 + s/(6h) + V/(16 l h)).

What it counts, precisely: the blocks exactly as F_exact with dense attention (d = 1), and the head as
24k * V/(16lh) * Bslh^2 = (3k/2) B s h V. The paper derives it for k = 4, where the head, never recomputed, is
6 B s h V: exact. At k = 3 (no recomputation, every run here unless stated) the head counts 4.5 B s h V instead of
6, an undercount of 1.5 B s h V (1.55% of the step at the 1.5b preset). Against the work a causal kernel does,
the dense s x s attention term overcounts: at the 1.5b preset, k = 3, the formula gives 1.048x the exact causal
count (F_exact with d = (s+1)/(2s)); both are reported, the formula as `tflops_per_gpu`, the exact causal count
as `tflops_per_gpu_causal`.

Not counted by any of them: elementwise work (softmax, LayerNorm, GELU, dropout, bias adds, the loss) and the
embedding's gather/scatter. `sparse_model_flops` is the formula with its attention term s/(6h) scaled by the
layout's density (the share of the s x s grid the layout's blocks visit): comparable with the dense formula, with
the same head undercount at k = 3; `matmul_flops` with that density is the exact matmul count.
tests/test_flops.py checks F_exact, the formula and the causal count against torch.utils.flop_counter on the
model itself. TFLOPs per GPU = F / (median step time * n_gpus), with B the global batch of that step.

FP8 runs (--precision fp8, shared/model/fp8.py) are counted by the same formula: the model does the same matmuls,
some of them in FP8, so their TFLOPs compare with bf16 runs' as speed. Their MFU is reported twice, against the
device's bf16 peak (the run JSON's `mfu`, comparable with bf16 runs) and against its FP8 peak (`mfu_fp8`, the bound of
the FP8 matmuls alone; no run of this model can reach it, since its attention and head stay bf16). `fp8_linear_flops`
is what ran in FP8: the blocks' four linears, k * l * 24 B s h^2 (forward, input and weight gradients, recomputed
forward included); its share of the exact causal count is recorded with each fp8 run.
"""

from __future__ import annotations

import warnings

from shared.model.config import GPTConfig


def megatron_flops(batch: int, seq: int, n_layer: int, hidden: int, vocab: int, k: int = 3) -> float:
    """FLOPs of one training step of `batch` sequences: 24*k*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))."""
    if k not in (3, 4):
        raise ValueError(f"k must be 3 (no recompute) or 4 (activation checkpointing), got {k}")
    return 24.0 * k * batch * seq * n_layer * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * n_layer * hidden))


def sparse_model_flops(batch: int, seq: int, n_layer: int, hidden: int, vocab: int, k: int, density: float) -> float:
    """As megatron_flops, with the attention term s/(6h) scaled by the layout density (1.0 = dense)."""
    if k not in (3, 4):
        raise ValueError(f"k must be 3 (no recompute) or 4 (activation checkpointing), got {k}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"layout density must be in (0, 1], got {density}")
    return 24.0 * k * batch * seq * n_layer * hidden**2 * (
        1 + density * seq / (6 * hidden) + vocab / (16 * n_layer * hidden)
    )


def matmul_flops(batch: int, seq: int, n_layer: int, hidden: int, vocab: int, k: int = 3,
                 density: float = 1.0) -> float:
    """Exact matmul FLOPs of one training step of shared.model.gpt.GPT: k*l*(24Bsh^2 + 4*d*Bs^2h) + 6BshV, with d the
    share of the s x s score grid the attention computes (1 dense, causal_density(s) causal)."""
    linear = k * n_layer * 24.0 * batch * seq * hidden**2 + 6.0 * batch * seq * hidden * vocab
    return linear + attention_flops(batch, seq, n_layer, hidden, k, density)


def attention_flops(batch: int, seq: int, n_layer: int, hidden: int, k: int = 3, density: float = 1.0) -> float:
    """The attention's share of matmul_flops: the score and value products, k*l*4*d*B*s^2*h (model FLOPs: a
    flash-style backward that recomputes the scores does 5 products where this counts 4)."""
    if k not in (3, 4):
        raise ValueError(f"k must be 3 (no recompute) or 4 (activation checkpointing), got {k}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"attention density must be in (0, 1], got {density}")
    return k * n_layer * 4.0 * density * batch * seq**2 * hidden


def causal_density(seq: int) -> float:
    """Share of the s x s score grid a causal mask keeps: the lower triangle with its diagonal, s(s+1)/2 of s^2."""
    return (seq + 1) / (2 * seq)


def causal_flops(batch: int, seq: int, n_layer: int, hidden: int, vocab: int, k: int = 3) -> float:
    """Exact matmul FLOPs of one training step with causal attention counted as the lower triangle only."""
    return matmul_flops(batch, seq, n_layer, hidden, vocab, k, causal_density(seq))


def step_flops_causal(cfg: GPTConfig, global_batch: int, k: int) -> float:
    """Exact causal matmul FLOPs of one optimizer step over `global_batch` sequences of model `cfg`."""
    return causal_flops(global_batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.vocab_size, k)


def step_flops(cfg: GPTConfig, global_batch: int, k: int) -> float:
    """Megatron-formula FLOPs (the reported convention) of one optimizer step over `global_batch` sequences."""
    return megatron_flops(global_batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.vocab_size, k)


def fp8_linear_flops(batch: int, seq: int, n_layer: int, hidden: int, k: int = 3) -> float:
    """Matmul FLOPs of the blocks' four linear layers (QKV, proj, MLP fc and proj) in one training step: k*l*24*B*s*h^2,
    the matmuls --precision fp8 runs in FP8."""
    if k not in (3, 4):
        raise ValueError(f"k must be 3 (no recompute) or 4 (activation checkpointing), got {k}")
    return k * n_layer * 24.0 * batch * seq * hidden**2


def fp8_share(cfg: GPTConfig, global_batch: int, k: int) -> float:
    """Share of a step's exact causal matmul FLOPs (step_flops_causal) that the blocks' linear layers do: what an fp8
    run ran in FP8."""
    in_fp8 = fp8_linear_flops(global_batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, k)
    return in_fp8 / step_flops_causal(cfg, global_batch, k)


def megatron_params(n_layer: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameter count by the Megatron formula: 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)).

    Per layer: QKV + proj (4h^2 + 4h), MLP (8h^2 + 5h), two LayerNorms (4h): 12h^2 + 13h. Plus the tied
    token embedding V*h and the position table s*h (the final LayerNorm's 2h is left out, as in the paper).
    """
    return 12.0 * n_layer * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * n_layer * hidden))


# Dense (no 2:4 sparsity) peak tensor throughput in FLOP/s, from the vendors' datasheets, keyed by the exact name
# torch.cuda.get_device_name() reports. Exact, not by substring: "NVIDIA L40" contains "L4" (a third of its
# peak) and "NVIDIA H200 NVL" contains "H200" (the SXM part, 18% faster); a name not listed gets no MFU.
# fp32 is the TF32 tensor-core rate where the chip has one (what PyTorch uses for fp32 matmuls when allowed).
# fp8 is the dense FP8 tensor-core rate (e4m3/e5m2 inputs, fp32 accumulation: torch._scaled_mm's), twice the bf16
# rate: NVIDIA's H100 and H200 datasheets (SXM, PCIe, NVL) and the HGX B200's quote FP8 with sparsity at twice their
# BF16-with-sparsity figure, dense being half of either (tests/test_flops.py checks fp8 = 2 x bf16 wherever listed).
# Ampere, Volta and the A10G have no FP8 tensor cores. The Ada parts (L40S, L40, L4, RTX 4090) have them but no fp8
# entry yet (their FP8 figures are not checked against their datasheets here): an fp8 run there reports no fp8 MFU.
_H100_SXM = {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12, "fp8": 1978.8e12}
_NVL = {"bf16": 835.0e12, "fp16": 835.0e12, "fp32": 417.5e12, "fp8": 1670.0e12}  # H100 NVL and H200 NVL, per GPU
_A100 = {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}  # SXM and PCIe, 40 and 80 GB alike
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": {"bf16": 756.0e12, "fp16": 756.0e12, "fp32": 378.0e12, "fp8": 1512.0e12},
    "NVIDIA H100 NVL": _NVL,
    "NVIDIA H200": _H100_SXM,  # the SXM part: H100's compute, more and faster memory
    "NVIDIA H200 NVL": _NVL,
    "NVIDIA GH200 480GB": _H100_SXM,
    "NVIDIA GH200 144G HBM3e": _H100_SXM,
    "NVIDIA B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12, "fp8": 4500e12},
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A10G": {"bf16": 70e12, "fp16": 70e12, "fp32": 35e12},
    "NVIDIA L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12},
    "NVIDIA L40": {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12},
    "NVIDIA L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12},
    "Tesla V100-SXM2-16GB": {"fp16": 125e12, "fp32": 15.7e12},  # no bf16 on Volta
    "Tesla V100-SXM2-32GB": {"fp16": 125e12, "fp32": 15.7e12},
    "Tesla V100-PCIE-16GB": {"fp16": 112e12, "fp32": 14e12},
    "Tesla V100-PCIE-32GB": {"fp16": 112e12, "fp32": 14e12},
    "NVIDIA GeForce RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "fp32": 82.6e12},
}
# The SM clock (MHz) each datasheet peak above is quoted at, where its arithmetic is known: 132 SMs x 4096 dense
# bf16 FLOP per clock x 1830 MHz = 989.4 TFLOP/s (H100 SXM and H200; FP8 does 8192 per SM and clock). Under its power
# cap a GPU holds a lower clock in training (the run's telemetry, harness/telemetry.py), and its peak falls with it:
# peak_flops_at_clock.
PEAK_CLOCK_MHZ: dict[str, float] = {"NVIDIA H100 80GB HBM3": 1830.0, "NVIDIA H200": 1830.0}
_warned: set[str] = set()


def peak_flops(device_name: str | None, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of `device_name` at `precision`; None when the device is not in PEAK_FLOPS by its exact name
    (warned once per name: never guessed) or has no such precision."""
    if not device_name:
        return None
    table = PEAK_FLOPS.get(device_name.strip())
    if table is None:
        if device_name not in _warned:
            _warned.add(device_name)
            warnings.warn(f"no peak FLOP/s known for device {device_name!r}: MFU is not reported (add its exact name "
                          "and datasheet peaks to shared/flops.PEAK_FLOPS)", stacklevel=2)
        return None
    return table.get(precision)


def peak_flops_at_clock(device_name: str | None, precision: str, sm_mhz: float | None) -> float | None:
    """peak_flops at the SM clock `sm_mhz` instead of the datasheet's (a tensor core's FLOP per clock is fixed, so the
    peak scales with the clock); None where the peak, the clock it is quoted at (PEAK_CLOCK_MHZ) or sm_mhz is
    unknown."""
    quoted = PEAK_CLOCK_MHZ.get((device_name or "").strip())
    peak = peak_flops(device_name, precision) if quoted else None
    if peak is None or sm_mhz is None or not sm_mhz > 0:
        return None
    return peak * sm_mhz / quoted


def mfu(tflops_per_gpu: float | None, device_name: str | None, precision: str) -> float | None:
    """Model FLOPs utilisation: achieved TFLOPs per GPU over the device's peak; None when the peak is unknown."""
    peak = peak_flops(device_name, precision)
    if peak is None or tflops_per_gpu is None:
        return None
    return tflops_per_gpu * 1e12 / peak
