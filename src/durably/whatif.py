"""A what-if replay: a finished run's workflow executed again with the code now registered,
against the run's own journal, where nothing real can happen.

It is a fork (``fork.py``) at the end of the source run, replay mode ``RECORDED``, marked
``what_if`` in its input: every call the code makes must be one the source recorded (same
step id, position, name and arguments) and is answered from that record; the first call
that differs — another call at a recorded position, other arguments, a call the source
never made, or a recorded call the code no longer makes — stops it before anything runs
(``calls.py``), and its pause records what differed. The report compares that, or the new
result, with the source. The what-if run is kept for inspection; one that stopped is
cancelled, so it leaves nothing for a person to act on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from durably import actions, fork, owners
from durably.engine import Engine
from durably.errors import InvalidInput, InvalidTransition, RunNotFound
from durably.keys import sha256_hex
from durably.status import ReplayMode, RunStatus, StepStatus
from durably.values import check_ref
from durably.views import Run

SUPPORTED = (ReplayMode.RECORDED,)


@dataclass(frozen=True)
class Divergence:
    """Where the new code first departs from the source run.

    ``kind``: ``other_call`` (another call at a recorded position), ``other_arguments``,
    ``new_call`` (a call the source never made), ``missing_call`` (a recorded call the new
    code does not make), ``other_result`` (same calls, another result), or ``stopped`` (the
    new code failed or stopped otherwise; see ``message``).
    """

    kind: str
    step_id: str | None
    name: str | None
    message: str
    recorded_step_id: str | None = None
    """The source's call at that step id or position, if it had one."""


@dataclass(frozen=True)
class ReplayReport:
    """What a what-if replay (``app.replay``) found; ``reproduced`` when nothing differs."""

    run_id: str
    what_if_run_id: str
    mode: ReplayMode
    reproduced: bool
    matched: list[str]
    """Step ids of the source's calls the new code made alike, in order, before the
    divergence (all of them when it reproduced)."""
    divergence: Divergence | None
    status: RunStatus
    """The what-if run's status once it stopped: ``completed``, or ``cancelled`` after it
    diverged or stopped."""
    result: Any = None
    recorded_result: Any = None
    result_hash: str | None = None
    recorded_result_hash: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON (``durably replay --json``)."""
        return asdict(self)


def check_mode(mode: ReplayMode | str) -> ReplayMode:
    """``mode`` as a :class:`ReplayMode` a what-if replay supports, or ``InvalidInput``."""
    try:
        parsed = ReplayMode(mode.upper() if isinstance(mode, str) else mode)
    except ValueError:
        parsed = None
    if parsed not in SUPPORTED:
        raise InvalidInput(
            f"replay mode {str(mode)!r} is not supported for a what-if replay; the supported "
            f"mode is {', '.join(m.value.lower() for m in SUPPORTED)} (every call answered "
            "from the run's record). Fork the run (durably fork --replay) for other modes"
        )
    assert parsed is not None
    return parsed


async def replay(engine: Engine, run_id: str, mode: ReplayMode | str) -> ReplayReport:
    """Replay completed run ``run_id`` with the code registered now; report the first
    divergence."""
    check_ref(run_id, "run id")
    replay_mode = check_mode(mode)
    store = await engine.open()
    journal = await store.load_journal(run_id, checkpoints=0)
    if journal is None:
        raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
    source = journal.run
    if source.status is not RunStatus.COMPLETED:
        raise InvalidTransition(
            f"run {run_id} is {source.status.value}; only a completed run can be replayed "
            "what-if (its whole journal is the reference). Fork it instead (durably fork)",
            run_id=run_id,
        )
    recorded = sorted(
        (s for s in journal.steps if s.status is StepStatus.SUCCEEDED and s.settled_sequence),
        key=lambda s: s.settled_sequence or 0,
    )
    if not recorded:
        raise InvalidInput(
            f"run {run_id} recorded no calls, so there is nothing to replay against",
            run_id=run_id,
        )
    # Leased to this process from its creation: a worker polling meanwhile must not take
    # it up, or this report would be read off a run still executing there.
    owner = owners.owner_name("inproc")
    what_if = await fork.fork(
        engine, run_id, at=None, replay=replay_mode, run_id=None, what_if=True, owner=owner
    )
    await actions.execute(engine, what_if, owner=owner)
    new = await store.get_run(what_if)
    assert new is not None
    ran = Run.from_record(new)
    recorded_result = None if source.result_json is None else Run.from_record(source).result
    matched = [s.step_id for s in recorded if not s.step_id.startswith("durably.patch:")]
    divergence: Divergence | None = None
    notes: list[str] = []
    if ran.status is RunStatus.COMPLETED:
        if new.result_json != source.result_json:
            divergence = Divergence(
                "other_result",
                None,
                None,
                "the new code made the same calls but returned another result",
            )
    else:
        error = ran.error or {}
        found = error.get("divergence")
        if isinstance(found, dict):
            divergence = Divergence(
                str(found["kind"]),
                found.get("step_id"),
                found.get("name"),
                str(error.get("message", "")),
                found.get("recorded_step_id"),
            )
            matched = [str(s) for s in found.get("matched", [])]
        else:
            matched = []
            notes.append("which calls were replayed before it stopped is not recorded")
            divergence = Divergence(
                "stopped",
                error.get("step_id"),
                None,
                str(error.get("message") or f"the what-if run ended {ran.status.value}"),
            )
        if not ran.status.is_final:
            await actions.cancel(engine, what_if)
            ran = Run.from_record(await store.get_run(what_if) or new)
            notes.append(f"what-if run {what_if} stopped at the divergence and was cancelled")
    return ReplayReport(
        run_id=run_id,
        what_if_run_id=what_if,
        mode=replay_mode,
        reproduced=divergence is None,
        matched=matched,
        divergence=divergence,
        status=ran.status,
        result=ran.result,
        recorded_result=recorded_result,
        result_hash=None if new.result_json is None else sha256_hex(new.result_json),
        recorded_result_hash=None if source.result_json is None else sha256_hex(source.result_json),
        notes=notes,
    )
