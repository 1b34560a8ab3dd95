"""Test set-up: CPU by default; `gpu`-marked tests run only where CUDA is present (the device machine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# DeepSpeed JIT-builds its ops under TORCH_EXTENSIONS_DIR, by default the user's ~/.cache/torch_extensions: a
# build killed there (a test timing out) would leave a lock that hangs the user's own runs, and theirs ours. The
# tests build into the project's own folder unless one is set.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))
# One ninja for every build there: the one installed beside this Python, which benchmarks/ds_autotuner.py puts first
# on PATH for DeepSpeed's autotuner. Ninja 1.13 (pip's) and 1.11 (e.g. /usr/bin) hash a command differently in
# .ninja_log, so each read the other's build of deepspeed_shm_comm as "command line changed" and rebuilt it (about
# a minute and a half on 2 cores) whenever a test ran processes under the other PATH.
# Only in a virtual environment with its own ninja: a system Python's folder (/usr/bin) first would shadow other tools.
_BIN = str(Path(sys.executable).parent)
if (sys.prefix != sys.base_prefix and (Path(_BIN) / "ninja").exists()
        and os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN):
    os.environ["PATH"] = os.pathsep.join(filter(None, [_BIN, os.environ.get("PATH")]))

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton kernels run under the interpreter on CPU; it must be set before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
