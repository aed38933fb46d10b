"""The ``durably`` command line against a real SQLite file and a real app module."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pty
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from durably.cli import cli
from durably.store import open_store
from durably.store.migrations import migrations
from tests.conftest import execute_sql, fetch_sql, postgres_schema_url

APP_MODULE = "clitestapp"

APP_SOURCE = textwrap.dedent(
    """
    import pathlib

    import durably

    app = durably.App("sqlite:///" + str(pathlib.Path(__file__).with_name("app.db")))


    @app.step()
    def add(a: int, b: int) -> int:
        return a + b


    @app.tool(idempotent=True)
    def notify(to: str, total: int) -> dict:
        return {"to": to, "total": total, "key": durably.idempotency_key()}


    @app.tool()
    def charge(amount: int) -> dict:
        # Neither idempotent nor reconcilable: an unknown outcome must go to a person.
        raise TimeoutError("gateway timed out")


    @app.workflow()
    async def summing(a: int, b: int = 0) -> dict:
        total = await add(a, b)
        mail = await notify(to="lead@example.com", total=total)
        return {"total": total, "mail": mail}


    @app.workflow()
    async def billing(amount: int) -> dict:
        return {"charge": await charge(amount), "amount": amount}


    @app.workflow()
    async def approval() -> object:
        payload = await durably.wait_for_event("approved", timeout=60)
        return payload


    @app.tool(idempotent=True, requires_approval=True)
    def place_order(customer: str, amount: int) -> dict:
        return {"customer": customer, "amount": amount, "key": durably.idempotency_key()}


    @app.workflow()
    async def ordering(customer: str, amount: int) -> dict:
        try:
            order = await place_order(customer=customer, amount=amount)
        except durably.ApprovalRejected as exc:
            return {"rejected_by": exc.by, "comment": exc.comment}
        return {"order": order}


    @app.workflow()
    async def campaign(audience: int) -> dict:
        decision = await durably.approval("send_campaign", {"audience": audience})
        return {"sent_to": audience, "by": decision["by"]}


    @app.model("scripted-mini", profile="v1")
    def answer(question: str) -> dict:
        return {
            "text": "refund it",
            "tool_calls": [{"id": "call_1", "name": "notify"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 4},
        }


    @app.workflow()
    async def asking(question: str) -> dict:
        reply = await answer(question)
        [call] = reply["tool_calls"]
        return await notify.with_step_id(call["id"])(to="lead@example.com", total=1)


    not_an_app = 42
    """
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory holding the test app module, as the current directory."""
    (tmp_path / f"{APP_MODULE}.py").write_text(APP_SOURCE)
    monkeypatch.chdir(tmp_path)
    # The CLI puts the cwd on sys.path; give it a copy so the change ends with the test.
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("DURABLY_APP", "DURABLY_DATABASE_URL", "DURABLY_LEASE_TTL"):
        monkeypatch.delenv(name, raising=False)
    sys.modules.pop(APP_MODULE, None)
    yield tmp_path
    sys.modules.pop(APP_MODULE, None)


def durably(*args: str, app: str | None = f"{APP_MODULE}:app") -> Result:
    argv = (["--app", app] if app else []) + list(args)
    return CliRunner().invoke(cli, argv, prog_name="durably")


def ok(*args: str, app: str | None = f"{APP_MODULE}:app") -> str:
    result = durably(*args, app=app)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


def ok_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json"))


def test_start_prints_the_run_id_and_is_idempotent_on_run_id(project: Path) -> None:
    run_id = ok("start", "summing", "--input", '{"a": 1, "b": 2}').strip()
    assert run_id.startswith("run_")
    assert ok("start", "summing", "--input", "[5]", "--run-id", "r-1") == "r-1\n"
    assert ok("start", "summing", "--input", "[5]", "--run-id", "r-1") == "r-1\n"

    runs = {r["run_id"]: r for r in ok_json("runs", "list")}
    assert set(runs) == {run_id, "r-1"}
    assert {r["status"] for r in runs.values()} == {"queued"}
    assert runs["r-1"]["workflow"] == "summing"
    assert runs["r-1"]["tenant"] == "default"


def test_start_with_another_input_on_the_same_run_id_is_a_clear_error(project: Path) -> None:
    ok("start", "summing", "--input", "[5]", "--run-id", "r-1")
    result = durably("start", "summing", "--input", "[6]", "--run-id", "r-1")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: run r-1 already exists")
    assert result.stdout == ""
    assert "Traceback" not in result.output


def test_start_rejects_bad_json_and_unknown_workflows(project: Path) -> None:
    bad_json = durably("start", "summing", "--input", "{a: 1}")
    assert bad_json.exit_code == 2
    assert "not valid JSON" in bad_json.stderr
    unknown = durably("start", "nope")
    assert unknown.exit_code == 1
    assert "error: no workflow named 'nope'" in unknown.stderr
    # Keys that name start's own options: refused with the way out, not a traceback.
    for key in ("run_id", "tenant"):
        clash = durably("start", "summing", "--input", json.dumps({"a": 1, key: "x"}))
        assert clash.exit_code == 2, (clash.stderr, clash.exception)
        assert clash.stderr.startswith("error: Invalid value for '--input'"), clash.stderr
        assert key in clash.stderr
        assert "JSON array" in clash.stderr
    assert ok_json("runs", "list") == []


def test_worker_until_idle_completes_queued_runs(project: Path) -> None:
    kwargs_run = ok("start", "summing", "--input", '{"a": 1, "b": 2}').strip()
    args_run = ok("start", "summing", "--input", "[40, 2]").strip()
    scalar_run = ok("start", "summing", "--input", "7").strip()

    result = durably("worker", "--until-idle", "--concurrency", "2", "--lease-ttl", "5")
    assert result.exit_code == 0, result.stderr
    assert "executed 3 run(s)" in result.stderr
    assert result.stdout == ""

    runs = {r["run_id"]: r for r in ok_json("runs", "list", "--status", "completed")}
    assert runs[kwargs_run]["result"]["total"] == 3
    assert runs[args_run]["result"]["total"] == 42
    assert runs[scalar_run]["result"]["total"] == 7
    assert ok_json("runs", "list", "--status", "queued") == []

    idle = durably("worker", "--until-idle")
    assert idle.exit_code == 0
    assert "executed 0 run(s)" in idle.stderr


def test_runs_list_filters_and_renders_a_table(project: Path) -> None:
    ok("start", "summing", "--input", "[1]", "--run-id", "s-1")
    ok("start", "billing", "--input", "[9]", "--run-id", "b-1")
    assert [r["run_id"] for r in ok_json("runs", "list", "--workflow", "billing")] == ["b-1"]
    assert len(ok_json("runs", "list", "--limit", "1")) == 1

    table = ok("runs", "list")
    assert table.splitlines()[0].split() == ["RUN", "ID", "WORKFLOW", "STATUS", "REASON", "UPDATED"]
    assert any(line.split()[:3] == ["b-1", "billing", "queued"] for line in table.splitlines())
    assert ok("runs", "list", "--status", "failed") == "no runs\n"


def test_runs_show_json_is_the_run_document(project: Path) -> None:
    ok("start", "summing", "--input", '{"a": 2, "b": 3}', "--run-id", "s-1")
    ok("worker", "--until-idle")

    doc = ok_json("runs", "show", "s-1")
    assert doc["run_id"] == "s-1"
    assert doc["workflow"] == "summing"
    assert doc["status"] == "completed"
    assert doc["error"] is None
    assert doc["result"]["total"] == 5
    assert [(s["step_id"], s["status"]) for s in doc["steps"]] == [
        ("add#1", "succeeded"),
        ("notify#1", "succeeded"),
    ]
    [effect] = doc["effects"]
    assert effect["step_id"] == "notify#1"
    assert effect["tool"] == "notify"
    assert effect["status"] == "succeeded"
    assert len(effect["idempotency_key"]) == 64
    # The key the tool saw is the key the ledger recorded.
    assert doc["result"]["mail"]["key"] == effect["idempotency_key"]
    assert doc["approvals"] == []

    text = ok("runs", "show", "s-1")
    assert "s-1" in text
    assert "completed" in text
    assert "add#1" in text
    effect_rows = [line.split() for line in text.split("effects:")[1].splitlines() if line]
    assert effect_rows[0] == ["STEP", "TOOL", "STATUS", "KEY", "EXTERNAL", "ID"]
    assert effect_rows[1] == [
        "notify#1",
        "notify",
        "succeeded",
        effect["idempotency_key"][:12],
        "-",
    ]


def test_runs_show_lists_model_calls(project: Path) -> None:
    ok("start", "asking", "--input", '{"question": "refund?"}', "--run-id", "m-1")
    ok("worker", "--until-idle")
    doc = ok_json("runs", "show", "m-1")
    [call] = doc["model_calls"]
    assert call["usage"] == {"input_tokens": 12, "output_tokens": 4, "total_tokens": 16}
    assert [e["model_call_id"] for e in doc["effects"]] == [call["model_call_id"]]

    text = ok("runs", "show", "m-1")
    rows = [line.split() for line in text.split("model calls:")[1].splitlines() if line]
    assert rows[0][:4] == ["STEP", "MODEL", "PROFILE", "TOKENS"]
    assert rows[1][:4] == ["answer#1", "scripted-mini", "v1", "12/4"]
    assert rows[1][-1] == "call_1"


def test_unknown_effect_is_resolved_then_resumed_to_completion(project: Path) -> None:
    ok("start", "billing", "--input", '{"amount": 30}', "--run-id", "b-1")
    ok("worker", "--until-idle")

    paused = ok_json("runs", "show", "b-1")
    assert paused["status"] == "paused"
    assert paused["status_reason"] == "effect_state_unknown"
    assert [(e["step_id"], e["status"]) for e in paused["effects"]] == [("charge#1", "unknown")]
    text = ok("runs", "show", "b-1")
    assert "paused (effect_state_unknown)" in text
    assert "charge#1" in text
    assert "unknown" in text

    resolved = ok_json(
        "resolve",
        "b-1",
        "charge#1",
        "--succeeded",
        "--result",
        '{"charge_id": "ch_1"}',
        "--by",
        "alice",
    )
    assert resolved["status"] == "queued"

    resumed = ok_json("resume", "b-1")
    assert resumed["status"] == "completed"
    assert resumed["result"] == {"charge": {"charge_id": "ch_1"}, "amount": 30}

    doc = ok_json("runs", "show", "b-1")
    assert doc["status"] == "completed"
    assert [(e["step_id"], e["status"]) for e in doc["effects"]] == [("charge#1", "succeeded")]

    again = durably("resume", "b-1")
    assert again.exit_code == 1
    assert again.stderr.startswith("error: run b-1 is completed")


def test_resolve_not_executed_and_failed_in_text_mode(project: Path) -> None:
    ok("start", "billing", "--input", "[1]", "--run-id", "b-1")
    ok("start", "billing", "--input", "[2]", "--run-id", "b-2")
    ok("worker", "--until-idle")

    assert ok("resolve", "b-1", "charge#1", "--not-executed").startswith("b-1: queued")
    # Not executed means sent again with the same key; this tool times out again.
    assert ok("resume", "b-1").startswith("b-1: paused (effect_state_unknown)")

    assert ok("resolve", "b-2", "charge#1", "--failed").startswith("b-2: queued")
    failed = ok("resume", "b-2")
    assert failed.startswith("b-2: failed")
    assert "error:" in failed


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--succeeded", "--failed"],
        ["--succeeded", "--not-executed", "--failed"],
        ["--not-executed", "--result", "{}"],
    ],
)
def test_resolve_requires_exactly_one_outcome(project: Path, flags: list[str]) -> None:
    ok("start", "billing", "--input", "[1]", "--run-id", "b-1")
    ok("worker", "--until-idle")
    result = durably("resolve", "b-1", "charge#1", *flags)
    assert result.exit_code == 2
    assert "--succeeded" in result.stderr
    assert ok_json("runs", "show", "b-1")["status"] == "paused"


def test_resolve_of_a_settled_effect_is_a_durably_error(project: Path) -> None:
    ok("start", "summing", "--input", "[1]", "--run-id", "s-1")
    ok("worker", "--until-idle")
    result = durably("resolve", "s-1", "notify#1", "--succeeded")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: run s-1 is completed")


def test_runs_show_of_a_missing_run(project: Path) -> None:
    result = durably("runs", "show", "nope", "--json")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: no run 'nope'")


def test_event_is_delivered_once_and_completes_the_waiting_run(project: Path) -> None:
    ok("start", "approval", "--run-id", "a-1")
    ok("worker", "--until-idle")
    waiting = ok_json("runs", "show", "a-1")
    assert waiting["status"] == "waiting_external"

    payload = '{"ok": true}'
    assert ok("event", "a-1", "approved", "--payload", payload, "--event-id", "e1") == (
        "delivered\n"
    )
    assert ok("event", "a-1", "approved", "--payload", payload, "--event-id", "e1") == (
        "duplicate ignored\n"
    )
    assert ok_json("event", "a-1", "approved", "--event-id", "e1") == {
        "run_id": "a-1",
        "name": "approved",
        "event_id": "e1",
        "result": "duplicate ignored",
    }

    ok("worker", "--until-idle")
    done = ok_json("runs", "show", "a-1")
    assert done["status"] == "completed"
    assert done["result"] == {"ok": True}

    late = durably("event", "a-1", "approved", "--event-id", "e2")
    assert late.exit_code == 1
    assert late.stdout == ""
    assert late.stderr.startswith("error: ")
    assert "Traceback" not in late.output


def test_event_without_an_id_gets_one_that_can_be_sent_again(project: Path) -> None:
    ok("start", "approval", "--run-id", "a-1")
    ok("worker", "--until-idle")
    sent = ok_json("event", "a-1", "approved", "--payload", "[1, 2]")
    assert sent["result"] == "delivered"
    assert len(sent["event_id"]) == 32
    again = ok_json("event", "a-1", "approved", "--event-id", sent["event_id"])
    assert again["result"] == "duplicate ignored"
    ok("worker", "--until-idle")
    assert ok_json("runs", "show", "a-1")["result"] == [1, 2]


def test_event_rejects_bad_json_and_unknown_runs(project: Path) -> None:
    bad_json = durably("event", "a-1", "approved", "--payload", "{ok: true}")
    assert bad_json.exit_code == 2
    assert "not valid JSON" in bad_json.stderr
    unknown = durably("event", "nope", "approved", "--event-id", "e1")
    assert unknown.exit_code == 1
    assert unknown.stderr.startswith("error: ")
    assert "nope" in unknown.stderr


def test_cancel_of_a_waiting_run(project: Path) -> None:
    ok("start", "approval", "--run-id", "a-1")
    ok("start", "approval", "--run-id", "a-2")
    ok("worker", "--until-idle")

    assert ok("cancel", "a-1") == "a-1: cancelled\n"
    assert ok_json("runs", "show", "a-1")["status"] == "cancelled"
    assert ok_json("runs", "show", "a-2")["status"] == "waiting_external"
    assert ok_json("cancel", "a-2")["status"] == "cancelled"

    again = durably("cancel", "a-1")
    assert again.exit_code == 1
    assert again.stderr.startswith("error: run a-1 is cancelled (final)")
    # A cancelled run takes no more events.
    assert durably("event", "a-1", "approved", "--event-id", "e1").exit_code == 1


def test_pause_and_unpause_of_a_waiting_run(project: Path) -> None:
    ok("start", "approval", "--run-id", "a-1")
    ok("worker", "--until-idle")
    waiting_for = ok_json("runs", "show", "a-1")["waiting_for"]

    paused = ok("pause", "a-1", "--reason", "customer called", "--by", "ana")
    assert paused.startswith("a-1: paused (operator_pause)\n")
    assert "paused by ana: customer called" in paused
    assert ok_json("pause", "a-1")["status"] == "paused"  # again: nothing changes
    assert ok_json("runs", "show", "a-1")["waiting_for"] == waiting_for
    ok("event", "a-1", "approved", "--payload", '{"ok": true}', "--event-id", "e1")
    ok("worker", "--until-idle")
    assert ok_json("runs", "show", "a-1")["status"] == "paused"  # the event is kept

    unpaused = ok_json("unpause", "a-1", "--by", "ana")
    assert (unpaused["status"], unpaused["pause_requested"]) == ("queued", False)
    ok("worker", "--until-idle")
    assert ok_json("runs", "show", "a-1")["result"] == {"ok": True}

    for args, message in [
        (("pause", "nope"), "error: no run 'nope'"),
        (("unpause", "nope"), "error: no run 'nope'"),
        (("pause", "a-1"), "error: run a-1 is completed (final)"),
        (("unpause", "a-1"), "error: run a-1 is completed (final)"),
    ]:
        refused = durably(*args)
        assert refused.exit_code == 1, args
        assert refused.stderr.startswith(message), refused.stderr
    ok("start", "approval", "--run-id", "a-2")
    not_paused = durably("unpause", "a-2")
    assert not_paused.exit_code == 1
    assert "nothing to unpause" in not_paused.stderr


def waiting_for_approval(run_id: str) -> dict[str, Any]:
    """Run the queued runs, then return ``run_id``'s one pending approval."""
    ok("worker", "--until-idle")
    doc = ok_json("runs", "show", run_id)
    assert doc["status"] == "waiting_approval", doc
    [pending] = [a for a in doc["approvals"] if a["status"] == "requested"]
    assert doc["waiting_for"]["approval_id"] == pending["approval_id"]
    return dict(pending)


def lines_of(text: str) -> dict[str, str]:
    """``label   value`` lines as a dict (the human output of approve and reject)."""
    pairs = (re.split(r"\s{2,}", line, maxsplit=1) for line in text.splitlines() if line)
    return {label: value for label, value in pairs}


def shown_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def test_approve_lets_the_tool_call_run_once(project: Path) -> None:
    ok("start", "ordering", "--input", '{"customer": "c-1", "amount": 30}', "--run-id", "o-1")
    pending = waiting_for_approval("o-1")
    assert pending["step_id"] == "place_order#1"
    assert pending["kind"] == "tool"
    assert pending["payload"] == {
        "tool": "place_order",
        "arguments": {"customer": "c-1", "amount": 30},
    }
    # Nothing ran before the approval.
    assert ok_json("runs", "show", "o-1")["effects"] == []

    text = ok("runs", "show", "o-1")
    assert f"waiting   approval {pending['approval_id']}: `durably approve o-1`" in text
    approval_rows = [line.split() for line in text.split("approvals:")[1].splitlines() if line]
    assert approval_rows[0] == ["APPROVAL", "STEP", "STATUS", "EXPIRES", "DECIDED", "BY"]
    assert approval_rows[1][:3] == [pending["approval_id"], "place_order#1", "requested"]
    assert "(in 23h" in text

    shown = lines_of(ok("approve", "o-1", "--by", "alice", "--comment", "within budget"))
    assert shown["approved"] == (
        f"approval {pending['approval_id']} of run o-1, step place_order#1"
    )
    assert shown["tool call"] == 'place_order(amount=30, customer="c-1")'
    assert shown["expires"].startswith(f"{shown_time(pending['expires_at'])} (in 23h ")
    assert shown["by"] == "alice: within budget"
    assert ok_json("runs", "show", "o-1")["status"] == "queued"

    ok("worker", "--until-idle")
    doc = ok_json("runs", "show", "o-1")
    assert doc["status"] == "completed"
    [effect] = doc["effects"]
    assert effect["status"] == "succeeded"
    assert doc["result"]["order"] == {
        "customer": "c-1",
        "amount": 30,
        "key": effect["idempotency_key"],
    }
    [used] = doc["approvals"]
    assert (used["status"], used["decided_by"], used["comment"]) == (
        "consumed",
        "alice",
        "within budget",
    )
    assert "consumed" in ok("runs", "show", "o-1").split("approvals:")[1]

    # A decision is recorded once; deciding again, either way, is an error.
    for again in (["approve", "o-1"], ["reject", "o-1"], ["approve", "o-1", "--json"]):
        result = durably(*again)
        assert result.exit_code == 1, again
        assert result.stdout == ""
        assert result.stderr.startswith("error: run o-1 is completed (final)")
    named = durably("reject", "o-1", pending["approval_id"])
    assert named.exit_code == 1
    assert named.stderr.startswith("error: run o-1 is completed (final)")
    assert "Traceback" not in named.output
    assert ok_json("runs", "show", "o-1")["status"] == "completed"


def test_approve_json_is_the_approval(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USER", "carol")
    ok("start", "ordering", "--input", '{"customer": "c-2", "amount": 5}', "--run-id", "o-2")
    pending = waiting_for_approval("o-2")

    decided = ok_json("approve", "o-2", pending["approval_id"])
    assert {
        k: decided[k]
        for k in ("approval_id", "run_id", "step_id", "kind", "name", "status", "payload")
    } == {
        "approval_id": pending["approval_id"],
        "run_id": "o-2",
        "step_id": "place_order#1",
        "kind": "tool",
        "name": "place_order",
        "status": "approved",
        "payload": {"tool": "place_order", "arguments": {"customer": "c-2", "amount": 5}},
    }
    assert decided["expires_at"] == pending["expires_at"]
    # --by defaults to $USER, as for resolve.
    assert decided["decided_by"] == "carol"
    assert decided["comment"] is None
    assert decided["idempotency_key"] == pending["idempotency_key"]


def test_reject_is_handled_by_the_workflow(project: Path) -> None:
    ok("start", "ordering", "--input", '{"customer": "c-3", "amount": 900}', "--run-id", "o-3")
    pending = waiting_for_approval("o-3")

    rejected = ok_json("reject", "o-3", "--by", "bob", "--comment", "too much")
    assert rejected["approval_id"] == pending["approval_id"]
    assert rejected["status"] == "rejected"
    assert (rejected["decided_by"], rejected["comment"]) == ("bob", "too much")

    ok("worker", "--until-idle")
    doc = ok_json("runs", "show", "o-3")
    assert doc["status"] == "completed"
    assert doc["result"] == {"rejected_by": "bob", "comment": "too much"}
    assert doc["effects"] == []
    assert [a["status"] for a in doc["approvals"]] == ["rejected"]

    again = durably("approve", "o-3", pending["approval_id"])
    assert again.exit_code == 1
    assert "o-3 is completed (final)" in again.stderr


def test_reject_in_text_mode(project: Path) -> None:
    ok("start", "ordering", "--input", '{"customer": "c-4", "amount": 1}', "--run-id", "o-4")
    pending = waiting_for_approval("o-4")
    shown = lines_of(ok("reject", "o-4", "--by", "bob"))
    assert shown["rejected"] == f"approval {pending['approval_id']} of run o-4, step place_order#1"
    assert shown["by"] == "bob"
    assert "ApprovalRejected" in shown["next"]


def test_plan_approval_shows_its_payload(project: Path) -> None:
    ok("start", "campaign", "--input", '{"audience": 12000}', "--run-id", "p-1")
    pending = waiting_for_approval("p-1")
    assert pending["kind"] == "plan"
    assert pending["step_id"] == "durably.approval:send_campaign#1"

    shown = lines_of(ok("approve", "p-1", pending["approval_id"], "--by", "dana"))
    assert shown["plan"] == 'send_campaign: {"audience": 12000}'
    ok("worker", "--until-idle")
    doc = ok_json("runs", "show", "p-1")
    assert doc["status"] == "completed"
    assert doc["result"] == {"sent_to": 12000, "by": "dana"}
    assert [a["status"] for a in doc["approvals"]] == ["consumed"]


def test_an_expired_approval_cannot_be_approved_and_is_requested_again(project: Path) -> None:
    ok("start", "ordering", "--input", '{"customer": "c-5", "amount": 2}', "--run-id", "o-5")
    pending = waiting_for_approval("o-5")
    with sqlite3.connect(project / "app.db") as db:
        db.execute("UPDATE durably_approvals SET expires_at = 1")

    late = durably("approve", "o-5")
    assert late.exit_code == 1
    assert late.stdout == ""
    assert late.stderr.startswith(f"error: approval {pending['approval_id']} of run o-5 expired")
    doc = ok_json("runs", "show", "o-5")
    assert [a["status"] for a in doc["approvals"]] == ["expired"]
    assert doc["effects"] == []

    # The run asks again, with a fresh expiry; the new approval lets the call run.
    fresh = waiting_for_approval("o-5")
    assert fresh["approval_id"] != pending["approval_id"]
    assert fresh["idempotency_key"] == pending["idempotency_key"]
    ok("approve", "o-5")
    ok("worker", "--until-idle")
    doc = ok_json("runs", "show", "o-5")
    assert doc["status"] == "completed"
    assert [a["status"] for a in doc["approvals"]] == ["expired", "consumed"]


def test_decisions_on_runs_without_that_approval(project: Path) -> None:
    ok("start", "summing", "--input", "[1]", "--run-id", "s-1")
    ok("worker", "--until-idle")
    none = durably("approve", "s-1")
    assert none.exit_code == 1
    assert none.stderr.startswith("error: run s-1 is completed (final)")

    ok("start", "ordering", "--input", '{"customer": "c-6", "amount": 3}', "--run-id", "o-6")
    waiting_for_approval("o-6")
    wrong = durably("approve", "o-6", "nope")
    assert wrong.exit_code == 1
    assert wrong.stderr == "error: run o-6 has no approval 'nope'\n"
    missing = durably("reject", "no-such-run")
    assert missing.exit_code == 1
    assert missing.stderr.startswith("error: no run 'no-such-run'")
    assert ok_json("runs", "show", "o-6")["status"] == "waiting_approval"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("missing_module:app", "cannot import module 'missing_module'"),
        (f"{APP_MODULE}:nope", "not a durably.App instance"),
        (f"{APP_MODULE}:not_an_app", "is a int, not a durably.App"),
        (APP_MODULE, "must look like module:attr"),
    ],
)
def test_bad_app_is_a_clear_error(project: Path, spec: str, message: str) -> None:
    result = durably("runs", "list", app=spec)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_missing_app_is_a_clear_error(project: Path) -> None:
    result = durably("start", "summing", app=None)
    assert result.exit_code == 2
    assert "--app" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus", "runs", "list"], "No such option '--bogus'"),
        (["start"], "Missing argument 'WORKFLOW'"),
        (["runs", "list", "--limit", "0"], "Invalid value for '--limit'"),
        (["nope"], "No such command 'nope'"),
    ],
)
def test_usage_errors_are_error_lines_too(project: Path, args: list[str], message: str) -> None:
    result = durably(*args)
    assert result.exit_code == 2
    first, *rest = result.stderr.splitlines()
    assert first.startswith(f"error: {message}")
    assert rest[0].startswith("Usage: durably")
    assert result.stdout == ""


def test_app_from_the_environment(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLY_APP", f"{APP_MODULE}:app")
    assert ok("start", "summing", "--input", "[1]", "--run-id", "s-1", app=None) == "s-1\n"


def test_db_overrides_the_apps_database(project: Path) -> None:
    other = f"sqlite:///{project / 'other.db'}"
    ok("--db", other, "start", "summing", "--input", "[1]", "--run-id", "s-1")
    assert [r["run_id"] for r in ok_json("--db", other, "runs", "list")] == ["s-1"]
    assert (project / "other.db").exists()
    # --db sets the imported app's URL; a fresh process (here: a fresh import) has its own.
    sys.modules.pop(APP_MODULE)
    assert ok_json("runs", "list") == []


def test_migrate_with_only_db(project: Path) -> None:
    url = f"sqlite:///{project / 'fresh.db'}"
    first = ok("--db", url, "migrate", app=None)
    assert "applied migration(s) 1" in first
    assert (project / "fresh.db").exists()
    assert "nothing to apply" in ok("--db", url, "migrate", app=None)
    # The migrated database is usable by an app.
    assert ok_json("--db", url, "runs", "list") == []


def test_migrate_over_a_table_durably_did_not_create_says_so(
    project: Path, database_url: str
) -> None:
    """A new database already holding a ``durably_runs`` of someone else's: ``migrate``
    says which statement failed and on what, exits 1, and creates nothing."""
    execute_sql(database_url, "CREATE TABLE durably_runs (note TEXT)")
    execute_sql(database_url, "INSERT INTO durably_runs VALUES ('theirs')")
    result = durably("--db", database_url, "migrate", app=None)
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    assert result.stderr.startswith("error: cannot migrate ")
    assert "creating its schema failed" in result.stderr
    assert "durably_runs" in result.stderr
    assert "already exists" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert fetch_sql(database_url, "SELECT * FROM durably_runs") == [("theirs",)]
    with pytest.raises(Exception, match="durably_schema_migrations"):
        fetch_sql(database_url, "SELECT * FROM durably_schema_migrations")


def with_password(postgres_url: str, password: str) -> str:
    """The same server and schema, with a password in the URL (the test server trusts any)."""
    scheme, _, rest = postgres_url.partition("://")
    user, _, host = rest.partition("@")
    return f"{scheme}://{user}:{password}@{host}"


def test_the_database_password_is_never_printed(
    project: Path, postgres_schema: str, bump_schema: Callable[[str], None]
) -> None:
    """Not on success, not when the schema is too new, not when the URL is malformed."""
    plain = postgres_schema_url(postgres_schema)
    url = with_password(plain, "hunter2-secret")
    migrated = ok("--db", url, "migrate", app=None)
    assert "applied migration(s)" in migrated
    assert ":***@" in migrated
    bump_schema(plain)
    for result in (durably("--db", url, "migrate", app=None), durably("--db", url, "runs", "list")):
        assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
        assert "schema version 9999" in result.stderr
        assert "hunter2" not in result.stdout + result.stderr
    scheme, _, rest = plain.partition("://")
    for password in ("hun%zzter2", "hun ter2", "hun@ter2/x#y", "hunter2@[::1"):
        result = durably(
            "--db", f"{scheme}://u:{password}@{rest.partition('@')[2]}", "migrate", app=None
        )
        assert result.exit_code != 0, (password, result.stdout)
        assert result.stderr.startswith("error: "), result.stderr
        assert "hunter2" not in result.stdout + result.stderr, result.stderr
        assert "ter2" not in result.stdout + result.stderr, result.stderr
    result = durably("--db", f"{plain}&password=hunter2-secret", "migrate", app=None)
    assert "hunter2" not in result.stdout + result.stderr


def test_a_migration_that_fails_is_named_and_leaves_the_schema_as_it_was(
    project: Path, database_url: str
) -> None:
    """A database whose newest migration is recorded as not applied while its objects are
    there: ``migrate`` names that migration, exits 1, and records nothing."""
    ok("--db", database_url, "migrate", app=None)
    (newest,) = fetch_sql(database_url, "SELECT max(version) FROM durably_schema_migrations")[0]
    execute_sql(database_url, "DELETE FROM durably_schema_migrations WHERE version = ?", (newest,))
    result = durably("--db", database_url, "migrate", app=None)
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    assert result.stderr.startswith("error: cannot migrate ")
    assert f"migration {newest:04d}_" in result.stderr
    assert " failed: " in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    versions = fetch_sql(database_url, "SELECT version FROM durably_schema_migrations")
    assert sorted(v for (v,) in versions) == list(range(1, newest))


def test_every_command_has_help(project: Path) -> None:
    for command in [
        [],
        ["start"],
        ["worker"],
        ["runs", "list"],
        ["runs", "show"],
        ["resolve"],
        ["approve"],
        ["reject"],
        ["resume"],
        ["event"],
        ["cancel"],
        ["migrate"],
        ["demo"],
    ]:
        result = durably(*command, "--help", app=None)
        assert result.exit_code == 0, command
        assert "Usage: durably" in result.stdout


def test_console_entry_points_in_a_subprocess(project: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    script = Path(sys.executable).with_name("durably")
    # The console script must find ./clitestapp.py although its sys.path lacks the cwd.
    started = subprocess.run(
        [str(script), "--app", f"{APP_MODULE}:app", "start", "summing", "--input", "[4]"],
        capture_output=True,
        text=True,
        cwd=project,
        env=env,
        check=False,
    )
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip()

    worker = subprocess.run(
        [sys.executable, "-m", "durably", "--app", f"{APP_MODULE}:app", "worker", "--until-idle"],
        capture_output=True,
        text=True,
        cwd=project,
        env={**env, "DURABLY_LEASE_TTL": "5"},
        check=False,
    )
    assert worker.returncode == 0, worker.stderr
    assert "executed 1 run(s)" in worker.stderr

    shown = subprocess.run(
        [str(script), "--app", f"{APP_MODULE}:app", "runs", "show", run_id, "--json"],
        capture_output=True,
        text=True,
        cwd=project,
        env=env,
        check=False,
    )
    assert json.loads(shown.stdout)["result"]["total"] == 4

    bad = subprocess.run(
        [str(script), "--app", "no_such_module:app", "runs", "list"],
        capture_output=True,
        text=True,
        cwd=project,
        env=env,
        check=False,
    )
    assert bad.returncode != 0
    assert "cannot import module 'no_such_module'" in bad.stderr
    assert "Traceback" not in bad.stderr


# -- a new SQLite file opened by several processes at once ---------------------------------

RACERS = 6
NEW_FILES = 40


def _migrate_new_files(directory: str, barrier: Any) -> None:
    """In a child process: for each new file, wait for every racer, then open the store and
    migrate it, as ``durably migrate`` and every worker do on start."""
    failures = []
    for n in range(NEW_FILES):
        barrier.wait(timeout=60)
        try:
            store = open_store(f"sqlite:///{directory}/new-{n}.db")
            asyncio.run(store.migrate())
            asyncio.run(store.close())
        except BaseException as exc:
            failures.append(f"file {n}: {type(exc).__name__}: {exc}\n")
    Path(directory, f"failures-{os.getpid()}.txt").write_text("".join(failures))


def test_processes_racing_to_create_one_database_all_succeed(tmp_path: Path) -> None:
    """Six real processes open the store and migrate it (what `durably migrate` and every
    worker do on start) on the same brand-new file at the same instant, forty times over.
    SQLite answers "database is locked" at once, without waiting out the busy timeout, when
    two of them switch a new file to WAL together: opening must wait or retry like every
    other statement, never fail."""
    # forkserver, not fork: this test process may have threads, which fork copies half-way.
    context = multiprocessing.get_context("forkserver")
    barrier = context.Barrier(RACERS)
    racers = [
        context.Process(target=_migrate_new_files, args=(str(tmp_path), barrier))
        for _ in range(RACERS)
    ]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=300)
    assert [racer.exitcode for racer in racers] == [0] * RACERS
    reports = sorted(tmp_path.glob("failures-*.txt"))
    assert len(reports) == RACERS
    assert "".join(report.read_text() for report in reports) == ""
    for n in range(NEW_FILES):
        with sqlite3.connect(tmp_path / f"new-{n}.db") as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            applied = db.execute("SELECT version FROM durably_schema_migrations ORDER BY 1")
            assert [v for (v,) in applied] == [m.version for m in migrations("sqlite")]


# -- what the store holds is shown, never obeyed -------------------------------------------

# Clear the screen, set the clipboard (OSC 52), ring, return and backspace over the line,
# an 8-bit CSI, a right-to-left override and a newline that would forge a line of output.
HOSTILE = "x\x1b[2J\x1b]52;c;aGk=\x07\r\x08\x9b1A\u202eok\nstatus    completed"
HOSTILE_SHOWN = "x\\x1b[2J\\x1b]52;c;aGk=\\x07\\r\\x08\\x9b1A\\u202eok\\nstatus    completed"
# What no output may contain raw: every control character but the newline, DEL, C1,
# bidirectional controls.
RAW = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def store_hostile_strings(project: Path) -> str:
    """Runs whose stored strings hold terminal controls, written behind durably's back as a
    buggy writer, an older version or a hand-edited database would leave them. Returns the
    id of the run whose very id is hostile."""
    ok("start", "billing", "--input", '{"amount": 3}', "--run-id", "b-1")
    ok("start", "ordering", "--input", '{"customer": "c-1", "amount": 2}', "--run-id", "o-1")
    ok("start", "summing", "--input", "[1]", "--run-id", "s-1")
    ok("worker", "--until-idle")
    url = f"sqlite:///{project / 'app.db'}"
    error = json.dumps({"type": HOSTILE, "message": HOSTILE})
    execute_sql(
        url,
        "UPDATE durably_runs SET workflow = ?, tenant_id = ?, status_reason = ?, error_json = ? "
        "WHERE run_id = 'b-1'",
        (HOSTILE, HOSTILE, HOSTILE, error),
    )
    execute_sql(url, "UPDATE durably_steps SET error_json = ? WHERE run_id = 'b-1'", (error,))
    execute_sql(
        url,
        "UPDATE durably_tool_operations SET tenant_id = ?, tool_name = ?, "
        "external_operation_id = ? WHERE run_id = 'b-1'",
        (HOSTILE, HOSTILE, HOSTILE),
    )
    payload = json.dumps({"tool": "place_order", "arguments": {"customer": HOSTILE}})
    execute_sql(url, "UPDATE durably_approvals SET payload_json = ?", (payload,))
    execute_sql(
        url, "UPDATE durably_runs SET result_json = ? WHERE run_id = 's-1'", (json.dumps(HOSTILE),)
    )
    hostile_id = "s" + HOSTILE
    for table in ("runs", "steps", "tool_operations", "events", "checkpoints"):
        execute_sql(
            url, f"UPDATE durably_{table} SET run_id = ? WHERE run_id = 's-1'", (hostile_id,)
        )
    return hostile_id


def assert_shown_not_obeyed(output: str) -> None:
    assert not RAW.search(output), ascii(output)
    assert HOSTILE_SHOWN in output, output


def test_stored_terminal_controls_are_shown_escaped(project: Path) -> None:
    visible_id = "s" + HOSTILE_SHOWN
    store_hostile_strings(project)

    listed = ok("runs", "list")
    assert_shown_not_obeyed(listed)
    # A header and one line per run: no stored newline forges another.
    assert len(listed.splitlines()) == 4
    assert any(line.startswith(visible_id) for line in listed.splitlines())

    shown = ok("runs", "show", "b-1")
    assert_shown_not_obeyed(shown)
    for label in ("workflow", "status", "error"):
        assert HOSTILE_SHOWN in next(line for line in shown.splitlines() if line.startswith(label))
    # workflow, tenant, reason, the error's type and message, the step's, the effect's tool
    # and external id
    assert shown.count(HOSTILE_SHOWN) == 9

    decided = ok("approve", "o-1", "--by", "alice")
    assert not RAW.search(decided), ascii(decided)
    assert "\\u001b[2J" in decided or "\\x1b[2J" in decided
    assert "\\x9b1A" in decided or "\\u009b1A" in decided
    assert "\\u202e" in decided

    # What the caller typed is refused, and shown escaped.
    refused = durably("--db", f"sqlite:///{project}/new\x1b]52;c;aGk=\x07.db", "migrate", app=None)
    assert refused.exit_code == 1
    assert not RAW.search(refused.output), ascii(refused.output)
    assert "new\\x1b]52;c;aGk=\\x07.db" in refused.stderr
    assert sorted(p.name for p in project.iterdir() if p.name.startswith("new")) == []


def test_json_output_keeps_the_stored_strings_exactly_and_escaped(project: Path) -> None:
    hostile_id = store_hostile_strings(project)
    for args in (["runs", "list"], ["runs", "show", "b-1"]):
        result = durably(*args, "--json")
        assert result.exit_code == 0, result.output
        assert not RAW.search(result.stdout), ascii(result.stdout)
        document = json.loads(result.stdout)
        if args[1] == "list":
            assert {r["run_id"] for r in document} == {hostile_id, "b-1", "o-1"}
        else:
            assert (document["workflow"], document["tenant"], document["status_reason"]) == (
                HOSTILE,
                HOSTILE,
                HOSTILE,
            )
            assert document["effects"][0]["external_operation_id"] == HOSTILE


def test_a_real_terminal_receives_no_control_sequence(project: Path) -> None:
    """click strips some ANSI sequences when output is not a terminal, and none when it is:
    the output is read here from a real pseudo-terminal."""
    store_hostile_strings(project)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    for args in (["runs", "list"], ["runs", "show", "b-1"]):
        primary, secondary = pty.openpty()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "durably", "--app", f"{APP_MODULE}:app", *args],
                cwd=project,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=secondary,
                stderr=secondary,
            )
            os.close(secondary)
            received = b""
            while True:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not chunk:
                    break
                received += chunk
            assert process.wait(timeout=30) == 0, received
        finally:
            os.close(primary)
        # The terminal turns each \n into \r\n: those are the only controls allowed.
        text = received.replace(b"\r\n", b"\n").decode()
        assert_shown_not_obeyed(text)


def test_fork_replays_history_and_blocks_a_new_effect(project: Path) -> None:
    ok("start", "summing", "--input", '{"a": 2, "b": 3}', "--run-id", "s-1")
    ok("worker", "--until-idle")
    assert ok("fork", "s-1", "--at", "add#1", "--run-id", "f-1") == "f-1: queued\n"
    ok("worker", "--until-idle")
    forked = ok_json("runs", "show", "f-1")
    assert forked["status"] == "paused"
    assert forked["status_reason"] == "replay_blocked"
    assert [s["step_id"] for s in forked["steps"]] == ["add#1"]
    recorded = ok_json("fork", "s-1", "--replay", "recorded", "--at", "add#1")
    ok("worker", "--until-idle")
    done = ok_json("runs", "show", recorded["run_id"])
    assert done["status"] == "completed"
    assert done["result"] == ok_json("runs", "show", "s-1")["result"]

    bad = durably("fork", "s-1", "--at", "nope#9")
    assert bad.exit_code == 1
    assert bad.stderr.startswith("error: run s-1 has no settled step or checkpoint 'nope#9'")
    assert durably("fork", "s-1", "--replay", "sometimes").exit_code == 2


def test_replay_reports_reproduced_or_the_divergence_by_exit_code(project: Path) -> None:
    run_id = ok("start", "summing", "--input", "[1, 2]").strip()
    ok("worker", "--until-idle")

    same = durably("replay", run_id, "--mode", "recorded", "--json")
    assert same.exit_code == 0, same.stderr
    report = json.loads(same.stdout)
    assert report["reproduced"] is True
    assert report["matched"] == ["add#1", "notify#1"]
    assert report["result"] == report["recorded_result"]

    # A deploy that changed the step's arguments: the same database, other code.
    changed = APP_SOURCE.replace("total = await add(a, b)", "total = await add(a, b + 1)")
    assert changed != APP_SOURCE
    (project / "changedapp.py").write_text(changed)
    try:
        diverged = durably("replay", run_id, "--json", app="changedapp:app")
        assert diverged.exit_code == 3, diverged.stderr
        divergence = json.loads(diverged.stdout)["divergence"]
        assert (divergence["kind"], divergence["step_id"]) == ("other_arguments", "add#1")
        text = durably("replay", run_id, app="changedapp:app")
        assert text.exit_code == 3
        assert text.stdout.startswith("diverged: other_arguments at add#1 (add)")
    finally:
        sys.modules.pop("changedapp", None)

    for args, message in [
        (["run_missing"], "no run 'run_missing'"),
        (["run\x00x"], "run id"),
        ([run_id, "--mode", "sandbox"], "the supported mode is recorded"),
    ]:
        bad = durably("replay", *args)
        assert bad.exit_code == 1, (args, bad.stdout)
        assert bad.stderr.startswith("error: "), bad.stderr
        assert message in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


def test_ctrl_c_while_a_write_waits_for_the_sqlite_lock_prints_no_traceback(
    project: Path,
) -> None:
    """Another process holds SQLite's write lock; Ctrl-C reaches ``durably start`` while
    its write waits for it. Once the lock is free the command ends on the interrupt, with
    no traceback, and the database holds the run whole or not at all."""
    ok("migrate")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE'); print('held', flush=True); time.sleep(3)\n"
            "db.execute('ROLLBACK')",
            str(project / "app.db"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        # Ctrl-C as from a terminal (a child of a non-interactive shell starts ignoring it).
        interruptible = (
            "import runpy, signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "sys.argv[0] = 'durably'\n"
            "runpy.run_module('durably', run_name='__main__')"
        )
        start = subprocess.Popen(
            [
                sys.executable,
                "-c",
                interruptible,
                "--app",
                f"{APP_MODULE}:app",
                "start",
                "summing",
                "--input",
                "[1]",
                "--run-id",
                "int-1",
            ],
            cwd=project,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        start.send_signal(signal.SIGINT)
        _, stderr = start.communicate(timeout=60)
    finally:
        holder.wait(timeout=30)
        if holder.stdout is not None:
            holder.stdout.close()
    assert start.returncode != 0
    assert "Traceback" not in stderr, stderr
    assert "InvalidStateError" not in stderr, stderr
    assert [r["run_id"] for r in ok_json("runs", "list")] in ([], ["int-1"])


def test_a_postgresql_server_that_never_answers_fails_the_command_in_its_timeout(
    project: Path,
) -> None:
    """A server that accepts connections and never answers (stopped, or a black hole)
    fails the command once the connect timeout is spent, instead of hanging it."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        url = f"postgresql://u:hunter2@127.0.0.1:{port}/db?connect_timeout=1"
        began = time.monotonic()
        for result in (
            durably("--db", url, "migrate", app=None),
            durably("--db", url, "runs", "list"),
        ):
            assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
            assert result.stderr.startswith("error: "), result.stderr
            assert "Traceback" not in result.stderr
            assert "hunter2" not in result.stderr
        assert time.monotonic() - began < 20


def test_a_database_that_would_not_outlast_the_command_or_has_options_is_refused(
    project: Path,
) -> None:
    before = sorted(p.name for p in project.iterdir())
    memory = durably("--db", "sqlite:///:memory:", "start", "summing", "--input", "[1]")
    assert memory.exit_code == 2, (memory.stdout, memory.stderr)
    assert "lasts only as long as one command" in memory.stderr
    assert memory.stdout == ""
    for url in ("sqlite:///app.db?mode=ro", "sqlite:///app.db#x"):
        odd = durably("--db", url, "migrate", app=None)
        assert odd.exit_code == 1, (odd.stdout, odd.stderr)
        assert odd.stderr.startswith("error: SQLite URL"), odd.stderr
    assert sorted(p.name for p in project.iterdir()) == before  # no file of that name
