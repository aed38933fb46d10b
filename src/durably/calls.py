"""How each call of a run is identified on replay: its step id, its position in its scope,
and the checks that the workflow still makes the calls its journal recorded.

A positional call is ``<scope><name>#<n>``, numbered in the order its scope makes its calls
(the workflow's own sequence, or one :func:`durably.gather` branch); an explicit id (a
framework's tool call id) is matched by that id alone, at position 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Coroutine
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from durably.errors import DurablyError, NonDeterminismError
from durably.store.base import RunRecord, StepRecord

T = TypeVar("T")


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
        self.unawaited.pop(step_id, None)

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
        positional call) at this position of its scope."""
        step = self.steps.get(step_id)
        if step is None:
            other = self.by_position.get((prefix_of(step_id, name), position))
            if position and other is not None:
                raise self.poison(
                    NonDeterminismError(
                        f"call #{position} of this run was recorded as {other.kind} "
                        f"{other.step_id!r} but the workflow now calls {kind} {step_id!r} there; "
                        "the workflow code changed under a running run. Deploy the old code for "
                        "it, or start a new run",
                        run_id=self.run.run_id,
                        step_id=step_id,
                    )
                )
            return
        if step.kind != kind or step.name != name:
            raise self.poison(
                NonDeterminismError(
                    f"step {step.step_id} was recorded as {step.kind} {step.name!r} but the "
                    f"workflow now calls {kind} {name!r} there; the workflow code changed under a "
                    "running run. Deploy the old code for it, or give the new call step_id=...",
                    run_id=self.run.run_id,
                    step_id=step.step_id,
                )
            )
        if kind == "step" and step.input_hash != ih:
            raise self.poison(
                NonDeterminismError(
                    f"step {step.step_id} ({name}) is called with other arguments than recorded; "
                    "workflow code between calls must be deterministic (no clock, random or I/O "
                    "outside steps)",
                    run_id=self.run.run_id,
                    step_id=step.step_id,
                )
            )


def prefix_of(step_id: str, name: str) -> str:
    """The scope prefix of a positional call's step id ``<prefix><name>#<n>``."""
    numbered = step_id.rpartition("#")[0]
    return numbered[: -len(name)] if numbered.endswith(name) else numbered
