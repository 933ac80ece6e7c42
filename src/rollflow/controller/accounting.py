"""Every prompt accounted for exactly once: trained at a step, or dropped with a reason.

`Accounting` writes the ledger (`ledger.jsonl`) and keeps the counts a run reports: prompts
trained, prompts dropped by reason, and the groups of the step being trained (out of the buffer,
not yet in the ledger). At the end of a run, `settle` drops whatever was started and not
trained, unless a checkpoint holds it (`hold_pending`). It decides nothing about what to train.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollflow.buffer import GroupBuffer
from rollflow.ledger import LedgerEntry
from rollflow.metrics import JsonlSink
from rollflow.records import Group


class Accounting:
    """The ledger and the prompt counts of one run."""

    def __init__(self, ledger: JsonlSink) -> None:
        self.ledger = ledger
        self.trained = 0
        """Prompts trained so far (over every resumed part of the run)."""
        self.dropped: dict[str, int] = {}
        """Prompts dropped, by the reason's first word group (`unscorable`, `run ended`, ...)."""
        self.stepping: list[Group] = []
        """Groups of the step being trained: out of the buffer, not yet in the ledger."""
        self.pending_held = False
        """A checkpoint holds the buffer and the work in flight: they are not dropped at exit."""
        self.abandoned = 0
        """Samples of groups dropped because the run ended (their admission room is given back
        before the final checkpoint, so a resumed run starts with a full window)."""

    def drop(self, prompt_id: str, reason: str) -> None:
        self.ledger.write(LedgerEntry(id=prompt_id, outcome="dropped", reason=reason))
        key = reason.split(":")[0]
        self.dropped[key] = self.dropped.get(key, 0) + 1

    def abandon(self, prompt_id: str, reason: str, samples: int) -> None:
        """Drop a group the run's end left unfinished."""
        self.drop(prompt_id, reason)
        self.abandoned += samples

    def take_abandoned(self) -> int:
        """Samples abandoned since the last call (their admission room is to be given back)."""
        samples, self.abandoned = self.abandoned, 0
        return samples

    def record_step(self, step: int, groups: list[Group], *, skipped: bool) -> None:
        """The step's groups are trained (or all dropped, when a non-finite loss skipped it)."""
        for group in groups:
            if skipped:
                self.drop(group.prompt.id, f"non-finite loss: step {step} was skipped")
                continue
            lengths = [sample.num_tokens for sample in group.samples]
            self.ledger.write(LedgerEntry(id=group.prompt.id, outcome="trained", step=step, tokens=lengths))
        self.trained += 0 if skipped else len(groups)
        self.stepping = []

    def hold_pending(self) -> None:
        """A checkpoint now holds the buffer and every group in flight."""
        self.pending_held = True

    def settle(self, buffer: GroupBuffer, in_flight: Iterable[str], group_size: int) -> None:
        """The run ends: prompts started but not trained are dropped with a reason (unless a
        checkpoint holds them). `in_flight`: prompt ids still generating or being scored."""
        if self.pending_held:
            return
        for group in self.stepping:
            self.abandon(group.prompt.id, "run ended: its step was interrupted", len(group.samples))
        self.stepping = []
        for group in buffer.drain():
            self.abandon(group.prompt.id, "run ended: generated, not trained", len(group.samples))
        for prompt_id in in_flight:
            self.abandon(prompt_id, "run ended: in flight", group_size)
