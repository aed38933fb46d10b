"""The console against a hostile network: a real ``durably serve`` subprocess, raw HTTP.

DNS rebinding (Host allow-list), security headers, reads behind the token, refusals before
the body is read, slow clients cut off, webhook secrets checked at startup, strict bodies,
URL-encoded links, and old rows too deep for any serializer. (Items 8 to 13 of issue 12.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from durably.errors import DurablyError, StoreError
from tests.server.served import (
    APP,
    AUTH,
    TOKEN,
    WEBHOOK_SECRET,
    Reply,
    Served,
    clone_run,
    fingerprint,
    prepare,
    write_sql,
)

Start = Callable[..., Served]

# One request per route family: (method, path, JSON body or None).
EVERY_ROUTE: list[tuple[str, str, object]] = [
    ("GET", "/", None),
    ("GET", "/runs/o-1", None),
    ("GET", "/ui/static/console.js", None),
    ("GET", "/api/health", None),
    ("GET", "/api/runs", None),
    ("GET", "/api/runs/o-1", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("POST", "/api/runs", {"workflow": "summing", "input": [1], "run_id": "s-new"}),
    ("POST", "/api/runs/o-1/approvals/approve", {}),
    ("POST", "/api/runs/o-1/approvals/reject", {}),
    ("POST", "/api/runs/w-1/events", {"name": "go", "event_id": "e-1"}),
    ("POST", "/api/runs/b-1/effects/charge%231/resolve", {"outcome": "not_executed"}),
    ("POST", "/api/runs/b-1/resume", {}),
    ("POST", "/api/runs/w-1/cancel", {"compensate": False}),
    ("POST", "/webhooks/events", {"run_id": "w-1", "name": "go"}),
]


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/durably.db"


def statuses(served: Served) -> dict[str, str]:
    return {r["run_id"]: r["status"] for r in served.request("GET", "/api/runs", None, AUTH).json()}


# -- 8. DNS rebinding ------------------------------------------------------------------------


def test_a_foreign_host_is_refused_on_every_route_and_changes_nothing(
    database_url: str, start: Start
) -> None:
    """A page on rebind.test whose name now resolves to 127.0.0.1 is same-origin with the
    console in the browser's eyes: its requests carry Host and Origin rebind.test. A console
    without a token used to approve for it."""
    prepare(database_url)
    served = start(database_url, DURABLY_API_TOKEN=None)
    assert served.request("GET", "/api/health").status == 200
    before = fingerprint(database_url)
    for host in ("rebind.test", f"rebind.test:{served.port}", "127.0.0.1.rebind.test"):
        for method, path, body in EVERY_ROUTE:
            r = served.request(method, path, body, {"Origin": f"http://{host}"}, host=host)
            assert r.status == 400, (host, method, path, r.text)
            assert r.json()["error"] == "HostNotAllowed"
            assert "--allowed-host" in r.json()["message"]
    assert fingerprint(database_url) == before
    # The same approval under the console's own name goes through: the refusal was the Host.
    ok = served.request(
        "POST",
        "/api/runs/o-1/approvals/approve",
        {},
        {"Origin": f"http://127.0.0.1:{served.port}"},
    )
    assert ok.status == 200, ok.text
    assert fingerprint(database_url) != before


def test_allowed_host_names_are_configured_by_option_and_environment(
    tmp_path: Path, start: Start
) -> None:
    url = sqlite_url(tmp_path)
    served = start(
        url,
        "--allowed-host",
        "console.example",
        "--allowed-host",
        "Ops.Example.",
        DURABLY_ALLOWED_HOSTS="env.example, other.example",
    )
    port = served.port
    for host in (
        "console.example",
        f"console.example:{port}",
        "ops.example",
        "env.example",
        "other.example",
        "localhost",
        f"127.0.0.1:{port}",
        f"[::1]:{port}",
    ):
        assert served.request("GET", "/api/health", host=host).status == 200, host
    for host in ("rebind.test", "console.example.evil", "[::2]", ""):
        assert served.request("GET", "/api/health", host=host).status == 400, host
    assert "answering to Host 127.0.0.1, ::1, console.example" in served.output()


# -- 9. headers ------------------------------------------------------------------------------


def assert_security_headers(reply: Reply, what: str) -> None:
    csp = reply.headers.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in csp, what
    assert "script-src 'self'" in csp, what
    assert "unsafe-inline" not in csp, what
    assert reply.headers.get("x-frame-options") == "DENY", what
    assert reply.headers.get("x-content-type-options") == "nosniff", what
    assert reply.headers.get("referrer-policy") == "no-referrer", what


def test_every_response_carries_the_security_headers(tmp_path: Path, start: Start) -> None:
    url = sqlite_url(tmp_path)
    prepare(url)
    served = start(url, "--max-body-bytes", "1000")
    replies = {
        "401 page": served.request("GET", "/"),
        "401 api": served.request("GET", "/api/runs"),
        "runs page": served.request("GET", "/", headers=AUTH),
        "run page": served.request("GET", "/runs/o-1", headers=AUTH),
        "error page": served.request("GET", "/runs/nope", headers=AUTH),
        "json": served.request("GET", "/api/runs/o-1", headers=AUTH),
        "404": served.request("GET", "/nope", headers=AUTH),
        "422": served.request("POST", "/api/runs", {"workflow": 1}, AUTH),
        "413": served.request("POST", "/api/runs", b"x" * 2000, AUTH),
        "400 host": served.request("GET", "/api/health", host="rebind.test"),
        "static": served.request("GET", "/ui/static/console.js"),
        "metrics": served.request("GET", "/metrics", headers=AUTH),
        "openapi": served.request("GET", "/openapi.json"),
        "webhook 401": served.request("POST", "/webhooks/events", {"run_id": "w-1"}),
    }
    assert replies["401 page"].status == 401
    assert replies["runs page"].status == 200
    assert replies["413"].status == 413
    for what, reply in replies.items():
        assert_security_headers(reply, what)
    for what in ("401 page", "runs page", "run page", "error page"):
        html = replies[what].text
        # The CSP allows no inline script: none may be needed.
        assert not re.search(r"<script(?![^>]*\bsrc=)", html), what
        assert not re.search(r"\son[a-z]+\s*=", html), what


def test_head_is_answered_like_get_without_a_body(tmp_path: Path, start: Start) -> None:
    """Uptime checks and proxies probe with HEAD: each readable route answers it as GET
    does (status, type, headers, the token required), with no body."""
    url = sqlite_url(tmp_path)
    prepare(url)
    served = start(url)
    for path in ("/", "/runs/o-1", "/api/health", "/api/runs", "/metrics", "/ui/static/console.js"):
        got = served.request("GET", path, headers=AUTH)
        head = served.request("HEAD", path, headers=AUTH)
        assert (head.status, head.body) == (200, b""), (path, head)
        assert head.headers["content-type"] == got.headers["content-type"], path
        assert_security_headers(head, path)
    refused = served.request("HEAD", "/api/runs")
    assert (refused.status, refused.body) == (401, b"")
    assert served.request("HEAD", "/api/runs/o-1/cancel", headers=AUTH).status == 405


def test_docs_pages_that_load_cdn_scripts_are_off(tmp_path: Path, start: Start) -> None:
    served = start(sqlite_url(tmp_path), DURABLY_API_TOKEN=None)
    assert served.request("GET", "/docs").status == 404
    assert served.request("GET", "/redoc").status == 404
    spec = served.request("GET", "/openapi.json")
    assert spec.status == 200
    assert "/api/runs/{run_id}/approvals/approve" in spec.json()["paths"]
    assert "cdn." not in served.request("GET", "/").text


# -- 10. reads -------------------------------------------------------------------------------


def test_with_a_token_reads_need_it_too(tmp_path: Path, start: Start) -> None:
    url = sqlite_url(tmp_path)
    prepare(url)
    served = start(url)
    for path in ("/api/runs", "/api/runs/o-1", "/metrics", "/api/runs?status=paused"):
        r = served.request("GET", path)
        assert r.status == 401, path
        assert r.json()["error"] == "Unauthorized"
        assert "Bearer" in r.json()["message"]
        assert served.request("GET", path, headers={"Authorization": "Bearer nope"}).status == 401
        assert served.request("GET", path, headers=AUTH).status == 200, path
    page = served.request("GET", "/runs/o-1")
    assert page.status == 401
    assert "API token needed" in page.text
    assert 'id="api-token"' in page.text
    assert "o-1" not in page.text.replace("/runs/o-1", "")
    assert served.request("GET", "/api/health").status == 200  # liveness stays open
    assert served.request("GET", "/ui/static/console.css").status == 200
    # Page loads carry the token in the cookie the header field sets: good for reads only.
    cookie = {"Cookie": f"durably_token={TOKEN}"}
    shown = served.request("GET", "/", headers=cookie)
    assert shown.status == 200
    assert "token: read+write" in shown.text
    assert "o-1" in shown.text
    assert (
        served.request("GET", "/api/runs", headers={"Cookie": "durably_token=wrong"}).status == 401
    )
    before = fingerprint(url)
    approve = served.request("POST", "/api/runs/o-1/approvals/approve", {}, cookie)
    assert approve.status == 401
    assert fingerprint(url) == before


def test_public_read_opens_reads_but_not_writes(tmp_path: Path, start: Start) -> None:
    url = sqlite_url(tmp_path)
    prepare(url)
    served = start(url, "--public-read")
    assert served.request("GET", "/api/runs").status == 200
    assert served.request("GET", "/api/runs/o-1").json()["status"] == "waiting_approval"
    page = served.request("GET", "/")
    assert page.status == 200
    assert "token: write · read open" in page.text
    assert served.request("POST", "/api/runs/o-1/approvals/approve", {}).status == 401
    assert served.request("POST", "/api/runs/o-1/approvals/approve", {}, AUTH).status == 200


def test_without_a_token_loopback_reads_stay_open(tmp_path: Path, start: Start) -> None:
    url = sqlite_url(tmp_path)
    prepare(url)
    served = start(url, DURABLY_API_TOKEN=None)
    assert served.request("GET", "/api/runs/o-1").status == 200
    page = served.request("GET", "/")
    assert "no token: local callers read and write" in page.text
    assert 'id="api-token"' not in page.text


# -- 11. before the body ---------------------------------------------------------------------


def exchange(port: int, data: bytes, *, timeout: float = 5) -> tuple[int, bytes, float]:
    """Send ``data`` (maybe an unfinished request), then read one reply: status, body and
    seconds until it came. Fails if the server does not answer within ``timeout``."""
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        try:
            while True:
                head, sep, body = received.partition(b"\r\n\r\n")
                if sep:
                    length = re.search(rb"(?i)content-length: *(\d+)", head)
                    if length and len(body) >= int(length.group(1)):
                        break
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        except TimeoutError:
            raise AssertionError(f"no answer within {timeout}s (got {received!r})") from None
    status = int(received.split(b" ", 2)[1])
    return status, received.partition(b"\r\n\r\n")[2], time.monotonic() - began


def head(port: int, path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", *headers, "", ""]
    return "\r\n".join(lines).encode()


def test_requests_are_refused_before_their_body_is_read(tmp_path: Path, start: Start) -> None:
    """A client announcing 150 MB is answered at once, without the server waiting for (or
    buffering) a byte of it: the body is never sent here, and :func:`exchange` fails unless
    the answer comes first."""
    url = sqlite_url(tmp_path)
    served = start(url, "--max-body-bytes", "1000")
    port = served.port
    json_type = "Content-Type: application/json"
    status, body, _ = exchange(
        port, head(port, "/api/runs", json_type, "Content-Length: 150000000")
    )
    assert (status, json.loads(body)["error"]) == (401, "Unauthorized")
    status, body, _ = exchange(
        port,
        head(
            port,
            "/api/runs",
            json_type,
            "Content-Length: 150000000",
            f"Authorization: Bearer {TOKEN}",
        ),
    )
    assert status == 413
    assert "over 1000 bytes" in json.loads(body)["message"]
    # A signed webhook is checked as far as its headers go before its body is read.
    status, body, _ = exchange(
        port, head(port, "/webhooks/events", json_type, "Content-Length: 900")
    )
    assert status == 401
    assert "webhook-signature" in json.loads(body)["message"]
    # Without Content-Length (chunked), the body is cut off at the limit.
    chunk = b'{"workflow": "summing", "input": ["' + b"x" * 1200 + b'"]}'
    status, body, _ = exchange(
        port,
        head(
            port,
            "/api/runs",
            json_type,
            "Transfer-Encoding: chunked",
            f"Authorization: Bearer {TOKEN}",
        )
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk),
    )
    assert status == 413, body
    assert json.loads(body)["error"] == "PayloadTooLarge"
    assert served.request("GET", "/api/health").status == 200
    assert served.request("GET", "/api/runs", headers=AUTH).json() == []


def test_slow_clients_are_cut_off_and_others_still_served(tmp_path: Path, start: Start) -> None:
    """Slowloris: connections that never finish their headers are closed after the read
    timeout; a body that never arrives is answered 408; the server answers others meanwhile."""
    served = start(sqlite_url(tmp_path), "--read-timeout", "1", DURABLY_API_TOKEN=None)
    idle: list[socket.socket] = []
    try:
        began = time.monotonic()
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=5)
            sock.sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            idle.append(sock)
        assert served.request("GET", "/api/health", timeout=2).status == 200
        for sock in idle:
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - began < 4
    finally:
        for sock in idle:
            sock.close()
    status, body, took = exchange(
        served.port,
        head(served.port, "/api/runs", "Content-Type: application/json", "Content-Length: 100")
        + b'{"workflow"',
    )
    assert status == 408
    assert "did not arrive within 1s" in json.loads(body)["message"]
    assert took < 4


# -- 13. webhook secrets, strict bodies, links --------------------------------------------------


@pytest.mark.parametrize(
    ("secret", "says"),
    [
        ("whsec_", "0-byte key"),
        ("whsec_c2hvcnQta2V5", "9-byte key"),
        ("whsec_not base64!", "not base64"),
        ("a-plain-23-byte-secret!", "23-byte key"),
    ],
)
def test_weak_webhook_secrets_are_refused_at_startup(
    tmp_path: Path, secret: str, says: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    env["DURABLY_WEBHOOK_SECRETS"] = f"{WEBHOOK_SECRET},{secret}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "durably",
            "--app",
            "tests.server.consoleapp:app",
            "--db",
            sqlite_url(tmp_path),
            "serve",
            "--port",
            "0",
        ],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(
            f"durably serve started with webhook secret {secret!r}:\n{output}"
        ) from None
    assert process.returncode != 0
    assert "error: webhook secret #2 in $DURABLY_WEBHOOK_SECRETS" in output
    assert says in output
    assert "Traceback" not in output


def test_mutating_bodies_are_strict(database_url: str, start: Start) -> None:
    prepare(database_url)
    served = start(database_url)
    before = fingerprint(database_url)
    refused = [
        ("/api/runs/w-1/cancel", {"compensate": "yes"}, "body.compensate"),
        ("/api/runs/w-1/cancel", {"compensate": 1}, "body.compensate"),
        ("/api/runs/w-1/cancel", {"compensate": True, "force": True}, "body.force"),
        ("/api/runs/o-1/approvals/approve", {"by": 7}, "body.by"),
        ("/api/runs/w-1/events", {"name": "go", "event_id": 5}, "body.event_id"),
        ("/api/runs", {"workflow": "summing", "input": [1], "run_id": 12}, "body.run_id"),
        ("/api/runs/b-1/resume", {"now": True}, "body.now"),
    ]
    for path, body, says in refused:
        r = served.request("POST", path, body, AUTH)
        assert r.status == 422, (path, body, r.text)
        assert r.json()["error"] == "ValidationError"
        assert says in r.json()["message"]
    assert fingerprint(database_url) == before
    ok = served.request("POST", "/api/runs/w-1/cancel", {"compensate": False}, AUTH)
    assert ok.json()["status"] == "cancelled"


def test_links_keep_odd_run_ids_whole(database_url: str, start: Start) -> None:
    """A run id with ``?`` or ``/`` (an old row) opens its own page, never another run's."""
    prepare(database_url)
    clone_run(database_url, "w-1", "o-1?x=1")
    clone_run(database_url, "w-1", "o-1/approvals")
    clone_run(database_url, "w-1", "#frag")
    served = start(database_url, DURABLY_API_TOKEN=None)
    listing = served.request("GET", "/").text
    for run_id in ("o-1?x=1", "o-1/approvals", "#frag"):
        hrefs = re.findall(r'href="(/runs/[^"]*)"[^>]*>' + re.escape(run_id) + "<", listing)
        assert len(hrefs) == 1, (run_id, hrefs)
        assert "?" not in hrefs[0]
        assert "#" not in hrefs[0]
        assert hrefs[0].count("/") == 2
        page = served.request("GET", hrefs[0])
        assert page.status == 200, (run_id, page.text)
        title = re.search(r'<h1 class="mono">(.*?)</h1>', page.text)
        assert title is not None
        assert title.group(1) == run_id


def test_runs_stored_too_deep_do_not_break_reading(database_url: str, start: Start) -> None:
    """Rows written before the nesting limit: every serializer recurses, so one deep value
    used to turn GET /api/runs into a 500 for everyone."""
    prepare(database_url)
    deep = "[" * 300 + "]" * 300
    write_sql(
        database_url,
        "UPDATE durably_runs SET input_json = ?, waiting_for_json = ? WHERE run_id = ?",
        (
            json.dumps({"args": [json.loads(deep)], "kwargs": {}}),
            json.dumps({"x": json.loads(deep)}),
            "w-1",
        ),
    )
    write_sql(
        database_url,
        "UPDATE durably_events SET payload_json = ? WHERE run_id = ?",
        (json.dumps({"deep": json.loads(deep)}), "w-1"),
    )
    served = start(database_url, DURABLY_API_TOKEN=None)
    listed = served.request("GET", "/api/runs")
    assert listed.status == 200, listed.text
    assert {r["run_id"] for r in listed.json()} == {"o-1", "w-1", "b-1"}
    shown = served.request("GET", "/api/runs/w-1")
    assert shown.status == 200, shown.text
    assert "nested deeper than 64 levels" in shown.text
    for page in ("/", "/runs/w-1"):
        assert served.request("GET", page).status == 200, page


# -- 12. errors --------------------------------------------------------------------------------


def test_unstorable_text_in_a_path_or_filter_is_a_4xx_without_a_token(
    database_url: str, start: Start
) -> None:
    """PostgreSQL refuses a NUL in any text parameter: it used to surface as a 500."""
    served = start(database_url, DURABLY_API_TOKEN=None)
    for path in ("/api/runs/a%00b", "/api/runs?workflow=a%00b", "/runs/a%00b", "/?workflow=%00"):
        r = served.request("GET", path)
        assert r.status == 422, (path, r.text)
        assert "control characters" in r.text
    assert "Traceback" not in served.output()


def every_subclass(kind: type[DurablyError]) -> list[type[DurablyError]]:
    return [kind, *(s for sub in kind.__subclasses__() for s in every_subclass(sub))]


def test_every_durably_error_is_a_4xx_but_an_unusable_database() -> None:
    from durably.server.errors import status_of

    for kind in every_subclass(DurablyError):
        status = status_of(kind.__new__(kind))  # only its type matters
        unavailable = issubclass(kind, StoreError)
        assert (status == 503) if unavailable else (400 <= status < 500), kind


def test_a_port_in_use_is_the_commands_own_error(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    prepare(url)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        command = f"--app {APP} --db {url} serve --port {port}".split()
        done = subprocess.run(
            [sys.executable, "-m", "durably", *command],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={k: v for k, v in os.environ.items() if k != "DURABLY_API_TOKEN"},
        )
    assert done.returncode == 1, done.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}: " in done.stderr, done.stderr
    assert "in use" in done.stderr
    assert "Traceback" not in done.stderr
