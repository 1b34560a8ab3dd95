"""Speed profiles: every speed setting of a named setup, declared once, as data.

A profile is the set of TrainConfig fields that decide how fast a run is (the compiler, the optimizer step, the
kernels of the model, the micro-batch), with its exceptions as rules: where a setting cannot run or was never
measured (another GPU count, ZeRO stage, precision, attention backend, a GPU with less memory), the rule says what
the run takes instead, and why. Every entry point reads the same table (`--profile` in compare.py, both training
scripts under any launcher, the ablation and the autotuner), a flag given on the command line overrides its one
setting, and every run JSON and report names the profile and the rules that fired.

The profiles:
  fast   the fastest setup measured on the GPU (docs/ledger.md lists each setting's measurement): DeepSpeed's
         DeepCompile with its passes run once, this project's ZeRO-3 step in one Triton kernel, inductor's
         coordinate-descent tuning, the Triton kernels of the model, micro-batch 16 where it fits.
  stock  DeepSpeed and Lightning as shipped: DeepSpeed's own DeepCompile schedule where it runs (eager on a CPU),
         its own ZeRO-3 step and waits, and none of this project's replacements of DeepSpeed internals nor Triton
         kernels of its own: what the library gives a user with the same model, on any DeepSpeed version (the
         version gate, shared/patches, refuses the other profiles on an untested one). What remains of the patch
         layer (shared/patches.PATCHES): the Lightning path's always-on hooks (groups lightning_cpu: its CPU
         set-up; lightning_engine: deepspeed.initialize with the same dict and the run's engine set-up;
         lightning_sigterm: Lightning's SIGTERM broadcast every 50 steps), and, for a run resumed under DeepCompile
         only, the shift of DeepCompile's pass schedule to the resumed step (group deepcompile_resume), without which
         DeepSpeed 0.19.8 never compiles a resumed engine.
  eager  no compiler: the model's PyTorch ops under ZeRO with this project's eager ZeRO-3 step; what runs on a CPU.
The default is fast on a machine with a CUDA GPU and eager without one.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

from shared.train import config

DEFAULT_GPU = "fast"
DEFAULT_CPU = "eager"

# A rule's condition: (what, op, value). `what` is a TrainConfig field, valued as the run would have it before any
# rule (the user's flag, else the profile's setting, else TrainConfig's default), or one of the machine's facts: gpus
# (processes of the run), gpu_memory_gib (the first GPU's), cuda (a GPU is present).
OPS = {"==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt,
       "in": lambda a, b: a in b, "not in": lambda a, b: a not in b, "set": lambda a, _: a not in (None, "", 0)}


@dataclass(frozen=True)
class Rule:
    """Where every condition of `when` holds: `set` these fields instead, or `use` another profile whole."""

    when: tuple[tuple[str, str, object], ...]
    why: str
    set: dict = field(default_factory=dict)
    use: str | None = None

    def holds(self, facts: dict) -> bool:
        return all(OPS[op](facts[what], value) for what, op, value in self.when)

    def describe(self) -> str:
        cond = " and ".join(f"{w} {op} {v!r}" if op != "set" else f"{w} given" for w, op, v in self.when)
        then = f"profile {self.use}" if self.use else ", ".join(f"{k}={v}" for k, v in self.set.items())
        return f"{cond}: {then} ({self.why})"


@dataclass(frozen=True)
class Profile:
    name: str
    doc: str
    settings: dict
    rules: tuple[Rule, ...] = ()
    needs_cuda: bool = False
    # micro_batch -> the profile's measured peak GiB on one GPU at the 1.5b preset in bf16 (docs/ledger.md names the
    # runs); where the profile's micro-batch is not expected to fit the GPU, the largest one here that is
    peak_gib: dict = field(default_factory=dict)


# The fields a profile may set: the speed settings. Everything else (model, data, steps, outputs) is the user's.
SPEED_FIELDS = (
    "compile", "deepcompile_schedule", "deepcompile_persist", "deepcompile_eager_persist", "deepcompile_cached_walks",
    "deepcompile_backward_wait", "coordinate_descent_tuning", "zero3_step", "grad_norm_check", "micro_batch",
    "vocab_multiple", "triton_loss", "triton_dropout", "triton_gelu_grad", "warmup_steps",
)

_NO_COMPILER = (("attention", "in", ("blocksparse", "xformers", "flex")),)

PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(
        name="fast",
        doc="the fastest setup measured on the GPU: DeepCompile compiled once, the ZeRO-3 step in one Triton kernel, "
            "the model's Triton kernels",
        needs_cuda=True,
        settings=dict(compile="deepcompile", deepcompile_schedule="once", deepcompile_persist="threshold",
                      deepcompile_eager_persist="drop", deepcompile_cached_walks=True,
                      deepcompile_backward_wait="device", coordinate_descent_tuning=True, zero3_step="fused",
                      grad_norm_check="device", micro_batch=16, vocab_multiple=128, triton_loss=True,
                      triton_dropout=True, triton_gelu_grad=True),
        peak_gib={16: 92.5, 8: 59.8},
        rules=(
            Rule(when=(("stage", "==", 0),), use="eager",
                 why="DeepCompile is a ZeRO pass: stage 0 has none"),
            Rule(when=_NO_COMPILER, use="eager",
                 why="no GPU run backs DeepCompile with this attention backend (xformers and flex break its graph)"),
            Rule(when=(("ds_config", "set", None),), use="eager",
                 why="a user DeepSpeed JSON decides the engine's settings itself"),
            Rule(when=(("compile", "!=", "deepcompile"),), use="eager",
                 why="the other settings of the profile were measured under DeepCompile"),
            Rule(when=(("gpus", ">", 1),), set=dict(deepcompile_backward_wait="host", grad_norm_check="host"),
                 why="the device wait and the device norm check were measured and tested on one GPU only"),
            Rule(when=(("stage", "!=", 3),), set=dict(zero3_step="fast", grad_norm_check="host"),
                 why="the fused step and the device norm check replace ZeRO-3's optimizer step"),
            Rule(when=(("precision", "==", "fp16"),), set=dict(grad_norm_check="host", triton_loss=False),
                 why="fp16's loss scale needs the host's check; the Triton loss keeps its logits' gradient in their "
                     "dtype, which fp16's range does not hold"),
            Rule(when=(("precision", "==", "fp32"),), set=dict(triton_loss=False),
                 why="the Triton loss was measured in bf16 only"),
            Rule(when=(("precision", "==", "fp8"),), set=dict(triton_gelu_grad=False, triton_dropout=False),
                 why="fp8 runs the GELU and the residual tails unfused, outside the linears torchao's Float8Linear "
                     "replaces (shared/model/fp8.py): these Triton kernels are the fused tails' backward and mask"),
            Rule(when=(("fused_bias_dropout_add", "==", False),), set=dict(triton_dropout=False),
                 why="the Triton dropout draws the mask of the fused bias + dropout + add"),
            Rule(when=(("fused_bias_gelu", "==", False),), set=dict(triton_gelu_grad=False),
                 why="the Triton GELU gradient is the backward of the fused bias + GELU"),
        )),
    Profile(
        name="stock",
        doc="DeepSpeed and Lightning as shipped: DeepSpeed's own DeepCompile and ZeRO-3 step, no replacement of "
            "DeepSpeed internals (any DeepSpeed version), no Triton kernel of this project",
        settings=dict(compile="deepcompile", deepcompile_schedule="deepspeed", deepcompile_persist="deepspeed",
                      deepcompile_eager_persist="deepspeed", deepcompile_cached_walks=False,
                      deepcompile_backward_wait="host", coordinate_descent_tuning=False, zero3_step="deepspeed",
                      grad_norm_check="host", vocab_multiple=1, triton_loss=False,
                      triton_dropout=False, triton_gelu_grad=False,
                      # DeepSpeed's schedule recompiles at step 5 (config.DEEPCOMPILE_WARMUP): no timed step may hold it
                      warmup_steps=6),
        rules=(
            Rule(when=(("cuda", "==", False),), set=dict(compile="none"),
                 why="DeepSpeed runs DeepCompile only on CUDA: its eager ZeRO step on a CPU"),
            Rule(when=(("stage", "==", 0),), set=dict(compile="none"),
                 why="DeepCompile is a ZeRO pass: stage 0 has none"),
            Rule(when=_NO_COMPILER, set=dict(compile="none"),
                 why="no GPU run backs DeepCompile with this attention backend"),
            Rule(when=(("ds_config", "set", None),), set=dict(compile="none"),
                 why="a user DeepSpeed JSON decides the engine's settings itself"),
        )),
    Profile(
        name="eager",
        doc="no compiler: the model's PyTorch ops under ZeRO with this project's eager ZeRO-3 step (the CPU default)",
        settings=dict(compile="none", zero3_step="fast", grad_norm_check="host", deepcompile_backward_wait="host"),
    ),
)}


assert tuple(PROFILES) == config.PROFILES, "shared/train/config.py names the profiles declared here"


def check_name(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown --profile {name!r}; choose one of {tuple(PROFILES)}")
    return PROFILES[name]


def default_name(cuda: bool) -> str:
    return DEFAULT_GPU if cuda else DEFAULT_CPU


@dataclass
class Resolved:
    """What a profile gave one run: its name, the settings it filled in (flags the user gave stay theirs), the rules
    that fired, and the profile it ended on (a rule may `use` another)."""

    name: str
    used: str
    filled: dict
    rules: list[str]
    note: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        used = "" if self.used == self.name else f" -> {self.used}"
        rules = "".join(f"\n  rule: {r}" for r in self.rules)
        return f"profile {self.name}{used}: {', '.join(f'{k}={v}' for k, v in self.filled.items()) or '-'}" \
               f"{self.note}{rules}"


def expected_peak_gib(profile: Profile, micro_batch: int, world: int, stage: int) -> float:
    """The profile's measured one-GPU peak at the 1.5b preset (peak_gib), less the model and optimizer state that ZeRO
    `stage` shards away from each of `world` GPUs (estimate_memory's state term on one GPU minus on `world`)."""
    from shared.train.distributed import GiB, estimate_memory

    def state(w: int) -> float:
        return estimate_memory(config.TrainConfig(preset="1.5b", stage=stage), w, "cuda")["model and optimizer state"]

    return profile.peak_gib[micro_batch] - (state(1) - state(world)) / GiB


MEMORY_SHARE = 0.95
# The precisions the measured peaks (Profile.peak_gib, bf16) stand for: fp16's tensors are as large, and fp8's
# Float8Linear saves the same bf16 input and weight for its backward as nn.Linear does (its FP8 copies are transient),
# and fp8's one measured run peaked below bf16's (docs/fp8.md).
MEASURED_PEAK_PRECISIONS = ("bf16", "fp16", "fp8")
# the flags that change the model's shape: with any of them, or in fp32, the measured peaks do not apply
SHAPE_FLAGS = ("seq_len", "n_layer", "n_head", "n_embd", "vocab_size", "activation_checkpointing")


def micro_batch_for_memory(profile: Profile, world: int, memory_gib: float, stage: int) -> tuple[int, str]:
    """(the largest micro-batch of profile.peak_gib whose expected peak fits in MEMORY_SHARE of `memory_gib`, a note
    saying why it is not the largest). None fits: ValueError naming the numbers."""
    fits = {mb: expected_peak_gib(profile, mb, world, stage) for mb in sorted(profile.peak_gib, reverse=True)}
    best = max(profile.peak_gib)
    for mb, peak in fits.items():
        if peak <= MEMORY_SHARE * memory_gib:
            note = "" if mb == best else (
                f" (micro-batch {best} would peak at about {fits[best]:.0f} GiB per GPU, over {MEMORY_SHARE:.0%} "
                f"of this GPU's {memory_gib:.0f} GiB)")
            return mb, note
    expected = ", ".join(f"{mb}: {peak:.0f} GiB" for mb, peak in fits.items())
    raise ValueError(f"profile {profile.name} at the 1.5b preset does not fit in {MEMORY_SHARE:.0%} of this GPU's "
                     f"{memory_gib:.0f} GiB on {world} GPU(s) (expected peaks per GPU by micro-batch: {expected}): "
                     f"pass a smaller --micro_batch (it is then run as given), a smaller --preset, more GPUs, or "
                     f"--profile eager")


def resolve(given: dict, name: str | None, *, cuda: bool, gpus: int, gpu_memory_gib: float | None = None,
            sharded_gpus: int | None = None) -> Resolved:
    """Fill the speed settings the user did not give (`given`: TrainConfig field -> value or None) from profile
    `name` (None: the machine's default), applying its rules; returns what was filled and why. The facts the rules
    read: each field as the run would have it before any rule (the user's flag, else the profile's setting, else
    TrainConfig's default), `gpus` (processes of the run), `cuda`, and the first GPU's memory (the micro-batch).
    `sharded_gpus`: the GPUs the model state is sharded over where that differs from `gpus` (compare's one-GPU
    reference rows). ValueError for an unknown profile or one this machine cannot run."""
    name = name or default_name(cuda)
    profile = check_name(name)
    if profile.needs_cuda and not cuda:
        raise ValueError(f"--profile {name} needs a CUDA GPU (DeepSpeed runs DeepCompile only on CUDA); on this "
                         f"machine use --profile {DEFAULT_CPU} (the default here)")
    defaults = config.TrainConfig()
    facts = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(config.TrainConfig)}
    facts.update(profile.settings)
    facts.update({k: v for k, v in given.items() if v is not None})
    facts["precision"] = config.normalize_precision(facts["precision"])
    facts.update(gpus=gpus, cuda=cuda, gpu_memory_gib=gpu_memory_gib)
    rules, used, settings = [], profile, dict(profile.settings)
    for rule in profile.rules:
        if not rule.holds(facts):
            continue
        rules.append(rule.describe())
        if rule.use:
            used = check_name(rule.use)
            settings = dict(used.settings)
            break
        settings.update(rule.set)
    note = ""
    if ("micro_batch" in settings and given.get("micro_batch") is None and used.peak_gib and cuda
            and facts["preset"] == "1.5b" and facts["precision"] in MEASURED_PEAK_PRECISIONS
            and all(given.get(f) in (None, False) for f in SHAPE_FLAGS)
            and gpu_memory_gib is not None):
        settings["micro_batch"], note = micro_batch_for_memory(used, sharded_gpus or gpus, gpu_memory_gib,
                                                               facts["stage"])
    filled = {k: v for k, v in settings.items() if given.get(k) is None}
    return Resolved(name=name, used=used.name, filled=filled, rules=rules, note=note)


def table() -> str:
    """Every profile's settings and rules, as `--profile list` prints them."""
    lines = []
    for p in PROFILES.values():
        lines.append(f"{p.name}: {p.doc}" + (" (needs a CUDA GPU)" if p.needs_cuda else ""))
        lines += [f"  {k} = {v}" for k, v in p.settings.items()]
        if p.peak_gib:
            lines.append(f"  micro_batch where {p.settings['micro_batch']} does not fit the GPU: the largest of "
                         f"{sorted(p.peak_gib)} that does (measured peaks at 1.5b, GiB: {p.peak_gib})")
        lines += [f"  rule: {r.describe()}" for r in p.rules]
    return "\n".join(lines)
