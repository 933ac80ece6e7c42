"""A verifiers v1 task's tool servers (`vf.Toolset`s), served in-process for its episodes, or
reached at their URL.

verifiers runs each toolset as an MCP server program, and a harness program that connects the
model to it. rollflow registers the same toolset on an in-process MCP server object (the
registration verifiers' own server does, `Toolset.register`, once per toolset class, each call
made on the calling episode's instance) and calls its tools directly: no subprocess, no port,
nothing installed at run time; a sync tool runs on a worker thread. The model sees each tool as verifiers'
harnesses advertise it, `<server>_<tool>` (bare when the toolset's `TOOL_PREFIX` is None), with the
schema MCP derives from its signature and its docstring as description. A call's answer is the
text of its result; a tool that raises, gets arguments its signature refuses, or runs past its
timeout answers with the error, as an MCP server does, and the episode goes on.

A toolset whose config gives a `url` is an MCP server that runs elsewhere (verifiers launches
nothing for it either): rollflow lists and calls its tools there over MCP's streamable HTTP, one
session per call as verifiers' harnesses do, and an error result is the model's to read.

A taskset's own toolsets are set up once for the run (`setup`); a task's are made for each
episode (`setup`, then `setup_task` with the task's data, as verifiers' tool servers get it). A
toolset that keeps state across calls (its own `State` type) shares the episode's state, as
verifiers' state channel does: before each call its `self.state` is the episode's state read as
the toolset's type, and what the call changed is written back as the task's type
(`EpisodeState`), the state the task's rewards read on the trace.
Refused at start (`check_toolsets`): a stateful toolset at a URL (its state would cross a channel
rollflow does not serve) and one in a container runtime. Works with mcp 1.x (verifiers 0.3) and 2.x
(verifiers 0.4).
This module does not play episodes (`rollflow.verifiers.tasksets`).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from rollflow import guest
from rollflow.closing import close_within
from rollflow.envs.tools import Tool, ToolCall, call_tool
from rollflow.errors import ConfigError


def check_toolsets(toolsets: list[Any], where: str) -> None:
    """ConfigError naming the first toolset rollflow cannot serve in-process, and why."""
    from verifiers.v1.runtimes import SubprocessConfig
    from verifiers.v1.state import State, state_cls

    for toolset in toolsets:
        name = f"{where}: its toolset {type(toolset).__name__}"
        config = getattr(toolset, "config", None)
        if state_cls(type(toolset)) is not State and getattr(config, "url", None):
            raise ConfigError(
                f"{name} keeps state across calls ({state_cls(type(toolset)).__name__}) and runs at a URL; its state "
                "would cross a channel rollflow does not serve (a stateful toolset is served in-process)"
            )
        runtime = getattr(config, "runtime", None)
        if not getattr(config, "url", None) and runtime is not None and not isinstance(runtime, SubprocessConfig):
            raise ConfigError(f"{name} runs in a {type(runtime).__name__} runtime, which rollflow does not start")


def _mcp_server(name: str) -> Any:
    """An MCP server object to register tools on. Making one configures the root logger (a rich
    handler at INFO); this one serves nothing, so the application's logging is kept as it was."""
    try:  # mcp 2.x
        from mcp.server.mcpserver import MCPServer
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as MCPServer
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return MCPServer(name)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _text(result: Any) -> str:
    """A tool result's text: its content blocks' text (mcp 1.x gives (blocks, structured), 2.x a
    result with `content`)."""
    if isinstance(result, tuple):
        result = result[0]
    blocks = getattr(result, "content", result)
    if isinstance(blocks, dict):
        return json.dumps(blocks)
    parts = [block.text if getattr(block, "type", None) == "text" else str(block) for block in blocks]
    return "\n".join(parts)


class _Remote:
    """An MCP server at a URL, in the calls an in-process server answers."""

    def __init__(self, url: str) -> None:
        self.url = url

    @asynccontextmanager
    async def _session(self) -> AsyncIterator[Any]:
        from mcp import ClientSession
        from mcp.client.streamable_http import streamable_http_client

        async with streamable_http_client(self.url) as (read, write, *_), ClientSession(read, write) as session:
            await session.initialize()
            yield session

    async def list_tools(self) -> list[Any]:
        async with self._session() as session:
            return list((await session.list_tools()).tools)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        async with self._session() as session:
            result = await session.call_tool(name, arguments)
        if getattr(result, "isError", None) or getattr(result, "is_error", None):
            raise RuntimeError(_text(result))  # the server's own error text, for the model
        return result


_CURRENT: contextvars.ContextVar[dict[type, Any]] = contextvars.ContextVar("rollflow_toolsets")
"""The calling episode's instance of each toolset class."""


class EpisodeState:
    """An episode's shared state (verifiers' `trace.state`): a value of the task's `State` type."""

    def __init__(self, value: Any) -> None:
        from pydantic import TypeAdapter

        self.value = value
        self.adapter = TypeAdapter(type(value))


_STATE: contextvars.ContextVar[EpisodeState | None] = contextvars.ContextVar("rollflow_episode_state", default=None)
"""The calling episode's state."""

_SERVERS: dict[type, Any] = {}
"""Toolset class -> its in-process MCP server."""


def _class_server(toolset: Any) -> Any:
    """The in-process MCP server of `toolset`'s class: registered once, by the class's own
    `register` (building a tool's argument model takes milliseconds, too long to repeat per
    episode), on a copy whose calls go to the calling episode's instance of the class (`_CURRENT`).
    A sync tool runs on a worker thread, so a slow one never holds the event loop."""
    cls = type(toolset)
    if cls not in _SERVERS:
        prototype = copy.copy(toolset)
        prototype._with_state = functools.partial(_dispatch, cls)  # register wraps each tool with it
        server = _mcp_server(toolset.server_name or cls.__name__)
        prototype.register(server)
        _SERVERS[cls] = server
    return _SERVERS[cls]


def _dispatch(cls: type, fn: Callable[..., Any]) -> Callable[..., Any]:
    name = fn.__name__

    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> Any:
        from verifiers.v1.mcp.server import _call_state
        from verifiers.v1.state import State

        instance = _CURRENT.get()[cls]
        method = getattr(instance, name)
        shared = _STATE.get()
        if shared is None or instance._state_cls is State:  # stateless: `self.state` is inert
            return await _call(method, args, kwargs)
        adapter = instance._state_adapter
        state = adapter.validate_json(shared.adapter.dump_json(shared.value))  # the episode's, as the toolset reads it
        before = adapter.dump_json(state)
        token = _call_state.set(state)  # what the toolset's `self.state` returns during the call
        try:
            result = await _call(method, args, kwargs)  # a guest thread sees the same context
        finally:
            _call_state.reset(token)
        after = adapter.dump_json(state)
        if after != before:  # written back as the task's type, as verifiers' state channel does
            shared.value = shared.adapter.validate_json(after)
        return result

    call.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    return call


async def _call(method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A toolset's method: a sync one on a guest thread, bounded by its caller (the tool call's timeout)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args, **kwargs)
    name = f"tool {getattr(method, '__qualname__', method)}"
    return await guest.call(functools.partial(method, *args, **kwargs), timeout_s=None, name=name)


TOOLSET_CLOSE_S = 30.0
"""How long a toolset set up for an episode may take to release what it holds."""


class ToolServers:
    """Toolsets registered on in-process MCP servers: their tools' chat schemas and calls."""

    def __init__(self, toolsets: list[Any]) -> None:
        self.toolsets = toolsets
        self.schemas: list[dict[str, Any]] = []
        """The tools as the chat template shows them (OpenAI function schemas)."""
        self.tools: dict[str, Tool] = {}
        """advertised name -> the call"""
        self.instances: dict[type, Any] = {}
        """Toolset class -> the instance its tools run on."""
        self.state: EpisodeState | None = None
        """The episode's state, which stateful toolsets read and write."""

    async def start(self, task: Any = None) -> None:
        """Set each toolset up (for `task`, when given) and learn its tools."""
        for toolset in self.toolsets:
            url = getattr(toolset.config, "url", None)
            server: Any
            if url:  # it runs elsewhere: nothing to set up here
                server = _Remote(url)
            else:
                await toolset.setup()
                if task is not None:
                    await toolset.setup_task(task.data)  # the task's data, as verifiers hands a tool server it
                server = _class_server(toolset)
                self.instances[type(toolset)] = toolset
            await self._learn(toolset.server_name, server)

    @classmethod
    async def at(cls, urls: dict[str, str]) -> ToolServers:
        """The tools of the MCP servers at `urls` (server name -> URL, as verifiers hands a harness
        its rollout's tool servers)."""
        here = [prefix for prefix, url in urls.items() if url.startswith(HERE)]
        if here:
            raise RuntimeError(f"the toolset {here[0]!r} is served by rollflow, to the episodes of its run")
        servers = cls([])
        await servers.reach(urls)
        return servers

    async def reach(self, urls: dict[str, str]) -> None:
        """Add the tools of the MCP servers at `urls` that run elsewhere (not `HERE`)."""
        for prefix, url in urls.items():
            if not url.startswith(HERE):
                await self._learn(prefix, _Remote(url))

    async def _learn(self, prefix: str, server: Any) -> None:
        """Add `server`'s tools, named as verifiers' harnesses name them (`<prefix>_<tool>`, bare
        with no prefix)."""
        for tool in await server.list_tools():
            name = f"{prefix}_{tool.name}" if prefix else tool.name
            if name in self.tools:
                raise ConfigError(f"two toolsets advertise the tool {name!r}; keep their TOOL_PREFIX")
            schema = getattr(tool, "inputSchema", None) or getattr(tool, "input_schema", None)
            function = {"name": name, "parameters": schema or {"type": "object"}}
            if tool.description:
                function["description"] = tool.description
            self.schemas.append({"type": "function", "function": function})
            self.tools[name] = _caller(server, tool.name, self.instances)

    async def aclose(self, timeout_s: float = TOOLSET_CLOSE_S) -> None:
        """Release what the toolsets set up here hold (each one's exit stack, as verifiers' server
        closes it when it ends), each within `timeout_s`; one that raises or hangs is logged."""
        instances, self.instances = list(self.instances.values()), {}
        for toolset in instances:
            await close_within(f"the toolset {type(toolset).__name__}", toolset._exit_stack.aclose, timeout_s)

    async def call(self, call: ToolCall, timeout_s: float) -> str:
        """The answer to one tool call (an error text when it fails)."""
        token = _STATE.set(self.state)
        try:
            return await call_tool(self.tools, call, timeout_s)
        finally:
            _STATE.reset(token)


def _caller(server: Any, tool: str, instances: dict[type, Any]) -> Tool:
    async def run(**arguments: Any) -> str:
        token = _CURRENT.set(instances)
        try:
            result = await server.call_tool(tool, arguments)
        except Exception as err:  # the server's own error text, as it answers a remote caller
            return f"error: {err}"
        finally:
            _CURRENT.reset(token)
        return _text(result)

    return run


HERE = "rollflow-tools:"
"""The URL scheme of a toolset rollflow serves in-process to the rollouts of an `Env`'s episode
(`point_here`). verifiers hands a toolset's configured URL to the harness untouched (a toolset at
a URL is one it does not launch), and rollflow's harness is the one that reads it."""


def point_here(task_cls: Any, config: Any) -> tuple[Any, list[int]]:
    """`config` (a task config) with each of its toolset configs that runs on the local runtime
    pointed at rollflow (a `HERE` URL), and the positions in `task_cls.toolsets` of the toolsets so
    pointed: rollflow serves those in-process, verifiers the others. `(config, [])` when none is."""
    import verifiers.v1 as vf
    from verifiers.v1.runtimes import SubprocessConfig

    update = {
        name: value.model_copy(update={"url": HERE + name})
        for name, value in config
        if isinstance(value, vf.ToolsetConfig) and not value.url and isinstance(value.runtime, SubprocessConfig)
    }
    if not update:
        return config, []
    pointed = config.model_copy(update=update)
    before, after = task_cls.toolsets(config), task_cls.toolsets(pointed)
    if len(before) != len(after):
        return config, []
    return pointed, [i for i, toolset in enumerate(after) if str(toolset.config.url or "").startswith(HERE)]


class RolloutTools:
    """The toolsets of one episode's task that `point_here` pointed at rollflow, served in-process to
    each of the episode's rollouts (an agent's run): their own instances, set up for the task, as
    verifiers launches a server per rollout, and their state the rollout trace's, as verifiers'
    state channel keeps it. The rollout's other tool servers are reached at their URLs."""

    def __init__(self, task: Any, positions: list[int]) -> None:
        self.task = task
        self.positions = positions
        self._rollouts: dict[str, ToolServers] = {}

    async def aclose(self) -> None:
        """Release every rollout's toolsets (the episode has ended)."""
        rollouts, self._rollouts = list(self._rollouts.values()), {}
        for servers in rollouts:
            await servers.aclose()

    async def of(self, trace: Any, urls: dict[str, str]) -> ToolServers:
        """The tools of the rollout `trace` records, given its tool servers' `urls`."""
        servers = self._rollouts.get(trace.id)
        if servers is None:
            made = type(self.task).toolsets(self.task.config)
            servers = ToolServers([made[i] for i in self.positions])
            servers.state = EpisodeState(trace.state)
            await servers.start(self.task)
            await servers.reach(urls)
            self._rollouts[trace.id] = servers
        return servers
