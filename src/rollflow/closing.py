"""Closing things each under its own bound.

A teardown closes many parts (a run's engine, trainer ranks, scorers and source of episodes; an
episode's toolsets); one that raises or hangs must not keep the others open. `close_within`
closes one, names it in the log when it fails or hangs, and returns either way. It decides
nothing about the order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0
"""Each part of a run's teardown (the engine, the trainer ranks, a scorer, ...) gets this long
to close; past it, it is named and left behind, and the next part closes."""


async def close_within(name: str, close: Callable[[], Awaitable[None]], timeout_s: float) -> None:
    """`close()` within `timeout_s`; a failure or a hang is logged naming `name`, never raised:
    the rest of a teardown still runs."""
    try:
        async with asyncio.timeout(timeout_s):
            await close()
    except TimeoutError:
        log.warning("closing %s: it did not close within %g s; left behind", name, timeout_s)
    except Exception as err:
        log.warning("closing %s: it raised %s: %s", name, type(err).__name__, err)
