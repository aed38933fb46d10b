"""The JSON API over a real App and SQLite file: happy paths, errors, auth, fuzzing."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST

import durably
from durably import RunStatus
from durably.server import create_server
from tests.server.consoleapp import build_app

with warnings.catch_warnings():
    # Starlette now prefers the httpx2 package for its TestClient; httpx is what is installed.
    warnings.filterwarnings("ignore", message=".*httpx2", category=UserWarning)
    from fastapi.testclient import TestClient

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WEBHOOK_SECRETS = (
    "whsec_" + "a2V5LW9uZS1mb3ItdGVzdHMtMzItYnl0ZXMhIQ==",
    "plain-second-secret-of-32-bytes!",
)


class Harness:
    def __init__(self, client: TestClient, driver: durably.App) -> None:
        self.client = client
        self.driver = driver

    def work(self) -> None:
        self.driver.worker().run(until_idle=True)

    def waiting(self, workflow: str, *args: Any, run_id: str) -> str:
        self.driver.start(workflow, *args, run_id=run_id)
        self.work()
        return run_id

    def events(self, run_id: str) -> list[tuple[int, str]]:
        return [(e.sequence, e.type) for e in self.driver.events(run_id)]

    def status(self, run_id: str) -> RunStatus:
        return self.driver.get_run(run_id).status


def serve(
    tmp_path: Path,
    *,
    api_token: str | None = TOKEN,
    secrets: tuple[str, ...] = WEBHOOK_SECRETS,
    public_read: bool = True,
) -> Iterator[Harness]:
    """The console in-process; reads are open unless ``public_read=False`` (the tests of the
    token on reads drive a real ``durably serve``: tests/server/test_hardening.py)."""
    url = f"sqlite:///{tmp_path}/durably.db"
    driver = build_app(url)
    app = build_app(url)
    server = create_server(
        app, api_token=api_token, webhook_secrets=secrets, public_read=public_read
    )
    try:
        # 127.0.0.1: the console answers only to its allowed Host names.
        with TestClient(
            server, base_url="http://127.0.0.1", raise_server_exceptions=False
        ) as client:
            yield Harness(client, driver)
            assert client.portal is not None
            client.portal.call(app.close_async)
    finally:
        driver.close()


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    yield from serve(tmp_path)


# -- reads ----------------------------------------------------------------------------------


def test_health_and_metrics(h: Harness) -> None:
    assert h.client.get("/api/health").json() == {"status": "ok"}
    r = h.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    assert "agent_checkpoint_after_tool_lag_seconds_bucket" in r.text
    assert "# TYPE agent_step_lease_expired_total counter" in r.text


def test_start_then_list_and_show(h: Harness) -> None:
    r = h.client.post(
        "/api/runs",
        json={"workflow": "summing", "input": {"a": 2, "b": 3}, "run_id": "s-1"},
        headers=AUTH,
    )
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "queued"
    assert r.json()["run_id"] == "s-1"
    # Starting the same run id with the same input is idempotent.
    again = h.client.post(
        "/api/runs",
        json={"workflow": "summing", "input": {"a": 2, "b": 3}, "run_id": "s-1"},
        headers=AUTH,
    )
    assert again.status_code == 201
    positional = h.client.post(
        "/api/runs", json={"workflow": "summing", "input": [4], "run_id": "s-2"}, headers=AUTH
    )
    assert positional.status_code == 201
    h.work()
    doc = h.client.get("/api/runs/s-1").json()
    assert doc["status"] == "completed"
    assert doc["result"] == 5
    assert [s["step_id"] for s in doc["steps"]] == ["add#1"]
    assert doc["events"][0]["type"]
    assert doc["events"][0]["sequence"] == 1
    assert [e["sequence"] for e in doc["events"]] == sorted(e["sequence"] for e in doc["events"])
    assert doc["checkpoints"]
    assert all(c["valid"] for c in doc["checkpoints"])
    assert h.client.get("/api/runs/s-2").json()["result"] == 4

    listed = h.client.get("/api/runs", params={"status": "completed"}).json()
    assert {r["run_id"] for r in listed} == {"s-1", "s-2"}
    assert h.client.get("/api/runs", params={"workflow": "billing"}).json() == []
    assert len(h.client.get("/api/runs", params={"limit": 1}).json()) == 1
    assert h.client.get("/api/runs", params={"limit": 0}).status_code == 422
    assert h.client.get("/api/runs", params={"status": "bogus"}).status_code == 422


def test_a_run_shows_its_model_calls(h: Harness) -> None:
    rid = h.waiting("asking", "why?", run_id="ask-1")
    doc = h.client.get(f"/api/runs/{rid}").json()
    assert doc["status"] == "completed"
    [call] = doc["model_calls"]
    assert call["model_call_id"].startswith("mc_")
    assert (call["step_id"], call["model"], call["model_profile"]) == (
        "answer#1",
        "scripted-mini",
        "v1",
    )
    assert call["input"] == {"question": "why?"}
    assert call["output"] == {"text": "WHY?", "usage": {"input_tokens": 3, "output_tokens": 2}}
    assert call["usage"] == {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}
    assert call["tool_call_ids"] == []
    assert [e["payload"].get("model_call_id") for e in doc["events"] if e["step_id"]] == [
        call["model_call_id"]
    ]


def test_start_errors(h: Harness) -> None:
    def start(body: dict[str, Any]) -> tuple[int, Any]:
        r = h.client.post("/api/runs", json=body, headers=AUTH)
        return r.status_code, r.json()

    status, body = start({"workflow": "nope"})
    assert (status, body["error"]) == (422, "ConfigurationError")
    status, body = start({"workflow": "summing", "input": {"c": 1}})
    assert (status, body["error"]) == (422, "InvalidInput")
    assert "summing" in body["message"]
    status, body = start({"workflow": "summing", "input": {"a": 1, "run_id": "x"}})
    assert (status, body["error"]) == (422, "InvalidInput")
    assert start({"input": {}})[0] == 422
    assert start({"workflow": "summing", "input": 3})[0] == 422
    nan = h.client.post(
        "/api/runs",
        content=b'{"workflow": "summing", "input": [NaN]}',
        headers={**AUTH, "content-type": "application/json"},
    )
    assert nan.status_code == 400, nan.text
    assert nan.json() == {
        "error": "MalformedJSON",
        "message": "NaN is not JSON: send numbers as finite decimals",
    }
    assert start({"workflow": "summing", "input": [1], "run_id": "c-1"})[0] == 201
    status, body = start({"workflow": "summing", "input": [2], "run_id": "c-1"})
    assert (status, body["error"]) == (409, "IdempotencyConflict")
    assert h.client.get("/api/runs").json()[0]["run_id"] == "c-1"
    assert len(h.client.get("/api/runs").json()) == 1


def test_unknown_run_is_404_everywhere(h: Harness) -> None:
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/api/runs/nope", None),
        ("POST", "/api/runs/nope/approvals/approve", {}),
        ("POST", "/api/runs/nope/approvals/reject", {}),
        ("POST", "/api/runs/nope/events", {"name": "go"}),
        ("POST", "/api/runs/nope/effects/charge%231/resolve", {"outcome": "not_executed"}),
        ("POST", "/api/runs/nope/resume", None),
        ("POST", "/api/runs/nope/cancel", None),
        ("POST", "/api/runs/nope/fork", None),
        ("POST", "/api/runs/nope/replay", None),
    ]
    for method, path, body in calls:
        r = h.client.request(method, path, json=body, headers=AUTH)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"] == "RunNotFound"
        assert "nope" in r.json()["message"]


# -- operator actions -----------------------------------------------------------------------


def test_approve_then_continue_and_decide_again_is_409(h: Harness) -> None:
    rid = h.waiting("ordering", "ann", run_id="o-1")
    assert h.status(rid) is RunStatus.WAITING_APPROVAL
    [pending] = h.client.get(f"/api/runs/{rid}").json()["approvals"]
    r = h.client.post(
        f"/api/runs/{rid}/approvals/approve",
        json={"approval_id": pending["approval_id"], "by": "ana", "comment": "ok"},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "approved"
    assert r.json()["decided_by"] == "ana"
    again = h.client.post(f"/api/runs/{rid}/approvals/reject", headers=AUTH)
    assert again.status_code == 409
    h.work()
    assert h.client.get(f"/api/runs/{rid}").json()["result"] == {"customer": "ann"}


def test_reject_without_body(h: Harness) -> None:
    rid = h.waiting("ordering", "bob", run_id="o-2")
    r = h.client.post(f"/api/runs/{rid}/approvals/reject", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "rejected"
    h.work()
    assert h.client.get(f"/api/runs/{rid}").json()["result"] == {"rejected_by": "operator"}


def test_send_event_once_then_finished_run_is_409(h: Harness) -> None:
    rid = h.waiting("waiter", run_id="w-1")
    body = {"name": "go", "payload": {"n": 1}, "event_id": "e-1"}
    r = h.client.post(f"/api/runs/{rid}/events", json=body, headers=AUTH)
    assert r.json() == {"run_id": rid, "name": "go", "event_id": "e-1", "result": "delivered"}
    dup = h.client.post(f"/api/runs/{rid}/events", json={**body, "payload": {"n": 2}}, headers=AUTH)
    assert dup.json()["result"] == "duplicate ignored"
    h.work()
    assert h.client.get(f"/api/runs/{rid}").json()["result"] == {"n": 1}
    late = h.client.post(f"/api/runs/{rid}/events", json={"name": "go"}, headers=AUTH)
    assert late.status_code == 409
    assert late.json()["error"] == "InvalidTransition"
    # A client retrying e-1 after the run finished (its first answer lost) hears success.
    retried = h.client.post(f"/api/runs/{rid}/events", json=body, headers=AUTH)
    assert retried.status_code == 200, retried.text
    assert retried.json()["result"] == "duplicate ignored"


def test_resolve_unknown_effect(h: Harness) -> None:
    rid = h.waiting("billing", 5, run_id="b-1")
    doc = h.client.get(f"/api/runs/{rid}").json()
    assert doc["status"] == "paused"
    assert [(e["step_id"], e["status"]) for e in doc["effects"]] == [("charge#1", "unknown")]
    path = f"/api/runs/{rid}/effects/charge%231/resolve"
    bad = h.client.post(path, json={"outcome": "failed", "result": {"x": 1}}, headers=AUTH)
    assert bad.status_code == 422
    assert h.client.post(path, json={"outcome": "maybe"}, headers=AUTH).status_code == 422
    wrong_step = h.client.post(
        f"/api/runs/{rid}/effects/add%231/resolve", json={"outcome": "failed"}, headers=AUTH
    )
    assert wrong_step.status_code == 409
    assert h.status(rid) is RunStatus.PAUSED
    r = h.client.post(
        path, json={"outcome": "succeeded", "result": {"paid": 5}, "by": "ops"}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "queued"
    assert h.client.post(path, json={"outcome": "failed"}, headers=AUTH).status_code == 409
    h.work()
    assert h.client.get(f"/api/runs/{rid}").json()["result"] == {"paid": 5}


def test_resume_and_cancel(h: Harness) -> None:
    rid = h.waiting("billing", 5, run_id="b-2")
    r = h.client.post(f"/api/runs/{rid}/resume", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "paused"  # still unknown: it needs a person

    wid = h.waiting("waiter", run_id="w-2")
    # A run waiting for an event goes on when the event comes: resume says so, not "done".
    before = h.client.get(f"/api/runs/{wid}").json()
    waiting = h.client.post(f"/api/runs/{wid}/resume", headers=AUTH)
    assert waiting.status_code == 409, waiting.text
    assert "waiting_external" in waiting.json()["message"]
    assert "send it" in waiting.json()["message"]
    assert h.client.get(f"/api/runs/{wid}").json() == before
    c = h.client.post(f"/api/runs/{wid}/cancel", json={"compensate": False}, headers=AUTH)
    assert c.status_code == 200, c.text
    assert c.json()["status"] == "cancelled"
    again = h.client.post(f"/api/runs/{wid}/cancel", headers=AUTH)
    assert again.status_code == 409
    resumed = h.client.post(f"/api/runs/{wid}/resume", headers=AUTH)
    assert resumed.status_code == 409
    assert resumed.json()["error"] == "InvalidTransition"


def test_pause_and_unpause(h: Harness) -> None:
    wid = h.waiting("waiter", run_id="w-3")
    waiting_for = h.client.get(f"/api/runs/{wid}").json()["waiting_for"]
    p = h.client.post(f"/api/runs/{wid}/pause", json={"reason": "audit", "by": "ana"}, headers=AUTH)
    assert p.status_code == 200, p.text
    paused = p.json()
    assert (paused["status"], paused["status_reason"]) == ("paused", "operator_pause")
    assert paused["pause_requested"]
    assert paused["error"]["message"] == "paused by ana: audit"
    assert paused["waiting_for"] == waiting_for
    again = h.client.post(f"/api/runs/{wid}/pause", headers=AUTH)
    assert (again.status_code, again.json()) == (200, paused)
    detail = h.client.get(f"/api/runs/{wid}").json()
    assert detail["pause_requested"]
    assert [e["type"] for e in detail["events"]][-1] == "run_paused"

    u = h.client.post(f"/api/runs/{wid}/unpause", json={"by": "ana"}, headers=AUTH)
    assert u.status_code == 200, u.text
    assert (u.json()["status"], u.json()["pause_requested"]) == ("queued", False)
    h.work()
    assert h.status(wid) is RunStatus.WAITING_EXTERNAL  # the same wait again

    refused = [
        ("/api/runs/nope/pause", None, 404),
        ("/api/runs/nope/unpause", None, 404),
        (f"/api/runs/{wid}/unpause", None, 409),  # not paused
        (f"/api/runs/{wid}/pause", {"reason": 7}, 422),
        (f"/api/runs/{wid}/pause", {"reason": "x" * 10_001}, 422),
        (f"/api/runs/{wid}/pause", {"by": ""}, 422),
        (f"/api/runs/{wid}/pause", {"by": "a\u0000b"}, 422),
        (f"/api/runs/{wid}/pause", {"typo": 1}, 422),
        (f"/api/runs/{wid}/unpause", {"reason": "no such field"}, 422),
    ]
    for url, body, status in refused:
        r = h.client.post(url, json=body, headers=AUTH)
        assert r.status_code == status, (url, body, r.text)
        assert r.json()["message"]
    assert h.status(wid) is RunStatus.WAITING_EXTERNAL
    h.client.post(f"/api/runs/{wid}/cancel", headers=AUTH)
    final = h.client.post(f"/api/runs/{wid}/pause", headers=AUTH)
    assert (final.status_code, final.json()["error"]) == (409, "InvalidTransition")


def test_fork(h: Harness) -> None:
    rid = h.waiting("summing", 2, run_id="s-9")
    r = h.client.post(
        f"/api/runs/{rid}/fork", json={"replay": "RECORDED", "run_id": "f-9"}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    assert (r.json()["run_id"], r.json()["status"]) == ("f-9", "queued")
    h.work()
    assert h.client.get("/api/runs/f-9").json()["result"] == 2
    bad = [
        ({"replay": "SOMETIMES"}, 422),
        ({"at": "nope#1"}, 422),
        ({"run_id": "f-9"}, 409),  # another fork (its mode) under f-9's id
        ({"typo": 1}, 422),
    ]
    for body, status in bad:
        refused = h.client.post(f"/api/runs/{rid}/fork", json=body, headers=AUTH)
        assert refused.status_code == status, (body, refused.text)
        assert refused.json()["message"]


def test_replay(h: Harness) -> None:
    rid = h.waiting("summing", 2, run_id="s-r")
    h.work()
    r = h.client.post(f"/api/runs/{rid}/replay", json={"mode": "RECORDED"}, headers=AUTH)
    assert r.status_code == 200, r.text
    report = r.json()
    assert (report["reproduced"], report["divergence"], report["status"]) == (
        True,
        None,
        "completed",
    )
    assert report["result"] == report["recorded_result"] == 2
    refused = h.client.post(f"/api/runs/{rid}/replay", json={"mode": "SANDBOX"}, headers=AUTH)
    assert refused.status_code == 422, refused.text
    assert "supported mode is recorded" in refused.json()["message"]


# -- auth -------------------------------------------------------------------------------------

MUTATING: list[tuple[str, dict[str, Any] | None]] = [
    ("/api/runs", {"workflow": "summing", "input": [1], "run_id": "new"}),
    ("/api/runs/{rid}/approvals/approve", {}),
    ("/api/runs/{rid}/approvals/reject", {}),
    ("/api/runs/{rid}/events", {"name": "go", "event_id": "e-x"}),
    ("/api/runs/{rid}/effects/charge%231/resolve", {"outcome": "not_executed"}),
    ("/api/runs/{rid}/resume", None),
    ("/api/runs/{rid}/cancel", None),
    ("/api/runs/{rid}/fork", {"run_id": "fork-auth"}),
    ("/api/runs/{rid}/replay", None),
    ("/api/runs/{rid}/pause", {"reason": "audit"}),
    ("/api/runs/{rid}/unpause", None),
]


@pytest.mark.parametrize(("path", "body"), MUTATING, ids=[p for p, _ in MUTATING])
def test_every_mutating_endpoint_needs_the_token(
    h: Harness, path: str, body: dict[str, Any] | None
) -> None:
    rid = h.waiting("waiter", run_id="w-auth")
    url = path.format(rid=rid)
    before = (h.events(rid), h.status(rid), len(h.client.get("/api/runs").json()))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = h.client.post(url, json=body, headers=headers)
        assert r.status_code == 401, (url, headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    assert (h.events(rid), h.status(rid), len(h.client.get("/api/runs").json())) == before
    with_token = h.client.post(url, json=body, headers=AUTH)
    assert with_token.status_code != 401
    assert with_token.status_code < 500


def test_reads_need_no_token(h: Harness) -> None:
    rid = h.waiting("waiter", run_id="w-read")
    assert h.client.get("/api/runs").status_code == 200
    assert h.client.get(f"/api/runs/{rid}").status_code == 200


def test_without_a_configured_token_local_callers_are_trusted(tmp_path: Path) -> None:
    for h in serve(tmp_path, api_token=None):
        r = h.client.post("/api/runs", json={"workflow": "summing", "input": [1]})
        assert r.status_code == 201


def test_cross_site_requests_are_refused_even_without_a_token(tmp_path: Path) -> None:
    """A page elsewhere cannot make the operator's browser start or cancel runs."""
    for h in serve(tmp_path, api_token=None):
        foreign = h.client.post(
            "/api/runs",
            json={"workflow": "summing", "input": [1]},
            headers={"origin": "https://evil.example"},
        )
        assert foreign.status_code == 403
        simple = h.client.post(
            "/api/runs",
            content=b'{"workflow": "summing", "input": [1]}',
            headers={"content-type": "text/plain"},
        )
        assert simple.status_code == 415
        assert h.client.get("/api/runs").json() == []


# -- fuzzing ----------------------------------------------------------------------------------


def test_openapi_is_precise(h: Harness) -> None:
    doc = h.client.get("/openapi.json").json()
    paths = doc["paths"]
    assert set(paths) >= {
        "/api/runs",
        "/api/runs/{run_id}",
        "/api/runs/{run_id}/approvals/approve",
        "/api/runs/{run_id}/approvals/reject",
        "/api/runs/{run_id}/events",
        "/api/runs/{run_id}/effects/{step_id}/resolve",
        "/api/runs/{run_id}/resume",
        "/api/runs/{run_id}/cancel",
        "/api/health",
        "/metrics",
        "/webhooks/events",
    }
    ok = paths["/api/runs/{run_id}"]["get"]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/RunDetail"}
    status = doc["components"]["schemas"]["RunStatus"]
    assert set(status["enum"]) == {s.value for s in RunStatus}


def test_fuzzed_requests_never_get_a_server_error(h: Harness) -> None:
    import schemathesis
    from hypothesis import HealthCheck, settings
    from schemathesis.core import NOT_SET
    from schemathesis.core.result import Ok

    h.waiting("waiter", run_id="w-fuzz")
    schema = schemathesis.openapi.from_dict(h.client.get("/openapi.json").json())
    failures: list[str] = []
    sent: list[int] = []

    for operation in schema.get_all_operations():
        assert isinstance(operation, Ok), operation
        op = operation.ok()
        strategy = op.as_strategy()

        @settings(
            max_examples=8,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            kwargs: dict[str, Any] = {
                "params": case.query or None,
                "headers": {**AUTH, **{k: str(v) for k, v in (case.headers or {}).items()}},
            }
            if case.body is not NOT_SET:
                kwargs["json"] = case.body
            r = h.client.request(case.method, case.formatted_path, **kwargs)
            sent.append(r.status_code)
            if r.status_code >= 500 and r.status_code != 503:
                failures.append(f"{case.method} {case.formatted_path} {case.body!r}: {r.text}")

        from hypothesis import given

        given(strategy)(check)()
    assert not failures, "\n".join(failures[:5])
    assert len(sent) >= 30
    assert any(200 <= s < 300 for s in sent)


# -- durably serve ----------------------------------------------------------------------------


def test_serve_refuses_a_public_host_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from durably.cli import cli

    monkeypatch.delenv("DURABLY_API_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["--app", "no_such_module:app", "serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "without an API token" in result.output
    assert "127.0.0.1 only" in result.output


def test_metrics_show_unsettled_unknown_effects(tmp_path: Path) -> None:
    """The unknown-effect gauges are read from the store at scrape time."""
    app = durably.App(f"sqlite:///{tmp_path}/m.db")

    @app.tool()
    def charge() -> None:
        raise TimeoutError

    @app.workflow()
    async def pay() -> None:
        await charge()

    try:
        assert app.run(pay).status is durably.RunStatus.PAUSED
        with TestClient(create_server(app), base_url="http://127.0.0.1") as client:
            text = client.get("/metrics").text
        assert 'agent_tool_unknown_unresolved{tool="charge"} 1.0' in text
        assert 'agent_tool_unknown_oldest_seconds{tool="charge"}' in text
    finally:
        app.close()
