"""Property-based tests of everything that reads user input: the config loader (TOML files and
--set overrides), the dataset JSONL reader and the ledger reader. Whatever the input, the
result is a value or one clear user error naming where; never another exception."""

from __future__ import annotations

import json
import string
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollflow.config import Config, _to_toml, dump_config, env_kinds, load_config
from rollflow.errors import ConfigError, DataError
from rollflow.ledger import read_ledger
from rollflow.sampler import read_jsonl

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SECTIONS = list(Config.__struct_fields__)
FIELDS = {name: list(getattr(Config(), name).__struct_fields__) for name in SECTIONS if name != "env"}
FIELDS["env"] = ["kind", *sorted({f for cls in env_kinds().values() for f in cls.__struct_fields__})]  # a tagged union

scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3))
# Mostly real section and field names (so validation, not just "unknown key", is exercised).
sections = st.one_of(st.sampled_from(SECTIONS), st.text(string.ascii_lowercase, min_size=1, max_size=6))


@st.composite
def config_dicts(draw):
    data = {}
    for section in draw(st.lists(sections, max_size=4, unique=True)):
        known = FIELDS.get(section, [])
        invented = st.text(string.ascii_lowercase, min_size=1, max_size=6)
        keys = st.one_of(st.sampled_from(known), invented) if known else invented
        data[section] = draw(st.dictionaries(keys, values, max_size=4))
    return data


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@FUZZ
@given(data=config_dicts())
def test_config_files_load_or_fail_with_the_file_and_field(tmp_path, data):
    path = _write(tmp_path, "c.toml", _to_toml(data).encode())
    try:
        config = load_config(path)
    except ConfigError as err:
        assert str(path) in str(err)
        return
    # A config that loads writes out and reads back to the same thing.
    again = _write(tmp_path, "again.toml", dump_config(config).encode())
    assert load_config(again) == config


@FUZZ
@given(text=st.text(max_size=200))
def test_arbitrary_text_as_a_config_file(tmp_path, text):
    path = _write(tmp_path, "c.toml", text.encode("utf-8", "surrogatepass"))
    try:
        load_config(path)
    except ConfigError as err:
        assert str(path) in str(err)


@FUZZ
@given(
    key=st.one_of(
        st.builds("{}.{}".format, st.sampled_from(SECTIONS), st.text(string.ascii_lowercase + "_", max_size=20)),
        st.text(max_size=20),
    ),
    value=st.text(max_size=20),
)
def test_overrides_apply_or_name_the_key(key, value):
    try:
        load_config(preset="tiny", overrides=[f"{key}={value}"])
    except ConfigError as err:
        assert "--set" in str(err) or key.split(".")[0] in str(err) or "override" in str(err)


row_values = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8), st.lists(st.text(max_size=4)))
rows = st.one_of(
    st.dictionaries(
        st.sampled_from(["id", "prompt", "messages", "answer", "task", "extra"]), row_values, max_size=5
    ).map(json.dumps),
    st.text(max_size=40),
)


@FUZZ
@given(lines=st.lists(rows, min_size=1, max_size=6))
def test_dataset_rows_load_or_fail_naming_file_and_line(tmp_path, lines):
    path = _write(tmp_path, "data.jsonl", "\n".join(lines).encode("utf-8", "surrogatepass"))
    try:
        loaded = read_jsonl([str(path)])
    except DataError as err:
        assert str(path) in str(err)
        return
    assert 0 < len(loaded) <= len(lines)
    assert all(row.messages and row.id for row in loaded)


ledger_lines = st.one_of(
    st.fixed_dictionaries(
        {"id": st.text(max_size=6), "outcome": st.sampled_from(["trained", "dropped", "lost"])},
        optional={"step": st.one_of(st.integers(), st.text(max_size=2)), "reason": st.text(max_size=8)},
    ).map(json.dumps),
    st.text(max_size=30),
)


@FUZZ
@given(lines=st.lists(ledger_lines, max_size=6))
def test_ledger_lines_read_or_fail_naming_file_and_line(tmp_path, lines):
    path = _write(tmp_path, "ledger.jsonl", "\n".join(lines).encode("utf-8", "surrogatepass"))
    try:
        entries = read_ledger(path)
    except DataError as err:
        assert f"{path}:" in str(err)
        return
    assert all(e.outcome in ("trained", "dropped") for e in entries)
