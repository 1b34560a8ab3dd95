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
Installed through shared/patches (`patches.before_compile`), which checks the DeepSpeed version first; the
measurement: docs/ledger.md, row `--deepcompile_backward_wait device`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OP_NAME = "dc_device_wait"
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
        // (shared/patches/deepcompile_op.py).
        at::cuda::CUDAEvent reduce_done(cudaEventDisableTiming);
        reduce_done.record(rs_stream_);
        reduce_done.block(at::cuda::getCurrentCUDAStream());
    }
"""


def device_wait_header(header: str) -> str:
    """deepcompile.h with endBackward's host wait replaced by the compute stream's wait on an event."""
    found = header.count(HOST_WAIT)
    if found != 1:
        raise ValueError(f"--deepcompile_backward_wait device patches DeepSpeed 0.19.8's endBackward in "
                         f"deepcompile.h, which this DeepSpeed's header holds {found} times (expected once): this "
                         "DeepSpeed changed the op; use --deepcompile_backward_wait host (DeepSpeed's own op)")
    return header.replace(HOST_WAIT, DEVICE_WAIT)


def _write_if_changed(path: Path, text: str) -> None:
    """Write atomically and only when the text differs, so concurrent ranks and ninja's timestamps agree."""
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def builder(include_dir: Path | None = None):
    """DeepSpeed's DeepCompile builder under its own name, with the patched header first on the include path."""
    from deepspeed.ops.op_builder.dc import DeepCompileBuilder
    from torch.utils.cpp_extension import get_default_build_root

    include_dir = Path(include_dir or Path(get_default_build_root()) / f"{OP_NAME}_include")

    class DeviceWaitBuilder(DeepCompileBuilder):
        NAME = OP_NAME

        def include_paths(self):
            original = Path(self.deepspeed_src_path("csrc/includes")) / "deepcompile.h"
            _write_if_changed(include_dir / "deepcompile.h", device_wait_header(original.read_text()))
            return [str(include_dir), *super().include_paths()]

    return DeviceWaitBuilder()


def install():
    """Build (once per machine, cached like DeepSpeed's own op) and load `dc_device_wait`, and make it the module
    DeepCompile uses in this process. Refused once DeepSpeed's own op is loaded."""
    import deepspeed.compile.util as dc_util

    loaded = active_op()
    if loaded == OP_NAME:
        return dc_util.dc_handle
    if loaded is not None:
        raise RuntimeError("--deepcompile_backward_wait device must be set up before DeepSpeed loads its own "
                           f"DeepCompile op, which this process already did ({loaded})")
    dc_util.dc_handle = builder().load()
    return dc_util.dc_handle


def active_op() -> str | None:
    """The name of the DeepCompile op this process loaded (dc: DeepSpeed's own; dc_device_wait), None if none."""
    dc_util = sys.modules.get("deepspeed.compile.util")
    handle = getattr(dc_util, "dc_handle", None)
    return None if handle is None else handle.__name__.rsplit(".", 1)[-1]
