"""The console's default limits (importable without loading the web stack, for the CLI)."""

from __future__ import annotations

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
"""Host names every console answers to; ``--allowed-host`` adds more."""

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""Largest request body accepted (``--max-body-bytes``); stored values are capped at 1 MiB
too, so a larger body could not be recorded anyway."""

DEFAULT_READ_TIMEOUT = 15.0
"""Seconds a client has to send its request headers, and then again its body."""

MAX_READ_TIMEOUT = 3600.0
"""The longest ``--read-timeout``: a client slower than that is holding a connection open."""

DEFAULT_MAX_CONNECTIONS = 256
"""Open connections served at once (``--max-connections``); beyond it requests get a 503."""
