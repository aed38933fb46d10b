"""The ``durably`` group itself: the global options --app/--db, how the app is loaded, how
durably errors are shown, and the helpers every command shares."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from collections.abc import Callable, Coroutine
from typing import IO, Any, TypeVar

import click

from durably.app import App
from durably.errors import DurablyError

T = TypeVar("T")


class _Failure(click.ClickException):
    """A durably error, shown as ``error: <message>`` (the message already says what to do)."""

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DurablyError as exc:
            raise _Failure(str(exc)) from exc


def parse_json(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """A click callback: the option's value parsed as JSON."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc}): {value!r}") from exc


class Config:
    """The global options; the app is imported only by the commands that need it."""

    def __init__(self, app_spec: str | None, db: str | None) -> None:
        self.app_spec = app_spec
        self.db = db
        self._app: App | None = None

    def app(self) -> App:
        if self._app is None:
            if not self.app_spec:
                raise click.UsageError("no app given: pass --app module:attr or set $DURABLY_APP")
            self._app = load_app(self.app_spec)
            if self.db:
                self._app.database_url = self.db
        return self._app


def load_app(spec: str) -> App:
    """Import ``module:attr`` and check that it names a :class:`durably.App`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise click.UsageError(f"--app {spec!r} must look like module:attr (e.g. myagent:app)")
    # The console script does not put the working directory on sys.path (python -m does);
    # without it `--app myagent:app` would not find ./myagent.py.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise click.UsageError(
            f"--app {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        found = "nothing" if app is None else f"a {type(app).__name__}"
        raise click.UsageError(
            f"--app {spec!r}: {module_name}.{attr} is {found}, not a durably.App instance"
        )
    return app


def run_coro(app: App, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run one command's coroutine in one event loop, and close the store in that loop."""

    async def main() -> T:
        try:
            return await make()
        finally:
            await app.close_async()

    return asyncio.run(main())


def operator() -> str:
    """Who is deciding or resolving, when --by is not given."""
    return os.environ.get("USER") or "operator"


OPERATOR_DEFAULT = "$USER, else operator"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--app",
    "app_spec",
    envvar="DURABLY_APP",
    metavar="MOD:ATTR",
    help="The durably.App to use, as module:attribute (env: DURABLY_APP).",
)
@click.option(
    "--db",
    envvar="DURABLY_DATABASE_URL",
    metavar="URL",
    help="Database URL, overriding the app's (env: DURABLY_DATABASE_URL).",
)
@click.pass_context
def cli(ctx: click.Context, app_spec: str | None, db: str | None) -> None:
    """durably: durable execution for AI agents whose tools have real side effects."""
    ctx.obj = Config(app_spec, db)


pass_config = click.make_pass_decorator(Config)
