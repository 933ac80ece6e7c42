"""The run directory's owner and how its run ended.

`RunLock` is held by the live run (an exclusive lock on `run.lock`, released by the OS when the
process ends, so a SIGKILL leaves nothing to clean up): a second run on the directory is refused
at once. `status.json` (`RunStatus`) says whether the run is running, finished, stopped or
failed; `running` with no live holder of the lock means it was killed. `rollflow ledger` reads
both. `new_run_dir` makes a fresh directory for a new run. This module writes nothing else.
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import os
import time
from pathlib import Path

import msgspec

from rollflow.errors import UserInputError

LOCK = "run.lock"
STATUS = "status.json"


class RunLock:
    """The output directory's owner: an exclusive lock on `run.lock`, held while the run lives and
    released by the OS when its process ends (a SIGKILL leaves nothing to clean up by hand). A
    second run on the directory, new or resumed, is refused at once, naming the process."""

    def __init__(self, out: Path) -> None:
        if out.exists() and not out.is_dir():
            raise UserInputError(f"{out}: is a file, not a directory; choose a directory for --output-dir")
        try:
            out.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise UserInputError(
                f"{out}: cannot write the run here ({err.strerror}); choose another --output-dir"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise UserInputError(
                f"{out}: another rollflow run is using this directory (process {holder}); wait for it to end, "
                "or choose another --output-dir"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = -1


def lock_holder(out: Path) -> str | None:
    """The process holding `out`'s run lock (a live run), or None."""
    try:
        fd = os.open(out / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # a shared lock taken here goes with the descriptor
    return None


def new_run_dir(name: str, root: str | Path = "runs") -> Path:
    """A new output directory for a run called `name`, made now: `root/name-YYYYmmdd-HHMMSS`
    (with `-2`, `-3`, ... when that is taken), so a script run again never meets its last run."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = Path(root) / (f"{name}-{stamp}" if n == 1 else f"{name}-{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


class RunStatus(msgspec.Struct, omit_defaults=True):
    """How the run in a directory ended (`status.json`), so an audit can tell a finished run
    from one that stopped, failed or was killed (`running` with no live process)."""

    state: str
    """`running`, `finished`, `stopped` (a graceful stop; `--resume` continues) or `failed`."""
    pid: int = 0
    steps: int = 0
    """Steps done when the state was written."""
    error: str = ""


def write_status(out: Path, status: RunStatus) -> None:
    """Replace `status.json` atomically."""
    tmp = out / f".{STATUS}.tmp"
    tmp.write_bytes(msgspec.json.encode(status))
    os.replace(tmp, out / STATUS)


def read_status(out: Path) -> RunStatus | None:
    try:
        return msgspec.json.decode((out / STATUS).read_bytes(), type=RunStatus)
    except (OSError, msgspec.DecodeError):
        return None


_exit_reason = "the process exited before the run ended"


def exiting(reason: str) -> None:
    """The process is about to exit at once for `reason` (a signal's bound passed): a run still
    recorded as running records it as its failure."""
    global _exit_reason
    _exit_reason = f"the process exited: {reason}"


class OwnedRun:
    """A run's hold on its directory: the lock, and `status.json` from start to end (a process
    that exits through its exit hooks while the run is `running` records `failed` with why)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._lock = RunLock(out)
        self._state = ""
        self._steps = 0
        atexit.register(self._on_exit)

    def record(self, state: str, steps: int = 0, error: str = "") -> None:
        self._state, self._steps = state, steps
        write_status(self.out, RunStatus(state, pid=os.getpid(), steps=steps, error=error[:1000]))

    def _on_exit(self) -> None:
        if self._state == "running":
            self.record("failed", self._steps, _exit_reason)

    def release(self) -> None:
        atexit.unregister(self._on_exit)
        self._lock.release()
