"""How long a group commit (both stores) waits for the writes of other runs to join it.

Every task already woken queues its write first: the first write waits one pass of the
event loop. Then, while callbacks are still ready to run, it waits more passes for as long
as a write joins at least every :data:`QUIET_PASSES`-th pass. A run takes a few passes from
one write to its next (its answer wakes it, a claim or a release takes a turn of its own),
and the more runs at once, the more passes they take to all reach theirs: with 16 runs at
once, waiting three passes gathered 13 writes a batch on SQLite and this rule all 16; with
64, 22 and all 64. A lone run finds nothing else ready and goes at once; a loop kept busy
by other work holds a write up for :data:`QUIET_PASSES` passes at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sized

QUIET_PASSES = 3
"""How many passes of the event loop in a row a group commit waits for a write to join."""
MAX_PASSES = 64
"""How many passes of the event loop a group commit waits at most."""


class Gather:
    """One group commit's wait: the passes it waited, and how many of the last ones in a
    row no write joined."""

    __slots__ = ("passes", "quiet", "seen")

    def __init__(self) -> None:
        self.passes = self.quiet = self.seen = 0

    def waits(self, loop: asyncio.AbstractEventLoop, queued: int) -> bool:
        """After one more pass, with ``queued`` writes now queued: whether to wait another.
        A loop with no ready queue to look at (not asyncio's own) never waits."""
        self.passes += 1
        self.quiet = 0 if queued > self.seen else self.quiet + 1
        self.seen = queued
        return (
            self.passes < MAX_PASSES
            and self.quiet < QUIET_PASSES
            and bool(getattr(loop, "_ready", None))
        )


async def gathered(joining: Sized) -> None:
    """Return once the writes joining ``joining`` (a group commit's queue) stop coming."""
    loop = asyncio.get_running_loop()
    gather = Gather()
    await asyncio.sleep(0)
    while gather.waits(loop, len(joining)):
        await asyncio.sleep(0)
