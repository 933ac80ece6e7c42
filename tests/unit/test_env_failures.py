"""The environment paths under failure: one odd episode, reward or item is that episode's or
that prompt's, with its reason, never the run's end, a hang or a silent wrong number. Each test
names the case it guards (docs/reliability.md lists them)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from rollflow.agent import AgentEpisode, run_agent
from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.controller.stall import StallWatch
from rollflow.envs import ChatFormat, EnvStep, EpisodeLimits, run_episode
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.scoring import Reward, Scorer
from rollflow.testing import FakeEngine, FakeTrainer, NullTransport, ScriptedTurns

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)
PROMPT = Prompt(id="p1", token_ids=[1, 2, 3], messages=[Message(role="user", content="What is 3 * 4?")], answer="12")

THINK_DROPPING = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A chat template that drops `<think>` blocks from earlier assistant turns, as Qwen3's does: a
conversation's rendering is then not an extension of its earlier rendering."""


@pytest.fixture
def thinking_chat():
    """The tiny model's tokenizer with a template that rewrites history (`THINK_DROPPING`)."""
    from rollflow.models import load_tokenizer, tiny_model_path

    tokenizer = load_tokenizer(tiny_model_path(0))
    tokenizer.chat_template = THINK_DROPPING
    return ChatFormat(tokenizer)


class Feedback:
    """Says "again" to every turn but the last, rewarding each turn with `reward`."""

    def __init__(self, turns: int = 2, reward: object = 0.5):
        self.turns, self.reward, self.seen = turns, reward, 0

    async def reset(self, prompt):
        return list(prompt.messages)

    async def step(self, turn):
        self.seen += 1
        done = self.seen >= self.turns
        return EnvStep(messages=[] if done else [Message(role="user", content="again")], reward=self.reward, done=done)


# ---- 1: a chat template that re-renders history -------------------------------------------------


async def test_a_template_that_drops_think_blocks_splits_the_episode_instead_of_ending_the_run(thinking_chat):
    chat = thinking_chat
    turns = ["<think>3 times 4</think>12", "<think>again?</think>12"]
    script = ScriptedTurns(chat, turns, version=2)
    sample = await run_episode(Feedback(turns=2), PROMPT, SPEC, script, chat, group_id="g", index=0,
                               limits=EpisodeLimits())
    assert sample.unscorable is None and sample.turns == 2
    eos = chat.tokenizer.eos_token_id
    # the first conversation, up to the template's rewrite, is a segment of its own
    (first,) = sample.segments
    assert first.completion_token_ids == [*chat.tokens(turns[0]), eos]
    assert first.prompt_token_ids == chat.tokens(chat.render(list(PROMPT.messages)))
    assert first.loss_mask == [1] * len(first.completion_token_ids)
    # the second starts from the template's own rendering of the conversation so far
    history = [*PROMPT.messages, Message(role="assistant", content=turns[0]), Message(role="user", content="again")]
    assert sample.prompt_token_ids == chat.tokens(chat.render(history)) == script.seen[1]
    assert sample.completion_token_ids == [*chat.tokens(turns[1]), eos]
    assert set(sample.versions) == {2} and set(first.versions) == {2}
    # both turns' rewards count, anchored on the last sequence
    assert sum(r for _, r in sample.process_rewards) == 1.0
    assert all(0 <= end < sample.num_tokens for end, _ in sample.process_rewards)


# ---- 2 and 3: one sample's odd reward is that sample's -----------------------------------------


async def test_one_raising_reasoning_gym_score_makes_only_its_sample_unscorable(monkeypatch):
    from rollflow.config import DataConfig
    from rollflow.sampler import Sampler
    from rollflow.scoring import builtin_reward
    from rollflow.tasks import parse_task
    from rollflow.tasks.reasoning_gym import task_for

    settings = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    config = DataConfig(task="reasoning_gym:chain_sum", task_config=settings, answer_from="last_number")
    prompt = Sampler(config, lambda messages: [1]).next()
    dataset = task_for(prompt.task, settings, "last_number")._dataset(0)
    real = type(dataset).score_answer

    def fussy(self, answer, entry):
        if answer == "666":
            raise RuntimeError("cursed")
        if answer == "777":
            return float("inf")
        if answer == "888":
            return 10**400
        return real(self, answer, entry)

    monkeypatch.setattr(type(dataset), "score_answer", fussy)
    scorer = Scorer([builtin_reward("verifier", parse_task(config))])
    try:
        scored = await scorer.score(prompt, [prompt.answer, "666", "777", "888", "1000"], [[1]] * 5)
    finally:
        await scorer.aclose()
    assert [s.reward for s in scored] == [1.0, None, None, None, 0.0]
    assert scored[1].reason == "reward verifier: raised RuntimeError: cursed"
    assert "score_answer returned inf" in scored[2].reason and "score_answer returned 1000" in scored[3].reason


def huge(prompts, completions, **kwargs):
    return [10**400, 1.0][: len(completions)]


async def test_a_reward_too_large_for_a_float_is_that_samples_reason():
    scorer = Scorer([Reward("huge", huge)])
    try:
        first, second = await scorer.score(PROMPT, ["a", "b"], [[1], [2]])
    finally:
        await scorer.aclose()
    assert first.reward is None and first.reason.startswith("reward huge: returned 1000")
    assert "expected a finite number" in first.reason
    assert second.reward == 1.0


async def test_an_environment_or_agent_reward_too_large_for_a_float_is_that_episodes_reason(chat, agent_server):
    script = ScriptedTurns(chat, ["12"])
    sample = await run_episode(Feedback(turns=1, reward=10**400), PROMPT, SPEC, script, chat, group_id="g", index=0,
                               limits=EpisodeLimits())
    assert sample.unscorable is not None and sample.unscorable.startswith("environment: step returned reward 1000")

    async def agent(task, base_url):
        return 10**400

    episode = AgentEpisode(PROMPT, SPEC, ScriptedTurns(chat, []), chat, EpisodeLimits())
    sample = await run_agent(agent, episode, agent_server, group_id="g", index=0, timeout_s=10)
    assert sample.unscorable is not None and sample.unscorable.startswith("agent: returned 1000")


# ---- 4: an environment class with start and aclose --------------------------------------------


class Lifecycle:
    """An episode's environment that happens to have `start` and `aclose` methods."""

    started = 0
    closed = 0

    async def start(self):
        Lifecycle.started += 1

    async def reset(self, prompt):
        return list(prompt.messages)

    async def step(self, turn):
        return EnvStep(reward=1.0 if "1" in turn.text else 0.0, done=True)

    async def aclose(self):
        Lifecycle.closed += 1


async def test_an_environment_class_with_start_and_aclose_is_an_episodes_environment(tmp_path, chat):
    config = load_config(preset="tiny", overrides=["run.max_steps=2", "sampling.max_tokens=6"])
    controller = Controller(
        config,
        tmp_path,
        env=Lifecycle,
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=chat.tokenizer),
    )
    result = await asyncio.wait_for(controller.run(), 60)
    assert result.steps == 2
    assert Lifecycle.started == 0 and Lifecycle.closed >= 2 * 4 * 4  # closed once per episode, never started


# ---- 6: the stall clock ------------------------------------------------------------------------


def test_a_filtered_group_after_a_slow_step_or_an_evaluation_does_not_stop_a_healthy_run():
    now = [0.0]
    fired: list[str] = []
    watch = StallWatch(16, 100.0, clock=lambda: now[0], on_stall=fired.append)
    watch.stepped()
    for t in (30.0, 60.0, 90.0, 120.0, 150.0):  # a slow step: groups keep reaching the buffer meanwhile
        now[0] = t
        watch.buffered()
    now[0] = 151.0
    watch.filtered("filtered: equal rewards")
    assert fired == []
    now[0] = 160.0
    watch.stepped()
    now[0] = 400.0  # an evaluation (or a checkpoint) took 240 s
    watch.restart_clock()
    watch.filtered("filtered: equal rewards")
    assert fired == []
    now[0] = 501.0  # then nothing but filtered groups for longer than the limit: that is a stall
    watch.filtered("filtered: equal rewards")
    assert len(fired) == 1 and "no step for 101 s" in fired[0]


# ---- 8: an environment's aclose that hangs -------------------------------------------------------


async def test_an_environment_whose_close_hangs_does_not_hold_its_episode(chat):
    class HangsOnClose(Feedback):
        async def aclose(self):
            await asyncio.sleep(60)

    began = time.monotonic()
    sample = await run_episode(HangsOnClose(turns=1, reward=1.0), PROMPT, SPEC, ScriptedTurns(chat, ["12"]), chat,
                               group_id="g", index=0, limits=EpisodeLimits(step_timeout_s=0.3))
    assert time.monotonic() - began < 5
    assert sample.unscorable is None and sample.process_rewards[-1][1] == 1.0


# ---- 10: an agent call still in flight when its episode ends ----------------------------------------


async def test_an_agent_call_that_outlives_its_episode_does_not_change_the_scored_sample(chat):
    release = asyncio.Event()
    script = ScriptedTurns(chat, ["12", "13"])

    async def slow_second_turn(token_ids, spec, n):
        if n == 1:
            await release.wait()
        return await script(token_ids, spec, n)

    episode = AgentEpisode(PROMPT, SPEC, slow_second_turn, chat, EpisodeLimits(max_tokens=512))
    messages = [{"role": "user", "content": "What is 3 * 4?"}]
    first = await episode.complete(messages)
    late = asyncio.ensure_future(
        episode.complete([*messages, {"role": "assistant", "content": first.content}, {"role": "user", "content": "?"}])
    )
    await asyncio.sleep(0.05)
    sample = episode.sample("g", 0, reward=1.0, failure=None)
    tokens, mask = list(sample.completion_token_ids), list(sample.loss_mask)
    release.set()
    from rollflow.agent import BadRequest

    with pytest.raises(BadRequest, match="episode has ended"):
        await late
    assert sample.completion_token_ids == tokens and sample.loss_mask == mask
    assert len(sample.completion_token_ids) == len(sample.versions) == len(sample.logprobs) == len(mask)


# ---- 11, 14, 15: reasoning-gym items made off the loop; one bad item is one dropped prompt ---------

RG = ['data.task="reasoning_gym:chain_sum"', 'data.answer_from="last_number"', "run.reward=verifier",
      "data.task_config={min_terms = 2, max_terms = 2, max_digits = 1}"]


def reasoning_gym_run(tmp_path, *overrides, max_steps=3):
    from rollflow.testing import FakeTokenizer

    config = load_config(preset="tiny", overrides=[*RG, f"run.max_steps={max_steps}", "sampling.max_tokens=6",
                                                   *overrides])
    return Controller(
        config,
        tmp_path,
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=FakeTokenizer()),
    )


async def test_reasoning_gym_chunks_are_made_off_the_event_loop(tmp_path, monkeypatch):
    import reasoning_gym

    import rollflow.tasks.reasoning_gym as rg

    make = reasoning_gym.create_dataset

    def slow(*args, **kwargs):
        time.sleep(0.6)  # a chunk of a slow dataset
        return make(*args, **kwargs)

    monkeypatch.setattr(rg, "CHUNK", 6)  # a new chunk every 6 prompts (and scoring asks for old ones)
    monkeypatch.setattr(rg, "DATASETS_KEPT", 2)
    monkeypatch.setattr(reasoning_gym, "create_dataset", slow)
    rg._cached.cache_clear()
    try:
        result = await asyncio.wait_for(reasoning_gym_run(tmp_path).run(), 120)
    finally:
        rg._cached.cache_clear()
    assert result.steps == 3
    worst = max(m["loop_lag_ms_max"] for m in result.metrics)
    assert worst < 300, f"the event loop stalled for {worst:.0f} ms"


async def test_an_item_that_cannot_be_made_drops_its_prompt_with_the_reason(tmp_path, monkeypatch):
    import json

    import rollflow.tasks.reasoning_gym as rg

    entry = rg.ReasoningGymTask.entry

    def cursed(self, seed, index):
        if index == 5:
            raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")
        return entry(self, seed, index)

    monkeypatch.setattr(rg.ReasoningGymTask, "entry", cursed)
    result = await asyncio.wait_for(reasoning_gym_run(tmp_path).run(), 60)
    assert result.steps == 3
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    (dropped,) = [e for e in ledger if e["id"] == "reasoning_gym:chain_sum-0-5"]
    assert dropped["outcome"] == "dropped"
    assert "item 5" in dropped["reason"] and "data.task_config" in dropped["reason"]
    assert "Exceeds the limit" in dropped["reason"]


def test_a_task_config_that_can_make_no_item_or_no_prompt_that_fits_is_refused_at_load():
    from rollflow.checks import check_task
    from rollflow.errors import ConfigError

    def check(task, settings):
        overrides = [f'data.task="reasoning_gym:{task}"', f"data.task_config={settings}"]
        check_task(load_config(preset="tiny", overrides=overrides))

    with pytest.raises(ConfigError, match=r"data.task_config: reasoning-gym's 'spell_backward' cannot make an item"):
        check("spell_backward", "{min_word_len = 100, max_word_len = 200}")
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"data.task_config: .*chain_sum' makes prompts of 7,0\d\d,\d\d\d characters"):
        check("chain_sum", "{min_terms = 1000000, max_terms = 1000000}")
    assert time.monotonic() - began < 30


# ---- 18: a module that exits while it loads --------------------------------------------------------


def test_a_module_that_calls_sys_exit_while_loading_is_refused_naming_the_field(tmp_path, monkeypatch):
    from rollflow.envs import load_environment
    from rollflow.errors import ConfigError

    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"env.name: importing 'exits_at_import' called sys.exit\(0\)"):
        load_environment("exits_at_import:Env")


# ---- 19, 20: eval and generate score what a run trains, and drop what cannot fit -----------------


def test_generate_refuses_a_config_whose_samples_are_episodes_and_eval_plays_them(
        tmp_path, capsys, monkeypatch, example_environments):
    from rollflow.cli import main

    monkeypatch.setenv("ROLLFLOW_NO_UVLOOP", "1")  # the command line's loop policy would outlive the test

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "config.toml").write_text('[env]\nkind = "verifiers"\nenvironment = "vf-sums"\n')
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr("rollflow.models.resolve_model", no_model)  # refused before any model or engine loads
    assert main(["generate", "--run", str(run)]) == 2
    assert "([env] kind = 'verifiers')" in capsys.readouterr().err
    unreachable = ["--preset", "tiny", "--set", "env.kind=openenv",
                   "--set", "env.client=openenv_sums:SumsClient", "--set", "env.url=http://127.0.0.1:9"]
    assert main(["generate", *unreachable]) == 2
    err = capsys.readouterr().err
    assert "([env] kind = 'openenv')" in err and "single-turn" in err and "use eval" in err
    # eval plays the episodes: it starts the source first, so an unreachable server is named at once
    assert main(["eval", *unreachable]) == 2
    err = capsys.readouterr().err
    assert "no OpenEnv server answers at http://127.0.0.1:9" in err and "preparing model" not in err


class RefusingEngine(FakeEngine):
    """Refuses a prompt that leaves no room in its context, as vLLM does."""

    async def stream(self, request_id, prompt_token_ids, sampling, *args, **kwargs):
        from rollflow.errors import RequestRefused

        if len(prompt_token_ids) >= 64:
            raise RequestRefused(f"request {request_id}: the engine refused it: too long")
        async for output in super().stream(request_id, prompt_token_ids, sampling, *args, **kwargs):
            yield output


async def test_eval_drops_held_out_prompts_too_long_for_the_context_and_says_how_many(tmp_path):
    import json

    from rollflow.evaluate import held_out_prompts, held_out_report
    from rollflow.testing import FakeTokenizer

    rows = [{"prompt": "x" * (200 if i % 3 == 0 else 5) + str(i), "answer": "1"} for i in range(9)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(preset="tiny", overrides=['data.task="jsonl"', f'data.paths=["{data}"]',
                                                   "engine.max_model_len=64", "run.reward=verifier"])
    prompts = await held_out_prompts(config, FakeTokenizer(), 9)
    report = await held_out_report(RefusingEngine(), config, FakeTokenizer(), prompts, 2)
    assert report["prompts"] == 6 and report["dropped"] == 3
    (reason,) = report["dropped_reasons"]
    assert reason.startswith("prompt too long: 2") and "engine.max_model_len = 64" in reason


# ---- 23: an example run again writes a new folder ------------------------------------------------


def test_a_new_run_dir_is_new_each_time_and_every_training_example_uses_one(tmp_path, request):
    import re

    import rollflow

    first, second = rollflow.new_run_dir("demo", tmp_path), rollflow.new_run_dir("demo", tmp_path)
    assert first != second and first.is_dir() and second.is_dir()
    assert re.fullmatch(r"demo-\d{8}-\d{6}(-\d+)?", second.name)
    for example in sorted((request.config.rootpath / "examples").glob("*.py")):
        text = example.read_text()
        assert not re.search(r"rollflow\.train\(\s*config,\s*f?\"runs/", text), f"{example.name}: a fixed folder"


@pytest.mark.parametrize(
    ("kind", "field", "spec"),
    [("agent", "env.function", "broken_at_import:agent"), ("factory", "env.factory", "broken_at_import:Env"),
     ("openenv", "env.client", "broken_at_import:Client")],
)
def test_a_module_that_raises_while_imported_is_refused_in_one_line_with_exit_2(tmp_path, kind, field, spec):
    """A module named by `env.function`, `env.factory` or `env.client` with a bug at import: one
    line naming the field, the module and the error, exit 2 (not a traceback)."""
    import subprocess
    import sys

    (tmp_path / "broken_at_import.py").write_text("import os\nLIMIT = 1 / 0\n")
    extra = ["--set", "env.url=http://127.0.0.1:9"] if kind == "openenv" else []
    done = subprocess.run(
        [sys.executable, "-m", "rollflow", "train", "--preset", "tiny", "--output-dir", str(tmp_path / "run"),
         "--set", f"env.kind={kind}", "--set", f"{field}={spec}", *extra],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert field in lines[0] and "broken_at_import" in lines[0] and "ZeroDivisionError: division by zero" in lines[0]


async def test_an_environment_class_whose_constructor_raises_makes_only_its_episode_unscorable(chat):
    """`kind = "tool"` (or `env=`): a new environment per episode; a constructor that raises is
    that episode's failure, made off the event loop; the next episode is played."""
    import threading

    from rollflow.config import ToolEnvConfig
    from rollflow.envs import EnvironmentEpisodes
    from rollflow.episodes import EpisodeContext

    built_on: list[str] = []

    class Flaky(Feedback):
        made = 0

        def __init__(self):
            super().__init__(turns=1, reward=1.0)
            built_on.append(threading.current_thread().name)
            Flaky.made += 1
            if Flaky.made == 1:
                raise ConnectionError("no sandbox")

    source = EnvironmentEpisodes(Flaky, ToolEnvConfig())
    context = EpisodeContext(chat=chat, sampling=SPEC, max_model_len=1024)
    failed = await source.play(PROMPT, group_id="g", index=0, generate=ScriptedTurns(chat, ["12"]), context=context)
    assert failed.unscorable == "environment: Flaky() raised ConnectionError: no sandbox"
    played = await source.play(PROMPT, group_id="g", index=1, generate=ScriptedTurns(chat, ["12"]), context=context)
    assert played.unscorable is None and played.process_rewards[-1][1] == 1.0
    assert threading.main_thread().name not in built_on


async def test_an_environment_class_that_cannot_be_built_is_refused_at_start_in_one_line():
    from rollflow.config import ToolEnvConfig
    from rollflow.envs import EnvironmentEpisodes
    from rollflow.errors import ConfigError

    class Broken(Feedback):
        def __init__(self):
            raise ValueError("needs an API key")

    with pytest.raises(ConfigError, match=r"^env: Broken\(\) raised ValueError: needs an API key$"):
        await EnvironmentEpisodes(Broken, ToolEnvConfig()).start()
