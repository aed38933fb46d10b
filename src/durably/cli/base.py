"""The ``durably`` group itself: the global options --app/--db, how the app is loaded, how
durably errors are shown, and the helpers every command shares."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Coroutine
from typing import IO, Any, TypeVar

import click

from durably.app import App
from durably.cli.render import echo
from durably.errors import DurablyError
from durably.values import MAX_JSON_DEPTH, check_json_value

T = TypeVar("T")


class _Failure(click.ClickException):
    """A durably error, shown as ``error: <message>`` (the message already says what to do)."""

    def show(self, file: IO[Any] | None = None) -> None:
        # The message may quote what was given or stored: escaped, like all output.
        echo(f"error: {self.format_message()}", err=True)


class _UsageFailure(_Failure):
    """A usage error in the same one-line form, then the command's usage."""

    exit_code = 2

    def __init__(self, message: str, ctx: click.Context | None) -> None:
        super().__init__(message)
        self.ctx = ctx

    def show(self, file: IO[Any] | None = None) -> None:
        super().show(file)
        if self.ctx is not None:
            click.echo(self.ctx.get_usage(), err=True)
            click.echo(f"Try '{self.ctx.command_path} -h' for help.", err=True)


def _usage_failure(exc: click.UsageError) -> click.ClickException:
    # One with a display of its own (help shown for a bare group) stays as it is.
    if type(exc).show is not click.UsageError.show:
        return exc
    return _UsageFailure(exc.format_message(), exc.ctx)


class _Group(click.Group):
    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _usage_failure(exc) from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DurablyError as exc:
            raise _Failure(str(exc)) from exc
        except click.UsageError as exc:
            raise _usage_failure(exc) from exc


MAX_INT_DIGITS = 4300
"""The longest integer a JSON value may hold: what Python's own int() accepts by default,
so that every reader of the store can parse what was stored."""


class _Refused(ValueError):
    """A JSON literal durably does not store (raised from the parser's hooks)."""


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(
            f"an integer of {len(text.lstrip('-'))} digits is too long (at most "
            f"{MAX_INT_DIGITS}); pass a number that large as a string"
        )
    return int(text)


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"{text} is beyond the range of a number; pass it as a string")
    return value


def _constant(name: str) -> Any:
    raise _Refused(f'{name} is not JSON; use null or a string such as "{name}"')


def parse_json(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """A click callback: the option's value parsed as JSON that durably can store."""
    if value is None:
        return None
    shown = repr(value if len(value) <= 60 else value[:57] + "...")
    try:
        parsed = json.loads(
            value, parse_int=_integer, parse_float=_number, parse_constant=_constant
        )
    except _Refused as exc:
        raise click.BadParameter(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise click.BadParameter(
            f'not valid JSON ({exc}): {shown}; write JSON, e.g. \'{{"name": "value"}}\', '
            "quoted for the shell"
        ) from None
    except RecursionError:
        raise click.BadParameter(
            f"arrays and objects nest too deeply (at most {MAX_JSON_DEPTH} levels): {shown}"
        ) from None
    try:
        check_json_value(parsed, "the JSON")
    except DurablyError as exc:
        raise click.BadParameter(str(exc)) from None
    return parsed


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
            _check_lasting(self._app.database_url, "the app's database")
        return self._app


def _check_lasting(url: str, what: str) -> None:
    """Each command is a process of its own: a database in its memory would be gone, with
    whatever the command recorded, by the time the next one runs."""
    if url.removeprefix("sqlite:///").startswith(":memory:"):
        raise click.UsageError(
            f"{what} is {url!r}, which lasts only as long as one command; give a file "
            "(sqlite:///durably.db) or a PostgreSQL URL"
        )


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
    if db == "":
        # Never fall back to the app's database: the caller meant another one.
        raise click.BadParameter(
            "is empty; pass a database URL (sqlite:///path.db or postgresql://...), or omit "
            "--db to use the app's",
            param_hint="--db",
        )
    if db is not None:
        _check_lasting(db, "--db")
    ctx.obj = Config(app_spec, db)


pass_config = click.make_pass_decorator(Config)
