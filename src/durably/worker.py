"""The worker: claims runnable runs under a lease, executes them, recovers dead workers' runs.

A run whose worker died keeps its lease until ``lease_until``; after that any worker claims
it, and the runtime reconciles its in-flight effects before anything else (never a blind
re-execution). SIGTERM/SIGINT stop claiming new runs; a run in progress is released at
its next call boundary (never in the middle of an effect) for another worker to continue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TYPE_CHECKING

from durably import faults, owners, runtime
from durably.errors import InvalidTransition, StoreUnavailable
from durably.exposition import MetricsServer
from durably.status import PauseReason, RunStatus
from durably.store.base import Claim, EventWrite, Expect, RunUpdate, Transition
from durably.values import check_duration, check_setting

if TYPE_CHECKING:
    from durably.engine import HasEngine

log = logging.getLogger("durably.worker")

MAX_BACKOFF_S = 10.0
"""The longest wait between two attempts to reach a store that is unavailable."""

CLAIM_BATCH_MAX = 100
"""Runs leased in one claim transaction at most: a bigger one holds SQLite's write lock
(and PostgreSQL's row locks) longer than a commit, for little more saved."""


class Worker:
    """Executes an app's runs: ``app.worker(concurrency=4).run()``.

    ``concurrency`` runs are executed at once in this process; run as many processes, on
    as many machines, as the store allows (SQLite: one machine; PostgreSQL: any).

    ``recheck_paused``: a run paused ``effect_state_unknown`` at a tool that can reconcile
    (the service could not say in time) is queued again once it has been paused that long,
    so the service is asked again without a person; ``None`` leaves it to a person.

    ``metrics_port``: serve this process's Prometheus ``/metrics`` on ``metrics_host``
    while the worker runs (one scrape target per worker process).
    """

    def __init__(
        self,
        app: HasEngine,
        *,
        concurrency: int = 1,
        lease_ttl: timedelta = timedelta(seconds=30),
        poll_interval: timedelta = timedelta(milliseconds=500),
        recheck_paused: timedelta | None = timedelta(minutes=10),
        metrics_host: str = "127.0.0.1",
        metrics_port: int | None = None,
    ) -> None:
        check_setting(concurrency, "worker concurrency", low=1)
        check_duration(lease_ttl, "lease_ttl")
        check_duration(poll_interval, "poll_interval")
        if recheck_paused is not None:
            check_duration(recheck_paused, "recheck_paused", zero=True)
        self.engine = app.engine
        self.concurrency = concurrency
        self.lease_ttl_s = lease_ttl.total_seconds()
        self.poll_interval_s = poll_interval.total_seconds()
        self.recheck_paused_s = None if recheck_paused is None else recheck_paused.total_seconds()
        self.worker_id = owners.owner_name("worker")
        self.metrics_address = None if metrics_port is None else (metrics_host, metrics_port)
        self.metrics_url: str | None = None
        """Where this worker serves ``/metrics`` while it runs (None: it does not)."""
        self.executed = 0
        """Run executions performed (a run that waits and resumes counts each time)."""
        self._stopping = asyncio.Event()
        self._outage: StoreUnavailable | None = None
        """The outage that ended a run ``until_idle`` (raised once its slots have stopped)."""
        self._work = asyncio.Condition()
        # Batch claims: the slots waiting for a run claim together, one transaction for all.
        self._claiming = asyncio.Lock()
        self._idle = 0
        self._claimed: list[Claim] = []
        self._batches = 0
        self._short_batch = -1
        """The last claim transaction that got fewer runs than it asked for."""
        self._loop: asyncio.AbstractEventLoop | None = None

    def stop(self) -> None:
        """Stop claiming; each run in progress is released at its next call boundary.

        Safe to call from any thread or a signal handler.
        """
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._stop_now)
        else:
            self._stopping.set()

    def _stop_now(self) -> None:
        self._stopping.set()
        asyncio.get_running_loop().create_task(self._wake_all())

    def run(self, *, until_idle: bool = False) -> int:
        """Block running the worker until stopped (SIGTERM/SIGINT) or, with ``until_idle``,
        until no run is runnable now. Returns how many run executions it performed."""
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in handled:
                previous[sig] = signal.signal(sig, lambda *_: self.stop())
        try:
            # On the App's own loop: the store's connections are shared, not reopened.
            return self.engine.block(self.run_async(until_idle=until_idle))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def run_async(self, *, until_idle: bool = False) -> int:
        """The worker on the running loop; handles SIGTERM/SIGINT if that is the main one."""
        loop = self._loop = asyncio.get_running_loop()
        async with self._serving_metrics(loop):
            return await self._run_async(loop, until_idle)

    @contextlib.asynccontextmanager
    async def _serving_metrics(self, loop: asyncio.AbstractEventLoop) -> AsyncIterator[None]:
        if self.metrics_address is None:
            yield
            return
        # Opened before the first scrape, which would otherwise race this open with its own.
        await self.engine.open()
        server = MetricsServer(self.engine, loop, *self.metrics_address)
        self.metrics_url = server.url
        log.info("worker %s: serving metrics at %s", self.worker_id, server.url)
        try:
            yield
        finally:
            self.metrics_url = None
            # Off the loop: a scrape in progress needs the loop to finish.
            await asyncio.to_thread(server.close)

    async def _run_async(self, loop: asyncio.AbstractEventLoop, until_idle: bool) -> int:
        handled: list[signal.Signals] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
                handled.append(sig)
        if not await self._started(until_idle):
            return self.executed
        if until_idle:
            await self.recheck_paused()
        # Slots that stop when idle never wait for work: no listener (nor its connection).
        listener = None if until_idle else asyncio.create_task(self._listen())
        rechecks = (
            None
            if until_idle or self.recheck_paused_s is None
            else asyncio.create_task(self._rechecks(self.recheck_paused_s))
        )
        sweeps = None if until_idle else asyncio.create_task(self._sweeps())
        slots = [asyncio.create_task(self._slot(until_idle)) for _ in range(self.concurrency)]
        try:
            await asyncio.gather(*slots)
        finally:
            for task in (rechecks, sweeps):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if listener is not None:
                # The store closes the listener's connection when this task ends.
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
            for sig in handled:
                loop.remove_signal_handler(sig)
        if self._outage is not None:
            raise self._outage
        return self.executed

    async def _rechecks(self, every_s: float) -> None:
        while not self._stopping.is_set():
            try:
                if await self.recheck_paused():
                    await self._wake_all()
            except StoreUnavailable as exc:
                log.warning("worker %s: cannot recheck paused runs (%s)", self.worker_id, exc)
            await asyncio.sleep(min(max(every_s, 1.0), 60.0))

    async def _sweeps(self) -> None:
        # Sooner than any lease runs out, and cheap: one indexed read while no one died.
        every_s = min(self.lease_ttl_s / 3, 5.0)
        while not self._stopping.is_set():
            await asyncio.sleep(every_s)
            try:
                if await self.recover_dead_owners():
                    await self._wake_all()
            except StoreUnavailable as exc:
                log.warning("worker %s: cannot look for dead owners (%s)", self.worker_id, exc)

    async def _started(self, until_idle: bool) -> bool:
        """Open the store (migrating it) and recover dead owners' runs; False if the worker
        was stopped first.

        A serving worker started while its database is down (restarting, or deployed at the
        same moment) waits for it, as its slots do once running, instead of exiting. One run
        ``until_idle`` reports the outage at once.
        """
        backoff = self.poll_interval_s
        while True:
            try:
                await self.engine.open()
                await self.recover_dead_owners()
                return True
            except StoreUnavailable as exc:
                if until_idle:
                    raise
                log.warning(
                    "worker %s: the store is unavailable (%s); trying again in %.1f s",
                    self.worker_id,
                    exc,
                    backoff,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            if self._stopping.is_set():
                return False
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def recover_dead_owners(self) -> list[str]:
        """End the leases held by workers of this machine whose process is gone, so their
        runs are recovered now instead of when the lease runs out; returns those owners.

        Only a process this one can see is judged (same boot, same pid namespace: see
        ``durably.owners``); any other owner's lease is waited out.
        """
        store = self.engine.store
        gone = owners.dead(await store.live_owners())
        if gone:
            freed = await store.expire_leases(gone)
            log.info("worker %s: %d runs of dead owners %s recovered", self.worker_id, freed, gone)
        return gone

    async def recheck_paused(self, *, limit: int = 100) -> list[str]:
        """Queue again the runs paused ``effect_state_unknown`` for at least
        ``recheck_paused`` at a call of a tool that can reconcile, which their replay reaches
        again (not one left unsettled when the workflow had ended); returns their ids."""
        if self.recheck_paused_s is None:
            return []
        store = self.engine.store
        now = await store.now()
        queued: list[str] = []
        for run in await store.list_runs(status=RunStatus.PAUSED, limit=limit):
            waiting = run.waiting_for or {}
            tool = self.engine.registry.tool_def(str(waiting.get("tool")), missing_ok=True)
            if (
                run.status_reason != PauseReason.EFFECT_STATE_UNKNOWN
                or waiting.get("workflow_ended")
                or tool is None
                or not tool.can_reconcile
                or f"{run.workflow}|{run.workflow_version}" not in self.engine.registry.versions
                or now - run.updated_at < self.recheck_paused_s
            ):
                continue
            try:
                await store.commit(
                    Expect(run.run_id, run.state_version),
                    Transition(
                        events=[
                            EventWrite(
                                "run_resumed",
                                None,
                                {"from": run.status_reason, "by": "recheck", "tool": tool.name},
                            )
                        ],
                        run=RunUpdate(RunStatus.QUEUED),
                    ),
                )
            except InvalidTransition:
                continue  # another worker (or a person) got there first
            queued.append(run.run_id)
        return queued

    async def _listen(self) -> None:
        """Wake the idle slots when the store says a run became runnable."""
        store = self.engine.store
        while not self._stopping.is_set():
            try:
                notified = await store.wait_for_work(self.poll_interval_s)
            except StoreUnavailable:
                await asyncio.sleep(self.poll_interval_s)
                continue
            if notified:
                await self._wake_all()

    async def _wake_all(self) -> None:
        async with self._work:
            self._work.notify_all()

    async def _next_claim(self, workflows: list[str]) -> Claim | None:
        """A run for this slot: one claimed with the other slots waiting now, or none.

        One slot at a time claims, for every slot waiting (itself included), in a single
        transaction; the others take the runs it got as soon as it lets go. A run is
        claimed only for a slot already waiting, so none sits leased with no one on it.
        """
        waiting_since = self._batches
        self._idle += 1
        try:
            async with self._claiming:
                if not self._claimed:
                    # Stopping; or a batch taken while this slot waited, counting it, came
                    # back short: nothing was left for it then (one empty claim, not one a slot).
                    if self._stopping.is_set() or self._short_batch >= waiting_since:
                        return None
                    # One turn of the loop first: the slots freed at the same moment join.
                    await asyncio.sleep(0)
                    limit = min(self._idle, CLAIM_BATCH_MAX)
                    self._claimed = await self.engine.store.claim_batch(
                        self.worker_id, self.lease_ttl_s, workflows, limit
                    )
                    if len(self._claimed) < limit:
                        self._short_batch = self._batches
                    self._batches += 1
                    if self._claimed:
                        faults.crash_point("worker.after_claim")
                return self._claimed.pop(0) if self._claimed else None
        finally:
            self._idle -= 1

    async def _slot(self, until_idle: bool) -> None:
        store = self.engine.store
        workflows = self.engine.registry.versions
        backoff = self.poll_interval_s
        while not self._stopping.is_set():
            try:
                claim = await self._next_claim(workflows)
                if claim is None and not until_idle:
                    wakeup = await store.next_wakeup(workflows)
            except StoreUnavailable as exc:
                if until_idle:
                    # Reported, as when it starts: retrying could last for ever (a full disk).
                    # The other slots stop at their runs' next boundary.
                    self._outage = self._outage or exc
                    self.stop()
                    return
                # The database is down or restarting: keep trying, a little slower each time.
                log.warning("worker %s: store unavailable (%s); retrying", self.worker_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            backoff = self.poll_interval_s
            if claim is not None:
                self.executed += 1
                try:
                    await runtime.drive(self.engine, claim, self._stopping)
                except Exception:
                    log.exception("run %s: unexpected error in the runtime", claim.run.run_id)
                continue
            if until_idle:
                return
            delay = self.poll_interval_s
            if wakeup is not None:
                delay = min(delay, max(wakeup - time.time(), 0.0))
            async with self._work:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), timeout=max(delay, 0.01))
