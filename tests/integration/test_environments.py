"""The environments the field already has, trained as they are with real vLLM on the tiny model:
a reasoning-gym task scored by its own `score_answer`, a dataset file scored by math-verify, a
verifiers environment (single-turn, and multi-turn with a tool) through the OpenAI endpoint, a
verifiers v1 taskset scored by its own tasks (one with tools served in-process, one played by its
own `Env`), and
an OpenEnv environment whose server rollflow starts. One engine serves every run in turn
(`rollflow.testing.lend` puts it back on the initial weights at version 0)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.evaluate import held_out_report
from rollflow.ledger import summarize
from rollflow.models import load_tokenizer, tiny_model_path
from rollflow.records import Message
from rollflow.tasks.reasoning_gym import extract_answer

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("example_environments")]

BASE = ["observe.sinks=[]", "checkpoint.final_model=false", "run.max_steps=3"]


@pytest.fixture
def lender(tiny_preset_engine):
    """The session's engine of the tiny preset, lent to each run (tests/integration/conftest.py)."""
    return tiny_preset_engine


async def run(lender, out, record_groups, *overrides, **given):
    """A tiny-preset run with `overrides` on the session's shared engine; its result, the groups
    it trained and the controller."""
    config = load_config(preset="tiny", overrides=[*BASE, *overrides])
    controller = Controller(config, out, **given, given=Given(engine=await lender()))
    result = await controller.run()
    assert summarize(out).ok  # every prompt accounted for exactly once
    return result, list(record_groups), controller


@pytest.mark.timeout(300)
async def test_a_reasoning_gym_task_trains_and_evaluates_with_its_own_scorer(lender, tmp_path, record_groups):
    import reasoning_gym

    settings = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    result, groups, controller = await run(
        lender, tmp_path, record_groups, "data.task=reasoning_gym:chain_sum",
        "data.task_config={min_terms = 2, max_terms = 2, max_digits = 1}", "data.answer_from=last_number",
        "run.reward=verifier", "run.eval_prompts=4", "run.eval_every=2", "run.eval_pass_k=2", "sampling.max_tokens=8",
    )
    assert result.steps == 3 and result.eval_before is not None and result.eval_after is not None
    assert "eval_pass_at_k" in result.metrics[1]
    tokenizer = load_tokenizer(tiny_model_path(0))
    dataset = reasoning_gym.create_dataset("chain_sum", seed=0, size=100, **settings)
    for group in groups:
        task, seed, index = group.prompt.id.rsplit("-", 2)
        entry = dataset[int(index)]  # prompt i of data.seed 0 is reasoning-gym's item i of seed 0
        assert (task, seed) == ("reasoning_gym:chain_sum", "0")
        assert group.prompt.messages == [Message(role="user", content=entry["question"])]
        for sample in group.samples:  # each reward is the dataset's own score of the completion's answer
            text = tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
            assert sample.reward == dataset.score_answer(extract_answer(text, "last_number"), entry), text
    report = await held_out_report(controller.engine, controller.config, tokenizer, 4, 2)
    assert report["task"] == "reasoning_gym:chain_sum" and report["k"] == 2 and report["unscorable"] == 0
    assert report["accuracy"] == pytest.approx(result.eval_after.accuracy)  # the same held-out items


@pytest.mark.timeout(300)
async def test_math_verify_scores_a_dataset_file(lender, tmp_path, record_groups):
    rows = [
        {"prompt": "Half of one, as a fraction?", "answer": "\\frac{1}{2}"},
        {"prompt": "What is 2 + 2?", "answer": "4"},
        {"prompt": "Square root of 9?", "answer": "3"},
        {"prompt": "What is 10 / 4?", "answer": "$\\frac{5}{2}$"},
    ]
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result, groups, _ = await run(
        lender, tmp_path / "run", record_groups, "data.task=jsonl", f'data.paths=["{data}"]',
        "run.reward=math_verify", "sampling.max_tokens=8", "run.max_steps=2",
    )
    assert result.steps == 2 and groups
    from math_verify import parse, verify

    tokenizer = load_tokenizer(tiny_model_path(0))
    for group in groups:
        gold = parse(group.prompt.answer) or parse(f"${group.prompt.answer}$")
        for sample in group.samples:
            text = tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
            assert sample.reward == float(verify(gold, parse(text))), text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("env_id", ["vf-sums", "vf-calc"])
async def test_a_verifiers_environment_trains_through_the_endpoint(lender, tmp_path, record_groups, env_id):
    result, groups, _ = await run(
        lender, tmp_path, record_groups, "env.kind=verifiers", f"env.environment={env_id}", "env.max_tokens=64",
        "sampling.max_tokens=16", "rollout.group_size=4", "run.groups_per_step=2", "run.eval_prompts=4",
    )
    assert result.steps == 3 and len(groups) == 6
    # the dataset's last 4 rows are held out: evaluated as episodes before and after, never trained
    assert result.eval_before.prompts == 4 and result.eval_before.unscorable == 0
    assert result.eval_before.versions == [0] and result.eval_after.versions == [3]
    from rollflow.verifiers.environments import VerifiersEnv

    held_out = {row.id for row in VerifiersEnv(env_id).rows()[-4:]}
    assert not {g.prompt.id.split("@")[0] for g in groups} & held_out
    for group in groups:
        assert group.prompt.id.startswith(f"{env_id}-")
        for sample in group.samples:
            assert sample.unscorable is None and sample.reward is not None
            assert sample.reward_parts.keys() == {"env"} and min(sample.versions) >= 0
            assert sample.num_tokens > 0 and 1 in sample.loss_mask
    assert all(m["agent_splits"] == 0 for m in result.metrics)


@pytest.mark.timeout(300)
async def test_a_verifiers_v1_taskset_trains_scored_by_its_own_tasks(lender, tmp_path, record_groups):
    result, groups, _ = await run(
        lender, tmp_path, record_groups, "env.kind=verifiers", "env.taskset=sums-taskset", "env.taskset_args={n = 8}",
        "sampling.max_tokens=16", "rollout.group_size=4", "run.groups_per_step=2",
    )
    assert result.steps == 3 and len(groups) == 6
    for group in groups:
        assert group.prompt.id.startswith("sums-taskset-")
        for sample in group.samples:
            assert sample.unscorable is None and sample.reward_parts == {"sums-taskset": sample.reward}
            # the task's own weights: correct (1) + digits share (0.5)
            assert sample.reward == pytest.approx(sample.env_metrics["correct"] + 0.5 * sample.env_metrics["digits"])
            assert sample.turns == 1 and sample.num_tokens > 0 and set(sample.loss_mask) == {1}
    assert all(set(m["env_metrics"]) == {"correct", "digits", "reply_chars"} for m in result.metrics)


@pytest.mark.timeout(300)
async def test_a_verifiers_v1_taskset_with_tools_trains_with_its_toolset_served_in_process(
    lender, tmp_path, record_groups
):
    """calc-taskset's tasks bring a Calculator toolset: the run serves it in-process and shows its
    tools to the chat template; the random model rarely calls one, so this checks the path end to end
    (every episode scored by its task on its trace), and the unit tests check the calls."""
    result, groups, _ = await run(
        lender, tmp_path, record_groups, "env.kind=verifiers", "env.taskset=calc-taskset", "env.taskset_args={n = 8}",
        "sampling.max_tokens=16", "rollout.group_size=4", "run.groups_per_step=2", "env.max_tokens=64",
    )
    assert result.steps == 3 and len(groups) == 6
    for group in groups:
        for sample in group.samples:
            assert sample.unscorable is None and sample.reward_parts == {"calc-taskset": sample.reward}
            metrics = sample.env_metrics
            assert sample.reward == pytest.approx(metrics["correct"] + 0.25 * metrics["used_tools"])
            assert 1 <= sample.turns <= 4 and sample.num_tokens > 0
    assert all(set(m["env_metrics"]) == {"correct", "used_tools", "tool_calls"} for m in result.metrics)


@pytest.mark.timeout(300)
async def test_a_verifiers_v1_taskset_with_its_own_env_trains_the_player_and_evaluates_held_out_games(
    lender, tmp_path, record_groups
):
    """guess-taskset's own Env answers each guess and lets an untrained referee comment: verifiers
    runs it, every call of both agents is generated by the engine, the player's are trained."""
    result, groups, _ = await run(
        lender, tmp_path, record_groups, "env.kind=verifiers", "env.taskset=guess-taskset",
        "env.taskset_args={n = 12, referee = true}", "sampling.max_tokens=8", "rollout.group_size=4",
        "run.groups_per_step=2", "run.eval_prompts=2", "env.max_tokens=96",
    )
    assert result.steps == 3 and len(groups) == 6
    assert result.eval_before.prompts == 2 and result.eval_before.unscorable == 0
    assert result.eval_before.versions == [0] and result.eval_after.versions == [3]
    tokenizer = load_tokenizer(tiny_model_path(0))
    for group in groups:
        for sample in group.samples:
            assert sample.unscorable is None and sample.reward_parts == {"guess-taskset": sample.reward}
            guesses = sample.env_metrics["guesses"]
            assert 1 <= guesses <= 4 and sample.turns == guesses
            assert sample.reward in (0.0, pytest.approx(1 / guesses))
            assert "Cheer" not in tokenizer.decode(sample.prompt_token_ids + sample.completion_token_ids)
    assert all(set(m["env_metrics"]) == {"solved", "guesses"} for m in result.metrics)


@pytest.mark.timeout(300)
async def test_an_openenv_environment_trains_against_the_server_rollflow_starts(lender, tmp_path, record_groups):
    result, groups, _ = await run(
        lender, tmp_path, record_groups, "env.kind=openenv", "env.client=openenv_sums:SumsClient",
        "env.server=openenv_sums:app", "env.max_turns=2", "env.max_tokens=64", "sampling.max_tokens=8",
    )
    assert result.steps == 3 and groups
    tokenizer = load_tokenizer(tiny_model_path(0))
    for group in groups:
        openings = {tuple(s.prompt_token_ids) for s in group.samples}
        assert len(openings) == 1  # a group's episodes meet one instance (the reset seed is the prompt's)
        assert "What is" in tokenizer.decode(group.samples[0].prompt_token_ids)
        for sample in group.samples:
            assert sample.unscorable is None and sample.reward in (0.0, 1.0)
            assert 1 <= sample.turns <= 2 and sample.reward_parts == {"env": sample.reward}
    assert all(1 <= m["turns_mean"] <= 2 for m in result.metrics)


def test_an_unknown_dataset_is_refused_at_load_naming_close_names(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rollflow", "train", "--preset", "tiny", "--set", "data.task=reasoning_gym:chain_sun",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "reasoning-gym has no dataset 'chain_sun'; did you mean 'reasoning_gym:chain_sum'" in done.stderr
