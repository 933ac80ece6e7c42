"""The guest pool (`rollflow.guest`): users' sync calls that hang cost their own call, never a
healthy call queued behind them, never a thread rollflow needs, never the process's exit."""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rollflow.errors import GuestStuckError, UserCodeExit
from rollflow.guest import GuestThreads, name_of


@pytest.fixture
def gate():
    """An event the test's blocking calls wait on; set at teardown so their threads end."""
    event = threading.Event()
    yield event
    event.set()


async def test_a_call_runs_on_a_thread_of_its_own_in_the_callers_context():
    pool = GuestThreads(size=2)
    var = contextvars.ContextVar("var", default="unset")
    var.set("caller's")
    loop_thread = threading.get_ident()
    seen = await pool.call(lambda: (threading.get_ident(), threading.current_thread().name, var.get()),
                           timeout_s=5, name="probe")
    assert seen[0] != loop_thread and seen[1].startswith("rollflow-guest-") and seen[2] == "caller's"


async def test_what_a_call_raises_is_raised_to_its_caller_sys_exit_included():
    pool = GuestThreads(size=1)

    def broken():
        raise KeyError("answer")

    with pytest.raises(KeyError, match="answer"):
        await pool.call(broken, timeout_s=5, name="broken")
    with pytest.raises(UserCodeExit, match=r"^called sys.exit\(3\)$"):  # the call's failure, not the process's end
        await pool.call(sys.exit, 3, timeout_s=5, name="exits")
    assert await pool.call(lambda: 7, timeout_s=5, name="after") == 7  # the thread still serves


async def test_a_healthy_call_queued_behind_a_stuck_one_is_not_charged_for_the_wait(gate):
    """One thread, held by a call that never returns: the call queued behind it gets a thread of
    its own once the stuck one is abandoned, and its time limit starts then."""
    pool = GuestThreads(size=1)
    stuck = asyncio.ensure_future(pool.call(gate.wait, timeout_s=0.5, name="hangs"))
    await asyncio.sleep(0.05)  # the stuck call holds the one thread
    began = time.monotonic()
    result = await pool.call(lambda: time.sleep(0.2) or "done", timeout_s=0.5, name="healthy")
    assert result == "done" and time.monotonic() - began >= 0.5  # it waited, uncharged
    with pytest.raises(TimeoutError):
        await stuck
    assert pool.stuck == 1


async def test_an_abandoned_thread_that_returns_serves_again_and_the_pool_keeps_its_size(gate):
    pool = GuestThreads(size=1)
    release = threading.Event()
    with pytest.raises(TimeoutError):
        await pool.call(release.wait, timeout_s=0.2, name="slow")
    assert pool.stuck == 1
    release.set()
    for _ in range(100):
        if pool.stuck == 0:
            break
        await asyncio.sleep(0.02)
    assert pool.stuck == 0
    assert await pool.call(lambda: 1, timeout_s=5, name="after") == 1
    assert sum(t.name.startswith("rollflow-guest-") and t.is_alive() for t in threading.enumerate()) >= 1


async def test_stuck_threads_at_the_cap_are_reported_once_then_new_calls_are_refused_naming_the_callable(gate):
    def hangs():
        gate.wait()

    told: list[str] = []
    pool = GuestThreads()
    with pool.serving(size=1, on_stuck=told.append):
        for n in range(3):
            with pytest.raises(TimeoutError):
                await pool.call(hangs, timeout_s=0.1, name=name_of(hangs))
            assert len(told) == (1 if n == 2 else 0)  # 3 stuck: only `size` left below the cap of 4
        with pytest.raises(TimeoutError):
            await pool.call(hangs, timeout_s=0.1, name=name_of(hangs))
        with pytest.raises(GuestStuckError) as refused:
            await pool.call(lambda: 1, timeout_s=5, name="healthy")
    assert len(told) == 1
    line = told[0]
    assert f"3 calls of {__name__}:" in line and "hangs" in line and "the cap is 4" in line
    assert "4 calls of" in str(refused.value)


async def test_a_caller_cancelled_while_queued_never_runs(gate):
    pool = GuestThreads(size=1)
    ran = threading.Event()
    first = asyncio.ensure_future(pool.call(gate.wait, timeout_s=5, name="holds"))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(pool.call(ran.set, timeout_s=5, name="queued"))
    await asyncio.sleep(0.1)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    gate.set()
    assert await first is True
    await asyncio.sleep(0.1)
    assert not ran.is_set() and queued.cancelled()


def test_a_process_whose_guest_call_never_returns_exits_without_waiting_for_it():
    """The default executor's threads are joined at exit, so a hung call on them holds the
    process forever; a guest thread is not waited for."""
    script = textwrap.dedent(
        """
        import asyncio, time
        from rollflow.guest import call

        async def main():
            try:
                await call(time.sleep, 3600, timeout_s=0.2, name="sleeps")
            except TimeoutError:
                print("abandoned", flush=True)

        asyncio.run(main())
        """
    )
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "abandoned" and time.monotonic() - began < 30


async def test_a_call_that_fails_as_its_caller_is_cancelled_leaves_no_unread_exception():
    """The window between a thread's end and its outcome reaching the loop: the caller is
    cancelled, the call fails, the thread is done before the loop runs again. Nobody waits for
    that failure any more, and it must not surface later as asyncio's "exception was never
    retrieved" from the garbage collector (inside whatever runs then)."""
    import gc

    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    pool = GuestThreads(size=1)
    go = threading.Event()

    def fails():
        go.wait(10)
        raise RuntimeError("late")

    task = asyncio.create_task(pool.call(fails, timeout_s=None, name="fails"))
    while pool._busy == 0:  # the call has started and its caller waits for the outcome
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    # One stretch with the loop held: cancel, let the call fail, wait until its thread is done.
    task.cancel()
    go.set()
    deadline = time.monotonic() + 10
    while pool._busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._busy == 0
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)  # the outcome reaches the loop
    assert await pool.call(lambda: 1, timeout_s=5, name="next") == 1  # the thread lets the old call go
    del task
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert not [m for m in reported if "never retrieved" in m], reported
