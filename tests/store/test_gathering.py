"""How long a group commit waits for other writes (``store.gathering``), on a real loop:
as long as writes keep joining, a few passes once they stop, never past its cap."""

from __future__ import annotations

import asyncio

from durably.store.gathering import MAX_PASSES, QUIET_PASSES, gathered


def passes_waited(joins_until: int | None) -> int:
    """Passes ``gathered`` waits, with a write joining every other pass up to pass
    ``joins_until`` (None: every other pass, forever) and a busy loop besides."""

    async def main() -> int:
        joining: list[int] = []
        passes = 0
        done = False

        async def busy() -> None:
            nonlocal passes
            while not done:
                passes += 1
                if passes % 2 == 0 and (joins_until is None or passes <= joins_until):
                    joining.append(passes)
                await asyncio.sleep(0)

        other = asyncio.ensure_future(busy())
        await asyncio.sleep(0)
        start = passes
        await gathered(joining)
        waited = passes - start
        done = True
        await other
        return waited

    return asyncio.run(main())


def test_a_loop_busy_with_other_work_holds_a_write_up_a_few_passes() -> None:
    assert passes_waited(joins_until=0) <= QUIET_PASSES + 1


def test_writes_joining_every_other_pass_are_waited_for() -> None:
    assert 40 <= passes_waited(joins_until=40) <= 40 + QUIET_PASSES + 1


def test_writes_that_never_stop_joining_are_waited_for_up_to_the_cap() -> None:
    assert MAX_PASSES - 1 <= passes_waited(joins_until=None) <= MAX_PASSES + 1
