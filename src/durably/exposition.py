"""Serving ``/metrics``: the process's own counters and the ledger's figures, read now.

Both ``durably serve`` (its ``/metrics`` route) and each worker started with a metrics port
(``durably worker --metrics-port``) answer a scrape with :func:`scrape`: the ledger's
figures are read from the store first, on the loop that owns the store's connections, then
rendered with the process's counters (docs/architecture.md#metrics says which is which).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from durably.engine import Engine
from durably.errors import ConfigurationError, DurablyError

log = logging.getLogger("durably.metrics")

SCRAPE_TIMEOUT_S = 10.0
"""Longest a scrape waits for the worker's loop; Prometheus's own default timeout is 10 s."""


async def scrape(engine: Engine) -> bytes:
    """The Prometheus text of ``engine``'s metrics, with the ledger's figures read now.

    A store that does not answer is no failed scrape: the process's counters are still
    served, the ledger's figures left out and ``agent_ledger_up`` is 0.
    """
    engine.metrics.know_tools(engine.registry.tool_names)
    try:
        figures = await (await engine.open()).ledger_figures()
    except DurablyError as exc:
        log.warning("metrics: cannot read the ledger's figures: %s", exc)
        figures = None
    engine.metrics.ledger.observe(figures)
    return engine.metrics.exposition()


class MetricsServer:
    """``GET /metrics`` for one worker process, on a thread of its own.

    Each scrape is handed to ``loop`` (the worker's), which reads the ledger with the
    worker's store; the worker's runs are not held up while the thread waits.
    """

    def __init__(
        self, engine: Engine, loop: asyncio.AbstractEventLoop, host: str, port: int
    ) -> None:
        # Before the first run: a counter's first sample must be 0 for increase() to see it.
        engine.metrics.know_tools(engine.registry.tool_names)
        server = _IPv6Server if ":" in host else ThreadingHTTPServer
        try:
            self._http = server((host, port), _handler(engine, loop))
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); choose another "
                "--metrics-port or --metrics-host"
            ) from exc
        self._http.daemon_threads = True
        bound_host, bound_port = self._http.server_address[:2]
        self.url = f"http://{_url_host(str(bound_host))}:{bound_port}/metrics"
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="durably-metrics",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _handler(engine: Engine, loop: asyncio.AbstractEventLoop) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "durably-metrics"

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self._send(404, b"not found: durably serves /metrics only\n", "text/plain")
                return
            try:
                future = asyncio.run_coroutine_threadsafe(scrape(engine), loop)
            except RuntimeError as exc:  # the loop is closed: the worker is stopping
                log.warning("metrics: scrape not answered: %r", exc)
                self._send(503, b"the worker is stopping\n", "text/plain")
                return
            try:
                body = future.result(SCRAPE_TIMEOUT_S)
            except FutureTimeout as exc:
                future.cancel()
                # The loop is stopping, or too busy to answer in time.
                log.warning("metrics: scrape not answered: %r", exc)
                self._send(503, b"the worker did not answer in time\n", "text/plain")
                return
            self._send(200, body, CONTENT_TYPE_LATEST)

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape would drown the worker's log

    return Handler
