"""Faults and hostile input: divergence, resume mismatches, damaged checkpoints, a failed final write, two runs on
one directory, duplicated records, bad flags and encodings (a model's own code: test_trust.py)."""
import json
import math
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, read_metrics, run_train, small_config
from prm.errors import PRMError, UsageError


def strict_records(out_dir):
    """metrics.jsonl parsed strictly: a bare NaN or Infinity fails."""
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_divergence_stops_with_status_3_and_saves_no_non_finite_weights(tmp_path, capsys):
    with pytest.raises(PRMError) as e:
        # 1e10: packed attention stays finite at the 1e3 that made the padded (masked) path overflow
        run_train(tmp_path, synthetic_size=400, batch_size=32, lr=1e10, max_steps=20, save_every=1, keep_last=1,
                  log_every=10)
    assert e.value.code == 3
    err = str(e.value)
    assert "not finite at step" in err and "Lower --lr (now 1e+10)" in err
    bad = int(err.split("not finite at step ")[1].split()[0])
    saved = [d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")]
    assert all(int(d.split("-")[1]) < bad for d in saved)  # nothing saved from the first non-finite step on
    for d in saved:
        assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / d / "model.safetensors")).values())
    assert not os.path.exists(tmp_path / "final")
    strict_records(tmp_path)  # the NaN loss was written as null


def test_auroc_returns_on_nan_scores():
    from prm.core.metrics import auroc
    out = {}
    worker = threading.Thread(target=lambda: out.update(v=auroc([0.1, float("nan"), 0.7], [False, True, True])),
                              daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and out["v"] is None


def test_signals_keep_their_usual_effect_during_the_final_evaluation(tmp_path, monkeypatch):
    from prm.training import trainer
    seen = []
    real = trainer.HeldOut.run
    monkeypatch.setattr(trainer.HeldOut, "run", lambda self: seen.append(signal.getsignal(signal.SIGTERM))
                        or real(self))
    run_train(tmp_path, max_steps=2)
    assert seen == [signal.SIG_DFL]  # the trainer's flag-only handler is gone: SIGTERM stops the process at once
    preemption = trainer.Preemption()
    preemption.signum = signal.SIGTERM  # a second signal in the loop stops at once
    with pytest.raises(PRMError) as e:
        preemption.on_signal(signal.SIGTERM, None)
    assert e.value.code == 128 + signal.SIGTERM


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


def test_final_is_written_before_the_evaluation_and_atomically(tmp_path, monkeypatch):
    from prm.training import checkpoint, trainer
    from prm.core.model import PRM
    monkeypatch.setattr(trainer.HeldOut, "run", lambda self: 1 / 0)  # the final evaluation fails
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


# holds a lock as run_lock does (flock, then its pid@host in the file) until killed
HOLD = ("import fcntl, os, socket, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, f'{os.getpid()}@{socket.gethostname()}'.encode())\n"
        "print('held', flush=True)\ntime.sleep(600)\n")


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
    from prm.training import checkpoint
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"{dead.pid}@{socket.gethostname()}")
    proceeded, second, real = [], contextlib.ExitStack(), checkpoint._alive

    def second_run_cuts_in(owner):
        monkeypatch.setattr(checkpoint, "_alive", real)  # the second run checks for itself, holding the lock if it can
        with contextlib.suppress(PRMError):
            second.enter_context(checkpoint.run_lock(str(tmp_path)))
            proceeded.append("second")
        return real(owner)
    monkeypatch.setattr(checkpoint, "_alive", second_run_cuts_in)
    try:
        with contextlib.suppress(PRMError), checkpoint.run_lock(str(tmp_path)):
            proceeded.append("first")
    finally:
        with contextlib.suppress(OSError):  # the unfixed lock: both runs remove "their" file
            second.close()
    assert len(proceeded) == 1


def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
    run_train(tmp_path, max_steps=4, save_every=2, keep_last=0)
    run_train(tmp_path, max_steps=4, resume=str(tmp_path / "checkpoint-2"))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert sum("final" in r for r in records) == 1


@pytest.mark.parametrize("flags, message", [
    (["--step-separator", ""], "--step-separator '': must not be empty"),
    (["--batch-size", "-1"], "--batch-size -1: must be >= 0"),
    (["--lr", "nan"], "--lr nan: must be finite"),
    (["--lr", "-1"], "--lr -1.0: must be finite and >= 0"),
    (["--max-steps", "0"], "--max-steps 0: must be -1"),
    (["--threshold", "1.5"], "--threshold 1.5: must be in [0, 1]"),
    (["--max-length", "-5"], "--max-length -5: must be >= 1"),
    (["--eval-fraction", "1.0"], "--eval-fraction 1.0: must be in (0, 1)"),
    (["--eval-fraction", "0"], "--eval-fraction 0.0: must be in (0, 1)"),
])
def test_bad_flags_exit_2_at_start_up(flags, message):
    from prm.cli import parse_config
    from prm.errors import UsageError
    with pytest.raises(UsageError) as e:
        parse_config(flags)
    assert e.value.code == 2 and message in str(e.value) and "\n" not in str(e.value)


def test_bad_paths_exit_2_with_a_message(tmp_path):
    from prm.cli import parse_config
    from prm.errors import UsageError
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError) as e:
        parse_config(["--output-dir", str(tmp_path / "file" / "out")])
    assert e.value.code == 2 and "not a writable folder" in str(e.value)
    (tmp_path / "no_config").mkdir()
    for kw, text in (({"tokenizer": str(tmp_path / "missing")}, "--tokenizer"),
                     ({"model": str(tmp_path / "no_config")}, "no config.json")):
        with pytest.raises(UsageError) as e:  # from prm.training.build: train.py's exit_status() makes it exit status 2
            run_train(tmp_path / "out", max_steps=1, **kw)
        assert e.value.code == 2 and text in str(e.value)
    r = subprocess.run([sys.executable, "train.py", "--lr", "nan", "--output-dir", str(tmp_path / "o")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--lr nan" in r.stderr


def test_eval_checks_its_paths_and_dev_set_before_working(tmp_path):
    import eval as eval_cli
    out = tmp_path / "run"
    run_train(out, max_steps=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError) as e:
        eval_cli.main(["--model", str(out / "final"), "--predictions", str(tmp_path / "file" / "p.jsonl")])
    assert e.value.code == 2 and "--predictions" in str(e.value)
    dev = tmp_path / "all_right.jsonl"
    dev.write_text(json.dumps({"prompt": "p", "completions": ["1+1=2"], "labels": [True]}) + "\n")
    with pytest.raises(UsageError) as e:
        eval_cli.main(["--model", str(out / "final"), "--tune-threshold", str(dev)])
    assert e.value.code == 2 and "both with and without an error" in str(e.value)


def test_encodings_are_named_and_a_bom_is_accepted(tmp_path):
    from prm.config import Config
    from prm.readers.sources import DataError, read_rows
    row = {"prompt": "p", "completions": ["a"], "labels": [True]}
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(row).encode() + b"\n")
    assert read_rows(str(tmp_path / "bom.jsonl"), "train", Config()) == [row]
    latin1 = json.dumps({**row, "prompt": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")  # \xe9, not UTF-8
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(row).encode() + b"\n" + latin1 + b"\n")
    with pytest.raises(DataError, match=r"latin1.jsonl line 2: not UTF-8 text"):
        read_rows(str(tmp_path / "latin1.jsonl"), "train", Config())


def test_metrics_writer_turns_non_finite_numbers_into_null():
    from prm.training.trainlog import strict_json
    assert strict_json({"a": math.nan, "b": [math.inf, 1.0], "c": {"d": -math.inf}}) == \
        {"a": None, "b": [None, 1.0], "c": {"d": None}}


def test_a_checkpoint_holding_a_symlink_to_dev_zero_or_a_fifo_is_damaged_not_a_hang(tmp_path):
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


def test_a_conflicting_resume_is_refused_before_any_data_loads(tmp_path, monkeypatch):
    run_train(tmp_path, max_steps=2, save_every=2)

    def no_data(cfg):
        raise AssertionError("the data loaded before the resume's settings were compared")
    monkeypatch.setattr("prm.training.trainer.load_splits", no_data)
    with pytest.raises(PRMError, match="--seed 1 \\(was 0\\)") as e:
        run_train(tmp_path, max_steps=4, resume="auto", seed=1)
    assert e.value.code == 2


def test_resuming_a_finished_run_reports_no_throughput_rather_than_zero(tmp_path):
    run_train(tmp_path, max_steps=2, save_every=2)
    final = run_train(tmp_path, max_steps=2, resume="auto")  # every step already done: nothing trained here
    assert final["train_tokens_per_second"] is None and final["padding_efficiency"] is None
    assert read_metrics(tmp_path)[-1]["final"]["padding_efficiency"] is None  # null in metrics.jsonl


def test_a_kill_between_a_save_and_its_pruning_leaves_no_surplus_checkpoint(tmp_path):
    import shutil
    run_train(tmp_path, max_steps=4, save_every=2, keep_last=0)
    shutil.rmtree(tmp_path / "final")  # as a --keep-last 1 run killed after checkpoint-4's rename, before pruning
    run_train(tmp_path, max_steps=4, save_every=2, keep_last=1, resume="auto")  # all steps done: no save follows
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]


def test_the_first_record_after_a_resume_says_it_averages_the_steps_since_the_resume(tmp_path, capsys):
    run_train(tmp_path, max_steps=3, save_every=3, log_every=4)
    run_train(tmp_path, max_steps=8, log_every=4, resume="auto")  # step 4's window: step 4 alone, not steps 1-4
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [(r["step"], r.get("since_resume")) for r in records] == [(3, None), (4, True), (8, None)]
    lines = capsys.readouterr().out.splitlines()
    assert [line.startswith("step 4 | ") for line in lines if line.endswith(" | since resume")] == [True]


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


def test_every_error_an_entry_point_reports_survives_pickling_whole():
    """Rank 0's error reaches the other ranks pickled (prm.core.runtime.decided_by_main): message, type, exit status
    and fields arrive as built."""
    import pickle

    from prm.errors import Diverged, Stopped, WriteFailed
    from prm.readers.sources import DataError, MissingSplit
    for error in (UsageError("bad flag"), WriteFailed("out: cannot write it: full", cause="full"),
                  Diverged("loss is nan"), Stopped("stopped by SIGTERM", signal.SIGTERM),
                  DataError(["a.jsonl line 2: field 'labels': missing"], total_rows=1),
                  MissingSplit(["d: no data file named for split 'dev'"])):
        back = pickle.loads(pickle.dumps(error))
        assert (type(back), str(back), back.code, vars(back)) == (type(error), str(error), error.code, vars(error))
