"""Real training runs on CPU (2 processes where distributed): resume, export, SIGTERM, validation, guards."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shared.tools.prepare_data import prepare
from shared.train import checkpoint, preemption
from tests.helpers import LIGHTNING, RAW, ROOT, env, load, run, torchrun

pytestmark = pytest.mark.slow
SCRIPTS = {"raw": RAW, "lightning": LIGHTNING}
# fp32 (exact on CPU) with dropout on, so resuming must restore the RNG stream too
BASE = ["--preset", "tiny", "--precision", "fp32", "--warmup_steps", "1", "--log_every", "2"]


@pytest.mark.parametrize("path, step", [("raw", "fast"), ("lightning", "fast"), ("raw", "fused")])
def test_resume_before_the_midpoint_gives_the_same_losses_as_an_uninterrupted_run(tmp_path, kjv, path, step):
    # Resumed at step 2 of 8, on real text: Lightning once counted its in-epoch batch index from the restored
    # position against a loader of the remaining steps only, ended the epoch early and replayed the data from
    # step 2k+1 on; a resume at or after the midpoint (3 of 6) could not show it. `fused`: the AdamW kernel's
    # moments and step count are saved and restored as torch's AdamW state (Triton's interpreter here).
    ck = tmp_path / "ck"
    args = [*BASE, "--data", kjv, "--steps", "8", "--zero3_step", step, "--val_every", "4"]
    first = torchrun(SCRIPTS[path], 2, [*args, "--ckpt_dir", ck, "--save_every", "2", "--keep_last", "0",
                                        "--out", tmp_path / "full.json"])
    full_run = load(tmp_path / "full.json")
    full = full_run["losses"]
    # what each validation pass and each checkpoint cost, recorded and printed
    assert [v["step"] for v in full_run["extra"]["val"]] == [4, 8] and all(
        v["seconds"] > 0 for v in full_run["extra"]["val"])
    assert [c["step"] for c in full_run["extra"]["saves"]] == [2, 4, 6, 8] and all(
        c["seconds"] > 0 for c in full_run["extra"]["saves"])
    assert "validation          2 x, median" in first.stdout and "checkpoints         4 x, median" in first.stdout
    # lose the later checkpoints, as a job killed right after step 2 would have
    for step in (4, 6, 8):
        shutil.rmtree(ck / checkpoint.tag_for(step))
    second = torchrun(SCRIPTS[path], 2, [*args, "--ckpt_dir", ck, "--save_every", "2", "--resume", "auto",
                                         "--out", tmp_path / "resumed.json"])
    resumed = load(tmp_path / "resumed.json")
    # the library noise of every step, save and resume is filtered (shared/train/distributed.LIBRARY_NOISE)
    for proc in (first, second):
        output = proc.stdout + proc.stderr
        for noise in ("FutureWarning", "reduce_scatter_tensor", "LeafSpec", "Tip:", "weights_only` was not set",
                      "resuming from a checkpoint that ended before", "does not have many workers"):
            assert noise not in output, (noise, output[-3000:])
    assert resumed["extra"]["start_step"] == 2 and resumed["extra"]["resumed_from"].endswith("step00000002")
    assert len(resumed["losses"]) == 6
    assert resumed["losses"] == full[2:]  # bit for bit: model, optimizer, LR, RNG and data position restored
    assert [s for s, _, ok in checkpoint.list_checkpoints(ck) if ok] == [4, 6, 8]  # keep_last 3 of the resumed run


@pytest.mark.parametrize("path, vocab_multiple", [("raw", 1), ("lightning", 128)])
def test_exported_weights_equal_the_live_weights(tmp_path, path, vocab_multiple):
    # 33-wide model with a 257-token vocabulary: 39,765 parameters, odd, so ZeRO-3 pads the 2-rank partition.
    # Lightning trains it with the vocabulary padded to 384 rows: the exports hold the 257 real ones.
    odd = ["--n_embd", "33", "--n_head", "3", "--vocab_size", "257", "--vocab_multiple", str(vocab_multiple)]
    padding = (384 - 257) * 33 if vocab_multiple == 128 else 0
    ck = tmp_path / "ck"
    torchrun(SCRIPTS[path], 2, [*BASE, *odd, "--steps", "4", "--ckpt_dir", ck, "--export", tmp_path / "live.st",
                                "--out", tmp_path / "r.json"])
    run([sys.executable, "-m", "shared.tools.export", ck / "step00000004", "--out", tmp_path / "offline.st"])
    live, offline = load_file(tmp_path / "live.st"), load_file(tmp_path / "offline.st")
    assert sorted(live) == sorted(offline) and "head.weight" not in live  # tied to wte.weight
    n_params = sum(v.numel() for v in live.values())
    assert n_params == 39765 and n_params % 2 == 1
    for k in live:
        assert torch.equal(live[k], offline[k]), k
    # the run's parameter checksum (each rank's valid part of its padded ZeRO-3 partition, all-reduced) is the
    # checksum of the gathered weights; a padded vocabulary's rows stayed zero (never an input, never predicted)
    flat = torch.cat([v.double().reshape(-1) for v in live.values()])
    checksum = load(tmp_path / "r.json")["param_checksum"]
    assert checksum["numel"] == n_params + padding
    assert checksum["sum"] == pytest.approx(flat.sum().item(), rel=1e-12, abs=1e-9)
    assert checksum["sum_sq"] == pytest.approx((flat * flat).sum().item(), rel=1e-12)
    model, meta = checkpoint.load_exported(tmp_path / "offline.st")
    assert model.cfg.n_embd == 33 and model.head.weight is model.wte.weight and meta["step"] == 4
    assert model.cfg.vocab_multiple == 1 and meta["model_config"]["vocab_multiple"] == 1
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 257)


def test_truncated_or_unmarked_checkpoints_are_never_picked(tmp_path):
    ck = tmp_path / "ck"
    torchrun(RAW, 1, [*BASE, "--steps", "4", "--ckpt_dir", ck, "--save_every", "2", "--keep_last", "0",
                      "--out", tmp_path / "r.json"])
    assert checkpoint.latest_complete(ck).name == "step00000004"
    shard = next((ck / "step00000004").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])  # a copy or save cut short
    assert checkpoint.latest_complete(ck).name == "step00000002"
    (ck / "step00000002" / checkpoint.MARKER).unlink()  # a save that never finished
    assert checkpoint.latest_complete(ck) is None
    proc = run([sys.executable, RAW, *BASE, "--steps", "4", "--resume", str(ck / "step00000004"),
                "--out", tmp_path / "resumed.json"], check=False)
    assert proc.returncode == 2 and "is incomplete" in proc.stderr


def test_keep_last_prunes_old_and_interrupted_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    (ck / "step00000001").mkdir(parents=True)  # an interrupted save: no marker
    torchrun(RAW, 1, [*BASE, "--steps", "6", "--ckpt_dir", ck, "--save_every", "2", "--keep_last", "2",
                      "--out", tmp_path / "r.json"])
    assert [(s, ok) for s, _, ok in checkpoint.list_checkpoints(ck)] == [(4, True), (6, True)]


def _start(cmd, log):
    return subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT,
                            start_new_session=True)


# who gets the SIGTERM: a scheduler that signals every process of the job reaches both ranks (torchrun's children);
# one that signals the job's command reaches torchrun, which passes it on
@pytest.mark.parametrize("path, signalled", [("raw", "ranks"), ("lightning", "ranks"), ("raw", "launcher")])
def test_sigterm_saves_a_checkpoint_and_exits_143_without_a_traceback(tmp_path, path, signalled):
    ck, log_path = tmp_path / "ck", tmp_path / "log.txt"
    with open(log_path, "w") as log:
        # torchrun's arguments; torchrun itself ends a SIGTERM with a traceback and exit 1 (shared/tools/torchrun.py)
        proc = _start([sys.executable, "-m", "shared.tools.torchrun", "--standalone", "--nproc_per_node=2",
                       SCRIPTS[path], *BASE, "--steps", "100000", "--log_every", "5",
                       "--ckpt_dir", ck, "--out", tmp_path / "r.json"], log)
        deadline = time.time() + 180
        while "step 10/" not in log_path.read_text() and time.time() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.5)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        for pid in children if signalled == "ranks" else [proc.pid]:
            os.kill(int(pid), signal.SIGTERM)
        proc.wait(timeout=120)
    text = log_path.read_text()
    assert "SIGTERM: stopped after step" in text
    assert proc.returncode == 143 and "Traceback" not in text, text[-3000:]
    saved = checkpoint.latest_complete(ck)
    assert saved is not None and 10 <= int(saved.name[4:]) < 100000
    assert int(saved.name[4:]) % preemption.CHECK_EVERY == 0  # the ranks agree every CHECK_EVERY steps
    assert not (tmp_path / "r.json").exists()  # a preempted run writes no benchmark result


@pytest.mark.parametrize("path", ["raw", "lightning"])
def test_sigterm_in_the_last_step_lets_the_run_finish_on_both_paths(tmp_path, path):
    # Checked at the last step, a SIGTERM once made the raw loop exit 143 without its result while Lightning wrote
    # it, and the saved step was the last: the same command with --resume auto could never finish either run.
    ck = tmp_path / "ck"
    run([sys.executable, ROOT / "tests" / "inject.py", path, "sigterm@3", "--", *BASE, "--steps", "3",
         "--ckpt_dir", ck, "--out", tmp_path / "r.json"])
    assert len(load(tmp_path / "r.json")["losses"]) == 3
    assert checkpoint.latest_complete(ck).name == "step00000003"


@pytest.mark.parametrize("path", ["raw", "lightning"])
def test_a_preempted_run_leaves_without_a_validation_that_is_not_due(tmp_path, path):
    # Lightning validates whenever trainer.should_stop is set: a preempted Lightning run once ran a validation the
    # raw loop does not, in the scheduler's grace period (validation every 3 steps, SIGTERM in step 2)
    proc = run([sys.executable, ROOT / "tests" / "inject.py", path, "sigterm@2", "--", *BASE, "--steps", "4",
                "--val_every", "3", "--out", tmp_path / "r.json"], check=False)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "SIGTERM: stopped after step 2" in proc.stdout and "validation at step" not in proc.stdout


@pytest.mark.parametrize("path", ["raw", "lightning"])
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, path):
    ck = tmp_path / "ck"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                ROOT / "tests" / "inject.py", path, "nan@5", "--", *BASE, "--steps", "8", "--log_every", "1",
                "--ckpt_dir", ck, "--save_every", "2", "--out", tmp_path / "r.json"], check=False)
    assert proc.returncode != 0
    assert "loss is nan at step 5" in proc.stdout + proc.stderr
    assert checkpoint.latest_complete(ck).name == "step00000004"  # nothing saved after the NaN
    assert not (ck / "step00000006").exists()


def test_nan_policy_skip_counts_and_continues(tmp_path):
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         ROOT / "tests" / "inject.py", "raw", "nan@3", "--", *BASE, "--steps", "5", "--nan_policy", "skip",
         "--out", tmp_path / "r.json"])
    r = load(tmp_path / "r.json")
    assert r["extra"]["skipped_steps"] == [3]
    assert r["losses"][2] is None and all(math.isfinite(x) for i, x in enumerate(r["losses"]) if i != 2)
    proc = run([sys.executable, LIGHTNING, *BASE, "--nan_policy", "skip", "--out", tmp_path / "pl.json"], check=False)
    assert proc.returncode == 2 and "not available in the Lightning path" in proc.stderr


@pytest.mark.parametrize("path", ["raw", "lightning"])
def test_a_micro_batch_that_does_not_fit_is_a_clear_error(tmp_path, path):
    proc = run([sys.executable, ROOT / "tests" / "inject.py", path, "oom", "--", *BASE, "--steps", "3",
                "--micro_batch", "64", "--out", tmp_path / "r.json"], check=False)
    assert proc.returncode == 2
    assert "micro_batch 64 does not fit" in proc.stderr and "--activation_checkpointing" in proc.stderr


def test_bad_inputs_are_refused_before_training(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("words and more words. " * 400)
    prepare(src, tmp_path / "t", "byte")
    cases = [
        (["--data", tmp_path / "t", "--vocab_size", "100"], "vocab_size 256 but the model has vocab_size 100"),
        (["--resume", "auto"], "need --ckpt_dir"),
        (["--nan_policy", "skip", "--grad_accum", "2"], "nan_policy skip needs grad_accum 1"),
        (["--resume", tmp_path / "nowhere"], "does not exist"),
    ]
    # the raw script's own entry point, cli(argv), for every case in one process (a start-up of Python + torch
    # each would cost more than the refusals): its exit status and stderr caught per case. exit_process leaves with
    # os._exit on a CPU (shared/train/distributed.py), which would end the loop: here it exits as on a GPU, sys.exit
    code = ("import contextlib, io, json, sys\nfrom shared.train import distributed\n"
            "from plain_deepspeed.train import cli\n"
            "distributed.exit_process = lambda code, device: sys.exit(code)\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err):\n"
            "        try:\n            cli(args)\n            status = None\n"
            "        except SystemExit as e:\n            status = e.code\n"
            "    print('case:', json.dumps({'status': status, 'stderr': err.getvalue()}), flush=True)\n")
    argvs = [[str(a) for a in [*BASE, *args]] for args, _ in cases]
    proc = run([sys.executable, "-c", code, json.dumps(argvs)])
    results = [json.loads(line[len("case: "):]) for line in proc.stdout.splitlines() if line.startswith("case: ")]
    assert len(results) == len(cases), (proc.stdout[-3000:], proc.stderr[-2000:])
    for (args, message), r in zip(cases, results):
        assert r["status"] == 2 and message in r["stderr"], (args, r["status"], r["stderr"][-2000:])
    # a token file edited after its metadata was written: the first batch refuses it, naming the id, before the
    # embedding would index out of range (a device-side assert on a GPU)
    tokens = tmp_path / "t.train.bin"
    arr = np.fromfile(tokens, dtype=np.uint16)
    arr[:] = 300
    arr.tofile(tokens)
    proc = run([sys.executable, RAW, *BASE, "--data", tmp_path / "t", "--steps", "2", "--out", tmp_path / "r.json"],
               check=False)
    assert proc.returncode != 0 and "token id 300" in proc.stdout + proc.stderr
    assert "outside the model's vocabulary of 256" in proc.stdout + proc.stderr


def test_untrusted_pickles_need_an_explicit_opt_in(tmp_path):
    folder = tmp_path / "step00000001"
    folder.mkdir()
    # any class outside the allow-list stands in for a malicious pickle (its reduce could run arbitrary code)
    torch.save({"weights": torch.ones(2), "hook": Fraction(1, 3)}, folder / "model_states.pt")
    with pytest.raises(ValueError, match="weights_only=True.*--trust_checkpoint"):
        checkpoint.check_safe_to_load(folder, trust=False)
    checkpoint.check_safe_to_load(folder, trust=True)


def test_real_text_validation_loss_falls(tmp_path, kjv):
    run([sys.executable, RAW, "--preset", "tiny", "--data", kjv, "--steps", "200", "--micro_batch", "8",
         "--lr", "3e-3", "--min_lr", "3e-4", "--lr_warmup_steps", "20", "--val_every", "100", "--log_every", "50",
         "--log_csv", tmp_path / "m.csv", "--out", tmp_path / "r.json"], timeout=300)
    val = load(tmp_path / "r.json")["extra"]["val"]
    # ln(256) = 5.55 at the start; a byte unigram model of English is ~2.9 nats; 2.7 needs context
    assert [v["step"] for v in val] == [100, 200] and val[-1]["val_loss"] < 2.7
    rows = (tmp_path / "m.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,lr,grad_norm") and len(rows) == 5  # header + steps 50..200
    assert float(rows[-1].split(",")[3]) > 0  # grad norm logged


def test_deepspeeds_shared_memory_buffer_is_this_runs_and_is_released_once_every_rank_mapped_it(tmp_path):
    # one process as the deepspeed launcher starts it (LOCAL_SIZE): DeepSpeed's CPU op creates the file
    # shm_buffer_path names, and release_shm_buffer removes it while the process runs on
    code = ("import torch, deepspeed\nfrom shared.train.distributed import release_shm_buffer, shm_buffer_path\n"
            "deepspeed.init_distributed(dist_backend='gloo')\nmine = shm_buffer_path(0)\n"
            "assert mine.is_file() and mine.stat().st_size > 60e6, mine\nrelease_shm_buffer(torch.device('cpu'))\n"
            "assert not mine.exists()\nprint('released', mine, flush=True)\n")
    port = str(_free_port())
    e = {**env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=ROOT, timeout=240)
    assert proc.returncode == 0 and f"released /dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0" \
        in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_a_run_under_the_deepspeed_launcher_leaves_nothing_in_dev_shm(tmp_path):
    # each of its 2 ranks once left a 66 MB /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    port = _free_port()
    run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", port, RAW, *BASE,
         "--steps", "3", "--out", tmp_path / "r.json"])
    assert len(load(tmp_path / "r.json")["losses"]) == 3
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def _free_port() -> int:
    from shared.train.distributed import free_port

    return free_port()
