"""Test set-up: CPU by default; `gpu`-marked tests run only where CUDA is present (the device machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# DeepSpeed JIT-builds its ops under TORCH_EXTENSIONS_DIR, by default the user's ~/.cache/torch_extensions: a
# build killed there (a test timing out) would leave a lock that hangs the user's own runs, and theirs ours. The
# tests build into the project's own folder unless one is set.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))

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
