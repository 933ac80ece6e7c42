"""An asyncio event loop on virtual time: it never sleeps, it jumps to the next timer.

`loop.time()` is a virtual clock starting at 0. When no callback is ready, the loop would block
in its selector until the earliest timer is due; here the selector moves the clock forward by
that timeout instead, so `asyncio.sleep(3600)` returns at once with the clock an hour later.
Real I/O still works (the selector is polled without blocking first), but nothing in a
simulation should wait on threads or sockets: the clock would not wait for them.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, advance: Any) -> None:
        super().__init__()
        self._advance = advance

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer left: only real I/O can wake the loop
            return super().select(None)
        self._advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock is virtual (see the module docstring)."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_VirtualSelector(self._advance))

    def _advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)

    def time(self) -> float:
        return self._now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on a fresh `VirtualTimeLoop`. From async code, call it in a
    thread (`await asyncio.to_thread(...)`): one thread runs one event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        main.close()
        raise RuntimeError("a simulation runs its own event loop: from async code use `await asyncio.to_thread(...)`")
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
