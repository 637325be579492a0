"""proxy.ingress: path rules, forwarded headers, the route table."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from proxy.ingress.headers import body_coding, forward_headers
from proxy.ingress.paths import path_problem
from proxy.ingress.routes import ROUTES, markdown_table


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
