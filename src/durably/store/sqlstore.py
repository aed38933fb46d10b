"""The :class:`Store` contract over SQL, for both backends: every method is one named
statement or one plan (``store.plans``). A backend supplies how to execute them — its
connection, transactions, clock and round trips — and the few statements its dialect
makes different: how a run is picked for a claim, how a list is bound.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from durably.metrics import LedgerFigures
from durably.status import RunStatus
from durably.store import commit_plan, pause, plans
from durably.store.base import (
    Approval,
    Claim,
    Committed,
    Event,
    Expect,
    Journal,
    Lease,
    NewRun,
    OperationRecord,
    RunRecord,
    Store,
    StoredCheckpoint,
    Transition,
)
from durably.store.plans import Plan, Query, Rows, lease_lost
from durably.store.rows import (
    checkpoint_from_row,
    event_from_row,
    operation_from_row,
    run_from_row,
)

T = TypeVar("T")


class SQLStore(Store):
    """A store whose every transaction is a plan of named statements."""

    # -- what a backend supplies --------------------------------------------------------

    _data_modifying_with = False
    """Whether the dialect has a data-modifying ``WITH``, and with it ``commit_step``,
    ``commit_at`` and a ``start_run`` that also writes the new run's event and receipt: a
    step's commit, a commit at the state its lease holder knows (an effect's, a
    checkpoint's, an ending) and a new run's start, as one statement each."""

    @abc.abstractmethod
    async def _run(
        self, plan: Callable[[], Plan[T]], *, idempotent: bool = False, read_only: bool = False
    ) -> T:
        """Execute a fresh ``plan()`` in one transaction and return its result.

        ``idempotent``: the plan may be repeated after a COMMIT whose answer was lost.
        ``read_only``: one consistent snapshot, no writes.
        """

    @abc.abstractmethod
    async def _one(self, name: str, params: dict[str, Any], *, write: bool = False) -> Rows:
        """One statement in a transaction of its own; its rows."""

    @abc.abstractmethod
    def _pick(self, name: str, params: dict[str, Any]) -> Plan[Rows]:
        """Run ``claim_run`` or ``claim_batch`` and lease the runs it finds:
        a row of each run as leased, with ``old_status``, ``old_owner`` and ``old_until``
        from before."""

    @abc.abstractmethod
    def _in_claim_order(self, query: Query, *, final: bool = False) -> Plan[Rows]:
        """``query``, a walk of ``durably_runs_runnable``, sent so that it walks the index
        in claim order and stops (PostgreSQL's planner may otherwise sort every runnable
        run); ``final``: the plan's last round."""

    @abc.abstractmethod
    def _list(self, values: Sequence[str]) -> Any:
        """``values`` as one statement parameter."""

    # -- runs ---------------------------------------------------------------------------

    async def now(self) -> float:
        (row,) = await self._one("clock", {})
        return float(row["now"])

    async def create_run(self, new: NewRun) -> tuple[RunRecord, bool]:
        # Idempotent: a retry after a lost COMMIT finds the run it created.
        return await self._run(lambda: plans.create_run(new), idempotent=True)

    async def create_fork(
        self,
        new: NewRun,
        copies: Sequence[Transition],
        *,
        owner: str | None = None,
        ttl_s: float = 0.0,
    ) -> RunRecord | None:
        return await self._run(lambda: commit_plan.create_fork(new, copies, owner, ttl_s))

    async def start_run(
        self, new: NewRun, owner: str, ttl_s: float
    ) -> tuple[RunRecord, bool, Claim | None]:
        sent_at = time.monotonic()
        one_statement = self._data_modifying_with
        # Idempotent: a retry after a lost COMMIT finds the run, leased to this owner, whose
        # claim_run then takes it again.
        return await self._run(
            lambda: plans.start_run(new, owner, ttl_s, sent_at, one_statement=one_statement),
            idempotent=True,
        )

    async def claim_run(self, run_id: str, owner: str, ttl_s: float) -> Claim | None:
        claims = await self._claim("claim_run", {"run_id": run_id}, owner, ttl_s)
        return claims[0] if claims else None

    async def claim_next(self, owner: str, ttl_s: float, workflows: list[str]) -> Claim | None:
        claims = await self.claim_batch(owner, ttl_s, workflows, 1)
        return claims[0] if claims else None

    async def claim_batch(
        self, owner: str, ttl_s: float, workflows: list[str], limit: int
    ) -> list[Claim]:
        if not workflows or limit < 1:
            return []
        params = {"workflows": self._list(workflows), "limit": limit}
        return await self._claim("claim_batch", params, owner, ttl_s)

    async def _claim(
        self, name: str, params: dict[str, Any], owner: str, ttl_s: float
    ) -> list[Claim]:
        # Before anything is sent: the lease runs out no earlier than sent_at + ttl.
        sent_at = time.monotonic()
        params = {**params, "owner": owner, "ttl": ttl_s}
        return await self._run(lambda: plans.claim(self._pick(name, params), owner, ttl_s, sent_at))

    async def heartbeat(self, lease: Lease) -> float:
        rows = await self._one(
            "heartbeat",
            {
                "run_id": lease.run_id,
                "owner": lease.owner,
                "epoch": lease.epoch,
                "ttl": lease.ttl_s,
            },
            write=True,
        )
        if not rows:
            raise lease_lost(lease)
        return float(rows[0]["lease_until"])

    async def live_owners(self) -> list[str]:
        return [r["lease_owner"] for r in await self._one("live_owners", {})]

    async def expire_leases(self, owners: Sequence[str]) -> int:
        return await self._run(lambda: plans.expire_leases(self._list(owners)))

    async def commit(self, guard: Lease | Expect, transition: Transition) -> Committed:
        if (
            self._data_modifying_with
            and isinstance(guard, Lease)
            and commit_plan.fits_one_statement(transition)
        ):
            committed = await self._run(lambda: commit_plan.commit_at(guard, transition))
            if committed is not None:
                return committed
        one = self._data_modifying_with
        return await self._run(lambda: commit_plan.commit(guard, transition, step_statement=one))

    async def deliver_signal(
        self, run_id: str, event_id: str, name: str, payload_json: str
    ) -> bool:
        # Idempotent: a retry after a lost COMMIT finds the event and reports a duplicate.
        return await self._run(
            lambda: plans.deliver_signal(run_id, event_id, name, payload_json), idempotent=True
        )

    async def decide_approval(
        self,
        run_id: str,
        approval_id: str | None,
        decision: str,
        by: str,
        comment: str | None,
    ) -> tuple[Approval, bool]:
        return await self._run(
            lambda: plans.decide_approval(run_id, approval_id, decision, by, comment)
        )

    async def request_cancel(self, run_id: str, *, compensate: bool) -> RunRecord:
        return await self._run(lambda: plans.request_cancel(run_id, compensate), idempotent=True)

    async def request_pause(self, run_id: str, request_json: str) -> RunRecord:
        return await self._run(lambda: pause.request_pause(run_id, request_json), idempotent=True)

    async def withdraw_pause(self, run_id: str, by: str) -> RunRecord:
        return await self._run(lambda: pause.withdraw_pause(run_id, by))

    async def ledger_figures(self) -> LedgerFigures:
        unresolved: dict[str, tuple[int, float]] = {}
        duplicates: dict[str, int] = {}
        totals: dict[str, int] = {}
        for r in await self._ledger_rows():
            figure, label, n = r["figure"], r["label"], int(r["n"] or 0)
            if figure == "unresolved":
                unresolved[label] = (n, float(r["since"]))
            elif figure == "duplicates":
                duplicates[label] = n
            else:
                totals[figure] = n
        return LedgerFigures(
            unresolved=unresolved,
            duplicates=duplicates,
            replays_blocked=totals.get("replays_blocked", 0),
            approvals_expired=totals.get("approvals_expired", 0),
        )

    async def _ledger_rows(self) -> Rows:
        return await self._one("ledger_figures", {})

    async def undelivered(
        self, consumer: str, limit: int, *, skip_runs: Sequence[str] = ()
    ) -> list[Event]:
        rows = await self._one(
            "undelivered",
            {"consumer": consumer, "skip_runs": self._list(skip_runs), "limit": limit},
        )
        return [event_from_row(r) for r in rows]

    async def acknowledge(self, consumer: str, event_id: str) -> bool:
        rows = await self._one(
            "acknowledge", {"consumer": consumer, "event_id": event_id}, write=True
        )
        return bool(rows)

    # -- reads --------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        rows = await self._one("get_run", {"run_id": run_id})
        return run_from_row(rows[0]) if rows else None

    async def list_runs(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        rows = await self._one(
            "list_runs", {"status": status, "workflow": workflow, "limit": limit}
        )
        return [run_from_row(r) for r in rows]

    async def load_journal(self, run_id: str, *, checkpoints: int = 3) -> Journal | None:
        return await self._run(
            lambda: plans.load_journal(run_id, checkpoints), idempotent=True, read_only=True
        )

    async def operation(self, tenant: str, idempotency_key: str) -> OperationRecord | None:
        rows = await self._one("operation", {"tenant": tenant, "key": idempotency_key})
        return operation_from_row(rows[0]) if rows else None

    async def events(self, run_id: str, *, after: int = 0) -> list[Event]:
        rows = await self._one("events", {"run_id": run_id, "after": after})
        return [event_from_row(r) for r in rows]

    async def checkpoints(self, run_id: str) -> list[StoredCheckpoint]:
        rows = await self._one("checkpoints", {"run_id": run_id})
        return [checkpoint_from_row(r) for r in rows]

    async def next_wakeup(self, workflows: list[str]) -> float | None:
        if not workflows:
            return None
        query = ("next_wakeup", {"workflows": self._list(workflows)})
        rows = await self._run(
            lambda: self._in_claim_order(query, final=True), idempotent=True, read_only=True
        )
        if not rows or rows[0]["due"] is None:
            return None
        # From the store's clock to ours: callers sleep with time.time().
        return float(rows[0]["due"]) - float(rows[0]["now"]) + time.time()
