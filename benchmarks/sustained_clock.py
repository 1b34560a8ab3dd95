"""The 1.5b layer's kernels under sustained load: how fast they run, and at what SM clock and power, second by second.

    python benchmarks/sustained_clock.py --seconds 40 --out benchmarks/results/sustained_clock.json   # one GPU

A training step runs the matmuls and the attention (cuDNN, with the preset's dropout) back to back for minutes; the
same kernels timed alone, in bursts of ~100 ms (benchmarks/attention.py, attention_layout.py), run faster than in a
profiled step. This loop runs one layer's kernels at the GPU default's shape (micro-batch 16, seq 2048, n_embd 2304,
24 heads) without a pause: the MLP's two matmuls forward (tokens x C x 4C and back) and the attention forward +
backward. The host queues about `--window` seconds of work and waits for it while a thread reads the SM clock, power
draw, temperature and the active clock-event reasons (nvidia-smi, 4 readings a window, their median kept); per window
the JSON keeps the attention's and the matmuls' mean time per iteration (CUDA events around each), the matmuls'
TFLOP/s and those readings. The first window against the last ones shows how much of the kernels' speed a sustained
load keeps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.telemetry import REASONS, number
from shared.model.config import PRESETS
from shared.train.results import device_info, versions, write_json

SMI_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")


def smi() -> dict:
    """One nvidia-smi reading of the first visible GPU, or why there is none."""
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    errors = []
    for reasons in (*REASONS, None):
        fields = ",".join(SMI_FIELDS + ((reasons,) if reasons else ()))
        try:
            out = subprocess.run(["nvidia-smi", "-i", gpu, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
            return parse_smi(out)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return {"error": "; ".join(errors)}


def parse_smi(line: str) -> dict:
    """`clock, power, temperature[, reasons]` as nvidia-smi prints them (csv, noheader, nounits)."""
    values = [x.strip() for x in line.split(",")]
    if len(values) not in (3, 4):
        raise ValueError(f"nvidia-smi printed {line!r}; expected clock, power, temperature[, reasons]")
    reading = {"sm_mhz": number(values[0]), "power_w": number(values[1]), "temp_c": number(values[2])}
    if len(values) == 4:
        reading["event_reasons"] = values[3]
    return reading


class Poller(threading.Thread):
    """nvidia-smi readings every `every_s` seconds, in the background, each with its time."""

    def __init__(self, every_s: float, t0: float):
        super().__init__(daemon=True)
        self.every_s, self.t0, self.readings, self.stopped = every_s, t0, [], threading.Event()

    def run(self):
        while not self.stopped.is_set():
            t = time.perf_counter() - self.t0
            self.readings.append((t, smi()))
            self.stopped.wait(self.every_s)

    def between(self, a: float, b: float) -> dict:
        """The median of each numeric reading taken between times a and b, and the reasons seen."""
        got = [r for t, r in self.readings if a <= t <= b and "error" not in r]
        if not got:
            return {"readings": 0}
        out = {"readings": len(got)}
        for key in ("sm_mhz", "power_w", "temp_c"):
            vals = [r[key] for r in got if r.get(key) is not None]
            out[key] = statistics.median(vals) if vals else None
        out["event_reasons"] = sorted({r["event_reasons"] for r in got if "event_reasons" in r})
        return out


def main(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/sustained_clock.py needs a CUDA GPU")
    p = PRESETS[args.preset]
    B, T, C, H = args.batch, p["seq_len"], p["n_embd"], p["n_head"]
    D = C // H
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(B * T, C, **bf16)
    w1, w2 = torch.randn(C, 4 * C, **bf16) / C**0.5, torch.randn(4 * C, C, **bf16) / (4 * C) ** 0.5
    q, k, v = (torch.randn(B, H, T, D, **bf16).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, T, D, **bf16)
    mm_flops = 2 * 2 * B * T * C * 4 * C

    def iteration(ev):
        ev[0].record()
        torch.mm(torch.mm(x, w1), w2)
        ev[1].record()
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=args.dropout, is_causal=True)
        torch.autograd.grad(out, (q, k, v), do)
        ev[2].record()

    for _ in range(3):  # warm-up: cuDNN's plan, cuBLAS's heuristics
        iteration([torch.cuda.Event(enable_timing=True) for _ in range(3)])
    torch.cuda.synchronize()
    t = time.perf_counter()
    iteration([torch.cuda.Event(enable_timing=True) for _ in range(3)])
    torch.cuda.synchronize()
    per_iter_s = time.perf_counter() - t
    n = max(1, round(args.window / per_iter_s))
    windows, started = [], time.perf_counter()
    poller = Poller(args.window / 4, started)
    poller.start()
    try:
        while time.perf_counter() - started < args.seconds:
            events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
            t0 = time.perf_counter() - started
            for ev in events:
                iteration(ev)
            torch.cuda.synchronize()
            t1 = time.perf_counter() - started
            mm = [a.elapsed_time(b) for a, b, _ in events]
            at = [b.elapsed_time(c) for _, b, c in events]
            windows.append({"t_s": round(t0, 2), "iterations": n, "matmul_ms": statistics.mean(mm),
                            "matmul_tflops": mm_flops / (statistics.mean(mm) * 1e-3) / 1e12,
                            "attention_ms": statistics.mean(at), **poller.between(t0 + 0.1 * (t1 - t0), t1)})
            w = windows[-1]
            print(f"[{w['t_s']:6.1f}s] attention {w['attention_ms']:.3f} ms, matmuls {w['matmul_ms']:.3f} ms "
                  f"({w['matmul_tflops']:.0f} TFLOP/s), SM {w.get('sm_mhz')} MHz, {w.get('power_w')} W, "
                  f"{w.get('temp_c')} C, reasons {w.get('event_reasons')}", flush=True)
    finally:
        poller.stopped.set()
    if len(windows) < 2:
        raise SystemExit(f"only {len(windows)} window in --seconds {args.seconds}: give it more seconds")
    first, last = windows[0], windows[-min(3, len(windows) - 1):]
    summary = {key: {"first": first[key], "last_mean": statistics.mean(w[key] for w in last),
                     "last_over_first": statistics.mean(w[key] for w in last) / first[key]}
               for key in ("attention_ms", "matmul_ms", "matmul_tflops", "sm_mhz", "power_w")
               if isinstance(first.get(key), float) and all(isinstance(w.get(key), float) for w in last)}
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": versions(),
        "device": device_info(torch.device("cuda")),
        "settings": {"preset": args.preset, "batch": B, "seq": T, "n_embd": C, "heads": H, "head_dim": D,
                     "dropout": args.dropout, "seconds": args.seconds, "window_s": args.window,
                     "iteration": "mm(mm(x[B*T, C], w1[C, 4C]), w2[4C, C]), then SDPA causal forward + backward",
                     "nvidia_smi_fields": [*SMI_FIELDS, "clock event reasons"]},
        "summary_last_3_windows_vs_first": summary,
        "windows": windows,
    }
    for key, s in summary.items():
        print(f"{key}: first {s['first']:.3f}, last windows {s['last_mean']:.3f} ({s['last_over_first']:.3f}x)")
    if args.out:
        write_json(args.out, result)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/sustained_clock.json", help="where to write the JSON result")
    p.add_argument("--preset", default="1.5b", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=16, help="the GPU default's micro-batch")
    p.add_argument("--dropout", type=float, default=0.1, help="attention dropout (the preset's rate)")
    p.add_argument("--seconds", type=float, default=40.0, help="how long to run")
    p.add_argument("--window", type=float, default=1.0, help="seconds of queued work per reading")
    args = p.parse_args(argv)
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.batch < 1 or args.seconds <= 0 or args.window <= 0:
        p.error("--batch, --seconds and --window must be positive")
    return args


if __name__ == "__main__":
    main(parse_args())
