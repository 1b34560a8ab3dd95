"""FP8 training of the blocks' linear layers (`--precision fp8`): the one conversion both paths apply, and its refusals.

What runs in FP8. The four linear layers of every block (attention `qkv` and `proj`, MLP `fc` and `proj`) become
torchao's Float8Linear through `torchao.float8.convert_to_float8_training` with a module filter that names them. Each
of their three matmuls runs as a scaled FP8 matmul (torch._scaled_mm): the forward (input x weight, both cast to
float8 e4m3), the input gradient (output gradient x weight) and the weight gradient (output gradient x input); the
casts are dynamic, their scales computed from each tensor's absolute maximum at every call, one scale per tensor
(`tensorwise`, torchao's default recipe: the output gradient in e5m2) or per row (`rowwise`: all three in e4m3, scales
rounded to powers of two). Products accumulate in fp32 and come back in bf16.

What stays bf16: everything else. The parameters (Float8Linear keeps the bf16 weight and casts a copy at each call),
so DeepSpeed's dict is bf16's and ZeRO-3 gathers bf16 shards; the activations between the layers; the attention's
score and value products (every backend runs as in bf16); the embeddings; LayerNorms; and the tied LM head, whose
logits feed the loss directly (torchao's and torchtitan's float8 recipes leave the output projection in high
precision too). In model FLOPs (shared/model/flops.py) the four linears are 24 B s h^2 of each block's
24 B s h^2 + 4 B s^2 h per forward: `fp8_share` gives their share of a step's matmuls.

The conversion runs once, right after GPT(...) is built and before DeepSpeed's engine, in both paths
(shared/train/build.py). Float8Linear.from_float keeps the very Parameter objects (weight and bias), so ZeRO-3's
partitioned parameters, the optimizer's groups, the state dict's names and a checkpoint or export are those of the
bf16 model.

What cannot be converted is refused, never skipped: the fused tails (`--fused_bias_gelu`, `--fused_bias_dropout_add`,
and the Triton kernels that are their backward or mask) read the weight in their own kernels instead of through
nn.Linear's forward, so the blocks run them unfused under fp8 (shared/train/config.py makes that their default, the
fast profile's rule turns the Triton pieces off: shared/train/profiles.py); asked for explicitly, the run is refused.
So are a CPU or a GPU without FP8 tensor cores (compute capability below 8.9), a missing torchao, and a hidden size
torch._scaled_mm cannot multiply (a multiple of 16).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from typing import TYPE_CHECKING

from shared.model.config import GPTConfig

if TYPE_CHECKING:
    from torch import nn

RECIPES = ("tensorwise", "rowwise")
# The blocks' linear layers, as named under blocks.<i> (shared/model/gpt.py): the four that run in FP8.
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
_BLOCK_LINEAR = re.compile(r"blocks\.\d+\.(" + "|".join(re.escape(n) for n in BLOCK_LINEARS) + r")")
# The matmuls that stay bf16, by name, as the run JSON and the report say them.
KEPT_BF16 = ("head (tied LM head)", "attention scores and values")
# FP8 tensor cores: Ada (8.9), Hopper (9.0) and later; torch._scaled_mm refuses older GPUs.
MIN_CAPABILITY = (8, 9)
# The extra of pyproject.toml that installs torchao at the version this was written and tested against.
TORCHAO_VERSION = "0.18.0"
INSTALL = "pip install 'zero3-bench[fp8]'"
# torch._scaled_mm multiplies (M x K) by (K x N) only when K and N are multiples of 16: the blocks' K and N are h, 3h
# and 4h.
DIM_MULTIPLE = 16
# The fused switches that bypass nn.Linear's forward (or are the backward/mask of one that does), why each cannot be
# converted; under fp8 each is off unless asked for, and asking is refused (shared/train/config.py).
UNCONVERTIBLE = {
    "fused_bias_gelu": "the MLP's fused bias + GELU reads fc's weight in its own compiled kernel",
    "fused_bias_dropout_add": "the fused bias + dropout + residual add reads each proj's weight in its own compiled "
                              "kernel",
    "triton_gelu_grad": "it is the backward of the fused bias + GELU",
    "triton_dropout": "it draws the mask of the fused bias + dropout + residual add",
}


def device_capability() -> tuple[int, int] | None:
    """The first CUDA GPU's compute capability; None without one (torch imported when asked: the config that calls
    this stays light to import)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))


def device_refusal() -> str | None:
    """Why this machine cannot train in FP8, or None where it can."""
    capability = device_capability()
    if capability is None:
        return ("--precision fp8 runs the blocks' matmuls on FP8 tensor cores (compute capability 8.9+: Ada, Hopper, "
                "Blackwell); this machine has no CUDA GPU: use --precision bf16 here, or run fp8 on such a GPU")
    if capability < MIN_CAPABILITY:
        import torch

        name = torch.cuda.get_device_name(0)
        return (f"--precision fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); {name} has "
                f"{capability[0]}.{capability[1]}: use --precision bf16 on it")
    return None


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def torchao_refusal() -> str | None:
    if torchao_available():
        return None
    return (f"--precision fp8 trains through torchao's float8 training, and torchao is not installed: run "
            f"`{INSTALL}` (torchao=={TORCHAO_VERSION}), or use --precision bf16")


def shape_refusal(cfg: GPTConfig) -> str | None:
    if cfg.n_embd % DIM_MULTIPLE:
        return (f"--precision fp8 needs n_embd a multiple of {DIM_MULTIPLE} (torch._scaled_mm's operands), got "
                f"{cfg.n_embd}")
    return None


def is_block_linear(name: str) -> bool:
    """Whether the module named `name` (relative to the GPT) is one of the blocks' four linear layers."""
    return _BLOCK_LINEAR.fullmatch(name) is not None


def convert(model: nn.Module, recipe: str = "tensorwise") -> dict:
    """Swap the blocks' linear layers of `model` (a GPT) for torchao's Float8Linear under `recipe`, in place, and
    return what was done: {recipe, converted: [names], n_converted, skipped: [what stays bf16], torchao} (a run
    JSON's `fp8`; shared/train/build.py keeps it as the model's `fp8`). A block linear that is not a plain Linear (a
    fused tail's module) raises ValueError: the config refuses those first, and a conversion never skips one
    silently."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; choose one of {RECIPES}")
    from torch import nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from shared.model.gpt import Linear

    wanted = [name for name, _ in model.named_modules() if is_block_linear(name)]
    unconvertible = [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
                     if is_block_linear(name) and type(m) is not Linear]
    if unconvertible:
        raise ValueError(f"--precision fp8 converts the blocks' plain linear layers; these are fused modules that read "
                         f"their weight outside nn.Linear's forward: {unconvertible[:4]}: run them unfused "
                         "(--fused_bias_gelu false --fused_bias_dropout_add false)")
    converted: list[str] = []

    def keep(module: nn.Module, name: str) -> bool:
        if is_block_linear(name):
            converted.append(name)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(recipe))
    if sorted(converted) != sorted(wanted):
        raise RuntimeError(f"torchao converted {sorted(set(wanted) - set(converted))[:4]} of the block linears not")
    # what else multiplies: nn.Linear modules the filter passed over (none in this GPT), then the head and attention
    skipped = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name not in converted] + list(KEPT_BF16)
    return {"recipe": recipe, "converted": converted, "n_converted": len(converted), "skipped": skipped,
            "torchao": importlib.metadata.version("torchao")}


def describe(record: dict | None) -> str:
    """One line saying which matmuls ran in FP8 (a run JSON's `fp8`), for the run summary and compare's report."""
    if not record:
        return "none"
    kinds = sorted({n.split(".", 2)[2] for n in record["converted"]}, key=BLOCK_LINEARS.index)
    blocks = len({n.split(".")[1] for n in record["converted"]})
    share = f", {record['flops_share']:.0%} of the step's model FLOPs" if record.get("flops_share") else ""
    return (f"{record['recipe']}: {record['n_converted']} linears ({', '.join(kinds)} of {blocks} blocks; forward, "
            f"input and weight gradients){share}; bf16: {', '.join(record['skipped'])}")
