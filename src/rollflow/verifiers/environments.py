"""verifiers environments (prime-rl's standard), trained as they are: `[env] kind = "verifiers"`.

The environment is loaded with verifiers' own loader (`verifiers.load_environment(ENV_ID,
**env.args)`, `env.environment = "ENV_ID"`: an installed package or module with a
`load_environment` function). Its
dataset gives the run's prompts (`rows`), and each episode is the environment's own rollout
(`Environment.run_rollout`: its turns, tools, parser and rubric, unchanged) against the run's
OpenAI-compatible endpoint, which records every token with its log-prob and version
(`rollflow.agent`); the rubric's reward is the episode's reward. A rollout that fails (the
environment raises, a model call is refused) makes its episode unscorable with the reason.

Supported: verifiers `SUPPORTED` (the API with `vf.Client` and `Environment.run_rollout`: 0.1.x,
and 0.3.x, which keeps it as `verifiers.legacy` at the same names; the suite runs 0.3.1, and 0.1.14
passed the same tests).
verifiers 0.4 has only the v1 API, whose tasksets `rollflow.verifiers.tasksets` trains; another version
is refused with one error. Rubrics with group-level reward functions are refused too: each episode here is
scored on its own. The library is imported lazily; without it, one error names the extra.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import importlib.util
import pkgutil
from importlib import metadata
from typing import Any

from rollflow import guest
from rollflow.agent import AgentEpisodes, AgentTask
from rollflow.agent.http import http_client
from rollflow.config import Config, VerifiersEnvConfig
from rollflow.data_files import Row
from rollflow.episodes import EpisodeSource, Served
from rollflow.errors import ConfigError, DataError
from rollflow.guest import name_of
from rollflow.records import Message
from rollflow.scoring import is_async
from rollflow.values import finite, shown

EXTRA = "pip install 'rollflow[verifiers]'"
"""How to install the library (named in the error when it is missing)."""

SUPPORTED = (0, 1, 11), (0, 4, 0)
"""Versions whose environments this adapter runs: at least the first, below the second."""

RUN_OWNS = ("temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "logprobs", "top_logprobs")
"""Sampling settings of an environment that the run decides (its endpoint refuses others)."""


class EpisodeFailed(Exception):
    """A verifiers rollout ended with an error; its episode is unscorable with this message."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def check_version(field: str, supported: tuple[tuple[int, ...], tuple[int, ...]], what: str, newer: str) -> None:
    """ConfigError naming `field` unless the installed verifiers is within `supported` (at least
    the first, below the second): what to install, or `newer`'s advice when it is too new."""
    try:
        version = metadata.version("verifiers")
    except metadata.PackageNotFoundError:
        raise ConfigError(f"{field}: needs the verifiers package; {EXTRA}") from None
    low, high = supported
    found = _version_tuple(version)
    if not low <= found < high:
        raise ConfigError(
            f"{field}: verifiers {version} is installed; rollflow trains {what} of verifiers "
            f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}: {newer if found >= high else EXTRA}"
        )


def _library() -> Any:
    check_version(
        "env.environment", SUPPORTED, "environments (Environment.run_rollout)",
        "verifiers 0.4 has only the v1 API; a v1 taskset is `taskset = \"ID\"`, a classic environment needs "
        "pip install 'verifiers>=0.3.1,<0.4'",
    )  # fmt: skip
    import verifiers

    return verifiers


def _close_modules(name: str) -> list[str]:
    modules = [m.name for m in pkgutil.iter_modules()]
    return difflib.get_close_matches(name, modules, n=3, cutoff=0.6)


_FAILURES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("rollflow_verifiers", default=None)
"""The current episode's rubric failures (verifiers turns an exception into a reward of 0)."""


def _guard(env: Any) -> None:
    """Wrap the environment's rubric functions and tools, in place: a synchronous one runs on a
    worker thread (verifiers calls it on the event loop, where one that blocks would freeze the
    run); a rubric function that raises or returns a non-number is recorded as the episode's
    failure (verifiers scores it 0). A wrapper keeps the function's name and signature, which
    verifiers reads to choose its arguments."""
    rubrics = [env.rubric]
    while rubrics:
        rubric = rubrics.pop()
        rubrics += getattr(rubric, "rubrics", [])  # a RubricGroup's members
        rubric.funcs = [_guarded(func, record=True) for func in rubric.funcs]
    tools = getattr(env, "tool_map", None)  # a ToolEnv's (its tool errors are the model's to read)
    if isinstance(tools, dict):
        for name, tool in tools.items():
            tools[name] = _guarded(tool, record=False)


def _guarded(func: Any, *, record: bool) -> Any:
    if getattr(func, "__rollflow_guarded__", False):
        return func
    name = getattr(func, "__name__", repr(func))
    shown_name = f"{'reward function' if record else 'tool'} {name_of(func)}"
    sync = not is_async(func)

    @functools.wraps(func)
    async def call(*args: Any, **kwargs: Any) -> Any:
        try:
            if sync:  # bounded by verifiers' caller (the episode's timeout), which cancels it
                result = await guest.call(functools.partial(func, *args, **kwargs), timeout_s=None, name=shown_name)
            else:
                result = await func(*args, **kwargs)
        except Exception as err:
            failures = _FAILURES.get()
            if record and failures is not None:
                failures.append(f"reward function {name} raised {type(err).__name__}: {err}")
                return 0.0  # what verifiers would make of it; the episode is unscorable anyway
            raise
        if record and finite(result) is None and not isinstance(result, (list, dict)):
            failures = _FAILURES.get()
            if failures is not None:
                failures.append(f"reward function {name} returned {shown(result)}, expected a finite number")
                return 0.0
        return result

    call.__rollflow_guarded__ = True  # type: ignore[attr-defined]
    return call


class VerifiersEnv(Served):
    """One loaded verifiers environment: its prompts, and the agent that plays one episode."""

    def __init__(self, env_id: str, args: dict[str, Any] | None = None) -> None:
        vf = _library()
        module = env_id.replace("-", "_").split("/")[-1]
        if not module.isidentifier() or importlib.util.find_spec(module) is None:
            close = _close_modules(module)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(
                f"env.environment: no verifiers environment {env_id!r} is installed (no module {module!r}){hint}"
            )
        try:
            env = vf.load_environment(env_id, **(args or {}))
        except SystemExit as err:  # an environment module that exits must not end the run silently
            raise ConfigError(f"env.environment: loading {env_id!r} called sys.exit({err.code!r})") from None
        except Exception as err:  # verifiers wraps the environment's own error; show what it was
            cause = err.__cause__ or err
            if isinstance(cause, AttributeError) and cause.name == "env_id" and cause.obj is not None:
                env = cause.obj  # verifiers labels what load_environment returned: not an Environment
            else:
                raise ConfigError(
                    f"env.environment: {env_id!r} could not be loaded: {type(cause).__name__}: {cause}"
                ) from None
        if not isinstance(env, vf.Environment):
            raise ConfigError(
                f"env.environment: {env_id!r}'s load_environment returned {type(env).__name__}, not an Environment"
            )
        if env.rubric.has_group_rewards:
            raise ConfigError(
                f"env.environment: {env_id!r}'s rubric has group-level reward functions; rollflow scores each "
                "episode on its own (its group advantages are rollflow's)"
            )
        self.env_id = env_id
        self.env = env
        _guard(env)
        self.sampling_args = {k: v for k, v in (env.sampling_args or {}).items() if k not in RUN_OWNS and v}
        self._http: Any = None

    def rows(self) -> list[Row]:
        """The environment's training dataset as rollflow rows (messages, answer, the row's
        `info` and `example_id` kept for its rollout)."""
        dataset = self.env.get_dataset()
        rows = []
        for i, item in enumerate(dataset):
            where = f"{self.env_id} dataset, row {i}"
            prompt = item.get("prompt")
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            if not isinstance(prompt, list) or not prompt:
                raise DataError(f"{where}: expected `prompt` as a list of messages, got {type(prompt).__name__}")
            messages = []
            for message in prompt:
                content = message.get("content") if isinstance(message, dict) else None
                if not isinstance(content, str):
                    raise DataError(f"{where}: only text messages are supported, got {message!r:.80}")
                messages.append(Message(role=str(message["role"]), content=content))
            example = item.get("example_id", i)
            info = item.get("info") or {}
            rows.append(
                Row(
                    id=f"{self.env_id}-{example}",
                    messages=messages,
                    answer=None if item.get("answer") is None else str(item["answer"]),
                    task=str(item.get("task") or self.env_id),
                    metadata={"verifiers": {"example_id": example, "info": info}},
                    source=where,
                )
            )
        if not rows:
            raise DataError(f"env.environment: {self.env_id!r} has an empty dataset")
        return rows

    async def __call__(self, task: AgentTask, base_url: str) -> float:
        """One episode: the environment's rollout against `base_url`; its rubric's reward."""
        import openai
        import verifiers as vf

        if self._http is None:  # one HTTP client for every episode's OpenAI client
            self._http = http_client()
        origin = task.metadata.get("verifiers", {})
        rollout_input: dict[str, Any] = {
            "prompt": task.messages,
            "example_id": origin.get("example_id", task.id),
            "info": origin.get("info", {}),
        }
        if task.answer is not None:
            rollout_input["answer"] = task.answer
        client = vf.OpenAIChatCompletionsClient(
            openai.AsyncOpenAI(base_url=base_url, api_key="unused", http_client=self._http, max_retries=0)
        )
        failures: list[str] = []
        recording = _FAILURES.set(failures)
        try:
            output = await self.env.run_rollout(rollout_input, client, task.model, dict(self.sampling_args))
        finally:
            _FAILURES.reset(recording)
        error = output.get("error")
        if error:
            raise EpisodeFailed(f"verifiers rollout of {self.env_id!r} failed: {error}")
        if failures:  # verifiers scored them 0: a failure is never a score here
            raise EpisodeFailed(f"verifiers rubric of {self.env_id!r}: {failures[0]}")
        reward = output.get("reward")
        if reward is None:
            raise EpisodeFailed(f"verifiers rollout of {self.env_id!r} has no reward (score_rollouts is off?)")
        return reward

    async def start(self) -> None:
        """Nothing to start: the HTTP client is made on the run's loop at the first episode."""

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def episodes(settings: VerifiersEnvConfig, config: Config) -> EpisodeSource:
    """`kind = "verifiers"`: the environment loaded now (a bad id or load fails at start), its
    dataset as the run's prompts, each episode its own rollout through the run's endpoint; or,
    with `taskset`, a v1 taskset (`rollflow.verifiers.tasksets`)."""
    from rollflow.sampler import sampling_spec

    if bool(settings.environment) == bool(settings.taskset):
        raise ConfigError(
            'env: kind = "verifiers" needs one of environment = "ID" (a classic environment) or '
            'taskset = "ID" (a v1 taskset)' + (", not both" if settings.taskset else "")
        )
    if not settings.taskset and (settings.env_id or settings.env_args):
        raise ConfigError('env.env_id, env.env_args: an Env plays a v1 taskset; give taskset = "ID" too')
    given = [f"env.{name}" for name in ("taskset_args", "max_tasks") if getattr(settings, name)]
    if not settings.taskset and given:
        raise ConfigError(f'{", ".join(given)}: they configure a v1 taskset (taskset = "ID"); a classic '
                          "environment's arguments are env.args")  # fmt: skip
    if settings.taskset and settings.args:
        raise ConfigError("env.args: arguments of a classic environment's load_environment; a taskset's "
                          "config fields are env.taskset_args")  # fmt: skip
    if settings.taskset:
        from rollflow.verifiers.tasksets import taskset_episodes

        return taskset_episodes(settings, config.model.path, sampling_spec(config))

    env = VerifiersEnv(settings.environment, settings.args)
    return AgentEpisodes(env, settings, model=config.model.path, sampling=sampling_spec(config), rows=env.rows)
