"""Every ``durably`` command that takes input, against hostile input.

One table of bad values per kind of input (JSON documents, ids, names and texts, numbers),
run through every command slot that accepts that kind. Each one must be refused with an
``error:`` line and a non-zero exit, no traceback, nothing unescaped echoed back to the
terminal, and the database byte for byte as it was. The table runs in-process
(``CliRunner``); the cases where a real process or terminal matters run as subprocesses.
"""

from __future__ import annotations

import hashlib
import http.client
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from durably.cli import cli
from tests.conftest import POSTGRES_URL, postgres_schema_url
from tests.test_cli import APP_SOURCE

APP_MODULE = "hostileapp"
APP = f"{APP_MODULE}:app"

# What must never reach a terminal raw: C0 controls but newline, DEL and C1 controls (ESC,
# BEL, CSI, OSC, backspace, carriage return rewrite or hijack the screen).
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")

DEEP = 10_000

JSON_CASES = {
    "malformed": "{a: 1}",
    "truncated": '{"x": ',
    "trailing-garbage": "[1] [2]",
    "nan": "NaN",
    "infinity": "Infinity",
    "minus-infinity": "[-Infinity]",
    "float-overflow": "1e999",
    "huge-int": "7" * 5000,
    "nested-10k": "[" * DEEP + "]" * DEEP,
    "nested-10k-objects": '{"a":' * DEEP + "1" + "}" * DEEP,
    "nested-100": "[" * 100 + "]" * 100,
    "surrogate": '{"memo": "\\ud800"}',
    "surrogate-key": '{"\\udfff": 1}',
    "nul": '{"memo": "a\\u0000b"}',
    "nul-key": '{"a\\u0000": 1}',
    "undecodable-argv": "\udcff",
    "oversized": '{"blob": "' + "x" * (1024 * 1024 + 16) + '"}',
}

# Run ids and tenants: printable ASCII ids only, for keys, URLs and file-like names.
ID_CASES = {
    "empty": "",
    "escape-sequence": "a\x1b[2Jb",
    "osc-52": "a\x1b]52;c;aGk=\x07b",
    "c1-csi": "a\x9b2Jb",
    "newline": "a\nb",
    "carriage-return": "a\rb",
    "path-traversal": "../../etc/passwd",
    "slash": "a/b",
    "query": "a?b=c#d",
    "key-separator": "a|b",
    "space": "a b",
    "percent-nul": "a%00b",
    "overlong": "r" * 129,
    "undecodable-argv": "a\udcffb",
    "non-ascii": "r\u00e9sum\u00e9",
    "bidi-override": "a\u202eb",
}

# Names, approvers, event ids: printable text, bounded.
TEXT_CASES = {
    "empty": "",
    "escape-sequence": "a\x1b[2Jb",
    "osc-52": "a\x1b]52;c;aGk=\x07b",
    "bell": "a\x07b",
    "backspace": "abc\x08\x08\x08xyz",
    "c1-csi": "a\x9b2Jb",
    "del": "a\x7fb",
    "newline": "alice\nstatus    completed",
    "carriage-return": "alice\rmallory",
    "undecodable-argv": "a\udcffb",
    "overlong": "n" * 5000,
}

# A comment may span lines and hold tabs; everything else that applies to texts applies.
COMMENT_CASES = {k: v for k, v in TEXT_CASES.items() if k not in ("newline", "empty")}

SECONDS_CASES = {
    "nan": "nan",
    "infinity": "inf",
    "negative": "-1",
    "zero": "0",
    "too-large": "1e308",
    "not-a-number": "soon",
}

COUNT_CASES = {
    "zero": "0",
    "negative": "-5",
    "too-large": "1" + "0" * 30,
    "not-a-number": "many",
}

X = "\0slot\0"
"""Where the bad value goes in a command line."""

# Every slot of every command that takes input, filled with valid values elsewhere, so
# that only the bad value can be the reason for a refusal. The runs they name exist (see
# ``project``): a valid value in the slot would change the database.
SLOTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "start WORKFLOW": (["start", X, "--input", "[1]"], TEXT_CASES),
    "start --input": (["start", "summing", "--input", X], JSON_CASES),
    "start --run-id": (["start", "summing", "--input", "[1]", "--run-id", X], ID_CASES),
    "start --tenant": (["start", "summing", "--input", "[1]", "--tenant", X], ID_CASES),
    "runs list --workflow": (["runs", "list", "--workflow", X], TEXT_CASES),
    "runs list --limit": (["runs", "list", "--limit", X], COUNT_CASES),
    "runs show RUN_ID": (["runs", "show", X], ID_CASES),
    "approve RUN_ID": (["approve", X], ID_CASES),
    "approve APPROVAL_ID": (["approve", "o-1", X], TEXT_CASES),
    "approve --by": (["approve", "o-1", "--by", X], TEXT_CASES),
    "approve --comment": (["approve", "o-1", "--comment", X], COMMENT_CASES),
    "reject RUN_ID": (["reject", X], ID_CASES),
    "reject --by": (["reject", "o-1", "--by", X], TEXT_CASES),
    "reject --comment": (["reject", "o-1", "--comment", X], COMMENT_CASES),
    "resolve RUN_ID": (["resolve", X, "charge#1", "--failed"], ID_CASES),
    "resolve STEP_ID": (["resolve", "b-1", X, "--failed"], TEXT_CASES),
    "resolve --result": (["resolve", "b-1", "charge#1", "--succeeded", "--result", X], JSON_CASES),
    "resolve --by": (["resolve", "b-1", "charge#1", "--failed", "--by", X], TEXT_CASES),
    "resume RUN_ID": (["resume", X], ID_CASES),
    "event RUN_ID": (["event", X, "approved", "--event-id", "e-1"], ID_CASES),
    "event NAME": (["event", "a-1", X, "--event-id", "e-1"], TEXT_CASES),
    "event --payload": (["event", "a-1", "approved", "--payload", X], JSON_CASES),
    "event --event-id": (["event", "a-1", "approved", "--event-id", X], TEXT_CASES),
    "cancel RUN_ID": (["cancel", X], ID_CASES),
    "pause RUN_ID": (["pause", X], ID_CASES),
    "pause --reason": (["pause", "a-1", "--reason", X], COMMENT_CASES),
    "pause --by": (["pause", "a-1", "--by", X], TEXT_CASES),
    "unpause RUN_ID": (["unpause", X], ID_CASES),
    "unpause --by": (["unpause", "a-1", "--by", X], TEXT_CASES),
    "worker --lease-ttl": (["worker", "--until-idle", "--lease-ttl", X], SECONDS_CASES),
    "worker --concurrency": (["worker", "--until-idle", "--concurrency", X], COUNT_CASES),
}

TABLE = [
    pytest.param([value if part == X else part for part in argv], id=f"{slot}: {case}")
    for slot, (argv, cases) in SLOTS.items()
    for case, value in cases.items()
]


def durably(*args: str, app: str | None = APP) -> Result:
    return CliRunner().invoke(cli, [*(["--app", app] if app else []), *args], prog_name="durably")


def ok(*args: str) -> str:
    result = durably(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def fingerprint(*paths: Path) -> str:
    """Each file (and its WAL) byte for byte, or its absence."""
    digest = hashlib.sha256()
    for path in paths:
        for part in (path, Path(f"{path}-wal"), Path(f"{path}-journal")):
            digest.update(str(part).encode() + b"\0")
            digest.update(part.read_bytes() if part.is_file() else b"<absent>")
    return digest.hexdigest()


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` and its digest: to show that nothing was created."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "<dir>"
        for p in sorted(root.rglob("*"))
    }


def assert_refused(result: Result) -> None:
    """An ``error:`` line, a non-zero exit, no traceback and nothing raw on the terminal."""
    # CliRunner keeps an uncaught exception instead of printing its traceback.
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code != 0, result.output
    assert re.search(r"^error: \S", result.stderr, re.MULTILINE), result.stderr
    assert "Traceback" not in result.output
    assert not RAW_CONTROL.search(result.output), ascii(result.output[:300])


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A project with a paused run (b-1: unknown effect charge#1), a run waiting for the
    event ``approved`` (a-1) and a run waiting for an approval (o-1)."""
    root = tmp_path_factory.mktemp("hostile-cli")
    (root / f"{APP_MODULE}.py").write_text(APP_SOURCE)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setattr(sys, "path", list(sys.path))
        for name in ("DURABLY_APP", "DURABLY_DATABASE_URL", "DURABLY_LEASE_TTL"):
            patch.delenv(name, raising=False)
        sys.modules.pop(APP_MODULE, None)
        ok("start", "billing", "--input", '{"amount": 3}', "--run-id", "b-1")
        ok("start", "approval", "--run-id", "a-1")
        ok("start", "ordering", "--input", '{"customer": "c-1", "amount": 2}', "--run-id", "o-1")
        ok("worker", "--until-idle")
        statuses = {r["run_id"]: r["status"] for r in json.loads(ok("runs", "list", "--json"))}
        assert statuses == {"b-1": "paused", "a-1": "waiting_external", "o-1": "waiting_approval"}
        yield root
        sys.modules.pop(APP_MODULE, None)


@pytest.mark.parametrize("argv", TABLE)
def test_bad_input_is_refused_and_nothing_is_stored(project: Path, argv: list[str]) -> None:
    db = project / "app.db"
    before = fingerprint(db)
    result = durably(*argv)
    assert_refused(result)
    assert fingerprint(db) == before


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["start", "summing", "--input", JSON_CASES[case]], id=f"--input {case}")
        for case in ("nul", "nul-key", "surrogate", "nested-100", "huge-int")
    ]
    + [
        pytest.param(
            ["start", "summing", "--input", "[1]", "--run-id", ID_CASES[case]],
            id=f"--run-id {case}",
        )
        for case in ("percent-nul", "undecodable-argv", "escape-sequence", "overlong")
    ]
    + [
        pytest.param(
            ["start", "summing", "--input", "[1]", "--tenant", ID_CASES[case]],
            id=f"--tenant {case}",
        )
        for case in ("key-separator", "undecodable-argv")
    ],
)
def test_bad_input_is_refused_on_postgres(
    project: Path, postgres_schema: str, argv: list[str]
) -> None:
    """PostgreSQL refuses NUL in text and JSON on its own: the CLI must refuse it first,
    with its own message, not a driver error."""
    import psycopg

    url = postgres_schema_url(postgres_schema)
    ok("--db", url, "migrate")

    def rows() -> int:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM durably_runs) + (SELECT count(*) FROM durably_events)"
            ).fetchone()
            assert row is not None
            return int(row[0])

    result = durably("--db", url, *argv)
    assert_refused(result)
    assert rows() == 0


# -- the database itself ----------------------------------------------------------------


def bad_databases(root: Path) -> dict[str, str]:
    """Database URLs that cannot be durably's database, after making what they point at."""
    (root / "random.db").write_bytes(os.urandom(8192))
    (root / "adir").mkdir()
    (root / "afile").write_text("not a directory\n")
    (root / "text.db").write_text("SQLite format 3 is what this file is not\n")
    damaged = root / "damaged.db"
    assert durably("--db", f"sqlite:///{damaged}", "migrate", app=None).exit_code == 0
    size = damaged.stat().st_size
    with damaged.open("r+b") as file:  # the header page kept, the schema's pages gone
        file.seek(4096)
        file.write(b"\xff" * (size - 4096))
    return {
        "random-bytes": f"sqlite:///{root}/random.db",
        "text-file": f"sqlite:///{root}/text.db",
        "damaged": f"sqlite:///{root}/damaged.db",
        "directory": f"sqlite:///{root}/adir",
        "directory-slash": f"sqlite:///{root}/adir/",
        "under-a-file": f"sqlite:///{root}/afile/durably.db",
        "deep-under-a-file": f"sqlite:///{root}/afile/x/y/durably.db",
        "missing-directory": f"sqlite:///{root}/missing/durably.db",
        "empty": "",
        "empty-path": "sqlite:///",
        "no-scheme": f"{root}/durably.db",
        "unknown-scheme": "mysql://root@localhost/durably",
        "control-characters": f"sqlite:///{root}/new\x1b]52;c;aGk=\x07.db",
        "undecodable": f"sqlite:///{root}/new\udcff.db",
        "postgres-bad-percent": "postgresql://postgres:s3cret@127.0.0.1/%zz",
        "postgres-nul-escape": f"{POSTGRES_URL}?options=-csearch_path%3Dx%00y",
        "postgres-unreachable": "postgresql://postgres@127.0.0.1:1/test",
    }


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["migrate"], id="migrate"),
        pytest.param(["runs", "list"], id="runs list"),
        pytest.param(["worker", "--until-idle"], id="worker"),
        pytest.param(["start", "summing", "--input", "[1]"], id="start"),
    ],
)
@pytest.mark.parametrize(
    "case",
    [
        "random-bytes",
        "text-file",
        "damaged",
        "directory",
        "directory-slash",
        "under-a-file",
        "deep-under-a-file",
        "missing-directory",
        "empty",
        "empty-path",
        "no-scheme",
        "unknown-scheme",
        "control-characters",
        "undecodable",
        "postgres-bad-percent",
        "postgres-nul-escape",
        "postgres-unreachable",
    ],
)
def test_a_bad_database_is_a_clear_error_and_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, command: list[str]
) -> None:
    """Nothing is created, converted or written anywhere: not at the bad path, and not in
    the app's own database (``--db ""`` must not fall back to it)."""
    (tmp_path / f"{APP_MODULE}.py").write_text(APP_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("DURABLY_DATABASE_URL", raising=False)
    sys.modules.pop(APP_MODULE, None)
    url = bad_databases(tmp_path)[case]
    before = tree(tmp_path)

    result = durably("--db", url, *command, app=None if command == ["migrate"] else APP)
    sys.modules.pop(APP_MODULE, None)

    assert_refused(result)
    assert tree(tmp_path) == before
    assert "s3cret" not in result.output
    if url.startswith("sqlite:///" + str(tmp_path)):
        # The message names the file and says what to do about it.
        assert str(tmp_path) in result.stderr


def _package_root(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None
    assert spec.origin is not None
    return str(Path(spec.origin).resolve().parents[1])


def _as_another_user() -> tuple[str, dict[str, Any]]:
    """An interpreter and ``subprocess`` options under which a root-owned 0600 file is
    unreadable: the current user if not root, else nobody (file modes do not bind root)."""
    if os.geteuid() != 0:
        return sys.executable, {}
    # nobody may not reach this interpreter (under /root): the system one of the same
    # version, given the packages' directories, will do.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join(_package_root(name) for name in ("durably", "click")),
    }
    options: dict[str, Any] = {"user": 65534, "group": 65534, "extra_groups": [], "env": env}
    for python in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        try:
            probe = subprocess.run(
                [python, "-c", "import durably.cli"], capture_output=True, check=False, **options
            )
        except OSError:
            continue
        if probe.returncode == 0:
            return python, options
    pytest.fail(
        "running as root, and no Python interpreter the user nobody may run: install "
        f"Debian's python{sys.version_info[0]}.{sys.version_info[1]} (root ignores file modes, so "
        "an unreadable file can only be shown to another user)"
    )


def test_an_unreadable_database_is_a_clear_error() -> None:
    """A database file this user may not read and write."""
    root = Path(tempfile.mkdtemp(prefix="durably-unreadable-"))
    try:
        root.chmod(0o777)
        db = root / "durably.db"
        url = f"sqlite:///{db}"
        assert durably("--db", url, "migrate", app=None).exit_code == 0
        db.chmod(0o600 if os.geteuid() == 0 else 0)
        before = fingerprint(db)
        python, options = _as_another_user()
        refused = subprocess.run(
            [python, "-m", "durably", "--db", url, "migrate"],
            capture_output=True,
            text=True,
            check=False,
            cwd=root,
            **options,
        )
        assert refused.returncode != 0
        assert refused.stderr.startswith("error: "), refused.stderr
        assert "Traceback" not in refused.stderr
        assert str(db) in refused.stderr
        assert "permission denied" in refused.stderr
        assert fingerprint(db) == before
        assert sorted(p.name for p in root.iterdir()) == ["durably.db"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- real processes -----------------------------------------------------------------------


def test_undecodable_command_line_bytes_are_refused_in_a_real_process(project: Path) -> None:
    """A shell passes bytes; Python turns invalid UTF-8 into lone surrogates, which no
    store can hold and no strict terminal encoder can print."""
    db = project / "app.db"
    before = fingerprint(db)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    for argv in (
        [b"start", b"summing", b"--input", b"[1]", b"--run-id", b"r\xff\xfe"],
        [b"event", b"a-1", b"appr\xffoved", b"--event-id", b"e-9"],
        [b"approve", b"o-1", b"--by", b"\xe9ve"],
        [b"runs", b"show", b"\x1b]52;c;aGk=\x07\xff"],
    ):
        result = subprocess.run(
            [sys.executable.encode(), b"-m", b"durably", b"--app", APP.encode(), *argv],
            capture_output=True,
            cwd=project,
            env=env,
            check=False,
        )
        assert result.returncode != 0, argv
        assert result.stderr.startswith(b"error: "), result.stderr
        assert b"Traceback" not in result.stderr
        assert not re.search(rb"[\x00-\x09\x0b-\x1f\x7f]", result.stdout + result.stderr)
    assert fingerprint(db) == before


def test_serve_on_a_file_that_is_not_a_database_answers_health_503(tmp_path: Path) -> None:
    """The documented contract of /api/health: up, but the database cannot be opened."""
    (tmp_path / f"{APP_MODULE}.py").write_text(APP_SOURCE)
    path = tmp_path / "random.db"
    path.write_bytes(os.urandom(8192))
    before = fingerprint(path)
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    with log.open("wb") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "durably",
                "--app",
                APP,
                "--db",
                f"sqlite:///{path}",
                "serve",
                "--port",
                "0",
            ],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(rb"running on http://127.0.0.1:(\d+)", log.read_bytes())):
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", int(found.group(1)), timeout=10)
        conn.request("GET", "/api/health")
        health = conn.getresponse()
        body = health.read().decode()
        conn.close()
        assert health.status == 503, (health.status, body)
        # Anyone may ask for health: the path stays in the server's log.
        assert str(tmp_path) not in body, body
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert "is not a SQLite database" in log.read_text()
    assert "Traceback" not in log.read_text()
    assert fingerprint(path) == before


def test_a_refused_database_is_refused_at_once(tmp_path: Path) -> None:
    """A refused database is refused at once, not after the 30 s busy wait."""
    path = tmp_path / "random.db"
    path.write_bytes(os.urandom(8192))
    started = time.monotonic()
    result = durably("--db", f"sqlite:///{path}", "migrate", app=None)
    assert_refused(result)
    assert time.monotonic() - started < 5


def test_damage_found_in_the_middle_of_a_query_is_a_clear_error(
    project: Path, tmp_path: Path
) -> None:
    """A file whose schema reads fine but whose data pages are damaged: the read that hits
    them is refused as an unavailable store, never a traceback."""
    import sqlite3

    path = tmp_path / "worn.db"
    url = f"sqlite:///{path}"
    assert durably("--db", url, "migrate", app=None).exit_code == 0
    with sqlite3.connect(path) as db:
        db.executemany(
            "INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status, "
            "input_json, input_hash, available_at, created_at, updated_at) "
            "VALUES (?, 'default', 'wf', '1', 'queued', ?, 'h', 0, 0, 0)",
            [(f"r{i}", json.dumps({"pad": "x" * 500})) for i in range(400)],
        )
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = path.stat().st_size
    with path.open("r+b") as file:
        file.seek(size // 2)
        file.write(b"\xff" * (size - size // 2))
    result = durably("--db", url, "runs", "list", "--limit", "1000")
    assert_refused(result)
    assert "malformed" in result.stderr or "not a database" in result.stderr, result.stderr


@pytest.mark.parametrize("value", list(SECONDS_CASES.values()), ids=list(SECONDS_CASES))
def test_serve_refuses_a_read_timeout_that_is_no_number_of_seconds(
    value: str, project: Path
) -> None:
    """Refused before anything is served (NaN would close every connection at once)."""
    result = durably("serve", "--read-timeout", value)
    assert_refused(result)
    assert "'--read-timeout'" in result.stderr, result.stderr
