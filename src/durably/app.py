"""The App: a registry of workflows, steps and tools bound to one store, and its facade."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, ParamSpec, TypeVar

from durably import actions, fork, views, whatif
from durably.definitions import (
    WorkflowDef,
)
from durably.engine import Engine
from durably.errors import (
    ConfigurationError,
    RunNotFound,
)
from durably.keys import (
    DEFAULT_MAX_PAYLOAD_BYTES,
)
from durably.metrics import Metrics
from durably.registration import MIN_SECRET_BYTES, Registration
from durably.registry import Registry
from durably.status import ReplayMode, RunStatus
from durably.store.base import (
    Approval,
    Event,
    RunRecord,
    Store,
)
from durably.subscription import Subscription
from durably.values import (
    MAX_LIST,
    MAX_SEQUENCE,
    check_choice,
    check_count,
    check_duration,
    check_ref,
    check_setting,
    check_text,
)
from durably.views import Run
from durably.whatif import ReplayReport
from durably.worker import Worker

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_DATABASE_URL = "sqlite:///durably.db"

START_OPTIONS = frozenset({"run_id", "tenant"})
"""The keyword arguments ``start`` and ``run`` keep for themselves: workflow input keyed so
goes positionally."""


class App(Registration):
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
        check_duration(lease_ttl, "lease_ttl")
        check_duration(reconcile_grace, "reconcile_grace", zero=True)
        check_setting(max_payload_bytes, "max_payload_bytes", low=1)
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
        """Close the store and stop the thread that runs the blocking methods (with the
        connections of event loops that used the App and have ended)."""
        if self._loop.running:
            self._loop.call(self.close_async())
        else:
            self.engine.close_ended_loops()
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
        /,
        *args: Any,
        run_id: str | None = None,
        tenant: str = "default",
        **kwargs: Any,
    ) -> str:
        """Record a new queued run (idempotent on ``run_id``) and return its id."""
        wf = self._resolve_workflow(workflow)
        started, _ = await actions.start(
            self.engine, wf, args, kwargs, run_id=run_id, tenant=tenant
        )
        return started

    def start(
        self,
        workflow: Callable[..., Any] | str,
        /,
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
        /,
        *args: Any,
        run_id: str | None = None,
        tenant: str = "default",
        **kwargs: Any,
    ) -> Run:
        """Start (or find) a run and execute it here until it completes, fails or stops."""
        wf = self._resolve_workflow(workflow)
        rid, released = await actions.start(
            self.engine, wf, args, kwargs, run_id=run_id, tenant=tenant, execute_here=True
        )
        return await self._left(rid, released)

    def run(
        self,
        workflow: Callable[..., Any] | str,
        /,
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
        released = await actions.execute(self.engine, run_id, owner=owner)
        return await self._left(run_id, released)

    async def _left(self, run_id: str, released: RunRecord | None) -> Run:
        """The run as its execution here released it (read in the releasing commit's own
        transaction), or as the store has it now."""
        if released is None:
            return await self.get_run_async(run_id)
        return Run.from_record(released)

    async def get_run_async(self, run_id: str) -> Run:
        check_ref(run_id, "run id")
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
        if status is not None:
            status = check_choice(status, RunStatus, "status")
        check_count(limit, "limit", low=1, high=MAX_LIST)
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
        workflow sees :class:`StepFailed`). The run becomes runnable (``queued``); a cancelled
        run stays cancelled, with the outcome recorded.
        """
        await actions.resolve_effect(self.engine, run_id, step_id, outcome, result=result, by=by)
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
        return await self._left(run_id, await actions.resume(self.engine, run_id))

    def resume(self, run_id: str) -> Run:
        """Resume a paused or stalled run in this process."""
        return self._loop.call(self.resume_async(run_id))

    async def send_event_async(
        self, run_id: str, name: str, payload: Any = None, *, event_id: str | None = None
    ) -> Literal["delivered", "duplicate ignored"]:
        return await actions.send_event(self.engine, run_id, name, payload, event_id=event_id)

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
        return await actions.decide(
            self.engine, run_id, approval_id, decision, by=by, comment=comment
        )

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
        await actions.cancel(self.engine, run_id, compensate=compensate)
        return await self.get_run_async(run_id)

    def cancel(self, run_id: str, *, compensate: bool = False) -> Run:
        """Cancel a run at its next call boundary — never in the middle of an effect.

        ``compensate=True`` first runs the compensations of the effects it made (newest
        first, each once); an effect of unknown outcome pauses the run
        (``effect_state_unknown``) until it is resolved, and the cancellation then goes on.
        Without compensations such an effect stays unknown, resolvable later. A run held by
        a worker is stopped by that worker; the returned run may still show it running.
        Cancelled is final.
        """
        return self._loop.call(self.cancel_async(run_id, compensate=compensate))

    async def pause_async(
        self, run_id: str, *, reason: str | None = None, by: str = "operator"
    ) -> Run:
        return Run.from_record(await actions.pause(self.engine, run_id, reason=reason, by=by))

    def pause(self, run_id: str, *, reason: str | None = None, by: str = "operator") -> Run:
        """Pause a run at its next call boundary — an effect in flight lands and is recorded
        first. A queued or waiting run pauses at once (a wait is kept for ``unpause``); one
        held by a worker may still show running. Asking again changes nothing; a finished
        run raises InvalidTransition."""
        return self._loop.call(self.pause_async(run_id, reason=reason, by=by))

    async def unpause_async(self, run_id: str, *, by: str = "operator") -> Run:
        return Run.from_record(await actions.unpause(self.engine, run_id, by=by))

    def unpause(self, run_id: str, *, by: str = "operator") -> Run:
        """Continue an operator-paused run: queued for a worker (a run paused while waiting
        waits again for the same approval, event or timer). Raises InvalidTransition for a
        run no operator paused, or one paused for another reason (``resolve_effect`` it)."""
        return self._loop.call(self.unpause_async(run_id, by=by))

    async def fork_async(
        self,
        run_id: str,
        *,
        at: str | None = None,
        replay: ReplayMode = ReplayMode.DISABLED,
        new_run_id: str | None = None,
    ) -> Run:
        replay = check_choice(replay, ReplayMode, "replay")
        forked = await fork.fork(self.engine, run_id, at=at, replay=replay, run_id=new_run_id)
        return await self.get_run_async(forked)

    def fork(
        self,
        run_id: str,
        *,
        at: str | None = None,
        replay: ReplayMode = ReplayMode.DISABLED,
        new_run_id: str | None = None,
    ) -> Run:
        """A new queued run of this code whose history, up to ``at``, is ``run_id``'s.

        ``at`` is a step id (or checkpoint id) of the source; every call the source settled
        up to it is the fork's own recorded call (tool calls under the fork's own keys),
        and without ``at`` all of them are. Past that, each new tool call follows
        ``replay``: ``DISABLED`` pauses the fork (``replay_blocked``) before anything is
        sent; ``RECORDED`` answers from the source's ledger (same step id, same input) or
        pauses; ``SANDBOX`` calls the tool's ``sandbox=``; ``LIVE_WITH_NEW_APPROVAL`` makes
        the effect for real after a fresh approval bound to the fork. Works on finished
        runs too: the way to continue one with new code. Idempotent on ``new_run_id``:
        asked again, the same fork is returned (IdempotencyConflict if that id is another
        run's).

        Example::

            trial = app.fork(run.run_id, at="plan#1", replay=durably.ReplayMode.SANDBOX)
            app.worker().run(until_idle=True)
        """
        return self._loop.call(self.fork_async(run_id, at=at, replay=replay, new_run_id=new_run_id))

    async def replay_async(
        self, run_id: str, *, mode: ReplayMode | str = ReplayMode.RECORDED
    ) -> ReplayReport:
        return await whatif.replay(self.engine, run_id, mode)

    def replay(self, run_id: str, *, mode: ReplayMode | str = ReplayMode.RECORDED) -> ReplayReport:
        """What-if: execute completed run ``run_id``'s workflow again with this code, every
        call answered from the run's record (nothing real happens), and report whether it
        reproduces the run or where it first diverges.

        Only ``RECORDED`` is supported. The what-if is a fork of the run (its id in the
        report), cancelled if it diverged.

        Example::

            report = app.replay(run.run_id)
            if not report.reproduced:
                print(report.divergence)
        """
        return self._loop.call(self.replay_async(run_id, mode=mode))

    async def describe_async(self, run_id: str) -> dict[str, Any]:
        """Everything about a run as plain JSON: the document behind ``runs show --json``."""
        check_ref(run_id, "run id")
        store = await self.open()
        journal = await store.load_journal(run_id, checkpoints=1)
        if journal is None:
            raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
        return views.describe(journal)

    def describe(self, run_id: str) -> dict[str, Any]:
        """A run with its steps and effects, as plain JSON."""
        return self._loop.call(self.describe_async(run_id))

    async def events_async(self, run_id: str, *, after: int = 0) -> list[Event]:
        check_ref(run_id, "run id")
        check_count(after, "after", low=0, high=MAX_SEQUENCE)
        store = await self.open()
        return await store.events(run_id, after=after)

    def events(self, run_id: str, *, after: int = 0) -> list[Event]:
        """The run's event log (its audit trail), in sequence order, after ``after``."""
        return self._loop.call(self.events_async(run_id, after=after))

    async def checkpoints_async(self, run_id: str) -> list[dict[str, Any]]:
        check_ref(run_id, "run id")
        store = await self.open()
        return views.checkpoints(await store.checkpoints(run_id), self.secret_key)

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

    def worker(
        self,
        *,
        concurrency: int = 1,
        lease_ttl: timedelta | None = None,
        recheck_paused: timedelta | None = timedelta(minutes=10),
        metrics_host: str = "127.0.0.1",
        metrics_port: int | None = None,
    ) -> Worker:
        """A worker that claims and executes this app's runnable runs (see :class:`Worker`)."""

        return Worker(
            self,
            concurrency=concurrency,
            lease_ttl=self.lease_ttl if lease_ttl is None else lease_ttl,
            recheck_paused=recheck_paused,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
        )


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
