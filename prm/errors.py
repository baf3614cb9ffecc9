"""The errors that end a command, each with its exit status (see exit_status)."""
import contextlib
import os
import sys


class PRMError(Exception):
    code = 1


class UsageError(PRMError, ValueError):
    """Bad settings, flags or input data."""
    code = 2


class WriteFailed(PRMError):
    """A failed write (full disk, read-only folder); cause: the reason alone."""

    def __init__(self, message: str, cause: str = None):
        super().__init__(message)
        self.cause = cause or message


class Diverged(PRMError, ArithmeticError):  # a non-finite loss or gradient norm
    code = 3


class Stopped(PRMError):
    """SIGTERM/SIGINT ended the run."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum

    def __reduce__(self):  # runtime.decided_by_main pickles errors
        return Stopped, (str(self), self.code - 128)


def check(problems: list):
    """Raises UsageError with every problem on one line."""
    if problems:
        raise UsageError("; ".join(problems))


def overwrites(written: list, read: list, new: bool = False) -> list:
    """For check(): the first (flag, path) written that is, holds or lies in one read."""
    real = os.path.realpath
    return [f"{wf} {w} would overwrite {rf} {r}, which it reads: choose another path"
            for wf, w in written for rf, r in read
            if w and r and (new or os.path.exists(w)) and os.path.exists(r)
            and os.path.commonpath([real(w), real(r)]) in (real(w), real(r))][:1]


@contextlib.contextmanager
def exit_status():
    """For entry points: a PRMError prints 'error: <message>' and exits with its code."""
    try:
        yield
    except PRMError as e:
        print(e if isinstance(e, Stopped) else f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.code)
