"""benchmarks/compile_cache.py: the compile caches packed on one machine and unpacked on the next."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import compile_cache as cc

IDENT = {"versions": {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0",
                      "deepspeed": "0.19.8"}, "device": "NVIDIA H200", "capability": "9.0"}


def caches(root: Path) -> dict[str, Path]:
    return {role: root / role for role in cc.ROLES}


def fill(dirs: dict[str, Path], size: int = 100) -> dict[str, bytes]:
    """A few files per cache folder, nested as the libraries nest them, plus the lock files a build leaves."""
    files = {}
    for role, d in dirs.items():
        for rel in ("a.bin", "sub/b.json", "sub/deeper/c.so"):
            data = os.urandom(size)
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
            files[f"{role}/{rel}"] = data
    (dirs["inductor"] / "sub" / "k.best_config").write_text('{"XBLOCK": 128, "num_warps": 4}')  # a tuning result
    files["inductor/sub/k.best_config"] = (dirs["inductor"] / "sub" / "k.best_config").read_bytes()
    (dirs["inductor"] / "sub" / "lock").write_text("")
    (dirs["triton"] / "sub" / "x.lock").write_text("")
    (dirs["triton"] / "sub" / "y.json.tmp42").write_text("")  # a write cut off
    return files


def contents(dirs: dict[str, Path]) -> dict[str, bytes]:
    """The caches' files, less the marker a restore leaves (its own test below)."""
    return {f"{role}/{p.relative_to(d).as_posix()}": p.read_bytes()
            for role, d in dirs.items() if d.exists() for p in d.rglob("*")
            if p.is_file() and not p.name.startswith(cc.RESTORED)}


def test_the_caches_travel_in_parts_and_unpack_where_this_machine_keeps_them(tmp_path):
    dirs, out = caches(tmp_path / "cache"), tmp_path / "out"
    files = fill(dirs, size=3000)
    so = dirs["triton"] / "sub" / "deeper" / "c.so"
    so.chmod(0o755)
    m = cc.save(out, dirs, max_mib=1, part_mib=0.002, ident=IDENT)  # 2 KiB parts: random bytes, several parts
    assert len(m["parts"]) >= 3 and sorted(p.name for p in out.iterdir()) == sorted(
        [cc.MANIFEST] + [p["name"] for p in m["parts"]])
    assert {k: v["files"] for k, v in m["packed"].items()} == {"inductor tuning": 1, "triton kernels": 3,
                                                                 "inductor graphs": 3} and m["left_out"] == []
    assert json.loads((out / cc.MANIFEST).read_text()) == m
    shutil.rmtree(tmp_path / "cache")  # a fresh machine, the same folders
    (dirs["triton"] / "sub").mkdir(parents=True)
    (dirs["triton"] / "sub" / "b.json").write_bytes(b"this machine's own")  # already here: left as it is
    res = cc.restore(out, dirs, IDENT)
    assert res["restored"] == {"triton": 2, "inductor": 4} and res["not_restored"] == {}
    got = contents(dirs)
    assert got.pop("triton/sub/b.json") == b"this machine's own"
    assert got == {k: v for k, v in files.items() if k != "triton/sub/b.json"}  # no lock or cut-off file travelled
    assert so.stat().st_mode & 0o777 == 0o755


def test_a_warm_machine_does_not_unpack_the_same_archive_twice_and_never_packs_the_marker(tmp_path):
    dirs, out = caches(tmp_path / "cache"), tmp_path / "out"
    fill(dirs)
    cc.save(out, dirs, max_mib=1, part_mib=1, ident=IDENT)
    shutil.rmtree(tmp_path / "cache")
    assert cc.restore(out, dirs, IDENT)["restored"] == {"triton": 3, "inductor": 4}
    (dirs["triton"] / "sub" / "b.json").unlink()  # gone since: a second unpack would bring it back
    again = cc.restore(out, dirs, IDENT)
    assert again["skipped"].startswith("this archive was restored on this machine already")
    assert not (dirs["triton"] / "sub" / "b.json").exists()
    m = cc.save(tmp_path / "out2", dirs, max_mib=1, part_mib=1, ident=IDENT)  # the marker stays out of a save
    assert m["packed"]["inductor graphs"]["files"] == 3
    cc.save(tmp_path / "out3", dirs, max_mib=1, part_mib=0.002, ident=IDENT)  # other parts: another archive
    assert "restored" in cc.restore(tmp_path / "out3", dirs, IDENT)


def test_a_folder_restores_only_where_it_was_made(tmp_path):
    """Triton's cache names its files by absolute path: a folder elsewhere on this machine is not restored."""
    dirs, out = caches(tmp_path / "cache"), tmp_path / "out"
    fill(dirs)
    cc.save(out, dirs, max_mib=1, part_mib=1, ident=IDENT)
    here = {**caches(tmp_path / "fresh"), "inductor": dirs["inductor"]}
    shutil.rmtree(tmp_path / "cache")
    res = cc.restore(out, here, IDENT)
    assert res["restored"] == {"inductor": 4}
    assert res["not_restored"] == {"triton": f"made in {dirs['triton']}, this machine's is {here['triton']}"}
    assert not here["triton"].exists()


def test_caches_made_with_other_versions_or_another_gpu_are_not_restored(tmp_path):
    here, out = caches(tmp_path / "here"), tmp_path / "out"
    fill(here)
    cc.save(out, here, max_mib=1, part_mib=1, ident=IDENT)
    shutil.rmtree(tmp_path / "here")
    other = {**IDENT, "versions": {**IDENT["versions"], "torch": "2.13.0"}, "device": "NVIDIA A100"}
    res = cc.restore(out, here, other)
    assert "torch '2.11.0' there vs '2.13.0' now" in res["skipped"]
    assert "device 'NVIDIA H200' there vs 'NVIDIA A100' now" in res["skipped"]
    assert contents(here) == {}
    assert "no compile_cache.json" in cc.restore(tmp_path / "nothing", here, IDENT)["skipped"]


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_broken_part_restores_nothing_and_says_which(tmp_path, damage):
    here, out = caches(tmp_path / "here"), tmp_path / "out"
    fill(here, size=3000)
    m = cc.save(out, here, max_mib=1, part_mib=0.002, ident=IDENT)
    shutil.rmtree(tmp_path / "here")
    last = out / m["parts"][-1]["name"]
    if damage == "corrupt":
        data = last.read_bytes()
        last.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        last.unlink()
    with pytest.raises(ValueError, match=last.name):
        cc.restore(out, here, IDENT)
    assert contents(here) == {}


def test_a_part_that_fits_in_part_keeps_its_newest_kernel_folders(tmp_path):
    """Over the limit with the graphs left out, Triton's binaries are packed folder by folder (a kernel each), the
    newest first, as many as fit; the manifest says how many of how many."""
    there, out = caches(tmp_path / "there"), tmp_path / "out"
    fill(there, size=10)
    kernels = []
    for i in range(6):  # six kernel folders of 100 KB of random bytes (they do not compress), written in turn
        k = there["triton"] / f"kernel{i}"
        k.mkdir()
        (k / "k.cubin").write_bytes(os.urandom(90_000))
        (k / "k.json").write_bytes(os.urandom(10_000))
        for f in k.iterdir():
            os.utime(f, (1000 + i, 1000 + i))
        kernels.append(k.name)
    (there["inductor"] / "graph.bin").write_bytes(os.urandom(400_000))
    m = cc.save(out, there, max_mib=0.35, part_mib=0.25, ident=IDENT)
    assert m["left_out"] == ["inductor graphs"] and m["archive_bytes"] <= 0.35 * 2**20
    folders = m["trimmed"]["triton kernels"]["folders"]
    assert m["trimmed"]["triton kernels"]["of"] == 9 and 1 <= folders < 9  # six kernels, the root, sub, sub/deeper
    with tarfile.open(fileobj=io.BytesIO(b"".join((out / p["name"]).read_bytes() for p in m["parts"]))) as tar:
        packed = {Path(n).parent.name for n in tar.getnames() if n.startswith("triton/kernel")}
        assert "inductor/sub/k.best_config" in tar.getnames()
    assert packed == set(kernels[-len(packed):]) and len(packed) >= 2  # the newest kernels, whole folders
    before = contents(there)
    shutil.rmtree(tmp_path / "there")  # the next machine: the same folders, empty
    cc.restore(out, there, IDENT)
    restored = {n: b for n, b in contents(there).items() if n.startswith("triton/")}
    assert {Path(n).parent.name for n in restored if "/kernel" in n} == packed
    assert restored and all(b == before[n] for n, b in restored.items())


def test_the_save_command_says_what_it_trimmed(tmp_path, monkeypatch, capsys):
    there = caches(tmp_path / "there")
    fill(there, size=10)
    for i in range(4):
        (there["triton"] / f"kernel{i}").mkdir()
        (there["triton"] / f"kernel{i}" / "k.cubin").write_bytes(os.urandom(100_000))
    monkeypatch.setattr(cc, "cache_dirs", lambda: there)
    monkeypatch.setattr(cc, "identity", lambda: IDENT)
    assert cc.main(["save", str(tmp_path / "out"), "--max_mib", "0.25", "--part_mib", "0.25"]) == 0
    m = json.loads((tmp_path / "out" / cc.MANIFEST).read_text())
    assert m["command"].split()[0] == Path(sys.executable).name  # how the manifest was made, as every result says
    t = m["trimmed"]["triton kernels"]
    assert f"triton kernels: the newest {t['folders']} of {t['of']} folders" in capsys.readouterr().out


def test_when_trimming_never_fits_whole_parts_are_left_out_last_first(tmp_path, monkeypatch):
    """A compression that stays just over the limit whatever is trimmed (here: an archive padded to 6 KB over it
    while it holds a Triton file): after as many passes as it allows, the save gives up trimming and leaves out
    whole parts, last first; the tuning results stay, and the manifest lists no trimmed part that was left out."""
    there, out = caches(tmp_path / "there"), tmp_path / "out"
    (there["inductor"] / "sub").mkdir(parents=True)
    (there["inductor"] / "sub" / "k.best_config").write_text('{"XBLOCK": 128}')
    for i in range(40):  # 40 kernel folders of 5 KB: each pass trims only a few of them
        (there["triton"] / f"kernel{i}").mkdir(parents=True)
        (there["triton"] / f"kernel{i}" / "k.cubin").write_bytes(os.urandom(5_000))
    archive, limit, passes = cc._archive, int(0.5 * 2**20), []

    def just_over(selected, parts):
        data, summary = archive(selected, parts)
        passes.append(len(selected["triton kernels"]) if "triton kernels" in parts else 0)
        return (data.ljust(limit + 6_000, b"\0") if "triton kernels" in parts else data), summary

    monkeypatch.setattr(cc, "_archive", just_over)
    m = cc.save(out, there, max_mib=0.5, part_mib=0.5, ident=IDENT)
    assert len(passes) > 4 * len(cc.PARTS) and passes[0] == 40 and 0 < passes[4 * len(cc.PARTS) - 1] < 40
    assert m["left_out"] == ["triton kernels"] and list(m["packed"]) == ["inductor tuning"]
    assert m["trimmed"] == {} and 0 < m["archive_bytes"] <= limit


def test_over_the_limit_the_bulk_is_left_out_first_and_the_tuning_results_last(tmp_path):
    there, out = caches(tmp_path / "there"), tmp_path / "out"
    fill(there, size=150_000)  # 450 KB of random bytes a folder (they do not compress): one fits in 0.55 MiB,
    # and none of the graphs' 150 KB folders beside it (about 100 KB left)
    m = cc.save(out, there, max_mib=0.55, part_mib=0.25, ident=IDENT)
    assert m["left_out"] == ["inductor graphs"] and set(m["packed"]) == {"inductor tuning", "triton kernels"}
    assert m["archive_bytes"] <= 0.55 * 2**20 and len(m["parts"]) == 2 and m["trimmed"] == {}
    with tarfile.open(fileobj=io.BytesIO(b"".join((out / p["name"]).read_bytes() for p in m["parts"]))) as tar:
        assert sorted(n for n in tar.getnames() if n.startswith("inductor/")) == ["inductor/sub/k.best_config"]
    m = cc.save(out, there, max_mib=0.1, part_mib=0.5, ident=IDENT)  # only the tuning results fit
    assert m["left_out"] == ["inductor graphs", "triton kernels"] and list(m["packed"]) == ["inductor tuning"]
    m = cc.save(out, there, max_mib=1e-5, part_mib=0.5, ident=IDENT)  # nothing fits
    assert m["left_out"] == ["inductor graphs", "triton kernels", "inductor tuning"] and m["parts"] == []
    assert m["archive_bytes"] == 0 and sorted(p.name for p in out.iterdir()) == [cc.MANIFEST]  # old parts gone
    assert cc.restore(out, caches(tmp_path / "here"), IDENT) == {"skipped": "the saved archive is empty"}
    with pytest.raises(ValueError, match="--part_mib must be at least 1 KiB"):
        cc.save(out, there, max_mib=1, part_mib=1e-7, ident=IDENT)
    (out / cc.MANIFEST).write_text(json.dumps({**IDENT}))  # not one this script wrote
    with pytest.raises(ValueError, match="is not a manifest this script wrote"):
        cc.restore(out, there, IDENT)


def test_an_archive_with_paths_outside_the_cache_folders_is_refused(tmp_path):
    here, out = caches(tmp_path / "here"), tmp_path / "out"
    out.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("triton/ok.bin", "triton/../../escaped.bin"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    data = buf.getvalue()
    (out / f"{cc.ARCHIVE}.000").write_bytes(data)
    part = {"name": f"{cc.ARCHIVE}.000", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / cc.MANIFEST).write_text(json.dumps({**IDENT, "dirs": {}, "parts": [part]}))
    with pytest.raises(ValueError, match="escaped.bin"):
        cc.restore(out, here, IDENT)
    assert contents(here) == {} and not (tmp_path / "escaped.bin").exists()


def test_the_command_reads_each_cache_folder_where_its_library_does(tmp_path, monkeypatch, capsys):
    dirs = {"triton": tmp_path / "tri", "inductor": tmp_path / "ind"}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(dirs["triton"]))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(dirs["inductor"]))
    assert cc.cache_dirs() == dirs
    files = fill(dirs)
    assert cc.main(["save", str(tmp_path / "out")]) == 0
    assert "compile cache: saved inductor tuning 1 files, triton kernels 3 files, inductor graphs 3 files" \
        in capsys.readouterr().out
    for d in dirs.values():
        shutil.rmtree(d)
    assert cc.main(["restore", str(tmp_path / "out")]) == 0
    assert "compile cache: restored triton 3 new files" in capsys.readouterr().out
    assert contents(dirs) == files
    shutil.rmtree(dirs["inductor"])  # another fresh machine (the marker of the restore above goes too)
    (tmp_path / "out" / f"{cc.ARCHIVE}.000").write_bytes(b"broken")
    assert cc.main(["restore", str(tmp_path / "out")]) == 1
    assert "compile cache: not restored:" in capsys.readouterr().err


def test_the_script_saves_and_restores_as_a_job_runs_it(tmp_path, monkeypatch, capsys):
    """`python benchmarks/compile_cache.py save|restore DIR` from the repo's root, in a fresh process each, and
    the device driver calls it at its start and its end."""
    import subprocess
    import sys

    from tests.helpers import ROOT, env

    dirs = caches(tmp_path / "cache")
    files = fill(dirs)
    script = str(ROOT / "benchmarks" / "compile_cache.py")
    run_env = {**env(), "TRITON_CACHE_DIR": str(dirs["triton"]), "TORCHINDUCTOR_CACHE_DIR": str(dirs["inductor"])}
    for cmd in ("save", "restore"):
        proc = subprocess.run([sys.executable, script, cmd, str(tmp_path / "out")], env=run_env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"compile cache: {cmd}"), proc.stdout
        if cmd == "save":
            shutil.rmtree(tmp_path / "cache")  # the next machine starts bare
    assert "restored triton 3 new files" in proc.stdout
    assert contents(dirs) == files
    # the device driver restores the caches a checkout carries in .compile_cache/ first and saves its own last
    from benchmarks import device

    monkeypatch.setattr(device, "COMPILE_CACHE", tmp_path / "carried")
    (tmp_path / "carried").mkdir()
    capsys.readouterr()
    assert device.main(["headline", "--dry_run", "--out", str(tmp_path / "call")]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]
    assert f"benchmarks/compile_cache.py restore {tmp_path / 'carried'}" in commands[0]
    assert f"benchmarks/compile_cache.py save {tmp_path / 'call'}" in commands[-1]


@pytest.mark.parametrize("flags, message", [
    (["--part_mib", "0"], "--part_mib must be at least 1 KiB (1/1024 MiB) and finite, got 0.0"),
    (["--part_mib", "nan"], "--part_mib must be at least 1 KiB (1/1024 MiB) and finite, got nan"),
    (["--max_mib", "-1"], "--max_mib must be a finite positive number of MiB, got -1.0"),
    (["--max_mib", "inf"], "--max_mib must be a finite positive number of MiB, got inf"),
])
def test_the_save_command_refuses_sizes_that_are_not_finite_and_positive(tmp_path, monkeypatch, capsys, flags,
                                                                          message):
    monkeypatch.setattr(cc, "cache_dirs", lambda: pytest.fail("the caches were read"))
    with pytest.raises(SystemExit) as e:
        cc.main(["save", str(tmp_path / "out"), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    sizes = {"max_mib": 1.0, "part_mib": 1.0, flags[0][2:]: float(flags[1])}
    with pytest.raises(ValueError, match=re.escape(message)):  # and save() itself, called as a library
        cc.save(tmp_path / "out", caches(tmp_path), ident=IDENT, **sizes)
