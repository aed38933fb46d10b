"""Delivering the event log to consumers: the transactional outbox, read side.

Every state change commits its event in the same transaction (the event log is the
outbox), so nothing that happened can be missed, even if the process died right after
the commit. A :class:`Subscription` hands each event to its handler, in order within a
run, and acknowledges it in the per-consumer inbox once the handler returned: an event is
acknowledged once per consumer. If the process dies between the handler and the
acknowledgement, the event is handed over again — so a handler with its own side effects
deduplicates by ``event.event_id`` (stable, ``"<run_id>:<sequence>"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from durably.definitions import invoke
from durably.errors import ConfigurationError, StoreUnavailable
from durably.store.base import Event
from durably.values import check_setting

if TYPE_CHECKING:
    from durably.engine import HasEngine

log = logging.getLogger("durably.subscription")


class Subscription:
    """Hands a consumer every event of the app's store: ``app.subscribe(fn, consumer=...)``."""

    def __init__(
        self,
        app: HasEngine,
        handler: Callable[[Event], Any],
        *,
        consumer: str,
        batch: int = 100,
        poll_interval: timedelta = timedelta(milliseconds=500),
    ) -> None:
        if not consumer:
            raise ConfigurationError("a subscription needs a consumer name (its inbox key)")
        self.engine = app.engine
        self.handler = handler
        self.consumer = consumer
        self.batch = check_setting(batch, "batch", low=1)
        self.poll_interval_s = poll_interval.total_seconds()
        self.delivered = 0
        self._stopping = asyncio.Event()

    async def deliver_once(self) -> int:
        """Hand over the pending events once; returns how many were acknowledged.

        A handler that raises leaves its event pending (retried next time) and holds back
        the later events of the same run, so each run's events arrive in order.
        """
        store = await self.engine.open()
        held: set[str] = set()
        acknowledged = 0
        while True:
            # Held runs are left out of the next batch, so one failing run cannot fill it.
            batch = await store.undelivered(self.consumer, self.batch, skip_runs=sorted(held))
            if not batch:
                break
            for event in batch:
                if event.run_id in held:
                    continue
                try:
                    await invoke(self.handler, event)
                except Exception:
                    log.exception("consumer %s failed on event %s", self.consumer, event.event_id)
                    held.add(event.run_id)
                    continue
                if await store.acknowledge(self.consumer, event.event_id):
                    acknowledged += 1
        self.delivered += acknowledged
        return acknowledged

    async def run_async(self, *, until_idle: bool = False) -> int:
        """Deliver until stopped (or, with ``until_idle``, until nothing is pending)."""
        while not self._stopping.is_set():
            try:
                acknowledged = await self.deliver_once()
            except StoreUnavailable as exc:
                log.warning("consumer %s: store unavailable (%s)", self.consumer, exc)
                acknowledged = 0
            if acknowledged:
                continue
            if until_idle:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.poll_interval_s)
        return self.delivered

    def run(self, *, until_idle: bool = False) -> int:
        """Block delivering events; returns how many were acknowledged in all."""
        return self.engine.block(self.run_async(until_idle=until_idle))

    def stop(self) -> None:
        self._stopping.set()
