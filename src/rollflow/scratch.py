"""Scratch folders of a process (IPC sockets, weight files, LoRA adapters) that never outlive it.

A folder is named `rollflow-<kind>-<pid>-<random>`. It is removed when the process exits (an
`atexit` function: a normal end, an error, Ctrl-C, the bounded exit after a second Ctrl-C); a
process killed outright (SIGKILL, the machine's OOM killer) runs nothing, so the next rollflow
process that makes a folder of the same kind removes those whose process is gone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

IN_MEMORY = Path("/dev/shm")
"""Where `in_memory=True` folders go when the machine has it (files there never touch a disk)."""


def scratch_dir(kind: str, *, in_memory: bool = False, parent: str | Path | None = None) -> Path:
    """A new folder for this process's `kind` of files, removed when the process exits."""
    if parent is None:
        parent = IN_MEMORY if in_memory and IN_MEMORY.is_dir() else Path(tempfile.gettempdir())
    remove_orphans(kind, parent)
    path = tempfile.mkdtemp(prefix=f"rollflow-{kind}-{os.getpid()}-", dir=parent)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return Path(path)


def remove_orphans(kind: str, parent: str | Path) -> list[Path]:
    """Remove this user's `kind` folders in `parent` whose process no longer runs; returns them."""
    removed = []
    for folder in Path(parent).glob(f"rollflow-{kind}-*-*"):
        pid = folder.name[len(f"rollflow-{kind}-") :].split("-", 1)[0]
        try:
            mine = folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if pid.isdigit() and mine and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
