"""How the console says no: every refusal is JSON ``{"error": <type>, "message": <what to do>}``
with a 4xx status, whatever the input was.

durably's own errors map by type (:func:`status_of`); HTTP-level refusals (no such route,
malformed JSON, a failed validation) get the same shape. Messages never echo raw input:
the JSON is ASCII-escaped, so a lone surrogate or an escape sequence a client sent cannot
break the response or a terminal that prints it.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from durably.errors import (
    ApprovalExpired,
    ConfigurationError,
    DurablyError,
    IdempotencyConflict,
    InputError,
    InvalidTransition,
    PayloadTooLarge,
    RunNotFound,
    StoreError,
)

_STATUS: tuple[tuple[type[DurablyError], int], ...] = (
    (RunNotFound, 404),
    (InvalidTransition, 409),
    (IdempotencyConflict, 409),
    (ApprovalExpired, 409),
    (ConfigurationError, 422),
    (PayloadTooLarge, 413),
    (InputError, 422),
    # Not the caller's fault: the database is away, or newer than this server.
    (StoreError, 503),
)


class ErrorOut(BaseModel):
    error: str = Field(description="The error type, e.g. RunNotFound.")
    message: str = Field(description="What went wrong and what to do next.")


def status_of(exc: DurablyError) -> int:
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    # The rest are about a run's state (lease lost, corrupted checkpoint, non-determinism…).
    return 409


class _ASCIIJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(
    status: int, error: str, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return _ASCIIJSONResponse(
        status_code=status, content={"error": error, "message": message}, headers=headers
    )


def durably_error_response(exc: DurablyError) -> JSONResponse:
    return error_response(status_of(exc), type(exc).__name__, str(exc))


class ApiError(HTTPException):
    """Raised by an endpoint (or while reading its body) to answer ``{"error", "message"}``."""

    def __init__(
        self, status: int, error: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.error = error
        self.message = message


# -- request bodies -------------------------------------------------------------------------


def _malformed(message: str) -> ApiError:
    return ApiError(400, "MalformedJSON", message)


def _refuse_constant(name: str) -> Any:
    raise _malformed(f"{name} is not JSON: send numbers as finite decimals")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _malformed(f"the number {text[:40]} is out of range for a 64-bit float")
    return value


def _int(text: str) -> int:
    if len(text) > sys.get_int_max_str_digits():
        raise _malformed(
            f"a number with {len(text)} digits is too long; send at most "
            f"{sys.get_int_max_str_digits()} digits (or the value as a string)"
        )
    return int(text)


def decode_json(body: bytes, what: str = "the request body") -> Any:
    """``body`` as JSON, or an :class:`ApiError` 400 that says what is wrong with it.

    Stricter than ``json.loads``: NaN, Infinity and floats that overflow to infinity are
    refused (no store can replay them), and so is nesting too deep to parse.
    """
    try:
        return json.loads(body, parse_constant=_refuse_constant, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as exc:
        raise _malformed(f"{what} is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise _malformed(f"{what} is not UTF-8 text") from None
    except RecursionError:
        raise _malformed(
            f"{what} nests arrays and objects too deeply to parse; JSON values may nest "
            "at most 64 levels"
        ) from None


class _JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = decode_json(await self.body())
        return self._json


class DurablyRoute(APIRoute):
    """A route that parses bodies with :func:`decode_json` and answers durably's errors as
    ``{"error", "message"}`` JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(_JSONRequest(request.scope, request.receive))
            except DurablyError as exc:
                return durably_error_response(exc)

        return route


# -- handlers for what FastAPI itself refuses ----------------------------------------------

_REASONS = {400: "BadRequest", 404: "NotFound", 405: "MethodNotAllowed", 413: "PayloadTooLarge"}


def _shown(part: object) -> str:
    text = str(part)
    return text if len(text) <= 60 else text[:57] + "..."


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if isinstance(exc, ApiError):
        return error_response(exc.status_code, exc.error, exc.message, exc.headers)
    if exc.status_code == 404:
        message = f"no such page or endpoint: {_shown(request.url.path)}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {_shown(request.url.path)}"
    else:
        message = str(exc.detail)
    error = _REASONS.get(exc.status_code, "HTTPError")
    return error_response(exc.status_code, error, message, exc.headers)


_UNICODE = {
    "string_unicode": "contains a lone UTF-16 surrogate, which cannot be stored; send valid "
    "Unicode text"
}


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    # Each error's "input" is left out: it is the client's own (possibly hostile) value.
    problems = [
        ".".join(_shown(p) for p in error.get("loc", ()))
        + ": "
        + _UNICODE.get(error.get("type", ""), str(error.get("msg", "")))
        for error in exc.errors()[:10]
    ]
    return error_response(422, "ValidationError", "; ".join(problems) or "invalid request")


def install_handlers(server: FastAPI) -> None:
    """Make FastAPI's own refusals (404, 405, validation) speak ``{"error", "message"}``."""
    server.add_exception_handler(HTTPException, _http_error)
    server.add_exception_handler(RequestValidationError, _validation_error)
