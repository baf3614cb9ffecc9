"""Files written whole or not at all (else WriteFailed), and a lock against a second writer."""
import contextlib
import fcntl
import os
import shutil
import socket
import sys

from safetensors import SafetensorError

from prm.errors import UsageError, WriteFailed


@contextlib.contextmanager
def reported(path: str):
    """A failed write in the block: WriteFailed."""
    try:
        yield
    except BaseException as e:
        # dcp.save's CheckpointException (a BaseException) holds each rank's error
        error = next(iter(e.failures.values()))[0] if getattr(e, "failures", None) else e
        if not isinstance(error, (OSError, RuntimeError, SafetensorError)):
            raise
        lines = str(error).strip().splitlines()
        cause = (error.strerror if isinstance(error, OSError) else None) or \
            (lines[0] if lines else type(error).__name__)
        # torch.save's message never says "disk full": the free space does
        if not isinstance(error, OSError):
            cause += f" ({free_mib(path)} MiB free there)"
        raise WriteFailed(f"could not write {path}: {cause}", cause=cause) from e


def free_mib(path: str) -> str:
    """Free MiB on the disk of `path` or its nearest parent; '?': unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free / 2 ** 20:.1f}"
    except OSError:
        return "?"


def write_lines(path: str, lines, mode: str = "w"):
    """Via a synced temporary file renamed over `path`; mode 'a', a FIFO, a device: in place."""
    direct = mode == "a" or os.path.exists(path) and not os.path.isfile(path)
    tmp = path if direct else f"{path}.tmp{os.getpid()}"
    try:
        with reported(path):
            with open(tmp, mode, encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)
                if not direct:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        if not direct:
            with contextlib.suppress(OSError):
                os.remove(tmp)


@contextlib.contextmanager
def written_in_place(path: str, fresh: bool = True):
    """A temporary directory that replaces `path` if the block succeeds."""
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


@contextlib.contextmanager
def locked(path: str, lock: str = ""):
    """Holds `lock` (PATH.lock: flock, pid@host) for the block; another writer: UsageError."""
    lock = lock or path + ".lock"
    with reported(lock):
        fd = _hold(lock, path)
    try:
        yield
    finally:
        # before the hold ends, so a waiting process sees the file gone
        os.remove(lock)
        os.close(fd)


def _hold(lock: str, path: str) -> int:
    def busy(owner):
        os.close(fd)
        raise UsageError(f"{path} is in use by another run ({owner or 'starting'}); wait for it "
                         f"to end, or if none is, delete {lock}")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy(_owner(fd))
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        # the holder removed the file as we opened it
        os.close(fd)
    owner = _owner(fd)
    if owner and _alive(owner):
        busy(owner)
    if owner:
        print(f"warning: taking over the stale lock of {owner}: {lock}", file=sys.stderr)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}".encode(), 0)
    return fd


def _owner(fd: int) -> str:
    return os.read(fd, 256).decode(errors="replace").strip()


def _alive(owner: str) -> bool:
    """Whether a lock's owner may run though we hold its flock: not pid@host, or on another host
    (flock need not reach there). A pid here proves nothing (pids are reused)."""
    pid, _, host = owner.partition("@")
    return host != socket.gethostname() or not pid.isdigit()
