"""build_ds_config(...): the only place a DeepSpeed config dict is written.

Both paths hand DeepSpeed the dict this returns (the raw loop to deepspeed.initialize, Lightning through
DeepSpeedStrategy(config=...)); tests assert that deepspeed.initialize receives the same dict from both.

Profiles:
  original  the 2022 study's config, with the Hugging Face "auto" bucket rules it copied: reduce bucket h^2,
            stage-3 prefetch bucket 0.9 h^2, param persistence threshold 10 h; everything else DeepSpeed's
            defaults, including its synchronized throughput timer (two device syncs per step).
  tuned     rules for throughput, each with the measurement behind it (see the comments in _tuned_zero).
A user JSON (`--ds_config FILE`) replaces the built dict; it is checked against the run's flags instead.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from shared.model.config import GPTConfig
from shared.train.compile import leaf_module_class
from shared.train.config import TrainConfig

# Top-level keys DeepSpeed 0.19 reads (deepspeed/runtime/config.py and the docs' config-json page). DeepSpeed
# silently ignores any other top-level key, so a typo ("zero_optimisation") would run an unintended config.
KNOWN_TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients", "fp16", "bf16", "bfloat16", "amp",
    "torch_autocast", "gradient_clipping", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
    "flops_profiler", "activation_checkpointing", "sparse_attention", "data_efficiency", "curriculum_learning",
    "tensorboard", "wandb", "csv_monitor", "comet", "elasticity", "aio", "autotuning", "checkpoint", "data_types",
    "compression_training", "timers", "pipeline", "disable_allgather", "dataloader_drop_last", "compile",
    "nebula", "weight_quantization", "hybrid_engine", "eigenvalue", "progressive_layer_drop", "quantize_training",
    "graph_harvesting", "use_data_before_expert_parallelism", "tensor_parallel", "zenflow", "check_overflow",
    "disable_python_gc", "load_universal", "use_node_local_storage",
})

# Lightning's own loss-scale defaults: written out so that Lightning's precision formatting leaves the dict alone.
FP16_DEFAULTS = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1}


def build_ds_config(train: TrainConfig, world: int | None = None) -> dict:
    """The DeepSpeed config for this run: the user's JSON if given (validated, against the run's `world` processes
    too where given), else the chosen profile."""
    model = train.model()
    if train.ds_config:
        return load_user_ds_config(train.ds_config, train, world)
    h = model.n_embd
    zero: dict = {"stage": train.stage}
    if train.stage > 0:
        zero.update({
            "contiguous_gradients": True,
            "overlap_comm": True,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "reduce_bucket_size": h * h,
        })
    if train.stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
        })
    cfg: dict = {
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.grad_clip,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # our own loop prints; DeepSpeed's per-N-step report is not needed
        "wall_clock_breakdown": train.wall_clock_breakdown,
    }
    # fp8 is bf16 training with the blocks' matmuls in FP8 inside the model (shared/model/fp8.py): DeepSpeed holds,
    # gathers and updates the bf16 parameters as for bf16, so its dict is bf16's
    if train.tensor_precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif train.tensor_precision == "fp16":
        cfg["fp16"] = dict(FP16_DEFAULTS)
    if train.stage == 3 and train.compile == "blocks":
        # A compiled block must hold no DeepSpeed hook (see shared/train/compile.py): gather its parameters in one
        # hook on the block itself.
        zero["leaf_module"] = {"classes": [leaf_module_class()]}
        # zero.Init replaces F.linear by DeepSpeed's LinearFunctionForZeroStage3, whose code reads each weight's
        # ds_id: dynamo guards on it and compiles the block again for every layer until its recompile limit (8),
        # the rest running eager (docs/ledger.md, the `--memory_efficient_linear false` and `--compile blocks`
        # rows). torch's own linear keeps one graph for all blocks.
        zero["memory_efficient_linear"] = False
    if train.compile == "deepcompile":
        # DeepCompile (DeepSpeed >= 0.16.6): engine.compile() then traces the whole GPT forward + loss, removes
        # ZeRO's module and gradient hooks and inserts the all-gathers, releases and reduce-scatters into the graph
        # (deepspeed/compile/init_z3.py); it restores torch's own F.linear itself.
        cfg["compile"] = {"deepcompile": True}
    if train.zero_profile == "tuned":
        _apply_tuned_rules(cfg, model)
    _apply_overrides(cfg["zero_optimization"], train)
    return cfg


# TrainConfig field -> ZeRO key, and the lowest stage the key means anything at (the autotuner sets these).
OVERRIDES = {
    "reduce_bucket_size": ("reduce_bucket_size", 2),
    "prefetch_bucket_size": ("stage3_prefetch_bucket_size", 3),
    "param_persistence_threshold": ("stage3_param_persistence_threshold", 3),
}


def _apply_overrides(zero: dict, train: TrainConfig) -> None:
    for field, (key, min_stage) in OVERRIDES.items():
        value = getattr(train, field)
        if value is None:
            continue
        if value <= 0:
            raise ValueError(f"{field} must be positive, got {value}")
        if zero["stage"] < min_stage:
            raise ValueError(f"{field} is a ZeRO stage-{min_stage}+ setting; the run uses stage {zero['stage']}")
        zero[key] = int(value)


def _apply_tuned_rules(cfg: dict, model: GPTConfig) -> None:
    """Throughput rules for ZeRO; each cites what it fixes and where it was measured.

    Measured together against the original profile (docs/ledger.md, the `--zero_profile tuned` row; docs/tuning.md,
    its first entry): the raw loop on 1 and 2 GPUs, and `compare.py --explain`'s factor `original_ds_config`, whose
    cost lands in the backward, the reduce buckets (docs/why-lightning-was-slower.md); `python explain.py
    REPORT/explain.json` recomputes an explain report's figures.
    """
    zero = cfg["zero_optimization"]
    h = model.n_embd
    biggest_matrix = 4 * h * h  # the MLP's fc/proj weights; the tied embedding (V*h) is fetched once per step
    if zero["stage"] >= 2:
        # The original reduce bucket (h^2 = 5.3M elements at h=2304) launches a reduce-scatter per 5.3M
        # gradient elements: many small NCCL calls; larger buckets won back part of what 2 GPUs lost per GPU
        # against 1 (docs/tuning.md, its first entry).
        zero["reduce_bucket_size"] = int(max(5e8, 2 * biggest_matrix))
    if zero["stage"] == 3:
        # The original prefetch bucket (0.9 h^2 = 4.8M) is smaller than one MLP weight (4h^2 = 21M at h=2304),
        # so prefetching never runs ahead by even one layer; 5e8 elements (1 GB in bf16) prefetches whole blocks.
        zero["stage3_prefetch_bucket_size"] = int(max(5e8, 2 * biggest_matrix))
        # Keep small params (biases, LayerNorms: <= 4h elements) resident instead of gathering each of them
        # every forward and backward: 1e6 covers them at every preset and costs < 100 MB at 1.5b.
        zero["stage3_param_persistence_threshold"] = int(1e6)
        zero["stage3_max_live_parameters"] = int(1e9)
        zero["stage3_max_reuse_distance"] = int(1e9)
        # Without a gather-granularity threshold DeepSpeed fetches every Linear on its own; our blocks are few
        # and large, so the default (0: off) is right.
        zero["stage3_module_granularity_threshold"] = 0
    # DeepSpeed's throughput timer is on and synchronized by default: a device sync at the start of every
    # forward and at the end of every step, which the step-time measurement does not need, and it stops the host
    # from running ahead of the GPU. Switching it back on in Lightning measured within the noise (docs/ledger.md, the
    # throughput timer's row): no measurable cost on one GPU; it stays off because nothing here reads it.
    cfg["timers"] = {"throughput": {"enabled": False, "synchronized": False}}


def read_user_json(source: str | Path) -> tuple[dict, str]:
    """A user DeepSpeed JSON and the name errors call it by, from a file path or from base64 text of the JSON
    (DeepSpeed's autotuner hands each experiment's config to the script that way: `--deepspeed_config <base64>`)."""
    path = Path(source)
    try:
        exists, is_file = path.exists(), path.is_file()
    except OSError:  # base64 text is longer than a file name may be
        exists = is_file = False
    if exists and not is_file:
        raise ValueError(f"DeepSpeed config {str(path)!r} is not a file")
    if is_file:
        name = repr(str(path))
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {name} is not valid JSON: {e}") from e
    else:
        name = "(given as base64 text)"
        try:
            cfg = json.loads(base64.urlsafe_b64decode(str(source).encode()).decode())
        except ValueError:  # binascii.Error, UnicodeDecodeError and JSONDecodeError are ValueErrors
            # a long base64 blob is shortened; a path (urlsafe base64 has no "/") is named in full
            text = str(source)
            shown = text if len(text) <= 80 or "/" in text else f"{text[:77]}..."
            raise ValueError(f"DeepSpeed config file {shown!r} does not exist (and it is not base64 of a JSON "
                             "object, as DeepSpeed's autotuner passes)") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"DeepSpeed config {name} must hold a JSON object, got {type(cfg).__name__}")
    return cfg, name


# How a written config was made (compare.py --autotune records its commands in winner_ds_config.json): not
# DeepSpeed's, so dropped before the dict reaches the engine.
PROVENANCE_KEYS = frozenset({"command", "commands"})


def load_user_ds_config(source: str | Path, train: TrainConfig, world: int | None = None) -> dict:
    """Read a user DeepSpeed JSON (a path, or base64 text) and check it against the run's flags and, where given,
    its number of processes (`world`); raises ValueError naming the problem."""
    cfg, name = read_user_json(source)
    cfg = {k: v for k, v in cfg.items() if k not in PROVENANCE_KEYS}
    unknown = sorted(set(cfg) - KNOWN_TOP_LEVEL_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in DeepSpeed config {name}; DeepSpeed would ignore them")
    for key in ("zero_optimization", "bf16", "bfloat16", "fp16", "torch_autocast"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):  # e.g. the deprecated "zero_optimization": true
            raise ValueError(f"DeepSpeed config {name}: {key} must be a JSON object (e.g. {{\"enabled\": true}}, "
                             f"{{\"stage\": 3}}), got {json.dumps(cfg[key])}")
    check_batch_sizes(cfg, name, train, world)
    bf16 = "bf16" if cfg.get("bf16") is not None else "bfloat16"  # DeepSpeed reads its older name without "bf16"
    cfg_precision = "bf16" if _enabled(cfg, bf16) else "fp16" if _enabled(cfg, "fp16") else "fp32"
    if cfg_precision != train.tensor_precision:
        raise ValueError(f"DeepSpeed config {name} enables {cfg_precision} but the run asks for {train.precision}"
                         + (" (bf16 parameters: enable the bf16 section)" if train.precision == "fp8" else ""))
    if _enabled(cfg, "torch_autocast"):  # the forward would run in the autocast dtype under another label
        raise ValueError(f"DeepSpeed config {name} enables torch_autocast, which runs the forward in another precision "
                         f"than the run's --precision {train.precision} names; remove it and choose the precision with "
                         "--precision (and the JSON's bf16 or fp16 section)")
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if stage != train.stage:
        raise ValueError(f"DeepSpeed config {name} sets ZeRO stage {stage} but the run asks for {train.stage}")
    clip = cfg.get("gradient_clipping", 0.0)  # DeepSpeed's default: no clipping
    # the key as given must be the run's; without it, only the flag's default goes unnoticed
    if cfg.get("gradient_clipping", TrainConfig.grad_clip) != train.grad_clip:
        raise ValueError(f"DeepSpeed config {name} clips gradients at {clip} (gradient_clipping"
                         f"{'' if 'gradient_clipping' in cfg else ' absent: DeepSpeed does not clip'}) but the run "
                         f"asks for --grad_clip {train.grad_clip}; set gradient_clipping in the JSON"
                         + (f" or pass --grad_clip {clip}" if "gradient_clipping" in cfg else ""))
    for flag, (key, _) in OVERRIDES.items():
        if getattr(train, flag) is not None:
            raise ValueError(f"--{flag} has no effect with --ds_config {name}: set zero_optimization.{key} in the "
                             "JSON instead")
    if train.wall_clock_breakdown:  # a diagnostic (compare.py --cross_check): on whatever the JSON says
        cfg["wall_clock_breakdown"] = True
    if stage == 3 and train.compile == "blocks":
        zero = cfg["zero_optimization"]
        leaf = zero.get("leaf_module", {}).get("classes", [])
        leaf = [leaf] if isinstance(leaf, str) else leaf
        block = leaf_module_class()
        if block not in leaf and block.rsplit(".", 1)[1] not in leaf:  # DeepSpeed takes either
            raise ValueError(
                f"DeepSpeed config {name}: --compile blocks under ZeRO-3 needs zero_optimization.leaf_module."
                f"classes to contain {block!r} (else DeepSpeed's hooks break every compiled graph)"
            )
        if zero.get("memory_efficient_linear", True):
            raise ValueError(
                f"DeepSpeed config {name}: --compile blocks under ZeRO-3 needs zero_optimization."
                "memory_efficient_linear false (DeepSpeed's linear makes dynamo recompile the block for every layer)"
            )
    deepcompile = isinstance(cfg.get("compile"), dict) and bool(cfg["compile"].get("deepcompile", False))
    if deepcompile != (train.compile == "deepcompile"):
        raise ValueError(f"DeepSpeed config {name} has compile.deepcompile={deepcompile} but the run uses "
                         f"--compile {train.compile}: pass --compile {'deepcompile' if deepcompile else 'none'} "
                         "or change the JSON, so the engine compiles the way the result says")
    if autotuning_enabled(cfg) and not cfg["autotuning"].get("model_info"):
        # An autotuning experiment: the engine writes its metrics and exits after end_profile_step (DeepSpeed's
        # default 5); a shorter run would end without them and the autotuner would record a failure.
        end = cfg["autotuning"].get("end_profile_step", 5)
        if not isinstance(end, int) or isinstance(end, bool) or end < 0:
            raise ValueError(f"DeepSpeed config {name}: autotuning.end_profile_step must be a non-negative integer, "
                             f"got {end!r}")
        if train.steps <= end:
            raise ValueError(f"DeepSpeed config {name} enables autotuning up to end_profile_step={end}; "
                             f"--steps {train.steps} ends before it: pass --steps {end + 1} or more")
    for key, flag in BATCH_FLAGS.items():
        if cfg.get(key) is None:
            cfg[key] = getattr(train, flag)
    return cfg


# DeepSpeed's batch keys and the flags that set them: the built dict writes both from the flags, a user JSON may give
# any of the three (DeepSpeed derives the others; runtime/config.py _set_batch_related_parameters).
BATCH_FLAGS = {"train_micro_batch_size_per_gpu": "micro_batch", "gradient_accumulation_steps": "grad_accum"}


def check_batch_sizes(cfg: dict, name: str, train: TrainConfig, world: int | None) -> None:
    """Refuse a user JSON whose batch keys DeepSpeed would reject, or that would train other batches than the
    flags say: each key a positive whole number, the micro-batch and accumulation keys equal to their flags (the
    data loaders are built from the flags), and train_batch_size equal to micro_batch x grad_accum x `world`
    processes (DeepSpeed asserts train_batch_size = micro x accumulation x world size in deepspeed.initialize,
    after the processes started; skipped where `world` is unknown)."""
    for key in ("train_batch_size", *BATCH_FLAGS):
        value = cfg.get(key)  # null: absent, as DeepSpeed reads it
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
                           or value != int(value)):
            raise ValueError(f"DeepSpeed config {name}: {key} must be a positive whole number, got {json.dumps(value)}")
    for key, flag in BATCH_FLAGS.items():
        if cfg.get(key) is not None and cfg[key] != getattr(train, flag):
            raise ValueError(f"DeepSpeed config {name} sets {key}={cfg[key]:g} but the run uses {flag}="
                             f"{getattr(train, flag)}; pass --{flag} {cfg[key]:g} or remove the key")
    if cfg.get("train_batch_size") is None or world is None:
        return
    tbs, product = int(cfg["train_batch_size"]), train.micro_batch * train.grad_accum * world
    if tbs == product:
        return
    # the flags that would make it hold, where the JSON does not fix them too
    fixes = [f"--{flag} {tbs * getattr(train, flag) // product}" for key, flag in BATCH_FLAGS.items()
             if cfg.get(key) is None and tbs * getattr(train, flag) % product == 0]
    raise ValueError(
        f"DeepSpeed config {name} sets train_batch_size={tbs}, but the run's --micro_batch {train.micro_batch} x "
        f"--grad_accum {train.grad_accum} x {world} process(es) = {product} (DeepSpeed requires train_batch_size = "
        "train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size): "
        + (f"pass {' or '.join(fixes)}, or " if fixes else "") + "remove train_batch_size from the JSON")


def autotuning_enabled(cfg: dict) -> bool:
    """The config turns DeepSpeed's autotuning on (its experiments exit after their profile steps)."""
    return _enabled(cfg, "autotuning")


def _enabled(cfg: dict, key: str) -> bool:
    section = cfg.get(key)
    return isinstance(section, dict) and bool(section.get("enabled", False))
