"""The network's configuration: GPTConfig (shape, attention, fused paths) and the named presets.

The fused switches are declared once, here (`FusedSwitches`): GPTConfig and the run config (shared/train/config.py
TrainConfig) both inherit them, so a flag, its doc (its --help) and its default rule have one source. Validation
lives in __post_init__ and raises ValueError naming the offending value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ATTENTION_BACKENDS = ("sdpa", "reference", "blocksparse", "flex", "xformers")
# Backends whose kernels run between compiled graphs (torch.compiler.disable: shared/model/attention/xformers.py): a
# whole-model compile breaks its graph at each of them. The block-sparse kernel is a torch custom op, one node of the
# graph (shared/kernels/blocksparse_attention.py).
GRAPH_BREAKING_BACKENDS = ("xformers",)
LAYOUTS = ("causal", "local", "strided", "dense")  # or a path to a saved bool tensor (see shared/model/layouts.py)


@dataclass
class FusedSwitches:
    """The model-level fused paths, one switch each. None (not given) means: on where a CUDA device is, where it was
    measured to win; CPU runs stay eager (`resolve_fused`)."""

    triton_loss: bool = False
    """the LM head's loss and its logits' gradient by one Triton kernel per row in forward, the backward's products
    scaled afterwards (shared/kernels/cross_entropy.py, shared/model/linear_cross_entropy.py); CUDA, or a CPU under
    TRITON_INTERPRET=1; on in compare.py's GPU default (bf16)"""
    fused_bias_dropout_add: bool | None = None
    """residual + dropout(x W^T + b) as one compiled kernel (shared/model/fused_ops.py); default: on with CUDA, off
    on CPU. Chosen from a single run per path, no repeat, inside single-run noise (docs/ledger.md, its row)"""
    fused_bias_gelu: bool | None = None
    """gelu(x W^T + b) as one compiled kernel (shared/model/fused_ops.py); default: on with CUDA, off on CPU. Chosen
    from a single run per path, as fused_bias_dropout_add, inside single-run noise (docs/ledger.md, its row)"""
    triton_gelu_grad: bool = False
    """with fused_bias_gelu: its backward (the input gradient and the bias gradient's sum over the B*T rows) as one
    Triton kernel (shared/kernels/bias_gelu_grad.py) instead of inductor's reduction kernel; CUDA, or a CPU under
    TRITON_INTERPRET=1"""
    triton_dropout: bool = False
    """with fused_bias_dropout_add: its keep mask drawn by a Triton kernel, eight 16-bit draws per Philox call
    instead of inductor's one per element (shared/kernels/dropout_mask.py; the rate p rounded to a multiple of
    1/65536); CUDA, or a CPU under TRITON_INTERPRET=1; on in compare.py's GPU default (with
    fused_bias_dropout_add)"""

    def resolve_fused(self) -> dict[str, bool]:
        """Each switch's value, None replaced by the default rule (on with CUDA, off on CPU)."""
        return {name: _on_cuda_by_default(getattr(self, name)) for name in FUSED_FLAGS}


# The switches' names (the fields of FusedSwitches), and the key each has in a result JSON's `fused` dict.
FUSED_FLAGS = tuple(f.name for f in dataclasses.fields(FusedSwitches))
FUSED_RESULT_KEYS = {"triton_loss": "triton_linear_cross_entropy",
                     "fused_bias_dropout_add": "bias_dropout_add", "fused_bias_gelu": "bias_gelu",
                     "triton_gelu_grad": "bias_gelu_triton_grad",
                     "triton_dropout": "dropout_triton_mask"}
assert set(FUSED_RESULT_KEYS) == set(FUSED_FLAGS), "every fused switch needs its result key"


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (torch imported only when asked: config parsing stays light)."""
    import torch

    return torch.cuda.is_available()


def _on_cuda_by_default(flag: bool | None) -> bool:
    return cuda_available() if flag is None else flag


@dataclass
class GPTConfig(FusedSwitches):
    """Shape of the GPT and how its attention is computed."""

    n_layer: int = 2
    """number of transformer blocks (l in the FLOPs formula)"""
    n_head: int = 4
    """attention heads per block"""
    n_embd: int = 64
    """hidden size (h in the FLOPs formula)"""
    seq_len: int = 128
    """tokens per sample (s); also the size of the learned position table"""
    vocab_size: int = 256
    """vocabulary size (V); 50257 is GPT-2's BPE, 256 the byte-level tokenizer"""
    vocab_multiple: int = 1
    """pad the token embedding and the tied LM head to a multiple of this many rows (128: 50257 -> 50304, whole
    matmul tiles for the head's three matmuls). The padded rows start at zero, are never an input, and their logits
    are cut off before the loss and before any caller sees them: the loss, the FLOPs formula and exported weights
    stay on vocab_size"""
    dropout: float = 0.1
    """dropout on embeddings and on both residual branches (the original study used 0.1)"""
    attn_dropout: float = 0.1
    """dropout on the attention probabilities"""
    bias: bool = True
    """biases in Linear and LayerNorm layers (GPT-2/Megatron style)"""
    attention: str = "sdpa"
    """attention backend: one of ATTENTION_BACKENDS"""
    attn_dropout_mask: str = "philox"
    """blocksparse with attention dropout: philox (each kernel draws the mask) | bits (drawn once per call into
    T*T/8 bytes a head, read by the three kernels; the same mask)"""
    layout: str = "causal"
    """block layout for sparse backends: causal | local | strided | dense | path to a .pt bool tensor"""
    sparse_block: int = 128
    """tokens per layout block (the original study used 128)"""
    local_blocks: int = 4
    """window of the `local` layout, in blocks (each query block sees itself and local_blocks-1 before it)"""
    stride_blocks: int = 4
    """segment length of the `strided` layout, in blocks (Sparse Transformer's fixed pattern)"""
    activation_checkpointing: bool = False
    """recompute each block in backward (torch.utils.checkpoint): FLOPs factor k=4 instead of 3"""

    def __post_init__(self) -> None:
        for name, value in self.resolve_fused().items():  # the model runs a decided path, never "default"
            setattr(self, name, value)
        for name in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "vocab_multiple", "sparse_block",
                     "local_blocks", "stride_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                f"head_dim would be {self.n_embd / self.n_head:g}"
            )
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention!r}; choose one of {ATTENTION_BACKENDS}")
        if self.attn_dropout_mask not in ("philox", "bits"):
            raise ValueError(f"unknown attn_dropout_mask {self.attn_dropout_mask!r}; choose philox or bits")
        if self.attn_dropout_mask == "bits" and self.attention != "blocksparse":
            raise ValueError(f"attn_dropout_mask 'bits' is the blocksparse kernel's; attention {self.attention!r} "
                             "draws its own dropout mask")
        if self.seq_len % self.sparse_block != 0:
            nearest = max(1, round(self.seq_len / self.sparse_block)) * self.sparse_block
            raise ValueError(
                f"seq_len ({self.seq_len}) must be a multiple of sparse_block ({self.sparse_block}) "
                "so that the block layout tiles the sequence (every attention backend reads its mask from that "
                f"layout; the preset fixes the block): use e.g. --seq_len {nearest}"
            )
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if self.layout not in LAYOUTS and not self.layout.endswith(".pt"):
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {LAYOUTS} or a path to a .pt file")
        if self.triton_gelu_grad and not self.fused_bias_gelu:
            raise ValueError("triton_gelu_grad changes the backward of fused_bias_gelu, which is off here (it is off "
                             "on CPU unless asked): turn on fused_bias_gelu too")
        if self.triton_dropout and not self.fused_bias_dropout_add:
            raise ValueError("triton_dropout draws the mask of fused_bias_dropout_add, which is off here (it is off "
                             "on CPU unless asked): turn on fused_bias_dropout_add too")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the token embedding and LM head: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_blocks(self) -> int:
        return self.seq_len // self.sparse_block


# Megatron/GPT-3-style sizes. `1.5b` is the original study's model (n_embd 2304, 24 layers, 24 heads, seq 2048,
# vocab 50257), 1.65B parameters by the Megatron formula (shared/model/flops.py). `tiny` runs a CPU step in
# milliseconds.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, seq_len=128, vocab_size=256, sparse_block=16,
                 local_blocks=2, stride_blocks=4),
    "125m": dict(n_layer=12, n_head=12, n_embd=768, seq_len=2048, vocab_size=50257),
    "350m": dict(n_layer=24, n_head=16, n_embd=1024, seq_len=2048, vocab_size=50257),
    "760m": dict(n_layer=24, n_head=16, n_embd=1536, seq_len=2048, vocab_size=50257),
    "1.5b": dict(n_layer=24, n_head=24, n_embd=2304, seq_len=2048, vocab_size=50257),
    "3b": dict(n_layer=26, n_head=24, n_embd=3072, seq_len=2048, vocab_size=50257),
}


def preset(name: str, **overrides) -> GPTConfig:
    """GPTConfig of a named preset, with field overrides (None values are ignored)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {tuple(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {sorted(unknown)}")
    kwargs = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
    return GPTConfig(**kwargs)


def fused_paths(cfg: GPTConfig) -> dict[str, bool]:
    """Every optional fused path and whether this model runs it (recorded in each result JSON, under `fused`)."""
    return {FUSED_RESULT_KEYS[name]: getattr(cfg, name) for name in FUSED_FLAGS}
