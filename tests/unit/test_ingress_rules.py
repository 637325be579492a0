"""proxy.ingress: path rules, forwarded headers, the route table, body validation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from multidict import CIMultiDict

from proxy.errors import RequestRejected
from proxy.ingress import validate
from proxy.ingress.headers import body_coding, forward_headers
from proxy.ingress.paths import path_problem
from proxy.ingress.routes import ROUTES, markdown_table
from proxy.ingress.validate import Endpoint, is_field_token, parse_body


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/models/tiny", "/brownout/", "/", "/v1/a.b/.c", "/v1/x%20y"],
)
def test_canonical_paths_pass(path: str) -> None:
    assert path_problem(path) is None


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/v1/chat/completions/", 404),
        ("/v1/models/", 404),
        ("/v1/a%2Fb", 400),
        ("/v1/a%2fb", 400),
        ("/v1/a%5Cb", 400),
        ("/v1/a\\b", 400),
        ("/v1/a%00", 400),
        ("/v1/a%1F", 400),
        ("/v1/a%7f", 400),
        ("/v1//a", 400),
        ("/v1/./a", 400),
        ("/v1/a/..", 400),
        ("/v1/%2e%2E/a", 400),
        ("/v1/.%2e/a", 400),
        ("v1/a", 400),
    ],
)
def test_non_canonical_paths_are_refused(path: str, status: int) -> None:
    problem = path_problem(path)
    assert problem is not None and problem.status == status


def test_path_fast_path_agrees_with_the_full_scan() -> None:
    # path_problem skips the regex when no character it looks for is there:
    # over every short path of the telling characters, the verdicts agree.
    import itertools

    from proxy.ingress.paths import _BAD

    alphabet = ["/", ".", "%", "2", "e", "f", "\\", "\x00", "\x7f", "a"]
    for n in range(1, 5):
        for chars in itertools.product(alphabet, repeat=n):
            path = "/" + "".join(chars)
            problem = path_problem(path)
            bad = _BAD.search(path) is not None
            assert (problem is not None and problem.status == 400) == bad, path


def test_trailing_slash_suggests_the_path() -> None:
    problem = path_problem("/v1/chat/completions/")
    assert problem is not None and problem.suggestion == "/v1/chat/completions"


@pytest.mark.parametrize(
    ("value", "coding"),
    [
        (None, "identity"),
        ("identity", "identity"),
        ("", "identity"),
        ("gzip", "decoded"),
        ("GZip", "decoded"),
        ("deflate", "decoded"),
        ("br", "decoded"),
        ("zstd", "decoded"),
        ("x-gzip", "unsupported"),
        ("gzip, br", "unsupported"),
        ("compress", "unsupported"),
    ],
)
def test_body_coding(value: str | None, coding: str) -> None:
    assert body_coding(value) == coding


def test_forward_headers_describe_the_forwarded_bytes() -> None:
    incoming = CIMultiDict(
        [
            ("Host", "proxy"),
            ("Content-Type", "application/json"),
            ("Content-Encoding", "gzip"),
            ("Content-Length", "123"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "keep-alive, X-Hop"),
            ("X-Hop", "1"),
            ("Expect", "100-continue"),
            ("Accept-Encoding", "gzip, br"),
            ("X-Session-Id", "s"),
            ("X-Request-Id", "client-said"),
            ("Authorization", "Bearer client"),
            ("X-Custom", "a"),
            ("X-Custom", "b"),
        ]
    )
    out = forward_headers(incoming, "rid-1")
    assert list(out.items()) == [
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer client"),
        ("X-Custom", "a"),
        ("X-Custom", "b"),
        ("X-Request-Id", "rid-1"),
        ("Accept-Encoding", "identity"),
    ]
    assert forward_headers(incoming, "r", "Bearer backend")["Authorization"] == "Bearer backend"


def test_route_table() -> None:
    names = [r.name for r in ROUTES]
    assert len(names) == len(set(names))
    v1 = {r.path: r for r in ROUTES if r.path.startswith("/v1/")}
    assert v1["/v1/chat/completions"].methods == ("POST",)
    assert v1["/v1/models"].methods == ("GET",)
    assert all(r.auth == "client" for r in v1.values() if r.handler.__name__ != "_no_such_route")
    # The catch-all is last among the /v1 rows: the router tries rows in order.
    v1_rows = [r.path for r in ROUTES if r.path.startswith("/v1/")]
    assert v1_rows[-1] == "/v1/{tail:.+}"
    table = markdown_table()
    assert table.count("\n") == len(ROUTES) + 1
    assert (
        "| `/v1/chat/completions` | POST | `ingress.completions.chat_completions` | client |"
        in table
    )


# --------------------------------------------------------------------------- body validation

_OK = {"role": "user", "content": "hi"}
_PARTS = [{"type": "text", "text": "a"}]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": [_OK, _OK, 5]}, "messages[2]", "'messages[2]' must be an object"),
        (
            {"messages": [_OK, _OK, {"role": "wizard"}]},
            "messages[2].role",
            "'messages[2].role' must be one of assistant, developer, function, system, tool, user",
        ),
        (
            {"messages": [_OK, _OK, {"role": "user", "content": 3}]},
            "messages[2].content",
            "'messages[2].content' must be a string or a list of parts",
        ),
        (
            {"messages": [_OK, _OK, {"role": "user", "content": [*_PARTS, 7]}]},
            "messages[2].content[1]",
            "'messages[2].content[1]' must be an object",
        ),
        (
            {"messages": [_OK, _OK, {"role": "user", "content": [*_PARTS, {"type": 7}]}]},
            "messages[2].content[1].type",
            "'messages[2].content[1].type' must be a string",
        ),
        (
            {"messages": [_OK, _OK, {"role": "user", "content": [*_PARTS, {"type": "a b"}]}]},
            "messages[2].content[1].type",
            '"a b" is not a valid content part type: content part types are 1-128 characters '
            "of ASCII letters, digits and !#$%&'*+-.^_`|~",
        ),
        (
            {"messages": [_OK, {"role": "user", "content": [*_PARTS, {"text": 1}]}]},
            "messages[1].content[1].text",
            "'messages[1].content[1].text' must be a string",
        ),
        (
            {"messages": [_OK], "temperature": "hot"},
            "temperature",
            "'temperature' must be a number",
        ),
        ({"messages": [_OK], "top_p": True}, "top_p", "'top_p' must be a number"),
        (
            {"messages": [_OK], "top_p": 0.5, "bad name": 1},
            "bad name",
            '"bad name" is not a valid field name: field names are 1-128 characters of ASCII '
            "letters, digits and !#$%&'*+-.^_`|~",
        ),
        ({"prompt": 3}, "prompt", "'prompt' must be a string or a list"),
    ],
)
def test_a_bad_body_is_refused_naming_the_field(
    body: dict[str, Any], param: str, message: str
) -> None:
    """Issue 24: the names in these errors are made only for an error now."""
    endpoint: Endpoint = "completions" if "prompt" in body else "chat"
    with pytest.raises(RequestRejected) as err:
        parse_body(json.dumps(body).encode(), endpoint)
    assert (err.value.status, err.value.param, err.value.message) == (400, param, message)


def test_any_token_field_passes_known_or_not() -> None:
    body = {"messages": [_OK], "model": "m", "max_tokens": 3, "x-custom_field~": 1}
    assert parse_body(json.dumps(body).encode(), "chat").body == body
    # The names let through without the regex are tokens by its measure too.
    assert all(map(is_field_token, validate._KNOWN_FIELDS | validate._KNOWN_PARTS))
