"""The suite needs no setup and disturbs nobody: it runs its own PostgreSQL and finds or
installs Chromium. Each case runs a real pytest session in a subprocess, with this suite's
fixtures (``-p tests.conftest``), over a small test file of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.pg import throwaway_cluster
from tests.server.browser import ChromiumMissing, install_chromium

ROOT = Path(__file__).resolve().parents[1]
STARTING = "starting a throwaway PostgreSQL for this session"

RECORDING = """
import json, os
from pathlib import Path

import psycopg
import pytest


def record(**values):
    Path(os.environ["RECORD"]).write_text(json.dumps(values))


def server():
    from tests.conftest import POSTGRES_URL

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        port, data = conn.execute(
            "SELECT current_setting('port')::int, current_setting('data_directory')"
        ).fetchone()
    pid = int(Path(data, "postmaster.pid").read_text().split()[0])
    return {"url": POSTGRES_URL, "port": port, "data": data, "pid": pid}
"""


def session(
    tmp_path: Path, source: str, *, wait: bool = True, **env: str
) -> tuple[subprocess.Popen[str], Path]:
    """A pytest session over ``source`` (after :data:`RECORDING`), DURABLY_TEST_* unset
    unless given; its output goes to ``tmp_path/out``, what it records to ``tmp_path/record``."""
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(RECORDING + textwrap.dedent(source))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_TEST_")}
    environ |= {"RECORD": str(tmp_path / "record"), **env}
    argv = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    with (tmp_path / "out").open("w") as out:
        proc = subprocess.Popen(
            [*argv, "-q", "-rA", str(test_file)],
            cwd=ROOT,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    if wait:
        proc.wait(timeout=120)
    return proc, tmp_path / "out"


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting to be reaped counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def assert_no_server_left(seen: dict[str, Any], pid: int) -> None:
    assert not Path(seen["data"]).parent.exists(), "the cluster's directory was left behind"
    assert gone(pid), "the session's PostgreSQL outlived the session"
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(seen["url"], connect_timeout=2).close()


def test_without_a_url_the_session_runs_its_own_postgres_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A failing session still destroys its server; a module that connects to POSTGRES_URL
    from a module fixture, before any schema fixture ran, finds it running."""
    proc, out = session(
        tmp_path,
        """
        from tests.conftest import POSTGRES_URL

        @pytest.fixture(scope="module")
        def direct():
            return server()

        def test_a_module_fixture_connects_first(direct):
            assert direct["url"] == POSTGRES_URL

        def test_a_schema(postgres_schema, direct):
            record(**server())
            assert server() == direct

        def test_that_fails():
            assert False, "a failing test"
        """,
    )
    output = out.read_text()
    assert proc.returncode == 1, output
    assert "1 failed, 2 passed" in output
    assert output.count(STARTING) == 1, output
    seen = json.loads((tmp_path / "record").read_text())
    assert seen["port"] != 5432
    assert seen["url"] == f"postgresql://postgres@127.0.0.1:{seen['port']}/postgres"
    assert_no_server_left(seen, seen["pid"])


def test_a_session_that_needs_no_postgres_starts_none(tmp_path: Path) -> None:
    proc, out = session(
        tmp_path,
        """
        def test_sqlite_only(tmp_path):
            assert tmp_path.exists()
        """,
    )
    output = out.read_text()
    assert proc.returncode == 0, output
    assert STARTING not in output


def test_a_given_server_is_used_and_none_is_started(tmp_path: Path) -> None:
    with throwaway_cluster() as given:
        proc, out = session(
            tmp_path,
            """
            def test_a_schema(postgres_schema):
                record(**server())
            """,
            DURABLY_TEST_POSTGRES_URL=given.url,
        )
        output = out.read_text()
        assert proc.returncode == 0, output
        assert STARTING not in output
        seen = json.loads((tmp_path / "record").read_text())
        assert (seen["url"], seen["port"]) == (given.url, given.port)


def test_without_postgresql_installed_the_session_ends_with_one_message(
    tmp_path: Path,
) -> None:
    """Never a skip, never one error per test: the first test that needs the server ends
    the session, saying what to install."""
    nothing = tmp_path / "empty-bin"
    nothing.mkdir()
    proc, out = session(
        tmp_path,
        """
        def test_one(postgres_schema):
            pass

        def test_two(postgres_schema):
            pass
        """,
        DURABLY_TEST_POSTGRES_BIN=str(nothing),
    )
    output = out.read_text()
    assert proc.returncode not in (0, 5), output
    assert output.count("apt-get install postgresql") == 1, output
    assert "initdb, pg_ctl, pg_isready" in output
    assert "skipped" not in output
    assert "passed" not in output


def test_a_killed_session_leaves_no_server_behind(tmp_path: Path) -> None:
    """SIGKILL gives pytest no chance to clean up: the cluster's watchdog does."""
    proc, _ = session(
        tmp_path,
        """
        import time

        def test_hangs(postgres_schema):
            record(**server())
            time.sleep(120)
        """,
        wait=False,
    )
    record = tmp_path / "record"
    try:
        wait_for(record.exists, 60, "the inner session to start its server")
        seen = json.loads(record.read_text())
        assert not gone(seen["pid"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    wait_for(lambda: gone(seen["pid"]), 30, "the orphaned server to be stopped")
    wait_for(lambda: not Path(seen["data"]).parent.exists(), 30, "its directory to go")
    assert_no_server_left(seen, seen["pid"])


def test_a_missing_chromium_fails_the_browser_tests_saying_what_to_do(tmp_path: Path) -> None:
    proc, out = session(
        tmp_path,
        """
        @pytest.fixture
        def browser():
            return "a browser"

        def test_with_a_browser(browser):
            pass

        def test_without():
            pass
        """,
        DURABLY_TEST_CHROMIUM=str(tmp_path / "no-chromium"),
    )
    output = out.read_text()
    assert proc.returncode == 1, output
    assert "1 passed, 1 error" in output
    assert f"$DURABLY_TEST_CHROMIUM={tmp_path}/no-chromium is not an executable" in output


def test_chromium_is_installed_with_apt_get_when_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apt-get here is a stand-in that records its calls and "installs" a browser: the
    real one would change the machine other tests share."""
    monkeypatch.delenv("DURABLY_TEST_CHROMIUM", raising=False)
    browser = tmp_path / "bin" / "chromium"
    apt_get = tmp_path / "apt-get"
    apt_get.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {tmp_path}/apt-calls\n'
        f'if [ "$1" = install ]; then mkdir -p {browser.parent} && '
        f"printf '#!/bin/sh\\n' > {browser} && chmod +x {browser}; fi\n"
    )
    apt_get.chmod(0o755)
    logged: list[str] = []
    found = install_chromium(logged.append, candidates=[str(browser)], apt_get=str(apt_get))
    assert found == str(browser)
    assert (tmp_path / "apt-calls").read_text().splitlines() == [
        "update -q",
        "install -y -q chromium",
    ]
    assert "installing it" in logged[0]
    assert logged[-1] == f"Chromium installed: {browser}"
    assert install_chromium(logged.append, candidates=[str(browser)], apt_get=str(apt_get))
    assert len((tmp_path / "apt-calls").read_text().splitlines()) == 2, "installed twice"


def test_without_chromium_or_apt_get_the_message_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DURABLY_TEST_CHROMIUM", raising=False)
    with pytest.raises(ChromiumMissing, match=r"no apt-get.*apt-get install chromium"):
        install_chromium(
            print, candidates=[str(tmp_path / "chromium")], apt_get=str(tmp_path / "no-apt")
        )
