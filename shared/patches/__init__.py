"""Every replacement of DeepSpeed or Lightning internals this project makes, in one place, gated by version.

The project speeds up DeepSpeed's ZeRO-3 step and DeepCompile's set-up by replacing some of their internals at run
time, and runs Lightning's DeepSpeedStrategy on a CPU by overriding some of its hooks. Each replacement is one entry
of PATCHES below: the upstream target (a dotted path), what replaces it and why, the TrainConfig setting that turns
it on (its Group), the docs page that holds its measurement or finding, and the tests that cover it. Patches that
only make sense together share a Group and are installed together or not at all (the device's invalid-norm check,
which lets DeepSpeed's `is_invalid_grad_norm` answer False, relies on the replaced `_optimizer_step` skipping a
non-finite update: its group requires the ZeRO-3 step's). docs/patches.md lists them (`python -m shared.patches
--list` prints that table; a test keeps the two equal).

The version gate. The replacements were written against, and tested with, exactly the versions in TESTED (pinned in
pyproject.toml). On any other installed version, a run whose settings need a patch is refused before any work
(`check_versions`, from shared/train/distributed.check_before_start, which both training paths and compare.py call
first): a ValueError naming the installed and the tested version and the settings concerned, offering
`--profile stock` (shared/train/profiles.py), which installs none of the DeepSpeed patches. Every entry point below
checks again before it installs anything (`require`), so no caller can patch half a group or patch another version.
The Lightning path's hooks (Groups with `always` set) are needed for it to run at all; on another pytorch-lightning
the Lightning path is refused, and the raw path still runs.

The fingerprints. shared/patches/fingerprints.json records a hash of the source of every upstream function the
patches replace or rely on (shared/patches/fingerprints.py; normalized text, so formatting of blank lines and
comment lines does not count). tests/test_patches.py fails, naming the function, when the installed library's source
differs. After upgrading DeepSpeed or pytorch-lightning:
  1. `python -m shared.patches` lists the versions and every function whose source changed;
  2. read each changed function against the replacement named in PATCHES, fix or drop the replacement, rerun its
     tests (the `tests` of its entry; the GPU ones on a GPU);
  3. set TESTED and the pins in pyproject.toml to the new versions, then `python -m shared.patches --update`
     rewrites the record (it refuses while the installed versions differ from TESTED).

Callers use the functions at the end of this file (`before_compile`, `persistence_pass`, `after_compile`, `install`,
`align_schedule`, `step_calls`, `records`, `installed`); the Lightning path's hooks are in
shared/patches/lightning.py, which only lightning_app/ imports. No module outside this package touches a private
attribute of DeepSpeed or Lightning (tests/test_patches.py parses them). No deepspeed or Lightning import at module
level here or in the submodules: each imports what it replaces inside the function that replaces it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

# The versions every patch was written against and tested with (pyproject.toml pins them).
TESTED = {"deepspeed": "0.19.8", "pytorch_lightning": "2.6.6"}
# library -> (its distribution's name, as pip knows it; as a reader writes it)
LIBRARIES = {"deepspeed": ("deepspeed", "DeepSpeed"), "pytorch_lightning": ("pytorch-lightning", "pytorch-lightning")}


@dataclass(frozen=True)
class Group:
    """Patches installed together or not at all, and what turns them on."""

    name: str
    library: str
    setting: str
    """the TrainConfig setting that turns the group on, as a reader writes it"""
    on: Callable
    """that setting, read from a TrainConfig: on(train) -> bool"""
    off: str
    """the flags that turn the group off (the version gate's message offers them)"""
    requires: tuple[str, ...] = ()
    """groups whose patches this one relies on (installed with it)"""
    always: str | None = None
    """where the group is on whatever the settings (a path that cannot run without it); None: `on` decides"""


@dataclass(frozen=True)
class Patch:
    """One replacement of an upstream internal."""

    target: str
    """the upstream object replaced (dotted path; an instance attribute is named on its class)"""
    replacement: str
    """ours, dotted (shared.patches.<module>.<function>)"""
    why: str
    group: str
    docs: str
    """the docs page that holds its measurement, or the finding behind it"""
    docs_row: str
    """the text of its row or section on that page"""
    tests: tuple[str, ...]
    """the tests that cover it (file::function)"""
    sources: tuple[str, ...] = ()
    """upstream sources fingerprinted for it (dotted functions or classes, or a file as package/path); empty: the
    target itself"""

    @property
    def fingerprinted(self) -> tuple[str, ...]:
        return self.sources or (self.target,)


def _deepcompile(train) -> bool:
    return train.compile == "deepcompile"


def _deepcompile_z3(train) -> bool:
    return train.compile == "deepcompile" and train.stage == 3


GROUPS: dict[str, Group] = {g.name: g for g in (
    Group("zero3_step", "deepspeed", "--zero3_step fast or fused at --stage 3",
          lambda t: t.stage == 3 and t.zero3_step in ("fast", "fused"), off="--zero3_step deepspeed"),
    Group("grad_norm_check", "deepspeed", "--grad_norm_check device",
          lambda t: t.grad_norm_check == "device", off="--grad_norm_check host", requires=("zero3_step",)),
    Group("deepcompile_backward_wait", "deepspeed", "--deepcompile_backward_wait device (with --compile deepcompile)",
          lambda t: _deepcompile(t) and t.deepcompile_backward_wait == "device",
          off="--deepcompile_backward_wait host"),
    Group("deepcompile_persist", "deepspeed", "--deepcompile_persist threshold (with --compile deepcompile, stage 3)",
          lambda t: _deepcompile_z3(t) and t.deepcompile_persist == "threshold", off="--deepcompile_persist deepspeed"),
    Group("deepcompile_eager_persist", "deepspeed",
          "--deepcompile_eager_persist drop (with --compile deepcompile, stage 3)",
          lambda t: _deepcompile_z3(t) and t.deepcompile_eager_persist == "drop",
          off="--deepcompile_eager_persist deepspeed"),
    Group("deepcompile_cached_walks", "deepspeed", "--deepcompile_cached_walks (with --compile deepcompile, stage 3)",
          lambda t: _deepcompile_z3(t) and t.deepcompile_cached_walks, off="--deepcompile_cached_walks false"),
    Group("deepcompile_profilers", "deepspeed", "--compile deepcompile under any --profile but stock (a diagnostic)",
          lambda t: _deepcompile(t) and t.profile != "stock", off="--profile stock"),
    Group("deepcompile_resume", "deepspeed", "--compile deepcompile with --resume auto or a checkpoint",
          lambda t: _deepcompile(t) and t.resume != "none", off="--resume none"),
    Group("lightning_cpu", "pytorch_lightning", "the Lightning path", lambda t: False, off="",
          always="the Lightning path (on a CPU it runs only with them; on GPUs they defer to Lightning's code)"),
    Group("lightning_engine", "pytorch_lightning", "the Lightning path", lambda t: False, off="",
          always="the Lightning path (the engine is built from the same dict and set up as the raw loop's)"),
    Group("lightning_sigterm", "pytorch_lightning", "the Lightning path", lambda t: False, off="",
          always="the Lightning path (every step with --lightning_overheads sigterm_check, counted either way)"),
)}

_STAGE3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
_FALLBACK = "deepspeed.compile.z3_eager_fallback.DeepCompileZ3EagerFallback"
_PROFILERS = "deepspeed.compile.profilers.graph_profile"
_PL_DS = "pytorch_lightning.strategies.deepspeed.DeepSpeedStrategy"
_ZERO3_TESTS = "tests/test_zero3_step.py::"

PATCHES: tuple[Patch, ...] = (
    Patch(f"{_STAGE3}.get_grad_norm_direct", "shared.patches.zero3_step.install",
          "the global norm as one fp32 vector_norm of the sub-group's flat gradient region instead of a per-parameter "
          "fp64 copy and norm (launch-bound); DeepSpeed's own where the gradients are not the buffer's views in order",
          "zero3_step", "docs/ledger.md", "`--zero3_step fast`",
          (f"{_ZERO3_TESTS}test_fast_step_matches_deepspeeds_norm_and_fp32_grads_on_two_ranks",),
          sources=(f"{_STAGE3}.get_grad_norm_direct", f"{_STAGE3}._assert_same_partition_group",
                   f"{_STAGE3}._get_param_partition_group", f"{_STAGE3}._autoep_expert_parallel_group",
                   "deepspeed.runtime.zero.utils.get_norm_dtype")),
    Patch(f"{_STAGE3}._prepare_fp32_grad_for_sub_group", "shared.patches.zero3_step.install",
          "one cast of the flat region to fp32 instead of a concatenation and a cast; with the fused step, no copy: "
          "the AdamW kernel reads the 16-bit region", "zero3_step", "docs/ledger.md", "`--zero3_step fast`",
          (f"{_ZERO3_TESTS}test_fast_step_matches_deepspeeds_norm_and_fp32_grads_on_two_ranks",
           f"{_ZERO3_TESTS}test_the_adamw_kernel_trains_like_torchs_fused_adamw_and_keeps_its_state")),
    Patch(f"{_STAGE3}.unscale_and_clip_grads", "shared.patches.zero3_step.install",
          "the unscale/clip factor handed to torch's fused AdamW (its grad_scale) or the AdamW kernel instead of a "
          "multiply over the whole fp32 gradient", "zero3_step", "docs/ledger.md", "`--zero3_step fast`",
          (f"{_ZERO3_TESTS}test_the_fused_adamw_takes_the_unscale_and_trains_like_deepspeeds_multiply",)),
    Patch(f"{_STAGE3}._optimizer_step", "shared.patches.zero3_step.install",
          "sets the fused AdamW's grad_scale (and found_inf under the device norm check) around DeepSpeed's update, "
          "or runs the AdamW kernel (--zero3_step fused); skips an update the invalid-norm flag marks",
          "zero3_step", "docs/ledger.md", "`--zero3_step fused`",
          (f"{_ZERO3_TESTS}test_the_fused_adamw_takes_the_unscale_and_trains_like_deepspeeds_multiply",
           f"{_ZERO3_TESTS}test_the_adamw_kernel_trains_like_torchs_fused_adamw_and_keeps_its_state")),
    Patch(f"{_STAGE3}._reassign_or_swap_out_partitioned_parameters", "shared.patches.zero3_step.install",
          "where the AdamW kernel already wrote the 16-bit partition, only points the parameters at it (no copy)",
          "zero3_step", "docs/ledger.md", "`--zero3_step fused`",
          (f"{_ZERO3_TESTS}test_the_adamw_kernel_trains_like_torchs_fused_adamw_and_keeps_its_state",),
          sources=(f"{_STAGE3}._reassign_or_swap_out_partitioned_parameters",
                   f"{_STAGE3}._unflatten_partitioned_parameters")),
    Patch("deepspeed.runtime.zero.stage3.is_invalid_grad_norm", "shared.patches.zero3_step._patch_invalid_norm_check",
          "answers False at once and leaves the inf/NaN flag on the device, where each update skips itself: no host "
          "wait for the backward and the norm", "grad_norm_check", "docs/ledger.md", "`--grad_norm_check device`",
          (f"{_ZERO3_TESTS}test_the_norm_check_on_the_device_skips_an_invalid_update_like_deepspeeds_host_check",)),
    Patch(f"{_STAGE3}.step", "shared.patches.zero3_step.install",
          "DeepSpeed's step with the deferred check armed for this optimizer, and the skipped updates counted on the "
          "device (fp16's loss scale keeps the host's check)", "grad_norm_check", "docs/ledger.md",
          "`--grad_norm_check device`",
          (f"{_ZERO3_TESTS}test_the_norm_check_on_the_device_skips_an_invalid_update_like_deepspeeds_host_check",)),
    Patch("deepspeed.compile.util.dc_handle", "shared.patches.deepcompile_op.install",
          "DeepCompile's op built from DeepSpeed's own sources with endBackward's host stream_synchronize replaced by "
          "the compute stream waiting on an event (a text patch of deepcompile.h, refused if its text changed)",
          "deepcompile_backward_wait", "docs/ledger.md", "`--deepcompile_backward_wait device`",
          ("tests/test_deepcompile_op.py::test_the_installed_header_loses_exactly_the_backwards_host_wait",
           "tests/test_deepcompile_op.py::test_install_refuses_once_deepspeeds_own_op_is_loaded",
           "tests/test_deepcompile.py::test_the_device_wait_trains_like_the_host_wait_without_the_backwards_sync"),
          sources=("deepspeed.compile.util.get_deepcompile_handle", "deepspeed.ops.op_builder.dc.DeepCompileBuilder",
                   "deepspeed/ops/csrc/includes/deepcompile.h")),
    Patch("deepspeed.compile.passes.zero3_compile.add_z3_gather_release",
          "shared.patches.deepcompile_passes.keep_small_params_gathered",
          "a pass after DeepSpeed's: parameters under the persistence threshold set persistent in DeepCompile's "
          "registry and their release_param nodes erased from the graphs, so inductor fuses across them",
          "deepcompile_persist", "docs/ledger.md", "`--deepcompile_persist threshold`",
          ("tests/test_deepcompile.py::test_the_persistence_pass_drops_only_the_releases_of_small_parameters",),
          sources=("deepspeed.compile.passes.zero3_compile.add_z3_gather_release_fw",
                   "deepspeed.compile.passes.zero3_compile.add_z3_gather_release_bw",
                   "deepspeed/ops/csrc/compile/z3.cpp")),
    Patch(f"{_STAGE3}.persistent_parameters", "shared.patches.deepcompile.drop_eager_persistent",
          "eager ZeRO-3's list of persistent parameters emptied once DeepCompile turned persistence off: no eager "
          "gather after each step that the next forward partitions again", "deepcompile_eager_persist",
          "docs/ledger.md", "`--deepcompile_eager_persist drop`",
          (f"{_ZERO3_TESTS}test_without_the_eager_persistent_list_the_step_leaves_nothing_gathered",),
          sources=(f"{_STAGE3}._post_step", "deepspeed.compile.init_z3.init_z3")),
    Patch(f"{_STAGE3}._partition_all_parameters", "shared.patches.deepcompile.cache_deepcompile_walks",
          "DeepSpeed's three walks of every parameter at each optimizer step run only when a cached list of the "
          "parameters shows one gathered", "deepcompile_cached_walks", "docs/ledger.md", "`--deepcompile_cached_walks`",
          (f"{_ZERO3_TESTS}test_cached_walks_release_and_mark_what_deepspeeds_walks_do",
           "tests/test_deepcompile.py::test_the_cached_walks_train_like_deepspeeds_walks")),
    Patch(f"{_FALLBACK}._enable_forward_fallback", "shared.patches.deepcompile.cache_deepcompile_walks",
          "marks the modules' parameter dicts in the forward over a list of modules taken once, not a walk of the "
          "tree each forward", "deepcompile_cached_walks", "docs/ledger.md", "`--deepcompile_cached_walks`",
          (f"{_ZERO3_TESTS}test_cached_walks_release_and_mark_what_deepspeeds_walks_do",)),
    Patch(f"{_FALLBACK}._disable_forward_fallback", "shared.patches.deepcompile.cache_deepcompile_walks",
          "the same, out of the forward", "deepcompile_cached_walks", "docs/ledger.md", "`--deepcompile_cached_walks`",
          (f"{_ZERO3_TESTS}test_cached_walks_release_and_mark_what_deepspeeds_walks_do",)),
    Patch(f"{_FALLBACK}.release_available_params_for_next_forward",
          "shared.patches.deepcompile.cache_deepcompile_walks",
          "DeepSpeed's release of the parameters left gathered, over a list of parameters taken once",
          "deepcompile_cached_walks", "docs/ledger.md", "`--deepcompile_cached_walks`",
          (f"{_ZERO3_TESTS}test_cached_walks_release_and_mark_what_deepspeeds_walks_do",),
          sources=(f"{_FALLBACK}.release_available_params_for_next_forward",
                   f"{_FALLBACK}._release_unclaimed_tracked_params", f"{_FALLBACK}.forward_context")),
    Patch(f"{_PROFILERS}.ProfilingInterpreter.run", "shared.patches.deepcompile.time_deepcompile_profilers",
          "DeepSpeed's operator profiling, timed and counted (extra.deepcompile_profilers): how much of DeepCompile's "
          "warm-up is profiling", "deepcompile_profilers", "docs/results.md", "`extra.deepcompile_profilers`",
          ("tests/test_deepcompile.py::test_deepcompiles_two_profilers_are_timed_once_per_process",)),
    Patch(f"{_PROFILERS}.MemoryProfilingInterpreter.run", "shared.patches.deepcompile.time_deepcompile_profilers",
          "DeepSpeed's memory profiling, timed and counted the same way", "deepcompile_profilers", "docs/results.md",
          "`extra.deepcompile_profilers`",
          ("tests/test_deepcompile.py::test_deepcompiles_two_profilers_are_timed_once_per_process",)),
    Patch("deepspeed.compile.backend.remaining_schedule", "shared.patches.deepcompile.start_schedule_at",
          "DeepCompile's pass schedule moved to start at a resumed engine's step: DeepSpeed launches a scheduled "
          "compile only at the exact global step, counted from 0, and a resumed engine never compiled",
          "deepcompile_resume", "docs/results.md", "so a resumed engine never",
          ("tests/test_deepcompile.py::test_a_resumed_engine_starts_deepcompiles_schedule_at_its_own_step",
           "tests/test_deepcompile.py::test_the_schedule_follows_a_checkpoint_loaded_after_compilation"),
          sources=("deepspeed.compile.backend.launch_compile_passes", "deepspeed.compile.backend.init_schedule")),
    Patch(f"{_PL_DS}.setup_environment", "shared.patches.lightning.setup_environment",
          "on a CPU, DDPStrategy's set-up without DeepSpeedStrategy's refusal of any accelerator but CUDA (DeepSpeed "
          "itself trains ZeRO-3 on a CPU with gloo)", "lightning_cpu", "docs/paths.md", "### Lightning on CPU",
          ("tests/test_lightning.py::test_one_process_matches_raw_path_bit_for_bit",),
          sources=(f"{_PL_DS}.setup_environment", "pytorch_lightning.strategies.ddp.DDPStrategy.setup_environment")),
    Patch(f"{_PL_DS}.setup_distributed", "shared.patches.lightning.setup_distributed",
          "on a CPU, Lightning's set-up without its check that every device has an index (a CPU has none), and the "
          "shared-memory file of DeepSpeed's CPU op unlinked", "lightning_cpu", "docs/paths.md",
          "### Lightning on CPU", ("tests/test_lightning.py::test_two_processes_lightning_launcher_and_torchrun",),
          sources=(f"{_PL_DS}.setup_distributed", f"{_PL_DS}._init_deepspeed_distributed")),
    Patch(f"{_PL_DS}._setup_model_and_optimizer", "shared.patches.lightning.setup_model_and_optimizer",
          "Lightning's deepspeed.initialize (on a CPU with the local rank as device_rank), then the run's DeepCompile "
          "and ZeRO-3 step applied to the engine as the raw loop applies them", "lightning_engine", "docs/paths.md",
          "### Lightning on CPU",
          ("tests/test_deepcompile.py::test_the_lightning_strategy_hands_every_deepcompile_option_to_compile_engine",
           "tests/test_lightning.py::test_one_process_matches_raw_path_bit_for_bit")),
    Patch("pytorch_lightning.loops.training_epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor",
          "shared.patches.lightning.throttle_sigterm_broadcast",
          "Lightning's per-step SIGTERM broadcast (a collective and a .item()) run every preemption.CHECK_EVERY steps "
          "and counted (extra.lightning.sigterm_broadcasts)", "lightning_sigterm", "docs/ledger.md",
          "the explain factor `sigterm_check`", ("tests/test_explain.py::test_explain_end_to_end_two_processes",),
          sources=("pytorch_lightning.loops.training_epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor",
                   "pytorch_lightning.loops.training_epoch_loop._TrainingEpochLoop.advance")),
)


# ---- the version gate ----------------------------------------------------------------------------------------------


def installed_version(library: str) -> str | None:
    """The installed version of `library` (a key of TESTED) without a local part ("0.19.8+cu128" -> "0.19.8"); None
    where it is not installed."""
    try:
        return importlib.metadata.version(LIBRARIES[library][0]).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def needed(train, lightning: bool = False) -> list[Group]:
    """The groups a run with these settings installs (with the groups they require); `lightning`: the run is the
    Lightning path's, whose always-on groups count too."""
    names = [g.name for g in GROUPS.values() if (g.always and lightning and g.library == "pytorch_lightning")
             or (not g.always and g.on(train))]
    for name in list(names):
        names += [r for r in GROUPS[name].requires if r not in names]
    return [GROUPS[n] for n in GROUPS if n in names]


def refusal(groups: list[Group]) -> str | None:
    """Why these groups cannot be installed here (each library's installed version against TESTED), or None."""
    reasons = []
    for library, (dist, label) in LIBRARIES.items():
        mine = [g for g in groups if g.library == library]
        have = installed_version(library)
        if not mine or have == TESTED[library]:
            continue
        found = f"this machine has {label} {have}" if have else f"{label} is not installed"
        always = [g for g in mine if g.always]
        if always:
            reasons.append(f"the Lightning path overrides hooks of {label} {TESTED[library]} that it needs to run at "
                           f"all (shared/patches/lightning.py, docs/patches.md), and {found}: install "
                           f"{dist}=={TESTED[library]} (pyproject.toml pins it), or run the raw path "
                           "(plain_deepspeed/train.py), which needs none of them; --profile stock keeps them")
        chosen = [g for g in mine if not g.always]
        if chosen:
            offs = ", ".join(dict.fromkeys(g.off for g in chosen))
            reasons.append(f"{'; '.join(g.setting for g in chosen)}: these replace internals of {label} "
                           f"{TESTED[library]}, the version they were written and tested against (shared/patches, "
                           f"docs/patches.md), and {found}. Install {dist}=={TESTED[library]} (pyproject.toml pins "
                           f"it), run with --profile stock ({label} as shipped: none of this project's patches of "
                           f"it), or turn them off: {offs}")
    return "; and ".join(reasons) or None


def check_versions(train, lightning: bool = False) -> None:
    """Refuse, before any work, a run whose settings need a patch of a library whose installed version is not the
    one tested (ValueError naming both versions and what to do instead)."""
    why = refusal(needed(train, lightning))
    if why:
        raise ValueError(why)


def require(*names: str) -> None:
    """Refuse to install these groups (and the groups they require) on an untested version; every entry point below
    calls it before it replaces anything."""
    groups = [GROUPS[n] for n in names]
    groups += [GROUPS[r] for g in groups for r in g.requires if GROUPS[r] not in groups]
    why = refusal(groups)
    if why:
        raise ValueError(why)


# ---- what this process installed ------------------------------------------------------------------------------------

_INSTALLED: set[str] = set()


def mark(*names: str) -> None:
    """Record that every patch of these groups is installed in this process (the run JSON's extra.patches)."""
    _INSTALLED.update(p.target for p in PATCHES if p.group in names)


def installed() -> list[str]:
    """The targets this process replaced, sorted (every run JSON records them: extra.patches)."""
    return sorted(_INSTALLED)


# ---- entry points: what the training paths call -------------------------------------------------------------------


def before_compile(train) -> None:
    """What must be in place before engine.compile() under DeepCompile: DeepCompile's op with the backward's wait
    on the device (before DeepSpeed loads its own) and the timing of DeepCompile's profilers, as the settings ask."""
    if GROUPS["deepcompile_backward_wait"].on(train):
        require("deepcompile_backward_wait")
        from shared.patches import deepcompile_op

        deepcompile_op.install()
        mark("deepcompile_backward_wait")
    if GROUPS["deepcompile_profilers"].on(train):
        require("deepcompile_profilers")
        from shared.patches import deepcompile

        deepcompile.time_deepcompile_profilers()
        mark("deepcompile_profilers")


def persistence_pass(threshold: int):
    """The DeepCompile pass that keeps the parameters of at most `threshold` elements gathered
    (--deepcompile_persist threshold; shared/patches/deepcompile_passes.py), for the schedule."""
    require("deepcompile_persist")
    from shared.patches.deepcompile_passes import keep_small_params_gathered

    mark("deepcompile_persist")
    return keep_small_params_gathered(threshold)


def after_compile(engine, train) -> None:
    """What replaces DeepCompile's ZeRO-3 internals once engine.compile() has set it up: the eager persistent list
    dropped, the cached walks, as the settings ask; then the pass schedule aligned with the engine's step."""
    from shared.patches import deepcompile

    if GROUPS["deepcompile_eager_persist"].on(train):
        require("deepcompile_eager_persist")
        deepcompile.drop_eager_persistent(engine)
        mark("deepcompile_eager_persist")
    if GROUPS["deepcompile_cached_walks"].on(train):
        require("deepcompile_cached_walks")
        deepcompile.cache_deepcompile_walks(engine)
        mark("deepcompile_cached_walks")
    align_schedule(engine)


def align_schedule(engine, backend=None) -> None:
    """DeepCompile's remaining pass schedule started at the engine's step (a resumed engine; shared/patches/
    deepcompile.align_schedule); call after compiling and after loading a checkpoint into a compiled engine. Changes
    nothing for an engine that has not moved since (a fresh run) or without DeepCompile."""
    from shared.patches import deepcompile

    if engine.is_deepcompile_active() and deepcompile.schedule_shift(engine):
        require("deepcompile_resume")
        mark("deepcompile_resume")
    deepcompile.align_schedule(engine, backend)


def install(engine, train) -> bool:
    """TrainConfig.zero3_step and grad_norm_check on a live engine (shared/patches/zero3_step.py): `fast` or `fused`
    replace the ZeRO-3 optimizer's step internals, grad_norm_check device its invalid-norm check as well; returns
    whether the engine now runs them (False for DeepSpeed's own step, or another ZeRO stage's optimizer)."""
    from shared.patches import zero3_step

    groups = [n for n in ("zero3_step", "grad_norm_check") if GROUPS[n].on(train)]
    require(*groups)
    done = zero3_step.apply(engine, train.zero3_step, train.grad_norm_check)
    if done:
        mark(*groups)
    return done


def step_calls(engine) -> dict[str, int] | None:
    """How often each part of the ZeRO-3 step ran this project's code or fell back to DeepSpeed's (the run JSON's
    extra.zero3_step_calls; shared/patches/zero3_step.calls); None where the step is DeepSpeed's own."""
    from shared.patches import zero3_step

    return zero3_step.calls(engine)


def records() -> dict:
    """What the patches of this process recorded, for the run JSON's extra: the persistence pass's counts, the
    eager persistent parameters dropped, the cached walks, the profilers' time, the DeepCompile op loaded; each None
    where it did not run."""
    import sys

    from shared.patches import deepcompile_op

    passes = sys.modules.get("shared.patches.deepcompile_passes")
    runtime = sys.modules.get("shared.patches.deepcompile")
    return {"deepcompile_persist": getattr(passes, "LAST_STATS", None),
            "deepcompile_eager_persist_dropped": getattr(runtime, "EAGER_PERSIST_DROPPED", None),
            "deepcompile_cached_walks": getattr(runtime, "CACHED_WALKS", None),
            "deepcompile_profilers": getattr(runtime, "PROFILERS", None),
            "deepcompile_op": deepcompile_op.active_op()}
