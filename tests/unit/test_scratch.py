"""Scratch folders go with their process: at exit on every path, and after a SIGKILL at the next
process's first folder of the same kind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rollflow.scratch import remove_orphans, scratch_dir

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from rollflow.scratch import scratch_dir

    folder = scratch_dir("test", parent=sys.argv[1])
    (folder / "weights.bin").write_bytes(b"x" * 1000)
    print(folder, flush=True)
    how = sys.argv[2]
    if how == "raise":
        raise RuntimeError("the run failed")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "interrupt":
        raise KeyboardInterrupt
    """
)


@pytest.mark.parametrize("how", ["return", "raise", "interrupt", "sigkill"])
def test_a_scratch_folder_does_not_outlive_its_process(tmp_path, how):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), how], capture_output=True, text=True,
                          timeout=60, check=False)
    folder = tmp_path / done.stdout.strip().rsplit("/", 1)[-1]
    assert folder.name.startswith("rollflow-test-"), done.stderr
    if how == "sigkill":  # nothing runs in a killed process: the next one removes it
        assert folder.exists()
        mine = scratch_dir("test", parent=tmp_path)
        assert not folder.exists() and mine.exists()
    else:
        assert not folder.exists(), done.stderr


def test_folders_of_live_processes_and_of_other_kinds_are_left_alone(tmp_path):
    live = scratch_dir("test", parent=tmp_path)  # this process is alive
    other = tmp_path / "rollflow-ipc-1-abc"  # another kind
    other.mkdir()
    unrelated = tmp_path / "rollflow-test-notapid-x"
    unrelated.mkdir()
    assert remove_orphans("test", tmp_path) == []
    assert live.exists() and other.exists() and unrelated.exists()
