"""The SM clock and power a run's GPUs held while its timed steps ran, read by nvidia-smi beside the run.

A throughput figure depends on the clock the GPU held, and under a power cap that is not the clock its peak assumes
(how far below, in a training-like loop: docs/results.md, "The one-GPU default with both device options"). `launch`
(harness/launch.py) starts one `nvidia-smi --query-gpu=... -lms 500` beside each run, writing
`<the run's log>.gpu.csv`; after the run, `summarize` keeps the readings taken between the start of the
first timed step and the end of the last one (`extra.timed_wall` in the run JSON, host wall-clock times recorded by
shared/train/timing.PhaseTimer; the host runs up to a step ahead of the device) and reports, per run, the median and
range of the SM clock and power draw, the hottest temperature and the clock-event reasons seen (a bit mask; 0x4: the
software power cap). The readings come from a process of their own, so the training processes do no extra work.
GPUs are named as the run's CUDA_VISIBLE_DEVICES names them (physical indices or UUIDs), which nvidia-smi -i takes.
"""

from __future__ import annotations

import datetime as dt
import shutil
import statistics
import subprocess
from pathlib import Path

FIELDS = ("timestamp", "index", "clocks.sm", "power.draw", "temperature.gpu")
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer and older drivers' names
INTERVAL_MS = 500


def _query(reasons: str | None) -> str:
    return ",".join(FIELDS + ((reasons,) if reasons else ()))


class Telemetry:
    """nvidia-smi in loop mode for the GPUs `gpus`, its CSV lines written to `csv_path`; stop() ends it."""

    def __init__(self, gpus: list[str], csv_path: Path, interval_ms: int | None = None):
        self.gpus, self.csv_path, self.interval_ms = gpus, Path(csv_path), interval_ms or INTERVAL_MS
        self.proc: subprocess.Popen | None = None
        self.error: str | None = None

    def start(self) -> Telemetry:
        """Start the readings; where they cannot be taken, `error` says why and the run goes on without them."""
        try:
            self._start()
        except (OSError, subprocess.SubprocessError) as exc:
            self.error = f"nvidia-smi failed: {type(exc).__name__}: {exc}"
        return self

    def _start(self) -> None:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.error = "nvidia-smi not found"
            return
        ids = ["-i", ",".join(self.gpus)] if self.gpus else []
        query = None
        for reasons in (*REASONS, None):  # the first field list this driver takes
            probe = subprocess.run([smi, *ids, f"--query-gpu={_query(reasons)}", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                query = _query(reasons)
                break
        if query is None:
            self.error = f"nvidia-smi refused the query: {(probe.stdout + probe.stderr).strip()[:300]}"
            return
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.csv_path, "w") as f:
            f.write(f"# {query}\n")
            f.flush()
            self.proc = subprocess.Popen([smi, *ids, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                          "-lms", str(self.interval_ms)], stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def parse(csv_path: Path) -> tuple[list[dict], list[str]]:
    """The readings of a telemetry CSV (each with `t`, POSIX seconds) and the lines that are not readings."""
    readings, other = [], []
    lines = Path(csv_path).read_text().splitlines()
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        values = [v.strip() for v in line.split(",")]
        try:
            t = dt.datetime.strptime(values[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as time.time()
            reading = {"t": t, "gpu": values[1], "sm_mhz": number(values[2]), "power_w": number(values[3]),
                       "temp_c": number(values[4])}
            if len(values) > 5:
                reading["reasons"] = values[5]
        except (ValueError, IndexError):
            other.append(line)
            continue
        readings.append(reading)
    return readings, other


def number(x: str) -> float | None:
    """A numeric nvidia-smi field (nounits), or None where it printed none."""
    try:
        return float(x)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _spread(values: list[float]) -> dict | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(csv_path: Path, window: list[float] | None, gpus: list[str], interval_ms: int) -> dict:
    """The readings of `csv_path` taken inside `window` ([start, end], POSIX seconds), summarized."""
    out = {"source": Path(csv_path).name, "gpus": gpus, "interval_ms": interval_ms, "window": window}
    if window is None:
        return {**out, "error": "the run recorded no timed window (extra.timed_wall)"}
    if not Path(csv_path).is_file():
        return {**out, "error": f"no {Path(csv_path).name}"}
    readings, other = parse(csv_path)
    if other:
        out["unparsed_lines"] = other[:5]
    return {**out, **in_window(readings, window)}


def in_window(readings: list[dict], window: list[float]) -> dict:
    """Of `parse`d readings, those taken inside `window` ([start, end], POSIX seconds): their count, the median and
    range of the SM clock and power, the hottest temperature and the clock-event reasons seen; an error if none."""
    inside = [r for r in readings if window[0] <= r["t"] <= window[1]]
    out = {"readings": len(inside), "readings_in_file": len(readings)}
    if not inside:
        return {**out, "error": f"none of the {len(readings)} readings lies in the timed window"}
    out["sm_mhz"] = _spread([r["sm_mhz"] for r in inside if r["sm_mhz"] is not None])
    out["power_w"] = _spread([r["power_w"] for r in inside if r["power_w"] is not None])
    temps = [r["temp_c"] for r in inside if r["temp_c"] is not None]
    out["temp_c_max"] = max(temps) if temps else None
    out["clock_event_reasons"] = sorted({r["reasons"] for r in inside if "reasons" in r})
    return out


def held_sm_mhz(extra: dict | None) -> float | None:
    """The median SM clock of a run's timed steps from its JSON's `extra` (extra.gpu_telemetry, as `summarize` wrote
    it), or None where no clock was read."""
    return (((extra or {}).get("gpu_telemetry") or {}).get("sm_mhz") or {}).get("median")
