"""Parallel calls that need a person's approval ask together: the first one to need it
suspends the run only once the run's other calls in flight have landed, each adding its
request, so a person sees and decides them all at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from durably import faults
from durably.checkpoint import JournalState
from durably.status import RunStatus
from durably.stops import Suspend
from durably.store.base import (
    ApprovalRequest,
    Committed,
    EventWrite,
    RunUpdate,
    StepWrite,
    Transition,
)


@dataclass(frozen=True)
class AwaitedApproval:
    """A call of the run that waits for a person's approval: recorded with the run's other
    calls that wait for one, in the commit that suspends the run."""

    step: StepWrite
    event: EventWrite
    request: ApprovalRequest | None
    """A new request (None: the call waits for one requested earlier)."""
    waiting: dict[str, Any]


class JoinsApprovals:
    """The approval-joining half of a run's execution context (``RunContext`` is one)."""

    awaited: list[AwaitedApproval] | None
    ended: asyncio.Event
    inflight: dict[int, asyncio.Future[None]]
    journal: JournalState

    async def commit(self, transition: Transition | Callable[[], Transition]) -> Committed:
        raise NotImplementedError

    async def release(
        self, record: Callable[[], Awaitable[object]], *, exclude: int | None = None
    ) -> NoReturn:
        raise NotImplementedError

    async def quiesce(self, *, exclude: int | None = None, closing: bool = True) -> None:
        raise NotImplementedError

    def landed(self, call: int) -> None:
        raise NotImplementedError

    async def await_approval(
        self, this: AwaitedApproval, *, exclude: int | None = None
    ) -> NoReturn:
        """Suspend the run in ``waiting_approval`` for ``this`` call (``exclude``: its
        in-flight id) and for every parallel call of the run that needs an approval too:
        their requests, step rows and the suspension are one commit, so a person sees and
        decides them all at once. A call arriving while another suspends the run joins it."""
        if self.awaited is not None:
            self.awaited.append(this)
            if exclude is not None:
                self.landed(exclude)
            # Unwinding now would make a TaskGroup cancel the calls still on their way here.
            await self.ended.wait()
            raise Suspend
        self.awaited = [this]

        async def suspend() -> None:
            awaited = await self._join_approvals()
            first = awaited[0]
            waiting_for = first.waiting
            if len(awaited) > 1:
                waiting_for = {**first.waiting, "approvals": [a.waiting for a in awaited]}
            await self.commit(
                lambda: Transition(
                    events=[a.event for a in awaited],
                    step=first.step,
                    more_steps=tuple(a.step for a in awaited[1:]),
                    run=RunUpdate(
                        RunStatus.WAITING_APPROVAL,
                        waiting_for=waiting_for,
                        available_at=min(a.waiting["expires_at"] for a in awaited),
                    ),
                    checkpoint=self.journal.draft(
                        status=RunStatus.WAITING_APPROVAL, current_step=first.step.step_id
                    ),
                    release=True,
                    request_approvals=tuple(a.request for a in awaited if a.request),
                    # Read when the run was claimed: a decision since is not seen there.
                    wake_on_approvals=tuple(
                        a.waiting["approval_id"] for a in awaited if a.request is None
                    ),
                )
            )
            # The requests and the suspension are one transaction: this is the same moment.
            faults.crash_point("approval.after_request")

        await self.release(suspend, exclude=exclude)

    async def _join_approvals(self) -> list[AwaitedApproval]:
        """The calls that wait for approval together (the run is closing): parallel calls
        started with the first one may still be on their way to their approval check, so
        they are waited for (until nothing is in flight) before the list is taken."""
        assert self.awaited is not None
        while True:
            for _ in range(3):  # calls scheduled in the same tick take their first steps
                await asyncio.sleep(0)
            if not self.inflight:
                break
            await self.quiesce()
        awaited, self.awaited = self.awaited, []  # a later call asks in the next execution
        return awaited
