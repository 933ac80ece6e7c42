"""A chat call's messages as the endpoint reads them: each checked (`BadRequest` naming the field),
keyed so a later call that sends it back is recognised (`message_key`), and rendered as the chat
template shows it (`canonical`). This module keeps no state (`rollflow.agent.episode` does).
"""

from __future__ import annotations

import json
from typing import Any

from rollflow.records import Message

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(Exception):
    """A request the run cannot honour; `param` names the field (OpenAI's error body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def text_of(content: Any, param: str) -> str:
    """A message's text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest("expected a string or a list of text parts (images and audio are not supported)", param)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as data (OpenAI sends them as a JSON string)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _calls(message: dict[str, Any], param: str) -> list[tuple[str, Any]]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise BadRequest("expected a list of tool calls", f"{param}.tool_calls")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest("expected {'function': {'name': ..., 'arguments': ...}}", f"{param}.tool_calls[{i}]")
        out.append((function["name"], _arguments(function.get("arguments", "{}"))))
    return out


def message_key(message: Any, i: int) -> tuple[str, str, str]:
    """What identifies a message when a later call sends it back: role, text, tool calls."""
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise BadRequest("expected an object with a role and content", param)
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", f"{param}.role")
    calls = _calls(message, param)
    return role, text_of(message.get("content"), f"{param}.content"), json.dumps(calls, sort_keys=True)


def canonical(key: tuple[str, str, str]) -> Message:
    """A message as the chat template renders it: an assistant's tool calls in the Hermes
    `<tool_call>` form the model writes, `developer` as `system`."""
    role, text, calls = key
    for name, arguments in json.loads(calls):
        text += "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    return Message(role="system" if role == "developer" else role, content=text)
