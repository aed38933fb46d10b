"""Where a measurement runs: a directory on a real disk for SQLite, a fresh schema on a
PostgreSQL server that other sessions may restart under us."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "shm"})
LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})
ATTEMPTS = 3
"""How often a measurement is taken before giving up, when the server restarts under it."""


def environment() -> dict[str, Any]:
    """The machine and software the figures come from."""
    try:
        from importlib.metadata import version

        durably_version = version("durably")
    except Exception:  # not installed as a distribution: running from a checkout
        durably_version = "?"
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return {
        "python": platform.python_version(),
        "durably": durably_version,
        "cpus": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.system()}",
        "load_average_at_start": load,
    }


# -- SQLite: which disk ---------------------------------------------------------------------


@dataclass(frozen=True)
class Filesystem:
    path: str
    mount_point: str
    fstype: str
    device: int

    @property
    def in_memory(self) -> bool:
        """fsync costs nothing here: commits measure CPU and ``write()`` only."""
        return self.fstype in MEMORY_FILESYSTEMS

    def describe(self) -> str:
        kind = "IN MEMORY - fsync is free, commits are not flushed" if self.in_memory else "disk"
        return f"{self.path} ({self.fstype} mounted on {self.mount_point}, {kind})"


def _unescape_mount(text: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(code, char)
    return text


def filesystem_of(path: Path) -> Filesystem:
    """The mount (longest matching mount point in /proc/mounts) that holds ``path``."""
    real = os.path.realpath(path)
    best, fstype = "/", "unknown"
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = _unescape_mount(parts[1])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, parts[2]
    return Filesystem(str(path), best, fstype, os.stat(real).st_dev)


def choose_base(explicit: str | None) -> tuple[Path, Filesystem, str]:
    """The directory for the benchmark's databases, its filesystem and why it was chosen.

    Default: the system temp dir if it is a real disk on the same device as the repo (so
    the numbers are the repo's disk), else the ``benchmarks/`` directory itself.
    """
    if explicit:
        base = Path(explicit).resolve()
        base.mkdir(parents=True, exist_ok=True)
        return base, filesystem_of(base), "given by --dir"
    repo_fs = filesystem_of(REPO_ROOT)
    tmp = Path(tempfile.gettempdir())
    tmp_fs = filesystem_of(tmp)
    if not tmp_fs.in_memory and tmp_fs.device == repo_fs.device:
        why = f"{tmp} is {tmp_fs.fstype} on the same device as the repo ({REPO_ROOT})"
        return tmp, tmp_fs, why
    why = (
        f"{tmp} is {tmp_fs.fstype}"
        + (" (memory)" if tmp_fs.in_memory else " on another device than the repo")
        + f"; using the repo's disk ({repo_fs.fstype})"
    )
    return BENCH_DIR, filesystem_of(BENCH_DIR), why


class SQLiteFile:
    """A fresh SQLite database, in a directory of its own under ``base``."""

    key = "sqlite"

    def __init__(self, base: Path, name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
        self.path = self.dir / "bench.db"

    def url(self) -> str:
        return f"sqlite:///{self.path}"

    def epoch(self) -> str | None:
        return None

    def drop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# -- PostgreSQL: a fresh schema per measurement ---------------------------------------------


def with_pg_options(url: str, *options: str) -> str:
    """``url`` with ``-c name=value`` server options appended to its ``options`` parameter.

    This is how a measurement's connections (durably's included) are pointed at their
    schema (``search_path=...``): through the database URL, durably's public input.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    existing = [v for k, v in query if k == "options"]
    query = [(k, v) for k, v in query if k != "options"]
    query.append(("options", " ".join([*existing, *(f"-c{o}" for o in options)])))
    return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote, safe="")))


class PostgresAdmin:
    """An autocommit connection for the benchmark's own bookkeeping (schemas, settings),
    re-opened when another session restarted the shared server."""

    def __init__(self, url: str, prefix: str, *, hint: str) -> None:
        import psycopg

        self.url = url
        self.prefix = prefix
        """Schemas are named ``<prefix><pid>_...``: a dead benchmark's are recognisable."""
        try:
            self._conn: Any = psycopg.connect(url, autocommit=True, connect_timeout=5)
        except psycopg.OperationalError as exc:
            raise SystemExit(f"cannot connect to PostgreSQL at {url} ({exc}); {hint}") from exc
        self._drop_stale_schemas()

    def conn(self) -> Any:
        """The connection, re-opened (waiting up to a minute for the server) if it broke."""
        import psycopg

        with contextlib.suppress(Exception):
            self._conn.execute("SELECT 1")
            return self._conn
        with contextlib.suppress(Exception):
            self._conn.close()
        deadline = time.monotonic() + 60.0
        while True:
            try:
                self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
                return self._conn
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def epoch(self) -> str | None:
        """The server's start time: it changes when another session restarts the server."""
        try:
            row = self._conn.execute("SELECT pg_postmaster_start_time()::text").fetchone()
        except Exception:
            return "unreachable"
        return None if row is None else str(row[0])

    def schema_name(self, *parts: object) -> str:
        tag = re.sub(r"[^a-z0-9_]", "_", "_".join(str(p) for p in parts).lower())
        return f"{self.prefix}{os.getpid()}_{tag}"[:63]

    def create_schema(self, schema: str) -> None:
        self.conn().execute(f'CREATE SCHEMA "{schema}"')

    def drop_schema(self, schema: str) -> None:
        self.conn().execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    def setting(self, name: str) -> str:
        row = (
            self.conn()
            .execute("SELECT setting FROM pg_settings WHERE name = %s", (name,))
            .fetchone()
        )
        return "?" if row is None else str(row[0])

    def show(self, name: str) -> str:
        row = self.conn().execute(f"SHOW {name}").fetchone()
        return "?" if row is None else str(row[0])

    def postmaster_pid(self) -> int | None:
        """The server's main process, when it runs on this machine and its data directory
        is readable (its children are its backends); None otherwise."""
        try:
            pid_file = Path(self.setting("data_directory")) / "postmaster.pid"
            return int(pid_file.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def wal_lsn(self) -> int:
        """Bytes of WAL the whole cluster has written so far."""
        row = (
            self.conn()
            .execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint")
            .fetchone()
        )
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        self._conn.close()

    def _drop_stale_schemas(self) -> None:
        """Drop ``<prefix><pid>_...`` schemas left by benchmark processes that no longer
        exist: only for a server on this machine, where the pid in the name is one of ours."""
        if (urlsplit(self.url).hostname or "") not in LOCAL_HOSTS:
            return
        pattern = self.prefix.replace("_", r"\_") + "%"
        names = [
            r[0]
            for r in self._conn.execute(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE %s", (pattern,)
            ).fetchall()
        ]
        for name in names:
            pid = name[len(self.prefix) :].split("_", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                self._conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


class PostgresSchema:
    """A fresh schema; durably's connections reach it through the URL's search_path."""

    key = "postgres"

    def __init__(self, admin: PostgresAdmin, schema: str, *options: str) -> None:
        self.admin = admin
        self.schema = schema
        self.options = options
        admin.create_schema(schema)

    def url(self) -> str:
        return with_pg_options(self.admin.url, f"search_path={self.schema}", *self.options)

    def epoch(self) -> str | None:
        return self.admin.epoch()

    def drop(self) -> None:
        self.admin.drop_schema(self.schema)
