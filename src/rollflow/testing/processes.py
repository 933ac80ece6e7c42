"""vLLM's engine processes as a test or a benchmark finds them: by their command line (`EngineCore`)
and their parent, read from /proc (Linux). For checks that an engine process exists, is killed,
or outlives nothing; nothing in a run uses it."""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_MARK = b"EngineCore"
"""What vLLM's engine-core processes have in their command line (the process title)."""


def _parents() -> dict[int, tuple[int, bytes]]:
    """Every process: its parent's pid and its command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # it exited meanwhile
            continue
        found[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    return found


def engine_processes(parent: int | None = None) -> list[int]:
    """The engine processes whose parent is `parent`; with None, every engine process descending
    from this one (at any depth). A zombie (exited, not yet reaped) has no command line, so it is
    never among them."""
    table = _parents()
    if parent is not None:
        return sorted(pid for pid, (ppid, cmdline) in table.items() if ppid == parent and ENGINE_MARK in cmdline)
    me, found = os.getpid(), []
    for pid, (_, cmdline) in table.items():
        if ENGINE_MARK not in cmdline:
            continue
        up, seen = pid, set()
        while up in table and up not in seen:
            seen.add(up)
            up = table[up][0]
            if up == me:
                found.append(pid)
                break
    return sorted(found)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
