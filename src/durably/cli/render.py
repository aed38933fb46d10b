"""How the commands print: JSON on stdout for ``--json``, else tables and labelled lines
for people, with times in UTC.

Everything shown comes from the store, where anyone who could start a run or send an event
put it: a control character in a run id, an error message or a payload would be obeyed by
the terminal (clear the screen, set the clipboard with OSC 52, rewrite a line). So every
line for people goes through :func:`echo`, which shows such characters as Python escapes
(``\\x1b``), and JSON escapes them as ``\\u001b``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from datetime import UTC, datetime
from typing import Any

import click

from durably.status import RunStatus
from durably.store.base import Approval
from durably.views import Run
from durably.whatif import ReplayReport

# C0 and C1 controls and DEL (terminal commands), bidirectional overrides and isolates and
# line separators (they reorder or split what is shown), and lone surrogates (which no
# terminal encoding can print).
_BEYOND_C0 = r"\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE = re.compile(rf"[\x00-\x1f{_BEYOND_C0}]")
# json escapes C0 controls itself, and its own newlines and indents are the layout.
_UNSAFE_IN_JSON = re.compile(f"[{_BEYOND_C0}]")


def visible(text: str) -> str:
    """``text`` with every character a terminal would obey shown as its Python escape."""
    return _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)


def echo(line: str = "", *, err: bool = False) -> None:
    """Print one line for people (see the module docstring)."""
    click.echo(visible(line), err=err)


def echo_json(value: Any) -> None:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    # These occur only inside strings, where \uXXXX is the same JSON value.
    click.echo(_UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text))


def format_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _span(seconds: float) -> str:
    """``2d 3h``, ``5h 12m``, ``4m 10s``, ``9s``: a duration for people, two units at most."""
    s = int(seconds)
    days, hours, minutes = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {s % 60}s"
    return f"{s}s"


def expiry(ts: float) -> str:
    """The absolute time and how far off it is, judged by this machine's clock."""
    left = ts - time.time()
    return f"{format_time(ts)} ({'in ' + _span(left) if left > 0 else 'passed'})"


def run_json(run: Run) -> dict[str, Any]:
    return {**dataclasses.asdict(run), "status": run.status.value}


def table(headers: list[str], rows: list[list[Any]], empty: str = "(none)") -> None:
    if not rows:
        echo(empty)
        return
    # Escaped before measuring, so that the columns line up with what is shown.
    rows = [["-" if cell is None else visible(str(cell)) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, *rows]:
        echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def error_text(error: dict[str, Any] | None) -> str:
    if not error:
        return "-"
    return f"{error.get('type', 'Error')}: {error.get('message', '')}"


def _labelled(label: str, value: str) -> None:
    echo(f"{label:<10} {value}")


def _approval_subject(approval: Approval) -> tuple[str, str]:
    """What was approved: a tool call as ``tool(arg=value, ...)``, or a plan's payload."""
    payload = approval.payload
    if approval.kind == "tool" and isinstance(payload, dict):
        arguments = payload.get("arguments")
        if isinstance(arguments, dict):
            shown = ", ".join(
                f"{name}={json.dumps(value, ensure_ascii=False)}"
                for name, value in arguments.items()
            )
            return "tool call", f"{payload.get('tool', approval.name)}({shown})"
    return "plan", f"{approval.name}: {json.dumps(payload, ensure_ascii=False)}"


def echo_decision(approval: Approval, as_json: bool) -> None:
    if as_json:
        echo_json(dataclasses.asdict(approval))
        return
    _labelled(
        approval.status,
        f"approval {approval.approval_id} of run {approval.run_id}, step {approval.step_id}",
    )
    _labelled(*_approval_subject(approval))
    _labelled("expires", expiry(approval.expires_at))
    by = approval.decided_by or "-"
    _labelled("by", f"{by}: {approval.comment}" if approval.comment else by)
    if approval.status == "approved":
        nxt = "a worker continues the run; the approved call may run once, before it expires"
    else:
        nxt = "a worker continues the run; the workflow sees ApprovalRejected"
    _labelled("next", f"{nxt} (`durably worker`, or `durably resume {approval.run_id}`)")


def echo_run(run: Run, as_json: bool) -> None:
    if as_json:
        echo_json(run_json(run))
        return
    shown = run.status_reason and run.status_reason != run.status.value
    reason = f" ({run.status_reason})" if shown else ""
    echo(f"{run.run_id}: {run.status.value}{reason}")
    if run.status is RunStatus.COMPLETED:
        echo(f"result: {json.dumps(run.result, ensure_ascii=False)}")
    elif run.error:
        echo(f"error: {error_text(run.error)}")


def echo_replay(report: ReplayReport) -> None:
    """A what-if replay's report, for people."""
    if report.reproduced:
        echo(f"reproduced: run {report.run_id} ({len(report.matched)} calls, same result)")
    else:
        d = report.divergence
        assert d is not None
        where = f" at {d.step_id}" + (f" ({d.name})" if d.name else "") if d.step_id else ""
        echo(f"diverged: {d.kind}{where}")
        _labelled("why", d.message)
    _labelled("matched", ", ".join(report.matched) or "(none)")
    _labelled("result", json.dumps(report.result))
    _labelled("recorded", json.dumps(report.recorded_result))
    _labelled("what-if", f"{report.what_if_run_id} ({report.status.value})")
    for note in report.notes:
        _labelled("note", note)
