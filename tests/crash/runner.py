"""Runs one crash-test run in this process and prints it as JSON on the last stdout line.

    python -m tests.crash.runner start   RUN_ID WORKFLOW INPUT_JSON
    python -m tests.crash.runner recover RUN_ID WORKFLOW INPUT_JSON
    python -m tests.crash.runner execute RUN_ID
    python -m tests.crash.runner resume  RUN_ID
    python -m tests.crash.runner cancel  RUN_ID
    python -m tests.crash.runner fork    RUN_ID SOURCE_RUN_ID AT REPLAY_MODE
    python -m tests.crash.runner again   RUN_ID

``start`` creates the run and executes it (``app.run``). ``recover`` plays a fresh process
after a crash: it waits until the dead process's lease on the run has expired (read from
the store, judged by the store's clock), then calls ``app.run`` again with the same run id
and input, which re-executes the existing run. ``execute`` calls ``app.execute_async`` at
once (it does nothing while another holder's lease is live). ``resume`` is ``app.resume``;
``cancel`` is ``app.cancel`` with compensations. ``fork`` forks the source run at
step id AT under REPLAY_MODE, as RUN_ID, and executes the fork; ``again`` plays a fresh
process after a crash of any run: it waits for the dead lease, then executes the run. With
``DURABLY_CRASH_AT`` set the process exits 77 at that point instead of printing anything.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import durably
from durably.cli.render import run_json
from tests.crash.crashapp import app
from tests.leases import wait_for_lease


async def main(argv: list[str]) -> dict[str, Any]:
    mode, run_id = argv[0], argv[1]
    try:
        if mode == "start":
            run = await app.run_async(argv[2], run_id=run_id, **json.loads(argv[3]))
        elif mode == "recover":
            await wait_for_lease(app, run_id)
            run = await app.run_async(argv[2], run_id=run_id, **json.loads(argv[3]))
        elif mode == "execute":
            run = await app.execute_async(run_id)
        elif mode == "resume":
            run = await app.resume_async(run_id)
        elif mode == "cancel":
            run = await app.cancel_async(run_id, compensate=True)
        elif mode == "fork":
            replay = durably.ReplayMode(argv[4])
            await app.fork_async(argv[2], at=argv[3], replay=replay, new_run_id=run_id)
            run = await app.execute_async(run_id)
        elif mode == "again":
            await wait_for_lease(app, run_id)
            run = await app.execute_async(run_id)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        await app.close_async()
    return run_json(run)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))), flush=True)
