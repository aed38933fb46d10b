"""Each shipped alert rule fires on the series that durably's metrics export when its failure
happens, and stays quiet on a normal series (evaluated by tests/server/promql.py).

The series are real expositions: every 15 s each scrape target (a worker, the console) is
rendered with ``Metrics.exposition()`` and parsed back, while the scenario moves its
counters and the ledger's figures, so names, labels and the split between per-process
counters and ledger figures are the ones Prometheus would scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from durably.metrics import LedgerFigures, Metrics
from tests.server.promql import Query, Series, duration_s, fires

RULES = resources.files("durably") / "alerts" / "durably.rules.yml"
SCRAPE_S = 30.0
SPAN_S = 30 * 60.0
END = 1_000_000.0
"""The evaluation time of the scenarios (their clock: seconds, arbitrary origin)."""

Scenario = Callable[[float, dict[str, Metrics]], None]
"""Bring every target's metrics to what they show at time ``t`` (called in time order)."""


def rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for group in doc["groups"] for r in group["rules"]}


def scraped(
    scenario: Scenario, instances: tuple[str, ...] = ("worker-1", "worker-2")
) -> list[Series]:
    targets = {name: Metrics() for name in instances}
    for metrics in targets.values():
        metrics.know_tools(["charge"])  # as durably.exposition does for the app's tools
    series: dict[tuple[str, frozenset[tuple[str, str]]], Series] = {}
    t = END - SPAN_S
    while t <= END:
        scenario(t, targets)
        for instance, metrics in targets.items():
            for family in metrics.registry.collect():  # what exposition() renders
                for sample in family.samples:
                    labels = {**sample.labels, "instance": instance}
                    key = (sample.name, frozenset(labels.items()))
                    series.setdefault(key, Series(sample.name, labels, [])).samples.append(
                        (t, sample.value)
                    )
        t += SCRAPE_S
    return list(series.values())


def ledger(**figures: Any) -> Scenario:
    """Every target reads the same figures from the store; ``figures`` maps a field to a
    function of the time."""

    def scenario(t: float, targets: dict[str, Metrics]) -> None:
        read = LedgerFigures(**{k: f(t) for k, f in figures.items()})
        for metrics in targets.values():
            metrics.ledger.observe(read)

    return scenario


def unknown_for(age_at_end: float) -> Scenario:
    """One effect of unknown outcome since ``age_at_end`` before the end (the collector
    ages it by the wall clock at each scrape, so its start is placed on that clock)."""

    def scenario(t: float, targets: dict[str, Metrics]) -> None:
        age = age_at_end - (END - t)
        unresolved = {"charge": (1, time.time() - age)} if age > 0 else {}
        for metrics in targets.values():
            metrics.ledger.observe(LedgerFigures(unresolved=unresolved))

    return scenario


def every(period_s: float, act: Callable[[Metrics], None], *, last_s: float) -> Scenario:
    """``act`` on the first target each ``period_s`` during the last ``last_s`` seconds."""
    state = {"next": END - last_s}

    def scenario(t: float, targets: dict[str, Metrics]) -> None:
        first = next(iter(targets.values()))
        while state["next"] <= t:
            act(first)
            state["next"] += period_s

    return scenario


def once(at: float, act: Callable[[Metrics], None]) -> Scenario:
    return every(1e9, act, last_s=END - at)


def no_conflict(t: float, targets: dict[str, Metrics]) -> None:
    targets["worker-1"].idempotency_conflict.labels(tool="charge")  # exported at 0


def step(value_before: int, value_after: int, at: float) -> Callable[[float], int]:
    return lambda t: value_after if t >= at else value_before


FIVE_MIN_AGO = END - 300

SCENARIOS: dict[str, tuple[Scenario, Scenario]] = {
    # alert: (a series it must fire on, a normal one it must not fire on)
    "DurablyDuplicateSideEffect": (
        ledger(duplicates=lambda t: {"charge": 1} if t >= FIVE_MIN_AGO else {}),
        ledger(duplicates=lambda t: {"charge": 2}),  # old duplicates, none new
    ),
    "DurablyUnknownEffectUnresolved": (unknown_for(35 * 60), unknown_for(10 * 60)),
    "DurablyIdempotencyKeyReusedWithOtherInput": (
        once(FIVE_MIN_AGO, lambda m: m.idempotency_conflict.labels(tool="charge").inc()),
        no_conflict,
    ),
    "DurablyLeaseExpiryRateHigh": (
        every(12, lambda m: m.lease_expired.inc(), last_s=25 * 60),  # 0.083/s
        every(60, lambda m: m.lease_expired.inc(), last_s=SPAN_S),  # 0.017/s
    ),
    "DurablyToolToCheckpointLagHigh": (
        every(5, lambda m: m.checkpoint_lag.observe(2.0), last_s=25 * 60),
        every(5, lambda m: m.checkpoint_lag.observe(0.004), last_s=25 * 60),
    ),
    "DurablyToolCallSurgeAfterRecovery": (
        every(10, lambda m: m.step_recovery.labels(state="executing").inc(), last_s=300),
        every(120, lambda m: m.step_recovery.labels(state="executing").inc(), last_s=SPAN_S),
    ),
    "DurablyReplayTriedLiveEffect": (
        ledger(replays_blocked=step(0, 1, FIVE_MIN_AGO)),
        ledger(replays_blocked=step(4, 4, FIVE_MIN_AGO)),
    ),
    "DurablyApprovalExpired": (
        ledger(approvals_expired=step(2, 3, FIVE_MIN_AGO)),
        ledger(approvals_expired=step(2, 2, FIVE_MIN_AGO)),
    ),
}


def test_every_rule_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(rules())


@pytest.mark.parametrize("alert", sorted(SCENARIOS))
def test_rule_fires_on_its_failure_and_not_otherwise(alert: str) -> None:
    rule = rules()[alert]
    for_s = duration_s(rule["for"]) if "for" in rule else 0.0
    failing, normal = SCENARIOS[alert]
    assert fires(rule["expr"], for_s, scraped(failing), at=END), f"{alert} did not fire"
    assert not fires(rule["expr"], for_s, scraped(normal), at=END), f"{alert} fired when normal"


def test_a_ledger_figure_counts_once_however_many_targets_report_it() -> None:
    """Every target reads the same duplicate from the store: the alert's value is one
    duplicate, not one per target."""
    scenario = SCENARIOS["DurablyDuplicateSideEffect"][0]
    expr = rules()["DurablyDuplicateSideEffect"]["expr"]
    for instances in (("serve",), ("serve", "worker-1", "worker-2")):
        (value,) = fires(expr, 0, scraped(scenario, instances), at=END).values()
        assert 1 <= value < 1.5, instances  # increase() extrapolates a little past 1


def test_the_evaluator_refuses_what_it_does_not_know() -> None:
    with pytest.raises(SyntaxError):
        Query("avg_over_time(agent_step_lease_expired_total[5m]) > 0")
