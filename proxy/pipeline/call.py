"""The backend call: request headers, the POST (or pass-through method), and
what a failed call means — as an `AttemptResult`, never an exception.

Redirects are never followed (`allow_redirects=False`): a backend's 3xx is
its answer, and following it would reach a URL the protections never saw.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from proxy.backends.upstream import Upstream
from proxy.ingress.headers import forward_headers
from proxy.openai.errors import error_body
from proxy.pipeline.deadline import Deadline
from proxy.pipeline.record import AttemptResult, RequestRecord


def upstream_headers(rec: RequestRecord, up: Upstream, *, entity: bool = True) -> CIMultiDict[str]:
    # Entity headers describe the forwarded bytes, not the client's (proxy.ingress.headers).
    out = forward_headers(rec.request.headers, rec.rid, up.auth_header)
    trace = rec.trace
    if trace is not None:
        # The attempt's span is the backend's parent (the client's traceparent, ours).
        trace.inject(out)
    elif rec.traceparent is not None:  # tracing on, this request not recorded
        out["traceparent"] = rec.traceparent
    if not entity:
        out.popall("Content-Type", None)
    return out


def failed(
    up: Upstream,
    status: int,
    message: str,
    code: str,
    fault: str,
    detail: str = "",
    retry: str = "",
) -> AttemptResult:
    """A failure before the first byte: the error to pass on if nothing else
    answers (`retry`: transient, the same backend may be tried again)."""
    return AttemptResult(
        "failed",
        up.name,
        status,
        "error",
        detail=detail,
        fault=fault,
        body=error_body(message, "server_error", code),
        retry=retry,
    )


async def call(
    rec: RequestRecord,
    up: Upstream,
    url: URL,
    payload: bytes | None,
    deadline: float,
    method: str = "POST",
    timeout_fault: str = "first_byte_timeout",
    **extra: Any,
) -> aiohttp.ClientResponse | AttemptResult:
    """The backend's response (status and headers read), or why there is none.
    `timeout_fault`: what a missed `deadline` is (`total_timeout` for a
    non-streaming answer, whose headers come after the whole generation)."""
    try:
        with Deadline(rec.loop, deadline):
            return await up.session.request(
                method,
                url,
                data=payload,
                headers=upstream_headers(rec, up, entity=payload is not None),
                allow_redirects=False,
                **extra,
            )
    except aiohttp.ClientConnectorError as exc:
        reason = exc.os_error.strerror or str(exc)
        message = f"{up.name} backend unreachable: {reason}"
        return failed(up, 502, message, "upstream_unreachable", "connect", reason)
    except aiohttp.ConnectionTimeoutError:
        # aiohttp's `connect_s` (a TimeoutError too): the backend did not take
        # the connection in time — not a first-byte timeout.
        message = f"{up.name} backend did not accept a connection in time"
        return failed(up, 504, message, "upstream_timeout", "connect_timeout")
    except TimeoutError:
        if timeout_fault == "total_timeout":
            # The whole generation comes before a non-streaming answer's
            # first byte: the request's length, not the backend's health.
            return failed(
                up,
                504,
                f"the answer was not complete within {up.name}'s timeouts.total_s "
                f"({up.policy.timeouts.total_s:g} s): ask for fewer tokens (max_tokens) "
                "or stream the answer",
                "total_timeout",
                "total_timeout",
            )._replace(kind="refused", code="total_timeout")
        return failed(
            up,
            504,
            "backend did not answer before the deadline",
            "upstream_timeout",
            "first_byte_timeout",
        )
    except aiohttp.ClientError as exc:
        # A reset or a dropped keep-alive connection: transient, worth a retry.
        name = type(exc).__name__
        message = f"backend request failed: {name}"
        return failed(up, 502, message, "upstream_error", "request", name, retry="reset")


def close(resp: aiohttp.ClientResponse) -> None:
    if resp.content.is_eof():
        resp.release()
    else:
        # Not fully read (client left, error, timeout): closing the connection
        # makes vLLM abort the request and free its KV cache.
        resp.close()
