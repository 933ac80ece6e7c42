"""What every dialect of the agents' endpoint checks and builds alike: the run's own model and
sampling (a request cannot change them), its known fields, the chat form of a function tool, a
positive token budget. The dialects (`rollflow.agent.server`'s chat completions,
`rollflow.agent.responses`, `rollflow.agent.anthropic`) translate the rest."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from rollflow.agent.episode import BadRequest
from rollflow.records import SamplingSpec


def check_run_settings(
    body: dict[str, Any], model: str, sampling: SamplingSpec, *, fields: Collection[str] = (), api: str = ""
) -> None:
    """`BadRequest` for a field `api` does not have (when `fields` are given), another model, or a
    temperature or top_p other than the run's (training corrects for the distribution it samples)."""
    unknown = sorted(set(body) - set(fields)) if fields else []
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r} (the {api} has no such request field)", unknown[0])
    if body.get("model") != model:
        raise BadRequest(f"this endpoint serves the model {model!r}, not {body.get('model')!r}", "model")
    for name, ours in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or abs(value - ours) > 1e-6):
            raise BadRequest(
                f"this run samples with {name} = {ours} (sampling.{name}); a request cannot change it, since "
                "training corrects for the distribution the run samples from",
                name,
            )


def positive(value: Any, param: str) -> int | None:
    """A token budget: None, or a positive integer (`BadRequest` otherwise)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise BadRequest("expected a positive integer", param)
    return value


def stop_sequences(value: Any, param: str) -> list[str]:
    """Stop sequences: a string, a list of non-empty strings, or nothing (`BadRequest` otherwise)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest("expected a non-empty string or a list of them", param)
    return value


def tool_list(tools: Any, one: Callable[[Any, str], dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A request's tools in the chat form, each read by `one(tool, "tools[i]")` (which raises
    `BadRequest` for one it refuses); None for none."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools: expected a list of tools", "tools")
    return [one(tool, f"tools[{i}]") for i, tool in enumerate(tools)] or None


def function_tool(name: str, parameters: Any, description: Any = None) -> dict[str, Any]:
    """A tool in the chat form the chat template reads."""
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object"}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}
