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

Tools are not served here (`SUPPORTS_MCP` is off: verifiers refuses a toolset at pairing, and
rollflow refuses such tasksets at start). It is installed as the verifiers harness plugin
`rollflow-harness` (the `rollflow_harness` module), the id verifiers' loader resolves. verifiers is
imported by this module: import it only when verifiers is installed.
"""

from __future__ import annotations

import contextvars
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

ID = "rollflow-harness"
"""The harness's id in a verifiers `HarnessConfig`."""

CALL_TIMEOUT_S = 3600.0
"""One model call's HTTP deadline; the run's own limits (`env.step_timeout_s`, the episode's
timeout) end a turn long before it."""


HTTP: contextvars.ContextVar[httpx.AsyncClient | None] = contextvars.ContextVar("rollflow_harness_http", default=None)
"""The HTTP client the harness's calls share (set by the run for its episodes: a client costs tens
of milliseconds to make); without one, a call makes its own."""


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
            response = await shared.post(url, json=body, headers=headers)
        else:
            async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as client:
                response = await client.post(url, json=body, headers=headers)
        if response.status_code != 200:
            why = f"model call: HTTP {response.status_code}: {response.text}"
            return ProgramResult(exit_code=1, stdout="", stderr=why)
        return ProgramResult(exit_code=0, stdout="", stderr="")
