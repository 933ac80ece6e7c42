"""One started engine lent to several runs in turn (tests that would otherwise each start one).

`lend(engine, weights)` puts the engine back on `weights` labelled version 0, as a new engine
would be, and returns a `LentEngine`: the engine itself to the run, except that the run's
`start` and `aclose` do nothing, since the lender started it and closes it. A run must not be
lent an engine another run is using.
"""

from __future__ import annotations

from typing import Any


class LentEngine:
    """A started engine as one run sees it; every other attribute is the engine's own."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    async def start(self) -> LentEngine:
        return self

    async def aclose(self) -> None:
        """The lender closes the engine."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


async def lend(engine: Any, weights: Any) -> LentEngine:
    """The engine, on `weights` (a state dict, the run's initial model) at version 0, for one run."""
    await engine.update_weights(weights, version=0)
    return LentEngine(engine)
