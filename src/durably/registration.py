"""Registration: what ``@app.workflow()``, ``@app.step()`` and ``@app.tool()`` record, and
:class:`Durable`, the awaitable call to a registered step or tool."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any, Generic, Literal, ParamSpec, Protocol, TypeVar, cast, overload

from durably import context, steps
from durably.calls import PATCH
from durably.definitions import (
    Budget,
    Classifier,
    Reconciler,
    RetryPolicy,
    StepDef,
    ToolDef,
    WorkflowDef,
    check_name,
    signature_of,
)
from durably.effect import Effect
from durably.errors import ApprovalRejected, ConfigurationError
from durably.model_calls import ModelSpec, ToolCallReader, UsageReader, model_step_name
from durably.reconcile import Operation
from durably.registry import Registry
from durably.values import check_text

P = ParamSpec("P")
R = TypeVar("R")

MIN_SECRET_BYTES = 16
"""The shortest App secret: what keeps redacted values and checkpoint seals from guessing."""


class Durable(Generic[P, R]):
    """A registered step or tool. Await calls to it inside a workflow."""

    def __init__(
        self,
        definition: StepDef | ToolDef,
        fn: Callable[P, R] | Callable[P, Awaitable[R]],
        step_id: str | None = None,
    ) -> None:
        self.definition = definition
        self.fn = fn
        """The undecorated function, for calling it outside any run (unit tests)."""
        self._step_id = step_id
        functools.update_wrapper(self, fn)

    def with_step_id(self, step_id: str) -> Durable[P, R]:
        """The same call under an explicit, stable step id (instead of ``<name>#<n>``)."""
        check_step_id(step_id)
        return Durable(self.definition, self.fn, step_id)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        ctx = context.active()
        # The step id is allocated now, not when the coroutine first runs, so calls
        # gathered in parallel get ids in the order the workflow created them.
        if isinstance(self.definition, ToolDef):
            call = Effect(ctx, self.definition, args, kwargs, self._step_id)
            return ctx.created(call.step_id, call.tool.name, call.settle())
        return steps.call_step(ctx, self.definition, args, kwargs, self._step_id)


def check_step_id(step_id: str) -> None:
    check_text(step_id, "step id")
    if not step_id or "|" in step_id:
        raise ConfigurationError(f"step id {step_id!r} is empty or contains '|'")
    # A patch marker's row is written as new, once: a step of the same id would share it.
    if step_id.startswith(f"{PATCH}:"):
        raise ConfigurationError(
            f"step id {step_id!r} is reserved: ids starting with {PATCH + ':'!r} are "
            "durably.patched() markers; choose another id"
        )


class Register(Protocol):
    """What ``@app.step()`` and ``@app.tool()`` return: ``async def`` and plain functions
    both become a :class:`Durable` whose call is awaited for the plain result."""

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]], /) -> Durable[P, R]: ...
    @overload
    def __call__(self, fn: Callable[P, R], /) -> Durable[P, R]: ...


class Registration:
    """The registering half of :class:`~durably.App`: decorators and lookups over its
    registry. An ``App`` is one (its class documentation says more)."""

    _registry: Registry

    @property
    def secret_key(self) -> bytes | None:
        raise NotImplementedError

    def workflow(
        self,
        *,
        name: str | None = None,
        version: str = "1",
        budget: Budget | None = None,
        migrates_from: Sequence[str] = (),
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
        """Register an ``async def`` as a workflow; its runs are pinned to ``version``.

        ``budget`` limits each run (steps, tool calls, reported tokens and cost).
        ``migrates_from``: older versions whose in-flight runs this code takes over; each
        change that would make such a run call something else goes behind
        ``if durably.patched("name"):``, so a run recorded before it replays the old path.
        """

        def register(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
            if not inspect.iscoroutinefunction(fn):
                raise ConfigurationError(f"workflow {fn.__name__} must be an async def")
            wf_name = name or fn.__name__
            if not version or "|" in version:
                raise ConfigurationError(
                    f"workflow {wf_name}: version {version!r} is empty or has '|'"
                )
            if isinstance(migrates_from, str):
                raise ConfigurationError(f"workflow {wf_name}: migrates_from= takes a list")
            self._registry.add_workflow(
                WorkflowDef(wf_name, fn, version, budget or Budget(), tuple(migrates_from))
            )
            fn.__durably_workflow__ = wf_name  # type: ignore[attr-defined]
            return fn

        return register

    def step(
        self,
        *,
        name: str | None = None,
        version: str = "1",
        retry: RetryPolicy | None = None,
        canonical: Callable[..., Any] | None = None,
    ) -> Register:
        """Register a step: a read, a computation or a model call, recorded once.

        Sync functions run on a thread, ``async def`` on the loop. Any exception is retried
        by ``retry`` (re-running a step is harmless), then recorded as failed.

        Replay checks a step's arguments against the recorded ones. ``canonical``, called
        with the same arguments, returns the JSON value checked instead: use it when the
        arguments hold what changes on every execution (a framework's message ids and
        timestamps), or are not JSON at all.
        """

        def register(fn: Callable[P, Any]) -> Durable[P, Any]:
            step_name = name or fn.__name__
            signature = inspect.signature(fn)
            d = StepDef(step_name, fn, version, retry or RetryPolicy(), signature, canonical)
            self._registry.add_step(d)
            return Durable(d, fn)

        return cast(Register, register)

    @overload
    def call_step(
        self,
        name: str,
        fn: Callable[..., Coroutine[Any, Any, R]],
        /,
        *args: Any,
        step_id: str | None = None,
        canonical: Callable[..., Any] | None = None,
        retry: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, R]: ...
    @overload
    def call_step(
        self,
        name: str,
        fn: Callable[..., R],
        /,
        *args: Any,
        step_id: str | None = None,
        canonical: Callable[..., Any] | None = None,
        retry: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, R]: ...
    def call_step(
        self,
        name: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        step_id: str | None = None,
        canonical: Callable[..., Any] | None = None,
        retry: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, Any]:
        """Record one call of any callable as a step named ``name``, inside a workflow.

        For code that wraps calls it does not own (an agent framework's model call): no
        registration, and the same guarantees as a registered step. ``step_id``,
        ``canonical`` and ``retry`` are those of :meth:`Durable.with_step_id` and
        :meth:`step`.

        Example::

            reply = await app.call_step("llm", model.complete, prompt, step_id=turn_id)
        """
        return self._call_step(name, fn, args, kwargs, step_id, canonical, retry, None)

    @overload
    def call_model(
        self,
        model: str,
        fn: Callable[..., Coroutine[Any, Any, R]],
        /,
        *args: Any,
        profile: str | None = None,
        usage: UsageReader | None = None,
        tool_calls: ToolCallReader | None = None,
        step_id: str | None = None,
        canonical: Callable[..., Any] | None = None,
        retry: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, R]: ...
    @overload
    def call_model(
        self,
        model: str,
        fn: Callable[..., R],
        /,
        *args: Any,
        profile: str | None = None,
        usage: UsageReader | None = None,
        tool_calls: ToolCallReader | None = None,
        step_id: str | None = None,
        canonical: Callable[..., Any] | None = None,
        retry: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, R]: ...
    def call_model(
        self,
        model: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        profile: str | None = None,
        usage: UsageReader | None = None,
        tool_calls: ToolCallReader | None = None,
        step_id: str | None = None,
        canonical: Callable[..., Any] | None = None,
        retry: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, Any]:
        """Record one call of ``fn`` asking ``model`` as a model call, inside a workflow.

        A step named ``model:<model>`` (see :meth:`call_step`) whose record also keeps a
        ``model_call_id``, the model and ``profile``, its input, token usage, latency and
        the tool call ids of its answer; the usage is charged to the run's budget, on the
        first execution and on every replay alike. ``usage`` and ``tool_calls`` read those
        off the answer (JSON) when the defaults do not find them (see :meth:`model`).

        Example::

            answer = await app.call_model("gpt-5", client.respond, messages, step_id=turn_id)
        """
        spec = ModelSpec(model, profile, usage, tool_calls)
        name = model_step_name(model)
        return self._call_step(name, fn, args, kwargs, step_id, canonical, retry, spec)

    def _call_step(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        step_id: str | None,
        canonical: Callable[..., Any] | None,
        retry: RetryPolicy | None,
        model: ModelSpec | None,
    ) -> Coroutine[Any, Any, Any]:
        tool = self._registry.tool_def(name, missing_ok=True)
        check_name("step", name, {name: tool} if tool else {})
        if step_id is not None:
            check_step_id(step_id)
        retry = retry or RetryPolicy()
        definition = StepDef(name, fn, "1", retry, signature_of(fn), canonical, model)
        return steps.call_step(context.active(), definition, args, kwargs, step_id)

    def model(
        self,
        model: str,
        *,
        name: str | None = None,
        profile: str | None = None,
        usage: UsageReader | None = None,
        tool_calls: ToolCallReader | None = None,
        version: str = "1",
        retry: RetryPolicy | None = None,
        canonical: Callable[..., Any] | None = None,
    ) -> Register:
        """Register a step that asks ``model``: every call is recorded as a model call.

        Like :meth:`step` (run once, its answer replayed), and its record also keeps a
        ``model_call_id``, ``model`` and ``profile`` (a prompt or settings version), the
        input its hash covers, token usage, latency and the ids of the tool calls its
        answer asks for; ``runs show``, the API and the console show them. The usage is
        charged to the run's budget (``total_tokens``, and ``cost`` if the answer has one).

        By default usage is read from the answer's ``usage`` or ``usage_metadata`` mapping
        (``input_tokens``/``prompt_tokens``, ``output_tokens``/``completion_tokens``,
        ``total_tokens``, ``cost``); ``usage=`` reads it from the answer (JSON) otherwise.

        Example::

            @app.model("gpt-5", profile="support-v3")
            async def answer(messages: list[dict]) -> dict:
                return (await client.chat(messages)).model_dump(mode="json")
        """
        spec = ModelSpec(model, profile, usage, tool_calls)

        def register(fn: Callable[P, Any]) -> Durable[P, Any]:
            step_name = name or fn.__name__
            signature = inspect.signature(fn)
            retry_policy = retry or RetryPolicy()
            d = StepDef(step_name, fn, version, retry_policy, signature, canonical, spec)
            self._registry.add_step(d)
            return Durable(d, fn)

        return cast(Register, register)

    def tool(
        self,
        *,
        name: str | None = None,
        version: str = "1",
        idempotent: bool = False,
        reconcile: Reconciler | None = None,
        external_id: Callable[[Any], Any] | None = None,
        compensate: Callable[[Operation], Any] | None = None,
        classify: Classifier | None = None,
        retry: RetryPolicy | None = None,
        redact: Sequence[str] = (),
        operation_group: str | None = None,
        timeout: timedelta | None = None,
        requires_approval: bool = False,
        approval_ttl: timedelta = timedelta(hours=24),
        authorize: Callable[[Operation], Any] | None = None,
        reconcile_for: timedelta = timedelta(minutes=15),
        on_rejected: Callable[[ApprovalRejected], Any] | None = None,
        control_flow: Sequence[type[BaseException]] = (),
        sandbox: Callable[..., Any] | None = None,
    ) -> Register:
        """Register a tool whose call has an external side effect (the effect ledger).

        ``idempotent=True``: the service deduplicates by ``durably.idempotency_key()``, so an
        unknown outcome is settled by re-sending the same key. ``reconcile=fn``: asked what
        happened when the outcome is unknown; while it answers ``running`` or raises (the
        lookup service blinked), it is asked again on a durable timer with backoff, the run
        released meanwhile, for ``reconcile_for`` before the run pauses for a person. With
        neither, an unknown outcome pauses the run for a person. ``timeout`` bounds one
        execution; a timeout is an unknown outcome.
        ``requires_approval``: each call first waits for a person's approval bound to its
        exact input, key and plan version, valid ``approval_ttl`` and usable once. A rejection
        raises ``ApprovalRejected`` in the workflow, or, with ``on_rejected=fn``, the call
        returns ``fn(rejection)`` instead (for an agent: tell the model, e.g. ``lambda r:
        {"refused": r.comment}``); ``fn`` is called again on replay, so keep it pure.
        An agent framework's control flow raised by the tool (Pydantic AI's ``ModelRetry``,
        ``CallDeferred``, ``ApprovalRequired``; LangGraph's ``interrupt()``; the types in
        ``control_flow``) means the tool chose not to act: it is recorded as not sent and
        raised on unchanged, never taken for an unknown outcome. ``sandbox=fn`` (same
        signature, no real effect) is what a fork with ``ReplayMode.SANDBOX`` calls instead.
        ``authorize=fn``: asked right before every execution (also after a long wait); a
        falsy answer or an exception is a PERMISSION failure: the run pauses, nothing is sent.
        ``redact=[names]``: those arguments are stored, hashed and shown only as HMACs under
        the App's secret (required), and scrubbed from the tool's error messages; naming a
        ``**kwargs`` parameter redacts every keyword argument it gathers.
        """

        def register(fn: Callable[P, Any]) -> Durable[P, Any]:
            tool_name = name or fn.__name__
            signature = inspect.signature(fn)
            if timeout is not None and not inspect.iscoroutinefunction(fn):
                raise ConfigurationError(
                    f"tool {tool_name}: timeout= needs an async def tool; a plain function "
                    "runs on a thread that cannot be stopped, so it would go on (and take "
                    "effect) after the timeout. Give the client its own timeout instead"
                )
            if isinstance(redact, str):
                raise ConfigurationError(f"tool {tool_name}: redact= takes a list of names")
            missing = [r for r in redact if r not in signature.parameters]
            if missing:
                raise ConfigurationError(
                    f"tool {tool_name}: redact= names {missing}, which are not parameters of "
                    f"{tool_name}{signature}; name its parameters (naming a **kwargs "
                    "parameter redacts every keyword argument it gathers)"
                )
            if redact and self.secret_key is None:
                raise ConfigurationError(
                    f"tool {tool_name}: redact= needs the App's secret, the same in every "
                    "process: a redacted call's input hash is an HMAC under it, which a replay "
                    "must recompute. Set $DURABLY_SECRET_KEY or pass App(secret_key=...) "
                    f"({MIN_SECRET_BYTES}+ random bytes, e.g. `openssl rand -hex 32`)"
                )
            d = ToolDef(
                name=tool_name,
                fn=fn,
                version=version,
                retry=retry or RetryPolicy(),
                signature=signature,
                idempotent=idempotent,
                reconcile=reconcile,
                external_id=external_id,
                compensate=compensate,
                classify=classify,
                redact=tuple(redact),
                operation_group=operation_group,
                timeout=timeout,
                requires_approval=requires_approval,
                approval_ttl=approval_ttl,
                authorize=authorize,
                reconcile_for=reconcile_for,
                on_rejected=on_rejected,
                control_flow=tuple(control_flow),
                sandbox=sandbox,
            )
            self._registry.add_tool(d)
            return Durable(d, fn)

        return cast(Register, register)

    def workflow_def(self, name: str) -> WorkflowDef:
        """The registered workflow ``name`` (ConfigurationError if none)."""
        return self._registry.workflow_def(name)

    @overload
    def tool_def(self, name: str) -> ToolDef: ...
    @overload
    def tool_def(self, name: str, *, missing_ok: Literal[True]) -> ToolDef | None: ...
    def tool_def(self, name: str, *, missing_ok: bool = False) -> ToolDef | None:
        """The registered tool ``name``."""
        if missing_ok:
            return self._registry.tool_def(name, missing_ok=True)
        return self._registry.tool_def(name)

    def compensation_def(self, tool: ToolDef) -> ToolDef:
        """The compensation of ``tool``, itself an effect recorded in the ledger."""
        return self._registry.compensation_def(tool)

    @property
    def workflows(self) -> list[str]:
        """The registered workflows as ``"<name>|<version>"``: what this code can run."""
        return self._registry.versions
