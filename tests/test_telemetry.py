"""harness/telemetry.py: the SM clock and power read beside a run, cut to its timed steps (a fake nvidia-smi on CPU)."""

import datetime as dt
import json
import os
import stat
import time

import pytest

from harness import launch as launch_mod
from harness import telemetry
from shared.train.config import TrainConfig

# Prints what `nvidia-smi --query-gpu=... --format=csv,noheader,nounits [-lms N]` would for GPUs of -i, with the
# time of each reading; FAKE_SMI_OLD=1 refuses the newer field name as an older driver does.
FAKE_SMI = r'''#!/usr/bin/env python3
import datetime, os, sys, time
args = sys.argv[1:]
query = next(a for a in args if a.startswith("--query-gpu=")).split("=", 1)[1]
if os.environ.get("FAKE_SMI_OLD") and "clocks_event_reasons" in query:
    print('Field "clocks_event_reasons.active" is not a valid field to query.'); sys.exit(2)
gpus = args[args.index("-i") + 1].split(",") if "-i" in args else ["0"]
loop_ms = int(args[args.index("-lms") + 1]) if "-lms" in args else None
n = 0
while True:
    for g in gpus:
        now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        row = [now, g, str(1700 + n % 3 * 10), "690.50", "61"] + (["0x0000000000000004"] if "reasons" in query else [])
        print(", ".join(row), flush=True)
    n += 1
    if loop_ms is None:
        break
    time.sleep(loop_ms / 1000)
'''


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return smi


def test_readings_are_taken_beside_and_cut_to_the_window(tmp_path, fake_smi):
    csv = tmp_path / "logs" / "run.gpu.csv"
    tele = telemetry.Telemetry(["0", "1"], csv, interval_ms=20).start()
    assert tele.error is None
    time.sleep(0.3)
    t0 = time.time()
    time.sleep(0.3)
    t1 = time.time()
    time.sleep(0.2)
    tele.stop()
    assert tele.proc.poll() is not None  # stopped
    readings, other = telemetry.parse(csv)
    assert other == [] and {r["gpu"] for r in readings} == {"0", "1"}
    assert csv.read_text().startswith("# timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons")
    s = telemetry.summarize(csv, [t0, t1], ["0", "1"], interval_ms=20)
    assert 0 < s["readings"] < s["readings_in_file"]
    assert s["sm_mhz"]["min"] >= 1700 and s["sm_mhz"]["max"] <= 1720 and s["power_w"]["median"] == 690.5
    assert s["temp_c_max"] == 61 and s["clock_event_reasons"] == ["0x0000000000000004"]
    assert s["window"] == [t0, t1] and s["gpus"] == ["0", "1"] and s["interval_ms"] == 20
    late = telemetry.summarize(csv, [t1 + 60, t1 + 61], ["0", "1"], interval_ms=20)
    assert late["error"].startswith("none of the") and "sm_mhz" not in late
    assert telemetry.summarize(csv, None, ["0"], interval_ms=20)["error"].startswith("the run recorded no timed window")


def test_an_older_driver_gets_the_older_field_name(tmp_path, fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_OLD", "1")
    tele = telemetry.Telemetry(["0"], tmp_path / "r.gpu.csv", interval_ms=20).start()
    time.sleep(0.2)
    tele.stop()
    assert tele.error is None and "clocks_throttle_reasons.active" in (tmp_path / "r.gpu.csv").read_text()


def test_without_nvidia_smi_the_reason_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    tele = telemetry.Telemetry(["0"], tmp_path / "r.gpu.csv").start()
    assert tele.error == "nvidia-smi not found" and tele.proc is None
    tele.stop()  # nothing to stop


def test_lines_that_are_not_readings_are_kept_apart(tmp_path):
    csv = tmp_path / "r.gpu.csv"
    now = dt.datetime.now()
    stamp = now.strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    csv.write_text(f"# query\n{stamp}, 0, [N/A], 650.0, 60\nFailed to initialize NVML: Driver/library mismatch\n")
    readings, other = telemetry.parse(csv)
    assert readings == [{"t": pytest.approx(now.timestamp(), abs=1e-3), "gpu": "0", "sm_mhz": None,
                         "power_w": 650.0, "temp_c": 60.0}]
    assert other == ["Failed to initialize NVML: Driver/library mismatch"]
    s = telemetry.summarize(csv, [now.timestamp() - 1, now.timestamp() + 1], ["0"], interval_ms=500)
    assert s["sm_mhz"] is None and s["power_w"]["median"] == 650.0 and s["unparsed_lines"] == other


def test_a_run_records_its_timed_window_and_the_clock_of_its_gpus(tmp_path, fake_smi, monkeypatch):
    """launch() on a CPU run with GPUs pretended: the readings land in the run JSON, cut to the timed steps."""
    monkeypatch.setattr(launch_mod, "run_gpus", lambda env, world: ["0"])
    monkeypatch.setattr(telemetry, "INTERVAL_MS", 20)
    train = TrainConfig(preset="tiny", steps=12, warmup_steps=2, log_every=6)
    out, log = tmp_path / "runs" / "deepspeed_0.json", tmp_path / "logs" / "deepspeed_0.log"
    result = launch_mod.launch("deepspeed", train, 1, out, log, timeout=300)
    start, end = result.extra["timed_wall"]
    assert 0 < end - start < 300
    t = json.loads(out.read_text())["extra"]["gpu_telemetry"]  # saved into the run's JSON
    assert t == result.extra["gpu_telemetry"] and t["gpus"] == ["0"] and t["source"] == "deepspeed_0.gpu.csv"
    assert (tmp_path / "logs" / "deepspeed_0.gpu.csv").is_file()
    # 10 timed ZeRO-3 steps of the tiny model on a CPU take well over the 20 ms between readings
    assert "error" not in t and t["readings"] >= 2 and 1700 <= t["sm_mhz"]["median"] <= 1720, t
    readings, _ = telemetry.parse(tmp_path / "logs" / "deepspeed_0.gpu.csv")
    assert t["readings"] < len(readings)  # the start-up's readings are left out


@pytest.mark.gpu
def test_the_real_nvidia_smi_reads_the_clock_of_a_busy_gpu(tmp_path):
    """The flags, field names and timestamp format on a real driver: a matmul loop on GPU 0, read beside it."""
    import torch

    gpu = launch_mod.run_gpus(None, 1)
    tele = telemetry.Telemetry(gpu, tmp_path / "busy.gpu.csv").start()
    assert tele.error is None, tele.error
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.time()
    while time.time() - t0 < 3:
        for _ in range(20):
            x = torch.mm(x, x).clamp_(-1, 1)
        torch.cuda.synchronize()
    t1 = time.time()
    tele.stop()
    s = telemetry.summarize(tele.csv_path, [t0, t1], gpu, tele.interval_ms)
    print(s)
    assert "error" not in s and "unparsed_lines" not in s and s["readings"] >= 6, s
    assert 300 <= s["sm_mhz"]["median"] <= 3000 and s["power_w"]["median"] > 50 and s["clock_event_reasons"], s
