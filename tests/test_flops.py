import pytest
import torch

from shared.model import flops
from shared.model.config import preset
from shared.model.gpt import GPT, count_parameters


def test_study_model_has_1_65b_parameters_by_formula_and_by_count():
    cfg = preset("1.5b")
    by_formula = flops.megatron_params(cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.seq_len)
    assert round(by_formula / 1e9, 2) == 1.65
    with torch.device("meta"):
        model = GPT(cfg)
    # The formula leaves out the final LayerNorm (2h); everything else must match exactly.
    assert count_parameters(model) == pytest.approx(by_formula + 2 * cfg.n_embd, rel=1e-9)


def test_formula_matches_hand_computation_for_the_study_setting():
    # B = 36 per GPU x 8 GPUs = 288, s = 2048, l = 24, h = 2304, V = 50257, k = 4 (activation checkpointing).
    # 24*k*B*s*l = 96 * 288 * 2048 * 24 = 1,358,954,496 ; h^2 = 5,308,416
    # product 1,358,954,496 * 5,308,416 = 7,213,895,789,838,336
    # bracket 1 + 2048/13824 + 50257/884736 = 1 + 0.1481481 + 0.0568045 = 1.2049527
    # F = 7.213896e15 * 1.2049527 = 8.692403e15 FLOPs per step (8692 TFLOP; at 8 GPUs and the study's 124.49
    # TFLOPs/GPU that is a 8.73 s step).
    base = 1_358_954_496 * 5_308_416
    assert base == 7_213_895_789_838_336 == 24 * 4 * 288 * 2048 * 24 * 2304**2
    expected = 8.692403e15
    assert flops.megatron_flops(288, 2048, 24, 2304, 50257, k=4) == pytest.approx(expected, rel=1e-6)
    # k=3 is exactly 3/4 of it
    k4 = flops.megatron_flops(288, 2048, 24, 2304, 50257, k=4)
    assert flops.megatron_flops(288, 2048, 24, 2304, 50257, k=3) == pytest.approx(k4 * 0.75, rel=1e-12)


def test_sparse_flops_scale_only_the_attention_term():
    dense = flops.megatron_flops(8, 2048, 24, 2304, 50257, 3)
    assert flops.sparse_model_flops(8, 2048, 24, 2304, 50257, 3, 1.0) == pytest.approx(dense)
    half = flops.sparse_model_flops(8, 2048, 24, 2304, 50257, 3, 0.5)
    attention_term = 24 * 3 * 8 * 2048 * 24 * 2304**2 * (2048 / (6 * 2304))
    assert dense - half == pytest.approx(attention_term / 2)
    with pytest.raises(ValueError):
        flops.sparse_model_flops(8, 2048, 24, 2304, 50257, 3, 0.0)
    with pytest.raises(ValueError, match="k must be 3"):
        flops.megatron_flops(1, 1, 1, 1, 1, k=2)
    with pytest.raises(ValueError, match="k must be 3"):
        flops.sparse_model_flops(1, 1, 1, 1, 1, 2, 0.5)


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H200", "bf16", 989.4e12),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-SXM4-40GB", "fp16", 312e12),
        ("NVIDIA L40", "bf16", 181e12),  # not the L4's 121e12 although the name contains "L4"
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA L40S", "bf16", 362e12),
        ("NVIDIA H200 NVL", "bf16", 835e12),  # not the SXM part's 989.4e12
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on Volta: unknown, not guessed
        (None, "bf16", None),
    ],
)
def test_peak_lookup_by_device_name(name, precision, peak):
    assert flops.peak_flops(name, precision) == peak


@pytest.mark.parametrize("name", ["Some Future GPU", "NVIDIA L4 Extreme", "H200"])  # not a name torch reports
def test_an_unknown_device_gets_no_peak_and_one_warning_naming_it(name):
    flops._warned.discard(name)
    with pytest.warns(UserWarning, match=f"no peak FLOP/s known for device '{name}'"):
        assert flops.peak_flops(name, "bf16") is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second lookup of the same name stays quiet
        assert flops.peak_flops(name, "fp32") is None


def test_the_peak_at_a_held_clock_scales_the_datasheets_by_its_own_clock():
    # the datasheet's arithmetic: 132 SMs x 4096 dense bf16 FLOP per clock x 1830 MHz
    assert 132 * 4096 * flops.PEAK_CLOCK_MHZ["NVIDIA H200"] * 1e6 == pytest.approx(989.4e12, rel=1e-4)
    assert flops.peak_flops_at_clock("NVIDIA H200", "bf16", 1830.0) == pytest.approx(989.4e12)
    assert flops.peak_flops_at_clock("NVIDIA H100 80GB HBM3", "bf16", 1525.0) == pytest.approx(989.4e12 * 1525 / 1830)
    assert flops.peak_flops_at_clock("NVIDIA H200", "fp32", 915.0) == pytest.approx(494.7e12 / 2)
    # unknown: the clock a peak is quoted at (never guessed), no clock read, or no such precision
    assert flops.peak_flops_at_clock("NVIDIA A100-SXM4-80GB", "bf16", 1400.0) is None
    for mhz in (None, 0.0, -5.0, float("nan")):
        assert flops.peak_flops_at_clock("NVIDIA H200", "bf16", mhz) is None
    assert flops.peak_flops_at_clock(None, "bf16", 1500.0) is None


def test_mfu_is_null_for_unknown_devices():
    with pytest.warns(UserWarning, match="Mystery Accelerator"):
        assert flops.mfu(500.0, "Mystery Accelerator", "bf16") is None
    assert flops.mfu(494.7, "NVIDIA H200", "bf16") == pytest.approx(0.5)


def counted_step_flops(cfg, batch: int) -> tuple[float, float]:
    """FLOPs of one forward + backward of shared.model.GPT on the meta device, by torch's FlopCounterMode: the
    total, and the part inside the attention modules (QK^T and scores x V; sdpa on meta runs its math path,
    which the counter sees as dense batched matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = GPT(cfg).to("meta")
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device="meta")
    counter = FlopCounterMode(display=False)
    with counter:
        model(idx, idx).backward()
    by_module = counter.get_flop_counts()
    attention = sum(sum(ops.values()) for name, ops in by_module.items() if name.endswith(".attn.attn"))
    return counter.get_total_flops(), attention


# FlopCounterMode counts matmul-like ops only (mm, addmm without its bias add, bmm, attention kernels), and so do
# the formulas: biases, LayerNorm, softmax, GELU, dropout, the loss and the embedding's gather/scatter are
# elementwise or memory work that neither counts. The exact count must therefore agree to rounding (rel 1e-12),
# and the formula must differ from it by exactly its stated head undercount, not "about" it.
@pytest.mark.parametrize("recompute", [False, True])
def test_conventions_against_torchs_flop_counter_on_the_model(recompute):
    cfg = preset("1.5b", activation_checkpointing=recompute)
    B, s, L, h, V = 8, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.vocab_size
    k = 4 if recompute else 3
    total, attention = counted_step_flops(cfg, B)
    # exact matmul count, dense attention: what the counter sees (1.8394e14 per GPU at micro-batch 8, k=3)
    assert flops.matmul_flops(B, s, L, h, V, k) == pytest.approx(total, rel=1e-12)
    assert attention == pytest.approx(k * L * 4 * B * s * s * h, rel=1e-12)
    # the dense formula: exact at k=4 (the head is never recomputed); at k=3 it counts the head as 4.5BshV of 6
    formula = flops.megatron_flops(B, s, L, h, V, k)
    undercount = 0.0 if recompute else 1.5 * B * s * h * V
    assert formula == pytest.approx(total - undercount, rel=1e-12)
    if not recompute:
        assert (formula - total) / total == pytest.approx(-0.0155, abs=5e-5)
    # causal: the counter's dense attention scaled to the lower triangle with its diagonal
    causal = total - attention * (1 - flops.causal_density(s))
    assert flops.causal_flops(B, s, L, h, V, k) == pytest.approx(causal, rel=1e-12)
    if not recompute:
        assert formula / causal == pytest.approx(1.0479, abs=1e-4)  # the dense formula's +4.8% at the 1.5b preset


def test_causal_density_counts_the_diagonal():
    assert flops.causal_density(1) == 1.0 and flops.causal_density(4) == pytest.approx(10 / 16)
    with pytest.raises(ValueError, match="attention density"):
        flops.matmul_flops(1, 1, 1, 1, 1, 3, density=1.5)
