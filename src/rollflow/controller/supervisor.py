"""The engine's keeper: which engine serves now, a health watch, and restarts after a death.

Every call the controller makes on the engine goes through `Supervisor.guard` (one attempt: a
dead engine is replaced and the call is not repeated, because the replacement already holds the
trainer's current weights) or `Supervisor.persist` (repeated on the replacement until it
succeeds: a rollout continuing from the tokens it kept). Whoever notices a death first (a
request, a weight load, the health watch) restarts the engine; the others wait on the lock and
find it replaced. The new engine is brought to the trainer's weights by `prepare` before it
serves, labelled with the number of steps they carry, so every token keeps an exact version.
It does not decide when weights move (`rollflow.controller.weights` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rollflow.engine import ManagedEngine
from rollflow.errors import EngineDeadError
from rollflow.trace import Trace

log = logging.getLogger(__name__)

T = TypeVar("T")
EngineCall = Callable[[ManagedEngine], Awaitable[T]]


class Supervisor:
    """Owns the engine in use and its replacement."""

    def __init__(
        self,
        engine: ManagedEngine,
        factory: Callable[[], ManagedEngine] | None,
        *,
        prepare: Callable[[ManagedEngine], Awaitable[int]],
        max_restarts: int,
        health_check_s: float,
        trace: Trace,
        clock: Callable[[], float],
    ) -> None:
        self.engine = engine
        """The engine serving now."""
        self.factory = factory
        """Builds a replacement (None: a dead engine ends the run)."""
        self.prepare = prepare
        """Gives a fresh engine the trainer's current weights; returns their version."""
        self.max_restarts = max_restarts
        self.health_check_s = health_check_s
        self.trace = trace
        self.clock = clock
        self.restarts = 0
        self._lock = asyncio.Lock()

    async def guard(self, call: EngineCall[T]) -> T | None:
        """`call(engine)` once; if the engine dies meanwhile, replace it and return None."""
        engine = self.engine
        try:
            return await call(engine)
        except EngineDeadError as err:
            await self.recover(engine, err)
            return None

    async def persist(self, call: EngineCall[T]) -> T:
        """`call(engine)` until it succeeds, on a replacement after each death."""
        while True:
            engine = self.engine
            try:
                return await call(engine)
            except EngineDeadError as err:
                await self.recover(engine, err)

    async def watch(self) -> None:
        """Ask the engine now and then whether it lives (requests notice a death at once; this
        covers the moments when none is streaming)."""
        while True:
            await asyncio.sleep(self.health_check_s)
            await self.guard(lambda engine: engine.check_health())

    async def recover(self, dead: ManagedEngine, err: EngineDeadError) -> None:
        """Replace `dead` unless that is done already; returns once a new engine serves the
        trainer's current weights. Raises `EngineDeadError` past `engine.max_restarts`."""
        async with self._lock:
            if self.engine is not dead:
                return
            limit = self.max_restarts
            if self.factory is None or self.restarts >= limit:
                raise EngineDeadError(f"{err}; not restarted ({self.restarts} of engine.max_restarts = {limit})")
            self.restarts += 1
            log.error("%s; restarting the engine (%d of %d)", err, self.restarts, limit)
            began = self.clock()
            with contextlib.suppress(Exception):
                await dead.aclose()
            engine = self.factory()
            try:
                await engine.start()
                version = await self.prepare(engine)
            except BaseException:
                with contextlib.suppress(Exception):  # the replacement failed: it must not outlive the run
                    await engine.aclose()
                raise
            self.engine = engine
            self.trace.span("engine restart", "engine update", began, self.clock(), version=version)
            log.error("engine restarted in %.1f s, serving version %d", self.clock() - began, version)

    async def aclose(self) -> None:
        await self.engine.aclose()
