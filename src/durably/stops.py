"""What unwinds a workflow's coroutine when its run must stop: ``BaseException``s, so no
``except Exception`` in workflow or framework code can swallow them."""

from __future__ import annotations

from durably.errors import RunStopped


class Cancel(RunStopped):
    """Unwinds a workflow whose cancellation was requested, at a call boundary."""


class Suspend(RunStopped):
    """Unwinds a workflow whose run stops here: paused or waiting (already committed), its
    lease or store lost (nothing more is written), or poisoned (the driver pauses it)."""
