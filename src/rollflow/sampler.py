"""Prompts in: procedural tasks or dataset files, in a seeded, resumable order.

The sampler turns rows (`rollflow.data_files`: JSONL, Parquet, CSV, `datasets` folders) into
`Prompt` records (messages -> token ids through the model's chat template, or the raw text) and
remembers where it is (`state_dict` / `load_state_dict`), so a resumed run continues with the
next prompt, never repeating or skipping one. Every prompt has a stable id:
`<task>-<seed>-<index>` for procedural tasks, the row's `id` or `<file>:<line or row>` for
files. All rows are validated when the sampler is built, so a bad row fails the run before any
work starts. A training sampler of a task that holds items out for evaluation (a reasoning-gym
dataset) skips them (`held_out_seed`), so the two never share a problem. The sampler does not score,
batch or track what was trained.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator

from rollflow.config import Config, DataConfig
from rollflow.data_files import ROLES, Row, read_rows
from rollflow.errors import DataError, UnusablePrompt
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.tasks import Task, parse_task

__all__ = ["ROLES", "Encode", "Sampler", "read_jsonl"]

Encode = Callable[[list[Message]], list[int]]
"""Chat messages -> prompt token ids (the model's chat template with a generation prompt)."""


def read_jsonl(paths: list[str]) -> list[Row]:
    """Every row of the given dataset files (the name is kept from when JSONL was the only kind)."""
    return read_rows(paths)


class Sampler:
    """An endless, seeded stream of prompts that can be checkpointed and resumed."""

    def __init__(
        self,
        config: DataConfig,
        encode: Encode,
        *,
        task: Task | None = None,
        rows: list[Row] | None = None,
        held_out_seed: int | None = None,
    ) -> None:
        """`task`: `data.task` parsed (default: parsed here). `rows`: the prompts' rows, given
        instead of read from `config` (an environment's own dataset). `held_out_seed`: a training
        stream skips the items its task holds out for evaluation from that seed."""
        self._config = config
        self._encode = encode
        task = task or parse_task(config)
        if rows is None and task.kind == "files":
            rows = read_rows(config.paths, config.columns, config.split)
        self._rows = rows
        self._source = task.problems() if rows is None else None
        self._skip: range | None = None
        if held_out_seed is not None and task.held_out_items:
            start = held_out_seed - config.seed
            self._skip = range(start, start + task.held_out_items)
        if config.template == "raw":
            for row in self._rows or []:
                if [m.role for m in row.messages] != ["user"]:
                    raise DataError(
                        f'{row.source}: data.template = "raw" feeds one prompt text; this row\'s messages have '
                        f"roles {[m.role for m in row.messages]} (give `prompt`, or one user message)"
                    )
        system = config.system_prompt or (self._source.system_prompt if self._source is not None else "")
        self._system = [Message(role="system", content=system)] if system else []
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

    async def draw(self) -> Prompt:
        """The next prompt, as `next`; a task whose problems are slow to make (a reasoning-gym
        dataset) makes it on a worker thread first, so the event loop never waits for it. The
        position moves only in `next`, on the caller's thread: a checkpoint taken meanwhile
        sees the sampler before the draw."""
        if self._source is not None and self._source.slow:
            await asyncio.to_thread(self._source.prepare, self._config.seed, self._next_index())
        return self.next()

    def _next_index(self) -> int:
        if self._skip is not None and self.position in self._skip:
            return self._skip.stop
        return self.position

    def next(self) -> Prompt:
        """The next prompt; advances the position. `UnusablePrompt` (after advancing) when a
        procedural task cannot make it: that prompt is dropped, the stream goes on."""
        cfg = self._config
        if self._source is not None:
            self.position = self._next_index()
            prompt_id = f"{cfg.task}-{cfg.seed}-{self.position}"
            try:
                problem = self._source(cfg.seed, self.position)
                row = Row(
                    id=prompt_id,
                    messages=[Message(role="user", content=problem.question)],
                    answer=problem.answer,
                    task=cfg.task,
                    metadata=problem.metadata,
                )
                self.position += 1
                return self._make(row, self.epoch)
            except Exception as err:  # one item's failure is that prompt's, not the run's
                self.position += 1
                raise UnusablePrompt(prompt_id, f"prompt unusable: {err}") from err
        else:
            assert self._rows is not None
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


def sampling_spec(config: Config, *, greedy: bool = False) -> SamplingSpec:
    """The run's sampling (`[sampling]`) as every request carries it; `greedy`: temperature 0,
    for held-out accuracy."""
    s = config.sampling
    if greedy:
        return SamplingSpec(temperature=0.0, max_tokens=s.max_tokens)
    return SamplingSpec(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, ignore_eos=s.ignore_eos
    )
