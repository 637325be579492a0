"""OpenAI-shaped error responses.

Every error the proxy itself produces has the body
`{"error": {"message", "type", "param", "code"}}` that the OpenAI SDKs and
vLLM use, so a client handles ours and the backend's alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

JSON_CT = "application/json"


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> bytes:
    obj = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return json.dumps(obj, ensure_ascii=False).encode()


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

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        return error_response(
            self.status, self.message, code=self.code, param=self.param, headers=headers
        )
