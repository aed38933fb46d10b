"""Group commit on PostgreSQL: the one-round writes of a process's runs that are ready at
the same moment go out as one round — one round trip, one transaction, one WAL flush.

A write of one round (a step's commit, an effect's, an ending, a new run's start) refuses
by matching no row, never by failing, so the writes of many runs can share one implicit
transaction and each still reads only its own statements' rows. The first write becomes
the round's leader: it lets every task already woken take its turn, and waits while writes
keep joining (see :mod:`.gathering`); they go in its round. Alone, it sends its own round, as
if there were no grouping. While a shared round is on its way, the writes that come
meanwhile gather for the next one, sent as soon as it lands (as a database's own group
commit waits for the flush in progress): under load the rounds grow rather than multiply.
A round held up on the server (a write waiting for a row lock) holds the next one back
for :data:`HELD_UP_S` at most.

* A shared round that the server refused (a unique violation, a deadlock), or that
  failed before its Sync (a value that cannot be sent), applied nothing: each of its
  writes goes again alone, so that only the one at fault fails.
* A shared round cut off (the connection lost) leaves each write's outcome unknown, as
  for a write of its own: a write safe to repeat goes again alone, the others fail with
  the error.
* A shared round runs in a task of its own, so cancelling one waiting run never cuts the
  others' round off; the cancelled run still learns its outcome, then its cancellation
  reaches it at its next ``await``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import psycopg

from durably.errors import StoreUnavailable
from durably.store.gathering import gathered
from durably.store.plans import Plan, Query, Round, Rows

HELD_UP_S = 0.005
"""How long the writes gathered behind a shared round wait for it to land before they go
anyway: a round held on the server (a write waiting for a row lock) must not hold up every
run of the process."""


class Write:
    """One plan whose first round is its only one, waiting for the round that sends it."""

    __slots__ = (
        "done",
        "error",
        "first",
        "idempotent",
        "plan",
        "result",
        "round",
        "settled",
        "steps",
    )

    def __init__(
        self,
        plan: Callable[[], Plan[Any]],
        steps: Generator[Round, list[Rows], Any],
        first: Round,
        idempotent: bool,
    ) -> None:
        self.plan = plan
        self.steps: Generator[Round, list[Rows], Any] | None = steps
        self.first = first
        self.idempotent = idempotent
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.round: asyncio.Task[None] | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.settled = False

    def started(self) -> tuple[Generator[Round, list[Rows], Any], Round] | None:
        """The plan as far as its first round, once: whoever sends it alone goes on from
        there; a second attempt starts the plan afresh."""
        steps, self.steps = self.steps, None
        return None if steps is None else (steps, self.first)


Together = Callable[[list[Query], bool], Awaitable[list[Rows]]]
"""Send these statements (and NOTIFY, if asked) as one round in one implicit transaction."""
Alone = Callable[[Write], Awaitable[Any]]
"""Execute the write's plan in a transaction of its own; its result."""


class Gathering:
    """The writes of each event loop waiting to join a round."""

    def __init__(self, together: Together, alone: Alone) -> None:
        self._together = together
        self._alone = alone
        self._joining: dict[asyncio.AbstractEventLoop, list[Write]] = {}
        self._rounds: set[asyncio.Task[None]] = set()
        self._sending: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}

    async def write(self, me: Write) -> Any:
        """The result of ``me``'s plan, its one round sent with those of the writes ready
        with it."""
        loop = asyncio.get_running_loop()
        joining = self._joining.get(loop)
        if joining is not None:
            joining.append(me)
            return await self._outcome(me, joining)
        joining = self._joining[loop] = [me]
        if loop in self._sending:  # a shared round is on its way: this group goes next
            loop.call_later(HELD_UP_S, self._go_if_waiting, loop, joining)
            return await self._outcome(me, joining)
        try:
            await gathered(joining)  # every task already woken queues its write first
        except asyncio.CancelledError:
            others = self._joining.pop(loop)[1:]
            if others:
                self._start(loop, others)
            raise
        writes = self._joining.pop(loop)
        if len(writes) == 1:
            return await self._alone(me)
        self._start(loop, writes)
        return await self._outcome(me, writes)

    def _start(self, loop: asyncio.AbstractEventLoop, writes: list[Write]) -> None:
        task = loop.create_task(self._round(writes))
        self._rounds.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._rounds.discard)
        self._sending[loop] = task
        task.add_done_callback(lambda _: self._landed(loop, task))
        for w in writes:
            w.round = task

    def _landed(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[None]) -> None:
        """A shared round landed: if it was the latest, the group gathered meanwhile goes."""
        if self._sending.get(loop) is task:
            del self._sending[loop]
            self._go_if_waiting(loop, self._joining.get(loop))

    def _go_if_waiting(self, loop: asyncio.AbstractEventLoop, group: list[Write] | None) -> None:
        """Send ``group`` if it is still the one gathering (and anyone is left in it)."""
        if group is not None and self._joining.get(loop) is group:
            del self._joining[loop]
            if group:
                self._start(loop, group)

    async def _outcome(self, me: Write, writes: list[Write]) -> Any:
        try:
            # Shielded: cancelling the caller leaves its write's own outcome to wait for.
            await asyncio.shield(me.done)
        except asyncio.CancelledError:
            if me.round is None:  # not sent yet: withdrawn, nothing of it applies
                writes.remove(me)
                raise
            # Its round is on its way: report what it did, like a write that cannot be
            # interrupted, and let the cancellation through at the caller's next await.
            # Its own outcome only: the round's other writes may go on alone for longer.
            while not me.done.done():
                try:
                    await asyncio.shield(me.done)
                except asyncio.CancelledError:
                    continue
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            task.cancel()
        if me.error is not None:
            raise me.error
        return me.result

    async def _round(self, writes: list[Write]) -> None:
        queries = [q for w in writes for q in w.first.queries]
        try:
            answers = await self._together(queries, any(w.first.notify for w in writes))
        except Exception as exc:
            # Only a connection lost on the way leaves the outcome unknown. Anything else
            # (the server refused a statement, a value failed to adapt before the Sync)
            # ended the implicit transaction unapplied.
            cause = exc.__cause__
            lost = isinstance(exc, StoreUnavailable) and not (
                isinstance(cause, psycopg.Error) and cause.sqlstate
            )
            try:
                await asyncio.gather(*(self._again(w, exc if lost else None) for w in writes))
            except BaseException:  # cancelled while writes went again alone
                self._cut_off(writes)
                raise
            return
        except BaseException:
            self._cut_off(writes)
            raise
        start = 0
        for w in writes:
            end = start + len(w.first.queries)
            steps = w.steps
            assert steps is not None
            try:
                steps.send(answers[start:end])
            except StopIteration as finished:
                self._settle(w, result=finished.value)
            except Exception as exc:
                self._settle(w, error=exc)
            else:  # pragma: no cover - a plan's final round is its last
                self._settle(w, error=AssertionError("a plan went on after its final round"))
            start = end

    async def _again(self, w: Write, lost: Exception | None) -> None:
        """``w`` alone, after its shared round was refused (``lost`` None: nothing of it
        applied) or lost (its outcome unknown: only a write safe to repeat goes again)."""
        if lost is not None and not w.idempotent:
            self._settle(w, error=lost)
            return
        w.steps = None
        try:
            self._settle(w, result=await self._alone(w))
        except Exception as exc:
            self._settle(w, error=exc)

    def _cut_off(self, writes: list[Write]) -> None:
        """The round's task was cancelled: each write not yet settled has an unknown outcome
        (a waiter cancelled meanwhile must not read "returned" from a write never settled)."""
        for w in writes:
            if not w.settled:
                self._settle(w, error=StoreUnavailable("the round of this write was cut off"))

    @staticmethod
    def _settle(w: Write, *, result: Any = None, error: BaseException | None = None) -> None:
        w.result, w.error, w.settled = result, error, True
        if not w.done.done():
            w.done.set_result(None)
