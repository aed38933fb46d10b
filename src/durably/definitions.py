"""What the decorators register: workflows, steps, tools and their policies."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from durably.errors import ApprovalRejected, ConfigurationError
from durably.model_calls import ModelSpec
from durably.reconcile import Operation, Reconciliation
from durably.status import FailureCategory
from durably.values import storable_text


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how fast a failed call is retried — only where retrying is safe.

    ``max_attempts`` counts executions, the first included. Delays grow from
    ``initial_interval`` by ``backoff`` up to ``max_interval``.
    """

    max_attempts: int = 3
    initial_interval: timedelta = timedelta(milliseconds=100)
    backoff: float = 2.0
    max_interval: timedelta = timedelta(seconds=30)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigurationError("RetryPolicy.max_attempts must be at least 1")
        if self.backoff < 1:
            raise ConfigurationError("RetryPolicy.backoff must be at least 1.0")

    def delay_s(self, attempt: int) -> float:
        """Delay before execution number ``attempt + 1``."""
        grown = self.initial_interval.total_seconds() * self.backoff ** max(attempt - 1, 0)
        return min(grown, self.max_interval.total_seconds())


@dataclass(frozen=True)
class Budget:
    """Limits of one run; exceeding one pauses the run with reason ``budget_exceeded``.

    Steps and tool calls are counted as the workflow makes them; tokens and cost are what
    it reports with ``durably.charge(tokens=..., cost=...)``. ``None``: no limit.

    Example: ``@app.workflow(budget=durably.Budget(max_tool_calls=20, max_cost=2.0))``
    """

    max_steps: int | None = None
    max_tool_calls: int | None = None
    max_cost: float | None = None
    max_tokens: int | None = None

    def exceeded(self, usage: dict[str, float]) -> str | None:
        """Which limit ``usage`` is over, if any."""
        limits = (
            ("steps", self.max_steps),
            ("tool_calls", self.max_tool_calls),
            ("cost", self.max_cost),
            ("tokens", self.max_tokens),
        )
        for what, limit in limits:
            if limit is not None and usage.get(what, 0) > limit:
                return f"{what} {usage[what]:g} > {limit:g}"
        return None


@dataclass(frozen=True)
class WorkflowDef:
    name: str
    fn: Callable[..., Any]
    version: str
    budget: Budget = field(default_factory=Budget)
    migrates_from: tuple[str, ...] = ()
    """Older versions whose in-flight runs this code continues (its new paths behind
    ``durably.patched()``)."""

    def runs(self, version: str) -> bool:
        """Whether this code may execute a run pinned to ``version``."""
        return version == self.version or version in self.migrates_from

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The workflow function's signature, read once: every start binds its input to it."""
        return inspect.signature(self.fn)


class Signed:
    """A registered callable's signature, and what binding a call to it needs."""

    name: str
    signature: inspect.Signature

    @functools.cached_property
    def positional(self) -> tuple[str, ...] | None:
        """The parameter names if each may be given by position or keyword: a call passing
        all of them by position binds them in this order (see :func:`bind_arguments`)."""
        params = self.signature.parameters.values()
        if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
            return tuple(self.signature.parameters)
        return None


@dataclass(frozen=True)
class StepDef(Signed):
    name: str
    fn: Callable[..., Any]
    version: str
    retry: RetryPolicy
    signature: inspect.Signature
    canonical: Callable[..., Any] | None = None
    """Called with the step's arguments; its JSON value is hashed instead of them (to
    leave out what changes on every execution: generated ids, timestamps)."""
    model: ModelSpec | None = None
    """Set for a step that asks a model: its calls are recorded as model calls."""


CONTROL_FLOW = frozenset(
    {
        "pydantic_ai.exceptions.ModelRetry",
        "pydantic_ai.exceptions.CallDeferred",
        "pydantic_ai.exceptions.ApprovalRequired",
        "langgraph.errors.GraphBubbleUp",  # GraphInterrupt (interrupt()), ParentCommand
    }
)
"""Agent frameworks' control-flow exceptions (and their subclasses), by qualified name so
that none of the frameworks needs to be installed; a tool's ``control_flow=`` adds more."""

Classifier = Callable[[BaseException], FailureCategory | None]
Reconciler = Callable[[Operation], Reconciliation | Any]


@dataclass(frozen=True)
class ToolDef(Signed):
    name: str
    fn: Callable[..., Any]
    version: str
    retry: RetryPolicy
    signature: inspect.Signature
    idempotent: bool = False
    reconcile: Reconciler | None = None
    external_id: Callable[[Any], Any] | None = None
    compensate: Callable[[Operation], Any] | None = None
    classify: Classifier | None = None
    redact: Sequence[str] = field(default_factory=tuple)
    operation_group: str | None = None
    timeout: timedelta | None = None
    requires_approval: bool = False
    approval_ttl: timedelta = timedelta(hours=24)
    authorize: Callable[[Operation], Any] | None = None
    reconcile_for: timedelta = timedelta(minutes=15)
    on_rejected: Callable[[ApprovalRejected], Any] | None = None
    control_flow: tuple[type[BaseException], ...] = ()
    sandbox: Callable[..., Any] | None = None

    def is_control_flow(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a framework's control flow raised by the tool (ask the model
        again, defer the call, interrupt the graph) rather than a failure: the tool chose
        not to act, so nothing was sent."""
        if isinstance(exc, self.control_flow):
            return True
        return any(f"{c.__module__}.{c.__qualname__}" in CONTROL_FLOW for c in type(exc).__mro__)

    @property
    def can_reconcile(self) -> bool:
        """Whether an unknown outcome can be settled without a person."""
        return self.reconcile is not None or self.idempotent

    def external_id_of(self, result: Any) -> str | None:
        """The service's id for the operation, as stored (``external_id=`` may raise)."""
        if self.external_id is None:
            return None
        # Derived from a result, but by user code: it must still fit every store.
        return storable_text(str(self.external_id(result)))


def check_name(kind: str, name: str, taken: dict[str, Any]) -> None:
    if not name or "#" in name or "|" in name:
        raise ConfigurationError(f"{kind} name {name!r} is empty or contains '#' or '|'")
    if name.startswith("durably."):
        raise ConfigurationError(f"{kind} name {name!r}: the 'durably.' prefix is reserved")
    if name in taken:
        raise ConfigurationError(f"{kind} {name!r} is registered twice; give one of them name=...")


def signature_of(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s signature, or ``(*args, **kwargs)`` for a callable that has none to read."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return inspect.Signature(
            [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        )


def bind_arguments(
    definition: Signed, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied: what the input hash covers."""
    positional = definition.positional
    if positional is not None and not kwargs and len(args) == len(positional):
        # Every parameter given by position: what bind() would find, at a tenth of its cost
        # (this runs for every call, replayed ones included).
        return dict(zip(positional, args, strict=True))
    signature, name = definition.signature, definition.name
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{name}(): {exc}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD and param.name in arguments:
            arguments.update(arguments.pop(param.name))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL and param.name in arguments:
            arguments[param.name] = list(arguments[param.name])
    return arguments


@functools.lru_cache(maxsize=4096)
def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn)


class CodeExited(Exception):
    """SystemExit or KeyboardInterrupt raised by user code (a wrapped command line's main):
    a failure of that call like any other. Let through, asyncio would re-raise it out of
    its loop, ending the thread that runs every run of the process."""


async def invoke(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a user function: coroutines on the loop, plain functions on a worker thread.

    A thread keeps a blocking tool (an HTTP client, a driver) from stalling the worker's
    other runs and its lease heartbeat; contextvars (the idempotency key) follow it.
    """
    try:
        if _is_async(fn):
            return await fn(*args, **kwargs)
        result = await asyncio.to_thread(fn, *args, **kwargs)
        if inspect.isawaitable(result):
            return await result
        return result
    except (SystemExit, KeyboardInterrupt) as exc:
        raise CodeExited(f"{getattr(fn, '__name__', fn)} raised {exc!r}") from exc
