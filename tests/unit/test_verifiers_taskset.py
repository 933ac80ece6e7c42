"""verifiers v1 tasksets (`[env] kind = "verifiers"`, `taskset = "ID"`) with scripted model turns
and the tiny model's real tokenizer: the real verifiers package loads the taskset and its tasks
score the episode's `vf.Trace` with their own rewards and metrics; what cannot be trained here is
refused at start naming it, and a task that cannot score makes its episode unscorable with the
reason. Training real vLLM on a taskset is in tests/integration/test_environments.py."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from rollflow.config import Config, VerifiersEnvConfig, load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.episodes import EpisodeContext
from rollflow.errors import ConfigError
from rollflow.records import Prompt, SamplingSpec
from rollflow.sources import episode_source
from rollflow.testing import FakeEngine, FakeTrainer, NullTransport, ScriptedTurns
from rollflow.verifiers.tasksets import TasksetEpisodes

pytestmark = pytest.mark.usefixtures("example_environments")

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)


def source(**settings) -> TasksetEpisodes:
    return TasksetEpisodes(VerifiersEnvConfig(**settings), "tiny")


def prompt_of(episodes: TasksetEpisodes, i: int) -> Prompt:
    row = episodes.rows()[i]
    return Prompt(id=row.id, token_ids=[1], messages=row.messages, answer=row.answer, task=row.task,
                  metadata=row.metadata)


async def play(episodes, chat, turns, i=0, timeout_s=30.0, **limits):
    context = EpisodeContext(chat=chat, sampling=SPEC, max_model_len=1024)
    episodes.settings = VerifiersEnvConfig(taskset=episodes.settings.taskset, step_timeout_s=timeout_s, **limits)
    return await episodes.play(prompt_of(episodes, i), group_id="g0", index=0, generate=ScriptedTurns(chat, turns),
                               context=context)


def test_the_tasks_become_rows_with_stable_ids_and_their_own_prompts():
    episodes = source(taskset="sums-taskset", taskset_args={"n": 5})
    rows = episodes.rows()
    assert len(rows) == 5 and len({r.id for r in rows}) == 5
    assert all(r.id.startswith("sums-taskset-") and r.task == "sums-taskset" for r in rows)
    assert [m.role for m in rows[0].messages] == ["system", "user"]
    assert rows[0].messages[0].content == "Answer with a number." and rows[0].messages[1].content.startswith("What is")
    assert [r.id for r in source(taskset="sums-taskset", taskset_args={"n": 5}).rows()] == [r.id for r in rows]
    assert [r.id for r in source(taskset="sums-taskset", taskset_args={"n": 3}, max_tasks=2).rows()] == [
        r.id for r in rows[:2]]


@pytest.mark.parametrize(("right", "reward"), [(True, 1.5), (False, 0.0)])
async def test_an_episode_is_scored_by_its_task_with_its_rewards_weights_and_metrics(chat, right, reward):
    episodes = source(taskset="sums-taskset", taskset_args={"n": 4})
    answer = episodes.rows()[0].answer
    text = answer if right else "none"
    sample = await play(episodes, chat, [text])
    assert sample.unscorable is None and sample.env_reward == "sums-taskset"
    # correct (weight 1) + digits share (weight 0.5): the answer is all digits, "none" has none
    assert sample.process_rewards == [(sample.num_tokens - 1, reward)]
    assert sample.env_metrics == {"correct": float(right), "digits": float(right), "reply_chars": float(len(text))}
    assert sample.completion_token_ids == [*chat.tokens(text), chat.tokenizer.eos_token_id]
    assert sample.turns == 1 and sample.loss_mask == [1] * sample.num_tokens


TASKSETS = {
    "ts_bad_rewards": """
        import math
        import verifiers.v1 as vf

        class Data(vf.TaskData):
            mode: str

        class BadTask(vf.Task[Data, vf.State, vf.TaskConfig]):
            @vf.reward
            async def judged(self, task: Data) -> float:
                if task.mode == "raise":
                    raise RuntimeError("judge offline")
                if task.mode == "nan":
                    return math.nan
                if task.mode == "hang":
                    import asyncio
                    await asyncio.sleep(60)
                return 1.0

        class BadTaskset(vf.Taskset[BadTask, vf.TasksetConfig]):
            def load(self):
                for i, mode in enumerate(["raise", "nan", "hang", "fine"]):
                    yield BadTask(Data(idx=i, prompt=f"mode {mode}", mode=mode), self.config.task)

        __all__ = ["BadTaskset"]
    """,
    "ts_runtime_only": """
        import verifiers.v1 as vf

        class SandboxTask(vf.Task):
            @vf.reward
            async def tests_pass(self, trace: vf.Trace, runtime) -> float:
                return 1.0

        class SandboxTaskset(vf.Taskset[SandboxTask, vf.TasksetConfig]):
            def load(self):
                yield SandboxTask(vf.TaskData(idx=0, prompt="write code"), self.config.task)

        __all__ = ["SandboxTaskset"]
    """,
    "ts_infinite": """
        import itertools
        import verifiers.v1 as vf

        class Forever(vf.Taskset[vf.Task, vf.TasksetConfig]):
            INFINITE = True

            def load(self):
                for i in itertools.count():
                    yield vf.Task(vf.TaskData(idx=i, prompt=f"task {i}"), self.config.task)

        __all__ = ["Forever"]
    """,
    "ts_raises": """
        import verifiers.v1 as vf

        class Broken(vf.Taskset[vf.Task, vf.TasksetConfig]):
            def load(self):
                raise FileNotFoundError("data/train.parquet")
                yield

        __all__ = ["Broken"]
    """,
    "ts_no_all": """
        import verifiers.v1 as vf

        class Lonely(vf.Taskset[vf.Task, vf.TasksetConfig]):
            def load(self):
                return []
    """,
    "ts_multi_turn": """
        import verifiers.v1 as vf

        class Game(vf.Taskset[vf.Task, vf.TasksetConfig]):
            def load(self):
                yield vf.Task(vf.TaskData(idx=0, prompt="play"), self.config.task)

        class GameEnv(vf.Env):
            async def run(self, task, agents):
                pass

        __all__ = ["Game", "GameEnv"]
    """,
    "ts_own_harness": """
        import verifiers.v1 as vf

        class Repo(vf.Taskset[vf.Task, vf.TasksetConfig]):
            def load(self):
                yield vf.Task(vf.TaskData(idx=0, prompt="fix the bug"), self.config.task)

        class RepoHarness(vf.Harness):
            pass

        __all__ = ["Repo", "RepoHarness"]
    """,
    "ts_tools": """
        import verifiers.v1 as vf

        class Shared(vf.Toolset[vf.ToolsetConfig, vf.State]):
            TOOL_PREFIX = None  # advertised bare

            @vf.tool
            def lookup(self, key: str) -> str:
                \"\"\"Look a key up.\"\"\"
                return {"pi": "3.14"}[key]

        class Own(vf.Toolset[vf.ToolsetConfig, vf.State]):
            @vf.tool
            async def echo(self, text: str) -> str:
                \"\"\"Say it back.\"\"\"
                return f"{self.prompt}/{text}"

            @vf.tool
            def wait(self, seconds: float) -> str:
                \"\"\"Block for a while (a sync tool).\"\"\"
                import time
                time.sleep(seconds)
                return self.prompt

            async def setup_task(self, task) -> None:  # the task's data, as verifiers hands it
                if task.prompt == "broken setup":
                    raise OSError("the index is missing")
                self.prompt = task.prompt

        class ToolTask(vf.Task):
            @classmethod
            def toolsets(cls, config):
                return [Own(vf.ToolsetConfig())]

            @vf.reward
            async def results(self, trace: vf.Trace) -> float:
                return float(len(trace.tool_messages))

        class ToolTasks(vf.Taskset[ToolTask, vf.TasksetConfig]):
            @classmethod
            def toolsets(cls, config):
                return [Shared(vf.ToolsetConfig())]

            def load(self):
                for i, prompt in enumerate(["look things up", "broken setup", "another task"]):
                    yield ToolTask(vf.TaskData(idx=i, prompt=prompt), self.config.task)

        __all__ = ["ToolTasks"]
    """,
    "ts_closing_tools": """
        import contextlib

        import verifiers.v1 as vf

        OPENED, CLOSED = [], []

        class Held(vf.Toolset[vf.ToolsetConfig, vf.State]):
            @vf.tool
            def peek(self) -> str:
                \"\"\"What this episode's toolset holds.\"\"\"
                return self.prompt

            async def setup_task(self, task) -> None:
                self.prompt = task.prompt
                OPENED.append(task.prompt)

                @contextlib.asynccontextmanager
                async def held():  # a sandbox, a connection: what verifiers closes with its exit stack
                    yield
                    CLOSED.append(task.prompt)

                await self._exit_stack.enter_async_context(held())

        class HeldTask(vf.Task):
            @classmethod
            def toolsets(cls, config):
                return [Held(vf.ToolsetConfig())]

            @vf.reward
            async def done(self, trace: vf.Trace) -> float:
                return 1.0

        class HeldTasks(vf.Taskset[HeldTask, vf.TasksetConfig]):
            def load(self):
                for i, prompt in enumerate(["first", "second"]):
                    yield HeldTask(vf.TaskData(idx=i, prompt=prompt), self.config.task)

        __all__ = ["HeldTasks"]
    """,
    "ts_stateful_tools": """
        import verifiers.v1 as vf

        class Counts(vf.State):
            calls: int = 0

        class Counter(vf.Toolset[vf.ToolsetConfig, Counts]):
            TOOL_PREFIX = None

            @vf.tool
            def bump(self) -> str:
                \"\"\"Count.\"\"\"
                self.state.calls += 1
                return str(self.state.calls)

            @vf.tool
            async def peek(self) -> str:
                \"\"\"The count so far.\"\"\"
                return f"count {self.state.calls}"

        class CountConfig(vf.TasksetConfig):
            url: str = ""

        class CountTask(vf.Task[vf.TaskData, Counts, vf.TaskConfig]):
            @classmethod
            def toolsets(cls, config):
                return [Counter(vf.ToolsetConfig())]

            @vf.reward
            async def counted(self, trace: vf.Trace) -> float:
                return float(trace.state.calls)

        class CountTasks(vf.Taskset[CountTask, CountConfig]):
            @classmethod
            def toolsets(cls, config):
                return [Counter(vf.ToolsetConfig(url=config.url))] if config.url else []

            def load(self):
                for i in range(2):
                    yield CountTask(vf.TaskData(idx=i, prompt=f"count {i}"), self.config.task)

        __all__ = ["CountTasks"]
    """,
    "ts_remote_tools": """
        import verifiers.v1 as vf

        class Search(vf.Toolset[vf.ToolsetConfig, vf.State]):
            @vf.tool
            def search(self, query: str) -> str:
                \"\"\"Search the index.\"\"\"
                if query == "nothing":
                    raise LookupError("no results")
                return f"3 results for {query}"

        class SearchConfig(vf.TasksetConfig):
            url: str = ""

        class SearchTask(vf.Task):
            @vf.reward
            async def searched(self, trace: vf.Trace) -> float:
                return float(len(trace.tool_messages))

        class SearchTasks(vf.Taskset[SearchTask, SearchConfig]):
            @classmethod
            def toolsets(cls, config):
                return [Search(vf.ToolsetConfig(url=config.url))]

            def load(self):
                yield SearchTask(vf.TaskData(idx=0, prompt="search"), self.config.task)

        __all__ = ["SearchTasks", "Search"]
    """,
    "ts_stops": """
        import verifiers.v1 as vf

        class Lookup(vf.Toolset[vf.ToolsetConfig, vf.State]):
            TOOL_PREFIX = None

            @vf.tool
            def lookup(self, key: str) -> str:
                \"\"\"Look a key up.\"\"\"
                return key.upper()

        class StopTask(vf.Task):
            @classmethod
            def toolsets(cls, config):
                return [Lookup(vf.ToolsetConfig())]

            @vf.stop
            async def submitted(self, response: vf.Response) -> bool:
                return "SUBMIT" in (response.message.content or "")

            @vf.stop
            async def two_turns(self, trace: vf.Trace) -> bool:
                return len(trace.assistant_messages) >= 2

            @vf.reward
            async def turns(self, trace: vf.Trace) -> float:
                return float(trace.num_turns)

            @vf.metric
            async def by_submit(self, trace: vf.Trace) -> float:
                return float(trace.stop_condition == "submitted")

        class StopTasks(vf.Taskset[StopTask, vf.TasksetConfig]):
            def load(self):
                yield StopTask(vf.TaskData(idx=0, prompt="find it"), self.config.task)

        __all__ = ["StopTasks"]
    """,
    "ts_intercept": """
        import verifiers.v1 as vf

        class Rewriting(vf.Task):
            @vf.intercept
            async def shorten(self, response: vf.Response) -> vf.Response:
                return response

        class RewriteTasks(vf.Taskset[Rewriting, vf.TasksetConfig]):
            def load(self):
                yield Rewriting(vf.TaskData(idx=0, prompt="go"), self.config.task)

        __all__ = ["RewriteTasks"]
    """,
    "ts_request_stop": """
        import verifiers.v1 as vf

        class Watching(vf.Task):
            @vf.stop
            async def long_prompt(self, request: vf.Request) -> bool:
                return False

        class WatchTasks(vf.Taskset[Watching, vf.TasksetConfig]):
            def load(self):
                yield Watching(vf.TaskData(idx=0, prompt="go"), self.config.task)

        __all__ = ["WatchTasks"]
    """,
    "ts_container_tools": """
        import verifiers.v1 as vf

        class Browser(vf.Toolset[vf.ToolsetConfig, vf.State]):
            @vf.tool
            def open(self, url: str) -> str:
                \"\"\"Open a page.\"\"\"
                return ""

        class BrowseTasks(vf.Taskset[vf.Task, vf.TasksetConfig]):
            @classmethod
            def toolsets(cls, config):
                return [Browser(vf.ToolsetConfig(runtime=vf.DockerConfig(image="browser:latest")))]

            def load(self):
                yield vf.Task(vf.TaskData(idx=0, prompt="browse"), self.config.task)

        __all__ = ["BrowseTasks"]
    """,
}


@pytest.fixture
def tasksets(tmp_path, monkeypatch):
    for name, code in TASKSETS.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in TASKSETS:
        sys.modules.pop(name, None)


@pytest.mark.usefixtures("tasksets")
async def test_a_reward_that_raises_is_not_finite_or_hangs_makes_only_its_episode_unscorable(chat):
    episodes = source(taskset="ts-bad-rewards")
    reasons = [(await play(episodes, chat, ["4"], i=i, timeout_s=1.0)).unscorable for i in range(4)]
    assert "judge offline" in reasons[0] and "RuntimeError" in reasons[0]
    assert "reward judged gave nan (float), expected a finite number" in reasons[1]
    assert "timed out after 1 s" in reasons[2]
    assert reasons[3] is None


@pytest.mark.usefixtures("tasksets")
async def test_a_task_whose_rewards_all_need_a_runtime_is_unscorable_saying_so(chat):
    sample = await play(source(taskset="ts-runtime-only"), chat, ["done"])
    assert sample.reward is None and "has no reward that runs without a runtime" in sample.unscorable


@pytest.mark.usefixtures("tasksets")
@pytest.mark.parametrize(("settings", "wanted"), [
    ({"taskset": "sums-taskzet"}, "no verifiers taskset 'sums-taskzet' is installed (no module 'sums_taskzet'); "
                                  "did you mean 'sums_taskset'"),
    ({"taskset": "sums-taskset", "taskset_args": {"n": "many"}}, "env.taskset_args: not a valid SumsConfig"),
    ({"taskset": "ts-infinite"}, "'ts-infinite' is infinite: give env.max_tasks"),
    ({"taskset": "ts-raises"}, "loading 'ts-raises''s tasks raised FileNotFoundError: data/train.parquet"),
    ({"taskset": "ts-no-all"}, "defines no `__all__`"),
    ({"taskset": "ts-own-harness"}, "'ts-own-harness' ships its own harness (ts-own-harness), a program"),
    ({"taskset": "ts-stateful-tools", "taskset_args": {"url": "http://127.0.0.1:9/mcp"}},
     "its toolset Counter keeps state across calls (Counts) and runs at a URL"),
    ({"taskset": "ts-container-tools"}, "its toolset Browser runs in a DockerConfig runtime"),
    ({"taskset": "ts-intercept"}, "its tasks' @vf.intercept hooks (shorten) rewrite model calls"),
    ({"taskset": "ts-request-stop"}, "its @vf.stop long_prompt reads the model request"),
])
def test_what_cannot_be_trained_is_refused_at_start_naming_it(settings, wanted):
    with pytest.raises(ConfigError) as err:
        source(**settings)
    assert wanted in str(err.value)


def test_an_infinite_taskset_reads_max_tasks(tasksets):
    assert len(source(taskset="ts-infinite", max_tasks=7).rows()) == 7


def test_the_config_takes_one_of_environment_and_taskset():
    for env in ('kind = "verifiers"', 'kind = "verifiers"\nenvironment = "vf-sums"\ntaskset = "sums-taskset"'):
        config = load_config(preset="tiny", overrides=[])
        settings = msgspec_env(env)
        with pytest.raises(ConfigError, match="needs one of environment"):
            episode_source(Config(model=config.model, env=settings))


def msgspec_env(text: str):
    import msgspec

    return msgspec.convert(msgspec.toml.decode(text.encode()), VerifiersEnvConfig)


async def test_a_run_trains_on_a_taskset_with_its_rewards_and_metrics_in_the_step_metrics(tmp_path, chat):
    config = load_config(preset="tiny", overrides=[
        "run.max_steps=2", "sampling.max_tokens=8", "env.kind=verifiers", "env.taskset=sums-taskset",
        "env.taskset_args={n = 8}"])
    controller = Controller(config, tmp_path, given=Given(engine=FakeEngine(), trainer=FakeTrainer(),
                                                          transport=NullTransport(), tokenizer=chat.tokenizer))
    result = await asyncio.wait_for(controller.run(), 100)
    assert result.steps == 2
    assert set(result.metrics[0]["rewards"]) == {"sums-taskset"}
    assert set(result.metrics[0]["env_metrics"]) == {"correct", "digits", "reply_chars"}


async def test_held_out_tasks_are_never_trained_and_are_evaluated_as_episodes_with_the_version_measured(
        tmp_path, chat):
    """`run.eval_prompts` holds out the taskset's last tasks: evaluated before, during
    (`run.eval_every`) and after training, scored by their tasks, never in a trained group."""
    import json

    config = load_config(preset="tiny", overrides=[
        "run.max_steps=2", "sampling.max_tokens=8", "env.kind=verifiers", "env.taskset=sums-taskset",
        "env.taskset_args={n = 10}", "run.eval_prompts=3", "run.eval_every=1", "run.groups_per_step=2"])
    held_out = {r.id for r in source(taskset="sums-taskset", taskset_args={"n": 10}).rows()[-3:]}
    controller = Controller(config, tmp_path, given=Given(engine=FakeEngine(), trainer=FakeTrainer(),
                                                          transport=NullTransport(), tokenizer=chat.tokenizer))
    result = await asyncio.wait_for(controller.run(), 100)
    assert result.eval_before.prompts == 3 and result.eval_after.prompts == 3
    assert result.eval_before.versions == [0] and result.eval_after.versions == [2]
    assert result.eval_before.unscorable == 0 and 0 <= result.eval_after.accuracy <= 1.5
    assert result.metrics[0]["eval_accuracy"] is not None and result.metrics[0]["eval_version"] == 1
    trained = {json.loads(line)["id"].split("@")[0] for line in (tmp_path / "ledger.jsonl").open()}
    assert trained and not trained & held_out


async def test_holding_out_every_task_is_refused_naming_the_setting(tmp_path, chat):
    config = load_config(preset="tiny", overrides=[
        "env.kind=verifiers", "env.taskset=sums-taskset", "env.taskset_args={n = 3}", "run.eval_prompts=3"])
    controller = Controller(config, tmp_path, given=Given(engine=FakeEngine(), trainer=FakeTrainer(),
                                                          transport=NullTransport(), tokenizer=chat.tokenizer))
    with pytest.raises(ConfigError, match=r"run.eval_prompts: \[env\] kind = 'verifiers' brings 3 prompts"):
        await asyncio.wait_for(controller.run(), 100)


def test_a_classic_environment_runs_on_the_legacy_api_and_is_refused_where_there_is_none():
    """verifiers 0.3 keeps the classic API (`verifiers.legacy`); 0.4 has only v1, so a classic
    environment is refused in one line naming the installed version (CI runs this file with both)."""
    from importlib import metadata

    from rollflow.verifiers.environments import VerifiersEnv, _version_tuple

    version = metadata.version("verifiers")
    if _version_tuple(version) >= (0, 4):
        with pytest.raises(ConfigError, match=rf"verifiers {version} is installed; rollflow trains environments"):
            VerifiersEnv("vf-sums")
    else:
        assert len(VerifiersEnv("vf-sums", {"n": 2}).rows()) == 2


def call(name: str, **arguments) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


async def test_a_task_with_tools_is_a_tool_loop_served_in_process_and_scored_on_its_whole_trace(chat):
    """calc-taskset: the task's Calculator toolset, as verifiers names its tools; each call's result
    comes back as a tool message (in the sequence, out of the loss), a bad call's error too, and the
    task scores the trace of every turn."""
    episodes = source(taskset="calc-taskset", taskset_args={"n": 2}, max_tokens=900)
    await episodes.start()
    row = episodes.rows()[0]
    a, b, c = (int(n) for n in row.messages[-1].content.removeprefix("What is ").rstrip("?").replace("×", "+")
               .split("+"))
    turns = [call("calculator_multiply", a=a, b=b), call("calculator_add", a=a * b, b="c"),
             call("calculator_add", a=a * b, b=c), f"The answer is {a * b + c}."]
    sample = await play(episodes, chat, turns, max_tokens=900)
    assert sample.unscorable is None and sample.turns == 4
    assert sample.env_metrics["correct"] == 1.0 and sample.env_metrics["tool_calls"] == 3.0
    assert sample.env_metrics["used_tools"] == 2 / 4  # two results without an error over four turns
    assert sample.process_rewards == [(sample.num_tokens - 1, 1.0 + 0.25 * 2 / 4)]
    text = chat.tokenizer.decode
    tool_text = text([t for t, m in zip(sample.completion_token_ids, sample.loss_mask, strict=True) if m == 0])
    model_text = text([t for t, m in zip(sample.completion_token_ids, sample.loss_mask, strict=True) if m == 1],
                      skip_special_tokens=True)
    assert str(a * b) in tool_text and str(a * b + c) in tool_text and "validation error" in tool_text
    assert model_text == "".join(turns)


@pytest.mark.usefixtures("tasksets")
async def test_the_tasksets_own_tools_and_the_tasks_are_both_there_and_errors_reach_the_model(chat):
    episodes = source(taskset="ts-tools")
    await episodes.start()
    turns = [call("lookup", key="pi"), call("lookup", key="e"), call("own_echo", text="hi"), call("nope"), "done"]
    sample = await play(episodes, chat, turns, max_tokens=900, max_turns=5)
    tool_text = chat.tokenizer.decode([t for t, m in zip(sample.completion_token_ids, sample.loss_mask,
                                                         strict=True) if m == 0])
    assert sample.unscorable is None and sample.turns == 5
    assert "3.14" in tool_text and "error: Error executing tool lookup: 'e'" in tool_text and "hi" in tool_text
    assert "error: unknown tool 'nope' (tools: lookup, own_echo, own_wait)" in tool_text
    assert sample.process_rewards == [(sample.num_tokens - 1, 4.0)]  # four tool results in the trace


@pytest.mark.usefixtures("tasksets")
async def test_a_tool_loop_cut_by_the_turn_limit_is_scored_as_it_stands_and_a_failed_setup_is_unscorable(chat):
    episodes = source(taskset="ts-tools")
    await episodes.start()
    sample = await play(episodes, chat, [call("lookup", key="pi"), call("lookup", key="pi"), "never"],
                        max_tokens=900, max_turns=2)
    assert sample.unscorable is None and sample.turns == 2
    assert sample.process_rewards == [(sample.num_tokens - 1, 1.0)]  # the second call's result came after the last turn
    broken = await play(episodes, chat, ["never"], i=1)
    assert broken.unscorable == "environment: setting up the task's toolsets raised OSError: the index is missing"
    assert broken.completion_token_ids == []


@pytest.mark.usefixtures("tasksets")
async def test_a_stateful_toolset_shares_its_episodes_state_which_the_task_scores(chat):
    """As verifiers' state channel does: each call reads the episode's state as the toolset's type
    and writes back what it changed; the task's reward reads it on the trace; episodes never share it."""
    episodes = source(taskset="ts-stateful-tools")
    await episodes.start()
    one, two = await asyncio.gather(
        play(episodes, chat, [call("bump"), call("bump"), call("peek"), "done"], max_tokens=900, max_turns=5),
        play(episodes, chat, [call("bump"), "done"], i=1, max_tokens=900, max_turns=5),
    )
    results = [t for t, m in zip(one.completion_token_ids, one.loss_mask, strict=True) if m == 0]
    tool_text = chat.tokenizer.decode(results)
    assert one.unscorable is None and two.unscorable is None
    assert "count 2" in tool_text  # the async tool saw the sync tool's writes
    assert one.process_rewards == [(one.num_tokens - 1, 2.0)] and two.process_rewards == [(two.num_tokens - 1, 1.0)]


@pytest.fixture
def search_server(tasksets, tmp_path):
    """ts_remote_tools's Search toolset served as verifiers serves a toolset (its own MCP server
    program, streamable HTTP on 127.0.0.1), in a subprocess; yields its URL."""
    import os
    import subprocess
    import time

    port_file = tmp_path / "port"
    env = os.environ | {"MCP_PORT_FILE": str(port_file), "VF_CONFIG": "{}",
                        "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", "from ts_remote_tools import Search; Search.run()"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the MCP server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_toolset_at_a_url_is_called_there_over_mcp(chat, search_server):
    episodes = source(taskset="ts-remote-tools", taskset_args={"url": search_server})
    for _ in range(100):  # the server binds its port before it answers
        try:
            await episodes.start()
            break
        except ConfigError:
            await asyncio.sleep(0.1)
    assert [t["function"]["name"] for t in episodes.shared.schemas] == ["search_search"]
    assert episodes.shared.schemas[0]["function"]["description"] == "Search the index."
    turns = [call("search_search", query="cats"), call("search_search", query="nothing"), "done"]
    sample = await play(episodes, chat, turns, max_tokens=900)
    tool_text = chat.tokenizer.decode([t for t, m in zip(sample.completion_token_ids, sample.loss_mask,
                                                         strict=True) if m == 0])
    assert sample.unscorable is None and sample.turns == 3
    assert "3 results for cats" in tool_text and "error: Error executing tool search: no results" in tool_text
    assert sample.process_rewards == [(sample.num_tokens - 1, 2.0)]


@pytest.mark.usefixtures("tasksets")
async def test_concurrent_episodes_call_their_own_toolset_instances_and_a_sync_tool_never_holds_the_loop(chat):
    """Each episode's task toolset is its own instance (set up for its task), though the class's tools
    are registered once; a blocking sync tool runs on a worker thread."""
    episodes = source(taskset="ts-tools")
    await episodes.start()
    gaps, ticking = [], True

    async def ticker():
        last = asyncio.get_running_loop().time()
        while ticking:
            await asyncio.sleep(0.01)
            now = asyncio.get_running_loop().time()
            gaps.append(now - last)
            last = now

    clock = asyncio.create_task(ticker())
    one, two = await asyncio.gather(
        play(episodes, chat, [call("own_wait", seconds=0.6), "done"], i=0, max_tokens=900),
        play(episodes, chat, [call("own_echo", text="x"), "done"], i=2, max_tokens=900),
    )
    ticking = False
    await clock
    texts = [chat.tokenizer.decode([t for t, m in zip(s.completion_token_ids, s.loss_mask, strict=True) if m == 0])
             for s in (one, two)]
    assert "look things up" in texts[0] and "another task/x" in texts[1] and "another task" not in texts[0]
    assert max(gaps) < 0.4, f"the event loop was held {max(gaps):.2f} s"


@pytest.mark.usefixtures("tasksets")
async def test_the_tasks_stops_end_the_loop_on_a_response_or_on_the_trace_before_the_next_turn(chat):
    episodes = source(taskset="ts-stops")
    submitted = await play(episodes, chat, [f"SUBMIT {call('lookup', key='a')}", "never"], max_tokens=900)
    assert submitted.unscorable is None and submitted.turns == 1 and set(submitted.loss_mask) == {1}  # no tool ran
    assert submitted.process_rewards == [(submitted.num_tokens - 1, 1.0)] and submitted.env_metrics["by_submit"] == 1
    looked = await play(episodes, chat, [call("lookup", key="a"), call("lookup", key="b"), "never"], max_tokens=900)
    tool_text = chat.tokenizer.decode([t for t, m in zip(looked.completion_token_ids, looked.loss_mask,
                                                         strict=True) if m == 0])
    assert looked.unscorable is None and looked.turns == 2 and "A" in tool_text and "B" not in tool_text
    assert looked.process_rewards == [(looked.num_tokens - 1, 2.0)] and looked.env_metrics["by_submit"] == 0


def test_serving_tools_in_process_leaves_the_applications_logging_as_it_was():
    """The MCP server object a toolset's tools are registered on configures the root logger when it
    is made (a rich handler at INFO, in mcp 1.x and 2.x): in an application that imports rollflow,
    every HTTP request would then be logged. It serves nothing here, so the logging stays as it was."""
    import logging

    from rollflow.verifiers import toolsets as task_tools

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    try:
        task_tools._mcp_server("probe")
        configured = root.handlers[:], root.level
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert configured == ([], logging.WARNING)


def _tasks(*keys):
    from types import SimpleNamespace

    return [SimpleNamespace(key=key, data=SimpleNamespace(system_prompt="", prompt=f"task {key}", answer="1"))
            for key in keys]


def test_prompt_ids_are_unique_whenever_task_keys_are():
    """Readable keys that share their first 16 characters (`openai/gsm8k:train:N`) stay apart:
    in-flight tracking, checkpoints, the ledger and eval groups key on the prompt id."""
    from rollflow.verifiers.loader import task_rows

    keys = [f"openai/gsm8k:train:{n}" for n in range(12)]
    rows, by_key = task_rows("gsm8k", _tasks(*keys))
    assert len({row.id for row in rows}) == len(keys) == len(by_key)


def test_tasks_with_the_same_key_are_kept_once_with_one_warning(caplog):
    """verifiers' own evaluation tolerates duplicate content; the taskset loads, each key once."""
    from rollflow.verifiers.loader import task_rows

    rows, by_key = task_rows("dup", _tasks("a", "b", "a", "c", "b", "a"))
    assert len(rows) == 3 and sorted(by_key) == ["a", "b", "c"]
    warnings = [r for r in caplog.records if "same key" in r.getMessage()]
    assert len(warnings) == 1 and "3 tasks" in warnings[0].getMessage()


@pytest.mark.usefixtures("tasksets")
@pytest.mark.parametrize(("env", "wanted"), [
    ('taskset = "sums-taskset"\nepisode_timeout_s = 30.0',
     "env.episode_timeout_s: 'sums-taskset' has no Env of its own"),
    ('taskset = "sums-taskset"\nmax_model_tokens = 100\ntime_budget_s = 5.0',
     "env.max_model_tokens, env.time_budget_s: 'sums-taskset' has no Env of its own"),
    ('taskset = "sums-taskset"\nargs = {n = 3}', "env.args: arguments of a classic environment"),
    ('environment = "vf-sums"\ntaskset_args = {n = 3}\nmax_tasks = 2',
     "env.taskset_args, env.max_tasks: they configure a v1 taskset"),
])
def test_settings_the_chosen_variant_would_ignore_are_refused_at_load(env, wanted):
    config = load_config(preset="tiny", overrides=[])
    with pytest.raises(ConfigError) as err:
        episode_source(Config(model=config.model, env=msgspec_env(f'kind = "verifiers"\n{env}')))
    assert wanted in str(err.value)


@pytest.mark.usefixtures("tasksets")
async def test_each_episodes_task_toolsets_are_closed_when_it_ends(chat):
    """What a toolset set up for an episode holds (its exit stack, as verifiers closes it when its
    server ends) is released when the episode ends, whether it was scored or cut short."""
    import ts_closing_tools

    episodes = source(taskset="ts-closing-tools")
    await episodes.start()
    await play(episodes, chat, [call("peek"), "done"], i=0, max_tokens=900)
    assert ts_closing_tools.CLOSED == ["first"]
    await play(episodes, chat, [call("peek"), call("peek")], i=1, max_tokens=900, max_turns=1)
    assert ts_closing_tools.CLOSED == ["first", "second"] == ts_closing_tools.OPENED
    await episodes.aclose()


@pytest.mark.usefixtures("tasksets", "example_environments")
@pytest.mark.parametrize("source", [["env.taskset=sums-taskset", "env.taskset_args={n = 4}"],
                                    ['env.environment="vf-sums"']])
def test_data_paths_beside_a_source_that_brings_its_own_prompts_are_refused(tmp_path, source):
    """A source that brings its own prompts (a v1 taskset's tasks, a classic environment's
    dataset) leaves no use for `data.paths`: refused before anything is written, naming both."""
    from importlib import metadata

    from rollflow.verifiers.environments import _version_tuple

    if "environment" in source[0] and _version_tuple(metadata.version("verifiers")) >= (0, 4):
        pytest.skip("verifiers 0.4 has no classic environments (refused, as its own test shows)")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    config = load_config(preset="tiny", overrides=[
        "env.kind=verifiers", *source, "data.task=jsonl", f'data.paths=["{rows}"]'])
    with pytest.raises(ConfigError, match=r"data.paths: \[env\] kind = 'verifiers' brings its own prompts"):
        Controller(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
