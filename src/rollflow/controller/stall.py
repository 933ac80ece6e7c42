"""The stop rule for a run that cannot learn.

A group is *dropped as failed* when none of its samples could be scored, when the engine refused
it, or when its prompt cannot fit the engine's context. One such group is ordinary (a flaky
reward server, one odd prompt); many in a row with nothing trained in between mean a broken
reward function, server, environment or dataset. `StallWatch` counts them and, at
`run.max_dropped_in_a_row` in a row, or once `run.stall_timeout_s` have passed without progress
while groups keep failing, asks the run to stop with a message naming the top reasons. Groups
that reach the buffer reset the count. Groups filtered by dynamic sampling are not failures,
but a run that only filters (a policy that has solved every prompt, or fails them all) takes no
step, so the time limit ends it too. Progress, which restarts the time limit's clock, is a step,
a group reaching the buffer, or the end of work that is not generation (an evaluation, a
checkpoint): a slow step or evaluation followed by one ordinary filtered group is not a stall.
It decides nothing else; the controller stops the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rollflow.errors import TrainingError

TOP_REASONS = 3
REASON_CHARS = 160


class StallWatch:
    """Counts failed groups since the last trainable one; calls `on_stall` once when the rule fires."""

    def __init__(
        self,
        max_in_a_row: int,
        stall_timeout_s: float,
        *,
        clock: Callable[[], float],
        on_stall: Callable[[str], None],
    ) -> None:
        self.max_in_a_row = max_in_a_row
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.on_stall = on_stall
        self.in_a_row = 0
        """Groups dropped as failed since the last group that reached the buffer."""
        self.reasons: Counter[str] = Counter()
        """Why, since the last trained step (or the start)."""
        self.since = clock()
        """When the run last made progress (a step, a buffered group, the end of an evaluation or
        checkpoint), or started."""
        self.message: str | None = None
        """Set once the rule has fired: why the run cannot learn."""

    def failed(self, reason: str) -> None:
        """A group was dropped as failed."""
        self.in_a_row += 1
        self.reasons[_short(reason)] += 1
        if self.message is None and self.in_a_row >= self.max_in_a_row:
            self._fire(f"{self.in_a_row} groups in a row were dropped with nothing to train")
        self._check_time()

    def filtered(self, reason: str) -> None:
        """A group was dropped as teaching nothing (dynamic sampling). Not a failure: early on most
        groups of a hard task are, so it does not count toward `max_in_a_row`. But a run whose
        every group is filtered takes no step, so the time limit applies."""
        self.reasons[_short(reason)] += 1
        self._check_time()

    def _check_time(self) -> None:
        idle = self.clock() - self.since
        if self.message is None and self.stall_timeout_s and idle >= self.stall_timeout_s:
            self._fire(f"no step for {idle:.0f} s (run.stall_timeout_s) while groups kept being dropped")

    def buffered(self) -> None:
        """A group reached the buffer: it will be trained."""
        self.in_a_row = 0
        self.restart_clock()

    def stepped(self) -> None:
        """A step was taken."""
        self.restart_clock()
        self.reasons.clear()

    def restart_clock(self) -> None:
        """The run did something other than generate (an evaluation, a checkpoint) and is back:
        the time limit counts from now."""
        self.since = self.clock()

    def give_up(self, message: str) -> None:
        """Stop the run with `message` as its error (user code stuck past every thread the run
        may hold: nothing more can be played)."""
        if self.message is None:
            self.message = message
            self.on_stall(message)

    def raise_if_fired(self, saved: Path | None) -> None:
        """The run's error once the rule has fired (`saved`: the checkpoint written since)."""
        if self.message is not None:
            where = f"; the run so far is in {saved} (--resume continues it)" if saved else ""
            raise TrainingError(self.message + where)

    def _fire(self, what: str) -> None:
        top = "; ".join(f"{reason} ×{n}" for reason, n in self.reasons.most_common(TOP_REASONS))
        self.message = (
            f"the run cannot learn: {what}. Top reasons: {top}. Check the reward functions or reward server, "
            "the environment and the data these name (run.max_dropped_in_a_row and run.stall_timeout_s set "
            "when this stops a run)"
        )
        self.on_stall(self.message)


def _short(reason: str) -> str:
    return reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"
