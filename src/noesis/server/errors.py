"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with its status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from noesis.errors import (
    ChatTemplateError,
    InvalidRequest,
    InvalidSamplingParams,
    NoesisError,
    OutOfKVCache,
    PromptTooLong,
)
from noesis.structured.matcher import GrammarTooComplex

log = logging.getLogger("noesis.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def __reduce__(self):  # its args are not __init__'s: pickle (from a worker) needs the fields
        return type(self), (self.status, self.message, self.param, self.code, self.headers)

    def body(self) -> dict:
        error_type = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_exception(exc: BaseException) -> APIError:
    """Map an engine-side exception to the API error a client should see."""
    # Here, not at the top: protocol.py (APIError) must import without torch (server/bodies.py).
    from noesis.engine.async_engine import QueueFull, RequestFailed
    from noesis.engine.messages import EngineDead, EngineStepError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        headers = {"Retry-After": str(exc.retry_after)}
        return APIError(429, str(exc), code="queue_full", headers=headers)
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, RequestFailed):
        return APIError(500, f"this request failed: {exc}", code="request_failed")
    if isinstance(exc, PromptTooLong):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidSamplingParams):
        return APIError(400, str(exc), param=exc.field, code="invalid_value")
    if isinstance(exc, GrammarTooComplex):
        return APIError(400, str(exc), code="grammar_too_complex")
    if isinstance(exc, OutOfKVCache):
        return APIError(400, str(exc), code="kv_cache_exceeded")
    if isinstance(exc, (InvalidRequest, ChatTemplateError)):
        return APIError(400, str(exc), code="invalid_value")
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def install_handlers(app: FastAPI) -> None:
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def on_any(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()

    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(APIError, on_any)
    app.add_exception_handler(NoesisError, on_any)
    app.add_exception_handler(Exception, on_any)  # the 500 path: logged with its traceback
