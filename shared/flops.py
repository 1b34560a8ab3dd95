"""FLOPs of a GPT training step, and the peak a device can do: the one place both are written.

Megatron/BigScience formula (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters", sec. 5.1; used by BigScience and by the original min-LLM study). For a batch of B sequences of s
tokens, l layers, hidden size h and vocabulary V, one forward pass of one transformer layer costs
  - QKV projection        2*B*s*h*3h   = 6  B s h^2
  - attention scores QK^T  2*B*s*s*h    = 2  B s^2 h
  - scores x V            2*B*s*s*h    = 2  B s^2 h
  - output projection     2*B*s*h*h    = 2  B s h^2
  - MLP (h -> 4h -> h)    2*2*B*s*h*4h = 16 B s h^2
  total 24 B s h^2 + 4 B s^2 h = 24 B s h^2 (1 + s/(6h)), and the LM head adds 2 B s h V once.
Summed over l layers: 24 B s l h^2 (1 + s/(6h) + V/(16 l h)) per forward.
Backward costs twice the forward, so a step costs k = 3 forwards; with activation recomputation the forward runs
again in backward: k = 4. Hence

    F = 24 * k * B * s * l * h^2 * (1 + s/(6h) + V/(16 l h)).

Conventions, stated because they move the number:
  - attention is counted as a *dense* s x s product, as Megatron does, even though causal attention only needs
    the lower triangle: this is the figure the original study reported (its 124.49 / 129.24 / 119.65 TFLOPs).
  - elementwise work (softmax, LayerNorm, GELU, dropout) is not counted.
  - `sparse_model_flops` scales the attention term s/(6h) by the layout's density (the share of the s x s grid
    the layout visits; ~0.5 for causal), giving the work a sparse-aware kernel must do at minimum.
TFLOPs per GPU = F / (step time * n_gpus), with B the global batch of that step.
"""

from __future__ import annotations

from shared.config import GPTConfig


def megatron_flops(batch: int, seq: int, n_layer: int, hidden: int, vocab: int, k: int = 3) -> float:
    """FLOPs of one training step of `batch` sequences: 24*k*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))."""
    if k not in (3, 4):
        raise ValueError(f"k must be 3 (no recompute) or 4 (activation checkpointing), got {k}")
    return 24.0 * k * batch * seq * n_layer * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * n_layer * hidden))


def sparse_model_flops(batch: int, seq: int, n_layer: int, hidden: int, vocab: int, k: int, density: float) -> float:
    """As megatron_flops, with the attention term s/(6h) scaled by the layout density (1.0 = dense)."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"layout density must be in (0, 1], got {density}")
    return 24.0 * k * batch * seq * n_layer * hidden**2 * (
        1 + density * seq / (6 * hidden) + vocab / (16 * n_layer * hidden)
    )


def step_flops(cfg: GPTConfig, global_batch: int, k: int) -> float:
    """Megatron FLOPs of one optimizer step over `global_batch` sequences of model `cfg`."""
    return megatron_flops(global_batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.vocab_size, k)


def megatron_params(n_layer: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameter count by the Megatron formula: 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)).

    Per layer: QKV + proj (4h^2 + 4h), MLP (8h^2 + 5h), two LayerNorms (4h): 12h^2 + 13h. Plus the tied
    token embedding V*h and the position table s*h (the final LayerNorm's 2h is left out, as in the paper).
    """
    return 12.0 * n_layer * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * n_layer * hidden))


# Dense (no 2:4 sparsity) peak tensor throughput in FLOP/s, from the vendors' datasheets, matched by a substring
# of the name torch.cuda.get_device_name() reports; the first match wins, so specific names come first.
# fp32 is the TF32 tensor-core rate where the chip has one (what PyTorch uses for fp32 matmuls when allowed).
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12}),
    ("H100 PCIe", {"bf16": 756.0e12, "fp16": 756.0e12, "fp32": 378.0e12}),
    ("H100 NVL", {"bf16": 835.0e12, "fp16": 835.0e12, "fp32": 417.5e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 35e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "fp32": 82.6e12}),
]


def peak_flops(device_name: str | None, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of `device_name` at `precision`, or None when the device is unknown (never guessed)."""
    if not device_name:
        return None
    for key, table in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return table.get(precision)
    return None


def mfu(tflops_per_gpu: float | None, device_name: str | None, precision: str) -> float | None:
    """Model FLOPs utilisation: achieved TFLOPs per GPU over the device's peak; None when the peak is unknown."""
    peak = peak_flops(device_name, precision)
    if peak is None or tflops_per_gpu is None:
        return None
    return tflops_per_gpu * 1e12 / peak
