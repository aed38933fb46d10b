"""What the framework plug-ins share: a durably tool dressed as a framework's tool function,
and a framework object as plain JSON for an input hash."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import pydantic_core


def jsonable(value: Any) -> Any:
    """``value`` as JSON (pydantic's own conversion); what is not JSON counts by its type."""
    try:
        return pydantic_core.to_jsonable_python(value, fallback=opaque)
    except (pydantic_core.PydanticSerializationError, TypeError, ValueError):
        return opaque(value)


def without_none(value: Any) -> Any:
    """``value`` without the fields that are None: unset and None mean the same request."""
    if isinstance(value, dict):
        return {k: without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_none(v) for v in value]
    return value


def opaque(value: Any) -> str:
    kind = type(value)
    return f"<{kind.__module__}.{kind.__qualname__}>"


def tool_function(
    invoke: Callable[..., Any],
    fn: Callable[..., Any],
    *,
    context: tuple[str, Any],
    returns: Any = inspect.Signature.empty,
) -> Any:
    """``invoke`` (the framework's context first, then ``fn``'s arguments) dressed as ``fn``
    for a framework that reads a tool's schema from the signature: ``fn``'s name, docstring
    and parameters, annotations resolved here (they live in ``fn``'s module), the context
    parameter ``context = (name, type)`` in front, and ``returns`` as the return type."""
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)
    parameters = [
        p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()
    ]
    name, kind = context
    first = inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY, annotation=kind)
    wrapper: Any = invoke
    wrapper.__signature__ = signature.replace(
        parameters=[first, *parameters], return_annotation=returns
    )
    wrapper.__annotations__ = {
        name: kind,
        **{p.name: p.annotation for p in parameters if p.annotation is not p.empty},
    }
    if returns is not inspect.Signature.empty:
        wrapper.__annotations__["return"] = returns
    for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(wrapper, attribute, getattr(fn, attribute, None))
    return wrapper
