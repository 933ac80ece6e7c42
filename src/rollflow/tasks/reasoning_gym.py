"""reasoning-gym's procedural datasets as rollflow tasks: `data.task = "reasoning_gym:NAME"`.

Problem `index` of the stream with seed `seed` is item `index` of reasoning-gym's dataset `NAME`
made with that seed (`create_dataset(NAME, seed=seed, **data.task_config)`; datasets whose items
depend on the dataset's size are made in chunks of `CHUNK` items, each chunk with the seed its
first item would have). Nothing is downloaded: reasoning-gym generates every item. The reward is
the dataset's own `score_answer`, given the answer read from the completion as `data.answer_from`
says; the item it scores against is made again from the prompt's seed and index, so scoring needs
nothing but the prompt.

The library is imported when a task needs it; without it, one error names the extra to install.
This module does not tokenise or order prompts (`rollflow.sampler`) or run rewards
(`rollflow.scoring`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import threading
from collections import OrderedDict
from typing import Any

import msgspec

from rollflow.errors import ConfigError
from rollflow.tasks.task import Problem, ProblemSource, Task, TaskKind

PREFIX = "reasoning_gym:"
"""`data.task` values naming a reasoning-gym dataset start with this."""

EXTRA = "pip install 'rollflow[reasoning-gym]'"
"""How to install the library (named in the error when it is missing)."""

CHUNK = 10_000
"""Items per dataset object. Some datasets draw all their items' templates when made, for the
size they are given; chunks keep that bounded while the stream itself is endless."""

DATASETS_KEPT = 8
"""Dataset objects (chunks) kept made; a run reads from two or three (training, held-out)."""

READY_KEPT = 64
"""Items made ahead by `prepare` and not yet taken, kept at most (the sampler takes each at once)."""

HELD_OUT_ITEMS = 100_000
"""Items of a stream, from `run.eval_seed` on, that are held out for evaluation: the held-out
prompts are items `eval_seed`, `eval_seed + 1`, ... of the dataset (reasoning-gym makes item i of
seed s from s + i), and a training stream skips every item in that window."""

RESERVED = ("seed", "size")
"""Dataset settings rollflow sets itself: the seed from `data.seed` (or `run.eval_seed`), the size endless."""

AnswerFrom = str
"""`tag`, `last_line`, `last_number` or `completion` (`DataConfig.answer_from`)."""

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def extract_answer(completion: str, answer_from: AnswerFrom) -> str | None:
    """The answer a completion gives, read as `answer_from` says (None: it gives none)."""
    if answer_from == "tag":
        found = _TAG.findall(completion)
        return found[-1].strip() if found else None
    if answer_from == "last_line":
        lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
        return lines[-1] if lines else None
    if answer_from == "last_number":
        numbers = _NUMBER.findall(completion)
        return numbers[-1].replace(",", "") if numbers else None
    return completion.strip()


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError as err:
        raise ConfigError(f"data.task: reasoning-gym tasks need the reasoning-gym package ({err}); {EXTRA}") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers."""
    _library()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


class ReasoningGymTask:
    """One reasoning-gym dataset with its settings: problems by (seed, index) and their scores."""

    def __init__(self, name: str, settings: dict[str, Any], answer_from: AnswerFrom = "tag") -> None:
        _library()
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            close = difflib.get_close_matches(name, DATASETS, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(PREFIX + c) for c in close)}?" if close else ""
            raise ConfigError(
                f"data.task: reasoning-gym has no dataset {name!r}{hint} (it has {len(DATASETS)}; "
                "`python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'` lists them)"
            )
        fields = {f.name for f in dataclasses.fields(DATASETS[name][1])}
        for key in settings:
            if key in RESERVED:
                raise ConfigError(
                    f"data.task_config.{key}: rollflow sets the dataset's {key} itself "
                    "(the seed from data.seed, run.eval_seed for held-out prompts; the stream is endless)"
                )
            if key not in fields:
                known = ", ".join(sorted(fields - set(RESERVED)))
                raise ConfigError(f"data.task_config.{key}: reasoning-gym's {name!r} has no setting {key!r} ({known})")
        self.name = name
        self.settings = dict(settings)
        self.answer_from = answer_from
        self._made: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()
        """Guards `_made` and `_making` (never held while a chunk is made)."""
        self._making: dict[int, threading.Lock] = {}
        """One lock per chunk being made: a second caller of the same chunk waits for the first."""
        self._ready: OrderedDict[tuple[int, int], dict[str, Any] | Exception] = OrderedDict()
        """Items `prepare` made ahead (or the error making one raised), taken by `entry`."""
        try:
            self.entry(0, 0)
        except (AssertionError, TypeError, ValueError) as err:
            raise ConfigError(f"data.task_config: reasoning-gym's {name!r} refuses {self.settings}: {err}") from None
        except Exception as err:  # a setting that leaves the dataset nothing to draw from, say
            raise ConfigError(
                f"data.task_config: reasoning-gym's {name!r} cannot make an item with {self.settings} "
                f"({type(err).__name__}: {err})"
            ) from None

    @property
    def task(self) -> str:
        """The `data.task` value naming this dataset."""
        return PREFIX + self.name

    @property
    def system_prompt(self) -> str:
        """The instructions a prompt gets when `data.system_prompt` is empty: reasoning-gym's own
        (it asks for the answer in <answer> tags) when the answer is read from them, else none."""
        if self.answer_from != "tag":
            return ""
        from reasoning_gym.utils import SYSTEM_PROMPTS

        return str(SYSTEM_PROMPTS["default"])

    def _dataset(self, seed: int) -> Any:
        """The chunk made with `seed`; making one can take seconds, so no lock other callers
        need (for chunks already made) is held meanwhile."""
        with self._lock:
            made = self._made.get(seed)
            if made is not None:
                self._made.move_to_end(seed)
                return made
            making = self._making.setdefault(seed, threading.Lock())
        with making:
            with self._lock:
                made = self._made.get(seed)
            if made is None:
                from reasoning_gym import create_dataset

                made = create_dataset(self.name, seed=seed, size=CHUNK, **self.settings)
                with self._lock:
                    self._made[seed] = made
                    if len(self._made) > DATASETS_KEPT:
                        self._made.popitem(last=False)
            with self._lock:
                self._making.pop(seed, None)
        return made

    def _make_entry(self, seed: int, index: int) -> dict[str, Any]:
        chunk, offset = divmod(index, CHUNK)
        return dict(self._dataset(seed + chunk * CHUNK)[offset])

    def prepare(self, seed: int, index: int) -> None:
        """Make item `index` of the stream with seed `seed` (and its chunk) ahead of `entry`, on
        the caller's thread: the sampler calls this on a worker thread so that the event loop
        never waits for reasoning-gym. An error is kept for `entry` to raise."""
        try:
            made: dict[str, Any] | Exception = self._make_entry(seed, index)
        except Exception as err:
            made = err
        with self._lock:
            self._ready[(seed, index)] = made
            while len(self._ready) > READY_KEPT:
                self._ready.popitem(last=False)

    def entry(self, seed: int, index: int) -> dict[str, Any]:
        """reasoning-gym's item `index` of the stream with seed `seed` (question, answer, metadata)."""
        with self._lock:
            made = self._ready.pop((seed, index), None)
        if isinstance(made, Exception):
            raise made
        return made if made is not None else self._make_entry(seed, index)

    def problem(self, seed: int, index: int) -> Problem:
        """The item as a rollflow problem; its metadata holds the item's own (JSON-safe) and where
        it comes from, which is what scoring needs to make it again."""
        try:
            entry = self.entry(seed, index)
        except Exception as err:  # this item's, not the run's: the sampler drops its prompt
            raise ValueError(
                f"reasoning-gym's {self.name!r} could not make item {index} of seed {seed} with data.task_config "
                f"{self.settings}: {type(err).__name__}: {err}"
            ) from err
        metadata = msgspec.json.decode(msgspec.json.encode(entry.get("metadata", {}), enc_hook=str))
        if not isinstance(metadata, dict):
            metadata = {"metadata": metadata}
        if "source_index" in metadata:  # the item's index in the stream, not within its chunk
            metadata["source_index"] = index
        metadata["reasoning_gym"] = {
            "settings": self.settings,
            "answer_from": self.answer_from,
            "seed": seed,
            "index": index,
        }
        answer = entry.get("answer")
        return Problem(str(entry["question"]), "" if answer is None else str(answer), metadata)

    def score(self, completion: str, seed: int, index: int) -> float:
        """The dataset's `score_answer` for the answer the completion gives; ValueError when it
        returns something other than a finite number."""
        entry = self._make_entry(seed, index)
        dataset = self._dataset(seed + index // CHUNK * CHUNK)
        value = dataset.score_answer(extract_answer(completion, self.answer_from), entry)
        from rollflow.values import finite, shown

        number = finite(value)
        if number is None:
            raise ValueError(
                f"reasoning-gym's {self.name!r} score_answer returned {shown(value, typed=False)}, expected a number"
            )
        return number


def task_for(task: str, settings: dict[str, Any], answer_from: AnswerFrom) -> ReasoningGymTask:
    """The task `data.task` names (`reasoning_gym:NAME`), made once per settings."""
    return _cached(task.removeprefix(PREFIX), msgspec.json.encode(settings, order="sorted").decode(), answer_from)


@functools.lru_cache(maxsize=16)
def _cached(name: str, settings: str, answer_from: AnswerFrom) -> ReasoningGymTask:
    return ReasoningGymTask(name, msgspec.json.decode(settings), answer_from)


def score(task: str, completion: str, metadata: dict[str, Any]) -> float:
    """The reward of a completion of a reasoning-gym prompt (its metadata says which item)."""
    origin = metadata.get("reasoning_gym")
    if not isinstance(origin, dict):
        raise ValueError(f"prompt of task {task!r} has no reasoning_gym metadata (seed, index) to score against")
    source = task_for(task, origin.get("settings", {}), origin.get("answer_from", "tag"))
    return source.score(completion, int(origin["seed"]), int(origin["index"]))


class ReasoningGym(Task):
    """`data.task = "reasoning_gym:NAME"` with its settings: the dataset (made when first needed;
    a bad name or setting is a ConfigError then), its stream, and its `score_answer`."""

    kind: TaskKind = "reasoning_gym"
    slow_checker = True
    held_out_items = HELD_OUT_ITEMS

    def __init__(self, name: str, settings: dict[str, Any], answer_from: AnswerFrom = "tag") -> None:
        super().__init__(name)
        self.settings = dict(settings)
        self.answer_from = answer_from

    @property
    def dataset(self) -> ReasoningGymTask:
        return task_for(self.name, self.settings, self.answer_from)

    def problems(self) -> ProblemSource:
        dataset = self.dataset
        return ProblemSource(dataset.problem, dataset.system_prompt, dataset.prepare)

    def verify(self, completion: str, answer: str | None, metadata: dict[str, Any]) -> float:
        """The dataset's `score_answer`, against the item the prompt's metadata names."""
        return score(self.name, completion, metadata)
