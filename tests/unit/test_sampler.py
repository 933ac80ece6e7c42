"""Prompt sources: procedural tasks, JSONL validation, seeded resumable order, verifiers."""

from __future__ import annotations

import json

import pytest

from rollflow.config import DataConfig
from rollflow.errors import DataError
from rollflow.records import Message
from rollflow.sampler import Sampler
from rollflow.tasks import arithmetic_problem, countdown_problem, countdown_reward, verify


def encode(messages: list[Message]) -> list[int]:
    """A stand-in chat template: one id per character, enough to check plumbing."""
    return [ord(c) for m in messages for c in f"{m.role}:{m.content}\n"]


def test_arithmetic_prompts_are_stable_and_verifiable():
    a, b = Sampler(DataConfig(seed=3), encode), Sampler(DataConfig(seed=3), encode)
    first = [a.next() for _ in range(5)]
    assert [p.id for p in first] == [f"arithmetic-3-{i}" for i in range(5)]
    assert first == [b.next() for _ in range(5)]
    problem = arithmetic_problem(3, 0)
    assert first[0].messages[0].content == problem.question
    assert verify("arithmetic", f"so it is {problem.answer}", problem.answer, {}) == 1.0
    assert verify("arithmetic", f"{problem.answer} or {int(problem.answer) + 1}", problem.answer, {}) == 0.0


def test_countdown_verifier_checks_numbers_and_target():
    problem = countdown_problem(0, 7)
    numbers, target = problem.metadata["numbers"], problem.metadata["target"]
    assert countdown_reward("1 + 2 + 3 + 4", [1, 2, 3, 4], 10) == 1.0
    assert countdown_reward("1 + 2 + 3", [1, 2, 3, 4], 6) == 0.0  # a number unused
    assert countdown_reward("__import__('os')", [1, 2, 3, 4], 10) == 0.0
    assert countdown_reward("(1 + 2) * (3 + 4) = 21", [1, 2, 3, 4], 21) == 1.0
    assert str(target) == problem.answer and len(numbers) == 4


def test_state_dict_resumes_without_repeat_or_skip(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = DataConfig(task="jsonl", paths=[str(path)], seed=1)
    straight = Sampler(cfg, encode)
    expected = [straight.next().id for _ in range(12)]
    first = Sampler(cfg, encode)
    got = [first.next().id for _ in range(7)]
    resumed = Sampler(cfg, encode)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.next().id for _ in range(5)]
    assert got == expected
    # One epoch visits every row once; later epochs get distinct ids.
    assert sorted(expected[:5]) == sorted(f"d.jsonl:{i}" for i in range(1, 6))
    assert all(pid.endswith("@1") for pid in expected[5:10])


def test_jsonl_rows_with_messages_ids_and_extra_columns(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}], "answer": 4, "level": 2}) + "\n\n"
    )
    prompt = Sampler(DataConfig(task="jsonl", paths=[str(path)]), encode).next()
    assert prompt.id == "x" and prompt.answer == "4" and prompt.metadata == {"level": 2}
    assert prompt.token_ids == encode([Message(role="user", content="hi")])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, found list"),
        ('{"answer": "1"}', "exactly one of `prompt`"),
        ('{"prompt": "a", "messages": []}', "exactly one of `prompt`"),
        ('{"prompt": ""}', "`prompt` must be a non-empty string"),
        ('{"messages": [{"role": "user"}]}', "`messages` must be a list of {role, content}"),
        ('{"prompt": "a", "answer": [1]}', "`answer` must be a string or integer"),
        ('{"messages": [{"role": "usr", "content": "hi"}]}', "unknown role 'usr' in `messages`; expected one of"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DataError) as info:
        Sampler(DataConfig(task="jsonl", paths=[str(path)]), encode)
    assert f"{path}:2:" in str(info.value)
    assert expected in str(info.value)


def test_duplicate_ids_missing_file_and_no_paths(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(DataError, match=r"dup.jsonl:2: duplicate id 'a' \(first at .*dup.jsonl:1\)"):
        Sampler(DataConfig(task="jsonl", paths=[str(path)]), encode)
    with pytest.raises(DataError, match="cannot read dataset file"):
        Sampler(DataConfig(task="jsonl", paths=[str(tmp_path / "none.jsonl")]), encode)
    with pytest.raises(DataError, match="data.paths"):
        Sampler(DataConfig(task="jsonl"), encode)


def test_a_dataset_with_a_byte_order_mark_reads_like_one_without(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "prompt": "x"}\n')
    assert Sampler(DataConfig(task="jsonl", paths=[str(path)]), encode).next().id == "a"


def test_raw_prompts_take_one_user_text_in_the_format_and_other_rows_name_their_line(tmp_path):
    from rollflow.models import load_tokenizer, raw_encoder, tiny_model_path

    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "2+2?", "answer": "4"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "3+3?"}]})
        + "\n"
    )
    seen = []

    def encode(messages):
        seen.append(messages)
        return [1]

    config = DataConfig(task="jsonl", paths=[str(data)], template="raw", system_prompt="Be brief.")
    sampler = Sampler(config, encode)
    sampler.next(), sampler.next()
    assert all([m.role for m in ms] == ["system", "user"] for ms in seen)
    tokenizer = load_tokenizer(tiny_model_path(0))
    ids = raw_encoder(tokenizer, "Q: {prompt}\nA:")(seen[0])
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"Be brief.\n\nQ: {seen[0][1].content}\nA:"

    data.write_text(
        json.dumps({"prompt": "fine"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
        + "\n"
    )
    with pytest.raises(DataError, match=rf'{data}:2: data.template = "raw" feeds one prompt text'):
        Sampler(config, encode)


def test_a_tokenizer_without_a_chat_template_is_one_error_naming_the_fix():
    from rollflow.errors import UserInputError
    from rollflow.models import chat_encoder

    class Base:
        chat_template = None
        name_or_path = "/models/base"

    with pytest.raises(UserInputError, match=r'model /models/base has no chat template .*data.template = "raw"'):
        chat_encoder(Base())
