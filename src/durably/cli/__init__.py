"""The ``durably`` command line: start runs, run workers, inspect runs, decide their
approvals, send them events, cancel them and settle them by hand.

The app comes from ``--app module:attr`` (or ``$DURABLY_APP``), the database from ``--db``
(or ``$DURABLY_DATABASE_URL``), else the app's own URL. ``--json`` output is JSON on stdout
only, so scripts can pipe it; every error is one ``error: ...`` line on stderr, with exit
code 1 (a durably error) or 2 (a usage error, followed by the usage). Output for people
shows control characters escaped, whoever stored them.

The group and its shared helpers are in :mod:`durably.cli.base`, the output in
:mod:`durably.cli.render`; the commands register themselves on import: starting and
inspecting runs in :mod:`~durably.cli.runs`, acting on one run in
:mod:`~durably.cli.operate`, and running durably itself in :mod:`~durably.cli.service`.
"""

from __future__ import annotations

# Imported for their side effect: each module adds its commands to `cli`.
from durably.cli import operate, runs, service
from durably.cli.base import cli, load_app

__all__ = ["cli", "load_app", "main", "operate", "runs", "service"]


def main() -> None:
    cli(prog_name="durably")
