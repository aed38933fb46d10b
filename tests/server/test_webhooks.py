"""Signed webhook intake (Standard Webhooks) over a real App and SQLite file."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durably import RunStatus
from durably.server.webhooks import MAX_BODY_BYTES, sign
from tests.server.test_api import WEBHOOK_SECRETS, Harness, serve

URL = "/webhooks/events"


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    yield from serve(tmp_path)


def post(
    h: Harness,
    body: bytes | dict[str, Any],
    *,
    webhook_id: str = "msg_1",
    secret: str = WEBHOOK_SECRETS[0],
    timestamp: int | None = None,
    signature: str | None = None,
) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    ts = str(int(time.time()) if timestamp is None else timestamp)
    headers = {
        "webhook-id": webhook_id,
        "webhook-timestamp": ts,
        "webhook-signature": signature or sign(secret, webhook_id, ts, raw),
        "content-type": "application/json",
    }
    return h.client.post(URL, content=raw, headers=headers)


def event(run_id: str, payload: Any = None) -> dict[str, Any]:
    return {"run_id": run_id, "name": "go", "payload": payload}


def test_signed_event_is_delivered_and_the_run_continues(h: Harness) -> None:
    rid = h.waiting("waiter", run_id="w-1")
    r = post(h, event(rid, {"order": 7}))
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "delivered", "run_id": rid, "name": "go", "event_id": "msg_1"}
    h.work()
    run = h.driver.get_run(rid)
    assert run.status is RunStatus.COMPLETED
    assert run.result == {"order": 7}


def test_redelivery_of_the_same_webhook_id_is_ignored(h: Harness) -> None:
    rid = h.waiting("waiter", run_id="w-2")
    assert post(h, event(rid, {"n": 1})).json()["status"] == "delivered"
    before = h.events(rid)
    # A retry is signed again with a fresh timestamp, same id.
    again = post(h, event(rid, {"n": 2}), timestamp=int(time.time()) + 1)
    assert again.status_code == 200
    assert again.json()["status"] == "duplicate ignored"
    assert h.events(rid) == before
    h.work()
    assert h.driver.get_run(rid).result == {"n": 1}
    # The sender retries once more after the run finished: still no failure to report.
    late = post(h, event(rid, {"n": 1}), timestamp=int(time.time()) + 2)
    assert late.status_code == 200, late.text
    assert late.json()["status"] == "duplicate ignored"


def test_rotated_secrets_any_configured_one_is_accepted(h: Harness) -> None:
    rid = h.waiting("waiter", run_id="w-3")
    r = post(h, event(rid, "second"), secret=WEBHOOK_SECRETS[1])
    assert r.status_code == 200, r.text
    # Several signatures in the header (the sender mid-rotation): one matching is enough.
    raw = json.dumps(event(rid)).encode()
    ts = str(int(time.time()))
    header = f"v1,{'A' * 44} {sign(WEBHOOK_SECRETS[0], 'msg_x', ts, raw)}"
    assert post(h, raw, webhook_id="msg_x", timestamp=int(ts), signature=header).status_code == 200


def assert_refused(h: Harness, rid: str, response: Any, status: int, text: str) -> None:
    assert response.status_code == status, response.text
    assert text in response.json()["message"]


@pytest.mark.parametrize(
    ("case", "status", "text"),
    [
        ("wrong secret", 401, "does not match"),
        ("tampered body", 401, "does not match"),
        ("unsigned", 401, "missing"),
        ("v2 scheme only", 401, "does not match"),
        ("stale", 401, "outside"),
        ("future", 401, "in the future"),
        ("timestamp not a number", 401, "unix seconds"),
        ("oversized", 413, "over"),
        ("not json", 400, "not valid JSON"),
        ("not an object", 400, "JSON object"),
        ("missing name", 400, '"name"'),
        ("run id not a string", 400, '"run_id"'),
    ],
)
def test_bad_requests_change_nothing(h: Harness, case: str, status: int, text: str) -> None:
    rid = h.waiting("waiter", run_id="w-bad")
    before = (h.events(rid), h.driver.describe(rid))
    now = int(time.time())
    good = json.dumps(event(rid)).encode()
    if case == "wrong secret":
        r = post(h, good, secret="whsec_" + "b3RoZXI=")
    elif case == "tampered body":
        sig = sign(WEBHOOK_SECRETS[0], "msg_1", str(now), good)
        r = post(h, json.dumps(event(rid, "evil")).encode(), timestamp=now, signature=sig)
    elif case == "unsigned":
        r = h.client.post(URL, content=good, headers={"content-type": "application/json"})
    elif case == "v2 scheme only":
        sig = sign(WEBHOOK_SECRETS[0], "msg_1", str(now), good).replace("v1,", "v2,")
        r = post(h, good, timestamp=now, signature=sig)
    elif case == "stale":
        # A minute past the tolerance: `now` was truncated, and a loaded machine may take
        # seconds to answer; one second past it failed when the request waited that long.
        r = post(h, good, timestamp=now - 360)
    elif case == "future":
        r = post(h, good, timestamp=now + 360)
    elif case == "timestamp not a number":
        r = h.client.post(
            URL,
            content=good,
            headers={"webhook-id": "m", "webhook-timestamp": "soon", "webhook-signature": "v1,x"},
        )
    elif case == "oversized":
        r = post(h, json.dumps(event(rid, "x" * MAX_BODY_BYTES)).encode())
    elif case == "not json":
        r = post(h, b"{not json")
    elif case == "not an object":
        r = post(h, b"[1, 2]")
    elif case == "missing name":
        r = post(h, {"run_id": rid, "payload": 1})
    else:
        r = post(h, {"run_id": 5, "name": "go"})
    assert_refused(h, rid, r, status, text)
    assert (h.events(rid), h.driver.describe(rid)) == before
    h.work()
    assert h.status(rid) is RunStatus.WAITING_EXTERNAL


def test_stale_signature_is_refused_even_when_valid(h: Harness) -> None:
    rid = h.waiting("waiter", run_id="w-old")
    r = post(h, event(rid), timestamp=int(time.time()) - 600)
    assert r.status_code == 401
    assert "600s old" in r.json()["message"] or "old" in r.json()["message"]


def test_unknown_and_finished_runs(h: Harness) -> None:
    assert post(h, event("nope")).status_code == 404
    rid = h.waiting("waiter", run_id="w-done")
    assert post(h, event(rid, 1), webhook_id="m1").status_code == 200
    h.work()
    before = h.events(rid)
    r = post(h, event(rid, 2), webhook_id="m2")
    assert r.status_code == 409
    assert r.json()["error"] == "InvalidTransition"
    assert h.events(rid) == before


def test_without_secrets_webhooks_are_refused(tmp_path: Path) -> None:
    for h in serve(tmp_path, secrets=()):
        rid = h.waiting("waiter", run_id="w-off")
        before = h.events(rid)
        r = post(h, event(rid))
        assert r.status_code == 503
        assert "webhooks not configured" in r.json()["message"]
        assert h.events(rid) == before


def test_an_absurd_timestamp_is_a_clean_401(h: Harness) -> None:
    raw = json.dumps(event("r")).encode()
    headers = {
        "webhook-id": "msg_big",
        "webhook-timestamp": "9" * 5000,
        "webhook-signature": "v1,AAAA",
        "content-type": "application/json",
    }
    assert h.client.post(URL, content=raw, headers=headers).status_code == 401
