"""Guest code: users' synchronous callables, run where they cannot stop the run.

Agents, environment classes, tools, reward and rubric functions are other people's code, and such
code blocks (a network call with no timeout, a sandbox that never answers). A sync guest call
runs on `GuestThreads`, a pool of its own, never the event loop's default executor, which
rollflow's own thread work keeps (weight-sync halves, the sampler, checkpoints):

- a call's time limit starts when a thread starts it, so a healthy call queued behind stuck ones
  is never charged for the wait;
- a call past its limit is abandoned: the caller gets `TimeoutError` at once, the thread is left
  to finish (or never) on its own, is never joined (the threads are daemons: not at teardown,
  not at exit), and a new thread takes its place, so `size` calls can still run;
- stuck threads are bounded: once they fill all of `cap` but `size`, the pool's `on_stuck` is
  called once with one line naming the callable and how many of its calls are stuck (the
  controller stops the run with it); once they fill all of `cap`, a new call raises
  `GuestStuckError` with that line at once instead of waiting for a thread that will not come.

One pool serves each event loop (`threads()`); the controller sizes it for its run (`serving`).
The pool does not decide what a timeout means for an episode: callers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rollflow.errors import GuestStuckError, UserCodeExit

DEFAULT_SIZE = 8
"""Guest calls that run at once on a pool nobody sized (a library call outside a run)."""

CAP_PER_SIZE = 4
"""Threads alive at most, stuck ones included, per call that may run at once."""


@dataclass(eq=False)
class _Call:
    """One guest call. `state` moves queued -> running -> done, or queued -> cancelled, or
    running -> abandoned (its caller stopped waiting); only under the pool's lock."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    name: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    started: asyncio.Event = field(default_factory=asyncio.Event)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    state: str = "queued"


class GuestThreads:
    """Runs sync guest callables on daemon threads, each call within its own time limit."""

    def __init__(self, size: int = DEFAULT_SIZE, cap: int | None = None) -> None:
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self.size = size
        """Calls that may run at once."""
        self.cap = cap or CAP_PER_SIZE * size
        """Threads alive at most, stuck ones included."""
        self.on_stuck: Callable[[str], None] | None = None
        """Told once, in one line, when stuck threads leave the pool only `size` below its cap."""
        self._threads = 0  # alive and not stuck
        self._busy = 0  # running a call nobody abandoned
        self._queued = 0
        self._stuck: Counter[str] = Counter()  # abandoned calls still running, by callable
        self._told = False
        self._made = 0

    # ---- what callers use --------------------------------------------------------------------

    async def call(self, func: Callable[..., Any], *args: Any, timeout_s: float | None, name: str) -> Any:
        """`func(*args)` on a guest thread, in this task's context (keyword arguments through
        `functools.partial`); `TimeoutError` when it runs longer than `timeout_s` once started (the
        call is abandoned, not waited for; None: the caller bounds it by cancelling, which abandons
        it too); `name` names it in messages. What it raises is raised here (`sys.exit()` as
        `UserCodeExit`, an ordinary failure)."""
        loop = asyncio.get_running_loop()
        call = _Call(func, args, name, loop, loop.create_future())
        with self._lock:
            if self._threads == 0 and self.stuck >= self.cap:
                raise GuestStuckError(self._stuck_line())
            self._queued += 1
            self._calls.put(call)
            self._grow()
        try:
            await call.started.wait()
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(call.future)
        except BaseException:
            self._leave(call)
            raise

    @property
    def stuck(self) -> int:
        """Abandoned calls whose threads have not returned."""
        return sum(self._stuck.values())

    @contextmanager
    def serving(self, size: int, on_stuck: Callable[[str], None]) -> Iterator[GuestThreads]:
        """Size the pool for a run and route its stuck-thread notice there, for the `with` block."""
        with self._lock:
            self.size, self.cap, self.on_stuck, self._told = size, CAP_PER_SIZE * size, on_stuck, False
        try:
            yield self
        finally:
            with self._lock:
                self.on_stuck = None

    # ---- the threads -------------------------------------------------------------------------

    def _grow(self) -> None:
        """Start a thread when a queued call has none free to take it (under the lock)."""
        free = self._threads - self._busy
        alive = self._threads + self.stuck
        if self._queued > free and self._threads < self.size and alive < self.cap:
            self._threads += 1
            self._made += 1
            threading.Thread(target=self._work, name=f"rollflow-guest-{self._made}", daemon=True).start()

    def _leave(self, call: _Call) -> None:
        """The caller stopped waiting (time limit, cancellation): forget a queued call; abandon a
        running one, whose thread then counts as stuck until it returns."""
        notice = None
        with self._lock:
            if call.state == "done" and not call.future.cancel() and not call.future.cancelled():
                # The thread finished as the caller left: an outcome already set is read here
                # (cancel() marks one still on its way to the loop as nobody's), so a failure
                # nobody waits for is not reported later by the garbage collector.
                call.future.exception()
            if call.state == "queued":
                call.state = "cancelled"
                self._queued -= 1
                call.future.cancel()
            elif call.state == "running":
                call.future.cancel()  # what the thread returns later is nobody's
                call.state = "abandoned"
                self._busy -= 1
                self._threads -= 1
                self._stuck[call.name] += 1
                if self.stuck >= self.cap - self.size and not self._told:
                    self._told = True
                    notice = self._stuck_line()
                self._grow()
        if notice is not None and self.on_stuck is not None:
            self.on_stuck(notice)

    def _stuck_line(self) -> str:
        name, n = self._stuck.most_common(1)[0]
        others = self.stuck - n
        more = f" (and {others} of other callables)" if others else ""
        return (
            f"user code is stuck: {n} calls of {name} did not return after their timeout{more}, and "
            f"{self.stuck} threads are held by calls that never returned (the cap is {self.cap}); the "
            "run stops. Fix the call that hangs (a network call with no timeout, a lock, a sandbox "
            "that never answers)"
        )

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            with self._lock:
                if call.state != "queued":
                    continue  # its caller left while it waited
                call.state = "running"
                self._queued -= 1
                self._busy += 1
            _tell(call.loop, call.started.set)
            try:
                outcome: tuple[Any, BaseException | None] = (call.context.run(call.func, *call.args), None)
            except (SystemExit, KeyboardInterrupt) as err:  # the call's failure, never the process's end
                outcome = (None, UserCodeExit(raised(err)))
            except BaseException as err:
                outcome = (None, err)
            _tell(call.loop, _settle, call.future, outcome)
            with self._lock:
                if call.state == "running":
                    call.state = "done"
                    self._busy -= 1
                    continue
                # An abandoned call came back: the thread serves again if the pool has room.
                self._stuck[call.name] -= 1
                if self._stuck[call.name] <= 0:
                    del self._stuck[call.name]
                if self._threads >= self.size:
                    return
                self._threads += 1


def _tell(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
    if future.done():
        return
    result, error = outcome
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GuestThreads] = weakref.WeakKeyDictionary()


def threads() -> GuestThreads:
    """The running event loop's guest pool (made on first use)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = GuestThreads()
    return pool


async def call(func: Callable[..., Any], *args: Any, timeout_s: float | None, name: str) -> Any:
    """`func(*args)` on the running loop's guest pool (`GuestThreads.call`)."""
    return await threads().call(func, *args, timeout_s=timeout_s, name=name)


def name_of(func: Any) -> str:
    """How messages name a user's callable: `module:qualname` where it has them."""
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if qualname is None:
        qualname = type(func).__qualname__
        module = type(func).__module__
    return f"{module}:{qualname}" if module else str(qualname)


async def contained(awaitable: Awaitable[Any]) -> Any:
    """`awaitable` (a user's coroutine), with a `sys.exit()` inside it raised as `UserCodeExit`:
    the event loop re-raises a `SystemExit` that leaves a task, which would end the process."""
    try:
        return await awaitable
    except (SystemExit, KeyboardInterrupt) as err:
        raise UserCodeExit(raised(err)) from None


def raised(err: BaseException) -> str:
    """What a user's call raised, as reasons say it: `raised KeyError: 'answer'`, or `called
    sys.exit(3)`."""
    if isinstance(err, UserCodeExit):
        return str(err)
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return f"raised {type(err).__name__}: {err}"
