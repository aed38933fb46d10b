"""The public surface stays what it was: every exported name's signature, every App method,
every CLI command with its options and every HTTP route, against tests/public_surface.json.

A change to the surface is a decision: make it, then record it with
``python -m tests.test_public_surface > tests/public_surface.json`` and say why in the commit.
(Recorded before the engine was extracted from the App; since then only the internal
``App.compensate_run`` trampoline is gone, and plain attributes became read-only properties.)
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import click

import durably

RECORDED = Path(__file__).with_name("public_surface.json")


def _signature(obj: Any) -> str | None:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def _commands(group: click.Group, prefix: str = "") -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, command in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        if isinstance(command, click.Group):
            found.update(_commands(command, path + " "))
        else:
            found[path] = sorted(p.opts[0] if p.opts else str(p.name) for p in command.params)
    return found


def surface() -> dict[str, Any]:
    from durably.cli import cli
    from durably.server import create_server

    found: dict[str, Any] = {}
    for name in durably.__all__:
        obj = getattr(durably, name)
        if inspect.isclass(obj):
            entry: dict[str, Any] = {"init": _signature(obj)}
            # Members of durably's own classes in the MRO too (App's registering half, say),
            # the most derived winning; not those of Exception or object.
            members: dict[str, Any] = {}
            for klass in reversed(obj.__mro__):
                if klass.__module__.partition(".")[0] == "durably":
                    members.update(vars(klass))
            for attr, member in sorted(members.items()):
                if attr.startswith("_"):
                    continue
                if isinstance(member, property):
                    entry[attr] = "property"
                elif isinstance(member, staticmethod | classmethod):
                    entry[attr] = _signature(member.__func__)
                elif callable(member):
                    entry[attr] = _signature(member)
            found[name] = entry
        elif callable(obj):
            found[name] = _signature(obj)
        else:
            found[name] = repr(type(obj))
    found["__cli__"] = _commands(cli)
    app = durably.App("sqlite:///:memory:")
    try:
        server = create_server(app)
        found["__routes__"] = sorted(
            f"{','.join(sorted(getattr(r, 'methods', None) or []))} {r.path}"
            for r in server.routes
            if hasattr(r, "path")
        )
    finally:
        app.close()
    return found


def test_the_public_surface_is_unchanged() -> None:
    assert surface() == json.loads(RECORDED.read_text())


if __name__ == "__main__":
    json.dump(surface(), sys.stdout, indent=1, sort_keys=True)
