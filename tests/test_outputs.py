"""One run per output directory (refuse, --overwrite, --resume auto) and the optional trackers (TensorBoard, W&B)."""
import json
import math
import os
import sys

import pytest

from prm.errors import PRMError
from conftest import read_metrics, run_train, small_config, training
from prm.training import report
from prm.readers.sources import DataError


def snapshot(directory) -> dict:
    """{relative path: (bytes, mtime_ns)} of every file below directory."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def loss_steps(out) -> list:
    return [r["step"] for r in read_metrics(out) if "loss" in r]


def test_second_run_into_a_finished_dir_is_refused_and_touches_nothing(tmp_path, capsys):
    run_train(tmp_path / "a", max_steps=2, save_every=2)
    run_train(tmp_path / "b", max_steps=2, save_every=2)
    before = snapshot(tmp_path)
    with pytest.raises(PRMError) as e:
        run_train(tmp_path / "a", max_steps=3)
    err = str(e.value)
    assert e.value.code == 2 and "--overwrite" in err
    assert f"{tmp_path / 'a'} already holds a run (checkpoint-2/, final/, metrics.jsonl)" in err
    with pytest.raises(PRMError) as e:  # continuing b's checkpoint would append to a's records
        run_train(tmp_path / "a", max_steps=3, resume=str(tmp_path / "b" / "checkpoint-2"))
    assert e.value.code == 2 and "is a checkpoint of another directory" in str(e.value)
    assert snapshot(tmp_path) == before


def test_a_run_stopped_by_bad_data_leaves_no_empty_output_dir(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "completions": ["a step"], "labels": ["yes"]}\n')
    for out, existed in ((tmp_path / "new", False), (tmp_path / "mine", True)):
        if existed:
            out.mkdir()
        with pytest.raises(DataError):
            run_train(out, dataset=str(bad))
        assert out.is_dir() == existed and (not existed or not os.listdir(out))  # a directory of the user's stays


def test_overwrite_replaces_the_run_and_keeps_other_files(tmp_path):
    run_train(tmp_path, max_steps=4, save_every=2)
    (tmp_path / "notes.txt").write_text("mine")
    run_train(tmp_path, max_steps=3, overwrite=True)
    assert loss_steps(tmp_path) == [1, 2, 3]  # the old run's 4 records are gone, not appended to
    assert not any(n.startswith("checkpoint-") for n in os.listdir(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert json.loads((tmp_path / "final" / "config.train.json").read_text())["max_steps"] == 3


def test_resume_auto_continues_the_same_run(tmp_path, capsys):
    run_train(tmp_path, max_steps=4, save_every=2)
    run_train(tmp_path, max_steps=6, save_every=2, resume="auto")
    assert loss_steps(tmp_path) == [1, 2, 3, 4, 5, 6]
    finished = tmp_path / "no_checkpoint"
    run_train(finished, max_steps=2)
    with pytest.raises(PRMError) as e:  # nothing to continue from: starting over would append to its records
        run_train(finished, max_steps=3, resume="auto")
    assert e.value.code == 2 and "finds no complete checkpoint" in str(e.value)
    with pytest.raises(PRMError) as e:
        run_train(finished, max_steps=3, resume="auto", overwrite=True)
    assert e.value.code == 2 and loss_steps(finished) == [1, 2]


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_missing_tracker_package_stops_at_start_up_with_one_line(kind, tmp_path, monkeypatch, capsys):
    for name in ("tensorboard", "torch.utils.tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: `import name` raises ImportError
    with pytest.raises(PRMError) as e:
        run_train(tmp_path / "out", report_to=kind)
    assert e.value.code == 2
    assert str(e.value) == f"--report-to {kind} needs the {kind} package: pip install {kind}"
    assert not (tmp_path / "out").exists()  # stopped before anything was written


class FakeWriter:
    """Stands in for torch.utils.tensorboard.SummaryWriter: records what it is given."""
    made = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.texts, self.closed = log_dir, purge_step, [], [], False
        FakeWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def add_text(self, tag, text):
        self.texts.append((tag, text))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tracker_gets_the_metrics_records_and_the_config_once(tmp_path, monkeypatch):
    fake = type(sys)("fake_tensorboard")
    fake.SummaryWriter = FakeWriter
    for module in (report, training()):  # train.py checks the package at start-up, the Tracker opens it
        monkeypatch.setattr(module, "tracker_module", lambda kind: fake)
    FakeWriter.made.clear()
    run_train(tmp_path, max_steps=4, eval_every=2, report_to="tensorboard", run_name="exp1")
    (writer,) = FakeWriter.made
    assert writer.log_dir == os.path.join(str(tmp_path), "tensorboard", "exp1") and writer.closed
    assert len(writer.texts) == 1 and '"report_to": "tensorboard"' in writer.texts[0][1]
    records = read_metrics(tmp_path)
    assert [(s, v) for t, v, s in writer.scalars if t == "train/loss"] == [(r["step"], r["loss"]) for r in records
                                                                          if "loss" in r]
    assert [s for t, _, s in writer.scalars if t == "eval/step_accuracy"] == [2]
    assert ("final/step_accuracy", records[-1]["final"]["step_accuracy"], 4) in writer.scalars


def test_a_resumed_run_purges_the_tensorboard_events_past_its_checkpoint(tmp_path, monkeypatch):
    """TensorBoard's crash-restart option: the steps a stopped run logged after its checkpoint appear once."""
    fake = type(sys)("fake_tensorboard")
    fake.SummaryWriter = FakeWriter
    for module in (report, training()):
        monkeypatch.setattr(module, "tracker_module", lambda kind: fake)
    FakeWriter.made.clear()
    run_train(tmp_path / "a", max_steps=4, save_every=2, report_to="tensorboard")
    run_train(tmp_path / "b", max_steps=4, report_to="tensorboard", resume=str(tmp_path / "a" / "checkpoint-2"))
    assert [w.purge_step for w in FakeWriter.made] == [None, 3]


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_train(tmp_path, max_steps=4, save_every=2, keep_last=0, report_to="tensorboard")
    run_train(tmp_path, max_steps=4, report_to="tensorboard", resume=str(tmp_path / "checkpoint-2"))
    events = EventAccumulator(os.path.join(str(tmp_path), "tensorboard", os.path.basename(str(tmp_path)))).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_tensorboard_event_files_hold_the_loss_curve(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_train(tmp_path, max_steps=3, report_to="tensorboard")
    events = EventAccumulator(os.path.join(str(tmp_path), "tensorboard", os.path.basename(str(tmp_path)))).Reload()
    curve, records = events.Scalars("train/loss"), [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [e.step for e in curve] == [r["step"] for r in records] == [1, 2, 3]
    assert [e.value for e in curve] == pytest.approx([r["loss"] for r in records], rel=1e-6)  # stored as float32
    assert events.Tags()["tensors"] == ["config/text_summary"]  # add_text: the config, once


def test_scalars_follow_the_records():
    assert report.scalars({"step": 3, "loss": 0.5, "acc": 1, "epoch": 0}) == {
        "train/loss": 0.5, "train/acc": 1.0, "train/epoch": 0.0}
    assert report.scalars({"step": 3, "eval_auroc": None, "eval_f1_1": 0.25}) == {"eval/f1_1": 0.25}
    assert report.scalars({"step": 4, "final": {"auroc": 0.75, "train_data": {"rows": 3}}}) == {
        "final/auroc": 0.75}


def test_wandb_tracker_gets_the_config_and_the_records(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = type(sys)("fake_wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setattr(report, "tracker_module", lambda kind: fake)
    monkeypatch.setenv("WANDB_PROJECT", "prm-tests")
    cfg = small_config(tmp_path / "run7", report_to="wandb").resolve()
    tracker = report.Tracker(cfg)
    tracker.log({"step": 1, "loss": 0.5, "acc": 0.75, "lr": 1e-3, "norm": 1.0, "tok_per_s": 10.0, "epoch": 0})
    tracker.close()
    init = calls[0][1]
    assert (init["project"], init["name"], init["config"]["report_to"]) == ("prm-tests", "run7", "wandb")
    assert calls[1] == ("log", {"train/loss": 0.5, "train/acc": 0.75, "train/lr": 1e-3, "train/norm": 1.0,
                                "train/tok_per_s": 10.0, "train/epoch": 0.0}, 1)
    assert calls[2:] == [("finish",)]


def test_metrics_writer_turns_non_finite_numbers_into_null():
    strict_json = training().strict_json
    assert strict_json({"a": math.nan, "b": [math.inf, 1.0], "c": {"d": -math.inf}}) == \
        {"a": None, "b": [None, 1.0], "c": {"d": None}}
