"""Lease owner names, and telling from one of them that its process is gone.

An owner is ``kind:host:pid:random:machine``. ``machine`` names one boot of one machine's
process-id namespace, so a pid means the same process to every holder of the same
``machine``: a worker restarted on the host of a dead one need not sit out the dead one's
lease (30 s by default) to recover its runs. Anywhere else (another machine, another
container, a system without ``/proc``) an owner is never judged dead: its lease expires.

A live process is never judged dead: a pid that was reused by another process looks alive,
and its owner's lease is waited out as before.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import uuid
from collections.abc import Iterable


@functools.cache
def machine() -> str | None:
    """This process's boot and pid namespace, hashed (None where it cannot be known)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return hashlib.sha256(f"{boot}|{namespace}".encode()).hexdigest()[:12]


def owner_name(kind: str) -> str:
    """A lease owner name unique to this process and call: ``kind:host:pid:random:machine``."""
    return f"{kind}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}:{machine() or '-'}"


def dead(owners: Iterable[str]) -> list[str]:
    """The owners among ``owners`` whose process provably no longer runs."""
    here = machine()
    if here is None:
        return []
    found = []
    for owner in owners:
        parts = owner.split(":")
        if len(parts) != 5 or parts[4] != here or not parts[2].isdigit():
            continue
        pid = int(parts[2])
        if pid != os.getpid() and not _running(pid):
            found.append(owner)
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that can still act (a zombie cannot: it only waits to
    be reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # The state follows the command name, which is in parentheses and may hold any byte.
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"
