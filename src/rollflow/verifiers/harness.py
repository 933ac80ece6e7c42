"""rollflow's verifiers harness: verifiers' null harness loop (the model and the task's tools),
run in-process instead of as a program, so a taskset's own `Env` can drive its agents inside the
run without a sandbox, a harness program or a download at run time.

verifiers' harness contract is that every model call goes through the rollout's interception
endpoint (`endpoint`, bearer `secret`); a harness may run its loop in-process if it keeps to that
(`verifiers.v1.Harness.launch`). This one sends a chat completions call per turn (the task's
system prompt and its prompt, or the conversation so far when an `Env` resumes the exchange), and
while the reply calls tools it calls them on the rollout's tool servers (`mcp_urls`, which
verifiers serves), appends their results as tool messages and asks again; a reply without a tool
call ends the segment. The interception records each call on the rollout's trace and relays it to
the client the run gave the episode: rollflow's endpoint, which generates and records every token
(`rollflow.verifiers.taskset_envs`).

`EndpointRelay` is the other end: the interception's model client (a verifiers `Client`),
answering each relayed call in-process from the run's endpoint (`AgentServer.chat_turn`, the
checks and recording of its chat completions route, for the episode the rollout's session is
bound to), with no HTTP hop between the two.

The toolsets the run serves itself (`TOOLS`: those `toolsets.point_here` pointed at rollflow)
are called in-process; the others are listed and called over MCP at their URLs, as verifiers'
harnesses do (`rollflow.verifiers.toolsets`: `<server>_<tool>` names, a session per call). A call
whose arguments are not a JSON object, or a tool that fails, answers the model with the error.

It is installed as the verifiers harness plugin `rollflow-harness` (the `rollflow_harness` module),
the id verifiers' loader resolves. verifiers is imported by this module: import it only when
verifiers is installed.
"""

from __future__ import annotations

import contextvars
import json
from typing import Any

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.clients import Client
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import model_error
from verifiers.v1.runtimes import ProgramResult

from rollflow.agent.episode import BadRequest
from rollflow.agent.server import AgentServer, Refused
from rollflow.envs.tools import ToolCall
from rollflow.verifiers.toolsets import HERE, RolloutTools, ToolServers

ID = "rollflow-harness"
"""The harness's id in a verifiers `HarnessConfig`."""

CALL_TIMEOUT_S = 3600.0
"""One model call's HTTP deadline; the run's own limits (`env.step_timeout_s`, the episode's
timeout) end a turn long before it."""


TOOLS: contextvars.ContextVar[RolloutTools | None] = contextvars.ContextVar("rollflow_harness_tools", default=None)
"""The toolsets the run serves in-process to the episode's rollouts (set by the run for each episode
whose task has toolsets it points at itself, `toolsets.point_here`)."""

HTTP: contextvars.ContextVar[aiohttp.ClientSession | None] = contextvars.ContextVar(
    "rollflow_harness_http", default=None
)
"""The HTTP session the harness's calls share (set by the run for its episodes, on aiohttp's pool: a
session costs milliseconds to make, and httpx's request and response machinery costs more CPU per
call than the call's own work here); without one, a call makes its own."""


class InProcessHarnessConfig(vf.HarnessConfig):
    id: str = ID


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    """verifiers' null harness loop, in-process, through the interception endpoint: the model's
    turn, and while it calls tools, their results and the next turn."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        model = _Model(endpoint, secret, ctx.model)
        tools = await _tools(trace, mcp_urls) if mcp_urls else None
        shared = HTTP.get()
        if shared is not None:
            return await self._loop(model, shared, messages, tools, trace)
        async with harness_http() as session:
            return await self._loop(model, session, messages, tools, trace)

    async def _loop(
        self,
        model: _Model,
        session: aiohttp.ClientSession,
        messages: list[dict],
        tools: ToolServers | None,
        trace: Any,
    ) -> ProgramResult:
        """Turns until one calls no tool; a refused model call ends the segment as the program's
        failure (verifiers reads a stopped rollout's refusal as the stop it is)."""
        while True:
            reply = await model.chat(session, messages, tools.schemas if tools else None)
            if isinstance(reply, str):
                return ProgramResult(exit_code=1, stdout="", stderr=reply)
            message = reply["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            if not calls or tools is None:
                return ProgramResult(exit_code=0, stdout="", stderr="")
            messages.append(message)
            for call in calls:
                content = await _run_tool(tools, call["function"], self.config.tool_timeout, trace)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})


async def _tools(trace: Any, urls: dict[str, str]) -> ToolServers:
    """The rollout's tools: those the run serves in-process (`TOOLS`) and those at their URLs."""
    here = TOOLS.get()
    if here is not None and any(url.startswith(HERE) for url in urls.values()):
        return await here.of(trace, urls)
    return await ToolServers.at(urls)


class _Model:
    """The rollout's interception endpoint, as the harness calls it."""

    def __init__(self, endpoint: str, secret: str, model: str) -> None:
        self.url = endpoint.rstrip("/") + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {secret}"}
        self.model = model

    async def chat(self, session: aiohttp.ClientSession, messages: list[dict], tools: list | None) -> dict | str:
        """The chat completion, or why there is none."""
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools:
            body["tools"] = tools
        async with session.post(self.url, json=body, headers=self.headers) as response:
            if response.status != 200:
                return f"model call: HTTP {response.status}: {await response.text()}"
            return await response.json()


async def _run_tool(tools: ToolServers, function: dict, timeout_s: float, trace: Any) -> str:
    """One tool call's result; an error text, for the model, when its arguments are not a JSON
    object or the tool fails. A toolset served in-process reads and writes the rollout's state on
    its trace, as verifiers' state channel has it do."""
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as err:
        return f"error: the tool call's arguments are not valid JSON ({err.msg} at character {err.pos})"
    if not isinstance(arguments, dict):
        return f"error: a tool call's arguments are a JSON object, not {type(arguments).__name__}"
    if tools.state is None:
        return await tools.call(ToolCall(function["name"], arguments), timeout_s)
    tools.state.value = trace.state  # as it stands: the task's hooks may have changed it
    try:
        return await tools.call(ToolCall(function["name"], arguments), timeout_s)
    finally:
        trace.state = tools.state.value


def harness_http() -> aiohttp.ClientSession:
    """An HTTP session for the harness's calls (`HTTP`): aiohttp's pool, unbounded, each call with
    `CALL_TIMEOUT_S` as its deadline."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
    )


class EndpointRelay(Client):
    """verifiers' model client for the run's endpoint, in-process: a relayed chat completions call
    is the turn of the episode its rollout's session is bound to."""

    def __init__(self, server: AgentServer) -> None:
        self.server = server

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Any = None,
    ) -> Any:
        if not isinstance(dialect, ChatDialect):
            raise model_error(f"{type(dialect).__name__}: rollflow's harness speaks chat completions", status_code=400)
        episode = self.server.registry.session_episode(session_id)
        if episode is None:
            raise model_error(f"rollout {session_id} belongs to no running episode", status_code=404)
        try:
            reply = await self.server.chat_turn(episode, body, session_id)
        except BadRequest as err:
            raise model_error(f"upstream 400: {err} ({err.param})", status_code=400) from None
        except Refused as err:
            raise model_error(f"upstream {err.status}: {err}", status_code=err.status) from None
        raw = self.server.chat_completion(episode, reply, body)
        response = dialect.parse_response(dialect.validate_response(raw))
        response.raw = raw
        return response
