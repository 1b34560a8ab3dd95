"""Carry the compile caches from one GPU machine to the next: DeepSpeed's JIT-built ops, inductor's compiled graphs
and tuned kernels, Triton's kernel binaries.

    python benchmarks/compile_cache.py save OUTDIR       # end of a job: OUTDIR/compile_cache.json + .tar.gz parts
    python benchmarks/compile_cache.py restore DIR       # start of the next, on a fresh machine: unpack DIR's parts

A machine that keeps its disk pays these once. A lent or preemptible one starts bare every time, and its first
DeepCompile run of the 1.5b preset builds DeepCompile's op, compiles every kernel and, with
`--coordinate_descent_tuning`, benchmarks each one's block sizes again. In
`benchmarks/results/headline_device_checks_1xh200` (one machine, `extra.warmup_s` of its run JSONs), the raw path's
first run, the machine's first, warmed up for 231 s and its second, the machine's fifth, for 148 s; the ceiling,
another graph, compiled there once, for 217 s. `save` packs the three cache folders (each where the library reads it:
TORCH_EXTENSIONS_DIR, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, or their defaults) into one gzipped tar split
into parts of at most --part_mib (a job's outputs may be capped per file), with a manifest of the versions and
the device they were made with and each part's SHA-256. If the archive exceeds --max_mib, the folders are dropped
from the last of (extensions, triton, inductor) until it fits, and the manifest says which were left out.
`restore` unpacks them only where everything that keys a cache is the same (Python, torch, CUDA, Triton,
DeepSpeed, the GPU's name and compute capability; else it says what differs and does nothing), after checking
every part's hash, into a scratch folder first; files that the machine already has are left as they are, and the
restored ones are dated now, so that ninja finds a build newer than the sources installed before it. Lock files are
never packed: a build killed mid-way leaves one, and a restored lock would stall every later build.

Caches change no timed step: the warm-up steps that compile are excluded from every figure (the run JSON's
`extra.compile_cache` counts inductor's cache hits and misses, `extra.compile_s` the seconds spent compiling).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

MANIFEST = "compile_cache.json"
ARCHIVE = "compile_cache.tar.gz"
ROLES = ("extensions", "triton", "inductor")  # the order of keeping: the op builds take the longest to redo
KEYED_BY = ("python", "torch", "cuda", "triton", "deepspeed")  # versions that key the caches' entries
SKIPPED_NAMES = ("lock",)  # torch's extension-build lock (a killed build leaves it behind)


def cache_dirs() -> dict[str, Path]:
    """Where this process's libraries keep each cache: the env variable where set, else the library's default."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
    from torch.utils.cpp_extension import get_default_build_root

    # torch.utils.cpp_extension._get_build_directory's and triton.knobs.cache.dir's rule
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    triton = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return {"extensions": Path(extensions), "triton": Path(triton),
            "inductor": Path(inductor_cache_dir())}


def identity() -> dict:
    """What the caches' entries depend on: the versions in KEYED_BY and the device."""
    from shared.train.results import device_info, versions

    dev = device_info()
    v = versions()
    return {"versions": {k: v.get(k) for k in KEYED_BY}, "device": dev["name"], "capability": dev["capability"]}


def _skipped(path: Path) -> bool:
    return path.name in SKIPPED_NAMES or path.name.endswith(".lock") or path.name.endswith(".tmp")


def _files(root: Path) -> list[Path]:
    """Regular files under root (no links, no lock or temporary files), sorted."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and not _skipped(p))


def _archive(dirs: dict[str, Path], roles: list[str]) -> tuple[bytes, dict]:
    buf = io.BytesIO()
    summary = {}
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for role in roles:
            files = _files(dirs[role])
            for f in files:
                tar.add(f, arcname=f"{role}/{f.relative_to(dirs[role]).as_posix()}", recursive=False)
            summary[role] = {"dir": str(dirs[role]), "files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    return buf.getvalue(), summary


def save(out: Path, dirs: dict[str, Path], max_mib: float, part_mib: float, ident: dict) -> dict:
    """Write the manifest and the archive's parts into `out`; returns the manifest."""
    if part_mib <= 0 or max_mib <= 0:
        raise ValueError(f"--part_mib and --max_mib must be positive, got {part_mib} and {max_mib}")
    roles = [r for r in ROLES if _files(dirs[r])]
    dropped = []
    # gzip does not shrink compiled code 20x: folders past that are left out before compressing anything
    while roles and sum(f.stat().st_size for r in roles for f in _files(dirs[r])) > 20 * max_mib * 2**20:
        dropped.append(roles.pop())
    while True:
        data, summary = _archive(dirs, roles)
        if len(data) <= max_mib * 2**20 or not roles:
            break
        dropped.append(roles.pop())
    part = int(part_mib * 2**20)
    parts = [data[i:i + part] for i in range(0, len(data), part)] if roles else []
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{ARCHIVE}.*"):
        old.unlink()
    names = []
    for i, chunk in enumerate(parts):
        name = f"{ARCHIVE}.{i:03d}"
        (out / name).write_bytes(chunk)
        names.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {**ident, "roles": summary, "left_out": dropped, "archive_bytes": len(data) if roles else 0,
                "max_mib": max_mib, "parts": names}
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
    manifest = json.loads(path.read_text())
    diff = differences(manifest, ident)
    if diff:
        return {"skipped": "made elsewhere: " + "; ".join(diff)}
    if not manifest["parts"]:
        return {"skipped": "the saved archive is empty"}
    data = bytearray()
    for p in manifest["parts"]:
        f = src / p["name"]
        if not f.is_file():
            raise ValueError(f"{f} is missing ({len(manifest['parts'])} parts listed in {path})")
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
            n = 0
            for f in _files(root):
                dest = dirs[role] / f.relative_to(root)
                if dest.exists():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dest)  # dated now, after the sources this call installed: ninja rebuilds nothing
                shutil.copymode(f, dest)
                n += 1
            if root.is_dir():
                restored[role] = n
    return {"restored": restored, "left_out_when_saved": manifest.get("left_out", [])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="pack this machine's compile caches into OUTDIR")
    s.add_argument("outdir")
    s.add_argument("--max_mib", type=float, default=32.0, help="largest archive kept, MiB (default 32)")
    s.add_argument("--part_mib", type=float, default=15.0, help="largest part file, MiB (default 15)")
    r = sub.add_parser("restore", help="unpack the caches saved in DIR, where they match this machine")
    r.add_argument("dir")
    ns = p.parse_args(argv)
    dirs = cache_dirs()
    if ns.cmd == "save":
        m = save(Path(ns.outdir), dirs, ns.max_mib, ns.part_mib, identity())
        kept = ", ".join(f"{k} {v['files']} files" for k, v in m["roles"].items()) or "nothing"
        print(f"compile cache: saved {kept}, {m['archive_bytes'] / 2**20:.1f} MiB in {len(m['parts'])} part(s) to "
              f"{ns.outdir}" + (f"; left out {m['left_out']} (over --max_mib {ns.max_mib})" if m["left_out"] else ""))
        return 0
    try:
        res = restore(Path(ns.dir), dirs, identity())
    except ValueError as e:
        print(f"compile cache: not restored: {e}", file=sys.stderr)
        return 1
    if "skipped" in res:
        print(f"compile cache: not restored: {res['skipped']}")
    else:
        print("compile cache: restored " + ", ".join(f"{k} {n} new files to {dirs[k]}" for k, n in
                                                  res["restored"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
