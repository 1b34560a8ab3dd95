"""The run's configuration: TrainConfig, every flag of a training or benchmark run.

Both training paths, compare.py and the tests build it; CLI flags are the field names (`--micro_batch` and
`--micro-batch` both work, see shared/train/cli.py). The network's own fields (preset, shape overrides, the fused
switches) come from shared/model/config.py. Validation lives in __post_init__ and raises ValueError naming the
offending value, so a bad flag fails before any process group or GPU is touched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shared.model import config as model_config
from shared.model import fp8
from shared.model.config import (  # noqa: F401  (ATTENTION_BACKENDS, LAYOUTS: named in field docs, see cli.py)
    ATTENTION_BACKENDS,
    FUSED_FLAGS,
    LAYOUTS,
    PRESETS,
    FusedSwitches,
    GPTConfig,
    preset,
)

PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
# fp8 trains a bf16 model whose blocks' linear layers run in FP8 (shared/model/fp8.py): its parameters, activations,
# attention and DeepSpeed dict are bf16's. What every other part of a run reads as the precision of its tensors.
TENSOR_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp8": "bf16"}
ZERO_PROFILES = ("original", "tuned")
# The speed profiles, declared in shared/train/profiles.py
PROFILES = ("fast", "stock", "eager")
# How the model is compiled, applied from outside the model: blocks by shared/train/compile.py (each block's forward
# compiled), deepcompile by DeepSpeed's compiler pass for ZeRO (the engine compiles the whole GPT forward + loss;
# shared/train/ds_config.py).
COMPILE_MODES = ("none", "blocks", "deepcompile")
# DeepCompile profiles its first steps and recompiles with prefetching at this global step (deepspeed/compile/
# init_z3.py WARMUP): a timed step must come after it.
DEEPCOMPILE_WARMUP = 5
# When DeepCompile runs its ZeRO-3 passes (shared/train/ds_runtime.deepcompile_schedule): deepspeed = its own
# schedule (gather/release at step 0, then a second whole compile at step 5 with prefetching and selective
# gathering); once = all three passes at step 0 from the first step's profile, one compile instead of two.
DEEPCOMPILE_SCHEDULES = ("deepspeed", "once")
# Which parameters DeepCompile keeps gathered from the start (shared/patches/deepcompile_passes.py): threshold = those
# at most ZeRO-3's persistence threshold, their releases taken out of the compiled graphs; deepspeed = none (its own).
DEEPCOMPILE_PERSIST = ("threshold", "deepspeed")
# Eager ZeRO-3's list of persistent parameters under DeepCompile (shared/patches/deepcompile.drop_eager_persistent):
# drop = emptied, so the optimizer step no longer gathers them eagerly; deepspeed = kept (DeepSpeed 0.19.8).
DEEPCOMPILE_EAGER_PERSIST = ("drop", "deepspeed")
# Where DeepCompile's op waits for its reduce-scatters at the end of the backward (shared/patches/deepcompile_op.py):
# host = DeepSpeed 0.19.8's stream synchronize; device = the compute stream waits on an event, the host goes on.
DEEPCOMPILE_BACKWARD_WAITS = ("host", "device")
NAN_POLICIES = ("stop", "skip")
# The ZeRO-3 optimizer step (shared/patches/zero3_step.py): fast = the gradient norm and fp32 gradient copy on the flat
# gradient buffer, one kernel each, and the unscale inside torch's fused AdamW; deepspeed = DeepSpeed's per-parameter
# loops and its multiply; fused = fast with the fp32 gradient copy, torch's AdamW and the 16-bit parameter copy in one
# Triton kernel (shared/kernels/adamw.py).
ZERO3_STEPS = ("fast", "fused", "deepspeed")
# Where the ZeRO-3 step checks the gradient norm for inf/NaN (shared/patches/zero3_step.py): host = DeepSpeed 0.19.8's
# bool() of the device value; device = the flag stays on the device and the update skips itself there.
GRAD_NORM_CHECKS = ("host", "device")


@dataclass
class TrainConfig(FusedSwitches):
    """One training or benchmark run; both paths read exactly these fields (the fused switches: FusedSwitches)."""

    preset: str = "tiny"
    """model preset: one of PRESETS"""
    stage: int = 3
    """ZeRO stage 0-3"""
    precision: str = "bf16"
    """bf16 | fp16 | fp32 | fp8 (Lightning's bf16-mixed/bf16-true/16-mixed/32-true and float8 are accepted and
    mapped). fp8: bf16 training whose blocks' linear layers (attention qkv/proj, MLP fc/proj) run their matmuls in FP8
    through torchao's float8 training (--fp8_recipe; shared/model/fp8.py, docs/fp8.md); needs a GPU of compute
    capability 8.9+ and `pip install 'zero3-bench[fp8]'`"""
    fp8_recipe: str = "tensorwise"
    """with --precision fp8: torchao's scaling recipe, tensorwise (one dynamic scale per tensor, torchao's default) |
    rowwise (one per row, power-of-two scales)"""
    micro_batch: int = 2
    """sequences per GPU per micro-step (the original study's --batch_size_per_gpu)"""
    grad_accum: int = 1
    """micro-steps per optimizer step"""
    steps: int = 20
    """optimizer steps to run (warmup included)"""
    warmup_steps: int = 5
    """first steps excluded from every timing figure (allocator, cuDNN/Triton autotune, DeepSpeed warm-up)"""
    lr: float = 3e-4
    """peak learning rate"""
    min_lr: float = 3e-5
    """learning rate at the end of the cosine decay"""
    lr_warmup_steps: int = 10
    """linear LR warmup steps before the cosine decay"""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to the matrices (linear weights, the token and position embeddings), not to biases
    or LayerNorm parameters (nanoGPT, Megatron)"""
    grad_clip: float = 1.0
    """global gradient-norm clip, handed to DeepSpeed's gradient_clipping (0 disables)"""
    seed: int = 1234
    """seeds model init, dropout and the data order"""
    attention: str | None = None
    """override the preset's attention backend"""
    attn_dropout_mask: str | None = None
    """blocksparse with attention dropout: philox (each kernel draws the mask, the default) | bits (drawn once per
    call, T*T/8 bytes a head kept for the backward)"""
    layout: str | None = None
    """override the preset's block layout"""
    seq_len: int | None = None
    """override the preset's sequence length"""
    n_layer: int | None = None
    """override the preset's number of blocks"""
    n_head: int | None = None
    """override the preset's number of heads"""
    n_embd: int | None = None
    """override the preset's hidden size"""
    vocab_size: int | None = None
    """override the preset's vocabulary (e.g. 256 for the byte tokenizer, the BPE size for a trained one)"""
    vocab_multiple: int | None = None
    """pad the embedding and LM head to a multiple of this many rows (GPTConfig.vocab_multiple; 128: 50257 ->
    50304); loss, FLOPs and exported weights stay on the real vocabulary. Default: the preset's (1, no padding);
    128 in compare.py's GPU default"""
    dropout: float | None = None
    """override both dropout rates of the preset"""
    activation_checkpointing: bool = False
    """recompute blocks in backward (FLOPs factor k=4)"""
    profile: str | None = None
    """speed profile: one of PROFILES, or list to print them (shared/train/profiles.py): fills every speed
    setting not given as a flag. Default: fast on a CUDA GPU, eager without one"""
    compile: str = "none"
    """none | blocks | deepcompile. blocks: torch.compile each block (a DeepSpeed ZeRO-3 leaf module; see
    shared/train/compile.py). deepcompile: DeepSpeed's compiler pass for ZeRO 1-3 (CUDA only): engine.compile()
    compiles the whole GPT forward and loss and schedules the gathers and reduce-scatters inside the graph; fastest
    mode measured (docs/ledger.md) and the fast profile's; each 1.5b run warms up for minutes while it compiles
    (--deepcompile_schedule; the warm-up times: docs/results.md, DeepCompile section); validation between steps runs
    eagerly outside its graphs (shared/train/validation.py)"""
    deepcompile_schedule: str = "deepspeed"
    """deepspeed | once: when DeepCompile runs its ZeRO-3 passes. deepspeed: DeepSpeed's schedule (gather/release
    from step 0, a second whole compile at step 5 adds prefetching and selective gathering); once: all three passes
    at step 0, from the first step's profile, so the model is compiled once (a shorter warm-up: docs/ledger.md).
    ZeRO 1/2 compile once either way"""
    deepcompile_persist: str = "threshold"
    """threshold | deepspeed: ZeRO-3 parameters DeepCompile keeps gathered from the first compile. threshold: those
    of at most the ZeRO-3 persistence threshold (the biases and LayerNorms of the presets), as eager ZeRO-3 does,
    with their release ops taken out of the compiled graphs so inductor fuses across them
    (shared/patches/deepcompile_passes.py); deepspeed: DeepSpeed's own (none; its selective gathering may add some).
    Only with --compile deepcompile at stage 3"""
    deepcompile_eager_persist: str = "drop"
    """drop | deepspeed: eager ZeRO-3's list of persistent parameters, under DeepCompile at stage 3. ZeRO-3 lists
    them when the engine is built and all-gathers them after every optimizer step; DeepCompile turns persistence off
    but keeps the list, so each step gathered the small parameters eagerly and the next forward partitioned them
    again, host work the device waits on (docs/results.md). drop: the list is emptied after DeepCompile is set up
    (shared/patches/deepcompile.drop_eager_persistent); deepspeed: kept, DeepSpeed 0.19.8's behaviour. Only with
    --compile deepcompile at stage 3"""
    deepcompile_cached_walks: bool = True
    """under DeepCompile at stage 3: the host's walks of the model around each step (ZeRO-3's release of every
    parameter at the optimizer step, the eager-fallback context's marking of every module at each forward) over
    lists taken once (shared/patches/deepcompile.cache_deepcompile_walks); same behaviour, less Python the device
    waits on (measured in docs/ledger.md). false: DeepSpeed 0.19.8's own walks. Only with --compile deepcompile at
    stage 3 (other modes and stages ignore it, as they do --deepcompile_persist)"""
    deepcompile_backward_wait: str = "host"
    """host | device: how DeepCompile's op waits for its last reduce-scatters at the end of each backward. host:
    DeepSpeed 0.19.8's op, whose host waits for its reduce-scatter stream, so the device idles while the host runs
    the autograd engine's end and the optimizer step's Python (docs/results.md); device: the same op built from
    DeepSpeed's sources with that wait made the compute stream's, on an event (shared/patches/deepcompile_op.py; built
    once per machine on first use). Same results, other timing (measured in docs/ledger.md); compare.py's GPU
    default when its runs use one GPU. Only with --compile deepcompile"""
    coordinate_descent_tuning: bool = False
    """inductor's coordinate-descent tuning (torch._inductor.config.coordinate_descent_tuning): each generated
    Triton kernel's block sizes and warps are benchmarked around the default at its first compile and the best is
    cached with the compiled code (TORCHINDUCTOR_CACHE_DIR); it speeds up the LayerNorm + dropout and GELU kernels
    (docs/results.md, "Levers on top of DeepCompile"; its ratio: docs/ledger.md). A cold cache adds the tuning to
    the warm-up, a warm one nothing; CUDA only. compare.py's GPU default (DeepCompile) turns it on"""
    zero3_step: str = "fast"
    """fast | fused | deepspeed: the ZeRO-3 optimizer step's gradient norm, fp32 gradient copy and unscale. fast: one
    kernel each on the flat gradient buffer (shared/patches/zero3_step.py; norm accumulated in fp32) and the
    unscale/clip factor handed to torch's fused AdamW instead of a multiply pass; fused: fast, with the gradient copy,
    torch's AdamW and the copy of the fp32 parameters into the 16-bit ones in one Triton kernel (AdamW only; on a CPU
    under TRITON_INTERPRET=1 only); deepspeed: DeepSpeed's own per-parameter loops (norm in fp64) and multiply. Other
    stages ignore it; compare.py's GPU default (DeepCompile, AdamW) runs fused"""
    grad_norm_check: str = "host"
    """host | device: where the ZeRO-3 step checks its global gradient norm for inf/NaN (DeepSpeed then skips the
    update). host: DeepSpeed 0.19.8's check, which makes the host wait for the backward and the norm, so the device
    idles while the host then launches the rest of the step; device: the flag stays on the device and each update
    skips itself there when it is set (shared/patches/zero3_step.py): the same parameters, moments and step counts,
    but the engine does not learn of a skip during the step (its learning-rate schedule advances, as torch's with a
    GradScaler does; the run JSON's zero3_step_calls.norm_skipped counts skips). Measured in docs/ledger.md;
    compare.py's GPU default when its runs use one GPU. bf16/fp32 only (fp16's loss scale needs the host); with
    --zero3_step fast or fused at stage 3"""
    zero_profile: str = "tuned"
    """DeepSpeed config rules: tuned (the default; see shared/train/ds_config.py; chosen from a single pair of runs per
    profile, raw first, inside single-pair noise: docs/ledger.md) | original (the 2022 study's bucket sizes and
    DeepSpeed's synchronized throughput timer)"""
    reduce_bucket_size: int | None = None
    """override the profile's ZeRO reduce bucket (elements)"""
    prefetch_bucket_size: int | None = None
    """override the profile's ZeRO-3 prefetch bucket (elements)"""
    param_persistence_threshold: int | None = None
    """override the profile's ZeRO-3 persistence threshold (params at most this large stay gathered)"""
    ds_config: str | None = None
    """path to a user DeepSpeed JSON that replaces the built dict (micro-batch and precision must agree)"""
    wall_clock_breakdown: bool = False
    """turn on DeepSpeed's own synchronized forward/backward/step timers (diagnostics: adds syncs)"""
    lightning_overheads: str = ""
    """comma-separated overheads to switch on in the Lightning path (names: lightning_app/overheads.py; compare.py
    --explain runs each); the raw loop ignores them"""
    data: str = "synthetic"
    """synthetic (seeded random tokens), kjv (the shipped text, data/kjv.txt, as byte tokens: made on first use) or
    the prefix of a token file made by `python -m shared.tools.prepare_data`"""
    profile_step: int | None = None
    """run this step (counted from the run's first, 0) under torch.profiler, with a device sync at each phase
    boundary, and write its summary into the result JSON (extra.profile: per phase wall, busy and idle ms, kernel
    ms per kind, top kernels; shared/train/step_profile.py). Must be a warm-up step (< warmup_steps), so no timed
    step is perturbed; with DeepCompile pick one after its compiles (e.g. warmup_steps - 1)"""
    profile_stack: bool = False
    """with profile_step: record Python frames too (torch.profiler's with_stack), so that the host code the device
    waited on is named down to the Python function (extra.profile idle.host_ops / host_inclusive; CUDA). Tracing
    every Python call slows the host, so that step's idle times grow: read the frames, not the milliseconds"""
    profile_sync: bool = True
    """with profile_step: synchronize the device at each of that step's phase boundaries (true: each phase's kernels
    run inside it, and its idle time includes the host's work before its first kernel), or profile the step as
    timed steps run (false: kernels attributed to the phase that launched them, walls and idle on the device's
    timeline; the step's idle is then what a step in flight idles)"""
    sync_check_step: int | None = None
    """record the calls of this step (counted from the run's first, 0) that made the host wait for the device
    (.item(), any device-to-host copy, a stream's synchronize; not torch.cuda.synchronize()), each with its phase
    and Python stack, into the result JSON (extra.syncs; shared/train/sync_check.py; CUDA). Must be a warm-up step
    other than profile_step"""
    log_every: int = 10
    """print a progress line every N steps (read asynchronously: no extra host sync)"""
    out: str = "runs/result.json"
    """where rank 0 writes the RunResult JSON"""
    devices: int | None = None
    """processes/GPUs for launchers that spawn themselves (Lightning); default: all GPUs, else 1 CPU process"""
    ckpt_dir: str | None = None
    """folder for DeepSpeed sharded checkpoints (one stepNNNNNNNN/ folder each); none: no checkpoints"""
    save_every: int = 0
    """save a checkpoint every N steps (0: only at the end, and on SIGTERM); needs ckpt_dir"""
    keep_last: int = 3
    """complete checkpoints to keep; older ones are deleted after each save (0 keeps all)"""
    resume: str = "none"
    """none | auto (the newest complete checkpoint in ckpt_dir, if any) | path to a stepNNNNNNNN folder"""
    trust_checkpoint: bool = False
    """allow checkpoint files that weights_only=True cannot open (DeepSpeed unpickles them): only for trusted files"""
    val_every: int = 0
    """validation loss and perplexity every N steps on the data's validation split (0: off)"""
    val_batches: int = 8
    """micro-batches per validation"""
    nan_policy: str = "stop"
    """stop: a non-finite loss stops the run (checked at log intervals and before every save, no per-step sync);
    skip: check every micro-step's loss before backward (one host sync per step) and skip non-finite ones"""
    max_nan_skips: int = 10
    """with nan_policy=skip, stop after this many skipped micro-steps"""
    log_csv: str | None = None
    """append loss, LR, grad norm, TFLOPs, MFU and memory at every log interval to this CSV file"""
    export: str | None = None
    """at the end, gather the live weights and write them (fp32) to this .safetensors file"""

    def __post_init__(self) -> None:
        self.precision = normalize_precision(self.precision)
        if self.fp8_recipe not in fp8.RECIPES:
            raise ValueError(f"unknown fp8_recipe {self.fp8_recipe!r}; choose one of {fp8.RECIPES}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {tuple(PRESETS)}")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage!r}")
        for name in ("micro_batch", "grad_accum", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be >= 0 and below steps ({self.steps}): "
                "at least one step must be timed"
            )
        if self.profile_step is not None and not 0 <= self.profile_step < self.warmup_steps:
            raise ValueError(f"profile_step ({self.profile_step}) must be >= 0 and below warmup_steps "
                             f"({self.warmup_steps}): the profiled step is slowed by the profiler and its syncs, so "
                             "it must be one of the steps no timing figure counts")
        if self.profile_stack and self.profile_step is None:
            raise ValueError("profile_stack records Python frames in the profiled step: give --profile_step too")
        if not self.profile_sync and self.profile_step is None:
            raise ValueError("profile_sync false changes how the profiled step is recorded: give --profile_step too")
        if self.sync_check_step is not None:
            if not 0 <= self.sync_check_step < self.warmup_steps:
                raise ValueError(f"sync_check_step ({self.sync_check_step}) must be >= 0 and below warmup_steps "
                                 f"({self.warmup_steps}): recording each sync's stack slows that step, so it must be "
                                 "one of the steps no timing figure counts")
            if not model_config.cuda_available():
                raise ValueError("--sync_check_step records the step's synchronizing CUDA calls; this machine has no "
                                 "CUDA GPU, so there are none to record: drop it")
            if self.sync_check_step == self.profile_step:
                raise ValueError(f"sync_check_step and profile_step are both {self.profile_step}: the profiler's own "
                                 "syncs would be recorded as the step's; check another warm-up step")
        if not 0 < self.lr < math.inf:  # also refuses NaN
            raise ValueError(f"lr must be positive and finite, got {self.lr!r}")
        for name in ("min_lr", "weight_decay", "grad_clip", "lr_warmup_steps"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr!r} is above lr {self.lr!r}: the cosine schedule would rise from lr "
                             "to min_lr instead of decaying; lower --min_lr (e.g. lr / 10) or raise --lr")
        if self.profile is not None and self.profile not in PROFILES:
            raise ValueError(f"unknown --profile {self.profile!r}; choose one of {PROFILES}")
        if self.zero_profile not in ZERO_PROFILES:
            raise ValueError(f"unknown zero_profile {self.zero_profile!r}; choose one of {ZERO_PROFILES}")
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(f"unknown nan_policy {self.nan_policy!r}; choose one of {NAN_POLICIES}")
        for name in ("save_every", "keep_last", "val_every", "max_nan_skips"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.nan_policy == "skip" and self.grad_accum > 1:
            raise ValueError("nan_policy skip needs grad_accum 1: DeepSpeed counts micro-steps, and a skipped "
                             "micro-step inside an accumulation window would shift its boundaries")
        if self.val_batches <= 0:
            raise ValueError(f"val_batches must be positive, got {self.val_batches!r}")
        if (self.save_every or self.resume == "auto") and not self.ckpt_dir:
            raise ValueError("--save_every and --resume auto need --ckpt_dir")
        if self.log_every <= 0:
            raise ValueError(f"log_every must be positive, got {self.log_every!r}")
        if self.devices is not None and self.devices <= 0:
            raise ValueError(f"devices must be positive, got {self.devices!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {self.compile!r}; choose one of {COMPILE_MODES}")
        if self.deepcompile_persist not in DEEPCOMPILE_PERSIST:
            raise ValueError(f"unknown deepcompile_persist {self.deepcompile_persist!r}; choose one of "
                             f"{DEEPCOMPILE_PERSIST}")
        if self.deepcompile_eager_persist not in DEEPCOMPILE_EAGER_PERSIST:
            raise ValueError(f"unknown deepcompile_eager_persist {self.deepcompile_eager_persist!r}; choose one of "
                             f"{DEEPCOMPILE_EAGER_PERSIST}")
        if self.deepcompile_backward_wait not in DEEPCOMPILE_BACKWARD_WAITS:
            raise ValueError(f"unknown deepcompile_backward_wait {self.deepcompile_backward_wait!r}; choose one of "
                             f"{DEEPCOMPILE_BACKWARD_WAITS}")
        if self.deepcompile_backward_wait != "host" and self.compile != "deepcompile":
            raise ValueError(f"--deepcompile_backward_wait {self.deepcompile_backward_wait} changes DeepCompile's op, "
                             f"which --compile {self.compile} does not run: add --compile deepcompile or drop it")
        if self.deepcompile_schedule not in DEEPCOMPILE_SCHEDULES:
            raise ValueError(f"unknown deepcompile_schedule {self.deepcompile_schedule!r}; choose one of "
                             f"{DEEPCOMPILE_SCHEDULES}")
        if self.zero3_step not in ZERO3_STEPS:
            raise ValueError(f"unknown zero3_step {self.zero3_step!r}; choose one of {ZERO3_STEPS}")
        if self.grad_norm_check not in GRAD_NORM_CHECKS:
            raise ValueError(f"unknown grad_norm_check {self.grad_norm_check!r}; choose one of {GRAD_NORM_CHECKS}")
        refusal = device_norm_check_refusal(self.stage, self.zero3_step, self.precision)
        if self.grad_norm_check == "device" and refusal:
            raise ValueError(refusal)
        if self.compile == "deepcompile":
            _check_deepcompile(self)
        if self.coordinate_descent_tuning and not model_config.cuda_available():
            raise ValueError("--coordinate_descent_tuning tunes inductor's Triton kernels, which only run on a CUDA "
                             "GPU; on this machine inductor emits C++ and the flag would change nothing: drop it")
        # Built once, here: the model overrides are validated now, not after the process group is up, and every
        # caller reads the same object (dataclasses.replace runs __post_init__ again, so a copy gets its own).
        self._model = self._build_model()
        if self.precision == "fp8":
            _check_fp8(self)
        if self._model.attention == "blocksparse" and self.tensor_precision == "bf16" and \
                not model_config.cuda_available():
            raise ValueError("--attention blocksparse runs its Triton kernel in Triton's interpreter on a machine "
                             "without a CUDA GPU, where bf16 dot products come out wrong: add --precision fp32 "
                             "(or run it on a CUDA GPU)")
        if self.compile == "deepcompile" and self.stage == 3 and \
                self._model.attention in model_config.GRAPH_BREAKING_BACKENDS:
            raise ValueError(
                f"--attention {self._model.attention} does not combine with --compile deepcompile under ZeRO-3: its "
                "kernel runs between compiled graphs (torch.compiler.disable), and DeepCompile's ZeRO-3 pass then "
                "leaves parameters ungathered outside its graph (seen on the H200 with a kernel outside the graph: "
                "\"RuntimeError: 'weight' must be 2-D\" at the token embedding); use --attention sdpa or blocksparse "
                "with DeepCompile, or --compile blocks (the kernel runs between the compiled blocks)")

    @property
    def tensor_precision(self) -> str:
        """The dtype of the run's parameters, activations and DeepSpeed dict: the precision, bf16 for fp8."""
        return TENSOR_PRECISION[self.precision]

    def resolve_fused(self) -> dict[str, bool]:
        """FusedSwitches' rule, except under fp8: a switch whose module the FP8 conversion cannot take
        (fp8.UNCONVERTIBLE) is off unless given, and refused when given (_check_fp8)."""
        fused = super().resolve_fused()
        if self.precision == "fp8":
            fused.update({name: False for name in fp8.UNCONVERTIBLE if getattr(self, name) is None})
        return fused

    def model(self) -> GPTConfig:
        """The GPTConfig this run trains: the preset with this run's overrides (built once, in __post_init__)."""
        return self._model

    def _build_model(self) -> GPTConfig:
        drop = self.dropout
        return preset(
            self.preset,
            attention=self.attention,
            attn_dropout_mask=self.attn_dropout_mask,
            layout=self.layout,
            seq_len=self.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            vocab_size=self.vocab_size,
            vocab_multiple=self.vocab_multiple,
            dropout=drop,
            attn_dropout=drop,
            activation_checkpointing=self.activation_checkpointing,
            **self.resolve_fused(),
        )

    @property
    def overheads(self) -> set[str]:
        return {x.strip() for x in self.lightning_overheads.split(",") if x.strip()}

    @property
    def flops_factor(self) -> int:
        """k in the Megatron formula: 3 (forward + 2x backward), 4 with activation recompute."""
        return 4 if self.activation_checkpointing else 3


# The expert levers: fields that change how fast a run trains, not what it trains or how it is run. Their defaults and
# compare.py's GPU default (the fast profile) set those measured faster; what each one measured is in docs/ledger.md.
# --help lists them in a group of their own, after the common flags (shared/train/cli.add_config_args).
LEVERS = frozenset({
    *FUSED_FLAGS, "attn_dropout_mask", "vocab_multiple", "deepcompile_schedule", "deepcompile_persist",
    "deepcompile_eager_persist", "deepcompile_cached_walks", "deepcompile_backward_wait", "coordinate_descent_tuning",
    "zero3_step", "grad_norm_check", "zero_profile", "reduce_bucket_size", "prefetch_bucket_size",
    "param_persistence_threshold"})
assert LEVERS <= {f.name for f in dataclasses.fields(TrainConfig)}, "every lever is a TrainConfig field"
# The other flags a first run needs none of: the optimizer's finer settings, the model's shape overrides, diagnostics
# and logging. --help lists the common flags only; --help-all adds these and the levers
# (shared/train/cli.add_config_args).
MORE_OPTIONS = frozenset({
    "min_lr", "lr_warmup_steps", "weight_decay", "grad_clip", "layout", "seq_len", "n_layer", "n_head", "n_embd",
    "vocab_size", "dropout", "activation_checkpointing", "fp8_recipe", "wall_clock_breakdown", "lightning_overheads",
    "profile_step", "profile_stack", "profile_sync", "sync_check_step", "log_every", "keep_last", "trust_checkpoint",
    "val_batches", "nan_policy", "max_nan_skips", "log_csv"})
assert MORE_OPTIONS <= {f.name for f in dataclasses.fields(TrainConfig)} and not MORE_OPTIONS & LEVERS


def _check_deepcompile(train: TrainConfig) -> None:
    """Refuse, before any process starts, what DeepCompile cannot run: never silently something else."""
    if not model_config.cuda_available():
        raise ValueError("--compile deepcompile needs a CUDA GPU (DeepSpeed runs DeepCompile only on CUDA); on this "
                         "machine use --compile none (the default here) or --compile blocks")
    if train.stage == 0:
        raise ValueError("--compile deepcompile needs ZeRO stage 1, 2 or 3 (DeepCompile is a ZeRO pass); "
                         "use --compile blocks or none with stage 0")
    recompiles_at = DEEPCOMPILE_WARMUP if train.deepcompile_schedule == "deepspeed" and train.stage == 3 else 0
    if train.warmup_steps <= recompiles_at:
        what = f"recompiles at step {recompiles_at}" if recompiles_at else "compiles at step 0"
        raise ValueError(f"--compile deepcompile needs --warmup_steps > {recompiles_at}: DeepCompile profiles and "
                         f"{what} (--deepcompile_schedule {train.deepcompile_schedule}, stage {train.stage}), and "
                         f"that step must not be timed (got --warmup_steps {train.warmup_steps})")


def _check_fp8(train: TrainConfig) -> None:
    """Refuse, before any process starts, what --precision fp8 cannot run: settings first, then the machine, then
    torchao (shared/model/fp8.py says why each)."""
    asked = [name for name in fp8.UNCONVERTIBLE if getattr(train._model, name)]
    if asked:
        raise ValueError(f"--precision fp8 cannot convert the blocks' linears under --{asked[0]}: "
                         f"{fp8.UNCONVERTIBLE[asked[0]]}, past the nn.Linear forward that torchao's Float8Linear "
                         f"replaces; drop {', '.join('--' + a for a in asked)} (fp8 runs the tails unfused by default)")
    for refusal in (fp8.shape_refusal(train._model), fp8.device_refusal(), fp8.torchao_refusal()):
        if refusal:
            raise ValueError(refusal)


_PRECISION_ALIASES = {
    "bf16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "16": "fp16", "16-mixed": "fp16", "16-true": "fp16", "float16": "fp16",
    "fp32": "fp32", "32": "fp32", "32-true": "fp32", "float32": "fp32",
    # float8: torchao's name (torchao.float8, Float8LinearConfig); Lightning's "transformer-engine" precisions are
    # another library's FP8 and are not mapped here
    "fp8": "fp8", "float8": "fp8",
}


def device_norm_check_refusal(stage: int, zero3_step: str, precision: str) -> str | None:
    """Why --grad_norm_check device cannot run with these settings (precision as normalize_precision gives it), or
    None where it can; compare.py's one-GPU default asks the same before it turns the check on."""
    if stage != 3 or zero3_step == "deepspeed":
        return (f"--grad_norm_check device runs inside this project's ZeRO-3 step: it needs --stage 3 and --zero3_step "
                f"fast or fused (got --stage {stage}, --zero3_step {zero3_step})")
    if precision == "fp16":
        return ("--grad_norm_check device cannot be used with --precision fp16: its dynamic loss scale is updated on "
                "the host from the overflow check; use bf16 or fp32, or --grad_norm_check host")
    return None


def normalize_precision(value: str) -> str:
    """Map Lightning's, DeepSpeed's and torchao's spellings to bf16 | fp16 | fp32 | fp8."""
    key = str(value).lower()
    if key not in _PRECISION_ALIASES:
        raise ValueError(f"unknown precision {value!r}; choose one of {PRECISIONS} (or Lightning's bf16-mixed, ..., "
                         "or float8)")
    return _PRECISION_ALIASES[key]


