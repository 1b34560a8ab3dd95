"""DeepCompile's C++ op with the end of the backward waited for on the device instead of on the host.

DeepSpeed 0.19.8's op (`dc`, built from deepspeed/ops/csrc/compile/ and includes/deepcompile.h) ends every backward
with `at::cuda::stream_synchronize(rs_stream_)`: the host waits until the reduce-scatter stream has finished, so
that "all of reduce calls are done before optimizer's step". That wait empties the device's queue at every step:
whatever the host does next (the autograd engine's own work after the backward, the optimizer step's Python before
its first kernel) runs on an idle device (docs/results.md, "The two host syncs of a ZeRO-3 step").

The optimizer step's kernels run on the compute stream, so the compute stream waiting for the reduce-scatter
stream gives the same order without stopping the host: an event recorded on the reduce-scatter stream, which the
compute stream waits on. `dc_device_wait` is DeepSpeed's op built from DeepSpeed's own installed sources with that
one statement replaced, through DeepSpeed's own builder (the patched header is found first on the include path;
every other file is DeepSpeed's). The buffers the reductions use stay safe: what the host frees after the wait is
reused only by work queued behind it on the compute stream, or on the reduce-scatter stream itself.

Only one library may register the `dc` operators in a process, so `install()` must run before anything loads
DeepSpeed's (engine.compile() does, at its first call of deepspeed.compile.util.get_deepcompile_handle); it hands
DeepSpeed the patched module through that function's cached handle. A DeepSpeed whose header no longer holds the
statement exactly as 0.19.8 wrote it is refused: the option never silently builds DeepSpeed's op or another change.

`--deepcompile_skip_divide_by_one` is a second patch of the same header, alone or with the first: before each
reduce-scatter the op divides every gradient by the world size (DeepSpeed's pre-division, always on in 0.19.8), a
kernel per parameter on its reduce-scatter stream, also when the world size is 1 (292 multiplications by 1.0 a step
of the 1.5b preset, 4.4-4.6 ms of device time in its profiles, benchmarks/results/together_1xh200). The patch skips the
division where the world size is 1, where it changes no bit; on more GPUs the op divides as DeepSpeed's does. The op
is named after its patches (op_name): `dc_device_wait`, `dc_skip_divide_by_one`, `dc_device_wait_skip_divide_by_one`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OP_NAME = "dc_device_wait"  # the op with the device wait alone (op_name(("device_wait",)))
# endBackward of CustomOpExecutor, exactly as DeepSpeed 0.19.8 writes it (its other stream_synchronize, when a
# gradient outgrows its bucket, stays).
HOST_WAIT = """\
    virtual void endBackward()
    {
        flushAllReduceBuckets();

        // This synchronization ensures all of reduce calls are done before optimizer's step.
        at::cuda::stream_synchronize(rs_stream_);
    }
"""
DEVICE_WAIT = """\
    virtual void endBackward()
    {
        flushAllReduceBuckets();

        // The optimizer's step runs on the compute stream: that stream waits for the reductions, the host does not
        // (shared/train/deepcompile_op.py).
        at::cuda::CUDAEvent reduce_done(cudaEventDisableTiming);
        reduce_done.record(rs_stream_);
        reduce_done.block(at::cuda::getCurrentCUDAStream());
    }
"""


# The reduce-scatter's pre-division, exactly as DeepSpeed 0.19.8 writes it, and with the division by 1 skipped.
DIVIDE_ALWAYS = """\
    void applyPreDivision(at::ScalarType scalar_type)
    {
        if (pre_div_reduce_) {
"""
DIVIDE_BUT_BY_ONE = """\
    void applyPreDivision(at::ScalarType scalar_type)
    {
        // a division by a world size of 1 changes no bit (shared/train/deepcompile_op.py)
        if (pre_div_reduce_ && process_group_->getSize() > 1) {
"""
# patch name -> (DeepSpeed's text, ours, the option that asks for it, the setting that runs DeepSpeed's text)
PATCHES = {
    "device_wait": (HOST_WAIT, DEVICE_WAIT, "--deepcompile_backward_wait device", "--deepcompile_backward_wait host"),
    "skip_divide_by_one": (DIVIDE_ALWAYS, DIVIDE_BUT_BY_ONE, "--deepcompile_skip_divide_by_one true",
                           "--deepcompile_skip_divide_by_one false"),
}


def _ordered(patches) -> tuple[str, ...]:
    unknown = sorted(set(patches) - set(PATCHES))
    if unknown or not patches:
        raise ValueError(f"DeepCompile op patches {list(patches)}: choose one or more of {list(PATCHES)}")
    return tuple(p for p in PATCHES if p in patches)


def op_name(patches) -> str:
    """The op's name for a set of patches, in PATCHES' order: dc_device_wait, dc_device_wait_skip_divide_by_one, ..."""
    return "dc_" + "_".join(_ordered(patches))


def patched_header(header: str, patches) -> str:
    """deepcompile.h with each patch's text of DeepSpeed 0.19.8 replaced by this project's; a header that does not
    hold a patch's text exactly once is refused, naming the option and the setting that runs DeepSpeed's op."""
    for name in _ordered(patches):
        theirs, ours, option, fallback = PATCHES[name]
        found = header.count(theirs)
        if found != 1:
            raise ValueError(f"{option} patches DeepSpeed 0.19.8's deepcompile.h, which this DeepSpeed's header holds "
                             f"{found} times (expected once): this DeepSpeed changed the op; use {fallback} "
                             "(DeepSpeed's own text)")
        header = header.replace(theirs, ours)
    return header


def device_wait_header(header: str) -> str:
    """deepcompile.h with endBackward's host wait replaced by the compute stream's wait on an event."""
    return patched_header(header, ("device_wait",))


def _write_if_changed(path: Path, text: str) -> None:
    """Write atomically and only when the text differs, so concurrent ranks and ninja's timestamps agree."""
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def builder(include_dir: Path | None = None, patches=("device_wait",)):
    """DeepSpeed's DeepCompile builder under the patched op's own name, with the patched header first on the include
    path."""
    from deepspeed.ops.op_builder.dc import DeepCompileBuilder
    from torch.utils.cpp_extension import get_default_build_root

    name, patches = op_name(patches), _ordered(patches)
    include_dir = Path(include_dir or Path(get_default_build_root()) / f"{name}_include")

    class PatchedBuilder(DeepCompileBuilder):
        NAME = name

        def include_paths(self):
            original = Path(self.deepspeed_src_path("csrc/includes")) / "deepcompile.h"
            _write_if_changed(include_dir / "deepcompile.h", patched_header(original.read_text(), patches))
            return [str(include_dir), *super().include_paths()]

    return PatchedBuilder()


def install(patches=("device_wait",)):
    """Build (once per machine, cached like DeepSpeed's own op) and load the op with these patches (op_name), and
    make it the module DeepCompile uses in this process. Refused once another DeepCompile op is loaded."""
    import deepspeed.compile.util as dc_util

    name, loaded = op_name(patches), active_op()
    if loaded == name:
        return dc_util.dc_handle
    if loaded is not None:
        options = " and ".join(PATCHES[p][2] for p in _ordered(patches))
        raise RuntimeError(f"{options} must be set up before DeepSpeed loads a DeepCompile op, which this process "
                           f"already did ({loaded})")
    dc_util.dc_handle = builder(patches=patches).load()
    return dc_util.dc_handle


def active_op() -> str | None:
    """The name of the DeepCompile op this process loaded (dc: DeepSpeed's own; else op_name's), None if none."""
    dc_util = sys.modules.get("deepspeed.compile.util")
    handle = getattr(dc_util, "dc_handle", None)
    return None if handle is None else handle.__name__.rsplit(".", 1)[-1]
