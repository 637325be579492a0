"""Request paths are checked before anything is routed or forwarded.

A backend may normalise a path differently from the proxy's router (vLLM
decodes `%2F`, resolves dot-segments, redirects a trailing slash with a 307):
any such path could reach a backend route around the proxy's protections.
So a path that is not already in its one canonical form is refused, never
repaired: dot-segments (`.`, `..`, also as `%2e`), empty segments (`//`),
encoded slashes or backslashes (`%2F`, `%5C`) and backslashes, encoded NULs
and control characters (`%00`-`%1F`, `%7F`). Under `/v1/`, a trailing slash
names no route (404, with the path it probably meant); nor does it under
`/brownout/` (the status page, `/brownout/`, aside).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

# One scan per request: the first thing found names the problem.
_BAD = re.compile(
    r"(?P<encoded>%(?:2f|5c|[01][0-9a-f]|7f))"
    r"|(?P<control>[\x00-\x1f\x7f\\])"
    r"|(?P<empty>//)"
    r"|(?P<dot>(?<=/)(?:\.|%2e)(?:\.|%2e)?(?=/|$))",
    re.IGNORECASE,
)
_MESSAGES = MappingProxyType(
    {
        "encoded": "an encoded slash, backslash or control character",
        "control": "a backslash or a control character",
        "empty": "an empty segment ('//')",
        "dot": "a dot-segment ('.' or '..')",
    }
)


@dataclass(frozen=True, slots=True)
class PathProblem:
    status: int  # 400: malformed; 404: well-formed but no such route
    message: str
    suggestion: str | None = None  # the path it probably meant


def path_problem(raw_path: str) -> PathProblem | None:
    """What is wrong with a request's raw (still percent-encoded) path, if anything."""
    if not raw_path.startswith("/"):
        return PathProblem(400, "the request path must start with '/'")
    # Each of `_BAD`'s alternatives needs one of these; a canonical path has
    # none, and these substring tests cost far less than the regex's scan.
    if (
        "%" in raw_path
        or "\\" in raw_path
        or "//" in raw_path
        or "/." in raw_path
        or not raw_path.isprintable()
    ):
        m = _BAD.search(raw_path)
    else:
        m = None
    if m is not None:
        what = _MESSAGES[m.lastgroup or "control"]
        return PathProblem(400, f"the request path contains {what}: {m.group(0)!r}")
    if raw_path.endswith("/") and (
        raw_path.startswith("/v1/")
        or (raw_path.startswith("/brownout/") and raw_path != "/brownout/")
    ):
        where = "/v1/" if raw_path.startswith("/v1/") else "/brownout/"
        return PathProblem(
            404, f"no route ends with '/' under {where}", suggestion=raw_path.rstrip("/")
        )
    return None
