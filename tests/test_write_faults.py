"""A full disk, a read-only folder, an I/O error: every failed write ends the run with exit status 1 and one line
naming the path and the cause, leaves no .tmp directory, and never loses the weights trained."""
import errno
import os
import subprocess

import pytest
from safetensors import SafetensorError

from prm.errors import PRMError
from conftest import run_train

NO_SPACE = os.strerror(errno.ENOSPC)
FAULTS = {  # what each writer raises on a full disk
    "open/write": OSError(errno.ENOSPC, NO_SPACE),
    "torch.save": RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 320 vs 214\n(more lines)"),
    "save_file": SafetensorError(f'Error while serializing: IoError(Os {{ code: 28, kind: StorageFull, message: '
                                 f'"{NO_SPACE}" }})'),
}


def leftovers(root) -> list:
    return [os.path.join(d, n) for d, dirs, _ in os.walk(root) for n in dirs if n.endswith((".tmp", ".old"))]


def one_line(e, *needles):
    """The exit: status 1, one line, holding each needle."""
    message = str(e.value)
    assert e.value.code == 1 and "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def fail(monkeypatch, target: str, error: Exception, only=""):
    """target (module.attr) raises `error` when its path argument holds `only`."""
    module, name = target.rsplit(".", 1)
    real = getattr(__import__(module, fromlist=[name]), name)

    def broken(obj, path, *a, **kw):
        if only in str(path):
            raise error
        return real(obj, path, *a, **kw)
    monkeypatch.setattr(f"{module}.{name}", broken)


@pytest.mark.parametrize("target, kind", [("torch.save", "torch.save"), ("torch.save", "open/write"),
                                          ("prm.core.model.save_file", "save_file")])
def test_a_checkpoint_that_cannot_be_written_exits_with_one_line(tmp_path, monkeypatch, target, kind):
    fail(monkeypatch, target, FAULTS[kind])
    with pytest.raises(PRMError) as e:
        run_train(tmp_path, max_steps=2, save_every=1)
    one_line(e, f"could not write {tmp_path / 'checkpoint-1'}: ", str(FAULTS[kind]).splitlines()[0]
             if kind != "open/write" else NO_SPACE)
    assert leftovers(tmp_path) == []


def test_a_failed_final_export_keeps_the_weights_in_a_checkpoint(tmp_path, monkeypatch):
    fail(monkeypatch, "prm.core.model.save_file", FAULTS["save_file"], only="final.tmp")
    with pytest.raises(PRMError) as e:
        run_train(tmp_path, max_steps=2)  # no --save-every: without the rescue, the export was the only copy
    one_line(e, f"could not write {tmp_path / 'final'}", f"kept in {tmp_path / 'checkpoint-2'}", "--resume auto")
    assert leftovers(tmp_path) == [] and not os.path.exists(tmp_path / "final")
    monkeypatch.undo()
    run_train(tmp_path, max_steps=2, resume="auto")  # nothing left to train: the export alone
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")


def test_a_failed_final_export_says_when_the_weights_are_lost(tmp_path, monkeypatch):
    fail(monkeypatch, "prm.core.model.save_file", FAULTS["save_file"])  # the rescue checkpoint fails too
    with pytest.raises(PRMError) as e:
        run_train(tmp_path, max_steps=2)
    one_line(e, f"could not write {tmp_path / 'final'}", "could not be written either", "weights of step 2 are lost")
    assert leftovers(tmp_path) == []


def test_a_full_disk_while_appending_metrics_exits_with_one_line(tmp_path, monkeypatch):
    from prm import files

    class Full:  # metrics.jsonl on a disk that has just filled up
        def writelines(self, lines):
            raise OSError(errno.ENOSPC, NO_SPACE)
        __enter__, __exit__ = lambda self: self, lambda self, *exc: None
    real = open
    monkeypatch.setattr(files, "open", lambda path, mode="r", *a, **kw: Full() if mode == "a"
                        else real(path, mode, *a, **kw), raising=False)
    with pytest.raises(PRMError) as e:
        run_train(tmp_path, max_steps=2)
    one_line(e, f"could not write {tmp_path / 'metrics.jsonl'}: {NO_SPACE}")


def test_a_real_full_disk(tmp_path):
    """A 3 MiB tmpfs (root only: skipped where mount is not permitted) takes final/'s weights but not more."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(PRMError) as e:
            run_train(disk / "run", max_steps=2, save_every=1)
        one_line(e, f"could not write {disk / 'run' / 'checkpoint-1'}")
        assert leftovers(disk) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)])  # -l: the failed run may still hold metrics.jsonl open


def test_a_full_disk_while_dropping_records_on_resume_keeps_metrics_whole(tmp_path, monkeypatch):
    from prm import files
    from prm.training import checkpoint
    from prm.errors import WriteFailed
    path = tmp_path / "metrics.jsonl"
    records = '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "loss": 0.3}\n'
    path.write_text(records)
    real = open

    class Full:  # opened for writing (so emptied), then the disk is full
        def __init__(self, *a, **kw):
            self.file = real(*a, **kw)

        def writelines(self, lines):
            raise OSError(errno.ENOSPC, NO_SPACE)
        write = writelines

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()
    monkeypatch.setattr(files, "open", lambda p, mode="r", *a, **kw: Full(p, mode, *a, **kw) if "w" in mode
                        else real(p, mode, *a, **kw), raising=False)
    with pytest.raises(WriteFailed) as e:
        checkpoint.keep_records_until(str(path), 2)
    one_line(e, f"could not write {path}: {NO_SPACE}")
    assert path.read_text() == records and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_records_kept_on_resume_end_with_a_newline(tmp_path):
    from prm.training.checkpoint import keep_records_until
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}')  # the crash cut the last "\n"
    keep_records_until(str(path), 5)
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n'


def test_a_failed_sharded_save_is_a_write_failure(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException
    from prm.files import writing
    from prm.errors import WriteFailed
    error = CheckpointException("save failed", {0: (OSError(errno.ENOSPC, NO_SPACE), None)})  # as dcp.save raises
    with pytest.raises(WriteFailed) as e:
        with writing(str(tmp_path / "checkpoint-1")):
            raise error
    one_line(e, f"could not write {tmp_path / 'checkpoint-1'}: {NO_SPACE}")
    assert e.value.__cause__ is error


def test_a_failed_write_is_a_write_failure_when_the_free_space_is_unknown(tmp_path, monkeypatch):
    import shutil
    from prm.files import writing
    from prm.errors import WriteFailed
    def disk_usage(path):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with pytest.raises(WriteFailed) as e:
        with writing(str(tmp_path / "model.safetensors")):
            raise SafetensorError("Error while serializing")
    one_line(e, f"could not write {tmp_path / 'model.safetensors'}: Error while serializing")


def test_any_write_failure_names_its_cause_when_final_cannot_be_rescued(tmp_path, monkeypatch):
    from types import SimpleNamespace
    from prm.training.checkpoint import Checkpointer
    from prm.errors import WriteFailed
    assert WriteFailed("cannot write the rows").cause == "cannot write the rows"
    checkpointer = Checkpointer.__new__(Checkpointer)
    checkpointer.cfg = SimpleNamespace(output_dir=str(tmp_path), fsdp=False)

    def write(tmp, step, state, shards):  # a WriteFailed not made by writing(): no cause given
        raise WriteFailed("cannot write the rows")
    monkeypatch.setattr(checkpointer, "write", write)
    assert "could not be written either (cannot write the rows)" in checkpointer.kept_instead(2, None)
