"""A throwaway PostgreSQL cluster for the tests that stop or restart the server.

The machine's PostgreSQL (127.0.0.1:5432) is shared with everyone running tests; a test
that needs an outage gets its own cluster instead: ``initdb`` in a temporary directory,
a free port on 127.0.0.1, ``pg_ctl`` from ``/usr/lib/postgresql/*/bin``, and it is
stopped and deleted when the test ends, whatever happened. As root (PostgreSQL refuses
to run as root) every command runs as the ``postgres`` system user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HOST = "127.0.0.1"
# --no-sync: its files are thrown away with it.
INITDB_OPTIONS = ["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"]


def _bin(name: str) -> str:
    found = glob.glob(f"/usr/lib/postgresql/*/bin/{name}")
    if not found:
        raise RuntimeError(f"no {name} under /usr/lib/postgresql/*/bin: install PostgreSQL")
    return max(found, key=lambda path: float(Path(path).parts[-3]))  # the newest version


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


class Cluster:
    """One running PostgreSQL cluster owned by a test; see :func:`throwaway_cluster`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = 0
        self.url = ""

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def pg_ctl(self, action: str, *options: str) -> subprocess.CompletedProcess[str]:
        """``pg_ctl ACTION`` on this cluster (``-w``: start and restart wait until ready)."""
        argv = [_bin("pg_ctl"), action, "-D", str(self.data), "-l", str(self.log), "-w"]
        return subprocess.run(
            self._as_owner([*argv, *options]),
            timeout=90,
            capture_output=True,
            text=True,
            check=False,
        )

    def ready(self) -> bool:
        done = subprocess.run(
            [_bin("pg_isready"), "-q", "-h", HOST, "-p", str(self.port)], timeout=15, check=False
        )
        return done.returncode == 0

    def ensure_up(self, timeout: float = 60.0) -> None:
        """Leave the server running whatever happened: start it if it is down, wait for it."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not (self.data / "postmaster.pid").exists():
                self.pg_ctl("start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the throwaway PostgreSQL did not come up:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"

    def _init(self) -> None:
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
        done = subprocess.run(
            self._as_owner([_bin("initdb"), "-D", str(self.data), *INITDB_OPTIONS]),
            timeout=120,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{done.stdout}{done.stderr}")

    def _start_on_a_free_port(self, attempts: int = 3) -> None:
        for _ in range(attempts):  # another process may take the port before the server does
            self.port = _free_port()
            self.url = f"postgresql://postgres@{HOST}:{self.port}/postgres"
            # In the configuration, not on pg_ctl's command line: every later start or
            # restart (after the test stopped it) comes back on the same port.
            (self.data / "postgresql.auto.conf").write_text(
                f"port = {self.port}\nlisten_addresses = '{HOST}'\n"
                f"unix_socket_directories = '{self.root}'\n"
            )
            if self.pg_ctl("start").returncode == 0:
                return
        raise RuntimeError(f"cannot start a throwaway PostgreSQL:\n{self.log_tail()}")

    def _destroy(self) -> None:
        pidfile = self.data / "postmaster.pid"
        if pidfile.exists():
            self.pg_ctl("stop", "-m", "immediate")
        if pidfile.exists():  # pg_ctl could not stop it (it was starting, say): kill it
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def throwaway_cluster() -> Iterator[Cluster]:
    """A fresh cluster, running; stopped (immediately) and deleted on the way out."""
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="durably-pg-")))
    try:
        cluster._init()
        cluster._start_on_a_free_port()
        yield cluster
    finally:
        cluster._destroy()
