"""Loading a verifiers v1 taskset with verifiers' own loader, and refusing at start what rollflow
cannot train, naming it (`rollflow.verifiers.tasksets` plays its episodes).

`load_taskset` resolves the id as verifiers does (the installed module that exports its `Taskset`
subclass in `__all__`; `taskset_args` are fields of its `TasksetConfig`), checks the taskset and
its tasks' hooks, and returns its tasks, its own toolsets, and the `Env` its package runs, if it
has one (`rollflow.verifiers.taskset_envs` plays those). Refused, each with a ConfigError: an unknown
id (with close module names), arguments its config rejects, a module that cannot load or calls
`sys.exit`, a taskset that ships its own harness (a program), a taskset with its own `Env` whose
toolsets verifiers cannot serve (a module that does not serve its toolset when run), tasks that
need a container, `@vf.intercept` hooks and stops that read the model
request, toolsets rollflow cannot serve (`toolsets.check_toolsets`), an infinite taskset
without `max_tasks`. `task_rows` makes the tasks the run's prompts. The library is imported
lazily; without it, one error names the extra.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import logging
import sys
from typing import Any, NamedTuple

from rollflow.data_files import Row
from rollflow.errors import ConfigError, DataError
from rollflow.records import Message
from rollflow.verifiers.toolsets import check_toolsets, point_here

log = logging.getLogger(__name__)

SUPPORTED = (0, 3, 1), (0, 5, 0)
"""verifiers versions whose v1 tasksets this adapter runs: at least the first, below the second."""

ROLES = {"system", "user", "assistant"}
"""Roles a task's prompt may hold (text only)."""

KEY = "verifiers_task"
"""The row metadata holding its task's key (prompt ids of later epochs carry a suffix)."""


class Taskset(NamedTuple):
    """A loaded taskset, checked."""

    tasks: list[Any]
    """Its first `max_tasks` tasks (all of them for 0)."""
    toolsets: list[Any]
    """Its own toolsets, shared by its tasks."""
    env: Any
    """The `Env` subclass its package runs, or None (verifiers' SingleAgentEnv: one agent plays each task)."""


def _v1() -> Any:
    """`verifiers.v1`, or ConfigError saying what to install."""
    from rollflow.verifiers.environments import check_version

    check_version("env.taskset", SUPPORTED, "v1 tasksets", "a newer verifiers is not tested with rollflow yet")
    import verifiers.v1 as vf

    return vf


def load_taskset(taskset_id: str, args: dict[str, Any], max_tasks: int, env_id: str = "") -> Taskset:
    """The taskset, checked, with the `Env` that plays it (`env_id`'s, else its own): ConfigError
    naming what cannot be trained here."""
    vf = _v1()
    from pydantic import ValidationError
    from verifiers.v1.utils import loaders

    from rollflow.verifiers.environments import _close_modules

    module = taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    builtin = f"verifiers.v1.tasksets.{module}"
    if not module.isidentifier() or (
        importlib.util.find_spec(module) is None and importlib.util.find_spec(builtin) is None
    ):
        close = _close_modules(module)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"env.taskset: no verifiers taskset {taskset_id!r} is installed (no module {module!r}){hint}")
    try:
        cls = loaders.taskset_class(taskset_id)
        config_type = loaders.taskset_config_type(taskset_id)
        env_cls = loaders.environment_class(taskset_id)
        harness = loaders.default_harness_id(taskset_id)
        if env_id:
            env_cls = _environment(env_id)
    except SystemExit as err:
        raise ConfigError(f"env.taskset: importing {taskset_id!r} called sys.exit({err.code!r})") from None
    except Exception as err:  # verifiers' own explanation (no __all__, no Taskset subclass, an import error)
        raise ConfigError(f"env.taskset: {taskset_id!r} could not be loaded: {type(err).__name__}: {err}") from None
    try:
        config = config_type.model_validate({**args, "id": taskset_id})
    except ValidationError as err:
        raise ConfigError(f"env.taskset_args: not a valid {config_type.__name__}: {err}") from None
    _check_trainable(vf, taskset_id, cls, config, env_cls, max_tasks)
    if harness != "bash":  # verifiers' fallback: the taskset ships no harness of its own
        raise ConfigError(
            f"env.taskset: {taskset_id!r} ships its own harness ({harness}), a program its tasks run through; "
            "rollflow plays tasks with the model and their tools alone"
        )
    try:
        tasks = list(itertools.islice(cls(config), max_tasks or None))
    except SystemExit as err:
        raise ConfigError(f"env.taskset: loading {taskset_id!r} called sys.exit({err.code!r})") from None
    except Exception as err:
        raise ConfigError(f"env.taskset: loading {taskset_id!r}'s tasks raised {type(err).__name__}: {err}") from None
    if not tasks:
        raise DataError(f"env.taskset: {taskset_id!r} has no tasks")
    _check_hooks(tasks[0], f"env.taskset: {taskset_id!r}")
    return Taskset(tasks, cls.toolsets(config), None if env_cls is vf.SingleAgentEnv else env_cls)


def task_rows(name: str, tasks: list[Any]) -> tuple[list[Row], dict[str, Any]]:
    """The tasks as the run's prompts, each under the id `NAME-<the task's key>` (verifiers' stable
    task identity, whole: ids are unique whenever keys are), and the tasks by key. Tasks with the
    same key (the same content) are kept once, with one warning, as verifiers' evaluation does."""
    rows: list[Row] = []
    by_key: dict[str, Any] = {}
    repeated = 0
    for i, task in enumerate(tasks):
        where = f"{name} task {i}"
        if task.key in by_key:
            repeated += 1
            continue
        answer = getattr(task.data, "answer", None)
        by_key[task.key] = task
        rows.append(
            Row(
                id=f"{name}-{task.key}", messages=task_messages(task, where),
                answer=None if answer is None else str(answer), task=name, metadata={KEY: task.key}, source=where,
            )
        )  # fmt: skip
    if repeated:
        log.warning("env.taskset: %s: %d tasks have the same key (the same content) as an earlier one; each is "
                    "kept once", name, repeated)  # fmt: skip
    return rows, by_key


def _environment(env_id: str) -> Any:
    """The `Env` class `env_id` names, verifiers' built-in ones or an installed module's;
    ConfigError naming the built-in ones otherwise."""
    import pkgutil

    import verifiers.v1.envs
    from verifiers.v1.utils import loaders

    try:
        return loaders.environment_class("", env_id)
    except (ModuleNotFoundError, TypeError, AttributeError) as err:
        builtin = sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(verifiers.v1.envs.__path__))
        raise ConfigError(
            f"env.env_id: no verifiers environment {env_id!r} ({err}); verifiers' own are {', '.join(builtin)}"
        ) from None


def _check_hooks(task: Any, name: str) -> None:
    """ConfigError for a task hook rollflow cannot honour: an `@vf.intercept` (it rewrites model
    calls: what the model sampled would not be what is trained), a `@vf.stop` that reads the model
    request (rollflow builds none), a hook verifiers itself would refuse."""
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.types import Request
    from verifiers.v1.utils.decorators import discover_decorated

    rewrites = [fn.__name__ for fn in discover_decorated(task, "intercept")]
    if rewrites:
        raise ConfigError(
            f"{name}: its tasks' @vf.intercept hooks ({', '.join(rewrites)}) rewrite model calls, so the tokens "
            "trained would not be the ones sampled; rollflow trains tasks without them"
        )
    for stop in task.hooks("stop"):
        try:
            boundary = hook_boundary(stop, allow_trace=True)
        except TypeError as err:
            raise ConfigError(f"{name}: {err}") from None
        if boundary is Request:
            raise ConfigError(
                f"{name}: its @vf.stop {stop.__name__} reads the model request, which rollflow does not build; "
                "a stop that reads the Trace or the Response works"
            )


def _check_trainable(vf: Any, taskset_id: str, cls: Any, config: Any, env_cls: Any, max_tasks: int) -> None:
    name = f"env.taskset: {taskset_id!r}"
    task_type = cls.task_type()
    if task_type.NEEDS_CONTAINER:
        raise ConfigError(f"{name}: its tasks ({task_type.__name__}) need a container, which rollflow does not run")
    shared, own = cls.toolsets(config), task_type.toolsets(config.task)
    check_toolsets([*shared, *own], name)
    if env_cls is not vf.SingleAgentEnv:  # what rollflow does not serve to an Env's rollouts, verifiers does
        _, here = point_here(task_type, config.task)
        for toolset in [*shared, *(t for i, t in enumerate(own) if i not in here)]:
            _check_served_by_verifiers(toolset, f"{name} runs its own environment ({env_cls.__name__}), and")
    if cls.INFINITE and not max_tasks:
        raise ConfigError(f"{name} is infinite: give env.max_tasks, how many of its tasks to read")


def _check_served_by_verifiers(toolset: Any, name: str) -> None:
    """ConfigError unless verifiers can serve `toolset` to an `Env`'s episodes: one at a URL, or one
    whose module serves it when run (`python -m MODULE`, as verifiers launches a tool server)."""
    if getattr(toolset.config, "url", None):
        return
    cls = type(toolset)
    try:
        source = inspect.getsource(sys.modules[cls.__module__])
    except (KeyError, OSError, TypeError):
        source = ""
    if "__main__" not in source:
        raise ConfigError(
            f"{name} its toolset {cls.__name__} is served by verifiers as a program, `python -m {cls.__module__}`, "
            f'which serves nothing: end that module with `if __name__ == "__main__": {cls.__name__}.run()`'
        )


def task_messages(task: Any, where: str) -> list[Message]:
    """A task's opening as rollflow messages: its system prompt, then its prompt (text or text
    messages); DataError naming the task otherwise."""
    from verifiers.v1.types import content_text

    data = task.data
    messages = [Message(role="system", content=data.system_prompt)] if data.system_prompt else []
    prompt = data.prompt
    if isinstance(prompt, str):
        messages.append(Message(role="user", content=prompt))
    else:
        for message in prompt or []:
            content = message.content
            text_only = isinstance(content, str) or all(part.type == "text" for part in content or [])
            if message.role not in ROLES or not text_only:
                raise DataError(f"{where}: only text system/user/assistant messages are supported, got {message!r:.80}")
            messages.append(Message(role=message.role, content=content_text(content)))
    if not any(m.role == "user" for m in messages):
        raise DataError(f"{where}: the task has no user prompt (a task the user opens is not supported)")
    return messages
