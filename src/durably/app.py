"""The App: a registry of workflows, steps and tools bound to one store, and its facade."""

from __future__ import annotations

import functools
import inspect
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Literal, ParamSpec, Protocol, TypeVar, cast, overload

from durably import context, effects, runtime
from durably.checkpoint import checksum_holds
from durably.definitions import (
    Budget,
    Classifier,
    Reconciler,
    RetryPolicy,
    StepDef,
    ToolDef,
    WorkflowDef,
)
from durably.engine import Engine
from durably.errors import (
    ApprovalExpired,
    ConfigurationError,
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    RunNotFound,
)
from durably.keys import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    KEY_SCHEME,
    canonical_json,
    plain_json,
    sha256_hex,
)
from durably.metrics import Metrics
from durably.reconcile import Operation
from durably.registry import Registry
from durably.status import FailureCategory, OperationStatus, PauseReason, RunStatus, StepStatus
from durably.store.base import (
    Approval,
    Event,
    EventWrite,
    Expect,
    NewRun,
    OperationWrite,
    RunRecord,
    RunUpdate,
    StepWrite,
    Store,
    Transition,
)
from durably.subscription import Subscription
from durably.values import MAX_TEXT_CHARS, check_id, check_text
from durably.worker import Worker, worker_id

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_DATABASE_URL = "sqlite:///durably.db"


@dataclass(frozen=True)
class Run:
    """A run as its caller sees it."""

    run_id: str
    workflow: str
    status: RunStatus
    result: Any
    error: dict[str, Any] | None
    status_reason: str | None
    waiting_for: dict[str, Any] | None
    tenant: str
    created_at: float
    updated_at: float

    @classmethod
    def from_record(cls, r: RunRecord) -> Run:
        return cls(
            run_id=r.run_id,
            workflow=r.workflow,
            status=r.status,
            result=None if r.result_json is None else _loads(r.result_json),
            error=r.error,
            status_reason=r.status_reason,
            waiting_for=r.waiting_for,
            tenant=r.tenant,
            created_at=r.created_at,
            updated_at=r.updated_at,
        )


def _loads(text: str) -> Any:
    import json

    return json.loads(text)


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
        check_text(step_id, "step id")
        if not step_id or "|" in step_id:
            raise ConfigurationError(f"step id {step_id!r} is empty or contains '|'")
        return Durable(self.definition, self.fn, step_id)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        ctx = context.active()
        # The step id is allocated now, not when the coroutine first runs, so calls
        # gathered in parallel get ids in the order the workflow created them.
        if isinstance(self.definition, ToolDef):
            effect = effects.Effect(ctx, self.definition, args, kwargs, self._step_id)
            return effect.settle()
        return runtime.call_step(ctx, self.definition, args, kwargs, self._step_id)


class Register(Protocol):
    """What ``@app.step()`` and ``@app.tool()`` return: ``async def`` and plain functions
    both become a :class:`Durable` whose call is awaited for the plain result."""

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]], /) -> Durable[P, R]: ...
    @overload
    def __call__(self, fn: Callable[P, R], /) -> Durable[P, R]: ...


class App:
    """Registry of workflows, steps and tools bound to one store.

    Example::

        app = durably.App("sqlite:///agent.db")

        @app.workflow(version="1")
        async def greet(name: str) -> str:
            return await shout(name)

    What every process recomputes from a call alone, with no secret: idempotency keys, step
    ids, and the input hashes of steps and of tools without ``redact=``. What needs the App's
    secret (``secret_key=`` or ``$DURABLY_SECRET_KEY``, at least 16 random bytes, the same in
    every process): the input hash and the stored form of a call to a tool with ``redact=``
    (HMACs under it, so a low-entropy value cannot be found by hashing every candidate; such
    a tool cannot be registered without a secret), and the seal of checkpoints (without a
    secret they carry a plain checksum, which anyone who can write the database can
    recompute). A changed secret makes in-flight calls of redacted tools conflict (the run
    pauses) and older seals unverifiable (reported, and the journal is checked against the
    event log instead).
    """

    def __init__(
        self,
        database_url: str | None = None,
        *,
        lease_ttl: timedelta = timedelta(seconds=30),
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        secret_key: str | bytes | None = None,
        reconcile_grace: timedelta = timedelta(seconds=5),
    ) -> None:
        self.engine = Engine(
            database_url=database_url
            or os.environ.get("DURABLY_DATABASE_URL")
            or DEFAULT_DATABASE_URL,
            registry=Registry(),
            metrics=Metrics(),
            lease_ttl=lease_ttl,
            max_payload_bytes=max_payload_bytes,
            secret_key=_secret_key(secret_key or os.environ.get("DURABLY_SECRET_KEY")),
            reconcile_grace=reconcile_grace,
        )
        """What executing runs needs (store, registry, metrics, limits); this App packs
        requests for it and delegates."""
        self.metrics = self.engine.metrics
        self._registry = self.engine.registry
        self._loop = self.engine.loop

    @property
    def database_url(self) -> str:
        return self.engine.database_url

    @database_url.setter
    def database_url(self, url: str) -> None:
        if self.engine.is_open:
            raise ConfigurationError(
                "the store is open already; set the database URL before the App's first use"
            )
        self.engine.database_url = url

    @property
    def lease_ttl(self) -> timedelta:
        return self.engine.lease_ttl

    @property
    def max_payload_bytes(self) -> int:
        return self.engine.max_payload_bytes

    @property
    def secret_key(self) -> bytes | None:
        """The App's secret, or None (see the class documentation)."""
        return self.engine.secret_key

    @property
    def reconcile_grace(self) -> timedelta:
        return self.engine.reconcile_grace

    # -- registration -------------------------------------------------------------------

    def workflow(
        self, *, name: str | None = None, version: str = "1", budget: Budget | None = None
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
        """Register an ``async def`` as a workflow; its runs are pinned to ``version``.

        ``budget`` limits each run (steps, tool calls, reported tokens and cost)."""

        def register(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
            if not inspect.iscoroutinefunction(fn):
                raise ConfigurationError(f"workflow {fn.__name__} must be an async def")
            wf_name = name or fn.__name__
            if not version or "|" in version:
                raise ConfigurationError(
                    f"workflow {wf_name}: version {version!r} is empty or has '|'"
                )
            self._registry.add_workflow(WorkflowDef(wf_name, fn, version, budget or Budget()))
            fn.__durably_workflow__ = wf_name  # type: ignore[attr-defined]
            return fn

        return register

    def step(
        self, *, name: str | None = None, version: str = "1", retry: RetryPolicy | None = None
    ) -> Register:
        """Register a step: a read, a computation or a model call, recorded once.

        Sync functions run on a thread, ``async def`` on the loop. Any exception is retried
        by ``retry`` (re-running a step is harmless), then recorded as failed.
        """

        def register(fn: Callable[P, Any]) -> Durable[P, Any]:
            step_name = name or fn.__name__
            d = StepDef(step_name, fn, version, retry or RetryPolicy(), inspect.signature(fn))
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
    ) -> Register:
        """Register a tool whose call has an external side effect (the effect ledger).

        ``idempotent=True``: the service deduplicates by ``durably.idempotency_key()``, so an
        unknown outcome is settled by re-sending the same key. ``reconcile=fn``: asked what
        happened when the outcome is unknown. With neither, an unknown outcome pauses the run
        for a person. ``timeout`` bounds one execution; a timeout is an unknown outcome.
        ``requires_approval``: each call first waits for a person's approval bound to its
        exact input, key and plan version, valid ``approval_ttl`` and usable once.
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

    # -- store --------------------------------------------------------------------------

    @property
    def store(self) -> Store:
        return self.engine.store

    async def open(self) -> Store:
        """Open the store and apply pending migrations (done on first use)."""
        return await self.engine.open()

    async def close_async(self) -> None:
        """Close the store's connections opened in the running event loop."""
        await self.engine.close()

    def close(self) -> None:
        """Close the store and stop the thread that runs the blocking methods."""
        if self._loop.running:
            self._loop.call(self.close_async())
        self._loop.stop()

    # -- runs ---------------------------------------------------------------------------

    def _resolve_workflow(self, workflow: Callable[..., Any] | str) -> WorkflowDef:
        if isinstance(workflow, str):
            return self.workflow_def(workflow)
        name = getattr(workflow, "__durably_workflow__", None)
        if name is None:
            raise ConfigurationError(f"{workflow!r} is not a workflow of this app (@app.workflow)")
        return self.workflow_def(name)

    async def start_async(
        self,
        workflow: Callable[..., Any] | str,
        *args: Any,
        run_id: str | None = None,
        tenant: str = "default",
        **kwargs: Any,
    ) -> str:
        """Record a new queued run (idempotent on ``run_id``) and return its id."""
        if run_id is not None:
            check_id(run_id, "run id")
        check_id(tenant, "tenant")
        wf = self._resolve_workflow(workflow)
        try:
            inspect.signature(wf.fn).bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidInput(
                f"workflow {wf.name} cannot take this input ({exc}); its signature is "
                f"{wf.name}{inspect.signature(wf.fn)}"
            ) from None
        store = await self.open()
        run_input = {"args": list(args), "kwargs": kwargs}
        input_json = canonical_json(
            run_input, what=f"the input of {wf.name}", limit=self.max_payload_bytes
        )
        ih = sha256_hex(canonical_json({"workflow": wf.name, "input": run_input}))
        new = NewRun(
            run_id=run_id or new_run_id(),
            tenant=tenant,
            workflow=wf.name,
            workflow_version=wf.version,
            input=run_input,
            input_json=input_json,
            input_hash=ih,
            key_scheme=KEY_SCHEME,
        )
        record, created = await store.create_run(new)
        if not created and (record.input_hash != ih or record.tenant != tenant):
            raise IdempotencyConflict(
                f"run {new.run_id} already exists with another workflow, input or tenant; "
                "use a new run_id for a new run",
                run_id=new.run_id,
            )
        return record.run_id

    def start(
        self,
        workflow: Callable[..., Any] | str,
        *args: Any,
        run_id: str | None = None,
        tenant: str = "default",
        **kwargs: Any,
    ) -> str:
        """Durably start a run for a worker to execute; returns its id. See ``start_async``."""
        return self._loop.call(
            self.start_async(workflow, *args, run_id=run_id, tenant=tenant, **kwargs)
        )

    async def run_async(
        self,
        workflow: Callable[..., Any] | str,
        *args: Any,
        run_id: str | None = None,
        tenant: str = "default",
        **kwargs: Any,
    ) -> Run:
        """Start (or find) a run and execute it here until it completes, fails or stops."""
        rid = await self.start_async(workflow, *args, run_id=run_id, tenant=tenant, **kwargs)
        return await self.execute_async(rid)

    def run(
        self,
        workflow: Callable[..., Any] | str,
        *args: Any,
        run_id: str | None = None,
        tenant: str = "default",
        **kwargs: Any,
    ) -> Run:
        """Start a run and execute it in this process; returns it once it completes, fails,
        pauses or waits. ``app.run(sales_report, "EMEA")``"""
        return self._loop.call(
            self.run_async(workflow, *args, run_id=run_id, tenant=tenant, **kwargs)
        )

    async def execute_async(self, run_id: str, *, owner: str | None = None) -> Run:
        """Execute a runnable run in this process, if no live worker holds it."""
        check_text(run_id, "run id")
        store = await self.open()
        record = await store.get_run(run_id)
        if record is None:
            raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
        wf = self.workflow_def(record.workflow)
        if record.workflow_version != wf.version:
            raise ConfigurationError(
                f"run {run_id} is pinned to {wf.name} version {record.workflow_version!r}, but "
                f"this code has version {wf.version!r}; run it with a worker that has that "
                "version (runs never switch code mid-flight)",
                run_id=run_id,
            )
        claim = await store.claim_run(
            run_id, owner or worker_id("inproc"), self.lease_ttl.total_seconds()
        )
        if claim is not None:
            await runtime.drive(self.engine, claim)
        return await self.get_run_async(run_id)

    async def get_run_async(self, run_id: str) -> Run:
        check_text(run_id, "run id")
        store = await self.open()
        record = await store.get_run(run_id)
        if record is None:
            raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
        return Run.from_record(record)

    def get_run(self, run_id: str) -> Run:
        """The run's current state."""
        return self._loop.call(self.get_run_async(run_id))

    async def list_runs_async(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[Run]:
        if workflow is not None:
            check_text(workflow, "workflow")
        store = await self.open()
        records = await store.list_runs(status=status, workflow=workflow, limit=limit)
        return [Run.from_record(r) for r in records]

    def list_runs(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[Run]:
        """Runs, newest first."""
        return self._loop.call(self.list_runs_async(status=status, workflow=workflow, limit=limit))

    # -- operator actions ---------------------------------------------------------------

    async def resolve_effect_async(
        self,
        run_id: str,
        step_id: str,
        outcome: Literal["succeeded", "not_executed", "failed"],
        *,
        result: Any = None,
        by: str = "operator",
    ) -> Run:
        """Settle an effect whose outcome is unknown, after checking the external system.

        ``succeeded`` records ``result`` as what the tool returned; ``not_executed`` lets the
        run execute it again with the same idempotency key; ``failed`` fails the call (the
        workflow sees :class:`StepFailed`). The run becomes runnable (``queued``).
        """
        check_text(run_id, "run id")
        check_text(step_id, "step id")
        check_text(by, "by")
        store = await self.open()
        journal = await store.load_journal(run_id, checkpoints=runtime.CHECKPOINTS_READ)
        if journal is None:
            raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
        run = journal.run
        if run.status is not RunStatus.PAUSED:
            raise InvalidTransition(
                f"run {run_id} is {run.status}; only a paused run's effects are resolved by hand",
                run_id=run_id,
            )
        ops = [o for o in journal.operations if o.step_id == step_id]
        settleable = (
            OperationStatus.UNKNOWN,
            OperationStatus.RECONCILING,
            OperationStatus.EXECUTING,
            OperationStatus.FAILED,
        )
        refused = bool(ops) and runtime.refused_result(ops[0]) and outcome == "succeeded"
        if not ops or (ops[0].status not in settleable and not refused):
            found = ops[0].status.value if ops else "no effect"
            raise InvalidTransition(
                f"step {step_id} of run {run_id} has {found}; only an unknown (or stuck) effect "
                "can be resolved",
                run_id=run_id,
                step_id=step_id,
            )
        op = ops[0]
        step = next(s for s in journal.steps if s.step_id == step_id)
        # Verify first: a new checkpoint over an altered journal would launder the damage.
        journal_state, corrupted = await runtime.verified(store, journal, self.secret_key)
        result_json = None
        external_id: str | None = None
        error: dict[str, Any] | None = None
        category = None
        if outcome == "succeeded":
            result_json = canonical_json(
                result, what="the resolved result", limit=self.max_payload_bytes
            )
            journal_state.settle(step_id, result_json)
            journal_state.effect_completed(op.idempotency_key)
            op_status = OperationStatus.SUCCEEDED
            tool = self._registry.tool_def(op.tool, missing_ok=True)
            if tool is not None and tool.external_id is not None:
                try:
                    external_id = str(tool.external_id(result))
                except Exception as exc:
                    raise InvalidTransition(
                        f"the result given for {step_id} is not shaped like what {op.tool} "
                        f"returns (its external_id function failed: {exc!r}); pass the "
                        "service's record as the tool would have returned it",
                        run_id=run_id,
                        step_id=step_id,
                    ) from exc
        elif outcome == "not_executed":
            op_status = OperationStatus.INTENT_RECORDED
        elif outcome == "failed":
            op_status = OperationStatus.FAILED
            category = FailureCategory.BUSINESS_REJECTED.value
            error = {"type": "ResolvedAsFailed", "message": f"resolved as failed by {by}"}
        else:
            raise ConfigurationError(f"unknown outcome {outcome!r}")
        await store.commit(
            Expect(run_id, run.state_version),
            Transition(
                events=[
                    *([corrupted] if corrupted else []),
                    EventWrite(
                        "effect_resolved",
                        step_id,
                        {
                            "outcome": outcome,
                            "by": by,
                            "idempotency_key": op.idempotency_key,
                            "output_hash": sha256_hex(result_json) if result_json else None,
                        },
                    ),
                ],
                step=StepWrite(
                    step_id,
                    step.position,
                    "tool",
                    step.name,
                    StepStatus(op_status.value),
                    step.input_hash,
                    output_json=result_json,
                    error=error,
                    idempotency_key=op.idempotency_key,
                    attempts=op.attempt,
                    settle=result_json is not None,
                ),
                operation=OperationWrite(
                    tenant=op.tenant,
                    idempotency_key=op.idempotency_key,
                    run_id=run_id,
                    step_id=step_id,
                    plan_version=op.plan_version,
                    tool=op.tool,
                    tool_version=op.tool_version,
                    input_hash=op.input_hash,
                    arguments_json=plain_json(op.arguments),
                    status=op_status,
                    result_json=result_json,
                    error=error,
                    failure_category=category,
                    external_operation_id=external_id,
                    attempt=op.attempt,
                    expect_row_version=op.row_version,
                ),
                run=RunUpdate(RunStatus.QUEUED),
                checkpoint=journal_state.draft(status=RunStatus.QUEUED, current_step=step_id),
            ),
        )
        return await self.get_run_async(run_id)

    def resolve_effect(
        self,
        run_id: str,
        step_id: str,
        outcome: Literal["succeeded", "not_executed", "failed"],
        *,
        result: Any = None,
        by: str = "operator",
    ) -> Run:
        """Settle an unknown effect by hand. See ``resolve_effect_async``."""
        return self._loop.call(
            self.resolve_effect_async(run_id, step_id, outcome, result=result, by=by)
        )

    async def resume_async(self, run_id: str) -> Run:
        """Make a paused run runnable again and execute it here."""
        check_text(run_id, "run id")
        store = await self.open()
        record = await store.get_run(run_id)
        if record is None:
            raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
        if record.status.is_final:
            raise InvalidTransition(
                f"run {run_id} is {record.status} (final); fork a new run to do more",
                run_id=run_id,
            )
        waiting = record.waiting_for or {}
        if record.status_reason == PauseReason.PERMISSION and waiting.get("step_id"):
            # Resuming after re-authorisation: the refused call is attempted again.
            await self.resolve_effect_async(
                run_id, str(waiting["step_id"]), "not_executed", by="resume"
            )
        elif record.status is RunStatus.PAUSED:
            await store.commit(
                Expect(run_id, record.state_version),
                Transition(
                    events=[EventWrite("run_resumed", None, {"from": record.status_reason})],
                    run=RunUpdate(RunStatus.QUEUED),
                ),
            )
        return await self.execute_async(run_id)

    def resume(self, run_id: str) -> Run:
        """Resume a paused or stalled run in this process."""
        return self._loop.call(self.resume_async(run_id))

    async def send_event_async(
        self, run_id: str, name: str, payload: Any = None, *, event_id: str | None = None
    ) -> Literal["delivered", "duplicate ignored"]:
        check_text(run_id, "run id")
        check_text(name, "event name")
        if event_id is not None:
            check_text(event_id, "event id")
        store = await self.open()
        payload_json = canonical_json(
            payload, what=f"the payload of event {name!r}", limit=self.max_payload_bytes
        )
        delivered = await store.deliver_signal(
            run_id, event_id or uuid.uuid4().hex, name, payload_json
        )
        return "delivered" if delivered else "duplicate ignored"

    def send_event(
        self, run_id: str, name: str, payload: Any = None, *, event_id: str | None = None
    ) -> Literal["delivered", "duplicate ignored"]:
        """Deliver an event to a run, exactly once per ``event_id`` (the sender's id).

        A run waiting in ``wait_for_event(name)`` becomes due and a worker resumes it; an
        event that arrives first is kept for the wait. A second delivery of the same
        ``event_id`` changes nothing and returns ``"duplicate ignored"``. Raises
        RunNotFound, or InvalidTransition if the run is finished.
        """
        return self._loop.call(self.send_event_async(run_id, name, payload, event_id=event_id))

    async def decide_async(
        self,
        run_id: str,
        approval_id: str | None,
        decision: Literal["approved", "rejected"],
        *,
        by: str = "operator",
        comment: str | None = None,
    ) -> Approval:
        check_text(run_id, "run id")
        if approval_id is not None:
            check_text(approval_id, "approval id")
        check_text(by, "by")
        if comment is not None:
            check_text(comment, "comment", max_chars=MAX_TEXT_CHARS, lines=True)
        store = await self.open()
        approval, expired = await store.decide_approval(run_id, approval_id, decision, by, comment)
        if expired:
            self.metrics.approval_expired.inc()
            raise ApprovalExpired(
                f"approval {approval.approval_id} of run {run_id} expired at "
                f"{approval.expires_at:.0f} (unix) before it was decided; the run will ask "
                "for a new one",
                run_id=run_id,
                step_id=approval.step_id,
            )
        return approval

    def approve(
        self,
        run_id: str,
        approval_id: str | None = None,
        *,
        by: str = "operator",
        comment: str | None = None,
    ) -> Approval:
        """Approve the run's pending approval (``approval_id`` may be omitted if only one).

        The decision is recorded once; the approval is then usable once, by exactly the call
        it is bound to, until it expires. Raises ApprovalExpired if it expired already.
        """
        return self._loop.call(
            self.decide_async(run_id, approval_id, "approved", by=by, comment=comment)
        )

    def reject(
        self,
        run_id: str,
        approval_id: str | None = None,
        *,
        by: str = "operator",
        comment: str | None = None,
    ) -> Approval:
        """Reject the run's pending approval: ``ApprovalRejected`` is raised in the workflow."""
        return self._loop.call(
            self.decide_async(run_id, approval_id, "rejected", by=by, comment=comment)
        )

    async def cancel_async(self, run_id: str, *, compensate: bool = False) -> Run:
        check_text(run_id, "run id")
        store = await self.open()
        record = await store.get_run(run_id)
        if record is None:
            raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
        if record.status.is_final:
            raise InvalidTransition(f"run {run_id} is already {record.status}", run_id=run_id)
        leased = record.lease_owner is not None and (record.lease_until or 0) > time.time()
        if not leased and not compensate:
            try:
                await store.commit(
                    Expect(run_id, record.state_version),
                    Transition(
                        events=[EventWrite("run_cancelled", None, {"compensated": []})],
                        run=RunUpdate(RunStatus.CANCELLED, status_reason="cancelled"),
                    ),
                )
                return await self.get_run_async(run_id)
            except InvalidTransition:
                pass  # a worker took it meanwhile: ask it to stop at its next boundary
        await store.request_cancel(run_id, compensate=compensate)
        if not leased:
            # Compensations are effects: replay the run here up to its next boundary.
            return await self.execute_async(run_id)
        return await self.get_run_async(run_id)

    def cancel(self, run_id: str, *, compensate: bool = False) -> Run:
        """Cancel a run at its next call boundary — never in the middle of an effect.

        ``compensate=True`` first runs the compensations of the effects it made (newest
        first, each once). A run held by a worker is stopped by that worker; the returned
        run may still show it running. Cancelled is final.
        """
        return self._loop.call(self.cancel_async(run_id, compensate=compensate))

    async def describe_async(self, run_id: str) -> dict[str, Any]:
        """Everything about a run as plain JSON: the document behind ``runs show --json``."""
        check_text(run_id, "run id")
        store = await self.open()
        journal = await store.load_journal(run_id, checkpoints=1)
        if journal is None:
            raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
        run = Run.from_record(journal.run)
        ops = {o.step_id: o for o in journal.operations}
        return {
            "run_id": run.run_id,
            "workflow": run.workflow,
            "workflow_version": journal.run.workflow_version,
            "tenant": run.tenant,
            "status": run.status.value,
            "status_reason": run.status_reason,
            "result": run.result,
            "error": run.error,
            "waiting_for": run.waiting_for,
            "created_at": run.created_at,
            "updated_at": run.updated_at,
            "steps": [
                {
                    "step_id": s.step_id,
                    "kind": s.kind,
                    "name": s.name,
                    "status": s.status.value,
                    "attempts": s.attempts,
                    "output": None if s.output_json is None else _loads(s.output_json),
                    "error": s.error,
                }
                for s in journal.steps
            ],
            "effects": [
                {
                    "step_id": o.step_id,
                    "tool": o.tool,
                    "status": o.status.value,
                    "idempotency_key": o.idempotency_key,
                    "input_hash": o.input_hash,
                    "arguments": o.arguments,
                    "external_operation_id": o.external_operation_id,
                    "attempt": o.attempt,
                    "failure_category": o.failure_category,
                    "result": None if o.result_json is None else _loads(o.result_json),
                    "error": o.error,
                }
                for o in sorted(ops.values(), key=lambda o: o.created_at)
            ],
            "approvals": [
                {
                    "approval_id": a.approval_id,
                    "step_id": a.step_id,
                    "kind": a.kind,
                    "name": a.name,
                    "status": a.status,
                    "payload": a.payload,
                    "input_hash": a.input_hash,
                    "idempotency_key": a.idempotency_key,
                    "plan_version": a.plan_version,
                    "requested_at": a.requested_at,
                    "expires_at": a.expires_at,
                    "decided_by": a.decided_by,
                    "comment": a.comment,
                }
                for a in journal.approvals
            ],
            "last_event_sequence": journal.run.last_sequence,
        }

    def describe(self, run_id: str) -> dict[str, Any]:
        """A run with its steps and effects, as plain JSON."""
        return self._loop.call(self.describe_async(run_id))

    async def events_async(self, run_id: str, *, after: int = 0) -> list[Event]:
        check_text(run_id, "run id")
        store = await self.open()
        return await store.events(run_id, after=after)

    def events(self, run_id: str, *, after: int = 0) -> list[Event]:
        """The run's event log (its audit trail), in sequence order, after ``after``."""
        return self._loop.call(self.events_async(run_id, after=after))

    async def checkpoints_async(self, run_id: str) -> list[dict[str, Any]]:
        check_text(run_id, "run id")
        store = await self.open()
        stored = await store.checkpoints(run_id)
        return [
            {
                **s.payload,
                "checksum": s.checksum,
                "valid": checksum_holds(s.payload, s.checksum, self.secret_key),
            }
            for s in stored
        ]

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        """The run's checkpoints, newest first, each with its checksum and whether it holds
        (with a secret configured, only a checksum sealed with it holds)."""
        return self._loop.call(self.checkpoints_async(run_id))

    def subscribe(
        self, handler: Callable[[Event], Any], *, consumer: str, batch: int = 100
    ) -> Subscription:
        """A subscription handing ``consumer`` every event, in order within each run, each
        acknowledged once in the consumer's inbox. Run it with ``.run()``.

        Example::

            app.subscribe(lambda e: audit.write(e.event_id, e.type), consumer="audit").run()
        """
        return Subscription(self, handler, consumer=consumer, batch=batch)

    def worker(self, *, concurrency: int = 1, lease_ttl: timedelta | None = None) -> Worker:
        """A worker that claims and executes this app's runnable runs."""

        return Worker(self, concurrency=concurrency, lease_ttl=lease_ttl or self.lease_ttl)


MIN_SECRET_BYTES = 16


def _secret_key(secret: str | bytes | None) -> bytes | None:
    if not secret:
        return None
    key = secret.encode() if isinstance(secret, str) else secret
    if len(key) < MIN_SECRET_BYTES:
        raise ConfigurationError(
            f"the App's secret key is {len(key)} bytes long; use at least {MIN_SECRET_BYTES} "
            "random bytes (e.g. `openssl rand -hex 32`) in App(secret_key=...) or "
            "$DURABLY_SECRET_KEY: it is all that keeps redacted values and checkpoint seals "
            "from being guessed"
        )
    return key


def new_run_id() -> str:
    """Time-ordered, unique run ids: ``run_<ms hex><random hex>``."""
    return f"run_{int(time.time() * 1000):012x}{secrets.token_hex(5)}"
