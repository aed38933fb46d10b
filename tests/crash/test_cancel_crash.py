"""A process dies right after recording a call's intent, before sending it; the run is then
cancelled with compensations. A call only intended (``neither``: its claim comes later) is
not claimed and sent. One claimed with its intent has an unknown outcome and is settled
first: ``reconciled`` asks the shop, which never saw it, and records that instead of
sending it again; ``idempotent`` settles it the only way it can, by sending again under
its key, and the cancellation then undoes it. The shop's own records say so."""

from __future__ import annotations

import pytest

from tests.crash.conftest import TOOL, WORKFLOW, Harness, Shop

pytestmark = pytest.mark.crash


@pytest.mark.parametrize(
    ("kind", "status", "effects"),
    [
        ("idempotent", "compensated", 1),
        ("reconciled", "intent_recorded", 0),
        ("neither", "intent_recorded", 0),
    ],
)
def test_a_call_only_intended_when_its_process_died_is_not_sent_once_cancelled(
    kind: str, status: str, effects: int, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    wf, step_id = WORKFLOW[kind], f"{TOOL[kind]}#1"
    run_input = {"customer": customer, "campaign": "cancelled"}
    first = harness.start(wf, run_id, crash_at="effect.after_intent", **run_input)
    assert first.code == 77, first.explain()
    asked = harness.cancel(run_id)  # the dead process's lease may still run: a request
    assert asked.code == 0, asked.explain()
    proc = harness.recover(wf, run_id, **run_input)
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    assert proc.run["status"] == "cancelled", proc.explain()
    assert harness.effect_status(run_id, step_id) == status
    assert len(shop.records(kind, customer)) == effects
    withdrawn = [e["request"]["subject"] for e in shop.emails(customer)]
    assert withdrawn == [f"withdrawn {step_id}"] * effects
