"""TRL's environment classes (`environment_factory`) as rollflow episodes, with scripted model
turns and the tiny model's real tokenizer: the row reaches `reset`, the tools are shown to the
template and run, `get_reward` is the episode's reward under the class's name, and what a class
gets wrong is refused at start or is that episode's reason."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollflow.config import Config, FactoryEnvConfig, load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.envs import ChatFormat
from rollflow.envs.factory import episodes, load_classes
from rollflow.episodes import EpisodeContext
from rollflow.errors import ConfigError
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.testing import FakeEngine, FakeTrainer, NullTransport, ScriptedTurns

pytestmark = pytest.mark.usefixtures("example_environments")

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)
PROMPT = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="What is 3 * 4?")], answer="12",
                metadata={"a": 3, "b": 4, "op": "*"})
SHOWS_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The tiny model's template, with the tools shown in a system message (as Qwen's does)."""


@pytest.fixture
def tool_chat():
    from rollflow.models import load_tokenizer, tiny_model_path

    tokenizer = load_tokenizer(tiny_model_path(0))
    tokenizer.chat_template = SHOWS_TOOLS
    return ChatFormat(tokenizer)


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


async def play(source, chat, turns, prompt=PROMPT, index=0, **limits):
    context = EpisodeContext(chat=chat, sampling=SPEC, max_model_len=1024)
    script = ScriptedTurns(chat, turns)
    sample = await source.play(prompt, group_id="g0", index=index, generate=script, context=context)
    return sample, script


def source_of(classes, **settings):
    return episodes(FactoryEnvConfig(**settings), Config(), classes)


async def test_the_row_reaches_reset_the_tools_are_shown_and_get_reward_scores_under_the_class_name(tool_chat):
    import trl_envs

    seen = {}

    class Recording(trl_envs.SubmitEnv):
        def reset(self, **kwargs):
            seen.update(kwargs)
            return super().reset(**kwargs)

    source = source_of(Recording)
    sample, script = await play(source, tool_chat, [call("submit", answer=12), "Done."])
    assert seen == {"answer": "12", "a": 3, "b": 4, "op": "*"}
    opening = tool_chat.tokenizer.decode(script.seen[0])
    assert '"name": "submit"' in opening and "Submit the final answer." in opening  # the schema, from the docstring
    assert "What is 3 * 4? Submit the result with the submit tool." in opening  # reset's text appended
    assert sample.unscorable is None and sample.turns == 2 and sample.env_reward == "Recording"
    assert sample.process_rewards == [(sample.num_tokens - 1, 1.0)]
    text = tool_chat.tokenizer.decode(sample.completion_token_ids)
    assert "Submitted." in text  # the tool's result, in the sequence ...
    tool_span = [i for i, m in enumerate(sample.loss_mask) if m == 0]
    assert "Submitted." in tool_chat.tokenizer.decode([sample.completion_token_ids[i] for i in tool_span])  # ... masked
    assert source.columns([sample])["environments"][0].submitted == 12  # what reward functions receive


async def test_a_tool_that_raises_answers_the_model_and_a_wrong_answer_scores_zero(tool_chat):
    import trl_envs

    class Fussy(trl_envs.SubmitEnv):
        def submit(self, answer: int) -> str:
            """Submit the final answer.

            Args:
                answer: The result.
            """
            raise RuntimeError("the grader is busy")

    sample, _ = await play(source_of(Fussy), tool_chat, [call("submit", answer=11), "Oh."])
    text = tool_chat.tokenizer.decode(sample.completion_token_ids)
    assert "error: tool submit raised RuntimeError: the grader is busy" in text
    assert sample.unscorable is None and sample.process_rewards[-1][1] == 0.0


async def test_async_methods_several_classes_chosen_by_the_row_and_an_unknown_one(tool_chat):
    source = source_of({"submit": "trl_envs:SubmitEnv", "counter": "trl_envs:CounterEnv"})
    counter = Prompt(id="c", token_ids=[1], messages=[Message(role="user", content="Count.")],
                     metadata={"environment": "counter", "target": 2})
    sample, script = await play(source, tool_chat, [call("increment", step=2), "There."], prompt=counter)
    opening = tool_chat.tokenizer.decode(script.seen[0])
    assert '"increment"' in opening and '"submit"' not in opening  # only the chosen class's tools
    assert sample.env_reward == "CounterEnv" and sample.process_rewards[-1][1] == 1.0  # async get_reward
    stray = Prompt(id="s", token_ids=[1], messages=[Message(role="user", content="?")], metadata={"environment": "x"})
    sample, _ = await play(source, tool_chat, [], prompt=stray)
    assert sample.unscorable == "environment: the row's `environment` is 'x', expected one of 'submit', 'counter'"


async def test_a_reset_or_get_reward_that_fails_or_hangs_makes_the_episode_unscorable(tool_chat):
    import trl_envs

    class BadReset(trl_envs.SubmitEnv):
        def reset(self, **kwargs):
            raise KeyError("no such task")

    class NotText(trl_envs.SubmitEnv):
        def reset(self, **kwargs):
            return 42

    class SlowReward(trl_envs.SubmitEnv):
        async def get_reward(self):
            await asyncio.sleep(30)

    class NaNReward(trl_envs.SubmitEnv):
        def get_reward(self):
            return float("nan")

    cases = [
        (BadReset, "environment: reset raised KeyError: 'no such task'"),
        (NotText, "environment: reset raised TypeError: NotText.reset returned 42 (int), expected text or None"),
        (SlowReward, "environment: step timed out after 0.5 s"),
        (NaNReward, "environment: step raised TypeError: NaNReward.get_reward returned nan (float), expected a finite"),
    ]
    for cls, reason in cases:
        sample, _ = await play(source_of(cls, step_timeout_s=0.5), tool_chat, ["12"])
        assert sample.unscorable is not None and sample.unscorable.startswith(reason), (cls, sample.unscorable)


def test_classes_that_cannot_work_are_refused_at_start_naming_the_method():
    class NoReset:
        def go(self, x: int) -> int:
            """Go.

            Args:
                x: How far.
            """
            return x

    class Undocumented:
        def reset(self, **kwargs):
            return None

        def move(self, direction: str) -> str:
            return direction

    class Untyped:
        def reset(self, **kwargs):
            return None

        def move(self, direction):
            """Move.

            Args:
                direction: Where.
            """
            return direction

    with pytest.raises(ConfigError, match=r"env.factory: NoReset has no `reset` method"):
        load_classes(NoReset, "env.factory")
    with pytest.raises(ConfigError, match=r"env.factory: Undocumented.move: a tool needs a docstring"):
        load_classes(Undocumented, "env.factory")
    with pytest.raises(ConfigError, match=r"env.factory: Untyped.move: cannot describe it as a tool"):
        load_classes(Untyped, "env.factory")
    close = r"env.factory: 'trl_envs' has no class 'SubmitEnvv'; did you mean 'trl_envs:SubmitEnv'"
    with pytest.raises(ConfigError, match=close):
        load_classes("trl_envs:SubmitEnvv", "env.factory")
    with pytest.raises(ConfigError, match=r'env.factory: kind = "factory" needs the class'):
        episodes(FactoryEnvConfig(), Config())


@pytest.mark.timeout(120)
async def test_a_run_trains_a_trl_class_with_reward_functions_that_read_the_environments(tmp_path, chat):
    """`rollflow.train(..., environment_factory=...)`'s path: the class's reward under its name,
    a reward function with TRL's signature reading `environments`."""
    import trl_envs

    seen = []

    def submitted(prompts, completions, environments, **kwargs):
        seen.append(environments)
        return [float(e.submitted is not None) for e in environments]

    from rollflow.envs.factory import EnvironmentFactory

    config = load_config(preset="tiny", overrides=[
        "run.max_steps=2", "sampling.max_tokens=8", "env.kind=factory", "env.max_turns=2", "env.max_tokens=48",
        'scoring.rewards=[{name = "submitted"}]'])
    controller = Controller(config, tmp_path, env=EnvironmentFactory(trl_envs.SubmitEnv),
                            reward_funcs={"submitted": submitted},
                            given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(),
                                        tokenizer=chat.tokenizer))
    result = await asyncio.wait_for(controller.run(), 100)
    assert result.steps == 2
    assert set(result.metrics[0]["rewards"]) == {"SubmitEnv", "submitted"}
    assert seen and all(len(envs) == 4 and all(isinstance(e, trl_envs.SubmitEnv) for e in envs) for envs in seen)


async def test_held_out_prompts_are_played_as_episodes_and_scored_by_the_class(tmp_path, chat):
    """A source that brings no prompts evaluates `data.task`'s held-out prompts as its episodes,
    scored by `get_reward` (the class's own reward), before and after training."""
    import trl_envs

    from rollflow.envs.factory import EnvironmentFactory

    config = load_config(preset="tiny", overrides=[
        "run.max_steps=1", "sampling.max_tokens=8", "env.kind=factory", "env.max_turns=2", "env.max_tokens=48",
        "run.eval_prompts=3"])
    controller = Controller(config, tmp_path, env=EnvironmentFactory(trl_envs.SubmitEnv),
                            given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(),
                                        tokenizer=chat.tokenizer))
    result = await asyncio.wait_for(controller.run(), 100)
    assert result.eval_before.prompts == 3 and result.eval_after.prompts == 3
    # the fake engine never writes a tool call: no submission, so get_reward gives 0; a single
    # turn scored without the class would have no reward at all (unscorable)
    assert result.eval_before.unscorable == 0 and result.eval_before.accuracy == 0.0
    assert result.eval_before.versions == [0] and result.eval_after.versions == [1]


# ---- user code that fails or blocks (issue: user code costs its episode, never the run) --------


async def test_a_constructor_that_raises_makes_its_episode_unscorable_and_runs_off_the_event_loop(tool_chat):
    import threading

    import trl_envs

    built_on: list[str] = []

    class Flaky(trl_envs.SubmitEnv):
        made = 0

        def __init__(self):
            built_on.append(threading.current_thread().name)
            Flaky.made += 1
            if Flaky.made == 2:
                raise ConnectionError("sandbox refused")

    source = source_of(Flaky)
    sample, _ = await play(source, tool_chat, ["12"])
    assert sample.unscorable is None
    sample, _ = await play(source, tool_chat, ["12"], index=1)
    assert sample.unscorable == "environment: Flaky() raised ConnectionError: sandbox refused"
    assert threading.main_thread().name not in built_on


async def test_a_class_that_cannot_be_built_is_refused_at_start_in_one_line():
    import trl_envs

    class Broken(trl_envs.SubmitEnv):
        def __init__(self):
            raise ValueError("needs an API key")

    source = source_of(Broken)
    with pytest.raises(ConfigError, match=r"^env.factory: Broken\(\) raised ValueError: needs an API key"):
        await source.start()


async def test_a_slow_tool_is_bounded_by_its_own_timeout_not_the_steps(tool_chat):
    """A tool call's time is the tool's, bounded by `tool_timeout_s`; its timeout is an error the
    model reads, as TRL does, and the step timeout does not count it."""
    import time

    import trl_envs

    class SlowTool(trl_envs.SubmitEnv):
        def lookup(self, key: str) -> str:
            """Look a key up.

            Args:
                key: What to look up.
            """
            time.sleep(0.7)
            return "found"

    source = source_of(SlowTool, step_timeout_s=0.5, tool_timeout_s=1.5)
    turns = [call("lookup", key="a"), call("submit", answer=12), "Done."]
    sample, _ = await play(source, tool_chat, turns)
    assert sample.unscorable is None, sample.unscorable
    assert "found" in tool_chat.tokenizer.decode(sample.completion_token_ids)
    assert sample.process_rewards[-1][1] == 1.0


def test_a_get_reward_that_is_not_callable_is_refused_at_start():
    import trl_envs

    class Scored(trl_envs.SubmitEnv):
        get_reward = 1.0

    with pytest.raises(ConfigError, match=r"env.factory: Scored.get_reward is float, expected a method"):
        load_classes(Scored, "env.factory")


@pytest.mark.timeout(120)
async def test_after_a_resume_reward_functions_get_the_environments_of_every_sample(tmp_path, chat):
    """Episodes that finished before the checkpoint cannot bring their instances back (an
    environment's state is not saved): they are played again, so reward functions reading
    `environments` never get None and no group is dropped for it."""
    import trl_envs

    from rollflow.checkpoint import latest_checkpoint, read_state

    seen = []

    def submitted(prompts, completions, environments, **kwargs):
        seen.append(list(environments))
        return [float(e.submitted is not None) for e in environments]

    from rollflow.envs.factory import EnvironmentFactory

    config = load_config(preset="tiny", overrides=[
        "run.max_steps=4", "sampling.max_tokens=8", "env.kind=factory", "env.max_turns=2", "env.max_tokens=48",
        'scoring.rewards=[{name = "submitted"}]', "run.max_lag=2"])

    made = iter(range(10**6))

    class Uneven(trl_envs.SubmitEnv):
        """After the first two steps' episodes, one in four is slow to reset, so the groups in
        flight at the stop hold finished episodes beside unfinished ones."""

        async def reset(self, **row):
            n = next(made)
            if n >= 32 and n % 4 == 3:
                await asyncio.sleep(2.0)
            return super().reset(**row)

    def make(**kwargs):
        return Controller(config, tmp_path, env=EnvironmentFactory(Uneven),
                          reward_funcs={"submitted": submitted},
                          given=Given(engine=FakeEngine(token_delay=0.002), trainer=FakeTrainer(),
                                      transport=NullTransport(), tokenizer=chat.tokenizer), **kwargs)

    first = make(on_step=lambda row: row["step"] == 1 and first.request_stop())
    assert (await asyncio.wait_for(first.run(), 100)).stopped
    state = read_state(latest_checkpoint(tmp_path))
    assert any(s.done is not None for g in state.in_flight for s in g.samples), "no finished episode was saved"
    seen.clear()
    resumed = await asyncio.wait_for(make(resume=True).run(), 100)
    assert resumed.steps == 2
    assert seen and all(isinstance(e, Uneven) for envs in seen for e in envs)
    import json

    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert not [e for e in ledger if e["outcome"] == "dropped" and "submitted" in json.dumps(e)]
