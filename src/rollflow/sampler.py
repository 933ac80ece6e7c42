"""Prompts in: procedural tasks or dataset files, in a seeded, resumable order.

The sampler turns rows (`rollflow.data_files`: JSONL, Parquet, CSV, `datasets` folders) into
`Prompt` records (messages -> token ids through the model's chat template, or the raw text) and
remembers where it is (`state_dict` / `load_state_dict`), so a resumed run continues with the
next prompt, never repeating or skipping one. Every prompt has a stable id:
`<task>-<seed>-<index>` for procedural tasks, the row's `id` or `<file>:<line or row>` for
files. All rows are validated when the sampler is built, so a bad row fails the run before any
work starts. The sampler does not score, batch or track what was trained.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from rollflow.config import DataConfig
from rollflow.data_files import ROLES, Row, read_rows
from rollflow.errors import DataError
from rollflow.records import Message, Prompt
from rollflow.tasks import PROBLEMS

__all__ = ["ROLES", "Encode", "Sampler", "read_jsonl"]

Encode = Callable[[list[Message]], list[int]]
"""Chat messages -> prompt token ids (the model's chat template with a generation prompt)."""


def read_jsonl(paths: list[str]) -> list[Row]:
    """Every row of the given dataset files (the name is kept from when JSONL was the only kind)."""
    return read_rows(paths)


class Sampler:
    """An endless, seeded stream of prompts that can be checkpointed and resumed."""

    def __init__(self, config: DataConfig, encode: Encode) -> None:
        self._config = config
        self._encode = encode
        self._rows = read_rows(config.paths, config.columns, config.split) if config.task == "jsonl" else None
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

    def _make(self, row: Row, epoch: int) -> Prompt:
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
            row = Row(
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
