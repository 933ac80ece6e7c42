"""Dataset files in: JSONL, Parquet, CSV, and folders saved with Hugging Face `datasets`.

Every source becomes the same validated `Row`s: a `prompt` (a text, or a list of {role, content}
messages as TRL's conversational format has it) or `messages`, an optional `answer` and `id`, and
every other column kept as metadata for rewards. `data.columns` renames a source's columns to
these names (`{question = "prompt", "reward_model.ground_truth" = "answer"}`; a dotted name reads
a field of a struct column), so verl's and TRL's usual layouts need no conversion. Tables are read
with pyarrow; a bad row is one error naming its file and line (JSONL) or row (tables), before any
work starts. The order of rows is the order in the files, so a seeded shuffle over them, and a
resumed position, is the same on every read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from rollflow.errors import DataError
from rollflow.records import Message

ROLES = ("system", "user", "assistant", "tool")
"""Chat roles a dataset's `messages` may use (what chat templates render)."""

TABLE_SUFFIXES = (".parquet", ".csv", ".arrow")
"""File types read as tables (any other file is read as JSONL)."""


class Row(msgspec.Struct, frozen=True):
    """A validated dataset row, before tokenising."""

    id: str
    messages: list[Message]
    answer: str | None
    task: str
    metadata: dict[str, Any]
    source: str = ""
    """Where the row is (`file:line`, or `file, row N`), for errors found after reading."""


def read_rows(paths: list[str], columns: dict[str, str] | None = None, split: str = "train") -> list[Row]:
    """Read and validate every row of every source, in order; ids must be unique."""
    if not paths:
        raise DataError('data.paths: task "jsonl" needs at least one dataset file or folder')
    rename = dict(columns or {})
    rows: list[Row] = []
    seen: dict[str, str] = {}
    for name in paths:
        path = Path(name)
        for where, default_id, obj in _records(path, split):
            row = parse_record(where, default_id, _renamed(where, obj, rename))
            if row.id in seen:
                raise DataError(f"{where}: duplicate id {row.id!r} (first at {seen[row.id]})")
            seen[row.id] = where
            rows.append(row)
    if not rows:
        raise DataError(f"{', '.join(paths)}: no rows")
    return rows


def _records(path: Path, split: str) -> Iterator[tuple[str, str, Any]]:
    """(where, default id, decoded record) of each row of one source."""
    if path.is_dir():
        yield from _table_records(path, _saved_dataset_files(path, split))
    elif path.suffix in TABLE_SUFFIXES:
        yield from _table_records(path, [path])
    else:
        yield from _jsonl_records(path)


def _jsonl_records(path: Path) -> Iterator[tuple[str, str, Any]]:
    try:
        lines = path.read_bytes().decode("utf-8-sig").splitlines()  # a byte-order mark is dropped
    except OSError as err:
        raise DataError(f"{path}: cannot read dataset file ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason})") from None
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = msgspec.json.decode(text)
        except msgspec.DecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err})") from None
        yield where, f"{path.name}:{number}", obj


def _saved_dataset_files(folder: Path, split: str) -> list[Path]:
    """The Arrow files of a folder written by `datasets`' `save_to_disk` (a `DatasetDict`: its
    `data.split`)."""
    if (folder / "dataset_dict.json").is_file():
        splits = _json(folder / "dataset_dict.json").get("splits", [])
        if split not in splits:
            raise DataError(f"{folder}: no split {split!r} (data.split); the dataset has {splits}")
        folder = folder / split
    state = folder / "state.json"
    if not state.is_file():
        raise DataError(
            f"{folder}: not a dataset folder saved with `datasets` (no state.json); expected a JSONL, "
            f"Parquet, CSV or Arrow file, or such a folder"
        )
    files = [folder / entry["filename"] for entry in _json(state).get("_data_files", [])]
    if not files:
        raise DataError(f"{state}: lists no data files")
    return files


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot read ({err})") from None
    return data if isinstance(data, dict) else {}


def _table_records(source: Path, files: list[Path]) -> Iterator[tuple[str, str, Any]]:
    number = 0
    for file in files:
        for obj in _read_table(file).to_pylist():
            number += 1
            yield f"{source}, row {number}", f"{source.name}:{number}", obj


def _read_table(file: Path) -> Any:  # -> pyarrow.Table
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet

    try:
        if file.suffix == ".parquet":
            return pyarrow.parquet.read_table(file)
        if file.suffix == ".csv":
            return pyarrow.csv.read_csv(file)
        with pa.memory_map(str(file)) as source:  # `datasets` writes Arrow streams
            try:
                return pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_file(source).read_all()
    except FileNotFoundError:
        raise DataError(f"{file}: cannot read dataset file (No such file or directory)") from None
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{file}: cannot read dataset file ({err})") from None


def _renamed(where: str, obj: Any, rename: dict[str, str]) -> Any:
    """`obj` with the columns `data.columns` names renamed (a dotted source name reads a field of
    a struct column)."""
    if not rename or not isinstance(obj, dict):
        return obj
    out = dict(obj)
    for source, target in rename.items():
        value: Any = obj
        for part in source.split("."):
            if not isinstance(value, dict) or part not in value:
                raise DataError(f"{where}: no column {source!r} (data.columns maps it to {target!r})")
            value = value[part]
        if "." not in source:
            out.pop(source, None)
        out[target] = value
    return out


def parse_record(where: str, default_id: str, obj: Any) -> Row:
    """Validate one decoded row; errors start with `where`."""

    def fail(what: str) -> DataError:
        return DataError(f"{where}: {what}")

    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, found {type(obj).__name__}")
    obj = dict(obj)
    prompt, messages = obj.pop("prompt", None), obj.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise fail("expected exactly one of `prompt` (string) or `messages` (list)")
    if isinstance(prompt, list):  # TRL's conversational format: the prompt is the messages
        prompt, messages = None, prompt
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise fail("`prompt` must be a non-empty string")
        parsed = [Message(role="user", content=prompt)]
    else:
        try:
            parsed = msgspec.convert(messages, list[Message])
        except msgspec.ValidationError as err:
            raise fail(f"`messages` must be a list of {{role, content}} ({err})") from None
        if not parsed:
            raise fail("`messages` is empty")
        for m in parsed:
            if m.role not in ROLES:
                raise fail(f"unknown role {m.role!r} in `messages`; expected one of {', '.join(ROLES)}")
    answer = obj.pop("answer", None)
    if answer is not None and not isinstance(answer, (str, int)):
        raise fail(f"`answer` must be a string or integer, found {type(answer).__name__}")
    row_id = obj.pop("id", None)
    if row_id is not None and not isinstance(row_id, (str, int)):
        raise fail(f"`id` must be a string or integer, found {type(row_id).__name__}")
    task = obj.pop("task", "jsonl")
    if not isinstance(task, str):
        raise fail("`task` must be a string")
    return Row(
        id=str(row_id) if row_id is not None else default_id,
        messages=parsed,
        answer=None if answer is None else str(answer),
        task=task,
        metadata=obj,
        source=where,
    )
