"""The 1.5b layer's kernels under sustained load: how fast they run, and at what SM clock and power, second by second.

    python benchmarks/sustained_clock.py --seconds 40 --out reports/sustained_clock.json   # one GPU

A training step runs the matmuls and the attention (cuDNN, with the preset's dropout) back to back for minutes; the
same kernels timed alone, in bursts of ~100 ms (benchmarks/attention.py, attention_layout.py), run faster than in a
profiled step. This loop runs one layer's kernels at the GPU default's shape (micro-batch 16, seq 2048, n_embd 2304,
24 heads) without a pause: the MLP's two matmuls forward (tokens x C x 4C and back) and the attention forward +
backward. The host queues about `--window` seconds of work and waits for it while nvidia-smi reads the SM clock, power
draw, temperature and the active clock-event reasons beside it (harness/telemetry.py's loop, 4 readings a window,
written to `<out>.gpu.csv`; the window's median clock and power kept); per window
the JSON keeps the attention's and the matmuls' mean time per iteration (CUDA events around each), the matmuls'
TFLOP/s and those readings. The first window against the last ones shows how much of the kernels' speed a sustained
load keeps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from harness import telemetry
from harness.launch import visible_gpu
from shared.model.config import PRESETS
from shared.train.cli import check_out_flag
from shared.train.results import device_info, versions, write_json


def window_reading(readings: list[dict], t0: float, t1: float) -> dict:
    """Of the telemetry readings (harness/telemetry.parse) those taken between POSIX times t0 and t1: their count,
    the median SM clock and power, the hottest temperature and the clock-event reasons seen; `readings` 0 (and the
    error) where there are none."""
    s = telemetry.in_window(readings, [t0, t1])
    if "error" in s:
        return {"readings": 0, "error": s["error"]}
    median = lambda key: s[key]["median"] if s.get(key) else None
    return {"readings": s["readings"], "sm_mhz": median("sm_mhz"), "power_w": median("power_w"),
            "temp_c": s["temp_c_max"], "event_reasons": s["clock_event_reasons"]}


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
    gpus = [visible_gpu(0)]
    interval_ms = max(100, round(args.window * 1000 / 4))  # 4 readings a window
    csv_path = Path(args.out or "sustained_clock.json").with_suffix(".gpu.csv")
    tele = telemetry.Telemetry(gpus, csv_path, interval_ms).start()
    if tele.error:
        print(f"no clock readings: {tele.error}", flush=True)
    windows, started = [], time.time()
    try:
        while time.time() - started < args.seconds:
            events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
            t0 = time.time()
            for ev in events:
                iteration(ev)
            torch.cuda.synchronize()
            t1 = time.time()
            mm = [a.elapsed_time(b) for a, b, _ in events]
            at = [b.elapsed_time(c) for _, b, c in events]
            windows.append({"t_s": round(t0 - started, 2), "iterations": n, "matmul_ms": statistics.mean(mm),
                            "matmul_tflops": mm_flops / (statistics.mean(mm) * 1e-3) / 1e12,
                            "attention_ms": statistics.mean(at), "wall": [t0, t1]})
    finally:
        time.sleep(interval_ms / 1000)  # nvidia-smi writes a reading after it takes it: let the last one land
        tele.stop()
    readings = telemetry.parse(csv_path)[0] if csv_path.is_file() else []
    for w in windows:  # the readings of each window, once the load has ended (no pause between windows)
        t0, t1 = w.pop("wall")
        w.update(window_reading(readings, t0 + 0.1 * (t1 - t0), t1))
        print(f"[{w['t_s']:6.1f}s] attention {w['attention_ms']:.3f} ms, matmuls {w['matmul_ms']:.3f} ms "
              f"({w['matmul_tflops']:.0f} TFLOP/s), SM {w.get('sm_mhz')} MHz, {w.get('power_w')} W, "
              f"{w.get('temp_c')} C, reasons {w.get('event_reasons')}", flush=True)
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
                     "telemetry": {"csv": csv_path.name, "interval_ms": interval_ms, "error": tele.error,
                                   "fields": "SM clock, power, temperature, clock-event reasons (harness/telemetry)"}},
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
    p.add_argument("--out", default="reports/sustained_clock.json", help="where to write the JSON result")
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
    if args.seconds < 2 * args.window:  # one window has nothing to be compared with: refused now, not after it ran
        p.error(f"--seconds {args.seconds:g} must be at least twice --window {args.window:g}: the summary compares "
                "the first window with the later ones")
    check_out_flag(p, args.out)  # a folder or an unwritable path: refused before it measures
    return args


if __name__ == "__main__":
    main(parse_args())
