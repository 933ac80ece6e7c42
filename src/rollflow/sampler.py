"""Prompts in: procedural tasks or JSONL files, in a seeded, resumable order.

The sampler turns rows into `Prompt` records (chat messages -> token ids through the model's
chat template) and remembers where it is (`state_dict` / `load_state_dict`), so a resumed run
continues with the next prompt, never repeating or skipping one. Every prompt has a stable id:
`<task>-<seed>-<index>` for procedural tasks, the row's `id` or `<file>:<line>` for JSONL.
All JSONL rows are validated when the sampler is built, so a bad row fails the run before any
work starts. The sampler does not score, batch or track what was trained.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from rollflow.config import DataConfig
from rollflow.errors import DataError
from rollflow.records import Message, Prompt
from rollflow.tasks import PROBLEMS

Encode = Callable[[list[Message]], list[int]]
"""Chat messages -> prompt token ids (the model's chat template with a generation prompt)."""


class _Row(msgspec.Struct, frozen=True):
    """A validated JSONL row, before tokenising."""

    id: str
    messages: list[Message]
    answer: str | None
    task: str
    metadata: dict[str, Any]
    source: str = ""
    """Where the row is (`file:line`), for errors found after reading."""


ROLES = ("system", "user", "assistant", "tool")
"""Chat roles a dataset's `messages` may use (what chat templates render)."""


def _fail(path: Path, line: int, what: str) -> DataError:
    return DataError(f"{path}:{line}: {what}")


def _parse_row(path: Path, line: int, text: str) -> _Row:
    try:
        obj = msgspec.json.decode(text)
    except msgspec.DecodeError as err:
        raise _fail(path, line, f"not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise _fail(path, line, f"expected a JSON object, found {type(obj).__name__}")
    prompt, messages = obj.pop("prompt", None), obj.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise _fail(path, line, "expected exactly one of `prompt` (string) or `messages` (list)")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise _fail(path, line, "`prompt` must be a non-empty string")
        parsed = [Message(role="user", content=prompt)]
    else:
        try:
            parsed = msgspec.convert(messages, list[Message])
        except msgspec.ValidationError as err:
            raise _fail(path, line, f"`messages` must be a list of {{role, content}} ({err})") from None
        if not parsed:
            raise _fail(path, line, "`messages` is empty")
        for m in parsed:
            if m.role not in ROLES:
                raise _fail(path, line, f"unknown role {m.role!r} in `messages`; expected one of {', '.join(ROLES)}")
    answer = obj.pop("answer", None)
    if answer is not None and not isinstance(answer, (str, int)):
        raise _fail(path, line, f"`answer` must be a string or integer, found {type(answer).__name__}")
    row_id = obj.pop("id", None)
    if row_id is not None and not isinstance(row_id, (str, int)):
        raise _fail(path, line, f"`id` must be a string or integer, found {type(row_id).__name__}")
    task = obj.pop("task", "jsonl")
    if not isinstance(task, str):
        raise _fail(path, line, "`task` must be a string")
    return _Row(
        id=str(row_id) if row_id is not None else f"{path.name}:{line}",
        messages=parsed,
        answer=None if answer is None else str(answer),
        task=task,
        metadata=obj,
        source=f"{path}:{line}",
    )


def read_jsonl(paths: list[str]) -> list[_Row]:
    """Read and validate every row of every file; errors name file and line."""
    if not paths:
        raise DataError("data.paths: task 'jsonl' needs at least one JSONL file")
    rows: list[_Row] = []
    seen: dict[str, str] = {}
    for name in paths:
        path = Path(name)
        try:
            lines = path.read_bytes().decode("utf-8-sig").splitlines()  # a byte-order mark is dropped
        except OSError as err:
            raise DataError(f"{path}: cannot read dataset file ({err.strerror})") from None
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text ({err.reason})") from None
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            row = _parse_row(path, number, text)
            if row.id in seen:
                raise _fail(path, number, f"duplicate id {row.id!r} (first at {seen[row.id]})")
            seen[row.id] = f"{path}:{number}"
            rows.append(row)
    if not rows:
        raise DataError(f"{', '.join(paths)}: no rows")
    return rows


class Sampler:
    """An endless, seeded stream of prompts that can be checkpointed and resumed."""

    def __init__(self, config: DataConfig, encode: Encode) -> None:
        self._config = config
        self._encode = encode
        self._rows = read_jsonl(config.paths) if config.task == "jsonl" else None
        if config.template == "raw":
            for row in self._rows or []:
                if [m.role for m in row.messages] != ["user"]:
                    raise DataError(
                        f'{row.source}: data.template = "raw" feeds one prompt text; this row\'s messages have '
                        f"roles {[m.role for m in row.messages]} (give `prompt`, or one user message)"
                    )
        self._system = [Message(role="system", content=config.system_prompt)] if config.system_prompt else []
        self.epoch = 0
        self.position = 0
        """Index of the next prompt within the current epoch (procedural tasks: overall)."""

    def _order(self, epoch: int) -> list[int]:
        assert self._rows is not None
        order = list(range(len(self._rows)))
        random.Random(f"{self._config.seed}:{epoch}").shuffle(order)
        return order

    def _make(self, row: _Row, epoch: int) -> Prompt:
        messages = self._system + row.messages
        prompt_id = row.id if epoch == 0 else f"{row.id}@{epoch}"
        return Prompt(
            id=prompt_id,
            token_ids=self._encode(messages),
            messages=messages,
            answer=row.answer,
            task=row.task,
            metadata=row.metadata,
        )

    def next(self) -> Prompt:
        """The next prompt; advances the position."""
        cfg = self._config
        if self._rows is None:
            problem = PROBLEMS[cfg.task](cfg.seed, self.position, cfg.max_operand)
            row = _Row(
                id=f"{cfg.task}-{cfg.seed}-{self.position}",
                messages=[Message(role="user", content=problem.question)],
                answer=problem.answer,
                task=cfg.task,
                metadata=problem.metadata,
            )
        else:
            if self.position >= len(self._rows):
                self.epoch, self.position = self.epoch + 1, 0
            row = self._rows[self._order(self.epoch)[self.position]]
        self.position += 1
        return self._make(row, self.epoch)

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            yield self.next()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
