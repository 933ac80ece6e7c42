"""The endpoint a run serves its agents (aiohttp, 127.0.0.1 by default), in the dialects agents use.

Each episode has its own base URL, `http://HOST:PORT/episodes/<id>/v1`, so an agent needs only
`base_url` and concurrent episodes never mix. Routes under it: `POST /chat/completions` (OpenAI's
chat completions), `POST /responses` (OpenAI's Responses API, `rollflow.agent.responses`),
`POST /messages` (Anthropic's Messages API, `rollflow.agent.anthropic`; Anthropic's client takes
the URL without `/v1`) and `GET /models` (in a form both clients read).
The same routes answer at the run's one URL, `http://HOST:PORT/v1/...`, for the episode whose key
the call carries (`Authorization: Bearer KEY` or `x-api-key: KEY`; who a call is for, keys and
bound sessions: `rollflow.agent.registry`); a refused key is a 401 in the dialect's error shape.
A call with an `X-Session-ID` header belongs to that session of its episode: each session is a
conversation of its own (a program that runs several agents in one episode, verifiers' `Env`s),
and the episode's sample is one session's (`AgentEpisode.sample`).

A chat request the run cannot honour — another model, a sampling setting other than the run's
(the importance-sampling correction assumes the run's distribution), `n` > 1, constrained
decoding, a field the API does not have — gets an OpenAI-style error body (`{"error": {"message", "type", "param",
"code"}}`) and status 400; nothing is silently changed.

`stream: true` is answered as server-sent events in the dialect's format; they are sent once the
turn has been generated and recorded, not token by token: in `restart` mode a weight update
discards the tokens of the turn so far, and what the agent saw must be what is trained. This
module does not record tokens (`rollflow.agent.episode`) or run agents (`rollflow.agent`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
from typing import Any

from aiohttp import web

from rollflow.agent import anthropic, responses
from rollflow.agent.dialect import check_run_settings, function_tool, positive, stop_sequences, tool_list
from rollflow.agent.episode import AgentEpisode, BadRequest, Reply
from rollflow.agent.registry import SESSION_HEADER, Refused, Registry
from rollflow.records import SamplingSpec

log = logging.getLogger(__name__)

_CHANGES_SAMPLING = ("frequency_penalty", "presence_penalty", "logit_bias", "response_format", "top_k", "min_p")

FIELDS = frozenset(
    {
        "model", "messages", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
        "max_completion_tokens", "max_tokens", "n", "seed", "stop", "stream", "stream_options", "temperature",
        "top_p", "tools", "tool_choice", "parallel_tool_calls", "response_format", "metadata", "store", "user",
        "service_tier", "prediction", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
        "verbosity", "reasoning_effort", "modalities", "audio", "functions", "function_call", "web_search_options",
        "top_k", "min_p", "repetition_penalty",  # vLLM's, refused unless they leave the distribution alone
    }
)  # fmt: skip
"""The request fields of chat completions this endpoint reads (any other is refused)."""

_UNSUPPORTED = {
    "functions": "functions and function_call are the API's old form of tools: send tools",
    "function_call": "functions and function_call are the API's old form of tools: send tools",
    "audio": "only text is supported",
    "reasoning_effort": "reasoning settings are not supported (the run's sampling decides the turn)",
    "web_search_options": "built-in web search is not supported (only function tools)",
}
"""Fields refused whenever they are set, and why."""


class AgentServer:
    """Serves every episode of a run; `open` gives an episode its base URL."""

    def __init__(
        self,
        model: str,
        sampling: SamplingSpec,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        call_timeout_s: float = 60.0,
    ) -> None:
        self.model = model
        """The name requests must ask for (`GET /v1/models` lists it)."""
        self.sampling = sampling
        self.host = host
        self.port = port
        self.call_timeout_s = call_timeout_s
        self.registry = Registry()
        """Who a call is for: the running episodes, their keys and sessions."""
        self._conversations: dict[str, dict[str, list[dict[str, Any]]]] = {}
        """Responses API: episode id -> response id -> the conversation it ended, until the episode ends."""
        self._runner: web.AppRunner | None = None
        self.requests = 0

    @property
    def relay_key(self) -> str:
        """The key of the run's own model client (`Registry.relay_key`)."""
        return self.registry.relay_key

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{episode}/v1/messages", self._messages)
        app.router.add_post("/episodes/{episode}/v1/responses", self._responses)
        app.router.add_post("/v1/chat/completions", self._chat)  # the episode chosen by the call's key
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/responses", self._responses)
        # A call whose agent went away (its episode timed out, the run ended) stops generating.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        sock = socket.create_server((self.host, self.port))  # bound here: port 0 gives a free one
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, episode: AgentEpisode) -> tuple[str, str]:
        """Register an episode; returns (its id, its base URL)."""
        key = self.registry.open(episode)
        return key, f"{self.url}/episodes/{key}/v1"

    def api_key(self, key: str) -> str:
        """The key that selects episode `key` on the run's one URL."""
        return self.registry.api_key(key)

    def close(self, key: str) -> None:
        """The episode has ended: its URL answers 404, its key 401, its sessions 401 from now on."""
        self.registry.close(key)
        self._conversations.pop(key, None)

    # ---- routes ------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        """The one model, as OpenAI's and Anthropic's clients list models."""
        model = {
            "id": self.model, "object": "model", "created": 0, "owned_by": "rollflow",  # OpenAI's fields
            "type": "model", "display_name": self.model, "created_at": "1970-01-01T00:00:00Z",  # Anthropic's
        }  # fmt: skip
        return web.json_response(
            {"object": "list", "data": [model], "has_more": False, "first_id": self.model, "last_id": self.model}
        )

    async def _call(self, request: web.Request) -> tuple[str, AgentEpisode, dict[str, Any]]:
        """The call's episode (its id, itself) and its JSON body, or `Refused`."""
        self.requests += 1
        key = request.match_info.get("episode") or self._key_of(request)
        episode = self.registry.episodes.get(key)
        if episode is None:
            raise Refused(404, f"episode {key} is not running (it has ended, or never existed)", "not_found")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise Refused(400, "the request body is not valid JSON") from None
        except ConnectionResetError:  # the agent went away (its episode ended) mid-request
            raise Refused(499) from None
        if not isinstance(body, dict):
            raise Refused(400, "the request body must be a JSON object")
        return key, episode, body

    def _key_of(self, request: web.Request) -> str:
        """The episode a call to the run's one URL is for, by its key (the relay key: by its bound
        session); `Refused` (401) otherwise, and when its session is another episode's."""
        bearer = request.headers.get("Authorization", "")
        secret = request.headers.get("x-api-key") or (bearer[7:] if bearer.startswith("Bearer ") else "")
        return self.registry.key_for(secret, request.headers.get(SESSION_HEADER, ""))

    async def chat_turn(self, episode: AgentEpisode, body: dict[str, Any], session: str | None) -> Reply:
        """One chat completions call's turn, checked as the endpoint checks it (`BadRequest`, or
        `Refused` past `call_timeout_s`): what its route serves over HTTP, and what a caller in the
        run's process (a verifiers Env's relay, `rollflow.verifiers.taskset_envs`) asks for directly."""
        return await self._complete(episode, body.get("messages"), self._check(body), session)

    def chat_completion(self, episode: AgentEpisode, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        """`reply` as OpenAI's chat completion object (with log-probs when `body` asks for them)."""
        logprobs = self._logprobs(episode, reply) if body.get("logprobs") else None
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": logprobs}],
            "usage": _usage(reply),
        }

    async def _turn(self, request: web.Request, episode: AgentEpisode, messages: Any, call: dict[str, Any]) -> Reply:
        """The model's turn for the call, in the session its `X-Session-ID` names."""
        return await self._complete(episode, messages, call, request.headers.get(SESSION_HEADER))

    async def _complete(self, episode: AgentEpisode, messages: Any, call: dict[str, Any], session: str | None) -> Reply:
        """The model's turn (`BadRequest`, or `Refused` past `call_timeout_s`)."""
        try:
            return await asyncio.wait_for(episode.complete(messages, session=session, **call), self.call_timeout_s)
        except TimeoutError:
            raise Refused(
                504, f"the model's turn took longer than {self.call_timeout_s:g} s (env.step_timeout_s)", "timeout"
            ) from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            _, episode, body = await self._call(request)
            reply = await self.chat_turn(episode, body, request.headers.get(SESSION_HEADER))
        except (BadRequest, Refused) as err:
            return _openai_error(err)
        if body.get("stream"):
            created, rid = int(time.time()), f"chatcmpl-{secrets.token_hex(12)}"
            logprobs = self._logprobs(episode, reply) if body.get("logprobs") else None
            return await self._stream(request, reply, rid, created, logprobs, body)
        return web.json_response(self.chat_completion(episode, reply, body))

    def _check(self, body: dict[str, Any]) -> dict[str, Any]:
        """The call's settings, or `BadRequest` for one the run cannot honour."""
        check_run_settings(body, self.model, self.sampling, fields=FIELDS, api="chat completions API")
        if body.get("n") not in (None, 1):
            raise BadRequest("n must be 1: each call is one turn of the episode", "n")
        for name, why in _UNSUPPORTED.items():
            if body.get(name) is not None:
                raise BadRequest(why, name)
        if body.get("modalities") not in (None, ["text"]):
            raise BadRequest('only text is supported: modalities must be ["text"]', "modalities")
        for name in _CHANGES_SAMPLING:
            if body.get(name) not in (None, 0, 0.0, {}):
                raise BadRequest(f"{name} would change the distribution the run samples from", name)
        if body.get("repetition_penalty") not in (None, 1, 1.0):
            raise BadRequest("repetition_penalty would change the distribution the run samples from",
                             "repetition_penalty")  # fmt: skip
        if body.get("top_logprobs"):
            raise BadRequest("top_logprobs is not supported (logprobs of the sampled tokens are)", "top_logprobs")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise BadRequest(
                'tool_choice must be "auto" or "none": a forced call would need constrained decoding', "tool_choice"
            )
        tools = tool_list(body.get("tools"), _chat_tool)
        limit = positive(body.get("max_completion_tokens", body.get("max_tokens")), "max_completion_tokens")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise BadRequest("expected an integer", "seed")
        return {
            "tools": tools or None,
            "max_tokens": limit,
            "seed": seed,
            "parse_tools": choice != "none",
            "stop": stop_sequences(body.get("stop"), "stop"),
        }

    def _logprobs(self, episode: AgentEpisode, reply: Reply) -> dict[str, Any]:
        texts = [episode.chat.tokenizer.decode([t]) for t in reply.token_ids]  # each token decoded once
        return {
            "content": [
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                for text, lp in zip(texts, reply.logprobs, strict=True)
            ]
        }

    async def _stream(
        self,
        request: web.Request,
        reply: Reply,
        rid: str,
        created: int,
        logprobs: dict[str, Any] | None,
        body: dict[str, Any],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": reply.content or ""}, logprobs=logprobs)
        if reply.tool_calls:
            await send({"tool_calls": [{"index": i, **call} for i, call in enumerate(reply.tool_calls)]})
        await send({}, reply.finish_reason)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model,
                "choices": [],
                "usage": _usage(reply),
            }
            await response.write(f"data: {json.dumps(usage)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API (`rollflow.agent.anthropic`)."""
        try:
            _, episode, body = await self._call(request)
            messages, call = anthropic.chat_call(body, self.model, self.sampling)
            reply = await self._turn(request, episode, messages, call)
        except (BadRequest, Refused) as err:
            return _anthropic_error(err)
        if not body.get("stream"):
            return web.json_response(anthropic.message(reply, self.model))
        return await _events(request, anthropic.events(reply, self.model))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (`rollflow.agent.responses`)."""
        try:
            key, episode, body = await self._call(request)
            messages, call = responses.chat_call(body, self.model, self.sampling, self._earlier(key, body))
            reply = await self._turn(request, episode, messages, call)
        except (BadRequest, Refused) as err:
            return _openai_error(err)
        include = body.get("include")
        wanted = isinstance(include, list) and responses.LOGPROBS in include
        logprobs = self._logprobs(episode, reply)["content"] if wanted else None
        done = responses.response(reply, body, self.model, self.sampling, logprobs)
        if key in self.registry.episodes:  # (an episode that ended meanwhile keeps nothing)
            self._conversations.setdefault(key, {})[done["id"]] = responses.conversation(messages, reply)
        if not body.get("stream"):
            return web.json_response(done)
        return await _events(request, [(event["type"], event) for event in responses.events(done)])

    def _earlier(self, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The conversation `previous_response_id` ended (a response of this episode), or none."""
        previous = body.get("previous_response_id")
        if previous is None:
            return []
        stored = self._conversations.get(key, {}).get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise BadRequest(f"no response {previous!r} in this episode", "previous_response_id")
        return stored


async def _events(request: web.Request, events: list[tuple[str, dict[str, Any]]]) -> web.StreamResponse:
    """A dialect's named server-sent events (Responses, Messages), sent in one go: the turn is recorded."""
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await stream.prepare(request)
    for name, data in events:
        await stream.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
    await stream.write_eof()
    return stream


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """One chat completions tool, checked as Responses and Messages check theirs."""
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(
            f'{where}: expected {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', where
        )
    if not isinstance(function.get("parameters", {}), dict):
        raise BadRequest(f"{where}.function.parameters: expected a JSON schema object", f"{where}.function.parameters")
    return function_tool(function["name"], function.get("parameters"), function.get("description"))


def _openai_error(err: BadRequest | Refused) -> web.StreamResponse:
    """A refused call in OpenAI's error shape (chat completions, Responses)."""
    if isinstance(err, BadRequest):
        return _error(400, str(err), err.param)
    if err.status == 499:  # the agent went away: nobody reads an answer
        return web.Response(status=499)
    return _error(err.status, str(err), None, err.code)


def _anthropic_error(err: BadRequest | Refused) -> web.StreamResponse:
    """A refused call in Anthropic's error shape, whose body has no field for the parameter: the
    message names it."""
    if isinstance(err, Refused) and err.status == 499:
        return web.Response(status=499)
    status = err.status if isinstance(err, Refused) else 400
    text = str(err)
    if isinstance(err, BadRequest) and err.param and not text.startswith(err.param):
        text = f"{err.param}: {text}"
    return web.json_response(anthropic.error(status, text), status=status)


def _usage(reply: Reply) -> dict[str, int]:
    n = len(reply.token_ids)
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": n, "total_tokens": reply.prompt_tokens + n}


def _error(status: int, message: str, param: str | None, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)
