"""Prometheus metrics with the names fixed in docs/architecture.md#metrics.

Each :class:`~durably.App` owns a :class:`Metrics` on its own registry, so two apps in one
process (tests, a console serving several) never mix their counts.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


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
            "Tool calls answered from the ledger.",
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
        self.duplicate_side_effect = Counter(
            "agent_duplicate_side_effect",
            "Duplicate effects found by reconciliation.",
            ["tool"],
            registry=r,
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
        self.approval_expired = Counter(
            "agent_approval_expired_attempt",
            "Approvals presented after their expiry (for a decision or to authorise an effect).",
            registry=r,
        )
        self.unknown_unresolved = Gauge(
            "agent_tool_unknown_unresolved",
            "Effects whose outcome is unknown and not settled yet (read from the store).",
            ["tool"],
            registry=r,
        )
        self.unknown_oldest = Gauge(
            "agent_tool_unknown_oldest_seconds",
            "Age of the oldest unsettled unknown effect (read from the store).",
            ["tool"],
            registry=r,
        )
        self.replay_blocked = Counter(
            "agent_replay_side_effect_blocked", "Live effects blocked during replay.", registry=r
        )

    def observe_unresolved(self, unresolved: dict[str, tuple[int, float]]) -> None:
        """Set the unknown-effect gauges from the store (shared by every worker)."""
        now = time.time()
        self.unknown_unresolved.clear()
        self.unknown_oldest.clear()
        for tool, (count, since) in unresolved.items():
            self.unknown_unresolved.labels(tool=tool).set(count)
            self.unknown_oldest.labels(tool=tool).set(max(now - since, 0.0))

    def exposition(self) -> bytes:
        """The metrics in Prometheus text format."""
        return generate_latest(self.registry)
