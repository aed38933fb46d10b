"""Serving the console with uvicorn, with limits a slow or idle client cannot outlast.

uvicorn does not time out a connection that never finishes its request headers (slowloris):
:class:`_TimedH11Protocol` closes one after the read timeout. The body has the same deadline
(:mod:`.guard`), connections are capped, and request headers are bounded by h11 (16 KiB).
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from durably.errors import ConfigurationError
from durably.server.limits import DEFAULT_MAX_CONNECTIONS
from durably.server.settings import ServerSettings

KEEP_ALIVE_SECONDS = 5
MAX_HEADER_BYTES = 16 * 1024


class _TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every wait for request headers.

    uvicorn's own keep-alive timer is cancelled by any byte received, so a client sending
    one header byte at a time (or nothing after connecting) would hold the connection for
    ever. This timer is cancelled only once a request's headers are complete.
    """

    header_timeout: float
    _header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a request is being served; its body has the guard's deadline

    def on_response_complete(self) -> None:
        self._arm()  # before: the next pipelined request may already be complete
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def serve(
    server: FastAPI, *, host: str, port: int, max_connections: int = DEFAULT_MAX_CONNECTIONS
) -> None:
    """Run ``server`` (from :func:`durably.server.create_server`) until SIGINT/SIGTERM."""
    settings: ServerSettings = server.state.settings
    protocol = type(
        "TimedH11Protocol", (_TimedH11Protocol,), {"header_timeout": settings.read_timeout}
    )
    config = uvicorn.Config(
        server,
        host=host,
        port=port,
        http=protocol,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        limit_concurrency=max_connections,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        server_header=False,
    )
    _check_listenable(host, port)
    uvicorn.Server(config).run()


def _check_listenable(host: str, port: int) -> None:
    """A port in use, or a host that is not this machine's, is the command's own error, not
    a log line of uvicorn's and an exit status of its own. (Bound and let go at once: the
    address is reused, and uvicorn binds it again.)"""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
            "(or --host)"
        ) from None
