"""The ledger: what became of every prompt, one JSON line each, and its audit.

A run appends one `LedgerEntry` per prompt to `ledger.jsonl` (a `metrics.JsonlSink`) when the
prompt's fate is decided: trained at step s, or dropped with a reason. Lines are flushed as they
are written and the file is fsynced before every checkpoint, which records its length; a resumed run cuts
the file back to that length, so work redone after a crash is never counted twice.

`summarize` is the audit behind `python -m rollflow ledger DIR`: how the run ended, prompts
trained, dropped by reason, duplicates and missing prompts (both must be 0). Missing means drawn
by the sampler (per the latest checkpoint) but neither in the ledger nor pending in that
checkpoint. A run that did not finish (stopped, failed, killed, or still running) does not pass
the audit either: its line says which, and how to continue it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec

from rollflow.errors import DataError

LEDGER = "ledger.jsonl"


class LedgerEntry(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One line of ledger.jsonl: what became of one prompt."""

    id: str
    outcome: str
    """`trained` or `dropped`."""
    step: int | None = None
    reason: str | None = None
    tokens: list[int] | None = None
    """Completion lengths of the group's samples (trained prompts)."""


def read_ledger(path: Path) -> list[LedgerEntry]:
    """Every entry of a ledger file; a bad line is an error naming file and line."""
    decoder = msgspec.json.Decoder(LedgerEntry)
    entries = []
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read the ledger ({err.strerror})") from None
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            entry = decoder.decode(line)
        except msgspec.DecodeError as err:
            raise DataError(f"{path}:{number}: not a ledger entry ({err})") from None
        if entry.outcome not in ("trained", "dropped"):
            raise DataError(f"{path}:{number}: outcome must be 'trained' or 'dropped', found {entry.outcome!r}")
        entries.append(entry)
    return entries


def truncate(path: Path, length: int) -> None:
    """Cut a run file back to what a checkpoint recorded (the lines after it are redone)."""
    size = path.stat().st_size if path.exists() else 0
    if size < length:
        raise DataError(
            f"{path}: {size} bytes, shorter than the {length} bytes the checkpoint recorded; "
            "the file was changed or lost after the checkpoint"
        )
    with path.open("r+b") as f:
        f.truncate(length)


class LedgerSummary(msgspec.Struct):
    trained: int
    dropped: dict[str, int]
    """Dropped prompts by reason (the text before the first colon)."""
    duplicates: list[str]
    """Prompt ids with more than one line (must be empty)."""
    missing: list[str] | None
    """Prompt ids drawn but unaccounted for (must be empty); None without a checkpoint."""
    pending: int
    """Prompts saved in flight or buffered in the latest checkpoint (a stopped run resumes them)."""
    run: str = "unknown (no status.json)"
    """How the run ended: `finished`, or what happened instead and how to continue it."""
    finished: bool = True
    """The run completed (False: stopped, failed, killed or still running)."""

    @property
    def ok(self) -> bool:
        return self.finished and not self.duplicates and not self.missing

    def format(self) -> str:
        dropped = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.dropped.items())) or "none"
        missing = "unknown (no checkpoint)" if self.missing is None else str(len(self.missing))
        lines = [
            f"run: {self.run}",
            f"trained: {self.trained}",
            f"dropped: {sum(self.dropped.values())} ({dropped})",
            f"pending in the latest checkpoint: {self.pending}",
            f"duplicates: {len(self.duplicates)}"
            + (f" ({', '.join(self.duplicates[:10])})" if self.duplicates else ""),
            f"missing: {missing}" + (f" ({', '.join(self.missing[:10])})" if self.missing else ""),
        ]
        return "\n".join(lines)


def summarize(run_dir: Path) -> LedgerSummary:
    """Audit a run directory's ledger against its latest checkpoint."""
    from rollflow.checkpoint import latest_checkpoint, read_state

    path = run_dir / LEDGER
    if not path.is_file():
        raise DataError(f"{run_dir}: no {LEDGER} (not a training run's output directory?)")
    entries = read_ledger(path)
    counts = Counter(e.id for e in entries)
    dropped = Counter((e.reason or "no reason").split(":")[0] for e in entries if e.outcome == "dropped")
    checkpoint = latest_checkpoint(run_dir)
    missing = None
    pending = 0
    if checkpoint is not None:
        state = read_state(checkpoint)
        pending_ids = {g.prompt.id for g in state.buffer} | {g.prompt.id for g in state.in_flight}
        pending = len(pending_ids)
        missing = [i for i in state.consumed if i not in counts and i not in pending_ids]
    run, finished = _how_it_ended(run_dir, checkpoint)
    return LedgerSummary(
        trained=sum(1 for e in entries if e.outcome == "trained"),
        dropped=dict(dropped),
        duplicates=sorted(i for i, n in counts.items() if n > 1),
        missing=missing,
        pending=pending,
        run=run,
        finished=finished,
    )


def _how_it_ended(run_dir: Path, checkpoint: Path | None) -> tuple[str, bool]:
    """(what to say about the run's end, whether it finished)."""
    from rollflow.rundir import lock_holder, read_status

    status = read_status(run_dir)
    if status is None:
        return "unknown (no status.json: written by rollflow since the run lock)", True
    resume = (
        f"`--resume` continues it from {checkpoint.name}"
        if checkpoint
        else "no checkpoint: rerun the same command (with or without --resume) to start over; its logs so far are "
        "kept in attempts/"
    )
    if status.state == "finished":
        return f"finished ({status.steps} steps)", True
    holder = lock_holder(run_dir)
    if status.state == "running" and holder is not None:
        return f"still running (process {holder}); audit it once it ends", False
    if status.state == "running":
        return f"crashed: process {status.pid} ended without a word (killed?); {resume}", False
    if status.state == "stopped":
        return f"stopped after {status.steps} steps; {resume}", False
    return f"failed after {status.steps} steps: {status.error}; {resume}", False
