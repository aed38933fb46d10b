"""A small real HTTP shop service that example tools call and crash tests treat as ground truth.

Run it with ``python -m durably.demo.shop --db PATH [--host H] [--port N] [--port-file F]``
or from Python via :class:`ShopService`. ``/orders`` and ``/emails`` honour ``Idempotency-Key``
like Stripe; ``/coupons`` deliberately does not. ``/faults`` injects failures around the commit.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

from durably.context import fenced

TRACKED_PATHS = ("/orders", "/coupons", "/emails", "/sales", "/model/draft")
FAULT_MODES = ("reject_before", "delay_after_commit", "drop_after_commit")
_PRODUCTS = ("espresso machine", "burr grinder", "milk frother", "pour-over kit", "travel mug")
_PREFIX = {"orders": "ord", "emails": "msg", "coupons": "cpn"}
_MAX_BODY = 1 << 20
_SRC_ROOT = Path(__file__).resolve().parents[2]
_Result = tuple[int, dict[str, Any]]


class ShopHTTPError(Exception):
    """The shop answered 4xx/5xx; ``status`` is the code and ``body`` its decoded JSON."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {body.get('error', body)}")
        self.status = status
        self.body = body


# Environment proxies must never intercept calls to a service on localhost.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        value = raw.decode("utf-8", "replace")
    return value if isinstance(value, dict) else {"error": value}


def _request(
    method: str, url: str, body: object, idempotency_key: str | None, timeout: float
) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json", "Content-Type": "application/json"}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return _decode(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            raise ShopHTTPError(exc.code, _decode(exc.read())) from None
    except urllib.error.URLError as exc:
        # urllib wraps connect-phase failures; callers need the real OSError to tell "never
        # reached the service" (ConnectionRefusedError) from "outcome unknown" (TimeoutError).
        if isinstance(exc.reason, OSError):
            raise exc.reason from None
        raise


@fenced
def post_json(
    url: str, body: object, *, idempotency_key: str | None = None, timeout: float = 5.0
) -> dict[str, Any]:
    """POST ``body`` as JSON and return the decoded JSON object.

    Fenced: inside a run it first checks that this worker still holds the run's lease
    (``durably.check_lease()``), so a worker frozen between its claim and this request
    never sends after another worker took the run over.

    Raises ShopHTTPError for 4xx/5xx, TimeoutError when no answer arrives in ``timeout``,
    ConnectionRefusedError when nothing listens, and http.client.RemoteDisconnected (a
    ConnectionResetError subclass) when the server closes the connection without answering.
    """
    return _request("POST", url, body, idempotency_key, timeout)


def get_json(url: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """GET ``url`` and return the decoded JSON object; raises like :func:`post_json`."""
    return _request("GET", url, None, None, timeout)


def sales_figures(region: str) -> dict[str, Any]:
    """Deterministic quarterly figures for ``region`` (same input, same numbers, forever)."""
    digest = hashlib.sha256(region.encode()).digest()
    return {
        "region": region,
        "quarter": "2026-Q3",
        "revenue": 50_000 + int.from_bytes(digest[:4], "big") % 950_000,
        "orders": 100 + int.from_bytes(digest[4:6], "big") % 4_900,
        "top_product": _PRODUCTS[digest[6] % len(_PRODUCTS)],
    }


def draft_report(prompt: str, figures: dict[str, Any]) -> dict[str, Any]:
    """Offline stand-in for a language model: a short report built only from ``figures``."""
    revenue, orders = figures.get("revenue"), figures.get("orders")
    sentences = [
        f"{figures.get('region', 'The region')} closed {figures.get('quarter', 'the quarter')}"
    ]
    if isinstance(revenue, int | float) and isinstance(orders, int) and orders > 0:
        sentences[0] += f" with revenue of {revenue:,} across {orders:,} orders."
        sentences.append(f"That is an average of {revenue / orders:,.2f} per order.")
    else:
        sentences[0] += " without usable revenue figures."
    if figures.get("top_product"):
        sentences.append(f"The best-selling product was {figures['top_product']}.")
    text = " ".join(sentences)
    tokens = len(prompt.split()) + len(text.split())
    return {"model": "shop-draft-1", "text": text, "tokens": tokens}


# The three effect tables share one shape so listing code can treat them alike; only orders
# and emails make the key UNIQUE, because only they promise deduplication.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, idempotency_key TEXT UNIQUE,
    request TEXT NOT NULL, code TEXT, created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS emails (id INTEGER PRIMARY KEY, idempotency_key TEXT UNIQUE,
    request TEXT NOT NULL, code TEXT, created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS coupons (id INTEGER PRIMARY KEY, idempotency_key TEXT,
    request TEXT NOT NULL, code TEXT, created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (method TEXT NOT NULL, path TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (method, path));
CREATE TABLE IF NOT EXISTS faults (id INTEGER PRIMARY KEY, method TEXT NOT NULL, path TEXT NOT NULL,
    mode TEXT NOT NULL, remaining INTEGER NOT NULL, seconds REAL NOT NULL);
"""
_COUNT_SQL = (
    "INSERT INTO requests VALUES (?, ?, 1) ON CONFLICT (method, path) DO UPDATE SET n = n + 1"
)


class _Problem(Exception):
    """A refusal decided before any effect row was written; args are (status, message)."""


class _Store:
    def __init__(self, path: str) -> None:
        # One connection behind a lock instead of one per thread: each request is a tiny
        # transaction, and serialising them makes check-then-insert on idempotency keys and
        # fault consumption atomic without leaning on SQLite's SQLITE_BUSY upgrade failures.
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        # Other processes (a test opening the file directly) may briefly hold the write lock.
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.executescript(_SCHEMA)

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except _Problem:
                # Refusals still keep their bookkeeping: the request count and a consumed fault.
                self._conn.execute("COMMIT")
                raise
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _rows(db: sqlite3.Connection, table: str, **match: str) -> list[dict[str, Any]]:
    sql = f"SELECT id, idempotency_key, request, code, created_at FROM {table} ORDER BY id"
    rows = [(n, key, json.loads(req), code, at) for n, key, req, code, at in db.execute(sql)]
    return [
        {"id": f"{_PREFIX[table]}_{n}", "idempotency_key": key, "request": req, "created_at": at}
        | ({"code": code} if code else {})
        for n, key, req, code, at in rows
        if all(req.get(k) == v for k, v in match.items())
    ]


class _ShopServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], store: _Store) -> None:
        super().__init__(address, _Handler)
        self.store = store

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients vanishing mid-response are routine under fault injection, not errors.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """Routes ``METHOD /a/b`` to the method ``_method_a_b``; each runs inside one transaction."""

    server: _ShopServer
    query: dict[str, str]
    raw: bytes
    fault: tuple[str, float] | None = None

    def log_message(self, format: str, *args: Any) -> None:
        """Stay silent: tests make many requests and stderr is reserved for real failures."""

    def _dispatch(self) -> None:
        method, split = self.command, urllib.parse.urlsplit(self.path)
        path = split.path.rstrip("/") or "/"
        self.query = {k: v[-1] for k, v in urllib.parse.parse_qs(split.query).items()}
        suffix = path.replace("/", "_")
        try:
            # Read the body before taking the store lock so a slow client cannot stall others.
            self.raw = self._read_body()
            with self.server.store.tx() as db:
                if path in TRACKED_PATHS:
                    db.execute(_COUNT_SQL, (method, path))
                route = getattr(self, f"_{method.lower()}{suffix}", None)
                if route is None:
                    known = any(hasattr(self, f"_{m}{suffix}") for m in ("get", "post", "delete"))
                    raise _Problem(405 if known else 404, f"no route for {method} {path}")
                status, payload = route(db)
        except _Problem as exc:
            status, payload, self.fault = exc.args[0], {"error": exc.args[1]}, None
        except Exception as exc:
            traceback.print_exc()
            status, payload, self.fault = 500, {"error": f"internal error: {exc!r}"}, None
        # Any effect is committed at this point; the fault decides what the client learns.
        mode, seconds = self.fault or ("", 0.0)
        if mode == "drop_after_commit":
            self.close_connection = True
            return
        if mode == "delay_after_commit":
            time.sleep(seconds)
        self._send(status, payload)

    do_GET = do_POST = do_DELETE = _dispatch

    def _read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise _Problem(400, "bad Content-Length") from None
        if length > _MAX_BODY:
            raise _Problem(413, "body too large")
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError:
            # The client gave up (e.g. timed out during a delay); the effect already stands.
            self.close_connection = True

    def _body(self, **fields: type | tuple[type, ...]) -> dict[str, Any]:
        """The JSON object body, after checking each named field's type."""
        try:
            body = json.loads(self.raw) if self.raw else None
        except ValueError:
            raise _Problem(400, "body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _Problem(400, "body must be a JSON object")
        for name, kind in fields.items():
            if not isinstance(body.get(name), kind) or isinstance(body.get(name), bool):
                raise _Problem(400, f"field {name!r} is missing or has the wrong type")
        return body

    def _gate(self, db: sqlite3.Connection, method: str, path: str) -> None:
        """Consume the next queued fault for this request inside the locked transaction."""
        sql = "SELECT id, mode, remaining, seconds FROM faults WHERE method = ? AND path = ?"
        row = db.execute(sql + " ORDER BY id LIMIT 1", (method, path)).fetchone()
        if row is None:
            return
        if row[2] <= 1:
            db.execute("DELETE FROM faults WHERE id = ?", (row[0],))
        else:
            db.execute("UPDATE faults SET remaining = remaining - 1 WHERE id = ?", (row[0],))
        if row[1] == "reject_before":
            raise _Problem(503, "unavailable")
        self.fault = (str(row[1]), float(row[3]))

    def _insert_once(self, db: sqlite3.Connection, table: str, body: object) -> tuple[str, int]:
        """Stripe-style idempotent insert: (``<prefix>_<n>`` id, 201 if new or 200 if replay)."""
        key, canon = self.headers.get("Idempotency-Key"), _canonical(body)
        if not key:
            raise _Problem(400, "Idempotency-Key header is required")
        self._gate(db, "POST", f"/{table}")
        sql = f"SELECT id, request FROM {table} WHERE idempotency_key = ?"
        row = db.execute(sql, (key,)).fetchone()
        if row is not None and row[1] != canon:
            raise _Problem(409, "idempotency key reused with a different request")
        if row is not None:
            return f"{_PREFIX[table]}_{row[0]}", 200
        sql = f"INSERT INTO {table} (idempotency_key, request, created_at) VALUES (?, ?, ?)"
        return f"{_PREFIX[table]}_{db.execute(sql, (key, canon, _now())).lastrowid}", 201

    def _get_health(self, db: sqlite3.Connection) -> _Result:
        return 200, {"ok": True}

    def _get_sales(self, db: sqlite3.Connection) -> _Result:
        if not self.query.get("region"):
            raise _Problem(400, "query parameter 'region' is required")
        self._gate(db, "GET", "/sales")
        return 200, sales_figures(self.query["region"])

    def _post_model_draft(self, db: sqlite3.Connection) -> _Result:
        body = self._body(prompt=str, figures=dict)
        self._gate(db, "POST", "/model/draft")
        return 200, draft_report(body["prompt"], body["figures"])

    def _post_orders(self, db: sqlite3.Connection) -> _Result:
        body = self._body(customer=str, items=list, amount=(int, float))
        order_id, status = self._insert_once(db, "orders", body)
        order = {k: body[k] for k in ("customer", "items", "amount")}
        return status, {"order_id": order_id, **order, "replayed": status == 200}

    def _post_emails(self, db: sqlite3.Connection) -> _Result:
        body = self._body(to=str, subject=str, body=str)
        message_id, status = self._insert_once(db, "emails", body)
        return status, {"message_id": message_id, "to": body["to"], "replayed": status == 200}

    def _post_coupons(self, db: sqlite3.Connection) -> _Result:
        body = self._body(customer=str, campaign=str)
        self._gate(db, "POST", "/coupons")
        # Safe to pick the next id up front: the store lock serialises every writer.
        n = int(db.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM coupons").fetchone()[0])
        code = "CPN-" + hashlib.sha256(f"{n}:{_canonical(body)}".encode()).hexdigest()[:8].upper()
        row = (n, self.headers.get("Idempotency-Key"), _canonical(body), code, _now())
        db.execute("INSERT INTO coupons VALUES (?, ?, ?, ?, ?)", row)
        coupon = {k: body[k] for k in ("customer", "campaign")}
        return 201, {"coupon_id": f"cpn_{n}", **coupon, "code": code}

    def _listing(self, db: sqlite3.Connection, table: str, id_name: str, *keys: str) -> _Result:
        rows = _rows(db, table, **{k: self.query[k] for k in keys if k in self.query})
        return 200, {table: [{id_name: r.pop("id"), **r.pop("request"), **r} for r in rows]}

    def _get_coupons(self, db: sqlite3.Connection) -> _Result:
        return self._listing(db, "coupons", "coupon_id", "customer", "campaign")

    def _get_emails(self, db: sqlite3.Connection) -> _Result:
        return self._listing(db, "emails", "message_id", "to")

    def _get_effects(self, db: sqlite3.Connection) -> _Result:
        counts, by_method = dict.fromkeys(TRACKED_PATHS, 0), {}
        for method, path, n in db.execute("SELECT method, path, n FROM requests ORDER BY path"):
            counts[path] += n
            by_method[f"{method} {path}"] = n
        effects = {t: _rows(db, t) for t in ("orders", "coupons", "emails")}
        return 200, effects | {"requests": counts, "requests_by_method": by_method}

    def _post_faults(self, db: sqlite3.Connection) -> _Result:
        body = self._body(path=str, mode=str)
        path, mode = body["path"], body["mode"]
        times, seconds = body.get("times", 1), body.get("seconds", 0.0)
        method = body.get("method", "GET" if path == "/sales" else "POST")
        if path not in TRACKED_PATHS or mode not in FAULT_MODES or method not in ("GET", "POST"):
            raise _Problem(400, f"path must be one of {TRACKED_PATHS}, mode one of {FAULT_MODES}")
        if type(times) is not int or times < 1 or type(seconds) not in (int, float) or seconds < 0:
            raise _Problem(400, "times must be a positive integer, seconds a non-negative number")
        fault = (method, path, mode, times, float(seconds))
        cur = db.execute("INSERT INTO faults VALUES (NULL, ?, ?, ?, ?, ?)", fault)
        names = ("method", "path", "mode", "times", "seconds")
        return 201, {"fault_id": cur.lastrowid, **dict(zip(names, fault, strict=True))}

    def _delete_faults(self, db: sqlite3.Connection) -> _Result:
        return 200, {"cleared": db.execute("DELETE FROM faults").rowcount}

    def _post_reset(self, db: sqlite3.Connection) -> _Result:
        for table in ("orders", "emails", "coupons", "requests", "faults"):
            db.execute(f"DELETE FROM {table}")
        return 200, {"ok": True}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: serve until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m durably.demo.shop", description=__doc__)
    parser.add_argument("--db", required=True, help="SQLite database file (created if missing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", help="write the bound port here once listening")
    args = parser.parse_args(argv)
    store = _Store(args.db)
    server = _ShopServer((args.host, args.port), store)
    # Turn SIGTERM into SystemExit so the finally block closes the socket and database.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if args.port_file:
            # Atomic so a poller never reads a half-written number.
            tmp = Path(f"{args.port_file}.{os.getpid()}.tmp")
            tmp.write_text(f"{server.server_port}\n")
            os.replace(tmp, args.port_file)
        print(f"listening on http://{args.host}:{server.server_port}", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        store.close()
    return 0


def _shutdown(
    proc: subprocess.Popen[bytes], log: IO[bytes], workdir: tempfile.TemporaryDirectory[str]
) -> None:
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        log.close()
        workdir.cleanup()


class ShopService:
    """The shop in a child process: started by the constructor, stopped by stop() or ``with``."""

    url: str
    db_path: Path | None

    def __init__(
        self, db_path: str | os.PathLike[str] | None = None, *, startup_timeout: float = 10.0
    ) -> None:
        workdir = tempfile.TemporaryDirectory(prefix="durably-shop-")
        work = Path(workdir.name)
        self.db_path = Path(db_path) if db_path is not None else work / "shop.sqlite3"
        log = (work / "server.log").open("w+b")
        env = dict(os.environ)
        # The child must import this very package even if the parent found it via sys.path.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SRC_ROOT), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "durably.demo.shop", "--db", str(self.db_path)]
        cmd += ["--port", "0", "--port-file", str(work / "port")]
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env
        )
        # A finalizer rather than __del__: it also runs at interpreter exit, so no orphan survives.
        self._stop: Callable[[], object] | None = weakref.finalize(
            self, _shutdown, self._proc, log, workdir
        )
        try:
            self.url = self._wait_ready(self._proc, work / "port", log, startup_timeout)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _wait_ready(
        proc: subprocess.Popen[bytes], port_file: Path, log: IO[bytes], timeout: float
    ) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read()[-2000:].decode("utf-8", "replace")
                raise RuntimeError(f"shop service exited with code {proc.returncode}:\n{tail}")
            if port_file.exists():
                url = f"http://127.0.0.1:{int(port_file.read_text())}"
                with contextlib.suppress(OSError, ShopHTTPError):
                    if get_json(f"{url}/health", timeout=1.0).get("ok") is True:
                        return url
            time.sleep(0.02)
        raise TimeoutError(f"shop service not healthy within {timeout} s")

    @classmethod
    def attach(cls, url: str) -> ShopService:
        """Wrap an already running service; stop() then leaves it alone."""
        self = cls.__new__(cls)
        self.url, self.db_path, self._proc, self._stop = url.rstrip("/"), None, None, None
        return self

    @property
    def pid(self) -> int | None:
        """Process id of the owned server, or None when attached."""
        return None if self._proc is None else self._proc.pid

    def effects(self) -> dict[str, Any]:
        """Everything that happened: effect rows plus per-path request counts."""
        return get_json(f"{self.url}/effects")

    def add_fault(self, path: str, mode: str, times: int = 1, seconds: float = 0.0) -> None:
        """Queue ``mode`` for the next ``times`` requests to ``path`` (POST; GET for /sales)."""
        body = {"path": path, "mode": mode, "times": times, "seconds": seconds}
        post_json(f"{self.url}/faults", body)

    def clear_faults(self) -> None:
        """Drop all queued faults."""
        _request("DELETE", f"{self.url}/faults", None, None, 5.0)

    def reset(self) -> None:
        """Clear every table: effects, request counts and faults."""
        post_json(f"{self.url}/reset", {})

    def stop(self) -> None:
        """Terminate (then kill) and reap the owned server; idempotent, no-op when attached."""
        if self._stop is not None:
            self._stop()

    def __enter__(self) -> ShopService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
