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
