"""Files written whole or not at all, locks, and the resumable outputs of prm.label, prm.search."""
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import sys

from safetensors import SafetensorError

from prm.errors import UsageError, WriteFailed, check


@contextlib.contextmanager
def writing(path: str):
    """A failed write in the block becomes a WriteFailed naming `path`."""
    try:
        yield
    except BaseException as e:
        # dcp.save's CheckpointException holds each rank's error
        error = next(iter(e.failures.values()))[0] if getattr(e, "failures", None) else e
        if isinstance(error, FileExistsError) or \
                not isinstance(error, (OSError, RuntimeError, SafetensorError)):
            raise
        first = (str(error).strip() or type(error).__name__).splitlines()[0]
        cause = getattr(error, "strerror", None) or first
        if not isinstance(error, OSError):  # torch.save's never says "disk full": free space does
            folder = path
            while folder and not os.path.exists(folder):
                folder = os.path.dirname(folder)
            with contextlib.suppress(OSError):  # unknown: the WriteFailed all the same
                free = shutil.disk_usage(folder or ".").free / 2 ** 20
                cause += f" ({free:.1f} MiB free there)"
        raise WriteFailed(f"could not write {path}: {cause}", cause=cause) from e


def write_lines(path: str, lines, mode: str = "w"):
    """Via a synced temporary file renamed over `path` (a symlink: its target); 'x': never over
    a file (FileExistsError); 'a', a FIFO, a device: in place."""
    real = os.path.realpath(path)
    direct = mode == "a" or os.path.exists(real) and not os.path.isfile(real)
    folder, name = os.path.split(real)  # name[:200]: a name near the length limit still fits
    tmp = real if direct else os.path.join(folder, f".{os.getpid()}.{name[:200]}.tmp")
    try:
        with writing(path):
            with open(tmp, mode.replace("x", "w"), encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)
                if not direct:
                    f.flush()
                    os.fsync(f.fileno())
            (os.link if mode == "x" else os.replace)(tmp, real)
    finally:
        if not direct:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def digest(paths: list, named: bool = True) -> str:
    """sha256 of the files' names (if named) and contents; a folder: its name."""
    out = hashlib.sha256()
    for path in paths:
        out.update((os.path.basename(path) if named else "").encode() + b"\0")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    out.update(block)
    return out.hexdigest()


@contextlib.contextmanager
def staged_folder(path: str):
    """Yields PATH.tmp (emptied) to fill; it replaces `path` if the block succeeds."""
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(path):
            yield tmp
            if os.path.isdir(path):
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(old) and not os.path.isdir(path):  # failed between the renames
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def locked(path: str, lock: str = ""):
    """Holds `lock` (PATH.lock: flock, pid@host) for the block; another writer: UsageError."""
    lock = lock or path + ".lock"
    with writing(lock):
        while True:
            try:  # O_NOFOLLOW: a link planted there would redirect the write
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError:
                if os.path.islink(lock):
                    check([f"{lock} is a symbolic link, not a lock; delete it"])
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = False
                break
            held = True
            with contextlib.suppress(FileNotFoundError):  # else the holder removed it meanwhile
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        text = os.read(fd, 256).decode(errors="replace").strip()
        owner = "".join(c if c.isprintable() else "?" for c in text)  # pid@host
        if not held or owner and _alive(owner):
            os.close(fd)
            raise UsageError(f"{path} is in use by another run ({owner or 'starting'}); if none "
                             f"is, delete {lock}")
        if owner:
            print(f"warning: taking over the stale lock of {owner}: {lock}", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}".encode(), 0)
    try:
        yield
    finally:
        os.remove(lock)  # before the flock ends: a waiting process sees it gone
        os.close(fd)


def _alive(owner: str) -> bool:
    """Whether the owner may run though we hold its flock: on another host, or not pid@host."""
    pid, _, host = owner.partition("@")
    return host != socket.gethostname() or not pid.isdigit()


def finished(*paths: str, writer: str = "prm.label") -> dict:
    """{input row: its output lines} of the complete rows (from the first file holding one)."""
    rows = {}
    for path in filter(os.path.isfile, paths):
        with open(path, "rb") as f:
            lines, got = f.read().split(b"\n")[:-1], {}  # past the last newline: a line cut short
        for n, line in enumerate(lines, 1):
            try:  # not UTF-8: a UnicodeDecodeError, a ValueError
                text = line.decode()
                r = json.loads(text)
                got.setdefault(r["row"], []).append((text, r["lines"]))
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"{path} line {n}: not a line {writer} writes; pass another "
                                 "--output") from None
        rows = {k: [line for line, _ in v] for k, v in got.items() if len(v) == v[0][1]} | rows
    return rows


def parts(output: str) -> list:
    found = glob.glob(glob.escape(output) + ".part*")
    return sorted(p for p in found if re.search(r"\.part\d+of\d+$", p))


def check_settings(output: str, settings: dict) -> bool:
    """Writes OUTPUT.settings (returns True) or refuses other settings."""
    side, now = output + ".settings", json.loads(json.dumps(settings))  # tuples as JSON lists
    wrote = False
    if not os.path.isfile(side):
        with contextlib.suppress(FileExistsError):  # another's came first
            write_lines(side, [json.dumps(now, indent=1)], "x")
            wrote = True
    try:
        with open(side, encoding="utf-8") as f:
            old = json.load(f)
        if not isinstance(old, dict):
            raise ValueError(f"a JSON {type(old).__name__}, not an object")
    except ValueError as e:  # cut short, not JSON, not UTF-8
        raise UsageError(f"{side}: not the settings {now['writer']} writes ({e}); pass another "
                         "--output") from None
    diff = [f"{k} {old.get(k)!r} (now {v!r})" for k, v in now.items() if old.get(k) != v]
    check([f"{output} was written with other settings: {', '.join(diff)}; rerun with those, or "
           "pass another --output"] if diff else [])
    return wrote


def stamp(path: str) -> str:
    """A hash of a model folder's file names, sizes and times; '' for a hub name."""
    if not os.path.isdir(path):
        return ""
    found = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path))
    return hashlib.sha256(repr(found).encode()).hexdigest()[:16]


@contextlib.contextmanager
def resumed(output: str, settings: dict, writer: str, own: tuple = ()):
    """For the block: `own` (default: output) locked, cut to its complete rows, OUTPUT.settings
    checked; a block failing before a line is written leaves no file."""
    own, side = own or (output,), output + ".settings"
    sides = (".settings", *(p[len(output):] + ".lock" for p in own))
    folder = os.path.dirname(output) or "."
    why = ""
    if not output or os.path.isdir(output):
        why = "a folder" if output else "not a file name"
    elif os.path.exists(output) and not os.path.isfile(output):
        why = "not a regular file"
    elif not os.path.isdir(folder):
        why = f"no folder {folder}"
    elif len(os.path.basename(output)) + max(map(len, sides)) > os.pathconf(folder, "PC_NAME_MAX"):
        why = "a name too long for its side files"
    if why:
        raise UsageError(f"--output {output!r}: {why}; pass another --output")
    made = [p for p in own if not os.path.exists(p)]
    with locked(own[0]):
        theirs = [p for p in (output, *own) if os.path.isfile(p) and os.path.getsize(p)]
        check([f"{theirs[0]}: not written by {writer} (no .settings beside it); pass another "
               "--output"] if theirs and not os.path.isfile(side) else [])
        made += [side] if check_settings(output, {"writer": writer, **settings}) else []
        for path in filter(os.path.isfile, own):
            write_lines(path, [line for lines in finished(path, writer=writer).values()
                               for line in lines])
        try:
            yield
        except BaseException:
            if not any(os.path.getsize(p) for p in own if os.path.isfile(p)):
                for path in filter(os.path.isfile, made):
                    os.remove(path)
            raise
