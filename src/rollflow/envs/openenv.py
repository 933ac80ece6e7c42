"""OpenEnv environments (TRL's standard) as rollflow episodes: `[env] kind = "openenv"`.

Each episode holds a session through the environment's own OpenEnv client (an `EnvClient`
subclass, `env.client = "module:Client"`, WebSocket) with the server at `env.url`, or at a
server rollflow starts itself from a local environment module (`env.server = "module:app"`, the
ASGI app OpenEnv's
`create_app` makes, served by uvicorn on 127.0.0.1, importing what this process can import, and
exiting when this process is gone, however it ends: `serve_app.py`); a
session whose episode ended cleanly is kept and reset for the next episode. `reset(seed=...)`
opens the episode (the seed comes from the prompt's id, so a group's samples meet the same
instance); each model turn becomes an action, `step(action)`'s observation the next user
message, and its reward and done flag the turn's. This is the multi-turn seam (`rollflow.envs`):
every model token is generated and recorded as in any episode.

Turning text into an action and an observation into text: by default the action is the client's
action class with its one text field set to the turn's text, and the observation is its one
field's text (or its fields as JSON); `env.action` / `env.observation` name
functions that do it instead. The server is checked before the run starts: one that does not
answer within `PROBE_TIMEOUT_S` (or a started one within `START_TIMEOUT_S`) is an error naming
it. A session the server refuses, a step that raises or times out, ends that episode unscorable
with the reason. The library is imported lazily; without it, one error names the extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import sys
import tempfile
import typing
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from rollflow import guest
from rollflow.config import Config, OpenEnvConfig
from rollflow.envs import EnvironmentEpisodes, EnvStep, Turn
from rollflow.episodes import Served
from rollflow.errors import ConfigError
from rollflow.guest import name_of
from rollflow.imports import load_function
from rollflow.records import Message, Prompt

EXTRA = "pip install 'rollflow[openenv]'"
"""How to install the library (named in the error when it is missing)."""

PROBE_TIMEOUT_S = 5.0
"""How long a server at `env.url` has to answer `/health` before the run is refused."""

START_TIMEOUT_S = 60.0
"""How long a server rollflow starts (`env.server`) has to answer `/health`."""

STOP_TIMEOUT_S = 5.0
"""How long a started server has to exit after SIGTERM before it is killed."""

SERVE = Path(__file__).with_name("serve_app.py")
"""The script a started server runs (uvicorn, exiting when this process is gone)."""

ToAction = Callable[[str], Any]
ToText = Callable[[Any], str]


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _library() -> Any:
    """OpenEnv's `EnvClient`, from `openenv` (>= 0.4, the project's name since 0.4; tested with
    0.10.0) or `openenv-core` 0.3 (its name before). Both install the module `openenv`: with
    both installed, which files are there is anyone's guess, so that is refused."""
    current, legacy = _installed("openenv"), _installed("openenv-core")
    if current and legacy:
        raise ConfigError(
            f"env.client: both openenv {current} and openenv-core {legacy} are installed, and they install the same "
            "`openenv` module; keep one: pip uninstall -y openenv-core openenv && pip install 'rollflow[openenv]'"
        )
    try:
        from openenv.core.env_client import EnvClient
    except ImportError as err:
        raise ConfigError(f"env.client: OpenEnv environments need the openenv package ({err}); {EXTRA}") from None
    return EnvClient


def action_class(client_cls: type) -> Any:
    """The action type an `EnvClient[Action, Observation, State]` subclass declares, or None."""
    for klass in client_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    return None


def text_action(client_cls: type) -> ToAction:
    """text -> the client's action: its action class with the one text field it has."""
    action = action_class(client_cls)
    fields = getattr(action, "model_fields", None)
    if action is None or fields is None:
        raise ConfigError(
            f"env.action: {client_cls.__name__} declares no pydantic action class; name a function "
            "`module:function` that turns the model's text into an action"
        )
    texts = [name for name, field in fields.items() if name != "metadata" and field.annotation is str]
    required = [name for name, field in fields.items() if field.is_required()]
    if len(texts) != 1 or any(name not in texts for name in required):
        raise ConfigError(
            f"env.action: {action.__name__} has fields {sorted(fields)}, not one text field to put the "
            "model's turn in; name a function `module:function` that turns the text into an action"
        )
    field = texts[0]
    return lambda text: action(**{field: text})


def observation_text(observation: Any) -> str:
    """An observation as the model reads it: its one field's text, or its fields as JSON
    (`done`, `reward` and `metadata` left out)."""
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump(exclude={"done", "reward", "metadata"})
    if isinstance(observation, dict):
        fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
        if len(fields) == 1:
            (value,) = fields.values()
            return value if isinstance(value, str) else json.dumps(value, default=str)
        return json.dumps(fields, default=str) if fields else ""
    return "" if observation is None else str(observation)


def episode_seed(prompt_id: str) -> int:
    """The reset seed of a prompt's episodes: the same for every sample of its group."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:4], "big") >> 1


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class OpenEnvSource(Served):
    """Makes each episode's `OpenEnvEpisode`; owns the server it starts and the session limit."""

    def __init__(
        self,
        client_cls: Any,
        *,
        url: str = "",
        server: str = "",
        to_action: ToAction | None = None,
        to_text: ToText | None = None,
        sessions: int = 8,
        timeout_s: float = 30.0,
    ) -> None:
        client_base = _library()
        if not (isinstance(client_cls, type) and issubclass(client_cls, client_base)):
            raise ConfigError(f"env.client: {client_cls!r} is not an OpenEnv client (an EnvClient subclass)")
        if bool(url) == bool(server):
            raise ConfigError("env.url: give the server's address (env.url) or its app (env.server), one of them")
        self.client_cls = client_cls
        self.url = url.rstrip("/")
        self.server = server
        self.to_action = to_action or text_action(client_cls)
        self.to_text = to_text or observation_text
        self._own: set[Any] = {f for f, given in ((self.to_action, to_action), (self.to_text, to_text)) if not given}
        """The conversions rollflow made (run in place); the user's run on guest threads."""
        self.timeout_s = timeout_s
        self._sessions = sessions
        self._slots: asyncio.Semaphore | None = None
        self.idle: list[Any] = []
        """Connected clients whose episode ended cleanly: the next episode resets one of them
        instead of opening a new session."""
        self._process: asyncio.subprocess.Process | None = None
        self._log: Any = None

    async def convert(self, func: Callable[[Any], Any], value: Any, field: str) -> Any:
        """`func(value)`: a conversion of the user's (`field`: `env.action`, `env.observation`) on a
        guest thread, one of rollflow's in place."""
        if func in self._own:
            return func(value)
        return await guest.call(func, value, timeout_s=self.timeout_s, name=f"{field} {name_of(func)}")

    async def __call__(self) -> OpenEnvEpisode:
        """A new episode, once one of the `sessions` is free (waiting for one is not the
        environment's time: `env.step_timeout_s` bounds the server's calls, not this wait)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._sessions)
        await self._slots.acquire()
        return OpenEnvEpisode(self, self._slots)

    async def start(self) -> None:
        """Start the server (`env.server`) or check that the one at `env.url`
        answers; an error names it otherwise."""
        if self.server:
            await self._start_server()
            return
        problem = await self._health(PROBE_TIMEOUT_S)
        if problem:
            raise ConfigError(f"env.url: no OpenEnv server answers at {self.url} ({problem})")

    async def _health(self, timeout_s: float) -> str | None:
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(f"{self.url}/health") as reply:
                if reply.status == 200:
                    return None
                return f"/health answered HTTP {reply.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__

    async def _start_server(self) -> None:
        host = "127.0.0.1"
        port = _free_port(host)
        self.url = f"http://{host}:{port}"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - the server writes to it until aclose
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-P",
            str(SERVE),
            self.server,
            "--host",
            host,
            "--port",
            str(port),
            "--log-level",
            "warning",
            stdout=self._log,
            stderr=self._log,
            env=os.environ | {"PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)},
        )
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while True:
            if self._process.returncode is not None or await self._exited():
                raise ConfigError(f"env.server: {self.server!r} exited at start:\n{self._tail()}")
            if await self._health(1.0) is None:
                return
            if asyncio.get_running_loop().time() > deadline:
                await self.aclose()
                raise ConfigError(f"env.server: {self.server!r} did not answer within {START_TIMEOUT_S:g} s")

    async def _exited(self) -> bool:
        """Whether the started server has exited (waits a moment for it, which paces the polling)."""
        assert self._process is not None
        try:
            await asyncio.wait_for(self._process.wait(), 0.2)
        except TimeoutError:
            return False
        return True

    def _tail(self, lines: int = 12) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return "\n".join(text.strip().splitlines()[-lines:])

    async def aclose(self) -> None:
        idle, self.idle = self.idle, []
        for client in idle:
            with contextlib.suppress(Exception):
                await client.close()
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


class OpenEnvEpisode:
    """One episode: a session with the server, held from reset to the end of the episode (the
    source made it holding one of its session slots; `aclose` gives it back)."""

    def __init__(self, source: OpenEnvSource, slots: asyncio.Semaphore) -> None:
        self.source = source
        self._slots = slots
        self._client: Any = None
        self._holding = True
        self._clean = False
        """The last call on the session returned (none was cut off): the session can be reused."""

    async def reset(self, prompt: Prompt) -> list[Message]:
        source = self.source
        if source.idle:
            self._client = source.idle.pop()
        else:
            self._client = source.client_cls(
                base_url=source.url, connect_timeout_s=source.timeout_s, message_timeout_s=source.timeout_s
            )
            await self._client.connect()
        self._clean = False
        result = await self._client.reset(seed=episode_seed(prompt.id))
        self._clean = True
        system = [m for m in prompt.messages if m.role == "system"]
        text = await source.convert(source.to_text, result.observation, "env.observation")
        if text:
            return [*system, Message(role="user", content=text)]
        return list(prompt.messages)

    async def step(self, turn: Turn) -> EnvStep:
        source = self.source
        action = await source.convert(source.to_action, turn.text, "env.action")
        self._clean = False
        result = await self._client.step(action)
        self._clean = True
        text = await source.convert(source.to_text, result.observation, "env.observation")
        messages = [] if result.done or not text else [Message(role="user", content=text)]
        reward = float(result.reward) if isinstance(result.reward, bool) else result.reward  # OpenEnv allows bools
        return EnvStep(messages=messages, reward=reward, done=bool(result.done))

    async def aclose(self) -> None:
        """Give the session back for the next episode's reset, or close it if a call on it was
        cut off (its answer may still come)."""
        client, self._client = self._client, None
        try:
            if client is not None:
                if self._clean:
                    self.source.idle.append(client)
                else:
                    await client.close()
        finally:
            if self._holding:
                self._holding = False
                self._slots.release()


def episodes(settings: OpenEnvConfig, config: Config) -> EnvironmentEpisodes:
    """`kind = "openenv"`: a session per episode with the server through the client `settings`
    names (the server is checked, or started, when the source starts)."""
    return EnvironmentEpisodes(
        OpenEnvSource(
            load_function(settings.client, "env.client"),
            url=settings.url,
            server=settings.server,
            to_action=load_function(settings.action, "env.action") if settings.action else None,
            to_text=load_function(settings.observation, "env.observation") if settings.observation else None,
            sessions=settings.sessions,
            timeout_s=settings.step_timeout_s,
        ),
        settings,
    )
