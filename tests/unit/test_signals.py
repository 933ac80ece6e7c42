"""Ctrl-C bounds a run's end: the second signal ends the process within the grace time even
while the event loop is blocked (user code, a huge allocation), where a handler run by the loop
never runs."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    from rollflow.cli.train import stop_on_signals

    async def main(block):
        loop = asyncio.get_running_loop()
        stop_on_signals(loop, lambda: print("stop asked", flush=True), asyncio.current_task().cancel, grace_s=2.0)
        print("ready", flush=True)
        if block:
            time.sleep(120)  # the event loop never runs again
        else:
            await asyncio.sleep(120)

    try:
        asyncio.run(main(sys.argv[1] == "block"))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("cancelled", flush=True)
        sys.exit(3)
    """
)


def _interrupt_twice(mode: str) -> tuple[int, str, str, float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{mode}: still running 30 s after the second SIGINT")
    return proc.returncode, out, err, time.monotonic() - began


def test_a_second_sigint_ends_a_process_whose_event_loop_is_blocked():
    code, _, err, seconds = _interrupt_twice("block")
    assert code == 130
    assert "did not stop within 2 s" in err
    assert seconds < 15  # 2 s of grace, with room for a slow machine


def test_with_a_free_event_loop_the_first_signal_asks_to_stop_and_the_second_cancels():
    code, out, err, seconds = _interrupt_twice("free")
    assert "stop asked" in out and "cancelled" in out
    assert code == 3 and seconds < 2  # cancelled, not cut off by the grace timer
    assert "stopping after the current step" in err and "stopping now" in err


BLOCKED = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from rollflow.cli.train import stop_on_signals
    from rollflow.rundir import OwnedRun

    async def main(out):
        loop = asyncio.get_running_loop()
        owned = OwnedRun(Path(out))
        owned.record("running")
        stop_on_signals(loop, lambda: print("stop asked", flush=True), asyncio.current_task().cancel, grace_s=2.0,
                        blocked_s=2.0)
        print("ready", flush=True)
        time.sleep(120)  # a user's function blocks the event loop: the stop request is never taken

    asyncio.run(main(sys.argv[1]))
    """
)


def _terminate_once(script: str, run_dir) -> tuple[int, str, str, float]:
    """Run `script` (it prints "ready" once its handlers are in place), send one SIGTERM; its
    exit status, output, errors and the seconds from the signal to its end."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("still running 30 s after one SIGTERM")
    return proc.returncode, out, err, time.monotonic() - began


def test_a_first_signal_the_blocked_event_loop_never_takes_ends_the_process_and_says_so(tmp_path):
    """One SIGTERM is enough: when the loop does not take the stop request within its bound, the
    process exits (130) and status.json says why, instead of ignoring the signal and staying
    'running'."""
    import json

    code, out, err, seconds = _terminate_once(BLOCKED, tmp_path)
    assert code == 130 and seconds < 15
    assert "stop asked" not in out
    assert "the event loop did not take the stop request within 2 s" in err
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed" and "did not take the stop request" in status["error"]


STUCK = textwrap.dedent(
    """
    import asyncio, sys, threading
    from pathlib import Path
    from rollflow.cli.train import stop_on_signals
    from rollflow.rundir import OwnedRun

    async def main(out):
        loop = asyncio.get_running_loop()
        owned = OwnedRun(Path(out))
        owned.record("running")
        stop_on_signals(loop, lambda: print("stop asked", flush=True), asyncio.current_task().cancel,
                        grace_s=2.0, stop_s=3.0)
        # The step never ends: a non-daemon thread that never returns (as a default-executor
        # thread holding a user's hung call), and a loop that waits for it without a bound.
        stuck = threading.Thread(target=threading.Event().wait)
        stuck.start()
        print("ready", flush=True)
        try:
            await loop.run_in_executor(None, stuck.join)
        except asyncio.CancelledError:
            owned.record("stopped", 0, "cancelled")
            raise

    asyncio.run(main(sys.argv[1]))
    """
)


def test_one_sigterm_ends_a_run_whose_step_never_ends_within_its_bound(tmp_path):
    """The event loop takes the stop request, but the step it waits for never ends (stuck
    threads): one SIGTERM still ends the process, the run cancelled after `stop_s` and cut off
    `grace_s` later, with status.json saying why."""
    import json

    code, out, err, seconds = _terminate_once(STUCK, tmp_path)
    assert seconds < 15
    assert code == 130, (out, err)
    assert "stop asked" in out
    assert "did not stop within 3 s of SIGTERM; stopping now" in err
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] in ("stopped", "failed") and status["error"], status
