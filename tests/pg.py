"""Throwaway PostgreSQL clusters: the suite's own server, and one per test that needs an outage.

A cluster is ``initdb`` in a temporary directory, a free port on 127.0.0.1 and the machine's
server programs (``$DURABLY_TEST_POSTGRES_BIN``, else the newest ``/usr/lib/postgresql/*/bin``,
else ``$PATH``). PostgreSQL refuses to run as root, so as root every command runs as the
``postgres`` system user. Whatever happens to the process that started it — a failing test,
Ctrl-C, SIGKILL — the server is stopped and its directory deleted: by its owner on the way
out, or else by a small watchdog process that waits for its owner to disappear.

Standard library only: this file is also the watchdog's program (``python pg.py reap DIR``).
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
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HOST = "127.0.0.1"
PROGRAMS = ("initdb", "pg_ctl", "pg_isready")
# --no-sync: its files are thrown away with it.
INITDB_OPTIONS = ["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"]
MISSING = (
    "PostgreSQL's server programs ({missing}) are not installed (looked in {where}). "
    "The tests start a throwaway PostgreSQL of their own: install it with "
    "`apt-get install postgresql`, or set DURABLY_TEST_POSTGRES_URL to a server they may use."
)


class PostgresMissing(RuntimeError):
    """PostgreSQL's server programs are not on this machine."""


def find_bin_dir() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``; :class:`PostgresMissing` otherwise."""
    chosen = os.environ.get("DURABLY_TEST_POSTGRES_BIN")
    if chosen:
        candidates, where = [Path(chosen)], f"$DURABLY_TEST_POSTGRES_BIN={chosen}"
    else:
        # Newest version first; then $PATH (Fedora, Homebrew keep them there).
        debian = sorted(
            (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")),
            key=lambda d: [int(part) for part in d.parent.name.split(".") if part.isdigit()],
            reverse=True,
        )
        on_path = shutil.which("initdb")
        candidates = [*debian, *([Path(on_path).parent] if on_path else [])]
        where = "/usr/lib/postgresql/*/bin and $PATH"
    for directory in candidates:
        if all(os.access(directory / name, os.X_OK) for name in PROGRAMS):
            return directory
    missing = [n for n in PROGRAMS if not any((d / n).exists() for d in candidates)]
    raise PostgresMissing(MISSING.format(missing=", ".join(missing or PROGRAMS), where=where))


def _bin(name: str) -> str:
    return str(find_bin_dir() / name)


def _as_owner(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


class Cluster:
    """One PostgreSQL cluster in its own directory; see :func:`throwaway_cluster`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = 0
        self.url = ""
        self._watchdog: subprocess.Popen[bytes] | None = None

    @classmethod
    def create(cls, port: int | None = None) -> Cluster:
        """A new cluster, running on ``port`` (else a free one). On failure nothing is left."""
        bin_dir = find_bin_dir()  # before creating anything: a clear error, nothing to clean
        cluster = cls(Path(tempfile.mkdtemp(prefix="durably-pg-")))
        try:
            cluster._watch()
            cluster._init(bin_dir)
            cluster._start(port)
        except BaseException:
            cluster.destroy()
            raise
        return cluster

    def pg_ctl(self, action: str, *options: str) -> subprocess.CompletedProcess[str]:
        """``pg_ctl ACTION`` on this cluster (``-w``: start and restart wait until ready)."""
        argv = [_bin("pg_ctl"), action, "-D", str(self.data), "-l", str(self.log), "-w"]
        return subprocess.run(
            _as_owner([*argv, *options]),
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

    def _watch(self) -> None:
        """Start the watchdog: it reaps this cluster once our end of its stdin closes, which
        the kernel does for us however this process ends."""
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", __file__, "reap", str(self.root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C and a closed terminal hit pytest, not the reaper
        )

    def _init(self, bin_dir: Path) -> None:
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresMissing(
                    "running as root, the throwaway PostgreSQL needs the `postgres` system user "
                    "to run as (`apt-get install postgresql` creates it)"
                ) from None
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
        done = subprocess.run(
            _as_owner([str(bin_dir / "initdb"), "-D", str(self.data), *INITDB_OPTIONS]),
            timeout=120,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{done.stdout}{done.stderr}")

    def _start(self, port: int | None, attempts: int = 3) -> None:
        for _ in range(1 if port else attempts):  # another process may take a free port first
            self.port = port or free_port()
            self.url = f"postgresql://postgres@{HOST}:{self.port}/postgres"
            # In the configuration, not on pg_ctl's command line: every later start or
            # restart (after a test stopped it) comes back on the same port. fsync off: the
            # files are thrown away, and a killed server (the outage tests) still loses no
            # commit — only a crash of the whole machine would.
            (self.data / "postgresql.auto.conf").write_text(
                f"port = {self.port}\nlisten_addresses = '{HOST}'\n"
                f"unix_socket_directories = '{self.root}'\nfsync = off\n"
            )
            if self.pg_ctl("start").returncode == 0:
                return
        raise RuntimeError(f"cannot start a throwaway PostgreSQL:\n{self.log_tail()}")

    def destroy(self) -> None:
        """Stop the server (immediately) and delete its directory; the watchdog then exits."""
        _reap(self.root)
        if self._watchdog is not None:
            watchdog, self._watchdog = self._watchdog, None
            if watchdog.stdin is not None:
                watchdog.stdin.close()
            try:
                watchdog.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a forked child still holds the pipe
                watchdog.kill()
                watchdog.wait(timeout=30)


def _reap(root: Path) -> None:
    data = root / "data"
    pidfile = data / "postmaster.pid"
    if pidfile.exists():
        argv = [_bin("pg_ctl"), "stop", "-D", str(data), "-m", "immediate", "-w"]
        with contextlib.suppress(OSError, subprocess.SubprocessError, PostgresMissing):
            subprocess.run(_as_owner(argv), timeout=90, capture_output=True, check=False)
    if pidfile.exists():  # pg_ctl could not stop it (it was starting, say): kill it
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


@contextmanager
def throwaway_cluster() -> Iterator[Cluster]:
    """A fresh cluster, running; stopped (immediately) and deleted on the way out."""
    cluster = Cluster.create()
    try:
        yield cluster
    finally:
        cluster.destroy()


class Reserved:
    """A port held now for a cluster started later, so its URL can be known before it runs."""

    def __init__(self) -> None:
        # Bound without SO_REUSEADDR, nobody else can bind it until :meth:`start` lets go.
        self._socket: socket.socket | None = socket.socket()
        self._socket.bind((HOST, 0))
        self.port: int = self._socket.getsockname()[1]
        self.url = f"postgresql://postgres@{HOST}:{self.port}/postgres"
        self.cluster: Cluster | None = None

    def start(self) -> Cluster:
        """The cluster on the reserved port: created and started on the first call."""
        if self.cluster is None:
            self.close()
            self.cluster = Cluster.create(self.port)
        return self.cluster

    def close(self) -> None:
        """Destroy the cluster if it was started, and let go of the port."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self.cluster is not None:
            self.cluster.destroy()
            self.cluster = None


if __name__ == "__main__" and sys.argv[1:2] == ["reap"]:
    sys.stdin.buffer.read()  # returns when the owner closed the pipe or died
    _reap(Path(sys.argv[2]))
