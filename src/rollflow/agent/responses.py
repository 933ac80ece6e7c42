"""OpenAI's Responses API on the agents' endpoint: `POST <episode URL>/responses`.

An agent written against `client.responses.create(...)` is served by the same recording as chat
completions. The request's `instructions` and `input` items are read as the chat call they are
(`instructions` -> a system message; message items -> messages, their `input_text` /
`output_text` parts as text; `function_call` items -> the assistant's tool calls; a
`function_call_output` item -> a tool message), after the conversation of `previous_response_id`
when given (a response of the same episode: the endpoint keeps each response's conversation until
the episode ends). The model's turn is answered as a `response` whose `output` holds a `message`
item (`output_text`) and a `function_call` item per tool call, `status` `completed` or
`incomplete` (`max_output_tokens`), and the turn's log-probs when `include` asks for
`message.output_text.logprobs`. With `stream: true`, the Responses event stream
(`response.created` ... `response.completed`, each event with its `sequence_number`), sent once
the turn has been recorded.

What the run cannot honour (another model, a sampling setting other than the run's, a forced tool
choice, built-in tools, structured output, reasoning settings, `top_logprobs`, images and files,
an unknown field) is a 400 in OpenAI's error shape naming the field. This module translates; it
does not serve (`rollflow.agent.server`) or record (`rollflow.agent.episode`).
"""

from __future__ import annotations

import copy
import secrets
import time
from typing import Any

from rollflow.agent.dialect import check_run_settings, function_tool, positive, tool_list
from rollflow.agent.episode import BadRequest, Reply
from rollflow.records import SamplingSpec

FIELDS = frozenset(
    {
        "model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "max_output_tokens",
        "temperature", "top_p", "stream", "store", "metadata", "parallel_tool_calls", "text", "reasoning",
        "truncation", "user", "include", "top_logprobs", "service_tier", "stream_options",
    }
)  # fmt: skip
"""The request fields of the Responses API this endpoint reads (any other is refused)."""

ROLES = ("system", "developer", "user", "assistant")

LOGPROBS = "message.output_text.logprobs"
"""The `include` value that asks for the turn's log-probs: every token's, on the message's text
(tool-call text and the end token included, as chat completions gives them); other `include`
values ask for what this endpoint never makes (reasoning, search results) and change nothing."""


def chat_call(
    body: dict[str, Any], model: str, sampling: SamplingSpec, earlier: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the conversation as chat messages: `earlier`, the conversation of `previous_response_id`,
    then this request's; the call's settings for `AgentEpisode.complete`), or `BadRequest`."""
    _check(body, model, sampling)
    limit = positive(body.get("max_output_tokens"), "max_output_tokens")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions: expected a string", "instructions")
    # A previous response's instructions are not carried over (the API's rule): this call's stand first.
    history = [m for m in earlier if m["role"] != "system"] if instructions else list(earlier)
    opening = [{"role": "system", "content": instructions}] if instructions else []
    messages = opening + history + _items(body.get("input"))
    choice = body.get("tool_choice")
    tools = tool_list(body.get("tools"), _tool)
    settings = {"tools": tools, "max_tokens": limit, "seed": None, "parse_tools": choice != "none"}
    return messages, settings


def _check(body: dict[str, Any], model: str, sampling: SamplingSpec) -> None:
    check_run_settings(body, model, sampling, fields=FIELDS, api="Responses API")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise BadRequest('tool_choice must be "auto" or "none": a forced call would need constrained decoding',
                         "tool_choice")  # fmt: skip
    if body.get("top_logprobs"):
        raise BadRequest("top_logprobs is not supported", "top_logprobs")
    form = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if form not in (None, {"type": "text"}):
        raise BadRequest("text.format: only plain text; structured output would need constrained decoding", "text")
    reasoning = body.get("reasoning")
    if reasoning and not (isinstance(reasoning, dict) and all(v is None for v in reasoning.values())):
        raise BadRequest("reasoning settings are not supported (the run's sampling decides the turn)", "reasoning")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    kinds = ("input_text", "output_text", "text")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest(f"{param}: expected text or text parts (images and files are not supported)", param)


def _items(given: Any) -> list[dict[str, Any]]:
    """Input items as chat messages: an assistant message and the function calls after it are one
    assistant message with tool calls (the form a reply is recorded in)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise BadRequest("input: expected text or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise BadRequest(f"{param}.role: expected one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", "{}"), str):
                raise BadRequest(f"{param}: a function_call needs a name and arguments (a JSON string)", param)
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}  # fmt: skip
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            text = _text(item.get("output", ""), f"{param}.output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        else:
            raise BadRequest(f"{param}: message, function_call and function_call_output items only, not {kind!r}",
                             param)  # fmt: skip
    return out


def _tool(tool: Any, where: str) -> dict[str, Any]:
    """One function tool in the chat form."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise BadRequest(f"{where}: only function tools are supported, not {kind!r} (built-in tools run elsewhere)",
                         where)  # fmt: skip
    if not isinstance(tool.get("name"), str):
        raise BadRequest(f"{where}: a function tool needs a name", where)
    return function_tool(tool["name"], tool.get("parameters"), tool.get("description"))


def output(reply: Reply, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The turn as output items: a message with its text (and `logprobs`, when asked for), then a
    function_call per tool call."""
    items: list[dict[str, Any]] = []
    if reply.content:
        text = {"type": "output_text", "text": reply.content, "annotations": [], "logprobs": logprobs or []}
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "completed",
                      "role": "assistant", "content": [text]})  # fmt: skip
    for call in reply.tool_calls:
        items.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})  # fmt: skip
    return items


def response(
    reply: Reply,
    body: dict[str, Any],
    model: str,
    sampling: SamplingSpec,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The Responses API's response to one call; `logprobs`, each token's of the turn, go on its
    message's text (`include: ["message.output_text.logprobs"]`)."""
    cut = reply.finish_reason == "length"
    n = len(reply.token_ids)
    return {
        "id": f"resp_{secrets.token_hex(12)}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": model,
        "output": output(reply, logprobs),
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": True,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_output_tokens": body.get("max_output_tokens"),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_tokens + n,
        },
    }


def events(done: dict[str, Any]) -> list[dict[str, Any]]:
    """The response as the Responses event stream, in order, numbered."""
    opened = {**copy.deepcopy(done), "status": "in_progress", "output": [], "usage": None}
    out: list[dict[str, Any]] = [
        {"type": "response.created", "response": opened},
        {"type": "response.in_progress", "response": opened},
    ]
    for index, item in enumerate(done["output"]):
        out += _item_events(index, item)
    out.append({"type": f"response.{'incomplete' if done['status'] == 'incomplete' else 'completed'}",
                "response": done})  # fmt: skip
    return [{**event, "sequence_number": n} for n, event in enumerate(out)]


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    at = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "function_call":
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": {**item, "arguments": "", "status": "in_progress"}},
            {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
            {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"],
             "name": item["name"]},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]  # fmt: skip
    part = item["content"][0]
    empty = {**part, "text": ""}
    return [
        {"type": "response.output_item.added", "output_index": index,
         "item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **at, "content_index": 0, "part": empty},
        {"type": "response.output_text.delta", **at, "content_index": 0, "delta": part["text"],
         "logprobs": part["logprobs"]},
        {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
         "logprobs": part["logprobs"]},
        {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]  # fmt: skip


def conversation(messages: list[dict[str, Any]], reply: Reply) -> list[dict[str, Any]]:
    """The call's conversation with the reply appended, as a later `previous_response_id` continues it."""
    answer: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        answer["tool_calls"] = copy.deepcopy(reply.tool_calls)
    return [*messages, answer]
