"""Backpressure in one place: admission control, the bounded queue of groups, staleness rules.

Definitions (the contract, also in the README): the policy version v is the number of optimizer
steps whose weights are loaded in the engine. A token's lag, when consumed by the optimizer step
that will produce version v', is v' − 1 − (token version). With B samples per optimizer step:

- admission: the total number of samples ever started may not exceed (v + max_lag + 1) × B, so
  nothing is generated only to be thrown away for staleness; `max_lag = 0` is synchronous
  on-policy training;
- consumption: a straggler (a long partial rollout) can still outlive the bound; its tokens
  whose lag exceeds `max_lag` are withheld from the loss (`withhold_stale`), while the sample's
  reward stays in its group's baseline.

`Admission` holds no asyncio state beyond one Condition, and `lags` / `withhold_stale` are pure,
so the simulator drives the very same rules. This module does not generate or train.
"""

from __future__ import annotations

import asyncio
from collections import deque

from rollflow.records import Group


class Admission:
    """The capacity rule: started ≤ (version + max_lag + 1) × samples_per_step."""

    def __init__(self, samples_per_step: int, max_lag: int) -> None:
        if samples_per_step <= 0 or max_lag < 0:
            raise ValueError("samples_per_step must be > 0 and max_lag >= 0")
        self.samples_per_step = samples_per_step
        self.max_lag = max_lag
        self.version = 0
        self.started = 0
        self.closed = False
        self._changed = asyncio.Condition()

    def capacity(self, version: int | None = None) -> int:
        """Samples that may have been started in total at `version` (default: the current one)."""
        v = self.version if version is None else version
        return (v + self.max_lag + 1) * self.samples_per_step

    def can_start(self, n: int) -> bool:
        return self.started + n <= self.capacity()

    async def acquire(self, n: int) -> bool:
        """Wait until `n` more samples may start, and count them started. False once closed."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.closed or self.can_start(n))
            if self.closed:
                return False
            self.started += n
            return True

    async def release(self, n: int) -> None:
        """`n` started samples will never be consumed (their group was dropped): they stop
        counting, so dropped work does not use up the room of work that can be trained."""
        async with self._changed:
            self.started -= n
            self._changed.notify_all()

    def forget(self, n: int) -> None:
        """`n` started samples were dropped after admission closed (the run ended): they no
        longer count, so a checkpoint taken now holds only the samples that were trained."""
        if not self.closed:
            raise RuntimeError("Admission.forget is for a closed admission; use release while it is open")
        self.started -= n

    async def advance(self, version: int) -> None:
        """The engine now holds `version`: more samples may start."""
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def close(self) -> None:
        """Wake every waiter with a refusal (the run is ending)."""
        async with self._changed:
            self.closed = True
            self._changed.notify_all()


def lags(versions: list[int], consuming_step: int) -> list[int]:
    """Lag of each token when consumed by optimizer step `consuming_step` (0-based), i.e. the
    step that will produce version consuming_step + 1: lag = consuming_step − token version."""
    return [consuming_step - v for v in versions]


def withhold_stale(
    versions: list[int], loss_mask: list[int], consuming_step: int, max_lag: int
) -> tuple[list[int], int]:
    """The loss mask with tokens whose lag exceeds `max_lag` set to 0, and how many were withheld."""
    mask = list(loss_mask)
    withheld = 0
    for i, lag in enumerate(lags(versions, consuming_step)):
        if lag > max_lag and mask[i]:
            mask[i] = 0
            withheld += 1
    return mask, withheld


class GroupBuffer:
    """Completed groups waiting for the trainer, in completion order."""

    def __init__(self) -> None:
        self._groups: deque[Group] = deque()
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, group: Group) -> None:
        async with self._changed:
            self._groups.append(group)
            self._changed.notify_all()

    async def take(self, n: int) -> list[Group]:
        """Wait for `n` groups and remove them (oldest first)."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._groups) >= n)
            return [self._groups.popleft() for _ in range(n)]

    def snapshot(self) -> list[Group]:
        """The groups waiting, oldest first, left in place (what a checkpoint saves)."""
        return list(self._groups)

    def drain(self) -> list[Group]:
        """Remove and return everything (at shutdown, to account for it)."""
        groups = list(self._groups)
        self._groups.clear()
        return groups
