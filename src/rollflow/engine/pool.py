"""Several engines behind one `Engine`: placement, one weight sync for all, failover.

- **Placement**: a request goes to the engine its group already uses (all G samples of a prompt,
  and every turn of an episode, share the prompt's prefix-cache entries there); a new group goes to
  the engine with the fewest outstanding tokens (prompt + budget of its live requests).
- **Weight sync**: `update_weights_with` runs every engine's own critical section at once, each
  loading the staged weights for itself (within it, `rpc` and `targets` address that engine only),
  so an engine that dies mid-sync fails alone. The new version is the same on every engine, so
  per-token versions mean the same weights wherever a token was made; each engine's section has
  the deadline, and they run side by side.
- **Failover**: an engine that dies is taken out. Its requests end as `preempted` (with the tokens
  the dead engine could still report, and their versions; a remote engine reports none, so its
  request restarts from the sample's earlier prefix) and the rollout resubmits them to the engines
  left. Only when none is left is the death an `EngineDeadError`.

Members are `VLLMEngine`s and `RemoteEngine`s, mixed as configured. This module does not start
servers or decide when to sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from rollflow.engine import EngineOutput, Load, ManagedEngine, PartialMode, Weights, WorkerCall, load_callable, named
from rollflow.errors import EngineDeadError, WeightSyncError
from rollflow.records import SamplingSpec

log = logging.getLogger(__name__)

AFFINITY_ENTRIES = 65536
"""Groups whose engine the pool remembers (the oldest are forgotten first)."""

TAKEN_OUT_CLOSE_S = 10.0
"""How long closing an engine taken out of the pool may take."""


_current: contextvars.ContextVar[Any] = contextvars.ContextVar("rollflow_pool_member", default=None)
"""The member whose weight-update critical section the current task runs."""


def group_key(request_id: str) -> str:
    """The group part of a rollout's request id (`g12/3#1`, `g12/t2/3` -> `g12`)."""
    return request_id.split("/", 1)[0]


class EnginePool:
    """One `Engine` over several."""

    def __init__(self, members: list[ManagedEngine]) -> None:
        if not members:
            raise ValueError("an engine pool needs at least one engine")
        self.members = list(members)
        self.taken_out: list[tuple[Any, str]] = []
        """Engines that died, with why."""
        self._version = 0
        self._owner: dict[str, Any] = {}
        """Live request id -> its engine."""
        self._outstanding: dict[Any, int] = {}
        """Engine -> outstanding tokens of its live requests."""
        self._affinity: OrderedDict[str, Any] = OrderedDict()
        self._lock = asyncio.Lock()

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_live(self) -> int:
        return len(self._owner)

    async def start(self) -> EnginePool:
        await asyncio.gather(*(member.start() for member in self.members))
        return self

    async def aclose(self) -> None:
        for member in self.members:
            with contextlib.suppress(Exception):
                await member.aclose()
        # Those taken out too: a dead server's client still holds its connections (bounded: a
        # server that hangs rather than refuses must not hold up the close).
        for member, _ in self.taken_out:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(TAKEN_OUT_CLOSE_S):
                    await member.aclose()

    def _place(self, request_id: str) -> Any:
        key = group_key(request_id)
        member = self._affinity.get(key)
        if member is None or member not in self.members:
            member = min(self.members, key=lambda m: self._outstanding.get(m, 0))
            self._affinity[key] = member
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        self._affinity.move_to_end(key)
        return member

    def _take_out(self, member: Any, err: BaseException) -> None:
        if member in self.members:
            self.members.remove(member)
            self.taken_out.append((member, str(err)))
            log.error("engine taken out of the pool (%d left): %s", len(self.members), err)
        if not self.members:
            raise EngineDeadError(f"every engine of the pool is gone; the last: {err}")

    async def stream(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, deltas: bool = True
    ) -> AsyncGenerator[EngineOutput, None]:
        if not self.members:
            raise EngineDeadError("every engine of the pool is gone")
        member = self._place(request_id)
        cost = len(prompt_token_ids) + sampling.max_tokens
        self._owner[request_id] = member
        self._outstanding[member] = self._outstanding.get(member, 0) + cost
        yielded = 0
        try:
            async for out in member.stream(request_id, prompt_token_ids, sampling, deltas=deltas):
                yielded += len(out.token_ids)
                yield out
        except EngineDeadError as err:
            self._take_out(member, err)  # raises when it was the last one
            # The rollout resubmits a preempted request from its prefix, to the engines left. It
            # keeps the tokens the dead engine reported, with their versions; an engine that
            # cannot report them (a remote one) loses the request's tokens, never mislabels them.
            lost = err.partial if isinstance(err.partial, EngineOutput) else None
            if lost is not None and lost.versions is not None and len(lost.versions) == len(lost.token_ids):
                rest = slice(yielded, None)
                yield EngineOutput(lost.token_ids[rest], lost.logprobs[rest], "preempted", lost.versions)
            elif yielded == 0:
                yield EngineOutput([], [], "preempted", [])
            else:
                raise  # tokens already passed on cannot be labelled
        finally:
            self._owner.pop(request_id, None)
            self._outstanding[member] -= cost

    def partial(self, request_id: str) -> EngineOutput | None:
        member = self._owner.get(request_id)
        return member.partial(request_id) if member is not None else None

    async def abort(self, request_id: str) -> None:
        member = self._owner.get(request_id)
        if member is not None:
            await member.abort(request_id)

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a worker-extension method on every worker of every engine addressed (`targets`);
        engines that die meanwhile are taken out."""
        members = self.targets()
        outcomes = await asyncio.gather(*(m.rpc(method, *args) for m in members), return_exceptions=True)
        results: list[Any] = []
        for member, outcome in zip(members, outcomes, strict=True):
            if isinstance(outcome, EngineDeadError):
                self._take_out(member, outcome)  # raises when none is left
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results += outcome
        return results

    async def check_health(self) -> None:
        for member in list(self.members):
            try:
                await member.check_health()
            except EngineDeadError as err:
                self._take_out(member, err)

    async def update_weights(
        self, weights: Weights, *, partial: PartialMode = "keep", version: int | None = None
    ) -> int:
        items = named(weights)
        new_version = self._version + 1 if version is None else version
        await self._each(lambda m: m.update_weights(items, partial=partial, version=new_version))
        self._version = new_version
        return new_version

    async def update_weights_with(
        self,
        load: Load,
        *,
        partial: PartialMode = "keep",
        deadline_s: float | None = None,
        version: int | None = None,
    ) -> int:
        """Every engine's critical section at once, each running `load` for itself (inside it,
        `rpc` and `targets` mean that engine only; a `WorkerCall` goes to each engine as it is);
        every engine gets the same new version."""
        async with self._lock:
            new_version = self._version + 1 if version is None else version

            async def load_into(member: Any) -> object:
                token = _current.set(member)
                try:
                    return await load_callable(member, load)()
                finally:
                    _current.reset(token)

            await self._each(
                lambda m: m.update_weights_with(
                    load if isinstance(load, WorkerCall) else (lambda: load_into(m)),
                    partial=partial,
                    deadline_s=deadline_s,
                    version=new_version,
                )
            )
            self._version = new_version
            return new_version

    async def update_adapter(
        self,
        tensors: dict[str, Any],
        adapter_config: dict[str, Any],
        *,
        partial: PartialMode = "keep",
        version: int | None = None,
    ) -> int:
        raise WeightSyncError("an engine pool takes full weights only; LoRA adapters need one in-process engine")

    def engines(self) -> list[ManagedEngine]:
        """The live members (dead ones are taken out)."""
        return list(self.members)

    def targets(self) -> list[ManagedEngine]:
        """The engines a weight load addresses now: the one whose critical section is running,
        or all of them."""
        current = _current.get()
        return [current] if current is not None else list(self.members)

    def weight_transfer_api(self) -> Any:
        raise WeightSyncError("the nccl transport drives one engine; an engine pool uses gloo or checkpoint")

    async def _each(self, call: Callable[[Any], Awaitable[object]]) -> None:
        """`call` on every engine at once; engines that die are taken out, other errors raised."""
        members = list(self.members)

        async def one(member: Any) -> None:
            try:
                await call(member)
            except EngineDeadError as err:
                self._take_out(member, err)  # raises when none is left

        outcomes = await asyncio.gather(*(one(m) for m in members), return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
