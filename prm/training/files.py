"""Writes that never leave half a file: a failure raises WriteFailed naming the path and the cause, and keeps
what was there before."""
import contextlib
import os
import shutil

from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from prm.errors import WriteFailed

# from open/write/rename, torch.save, safetensors' save_file and dcp.save
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError, CheckpointException)


@contextlib.contextmanager
def reported(path: str):
    """A write failure inside the block raises WriteFailed naming `path` and the cause."""
    try:
        yield
    except WRITE_ERRORS as e:
        error = e
        # dcp's text is a traceback per rank: the first rank's error instead
        if isinstance(e, CheckpointException) and e.failures:
            error = next(iter(e.failures.values()))[0]
        lines = str(error).strip().splitlines()
        cause = (error.strerror if isinstance(error, OSError) else None) or \
            (lines[0] if lines else type(error).__name__)
        # torch.save's message never says "disk full": the free space does
        if not isinstance(error, OSError):
            cause += f" ({free_mib(path)} MiB free there)"
        raise WriteFailed(f"could not write {path}: {cause}", cause=cause) from e


def free_mib(path: str) -> str:
    """Free space on the disk of `path` (or its nearest existing parent), in MiB; '?' when unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free / 2 ** 20:.1f}"
    except OSError:
        return "?"


@contextlib.contextmanager
def written_in_place(path: str, fresh: bool = True):
    """Yields a temporary directory that replaces the directory `path` once the block succeeds, else is removed.
    fresh=False keeps what the temporary directory holds already (the shards every rank wrote)."""
    tmp, old = path + ".tmp", path + ".old"
    if fresh:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        with reported(path):
            yield tmp
            if os.path.isdir(path):
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        # failed between the two renames: the old one goes back
        if os.path.isdir(old) and not os.path.isdir(path):
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_text(path: str, text: str):
    """The file `path` holding `text`, written to a temporary name and renamed."""
    tmp = path + ".tmp"
    try:
        with reported(path):
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
    except WriteFailed:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class AppendFile:
    """A text file opened for appending, each write flushed."""

    def __init__(self, path: str):
        self.path = path
        with reported(path):
            self.file = open(path, "a")

    def write(self, text: str):
        with reported(self.path):
            self.file.write(text)
            self.file.flush()

    def close(self):
        with reported(self.path):
            self.file.close()
