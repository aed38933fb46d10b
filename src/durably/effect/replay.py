"""Effects of a fork beyond its fork point, under the fork's replay mode.

A fork (``app.fork``) starts with the source run's recorded calls up to the fork point;
every new tool call after it is governed by :class:`~durably.ReplayMode`: blocked, answered
from the source run's ledger, sent to the tool's sandbox, or made live under a fresh
approval. Nothing real happens unless the mode says so.
"""

from __future__ import annotations

from typing import Any

from durably.effect.core import EffectCore
from durably.errors import ReplayBlocked
from durably.keys import json_value
from durably.status import OperationStatus, ReplayMode
from durably.stops import Suspend
from durably.store.base import OperationRecord


class Replaying(EffectCore):
    """The replay-mode gate a new call of a fork passes before anything else."""

    async def _replay_gate(self) -> bool:
        """Before a new call of a fork: True if it was answered here (``RECORDED``); raise
        the stop if the mode blocks it; otherwise it goes on (sandbox or live)."""
        mode = self._replay_mode()
        if mode is None or mode is ReplayMode.LIVE_WITH_NEW_APPROVAL:
            return False
        if mode is ReplayMode.SANDBOX and self.tool.sandbox is not None:
            return False
        if mode is ReplayMode.RECORDED:
            recorded = await self._source_operation()
            if recorded is not None:
                await self._record_success(
                    json_value(recorded.result_json or "null"),
                    event="effect_replayed",
                    source_run=recorded.run_id,
                    known_id=recorded.external_operation_id,
                )
                return True
        raise self._blocked(mode)

    def _blocked(self, mode: ReplayMode) -> Suspend:
        fork = self.ctx.run.input["fork"]
        why = {
            ReplayMode.DISABLED: "the fork's replay mode is DISABLED",
            ReplayMode.RECORDED: f"run {fork['of']} recorded no succeeded call at "
            f"{self.step_id} with these arguments",
            ReplayMode.SANDBOX: f"tool {self.tool.name} has no sandbox= implementation",
        }[mode]
        return self.ctx.poison(
            ReplayBlocked(
                f"{self.tool.name} at {self.step_id} would make a real effect in fork "
                f"{self.ctx.run.run_id} of {fork['of']}, and {why}; nothing was sent. Fork "
                "again with another replay mode (RECORDED, SANDBOX, LIVE_WITH_NEW_APPROVAL), "
                "or cancel this fork",
                run_id=self.ctx.run.run_id,
                step_id=self.step_id,
            )
        )

    async def _source_operation(self) -> OperationRecord | None:
        """The source run's succeeded call at this step id with the same input."""
        source = str(self.ctx.run.input["fork"]["of"])
        journal = await self.ctx.store.load_journal(source, checkpoints=0)
        if journal is None:
            return None
        return next(
            (
                o
                for o in journal.operations
                if o.step_id == self.step_id
                and o.input_hash == self.input_hash
                and o.status is OperationStatus.SUCCEEDED
                and o.result_json is not None
            ),
            None,
        )

    @property
    def sandboxed(self) -> bool:
        return self._replay_mode() is ReplayMode.SANDBOX and self.tool.sandbox is not None

    def _target(self) -> Any:
        """What the call invokes: the tool, or its sandbox in a ``SANDBOX`` fork. Decided by
        the fork's mode at every attempt, also one a later execution makes (after a pause,
        a crash, a reconciliation): never by what the execution that prepared it knew."""
        mode = self._replay_mode()
        if mode is None or mode is ReplayMode.LIVE_WITH_NEW_APPROVAL:
            return self.tool.fn
        if self.sandboxed:
            return self.tool.sandbox
        raise self._blocked(mode)  # its sandbox was taken away since it was prepared
