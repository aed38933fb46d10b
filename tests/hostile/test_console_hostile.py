"""One table of bad inputs against every route of a real ``durably serve`` and its webhook.

Each bad input is sent where a client could put it — a request body as a whole, a string
field, a JSON value field, a path segment, a query filter — to every route that takes one,
on both stores. Every answer must be a 4xx that says what was wrong, and the database must
be byte for byte (SQLite file) or row for row (PostgreSQL schema) what it was before.

One server per store for the whole module; the runs it could change are those of
:func:`tests.server.served.prepare`.
"""

from __future__ import annotations

import html
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import POSTGRES_URL, postgres_schema_url
from tests.server.served import (
    AUTH,
    WEBHOOK_SECRET,
    Reply,
    Served,
    fingerprint,
    prepare,
    serve_cli,
)


@dataclass(frozen=True)
class Bad:
    """A bad input: raw JSON text (``json``) for bodies, or text for a URL (``url``, already
    percent-encoded). ``says``: words one of which a clear refusal contains."""

    name: str
    json: str | None
    url: str | None
    says: tuple[str, ...]
    ids_only: bool = False  # bad only where an id is expected (free text may hold it)


DEEP = {n: "[" * n + "]" * n for n in (300, 990, 10_000)}
BAD = [
    Bad("nan", "NaN", None, ("nan is not json",)),
    Bad("infinity", "-Infinity", None, ("infinity is not json",)),
    Bad("float-overflow", "1e999", None, ("out of range",)),
    Bad("huge-number", "9" * 5000, "9" * 5000, ("digits", "integer", "4300")),
    Bad("deep-300", DEEP[300], None, ("nest",)),
    Bad("deep-990", DEEP[990], None, ("nest",)),
    Bad("deep-10k", DEEP[10_000], None, ("nest",)),
    Bad("surrogate", '"a\\ud800b"', "a%ED%A0%80b", ("surrogate", "no run")),
    Bad("nul", '"a\\u0000b"', "a%00b", ("control character", "nul", "not a valid id")),
    Bad("escape", '"\\u001b[2J\\u001b]52;c;aGk=\\u0007"', "%1B%5B2J", ("control character",)),
    Bad("c1-control", '"a\\u009bb"', "a%C2%9Bb", ("control character", "not a valid id")),
    Bad("path-chars", '"../o-1?x=1#f"', "..%2Fo-1%3Fx%3D1", ("valid id", "no run"), True),
    Bad("overlong", json.dumps("x" * 100_000), "x" * 5000, ("characters", "at most")),
]
# A body over the console's limit (1 MiB) is refused from its Content-Length alone.
HUGE = json.dumps("x" * (1024 * 1024 + 1))


@dataclass(frozen=True)
class Route:
    name: str
    method: str
    path: str  # {run} (and {step}): the run (step) the route acts on
    run: str = ""
    body: dict[str, Any] | None = None
    text_fields: tuple[str, ...] = ()  # strings: ids, names, free text
    value_field: str | None = None  # any JSON value
    webhook: bool = False


ROUTES = [
    Route("list", "GET", "/api/runs?workflow={q}"),
    Route("list-limit", "GET", "/api/runs?limit={q}"),
    Route("show", "GET", "/api/runs/{run}", run="o-1"),
    Route("page-list", "GET", "/?workflow={q}"),
    Route("page-run", "GET", "/runs/{run}", run="o-1"),
    Route(
        "start",
        "POST",
        "/api/runs",
        body={"workflow": "summing", "input": [1], "run_id": "s-new", "tenant": "t-1"},
        text_fields=("workflow", "run_id", "tenant"),
        value_field="input",
    ),
    Route(
        "approve",
        "POST",
        "/api/runs/{run}/approvals/approve",
        run="o-1",
        body={"by": "ann", "comment": "fine"},
        text_fields=("by", "comment", "approval_id"),
    ),
    Route(
        "reject",
        "POST",
        "/api/runs/{run}/approvals/reject",
        run="o-1",
        body={"by": "ann"},
        text_fields=("by", "comment"),
    ),
    Route(
        "event",
        "POST",
        "/api/runs/{run}/events",
        run="w-1",
        body={"name": "go", "event_id": "e-1", "payload": {"n": 1}},
        text_fields=("name", "event_id"),
        value_field="payload",
    ),
    Route(
        "resolve",
        "POST",
        "/api/runs/{run}/effects/{step}/resolve",
        run="b-1",
        body={"outcome": "succeeded", "result": {"id": "ch-1"}, "by": "ops"},
        text_fields=("outcome", "by"),
        value_field="result",
    ),
    Route("resume", "POST", "/api/runs/{run}/resume", run="b-1", body={}),
    Route(
        "cancel",
        "POST",
        "/api/runs/{run}/cancel",
        run="w-1",
        body={"compensate": True},
        text_fields=("compensate",),
    ),
    Route(
        "webhook",
        "POST",
        "/webhooks/events",
        body={"run_id": "w-1", "name": "go", "payload": {"n": 1}},
        text_fields=("run_id", "name"),
        value_field="payload",
        webhook=True,
    ),
]
ID_FIELDS = frozenset({"run_id", "tenant", "outcome", "compensate"})


@dataclass(frozen=True)
class Case:
    route: Route
    where: str  # "body", "field:<name>", "path", "query"
    raw: str  # the whole body (JSON text), or the URL piece
    says: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.route.name}-{self.where}"


def body_with(route: Route, field: str, raw_value: str) -> str:
    """The route's good body with ``field`` set to ``raw_value`` (JSON text); in a value
    field, inside an array (``input`` must be one)."""
    assert route.body is not None
    marker = f"@@{uuid.uuid4().hex}@@"
    if field == route.value_field:
        raw_value = f"[{raw_value}]"
    return json.dumps({**route.body, field: marker}).replace(json.dumps(marker), raw_value)


def cases() -> list[Any]:
    found: list[Any] = []

    def add(route: Route, where: str, raw: str, says: tuple[str, ...], bad: str) -> None:
        case = Case(route, where, raw, says)
        found.append(pytest.param(case, id=f"{route.name}-{where}-{bad}"))

    for route in ROUTES:
        if route.body is None:  # GET: the bad text goes where the URL takes text
            where = "query" if "{q}" in route.path else "path"
            for bad in BAD:
                # In a URL a surrogate arrives as U+FFFD, legal text; and a filter is free text.
                if bad.url is None or (
                    where == "query" and (bad.ids_only or bad.name == "surrogate")
                ):
                    continue
                says = (*bad.says, "run id", "workflow", "limit", "no such page")
                add(route, where, bad.url, says, bad.name)
            continue
        if route.run:
            for bad in BAD:
                if bad.url is not None:
                    add(route, "path", bad.url, (*bad.says, "run id", "no such page"), bad.name)
        add(route, "body", "{not json", ("not valid json",), "malformed")
        add(route, "body", "[1, 2]", ("object", "dictionary"), "not-an-object")
        add(route, "body", body_with(route, "extra", HUGE), ("bytes",), "huge")
        target = route.value_field or (route.text_fields[0] if route.text_fields else "extra")
        for bad in BAD:
            if bad.json is None or bad.ids_only or bad.name == "overlong":
                continue
            if target == route.value_field and bad.name in ("escape", "c1-control"):
                continue  # free JSON values may hold any printable or control text
            words = bad.says if target == route.value_field else (*bad.says, target)
            add(route, f"field:{target}", body_with(route, target, bad.json), words, bad.name)
        for field in route.text_fields:
            for bad in BAD:
                if bad.json is None or (bad.ids_only and field not in ID_FIELDS):
                    continue
                if bad.name.startswith(("deep", "nan", "infinity", "float", "huge")):
                    continue  # a non-string where text belongs: covered above
                says = (*bad.says, field, field.replace("_", " "))
                add(route, f"field:{field}", body_with(route, field, bad.json), says, bad.name)
    return found


# -- the console -------------------------------------------------------------------------------


@dataclass
class Console:
    served: Served
    database_url: str


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def console(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Console]:
    import psycopg

    tmp: Path = tmp_path_factory.mktemp("hostile")
    schema = f"durably_hostile_{uuid.uuid4().hex[:12]}"
    if request.param == "sqlite":
        url = f"sqlite:///{tmp}/durably.db"
    else:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
        url = postgres_schema_url(schema)
    try:
        prepare(url)
        served = serve_cli(url, tmp / "serve.log")
        try:
            yield Console(served, url)
        finally:
            served.stop()
        assert "Traceback" not in served.output(), served.output()
    finally:
        if request.param == "postgres":
            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE'.encode())


def send(console: Console, case: Case) -> Reply:
    route, served = case.route, console.served
    path = route.path.replace("{run}", route.run).replace("{step}", "charge%231")
    if case.where == "query":
        path = path.replace("{q}", case.raw)
    elif case.where == "path":
        path = path.replace(route.run, case.raw, 1)
    if route.method == "GET":
        return served.request("GET", path, None, AUTH)
    body = (
        case.raw if case.where.startswith(("body", "field")) else json.dumps(route.body)
    ).encode()
    headers = dict(AUTH)
    if route.webhook:
        from durably.server.webhooks import sign

        webhook_id, stamp = f"msg-{uuid.uuid4().hex}", str(int(time.time()))
        headers = {
            "webhook-id": webhook_id,
            "webhook-timestamp": stamp,
            "webhook-signature": sign(WEBHOOK_SECRET, webhook_id, stamp, body),
        }
    return served.request(route.method, path, body, headers)


@pytest.mark.parametrize("case", cases())
def test_bad_input_is_a_clear_4xx_and_changes_nothing(console: Console, case: Case) -> None:
    before = fingerprint(console.database_url)
    reply = send(console, case)
    assert 400 <= reply.status < 500, (reply.status, reply.text[:500])
    assert reply.status not in (401, 403), reply.text[:500]
    if reply.headers.get("content-type", "").startswith("text/html"):
        text = html.unescape(reply.text)
        assert "<h1>" in text
    else:
        doc = reply.json()
        assert set(doc) == {"error", "message"}, doc
        assert doc["error"][:1].isupper()
        text = doc["message"]
    assert any(word in text.lower() for word in case.says), (case.says, text[:500])
    assert fingerprint(console.database_url) == before
