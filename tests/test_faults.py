"""Faults and hostile input: divergence, signals during the final evaluation, NaN scores, bad flags, paths and
encodings, errors sent between ranks (checkpoints, resume and the run lock: test_checkpoint.py; a model's own code:
test_trust.py)."""
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

from conftest import ROOT, run_train
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
    real = trainer.Trainer.evaluate
    monkeypatch.setattr(trainer.Trainer, "evaluate", lambda self: seen.append(signal.getsignal(signal.SIGTERM))
                        or real(self))
    run_train(tmp_path, max_steps=2)
    assert seen == [signal.SIG_DFL]  # the trainer's flag-only handler is gone: SIGTERM stops the process at once
    preemption = trainer.Preemption()
    preemption.signum = signal.SIGTERM  # a second signal in the loop stops at once
    with pytest.raises(PRMError) as e:
        preemption.on_signal(signal.SIGTERM, None)
    assert e.value.code == 128 + signal.SIGTERM


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
