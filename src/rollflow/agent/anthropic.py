"""Anthropic's Messages API on the agents' endpoint: `POST <episode URL>/v1/messages`.

An agent written against the `anthropic` client (`AsyncAnthropic(base_url=...)`, whose base URL
is the episode's URL without its `/v1`) is served by the same recording as chat completions: a
request is translated into the chat form the episode records (`system` -> a system message, text
blocks -> text, `tool_use` blocks -> an assistant's tool calls, `tool_result` blocks -> tool
messages, `tools`' `input_schema` -> function parameters), and the model's turn is answered as a
`message` with `text` and `tool_use` blocks and Anthropic's `stop_reason` (`end_turn`,
`max_tokens`, `tool_use`, and `stop_sequence` for one of the request's `stop_sequences`). A
history the client sends back extends the episode's tokens exactly when it holds the earlier
replies as they were returned; otherwise the episode starts a new segment, as for chat
completions (`rollflow.agent.episode`).

`stream: true` is answered with the Messages event stream (`message_start`,
`content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`), sent once the turn
has been generated and recorded (the server's rule for every dialect). What the run cannot
honour (another model, a sampling setting other than the run's, `top_k`, a forced tool choice,
extended thinking, server tools, images, an unknown field) is a 400 in Anthropic's error shape
(`{"type": "error", "error": {"type", "message"}}`) naming the field. This module translates; it
does not serve (`rollflow.agent.server`) or record (`rollflow.agent.episode`).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from rollflow.agent.dialect import check_run_settings, function_tool, positive, stop_sequences, tool_list
from rollflow.agent.episode import BadRequest, Reply
from rollflow.records import SamplingSpec

FIELDS = frozenset(
    {
        "model", "messages", "system", "max_tokens", "metadata", "stop_sequences", "stream", "temperature",
        "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier",
    }
)  # fmt: skip
"""The request fields of the Messages API this endpoint reads (any other is refused)."""

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""The episode's finish reasons as Anthropic's stop reasons."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 504: "timeout_error"}


def chat_call(body: dict[str, Any], model: str, sampling: SamplingSpec) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the request's conversation as chat messages, the call's settings for `AgentEpisode.complete`),
    or `BadRequest` naming the field the run cannot honour."""
    check_run_settings(body, model, sampling, fields=FIELDS, api="Messages API")
    limit = positive(body.get("max_tokens"), "max_tokens")
    if limit is None:
        raise BadRequest("max_tokens: expected a positive integer (the Messages API requires it)", "max_tokens")
    if body.get("top_k") is not None:
        raise BadRequest("top_k would change the distribution the run samples from", "top_k")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") != "disabled"):
        raise BadRequest("thinking: extended thinking is not supported (the run's sampling decides the turn)",
                         "thinking")  # fmt: skip
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is not None and kind not in ("auto", "none"):
        raise BadRequest('tool_choice: "auto" or "none" only; a forced call would need constrained decoding',
                         "tool_choice")  # fmt: skip
    messages = _system(body.get("system")) + _conversation(body.get("messages"))
    settings = {
        "tools": tool_list(body.get("tools"), _tool),
        "max_tokens": limit,
        "seed": None,
        "parse_tools": kind != "none",
        "stop": stop_sequences(body.get("stop_sequences"), "stop_sequences"),
    }
    return messages, settings


def _text(content: Any, param: str) -> str:
    """A string, or a list of text blocks, as text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise BadRequest(f"{param}: expected a string or a list of text blocks", param)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _conversation(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of messages", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        asked = (
            {c["id"] for c in (out[-1].get("tool_calls") or [])} if out and out[-1]["role"] == "assistant" else set()
        )
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise BadRequest(f'{param}.role: expected "user" or "assistant", got {role!r}', f"{param}.role")
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BadRequest(f"{param}.content: expected a string or a list of content blocks", f"{param}.content")
        out += _assistant(blocks, param) if role == "assistant" else _user(blocks, param, asked)
    return out


def _user(blocks: list[Any], param: str, asked: set[str]) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages and its text as user messages, in order.
    Each tool result answers a `tool_use` of the assistant turn before it (`asked`), as Anthropic's
    API requires."""
    out: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += str(block.get("text", ""))
            else:
                out.append({"role": "user", "content": str(block.get("text", ""))})
        elif kind == "tool_result":
            if block.get("tool_use_id") not in asked:
                raise BadRequest(
                    f"{where}: tool_use_id {block.get('tool_use_id')!r} answers no tool_use block of the previous "
                    "(assistant) message", f"{where}.tool_use_id",
                )  # fmt: skip
            content = block.get("content", "")
            text = _text(content, f"{where}.content") if content is not None else ""
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
        else:
            raise BadRequest(f"{where}: a user turn holds text and tool_result blocks, not {kind!r}", where)
    return out


def _assistant(blocks: list[Any], param: str) -> list[dict[str, Any]]:
    """An assistant turn: its text, and its tool_use blocks as tool calls."""
    text, calls = "", []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += str(block.get("text", ""))
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise BadRequest(f"{where}: a tool_use block needs a name and an input object", where)
            arguments = json.dumps(block.get("input", {}))
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": arguments}})  # fmt: skip
        else:
            raise BadRequest(f"{where}: an assistant turn holds text and tool_use blocks, not {kind!r}", where)
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool(tool: Any, where: str) -> dict[str, Any]:
    """One custom tool in the chat form."""
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadRequest(f"{where}: only custom tools (name, input_schema) are supported, not {kind!r}", where)
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise BadRequest(f"{where}: a tool needs a name and an input_schema object", where)
    return function_tool(tool["name"], tool["input_schema"], tool.get("description"))


def blocks(reply: Reply) -> list[dict[str, Any]]:
    """The turn as content blocks: its text, then each tool call as a `tool_use` block."""
    out: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    for call in reply.tool_calls:
        arguments = json.loads(call["function"]["arguments"])
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": arguments if isinstance(arguments, dict) else {"value": arguments}})  # fmt: skip
    return out


def message(reply: Reply, model: str) -> dict[str, Any]:
    """The Messages API's response to one call."""
    return {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks(reply),
        "stop_reason": "stop_sequence" if reply.stop_sequence else STOP_REASONS.get(reply.finish_reason, "end_turn"),
        "stop_sequence": reply.stop_sequence,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": len(reply.token_ids)},
    }


def events(reply: Reply, model: str) -> list[tuple[str, dict[str, Any]]]:
    """The same response as the Messages event stream: (event name, data) in order."""
    done = message(reply, model)
    start = {**done, "content": [], "stop_reason": None, "usage": {"input_tokens": reply.prompt_tokens,
                                                                    "output_tokens": 0}}  # fmt: skip
    out: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(done["content"]):
        opened: dict[str, Any]
        delta: dict[str, Any]
        if block["type"] == "text":
            opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        out += [
            ("content_block_start", {"type": "content_block_start", "index": i, "content_block": opened}),
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]
    out += [
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": done["stop_reason"],
                                                              "stop_sequence": done["stop_sequence"]},
                           "usage": {"output_tokens": len(reply.token_ids)}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return out


def error(status: int, text: str) -> dict[str, Any]:
    """Anthropic's error body."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": text}}
