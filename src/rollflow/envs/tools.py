"""Tool calls: parsed from the model's text, run with a timeout, answered with text.

The call format is the one Hermes- and Qwen-style chat templates use:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>

A tool is a sync or async callable taking the call's arguments as keywords and returning text.
Sync tools run on the run's guest threads (`rollflow.guest`) so a slow one never blocks the event
loop or rollflow's own threads. Whatever goes wrong (an unknown tool, bad arguments, an exception,
a timeout) becomes an error text the model reads as the tool's result: a broken tool ends the
turn, not the run. A sync tool that hangs cannot be killed; its thread is abandoned when the
timeout answers for it (use async tools for I/O). A tool's time is its own, bounded by its
timeout: the time limit of the environment call it runs in (`STEP_LIMIT`) is moved on by it.
This module does not know about episodes or rewards.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import msgspec

from rollflow import guest

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

STEP_LIMIT: ContextVar[asyncio.Timeout | None] = ContextVar("rollflow_step_limit", default=None)
"""The time limit of the environment call (a step) that tools run in, if any: a tool's own time
does not count against it."""

TOOL_MARGIN_S = 1.0
"""How far past a tool's own timeout the step's limit is held while it runs (the tool's bound
answers first)."""

Tool = Callable[..., Any]
"""A tool: keyword arguments in, text (or anything `str` turns into text) out; sync or async."""


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """The tool calls in a model turn, and an error text when a call is malformed."""
    calls: list[ToolCall] = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            return calls, f"error: the tool call is not valid JSON ({err.msg} at character {err.pos})"
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return calls, 'error: a tool call needs {"name": ..., "arguments": {...}}'
        arguments = data.get("arguments", {})
        if not isinstance(arguments, dict):
            return calls, "error: a tool call's arguments must be a JSON object"
        calls.append(ToolCall(data["name"], arguments))
    return calls, None


def split_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A turn as a reply: (its text without the call blocks, None when nothing else is left; its
    calls), or (the whole text, no calls) when it has none or one of them is broken, so the model's
    mistake is read as it wrote it."""
    calls, broken = parse_tool_calls(text)
    if not calls or broken is not None:
        return text, []
    return _CALL.sub("", text).strip() or None, calls


async def call_tool(tools: dict[str, Tool], call: ToolCall, timeout_s: float) -> str:
    """Run one call; its result, or an error text that says what went wrong."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(tools))})"
    with _own_time(timeout_s):
        return await _run(tool, call, timeout_s)


async def _run(tool: Tool, call: ToolCall, timeout_s: float) -> str:
    try:
        if inspect.iscoroutinefunction(tool):
            result = await asyncio.wait_for(guest.contained(tool(**call.arguments)), timeout_s)
        else:
            bound = functools.partial(tool, **call.arguments)
            result = await guest.call(bound, timeout_s=timeout_s, name=f"tool {call.name}")
    except TimeoutError:
        return f"error: tool {call.name} timed out after {timeout_s:g} s"
    except Exception as err:  # a tool's failure is the model's observation, never the run's
        return f"error: tool {call.name} {guest.raised(err)}"
    return str(result)


@contextmanager
def _own_time(timeout_s: float) -> Iterator[None]:
    """A tool's time, bounded by `timeout_s`, is not the surrounding step's: its limit is held
    past the tool's while the tool runs, then moved on by the time the tool took."""
    step = STEP_LIMIT.get()
    when = step.when() if step is not None and not step.expired() else None
    if step is None or when is None:
        yield
        return
    began = time.monotonic()
    step.reschedule(when + timeout_s + TOOL_MARGIN_S)
    try:
        yield
    finally:
        if not step.expired():
            step.reschedule(when + time.monotonic() - began)
