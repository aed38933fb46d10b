"""Prometheus metrics with the names fixed in docs/architecture.md#metrics.

Each :class:`~durably.App` owns a :class:`Metrics` on its own registry, so two apps in one
process (tests, a console serving several) never mix their counts.

Two sources, never both for one name: *events* seen by this process (a lease taken over, a
reconciliation answered) are counters of the process that saw them — sum them over every
scrape target; *facts* recorded in the ledger (effects left unknown, duplicates found,
replays blocked, approvals expired) are read from the store at scrape time by
:class:`LedgerCollector`, so every process reports the same whole-system value — take
their ``max``, never their sum.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from durably.status import OperationStatus

RECOVERED_STATES = (
    *(
        s.value
        for s in OperationStatus
        if s not in (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED)
    ),
    "checkpoint_corrupted",
)
"""The ``state`` labels of ``agent_step_recovery_total``: an unfinished call's status, or a
checkpoint found corrupted."""


@dataclass(frozen=True)
class LedgerFigures:
    """What the ledger says about the whole system, whichever process wrote it: read from
    the store (``Store.ledger_figures``) by every process's ``/metrics`` at scrape time."""

    unresolved: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Per tool: effects unknown, being reconciled, or executing past their lease, and the
    oldest ``updated_at`` among them (unix seconds)."""
    duplicates: dict[str, int] = field(default_factory=dict)
    """Per tool: the extra executions reconciliations reported (``duplicates=``)."""
    replays_blocked: int = 0
    """Forks paused because their replay mode blocked a live effect."""
    approvals_expired: int = 0
    """Approvals that ran out before they were decided or used."""


class LedgerCollector(Collector):
    """The ledger's figures as metrics: whatever :meth:`observe` was last given.

    Reading the store is asynchronous and a collector is not, so whoever serves a scrape
    reads the figures first (``durably.exposition.scrape``) and then renders them.
    """

    def __init__(self) -> None:
        self._figures: LedgerFigures | None = None
        self._read_at = 0.0
        self.tools: frozenset[str] = frozenset()
        """Tools whose duplicates are exported even at 0 (see :meth:`Metrics.know_tools`)."""

    def observe(self, figures: LedgerFigures | None) -> None:
        """The figures just read from the store; ``None``: the store did not answer."""
        self._figures = figures
        self._read_at = time.time()

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._figures)

    def _families(self, figures: LedgerFigures | None) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "agent_ledger_up", "1 if the store answered the last read of the ledger's figures."
        )
        unresolved = GaugeMetricFamily(
            "agent_tool_unknown_unresolved",
            "Effects whose outcome is unknown and not settled yet (read from the store).",
            labels=["tool"],
        )
        oldest = GaugeMetricFamily(
            "agent_tool_unknown_oldest_seconds",
            "Age of the oldest unsettled unknown effect (read from the store).",
            labels=["tool"],
        )
        duplicates = CounterMetricFamily(
            "agent_duplicate_side_effect",
            "Duplicate effects reconciliations found (read from the store).",
            labels=["tool"],
        )
        blocked = CounterMetricFamily(
            "agent_replay_side_effect_blocked",
            "Forks paused because their replay mode blocked a live effect (read from the store).",
        )
        expired = CounterMetricFamily(
            "agent_approval_expired",
            "Approvals that ran out before they were decided or used (read from the store).",
        )
        if figures is not None:
            for tool, (count, since) in sorted(figures.unresolved.items()):
                unresolved.add_metric([tool], count)
                oldest.add_metric([tool], max(self._read_at - since, 0.0))
            for tool in sorted(self.tools | set(figures.duplicates)):
                duplicates.add_metric([tool], figures.duplicates.get(tool, 0))
            blocked.add_metric([], figures.replays_blocked)
            expired.add_metric([], figures.approvals_expired)
        if self._read_at:
            up.add_metric([], 0.0 if figures is None else 1.0)
        yield from (up, unresolved, oldest, duplicates, blocked, expired)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step_recovery = Counter(
            "agent_step_recovery",
            "Calls found unfinished when a run was resumed.",
            ["state"],
            registry=r,
        )
        self.idempotency_hit = Counter(
            "agent_tool_idempotency_hit",
            "Duplicate requests of a tool call answered without a second effect: a call whose "
            "result another holder had recorded, or a reconciliation that found the effect "
            "(not a replay of a result this run recorded).",
            ["tool"],
            registry=r,
        )
        self.idempotency_conflict = Counter(
            "agent_tool_idempotency_conflict", "Same key, different input.", ["tool"], registry=r
        )
        self.unknown = Counter(
            "agent_tool_unknown", "Tool calls whose outcome became unknown.", ["tool"], registry=r
        )
        self.reconciliation = Counter(
            "agent_tool_reconciliation", "Reconciliation answers.", ["result"], registry=r
        )
        self.lease_expired = Counter(
            "agent_step_lease_expired", "Runs taken over after their lease expired.", registry=r
        )
        self.checkpoint_lag = Histogram(
            "agent_checkpoint_after_tool_lag_seconds",
            "From a tool returning to its result being committed.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=r,
        )
        self.ledger = LedgerCollector()
        r.register(self.ledger)
        for state in RECOVERED_STATES:
            self.step_recovery.labels(state=state)

    def know_tools(self, tools: Iterable[str]) -> None:
        """Export each tool's labelled counters from 0. Prometheus's ``increase()`` sees no
        increase in a series whose first sample is already 1, so without this the alert on
        a tool's first duplicate or first conflict would never fire."""
        names = frozenset(tools)
        for tool in names:
            for counter in (self.idempotency_hit, self.idempotency_conflict, self.unknown):
                counter.labels(tool=tool)
        self.ledger.tools = names

    def exposition(self) -> bytes:
        """The metrics in Prometheus text format (the ledger's as last observed)."""
        return generate_latest(self.registry)
