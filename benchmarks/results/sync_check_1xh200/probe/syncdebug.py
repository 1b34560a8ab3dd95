"""Run plain_deepspeed/train.py with torch.cuda's sync debug mode on during one step's forward, backward and step:
every synchronizing CUDA call of that step is recorded with its Python stack (JSON at SYNC_DEBUG_OUT)."""
import json
import os
import runpy
import sys
import time
import traceback
import warnings

import torch
import deepspeed.runtime.engine as eng

STEP = int(os.environ.get("SYNC_DEBUG_STEP", "12"))
OUT = os.environ["SYNC_DEBUG_OUT"]
records = []
_show = warnings.showwarning


def _record(message, category, filename, lineno, file=None, line=None):
    text = str(message)
    if "synchroniz" in text:
        records.append({"phase": _phase[0], "t": time.perf_counter(), "message": text[:200],
                        "stack": traceback.format_stack(limit=30)[:-1]})
    else:
        _show(message, category, filename, lineno, file, line)


_phase = [None]


def wrap(name):
    orig = getattr(eng.DeepSpeedEngine, name)

    def f(self, *a, **k):
        on = self.global_steps == STEP
        if on:
            _phase[0] = name
            warnings.simplefilter("always")
            warnings.showwarning = _record
            torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            if on:
                torch.cuda.set_sync_debug_mode("default")
                records.append({"phase": name, "end": True, "host_ms": (time.perf_counter() - t0) * 1e3})
                with open(OUT, "w") as fh:
                    json.dump({"command": " ".join(sys.argv), "step": STEP, "records": records}, fh, indent=1)

    setattr(eng.DeepSpeedEngine, name, f)


for n in ("forward", "backward", "step"):
    wrap(n)

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
