"""rollflow's verifiers harness: verifiers' null harness loop (the model and nothing else),
run in-process instead of as a program, so a taskset's own `Env` can drive its agents inside the
run without a sandbox, a subprocess or a download at run time.

verifiers' harness contract is that every model call goes through the rollout's interception
endpoint (`endpoint`, bearer `secret`); a harness may run its loop in-process if it keeps to that
(`verifiers.v1.Harness.launch`). This one sends one chat completions call per segment (the task's
system prompt and its prompt, or the conversation so far when an `Env` resumes the exchange) and
returns. The interception records the call on the rollout's trace and relays it to the client the
run gave the episode: rollflow's endpoint, which generates and records every token
(`rollflow.envs.taskset_envs`).

`EndpointRelay` is the other end: the interception's model client (a verifiers `Client`),
answering each relayed call in-process from the run's endpoint (`AgentServer.chat_turn`, the
checks and recording of its chat completions route, for the episode the rollout's session is
bound to), with no HTTP hop between the two.

Tools are not served here (`SUPPORTS_MCP` is off: verifiers refuses a toolset at pairing, and
rollflow refuses such tasksets at start). It is installed as the verifiers harness plugin
`rollflow-harness` (the `rollflow_harness` module), the id verifiers' loader resolves. verifiers is
imported by this module: import it only when verifiers is installed.
"""

from __future__ import annotations

import contextvars
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

ID = "rollflow-harness"
"""The harness's id in a verifiers `HarnessConfig`."""

CALL_TIMEOUT_S = 3600.0
"""One model call's HTTP deadline; the run's own limits (`env.step_timeout_s`, the episode's
timeout) end a turn long before it."""


HTTP: contextvars.ContextVar[aiohttp.ClientSession | None] = contextvars.ContextVar("rollflow_harness_http", default=None)
"""The HTTP session the harness's calls share (set by the run for its episodes, on aiohttp's pool: a
session costs milliseconds to make, and httpx's request and response machinery costs more CPU per
call than the call's own work here); without one, a call makes its own."""


class InProcessHarnessConfig(vf.HarnessConfig):
    id: str = ID


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    """The null harness's one-call segment, in-process, through the interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
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
        url = endpoint.rstrip("/") + "/chat/completions"
        body = {"model": ctx.model, "messages": messages}
        headers = {"Authorization": f"Bearer {secret}"}
        shared = HTTP.get()
        if shared is not None:
            return await _post(shared, url, body, headers)
        async with harness_http() as session:
            return await _post(session, url, body, headers)


def harness_http() -> aiohttp.ClientSession:
    """An HTTP session for the harness's calls (`HTTP`): aiohttp's pool, unbounded, each call with
    `CALL_TIMEOUT_S` as its deadline."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
    )


async def _post(session: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> ProgramResult:
    """One model call to the interception endpoint; a failed one is the program's failure."""
    async with session.post(url, json=body, headers=headers) as response:
        if response.status != 200:
            why = f"model call: HTTP {response.status}: {await response.text()}"
            return ProgramResult(exit_code=1, stdout="", stderr=why)
        await response.read()
    return ProgramResult(exit_code=0, stdout="", stderr="")


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
        episode = self.server.session_episode(session_id)
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
