"""The engine's collaborators in one object, handed down by the App facade.

Executing runs needs a store, what is registered, the metrics and a few limits; the
runtime, the effects, the worker and the subscriptions receive them here and never reach
back into the facade (``durably.app``), the CLI or the server.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from durably.errors import ConfigurationError
from durably.loop import LoopThread
from durably.metrics import Metrics
from durably.registry import Registry
from durably.store import open_store
from durably.store.base import Store

R = TypeVar("R")


@dataclass(eq=False)
class Engine:
    """The store (opened on first use), the registry, the metrics and the limits."""

    database_url: str
    registry: Registry
    metrics: Metrics
    lease_ttl: timedelta
    """How long a claim lasts unless renewed."""
    max_payload_bytes: int
    """The largest JSON value stored (inputs, results, payloads)."""
    secret_key: bytes | None
    """Keys redacted inputs and seals checkpoints; None when not configured."""
    reconcile_grace: timedelta
    """How long after a dead holder's lease ran out its send may still arrive: a
    reconciliation's "not executed" for its claim is trusted only after that."""
    loop: LoopThread = field(default_factory=LoopThread)
    """Where blocking calls run (one loop, so the store's connections are reused)."""
    _store: Store | None = None

    @property
    def is_open(self) -> bool:
        return self._store is not None

    @property
    def store(self) -> Store:
        if self._store is None:
            raise ConfigurationError("the store is not open yet; call app.open() or run a workflow")
        return self._store

    async def open(self) -> Store:
        """Open the store and apply pending migrations (done on first use)."""
        if self._store is None:
            store = open_store(self.database_url)
            try:
                await store.migrate()
            except BaseException:
                await store.close()  # a caller that tries again opens a new one
                raise
            if self._store is None:
                self._store = store
            else:
                # Another first use opened it while this one migrated (a worker starting
                # beside a read): one store, or the other's connections outlive the App.
                await store.close()
        return self._store

    async def close(self) -> None:
        """Close the store's connections opened in the running event loop."""
        if self._store is not None:
            await self._store.close()
            self._store = None

    def close_ended_loops(self) -> None:
        """Close the store's connections of event loops that have ended (no loop needed)."""
        if self._store is not None:
            self._store.close_ended_loops()

    def block(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run ``coro`` on the engine's loop and wait for it (from outside any loop)."""
        return self.loop.call(coro)


class HasEngine(Protocol):
    """Anything that carries an engine: an ``App``, for ``Worker(app)`` and
    ``Subscription(app, ...)``."""

    @property
    def engine(self) -> Engine: ...
