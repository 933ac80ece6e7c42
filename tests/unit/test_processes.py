"""Finding vLLM's engine processes (by their `EngineCore` title and their parent) for tests that
check one exists or is gone: children, descendants, and exited processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rollflow.testing import alive, engine_processes


def test_engine_processes_are_found_by_parent_and_as_descendants():
    # A stand-in engine: a child whose command line says EngineCore, with a grandchild that does too.
    grandchild = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', 'EngineCore']); time.sleep(30)"
    )
    # Engines this process already has (a session's shared vLLM engine) are not the test's.
    before, mine_before = set(engine_processes()), set(engine_processes(os.getpid()))
    child = subprocess.Popen([sys.executable, "-c", grandchild, "EngineCore"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while len(set(engine_processes()) - before) < 2:
            assert time.monotonic() < deadline, "the stand-in engines did not start"
            time.sleep(0.05)
        assert set(engine_processes(os.getpid())) - mine_before == {child.pid}  # the child, not the grandchild
        descendants = set(engine_processes()) - before
        assert child.pid in descendants and other.pid not in descendants and len(descendants) == 2
        (grand,) = set(descendants) - {child.pid}
        assert engine_processes(child.pid) == [grand] and alive(grand)
        # Killed and not yet reaped, the child is a zombie: neither running nor an engine any more.
        child.kill()
        while alive(child.pid):
            assert time.monotonic() < deadline + 10, "the killed stand-in did not exit"
            time.sleep(0.05)
        assert child.pid not in engine_processes() and engine_processes(child.pid) == []
    finally:
        for proc in (child, other):
            proc.kill()
            proc.wait()
    assert not alive(child.pid)
    os.kill(grand, 9)
