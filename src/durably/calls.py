"""How each call of a run is identified on replay: its step id, its position in its scope,
and the checks that the workflow still makes the calls its journal recorded.

A positional call is ``<scope><name>#<n>``, numbered in the order its scope makes its calls
(the workflow's own sequence, or one :func:`durably.gather` branch); an explicit id (a
framework's tool call id) is matched by that id alone, at position 0.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from durably.errors import DurablyError, NonDeterminismError
from durably.store.base import RunRecord, StepRecord

T = TypeVar("T")

PATCH = "durably.patch"
"""The step id prefix of a :func:`durably.patched` marker (not a call of the workflow)."""


@dataclass(eq=False)
class Scope:
    """Where positional step ids are counted: the workflow's own sequence, or one branch of
    :func:`durably.gather`, whose calls are numbered within the branch so that the order
    branches reach their calls in (latency) does not change any id."""

    owner: CallIdentity
    prefix: str = ""
    counters: Counter[str] = field(default_factory=Counter)
    positions: int = 0

    def enter(self) -> None:
        """Make this the scope of the calls the current task makes from now on."""
        _scope.set(self)


_scope: ContextVar[Scope | None] = ContextVar("durably_scope", default=None)


class CallIdentity:
    """The call-identity half of a run's execution context (``RunContext`` is one)."""

    run: RunRecord
    steps: dict[str, StepRecord]
    root: Scope
    by_position: dict[tuple[str, int], StepRecord]
    reached: dict[str, None]
    unawaited: dict[str, tuple[str, Coroutine[Any, Any, Any]]]
    starting: dict[str, None]
    all_begun: asyncio.Future[None] | None

    def check_running(self) -> None:
        raise NotImplementedError

    def poison(self, error: DurablyError) -> BaseException:
        raise NotImplementedError

    def scope(self) -> Scope:
        scope = _scope.get()
        return scope if scope is not None and scope.owner is self else self.root

    def allocate(self, name: str, explicit: str | None) -> tuple[str, int]:
        """The deterministic step id of the next call and its position in its scope.

        Without an explicit id the call is ``<scope><name>#<n>``, numbered in the order the
        scope makes its calls, and replay checks it by position. An explicit id (a
        framework's tool call id) is matched by that id alone, at position 0, so calls made
        concurrently may be replayed in any order.
        """
        self.check_running()
        if explicit is not None:
            step_id, position = explicit, 0
        else:
            scope = self.scope()
            scope.counters[name] += 1
            scope.positions += 1
            step_id = f"{scope.prefix}{name}#{scope.counters[name]}"
            position = scope.positions
        if step_id in self.reached:
            raise self.poison(
                NonDeterminismError(
                    f"step id {step_id!r} is used twice in this run; give each call its own "
                    "step id (with_step_id) or let durably number them",
                    run_id=self.run.run_id,
                    step_id=step_id,
                )
            )
        self.reached[step_id] = None
        return step_id, position

    def created(
        self, step_id: str, name: str, call: Coroutine[Any, Any, T]
    ) -> Coroutine[Any, Any, T]:
        """``call``, the coroutine of the call allocated at ``step_id``, handed to workflow
        code: it counts as un-awaited until it starts (:meth:`started`)."""
        self.unawaited[step_id] = (name, call)
        return call

    def started(self, step_id: str) -> None:
        """The call at ``step_id`` began (awaited, or its task ran): it is no longer
        un-awaited, but starting until it is in flight or ends (:meth:`begun`)."""
        self.unawaited.pop(step_id, None)
        self.starting[step_id] = None

    def begun(self, step_id: str) -> None:
        """The call at ``step_id`` is in flight, replayed, or ended before either."""
        if self.starting.pop(step_id, 0) is None and not self.starting:
            waiter = self.all_begun
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def drop_unawaited(self) -> list[str]:
        """Close the calls never awaited (so none warns later) and name them."""
        names = [f"{name} at {step_id}" for step_id, (name, _) in self.unawaited.items()]
        for _, call in self.unawaited.values():
            call.close()
        self.unawaited.clear()
        return names

    def branches(self, count: int) -> list[Scope]:
        """The scopes of a new :func:`durably.gather`'s branches, under the current scope."""
        parent = self.scope()
        parent.counters["durably.gather"] += 1
        gather = f"{parent.prefix}gather#{parent.counters['durably.gather']}"
        return [Scope(self, f"{gather}.{i}/") for i in range(count)]

    def replayed(self, step_id: str, position: int, kind: str, name: str, ih: str) -> None:
        """Raise if the journal holds a different call at this step id, or (for a
        positional call) at this position of its scope; in a what-if replay, also if the
        journal holds no call at all here."""
        step = self.steps.get(step_id)
        if step is None:
            # A new run has nothing recorded by position: no prefix to work out.
            other = (
                self.by_position.get((prefix_of(step_id, name), position))
                if position and self.by_position
                else None
            )
            if other is not None:
                raise self.diverged(
                    "other_call",
                    step_id,
                    name,
                    f"call #{position} of this run was recorded as {other.kind} "
                    f"{other.step_id!r} but the workflow now calls {kind} {step_id!r} there; "
                    "the workflow code changed under a running run. Deploy the old code for "
                    "it, or start a new run",
                    recorded=other.step_id,
                )
            if self.what_if():
                raise self.diverged(
                    "new_call",
                    step_id,
                    name,
                    f"the workflow now calls {kind} {name!r} at {step_id}, a call run "
                    f"{self.run.input['fork']['of']} never made; nothing was executed",
                )
            return
        if step.kind != kind or step.name != name:
            raise self.diverged(
                "other_call",
                step.step_id,
                name,
                f"step {step.step_id} was recorded as {step.kind} {step.name!r} but the "
                f"workflow now calls {kind} {name!r} there; the workflow code changed under a "
                "running run. Deploy the old code for it, or give the new call step_id=...",
                recorded=step.step_id,
            )
        if kind == "step" and step.input_hash != ih:
            raise self.diverged(
                "other_arguments",
                step.step_id,
                name,
                f"step {step.step_id} ({name}) is called with other arguments than recorded; "
                "workflow code between calls must be deterministic (no clock, random or I/O "
                "outside steps)",
            )

    def what_if(self) -> bool:
        """Whether this run is a what-if replay (``durably replay``): every call must be
        one the source run recorded, or the replay stops there."""
        fork = self.run.input.get("fork")
        return isinstance(fork, dict) and fork.get("what_if") is True

    def diverged(
        self, kind: str, step_id: str, name: str, message: str, *, recorded: str | None = None
    ) -> BaseException:
        """The stop for a divergence from the journal at ``step_id``, with what differs and
        the calls replayed before it (``NonDeterminismError.divergence``)."""
        return self.poison(self._divergence(kind, step_id, name, message, recorded))

    def unreached(self) -> NonDeterminismError | None:
        """In a what-if replay whose workflow returned: the first recorded call it never
        made (the new code dropped it), as the divergence to pause with; else None."""
        if not self.what_if():
            return None
        missed = sorted(
            (s for s in self.steps.values() if s.step_id not in self.reached),
            key=lambda s: s.settled_sequence or 0,
        )
        missed = [s for s in missed if s.step_id.partition(":")[0] != PATCH]
        if not missed:
            return None
        first = missed[0]
        return self._divergence(
            "missing_call",
            first.step_id,
            first.name,
            f"run {self.run.input['fork']['of']} made {first.kind} {first.name!r} at "
            f"{first.step_id}, and the workflow now returns without making it",
            first.step_id,
        )

    def _divergence(
        self, kind: str, step_id: str, name: str, message: str, recorded: str | None
    ) -> NonDeterminismError:
        matched = [s for s in self.reached if s != step_id and s.partition(":")[0] != PATCH]
        return NonDeterminismError(
            message,
            run_id=self.run.run_id,
            step_id=step_id,
            divergence={
                "kind": kind,
                "step_id": step_id,
                "name": name,
                "recorded_step_id": recorded,
                "matched": matched,
            },
        )


def prefix_of(step_id: str, name: str) -> str:
    """The scope prefix of a positional call's step id ``<prefix><name>#<n>``."""
    numbered = step_id.rpartition("#")[0]
    return numbered[: -len(name)] if numbered.endswith(name) else numbered
