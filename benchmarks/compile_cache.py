"""Carry the compile caches from one GPU machine to the next: inductor's compiled graphs and tuned kernels, and
Triton's kernel binaries.

    python benchmarks/compile_cache.py save OUTDIR       # end of a job: OUTDIR/compile_cache.json + .tar.gz parts
    python benchmarks/compile_cache.py restore DIR       # start of the next, on a fresh machine: unpack DIR's parts

A machine that keeps its disk pays these once. A lent or preemptible one starts bare every time, and its first
DeepCompile run of the 1.5b preset compiles every kernel and, with `--coordinate_descent_tuning`, benchmarks each
one's block sizes again. In `benchmarks/results/headline_device_checks_1xh200` (one machine, `extra.warmup_s` of its
run JSONs), the raw path's first run, the machine's first, warmed up for 231 s and its second, the machine's fifth,
for 148 s; the ceiling, another graph, compiled there once, for 217 s. `save` packs the two cache folders (each
where the library reads it: TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, or their defaults) into one gzipped tar
split into parts of at most --part_mib (a job's outputs may be capped per file), with a manifest of the folders,
the versions and the device they were made with and each part's SHA-256. If the archive exceeds --max_mib, what is
packed last is left out first until it fits (inductor's generated code and graphs, then Triton's binaries;
inductor's tuning results, a few bytes each and minutes of benchmarks to redo, last); of the last part that fits in
part, its newest folders (a Triton kernel each) are packed, and the manifest says what was left out and trimmed.
`restore` unpacks them only where everything that keys a cache is the same (Python, torch, CUDA, Triton,
DeepSpeed, the GPU's name and compute capability; else it says what differs and does nothing), each folder only
where it is the same path as where it was made (Triton's cache names its files by absolute path), after checking
every part's hash, into a scratch folder first, each file written under a temporary name and renamed; files the
machine already has are left as they are, and an archive a machine restored once (a marker in inductor's
folder names it) is not unpacked there again. Lock and temporary files are never packed.

DeepSpeed's JIT-built ops (TORCH_EXTENSIONS_DIR) are not carried: ninja rebuilds an op whose sources were installed
after the build or at another path, and a fresh machine installs them anew, so a carried build would save nothing
(on one machine, benchmarks/device.py keeps them from call to call: `stable_deepspeed`).

Caches change no timed step: the warm-up steps that compile are excluded from every figure (the run JSON's
`extra.compile_cache` counts inductor's cache hits and misses, `extra.compile_s` the seconds spent compiling).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

MANIFEST = "compile_cache.json"
ARCHIVE = "compile_cache.tar.gz"
ROLES = ("triton", "inductor")  # the cache folders, as the archive names them
# What is packed, in the order of keeping (the last left out first): inductor's tuning results (the block sizes
# coordinate-descent tuning and autotuning chose, a few bytes each, minutes of benchmarks: `.best_config` files in
# torch 2.13, `.best` in older ones), Triton's kernel binaries, then the rest of inductor's folder (generated code,
# compiled graphs: the bulk).
TUNING = (".best", ".best_config")
PARTS = {"inductor tuning": ("inductor", lambda rel: rel.suffix in TUNING),
         "triton kernels": ("triton", lambda rel: True),
         "inductor graphs": ("inductor", lambda rel: rel.suffix not in TUNING)}
KEYED_BY = ("python", "torch", "cuda", "triton", "deepspeed")  # versions that key the caches' entries
SKIPPED_NAMES = ("lock",)  # a lock a killed process leaves behind would stall every later one
# Written into the inductor folder once an archive is restored, named by its parts' hashes: the next call on the same
# (warm) machine skips unpacking the same archive again (tens of MiB, about 11,000 files), and save never packs it.
RESTORED = ".restored_"


def cache_dirs() -> dict[str, Path]:
    """Where this process's libraries keep each cache: the env variable where set, else the library's default."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    # triton.knobs.cache.dir's rule; where TRITON_CACHE_DIR is unset, inductor keeps its own kernels' binaries in
    # its folder (TORCHINDUCTOR_CACHE_DIR/triton) and Triton the hand-written kernels' here
    triton = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return {"triton": Path(triton), "inductor": Path(inductor_cache_dir())}


def identity() -> dict:
    """What the caches' entries depend on: the versions in KEYED_BY and the device."""
    from shared.train.results import device_info, versions

    dev = device_info()
    v = versions()
    return {"versions": {k: v.get(k) for k in KEYED_BY}, "device": dev["name"], "capability": dev["capability"]}


def _skipped(path: Path) -> bool:
    return (path.name in SKIPPED_NAMES or path.name.endswith(".lock") or ".tmp" in path.suffix
            or path.name.startswith(RESTORED))


def _files(root: Path) -> list[Path]:
    """Regular files under root (no links, no lock or temporary files), sorted."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and not _skipped(p))


def _selected(dirs: dict[str, Path], part: str) -> list[tuple[Path, str]]:
    """The files of PARTS[part]: (path, name in the archive)."""
    role, keep = PARTS[part]
    return [(f, f"{role}/{f.relative_to(dirs[role]).as_posix()}") for f in _files(dirs[role])
            if keep(f.relative_to(dirs[role]))]


def _newest_first(files: list[tuple[Path, str]], st: dict[Path, os.stat_result]) -> list[list[tuple[Path, str]]]:
    """The files grouped by folder (one Triton kernel's binaries and metadata are one folder), the folder written
    last first (`st`: each file's stat): what a size limit keeps of a part that does not fit whole."""
    groups: dict[Path, list[tuple[Path, str]]] = {}
    for f, name in files:
        groups.setdefault(f.parent, []).append((f, name))
    return sorted(groups.values(), key=lambda g: (-max(st[f].st_mtime for f, _ in g), g[0][1]))


def _archive(selected: dict[str, list[tuple[Path, str]]], parts: list[str]) -> tuple[bytes, dict]:
    buf = io.BytesIO()
    summary = {}
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for part in parts:
            files = selected[part]
            for f, name in files:
                tar.add(f, arcname=name, recursive=False)
            summary[part] = {"files": len(files), "bytes": sum(f.stat().st_size for f, _ in files)}
    return buf.getvalue(), summary


def check_sizes(max_mib: float, part_mib: float) -> None:
    """save()'s limits, checked by the command before anything is packed: finite (nan passes a comparison), the
    archive's cap positive and a part at least 1 KiB; the ValueError names the flag."""
    if not (math.isfinite(max_mib) and max_mib > 0):
        raise ValueError(f"--max_mib must be a finite positive number of MiB, got {max_mib}")
    if not (math.isfinite(part_mib) and part_mib * 2**20 >= 1024):
        raise ValueError(f"--part_mib must be at least 1 KiB (1/1024 MiB) and finite, got {part_mib}")


def save(out: Path, dirs: dict[str, Path], max_mib: float, part_mib: float, ident: dict) -> dict:
    """Write the manifest and the archive's parts into `out`; returns the manifest."""
    check_sizes(max_mib, part_mib)
    selected = {k: _selected(dirs, k) for k in PARTS}  # each folder walked once
    st = {f: f.stat() for files in selected.values() for f, _ in files}  # and each file stat'ed once
    size_of = {k: sum(st[f].st_size for f, _ in files) for k, files in selected.items()}
    kept = [k for k in PARTS if selected[k]]
    dropped, trimmed = [], {}
    limit = max_mib * 2**20
    # gzip does not shrink compiled code 20x: what is past that is left out before compressing anything
    while kept and sum(size_of[k] for k in kept) > 20 * limit:
        dropped.append(kept.pop())
    for _ in range(4 * len(PARTS)):  # each pass drops or trims the last part kept; a few more if gzip's ratio moved
        data, summary = _archive(selected, kept)
        if len(data) <= limit or not kept:
            break
        last = kept[-1]
        # the folders of the last part, newest first, that fit in what the archive must shed (at its compression)
        raw = sum(summary[k]["bytes"] for k in kept)
        room = summary[last]["bytes"] - (len(data) - 0.95 * limit) * raw / len(data)
        keep, groups = [], _newest_first(selected[last], st)
        for group in groups:
            room -= sum(st[f].st_size for f, _ in group)
            if room < 0:
                break
            keep.append(group)
        if not keep or len(keep) == len(groups):
            dropped.append(kept.pop())
            trimmed.pop(last, None)
        else:
            trimmed[last] = {"folders": len(keep), "of": trimmed.get(last, {}).get("of", len(groups))}
            selected[last] = [f for group in keep for f in group]
    else:  # trimming never came under the limit (gzip's ratio kept moving): whole parts left out, last first
        while kept:
            dropped.append(kept.pop())
            trimmed.pop(dropped[-1], None)
            data, summary = _archive(selected, kept)
            if len(data) <= limit:
                break
    size = int(part_mib * 2**20)
    chunks = [data[i:i + size] for i in range(0, len(data), size)] if kept else []
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{ARCHIVE}.*"):
        old.unlink()
    names = []
    for i, chunk in enumerate(chunks):
        name = f"{ARCHIVE}.{i:03d}"
        (out / name).write_bytes(chunk)
        names.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"command": " ".join([Path(sys.executable).name, *sys.argv]), **ident,
                "dirs": {r: str(dirs[r]) for r in ROLES}, "packed": summary, "left_out": dropped,
                "trimmed": trimmed, "archive_bytes": len(data) if kept else 0, "max_mib": max_mib, "parts": names}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def differences(manifest: dict, ident: dict) -> list[str]:
    """What keys the caches and differs between the machine that made them and this one, "X there vs Y now"."""
    diff = [f"{k} {manifest.get('versions', {}).get(k)!r} there vs {v!r} now" for k, v in ident["versions"].items()
            if manifest.get("versions", {}).get(k) != v]
    return diff + [f"{k} {manifest.get(k)!r} there vs {ident[k]!r} now" for k in ("device", "capability")
                   if manifest.get(k) != ident[k]]


def restore(src: Path, dirs: dict[str, Path], ident: dict) -> dict:
    """Unpack the caches saved in `src` into `dirs`; returns {"restored": {role: files}} or {"skipped": reason}.
    Raises ValueError, with nothing written, when a part is missing or corrupt or the archive is malformed."""
    path = src / MANIFEST
    if not path.is_file():
        return {"skipped": f"no {MANIFEST} in {src}"}
    try:
        manifest = json.loads(path.read_text())
        parts, made_in = manifest["parts"], manifest["dirs"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a manifest this script wrote ({type(e).__name__}: {e})") from e
    diff = differences(manifest, ident)
    if diff:
        return {"skipped": "made elsewhere: " + "; ".join(diff)}
    if not parts:
        return {"skipped": "the saved archive is empty"}
    key = hashlib.sha256("".join(p["sha256"] for p in parts).encode()).hexdigest()[:16]
    marker = dirs["inductor"] / (RESTORED + key)
    if marker.is_file():
        return {"skipped": f"this archive was restored on this machine already ({marker})"}
    moved = {r: f"made in {made_in[r]}, this machine's is {dirs[r]}" for r in ROLES
             if r in made_in and Path(made_in[r]) != dirs[r]}
    data = bytearray()
    for p in parts:
        f = src / p["name"]
        if not f.is_file():
            raise ValueError(f"{f} is missing ({len(parts)} parts listed in {path})")
        chunk = f.read_bytes()
        if hashlib.sha256(chunk).hexdigest() != p["sha256"]:
            raise ValueError(f"{f} does not match its SHA-256 in {path} (a broken or partial copy)")
        data += chunk
    restored = {}
    with tempfile.TemporaryDirectory(prefix="compile_cache_") as tmp, \
            tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            role, _, rel = m.name.partition("/")
            if role not in ROLES or not rel or not m.isfile() or ".." in Path(rel).parts or Path(rel).is_absolute():
                raise ValueError(f"{src}: unexpected member {m.name!r} in the archive (only files under "
                                 f"{'/, '.join(ROLES)}/ are packed); nothing restored")
        tar.extractall(tmp, members=members, filter="data")
        for role in ROLES:
            root = Path(tmp) / role
            if not root.is_dir() or role in moved:
                continue
            n = 0
            for f in _files(root):
                dest = dirs[role] / f.relative_to(root)
                if dest.exists():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                part = dest.with_name(f"{dest.name}.tmp{os.getpid()}")  # never a cut-off file under the real name
                shutil.copy2(f, part)
                os.replace(part, dest)
                n += 1
            restored[role] = n
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"parts": [p["name"] for p in parts], "restored": restored}) + "\n")
    return {"restored": restored, "not_restored": moved, "left_out_when_saved": manifest.get("left_out", [])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="pack this machine's compile caches into OUTDIR")
    s.add_argument("outdir")
    s.add_argument("--max_mib", type=float, default=40.0,
                   help="largest archive kept, MiB (default 40: with the wheels, under a device call's 64 MiB carry)")
    s.add_argument("--part_mib", type=float, default=15.0, help="largest part file, MiB (default 15)")
    r = sub.add_parser("restore", help="unpack the caches saved in DIR, where they match this machine")
    r.add_argument("dir")
    ns = p.parse_args(argv)
    if ns.cmd == "save":
        try:
            check_sizes(ns.max_mib, ns.part_mib)
        except ValueError as e:
            s.error(str(e))
    dirs = cache_dirs()
    if ns.cmd == "save":
        m = save(Path(ns.outdir), dirs, ns.max_mib, ns.part_mib, identity())
        kept = ", ".join(f"{k} {v['files']} files" for k, v in m["packed"].items()) or "nothing"
        print(f"compile cache: saved {kept}, {m['archive_bytes'] / 2**20:.1f} MiB in {len(m['parts'])} part(s) to "
              f"{ns.outdir}" + (f"; left out {m['left_out']} (over --max_mib {ns.max_mib})" if m["left_out"] else "")
              + "".join(f"; {k}: the newest {t['folders']} of {t['of']} folders" for k, t in m["trimmed"].items()))
        return 0
    try:
        res = restore(Path(ns.dir), dirs, identity())
    except ValueError as e:
        print(f"compile cache: not restored: {e}", file=sys.stderr)
        return 1
    if "skipped" in res:
        print(f"compile cache: not restored: {res['skipped']}")
    else:
        print("compile cache: restored " + (", ".join(f"{k} {n} new files to {dirs[k]}" for k, n in
                                                   res["restored"].items()) or "nothing")
              + "".join(f"; {k} not: {why}" for k, why in res["not_restored"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
