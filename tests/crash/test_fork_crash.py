"""A ``SANDBOX`` fork's process dies right after recording a call's intent; a fresh process
takes the fork up. Whatever the tool (``neither``: the call is only intended; ``idempotent``:
claimed with its intent, so its outcome is unknown and it is sent again), the call goes to
the tool's sandbox: the fork's replay mode decides every attempt, not the memory of the
process that died. The shop's own records say so: the source's one effect, and one sandbox
notice."""

from __future__ import annotations

import pytest

from tests.crash.conftest import TOOL, WORKFLOW, Harness, Shop

pytestmark = pytest.mark.crash


@pytest.mark.parametrize("kind", ["idempotent", "neither"])
def test_a_sandbox_call_taken_up_after_a_crash_stays_in_the_sandbox(
    kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    wf, step_id = WORKFLOW[kind], f"{TOOL[kind]}#1"
    source = harness.start(wf, f"{run_id}-source", customer=customer, campaign="fork")
    assert source.code == 0, source.explain()
    assert len(shop.records(kind, customer)) == 1
    first = harness.fork(
        run_id, f"{run_id}-source", "begin#1", "SANDBOX", crash_at="effect.after_intent"
    )
    assert first.code == 77, first.explain()
    proc = harness.again(run_id)
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    assert proc.run["status"] == "completed", proc.explain()
    assert proc.run["result"]["sandbox"] is True
    assert harness.effect_status(run_id, step_id) == "succeeded"
    assert len(shop.records(kind, customer)) == 1, "only the source's effect"
    notices = [e["request"]["subject"] for e in shop.emails(customer)]
    assert notices == ["sandbox fork"]
