"""reasoning-gym datasets as tasks: the stream is reasoning-gym's own, held-out items never reach
training, the reward is the dataset's `score_answer`, and bad names and settings are refused
naming what was meant."""

from __future__ import annotations

import pytest
import reasoning_gym

from rollflow.checks import check_task
from rollflow.config import Config, DataConfig, load_config
from rollflow.errors import ConfigError
from rollflow.records import Message
from rollflow.sampler import Sampler
from rollflow.scoring import Scorer, builtin_reward
from rollflow.tasks import parse_task, verify
from rollflow.tasks.reasoning_gym import CHUNK, HELD_OUT_ITEMS, extract_answer, task_for

SETTINGS = {"min_terms": 2, "max_terms": 2, "max_digits": 1}


def encode(messages: list[Message]) -> list[int]:
    """A stand-in chat template: one id per character, enough to check plumbing."""
    return [ord(c) for m in messages for c in f"{m.role}:{m.content}\n"]


def sampler(task="reasoning_gym:chain_sum", held_out_seed=None, **data):
    config = DataConfig(task=task, task_config=data.pop("task_config", SETTINGS), **data)
    return Sampler(config, encode, held_out_seed=held_out_seed)


def test_prompt_i_of_seed_s_is_reasoning_gyms_item_i_across_chunks():
    source = task_for("reasoning_gym:chain_sum", SETTINGS, "tag")
    own = reasoning_gym.create_dataset("chain_sum", seed=5, size=CHUNK + 10, **SETTINGS)
    for index in (0, 1, CHUNK - 1, CHUNK, CHUNK + 7):
        made, want = source.entry(5, index), own[index]
        assert (made["question"], made["answer"]) == (want["question"], want["answer"])
        assert source.problem(5, index).metadata["source_index"] == index
    prompt = sampler(seed=5).next()
    assert prompt.id == "reasoning_gym:chain_sum-5-0" and prompt.task == "reasoning_gym:chain_sum"
    assert prompt.answer == own[0]["answer"] and prompt.metadata["num_terms"] == 2
    assert prompt.metadata["reasoning_gym"] == {"settings": SETTINGS, "answer_from": "tag", "seed": 5, "index": 0}


def test_the_answer_is_read_where_answer_from_says():
    text = "Let me think: 3 + 4.\nSo <answer> 7 </answer> or maybe 8\nIt is 1,234.5"
    assert extract_answer(text, "tag") == "7"
    assert extract_answer(text, "last_line") == "It is 1,234.5"
    assert extract_answer(text, "last_number") == "1234.5"
    assert extract_answer(text, "completion") == text
    assert extract_answer("no tags here", "tag") is None and extract_answer("", "last_number") is None


def test_the_reward_is_the_datasets_score_answer():
    prompt = sampler(answer_from="last_number").next()
    entry = reasoning_gym.create_dataset("chain_sum", seed=0, size=1, **SETTINGS)[0]
    assert verify(prompt.task, f"it is {entry['answer']}", prompt.answer, prompt.metadata) == 1.0
    assert verify(prompt.task, "it is 1000", prompt.answer, prompt.metadata) == 0.0
    spell = sampler("reasoning_gym:spell_backward", task_config={}, answer_from="completion").next()
    word = spell.answer
    partial = verify(spell.task, word[:-1] + "#", spell.answer, spell.metadata)  # its own partial credit
    assert 0.0 < partial < 1.0


def test_tag_answers_come_with_reasoning_gyms_system_prompt_unless_one_is_set():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    assert sampler().next().messages[0] == Message(role="system", content=SYSTEM_PROMPTS["default"])
    assert [m.role for m in sampler(answer_from="last_number").next().messages] == ["user"]
    assert sampler(system_prompt="Be brief.").next().messages[0].content == "Be brief."


def test_training_skips_the_items_held_out_for_evaluation():
    train = sampler(seed=0, held_out_seed=10)
    ids = [train.next().id.rsplit("-", 1)[1] for _ in range(12)]
    assert ids == [str(i) for i in range(10)] + [str(10 + HELD_OUT_ITEMS), str(11 + HELD_OUT_ITEMS)]
    train.load_state_dict({"epoch": 0, "position": 5})
    assert train.next().id.endswith("-5")  # resumes at its position
    # reasoning-gym makes item i of seed s from s + i: the first held-out prompt (seed 10, item 0)
    # is the item a training stream of seed 0 would have drawn at 10, which it skipped
    source = task_for("reasoning_gym:chain_sum", SETTINGS, "tag")
    assert sampler(seed=10).next().messages[-1].content == source.entry(0, 10)["question"]


async def test_a_scorer_that_raises_or_returns_garbage_makes_the_sample_unscorable(monkeypatch):
    prompt = sampler(answer_from="last_number").next()
    source = task_for(prompt.task, SETTINGS, "last_number")
    dataset = source._dataset(0)
    scorer = Scorer([builtin_reward("verifier", parse_task(DataConfig(task=prompt.task)))])
    try:
        monkeypatch.setattr(type(dataset), "score_answer", lambda self, answer, entry: "high")
        (bad,) = await scorer.score(prompt, ["7"], [[1]])
        monkeypatch.setattr(type(dataset), "score_answer", lambda self, answer, entry: 1 / 0)
        (raised,) = await scorer.score(prompt, ["7"], [[1]])
    finally:
        await scorer.aclose()
    assert bad.reward is None and "score_answer returned 'high', expected a number" in bad.reason
    assert raised.reward is None and raised.reason == "reward verifier: raised ZeroDivisionError: division by zero"


def test_unknown_names_and_settings_are_refused_naming_what_was_meant():
    with pytest.raises(ConfigError, match=r"no dataset 'chain_sun'; did you mean 'reasoning_gym:chain_sum'"):
        check_task(Config(data=DataConfig(task="reasoning_gym:chain_sun")))
    with pytest.raises(ConfigError, match=r"data.task_config.max_term: reasoning-gym's 'chain_sum' has no setting"):
        check_task(Config(data=DataConfig(task="reasoning_gym:chain_sum", task_config={"max_term": 3})))
    with pytest.raises(ConfigError, match=r"data.task_config.seed: rollflow sets the dataset's seed itself"):
        check_task(Config(data=DataConfig(task="reasoning_gym:chain_sum", task_config={"seed": 3})))
    with pytest.raises(ConfigError, match=r"refuses .*max_terms must be >= min_terms"):
        backwards = {"min_terms": 4, "max_terms": 2}
        check_task(Config(data=DataConfig(task="reasoning_gym:chain_sum", task_config=backwards)))
    with pytest.raises(ConfigError, match=r"data.task: 'aritmetic' is not a task; did you mean 'arithmetic'"):
        check_task(load_config(overrides=["data.task=aritmetic"]))
    with pytest.raises(ConfigError, match=r"data.task_config: only read by reasoning-gym tasks"):
        check_task(load_config(overrides=["data.task_config={a = 1}"]))


def test_the_reasoning_preset_trains_smollm2_on_a_reasoning_gym_task():
    config = load_config(preset="reasoning")
    assert config.model.path == "smollm2-135m-instruct" and config.data.task.startswith("reasoning_gym:")
    check_task(config)
    assert config.run.eval_prompts > 0 and config.run.eval_pass_k > 0
