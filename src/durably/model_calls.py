"""A model call as a record: which model was asked what, what it cost, how long it took, and
which tool calls its answer asked for.

A step that asks a model (``@app.model``, ``app.call_model``, the framework plug-ins' model
wrappers) is recorded like any step: run once, its answer replayed on recovery. Beside its
answer (the step's output) it keeps this record, built here from the answer as JSON, so that
the first execution and every replay read the same usage and charge the same budget.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from durably.keys import plain_json, sha256_hex
from durably.values import check_text

log = logging.getLogger("durably.model_calls")

UsageReader = Callable[[Any], Mapping[str, Any] | None]
ToolCallReader = Callable[[Any], Iterable[str]]

# How providers and frameworks name their token counts, mapped to the record's names.
_TOKEN_NAMES = {
    "input_tokens": "input_tokens",
    "prompt_tokens": "input_tokens",
    "request_tokens": "input_tokens",
    "output_tokens": "output_tokens",
    "completion_tokens": "output_tokens",
    "response_tokens": "output_tokens",
    "total_tokens": "total_tokens",
    "cost": "cost",
}


@dataclass(frozen=True)
class ModelSpec:
    """What makes a step a model call.

    ``usage`` reads the token usage off the answer (JSON); by default the answer's
    ``usage`` or ``usage_metadata`` mapping (OpenAI, LangChain, Pydantic AI names).
    ``tool_calls`` reads the ids of the tool calls the answer asks for; by default those of
    OpenAI's ``function_call`` items and ``tool_calls`` lists, and ``tool_call_id`` fields.
    """

    model: str
    profile: str | None = None
    usage: UsageReader | None = None
    tool_calls: ToolCallReader | None = None

    def __post_init__(self) -> None:
        # Shown by the CLI and the console, and part of the step's name.
        check_text(self.model, "model name")
        if self.profile is not None:
            check_text(self.profile, "model profile")


def model_step_name(model: str) -> str:
    """The step name of a call asking ``model``: ``model:<model>``, with '#' and '|'
    (which delimit step ids and keys) replaced."""
    return "model:" + model.replace("#", "_").replace("|", "_")


def model_call_id(run_id: str, step_id: str) -> str:
    """The call's id: stable across replays and recoveries, one per step of a run."""
    return "mc_" + sha256_hex(f"{run_id}|{step_id}")[:24]


def record(
    spec: ModelSpec,
    *,
    run_id: str,
    step_id: str,
    arguments: Mapping[str, Any],
    answer: Any,
    latency_s: float,
    limit: int,
) -> dict[str, Any]:
    """The record of one answered call. ``arguments`` is what its input hash covers (the
    canonical form when the step has one): kept so a person can read the prompt, unless it
    is over ``limit`` bytes, in which case only its size is kept."""
    text = plain_json(dict(arguments))
    size = len(text.encode())
    return {
        "model_call_id": model_call_id(run_id, step_id),
        "model": spec.model,
        "model_profile": spec.profile,
        "input": dict(arguments) if size <= limit else None,
        "input_bytes": size,
        "usage": usage_of(spec, answer),
        "latency_ms": round(latency_s * 1000, 3),
        "tool_call_ids": tool_call_ids_of(spec, answer),
    }


def charges(model_call: Mapping[str, Any] | None) -> tuple[float, float]:
    """The tokens and cost a recorded call charges to its run's budget."""
    usage = (model_call or {}).get("usage") or {}
    return float(usage.get("total_tokens", 0)), float(usage.get("cost", 0))


def usage_of(spec: ModelSpec, answer: Any) -> dict[str, float]:
    usage: dict[str, float] = {}
    try:
        found = spec.usage(answer) if spec.usage is not None else _usage_mapping(answer)
        for name, value in (found or {}).items():
            key = _TOKEN_NAMES.get(name)
            if key is not None and _amount(value):
                usage[key] = value
    except Exception:
        # The call was made and paid for: a reader that breaks must not lose its record.
        log.warning("model %s: the usage reader failed; usage not recorded", spec.model)
        return {}
    if "total_tokens" not in usage and ("input_tokens" in usage or "output_tokens" in usage):
        usage["total_tokens"] = usage.get("input_tokens", 0) + usage.get("output_tokens", 0)
    return usage


def tool_call_ids_of(spec: ModelSpec, answer: Any) -> list[str]:
    try:
        found = spec.tool_calls(answer) if spec.tool_calls is not None else _tool_calls(answer)
        ids = [i for i in found if isinstance(i, str)]
    except Exception:
        log.warning("model %s: the tool call reader failed; tool calls not recorded", spec.model)
        return []
    return list(dict.fromkeys(ids))


def _amount(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _usage_mapping(answer: Any) -> Mapping[str, Any] | None:
    if not isinstance(answer, Mapping):
        return None
    for name in ("usage", "usage_metadata"):
        found = answer.get(name)
        if isinstance(found, Mapping):
            return found
    return None


def _tool_calls(answer: Any) -> Iterable[str]:
    """Tool call ids anywhere in ``answer``: ``function_call`` items' ``call_id`` (OpenAI
    Responses), the ``id`` of each entry of a ``tool_calls`` list (Chat Completions,
    LangChain), ``tool_call_id`` fields (Pydantic AI's tool-call parts)."""
    stack = [answer]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(reversed(value))
        elif isinstance(value, Mapping):
            if value.get("type") == "function_call" and isinstance(value.get("call_id"), str):
                yield value["call_id"]
            if isinstance(value.get("tool_call_id"), str):
                yield value["tool_call_id"]
            calls = value.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                        yield call["id"]
            stack.extend(reversed([v for k, v in value.items() if k != "tool_calls"]))
