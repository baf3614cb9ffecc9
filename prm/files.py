"""Files written whole or not at all, and the lock that keeps a second writer out. A failed write
raises WriteFailed naming the path and the cause, and keeps what was there before."""
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
    """A failed write inside the block (open, torch.save, safetensors, dcp.save) raises WriteFailed
    naming `path` and the cause."""
    try:
        yield
    except BaseException as e:
        # dcp.save's CheckpointException (a BaseException) holds each rank's error: the first one
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
    """Free space on the disk of `path` (or its nearest existing parent) in MiB; '?' if unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free / 2 ** 20:.1f}"
    except OSError:
        return "?"


def write_lines(path: str, lines, mode: str = "w"):
    """`path` holding `lines`, each ended by a newline: a temporary file in its folder, synced and
    renamed over it. mode 'a' appends in place, as does a write to a FIFO or device (/dev/full)."""
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
    """Yields a temporary directory that replaces the directory `path` once the block succeeds, else
    is removed. fresh=False keeps what it holds already (the shards every rank wrote)."""
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
    """Holds `lock` (default PATH.lock: its flock, pid@host in it) while the block runs: another
    writer of `path` meanwhile is a UsageError. A lock of this host with a free flock is stale."""
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
    """An open descriptor of `lock` holding its flock, the file naming this process."""
    def busy(owner):
        os.close(fd)
        raise UsageError(f"{path} is in use by another run ({owner or 'starting'}); wait for it "
                         f"to end, or if none is, delete {lock}")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy(os.read(fd, 256).decode(errors="replace").strip())
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        # the holder removed the file as we opened it
        os.close(fd)
    owner = os.read(fd, 256).decode(errors="replace").strip()
    if owner and _alive(owner):
        busy(owner)
    if owner:
        print(f"warning: taking over the stale lock of {owner}: {lock}", file=sys.stderr)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}".encode(), 0)
    return fd


def _alive(owner: str) -> bool:
    """Whether the owner of a lock whose flock we hold may still run: only on another host (flock
    need not reach there) or if not pid@host. A pid here proves nothing (pids are reused)."""
    pid, _, host = owner.partition("@")
    return host != socket.gethostname() or not pid.isdigit()
