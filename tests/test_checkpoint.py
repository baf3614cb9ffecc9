"""Checkpoints and resume: exact resume, what a resume continues and what it refuses, crash-safe and checksummed
checkpoints, the final export's safety, SIGTERM, and the lock that keeps two runs out of one output directory."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, final_weights, read_metrics, run_train, training
from prm.errors import PRMError, UsageError
from prm.training.checkpoint import MARKER, resolve_resume


# exact resume, and what a resumed run continues
def losses(out):
    return {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}


def test_resume_is_bit_identical(tmp_path):
    run_train(tmp_path / "full", max_steps=6, save_every=3, keep_last=0, dtype="bf16")
    assert os.path.isfile(tmp_path / "full" / "checkpoint-3" / MARKER)
    run_train(tmp_path / "resumed", max_steps=6, dtype="bf16", resume=str(tmp_path / "full" / "checkpoint-3"))
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert all(full[s] == resumed[s] for s in resumed)
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rng_state_round_trip():
    import random
    from prm.training.checkpoint import rng_state, set_rng_state
    state = rng_state()
    drawn = (random.random(), torch.rand(3))
    set_rng_state(state)
    again = (random.random(), torch.rand(3))
    assert drawn[0] == again[0] and torch.equal(drawn[1], again[1])


def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
    run_train(tmp_path, max_steps=4, save_every=2, keep_last=0)
    run_train(tmp_path, max_steps=4, resume=str(tmp_path / "checkpoint-2"))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert sum("final" in r for r in records) == 1


def test_the_first_record_after_a_resume_says_it_averages_the_steps_since_the_resume(tmp_path, capsys):
    run_train(tmp_path, max_steps=3, save_every=3, log_every=4)
    run_train(tmp_path, max_steps=8, log_every=4, resume="auto")  # step 4's window: step 4 alone, not steps 1-4
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [(r["step"], r.get("since_resume")) for r in records] == [(3, None), (4, True), (8, None)]
    lines = capsys.readouterr().out.splitlines()
    assert [line.startswith("step 4 | ") for line in lines if line.endswith(" | since resume")] == [True]


def test_sigterm_saves_a_resumable_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train.py", "--synthetic-size", "200", "--max-steps", "100000", "--log-every", "1",
           "--output-dir", str(tmp_path), "--batch-size", "4"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert "stopped by SIGTERM" in out
    ckpt = resolve_resume("auto", str(tmp_path))
    assert ckpt is not None
    stopped = int(os.path.basename(ckpt).split("-")[1])
    run_train(tmp_path, synthetic_size=200, batch_size=4, dtype="auto", max_steps=stopped + 1, resume="auto")
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r][-1] == stopped + 1


@pytest.mark.parametrize("signalled_at, logged", [(4, [(3, False), (5, False), (6, True), (7, False)]),
                                                  (2, [(3, False), (6, True), (7, False)])])  # on a log step
def test_a_stop_between_log_steps_records_the_steps_since_the_last_log_line(tmp_path, monkeypatch, signalled_at,
                                                                             logged):
    """--log-every 3, SIGTERM while step 5 trains: the record of steps 4-5 is written before the checkpoint at 5,
    so the resume keeps it and starts its own window at 6: every step is in exactly one record (at 3: once)."""
    from conftest import training
    from prm.errors import Stopped
    trainer, signalled = training(), []
    real = trainer.train_step

    def step_then_signal(run, batch):
        if run.step == signalled_at and not signalled:  # run.step: the steps done before this one
            signalled.append(signal.raise_signal(signal.SIGTERM))
        return real(run, batch)
    monkeypatch.setattr(trainer, "train_step", step_then_signal)
    with pytest.raises(Stopped):
        run_train(tmp_path, max_steps=7, log_every=3)
    run_train(tmp_path, max_steps=7, log_every=3, resume="auto")
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [(r["step"], r.get("since_resume", False)) for r in records] == logged


def test_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, capsys):
    run_train(tmp_path, max_steps=4, save_every=1, keep_last=0)  # checkpoints 1, 2, 3, 4
    run_train(tmp_path, max_steps=3, save_every=1, keep_last=1, resume=str(tmp_path / "checkpoint-1"))
    assert "set aside" in capsys.readouterr().err
    names = sorted(d for d in os.listdir(tmp_path) if "checkpoint" in d)
    # the new run's checkpoint-3 is kept (not the old timeline's checkpoint-4), and nothing is deleted
    assert names == ["abandoned-checkpoint-2", "abandoned-checkpoint-3", "abandoned-checkpoint-4", "checkpoint-3"]
    assert resolve_resume("auto", str(tmp_path)) == str(tmp_path / "checkpoint-3")
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3]


def test_a_resume_with_no_step_left_reports_no_throughput(tmp_path):
    run_train(tmp_path, max_steps=2, save_every=2)
    final = run_train(tmp_path, max_steps=2, resume="auto")  # every step already done: nothing trained here
    assert final["train_tokens_per_second"] is None and final["padding_efficiency"] is None
    assert read_metrics(tmp_path)[-1]["final"]["padding_efficiency"] is None  # null in metrics.jsonl

# what a resume refuses
def test_resume_refuses_other_data_settings_and_accepts_a_longer_run(tmp_path):
    run_train(tmp_path, max_steps=2, save_every=2)
    for change, named in (({"seed": 1}, "--seed 1 (was 0)"), ({"lr": 5e-2}, "--lr 0.05 (was 0.001)"),
                          ({"batch_size": 8}, "global batch 8 x 1 x 1 ranks (was 4 x 1 x 1)")):
        with pytest.raises(PRMError, match="does not fit this model and data") as e:
            run_train(tmp_path, max_steps=4, resume="auto", **change)
        assert e.value.code == 2 and named in str(e.value)
    run_train(tmp_path, max_steps=4, resume="auto", batch_size=2, grad_accum=2)  # same global batch: allowed
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]
    with pytest.raises(PRMError, match=r"checkpoint is at step 2, past this run's last step 1") as e:
        run_train(tmp_path, max_steps=1, resume=str(tmp_path / "checkpoint-2"))
    assert e.value.code == 2


def test_resume_refuses_a_data_file_whose_contents_changed(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{i} + 1 =", "completions": [f"{i + 1}", "done"], "labels": [True, i % 2 == 0]}
            for i in range(24)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    run_train(out, dataset=str(data), max_steps=2, save_every=1)
    data.write_text("".join(json.dumps({**r, "labels": [False, True]}) + "\n" for r in rows[:12]))  # other rows
    with pytest.raises(PRMError, match="changed since the checkpoint") as e:
        run_train(out, dataset=str(data), max_steps=4, resume="auto")
    assert e.value.code == 2 and str(data) in str(e.value)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # the same contents again: resume goes on
    run_train(out, dataset=str(data), max_steps=4, resume="auto")
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4]


def test_a_conflicting_resume_is_refused_before_any_data_loads(tmp_path, monkeypatch):
    run_train(tmp_path, max_steps=2, save_every=2)

    def no_data(cfg):
        raise AssertionError("the data loaded before the resume's settings were compared")
    monkeypatch.setattr(training(), "load_splits", no_data)
    with pytest.raises(PRMError, match="--seed 1 \\(was 0\\)") as e:
        run_train(tmp_path, max_steps=4, resume="auto", seed=1)
    assert e.value.code == 2

# the checkpoint files: pruned, complete, checksummed; final/ never lost
def test_keep_last_prunes_old_checkpoints(tmp_path):
    run_train(tmp_path, max_steps=6, save_every=2, keep_last=2)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint")) == ["checkpoint-4", "checkpoint-6"]


def test_a_kill_between_a_save_and_its_pruning_leaves_no_surplus_checkpoint(tmp_path):
    run_train(tmp_path, max_steps=4, save_every=2, keep_last=0)
    shutil.rmtree(tmp_path / "final")  # as a --keep-last 1 run killed after checkpoint-4's rename, before pruning
    run_train(tmp_path, max_steps=4, save_every=2, keep_last=1, resume="auto")  # all steps done: no save follows
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]


def test_half_written_checkpoint_is_ignored(tmp_path):
    run_train(tmp_path, max_steps=3, save_every=3)
    broken = tmp_path / "checkpoint-5"  # a crash between files: weights written, marker never
    broken.mkdir()
    shutil.copy(tmp_path / "checkpoint-3" / "model.safetensors", broken)
    (tmp_path / "checkpoint-6.tmp").mkdir()
    assert resolve_resume("auto", str(tmp_path)) == str(tmp_path / "checkpoint-3")
    run_train(tmp_path, max_steps=4, resume="auto")
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r][-1] == 4


def test_damaged_checkpoint_is_refused_and_auto_falls_back(tmp_path, capsys):
    from prm.training.checkpoint import resolve_resume
    run_train(tmp_path, max_steps=4, save_every=2, keep_last=0)
    weights = tmp_path / "checkpoint-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensors
    weights.write_bytes(bytes(data))
    assert resolve_resume("auto", str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert "skipping damaged checkpoint" in capsys.readouterr().err
    with pytest.raises(PRMError, match="model.safetensors"):
        resolve_resume(str(tmp_path / "checkpoint-4"), str(tmp_path))
    capsys.readouterr()
    run_train(tmp_path, max_steps=4, resume="auto")
    assert capsys.readouterr().err.count("skipping damaged checkpoint") == 1  # checksummed once per run
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]


def test_a_checkpoint_holding_a_symlink_or_a_fifo_is_damaged_and_never_read(tmp_path):
    run_train(tmp_path, max_steps=3, save_every=1, keep_last=0)
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    weights.unlink()
    weights.symlink_to("/dev/zero")  # read for its checksum, it never ends
    os.mkfifo(tmp_path / "checkpoint-3" / "extra")  # nor does a FIFO that nobody writes
    r = subprocess.run([sys.executable, "-c", f"from prm.training.checkpoint import resolve_resume; "
                        f"print(resolve_resume('auto', {str(tmp_path)!r}))"], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.stdout.strip() == str(tmp_path / "checkpoint-1")
    assert "model.safetensors (not a regular file)" in r.stderr and "extra (not a regular file)" in r.stderr


def test_final_is_written_before_the_evaluation_and_atomically(tmp_path, monkeypatch):
    from prm.training import checkpoint
    from prm.core.model import PRM
    monkeypatch.setattr(training(), "evaluate", lambda run: 1 / 0)  # the final evaluation fails
    with pytest.raises(ZeroDivisionError):
        run_train(tmp_path / "a", max_steps=2)
    PRM.from_pretrained(str(tmp_path / "a" / "final"))  # the weights were not lost with it
    monkeypatch.undo()
    run_train(tmp_path / "b", max_steps=2, save_every=2)
    before = (tmp_path / "b" / "final" / "model.safetensors").read_bytes()
    real = checkpoint.write_model_dir

    def disk_full(path, *a, **kw):  # half a directory written, then no space
        real(path, *a, **kw)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint, "write_model_dir", disk_full)
    with pytest.raises(PRMError, match="No space left on device"):
        run_train(tmp_path / "b", max_steps=3, resume="auto")
    assert (tmp_path / "b" / "final" / "model.safetensors").read_bytes() == before  # the old final/ intact
    assert not os.path.exists(tmp_path / "b" / "final.tmp")

# the run lock
# holds a lock as run_lock does (flock, then its pid@host in the file) until killed
HOLD = ("import fcntl, os, socket, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, f'{os.getpid()}@{socket.gethostname()}'.encode())\n"
        "print('held', flush=True)\ntime.sleep(600)\n")


def test_overwrite_never_deletes_the_model_the_run_reads(tmp_path):
    run_train(tmp_path, max_steps=1)
    final = tmp_path / "final"
    with pytest.raises(UsageError) as e:
        run_train(tmp_path, max_steps=1, model=str(final), overwrite=True)
    assert str(e.value) == f"--output-dir {final} would overwrite --model {final}, which it " \
                           "reads: choose another path"
    assert (final / "model.safetensors").is_file() and (tmp_path / "metrics.jsonl").is_file()


@pytest.mark.parametrize("name", ["final", "checkpoint-3"])
def test_overwrite_refuses_a_symlinked_run_folder_and_deletes_nothing(tmp_path, name):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("x")
    (out / "metrics.jsonl").write_text("{}\n")
    (out / name).symlink_to(elsewhere)
    with pytest.raises(UsageError) as e:
        run_train(out, max_steps=1, overwrite=True)
    assert str(e.value) == f"--overwrite: {out / name} is a link to a folder; remove it yourself"
    assert sorted(os.listdir(out)) == sorted(["metrics.jsonl", name])
    assert (out / name / "keep.txt").is_file()


def test_a_locked_output_directory_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    import socket
    tmp_path.mkdir(exist_ok=True)
    lock = tmp_path / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:  # a live run of this host holds it
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(PRMError) as e:
            run_train(tmp_path, max_steps=1)
        assert e.value.code == 2 and f"in use by another run ({holder.pid}@{socket.gethostname()})" in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    lock.write_text("123@another-host")  # flock need not reach across hosts: its run is taken to be alive
    with pytest.raises(PRMError, match=r"in use by another run \(123@another-host\)"):
        run_train(tmp_path, max_steps=1)
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # refused before anything was written
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"{dead.pid}@{socket.gethostname()}")
    run_train(tmp_path, max_steps=1)
    assert "stale lock" in capsys.readouterr().err and not lock.exists()  # released at the end


def test_a_stale_lock_naming_this_very_process_is_taken_over(tmp_path, capsys):
    """A restarted container: same host name, the same small pid as the run it killed. The flock is free, so the
    lock is stale, although its pid@host names a live process: this one."""
    import socket
    run_train(tmp_path, max_steps=2, save_every=1)
    (tmp_path / ".lock").write_text(f"{os.getpid()}@{socket.gethostname()}")  # what a killed run leaves
    run_train(tmp_path, max_steps=3, resume="auto")
    assert "stale lock" in capsys.readouterr().err and not (tmp_path / ".lock").exists()
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3]


def test_two_runs_taking_over_one_stale_lock_at_once_cannot_both_proceed(tmp_path, monkeypatch):
    """The race, made deterministic: a second run takes the lock over while the first is deciding the lock is stale."""
    import contextlib
    import socket
    from prm import files
    from prm.training import checkpoint
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"{dead.pid}@{socket.gethostname()}")
    proceeded, second, real = [], contextlib.ExitStack(), files._alive

    def second_run_cuts_in(owner):
        monkeypatch.setattr(files, "_alive", real)  # the second run checks for itself, holding the lock if it can
        with contextlib.suppress(PRMError):
            second.enter_context(checkpoint.run_lock(str(tmp_path)))
            proceeded.append("second")
        return real(owner)
    monkeypatch.setattr(files, "_alive", second_run_cuts_in)
    try:
        with contextlib.suppress(PRMError), checkpoint.run_lock(str(tmp_path)):
            proceeded.append("first")
    finally:
        with contextlib.suppress(OSError):  # the unfixed lock: both runs remove "their" file
            second.close()
    assert len(proceeded) == 1
