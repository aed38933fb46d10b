"""The shipped Prometheus alert rules name only metrics durably exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib import resources
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client import Counter, Histogram

from durably.metrics import LedgerFigures, Metrics

RULES = resources.files("durably") / "alerts" / "durably.rules.yml"

# docs/architecture.md#metrics: what must be alerted on, and a metric that shows it.
REQUIRED = {
    "duplicate side effect": "agent_duplicate_side_effect_total",
    "unknown unresolved": "agent_tool_unknown_oldest_seconds",
    "key reused with other input": "agent_tool_idempotency_conflict_total",
    "lease expiry rate": "agent_step_lease_expired_total",
    "tool-to-commit lag": "agent_checkpoint_after_tool_lag_seconds_bucket",
    "surge after recovery": "agent_step_recovery_total",
    "approval expired": "agent_approval_expired_total",
    "replay blocked": "agent_replay_side_effect_blocked_total",
}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def exported_names() -> set[str]:
    """Every sample name the registry exposes once each labelled metric has a child."""
    metrics = Metrics()
    # The figures read from the store.
    metrics.ledger.observe(LedgerFigures(unresolved={"x": (1, 0.0)}, duplicates={"x": 1}))
    for value in vars(metrics).values():
        if isinstance(value, Counter | Histogram):
            labels = value._labelnames  # prometheus_client has no public accessor
            if isinstance(value, Histogram):
                (value.labels(*("x" for _ in labels)) if labels else value).observe(0.01)
            else:
                (value.labels(*("x" for _ in labels)) if labels else value).inc()
    return {s.name for family in metrics.registry.collect() for s in family.samples}


def test_every_rule_is_well_formed() -> None:
    found = rules()
    assert found
    names = [r["alert"] for r in found]
    assert len(names) == len(set(names))
    for rule in found:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert isinstance(rule["expr"], str)
        assert rule["expr"].strip()
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"])


def test_every_metric_in_an_expression_is_exported() -> None:
    exported = exported_names()
    for rule in rules():
        used = set(re.findall(r"agent_[a-z_]+", rule["expr"]))
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)


@pytest.mark.parametrize("what", sorted(REQUIRED))
def test_each_required_alert_exists(what: str) -> None:
    assert any(REQUIRED[what] in r["expr"] for r in rules()), what


def test_promtool_accepts_the_rules_if_installed() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # not installed here; the structure is checked above
    with resources.as_file(RULES) as path:
        subprocess.run([promtool, "check", "rules", str(path)], check=True)
