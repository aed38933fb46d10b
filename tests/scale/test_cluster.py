"""The throwaway PostgreSQL of the outage tests goes away with its test, whatever happens."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.scale.cluster import throwaway_cluster

pytestmark = pytest.mark.scale


def gone(pid: int, timeout: float = 10.0) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def use_then_fail(seen: dict[str, Any]) -> None:
    with throwaway_cluster() as cluster:
        seen["cluster"] = cluster
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            row = conn.execute("SELECT current_setting('port')::int").fetchone()
        assert row == (cluster.port,)
        assert cluster.port != 5432
        seen["postmaster"] = int((cluster.data / "postmaster.pid").read_text().split()[0])
        raise RuntimeError("the test failed")


def test_a_throwaway_cluster_is_gone_after_a_failing_test() -> None:
    seen: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="the test failed"):
        use_then_fail(seen)
    assert not seen["cluster"].root.exists()
    assert gone(seen["postmaster"]), "the throwaway server outlived its test"
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(seen["cluster"].url, connect_timeout=2).close()
