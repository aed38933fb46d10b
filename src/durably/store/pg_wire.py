"""One round of statements on a pooled PostgreSQL connection, sent through libpq directly.

psycopg's cursors and pipeline manager cost the client more CPU than the statements they
send: about 150 µs a statement through ``AsyncConnection.execute`` and more again for a
pipeline, against some 70 µs for the same statement handed to libpq
(``benchmarks/driver_modes.py``). This module keeps psycopg's parts that matter — its
adapters turn Python values into parameters and result columns back into Python values,
its error classes name what the server refused — and drives the protocol itself:

* every statement is prepared once per connection (named, with the parameter types
  psycopg's adapters chose) and then only executed — prepared again once the server
  refuses it as no longer prepared, or prepared for a table that changed shape;
* a round is one libpq pipeline closed by one Sync, so its statements are one implicit
  transaction unless the round opens one, and go out in one round trip;
* a connection whose round was interrupted (cancelled, or the socket failed) is closed,
  so that the pool never hands out a connection with answers still on the way. The server
  still runs what it received up to its Sync: an interrupted write's outcome is unknown,
  as after a lost COMMIT (the store reads the run back, and the lease fences the rest).
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg.adapt import PyFormat, Transformer
from psycopg.errors import error_from_result
from psycopg.pq import ConnStatus, DiagnosticField, ExecStatus
from psycopg.pq.abc import PGconn, PGresult

from durably.store.plans import Rows
from durably.store.queries import numbered

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


class Statement(NamedTuple):
    """A statement in the protocol's form: ``$n`` placeholders, and how to pick its
    parameters, in order, from a plan's parameters by name."""

    sql: bytes
    values: Callable[[dict[str, Any]], Sequence[Any]]


def statement(sql: str) -> Statement:
    """``%(name)s`` becomes ``$n``."""
    text, values = numbered(sql, _PLACEHOLDER, "$")
    return Statement(text.encode(), values)


class _Wire:
    """What this module keeps per connection: its adapters and prepared statements."""

    __slots__ = ("columns", "encoding", "names", "prepared", "transformer")

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.transformer = Transformer.from_context(conn)
        self.encoding = conn.info.encoding
        # Keyed like psycopg's own: the same text with other parameter types (an int
        # that needs int8, a NULL) is another prepared statement.
        self.prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self.names = itertools.count()
        self.columns: dict[bytes, list[str]] = {}


class _Sent(NamedTuple):
    key: tuple[bytes, tuple[int, ...]]
    name: bytes
    preparing: bool


# Not weakly keyed: a wire's Transformer holds its connection, so an entry would keep its
# key alive for ever. Entries of closed connections go when a new connection comes (the
# pool replacing them): at most the pool's connections and those it closed since.
_wires: dict[psycopg.AsyncConnection[Any], _Wire] = {}


async def send_round(
    conn: psycopg.AsyncConnection[Any],
    statements: Sequence[tuple[Statement, dict[str, Any] | None]],
) -> list[Rows]:
    """Send ``statements`` in one round trip; the rows of each as dicts (for a statement
    without rows, an empty row per row it changed: see ``store.plans.Plan``). The first
    statement the server refused is raised as psycopg's error for it, once every answer
    of the round has been read."""
    wire = _wires.get(conn)
    if wire is None:
        # From a copy (taken in one step): another thread's event loop may add its own.
        for other in list(_wires):
            if other.closed:
                _wires.pop(other, None)
        wire = _wires[conn] = _Wire(conn)
    pgconn = conn.pgconn
    try:
        pgconn.enter_pipeline_mode()
        sent = [_send(wire, pgconn, s, params) for s, params in statements]
        pgconn.pipeline_sync()
        results = await _answers(pgconn)
        pgconn.exit_pipeline_mode()
    except BaseException:
        # Answers may still be on the way: no one may use this connection again.
        pgconn.finish()
        raise
    return _rows(wire, sent, results)


def _send(wire: _Wire, pgconn: PGconn, s: Statement, params: dict[str, Any] | None) -> _Sent:
    """Queue ``s``, and its preparation the first time this connection sees it."""
    tx = wire.transformer
    values = s.values(params) if params is not None else ()
    dumped = tx.dump_sequence(values, [PyFormat.AUTO] * len(values))
    types = tuple(tx.types or ())
    key = (s.sql, types)
    name = wire.prepared.get(key)
    preparing = name is None
    if name is None:
        # Counted as prepared from now: a later statement of this round uses it.
        name = wire.prepared[key] = b"durably_%d" % next(wire.names)
        pgconn.send_prepare(name, s.sql, param_types=types)
    pgconn.send_query_prepared(name, dumped, param_formats=tx.formats)
    return _Sent(key, name, preparing)


async def _answers(pgconn: PGconn) -> list[PGresult]:
    """Every result of the round, in order, up to its Sync."""
    loop = asyncio.get_running_loop()
    results: list[PGresult] = []
    while True:
        if pgconn.flush():
            # More to send. Read while waiting: the server stops reading once the answers
            # it could not send us fill its buffer.
            await _ready(loop, pgconn.socket, write=True)
            pgconn.consume_input()
            continue
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:  # the end of one statement's results
                if pgconn.status == ConnStatus.BAD:
                    # libpq gave up on the connection (a protocol error): no result will
                    # ever come, and this loop would spin without waiting for any.
                    message = pgconn.error_message.decode(errors="replace")
                    raise psycopg.OperationalError(f"the connection was lost: {message}")
                continue
            if result.status == ExecStatus.PIPELINE_SYNC:
                return results
            results.append(result)
        await _ready(loop, pgconn.socket, write=False)
        pgconn.consume_input()


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool) -> None:
    """Until ``fd`` can be read (or, with ``write``, written)."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    if write:
        loop.add_writer(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
        if write:
            loop.remove_writer(fd)


def _rows(wire: _Wire, sent: list[_Sent], results: list[PGresult]) -> list[Rows]:
    answers: list[Rows] = []
    refused: PGresult | None = None
    read = iter(results)
    for key, name, preparing in sent:
        if preparing:
            prepared = next(read)
            if prepared.status != ExecStatus.COMMAND_OK:
                # Perhaps gone already: _forget, for a statement before it, forgets them all.
                wire.prepared.pop(key, None)
                refused = refused or _refusal(prepared)
        result = next(read)
        status = result.status
        if status == ExecStatus.TUPLES_OK:
            answers.append(_loaded(wire, name, result))
        elif status == ExecStatus.COMMAND_OK:
            answers.append([()] * (result.command_tuples or 0))
        else:  # refused, or not run after a refusal (the whole round is rolled back)
            refused = refused or _refusal(result)
            answers.append([])
            _forget(wire, key, name, result)
    if refused is not None:
        raise error_from_result(refused, wire.encoding)
    return answers


def _forget(wire: _Wire, key: tuple[bytes, tuple[int, ...]], name: bytes, result: PGresult) -> None:
    """Forget what the server no longer holds as it was prepared, so that the next round
    using it prepares it again rather than being refused the same way for ever."""
    state = result.error_field(DiagnosticField.SQLSTATE)
    if state == b"26000":  # invalid_sql_statement_name
        # The server dropped this connection's statements (DEALLOCATE ALL; DISCARD ALL, a
        # pooler's reset): all of them. Names go on counting, so a statement prepared again
        # never clashes with one the server may still hold.
        wire.prepared.clear()
        wire.columns.clear()
    elif state == b"0A000":  # feature_not_supported: "cached plan must not change result type"
        # Its tables changed shape under it (a migration added a column): PostgreSQL
        # refuses it from now on. Prepared again under a new name; the old one stays on
        # the server until the connection closes.
        wire.prepared.pop(key, None)
        wire.columns.pop(name, None)


def _refusal(result: PGresult) -> PGresult | None:
    return result if result.status == ExecStatus.FATAL_ERROR else None


def _loaded(wire: _Wire, name: bytes, result: PGresult) -> Rows:
    columns = wire.columns.get(name)
    if columns is None:
        columns = wire.columns[name] = [
            (result.fname(i) or b"").decode() for i in range(result.nfields)
        ]
    tx = wire.transformer
    tx.set_pgresult(result)
    return tx.load_rows(0, result.ntuples, lambda values: dict(zip(columns, values, strict=True)))
