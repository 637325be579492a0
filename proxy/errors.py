"""OpenAI error objects as aiohttp responses (the object itself is
`proxy.openai.errors`, sans-IO)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from proxy.openai.errors import JSON_CT, error_body

__all__ = ["JSON_CT", "RequestRejected", "error_body", "error_response"]


def error_response(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    code: str | int | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(message, type_, code, param),
        content_type=JSON_CT,
        headers=headers,
    )


class RequestRejected(Exception):
    """A client request that fails validation; becomes a 4xx error response."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        *,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type_ = type_

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        return error_response(
            self.status,
            self.message,
            type_=self.type_,
            code=self.code,
            param=self.param,
            headers=headers,
        )
