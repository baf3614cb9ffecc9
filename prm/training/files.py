"""Writes that never leave half a file: a failure (a full disk, a read-only folder, an interrupt) ends the run with
WriteFailed, one line naming the path and the cause (exit status 1), and keeps what was there before.
Depends on: safetensors, torch, prm.errors."""
import contextlib
import os
import shutil

from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from prm.errors import WriteFailed

# what a failed write raises: OSError from open/write/rename, RuntimeError from torch.save ("file write
# failed"), SafetensorError from safetensors' save_file ("IoError(... StorageFull ...)"), CheckpointException
# from dcp.save under --fsdp (a BaseException, holding each failed rank's error)
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError, CheckpointException)


@contextlib.contextmanager
def reported(path: str):
    """A write failure inside the block raises WriteFailed naming `path` and the cause."""
    try:
        yield
    except WRITE_ERRORS as e:
        error = e
        # dcp's own text is a traceback per rank: the first failed rank's error instead
        if isinstance(e, CheckpointException) and e.failures:
            error = next(iter(e.failures.values()))[0]
        lines = str(error).strip().splitlines()
        cause = (error.strerror if isinstance(error, OSError) else None) or \
            (lines[0] if lines else type(error).__name__)
        # torch.save's "unexpected pos 320 vs 214" never says "disk full": the free space does
        if not isinstance(error, OSError):
            cause += f" ({free_mib(path)} MiB free there)"
        raise WriteFailed(f"could not write {path}: {cause}", cause=cause) from e


def free_mib(path: str) -> str:
    """Free space on the disk of `path` (or of its nearest existing parent), in MiB; '?' when unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free / 2 ** 20:.1f}"
    except OSError:
        return "?"


@contextlib.contextmanager
def written_in_place(path: str, fresh: bool = True):
    """Yields a temporary directory that replaces the directory `path` once the block succeeds; whatever stops the
    block, no temporary directory stays and the previous `path` is kept. fresh=False keeps what is already in the
    temporary directory (the shards every rank wrote)."""
    tmp, old = path + ".tmp", path + ".old"
    if fresh:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        with reported(path):
            yield tmp
            # the previous one is set aside only now that the new one is complete
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
    """The file `path` holding `text`, written to a temporary name and renamed: the whole text or the file as it
    was."""
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
    """A text file opened for appending (metrics.jsonl), each write flushed: on disk even if the run dies next."""

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
