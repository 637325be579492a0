"""The one exception type handlers raise to answer with an OpenAI error object."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from proxy.openai.errors import error_body


class APIError(Exception):
    """Becomes `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.message, self.type_, self.code, self.param)

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=self.body(),
            content_type="application/json",
            headers=self.headers,
        )


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str | None = None) -> APIError:
    """A 400 for a field this server does not honour; the message always names it."""
    detail = what or f"'{param}' is not supported by this server"
    if param not in detail:
        detail = f"'{param}': {detail}"
    return APIError(400, detail, param=param, code="unsupported_parameter")
