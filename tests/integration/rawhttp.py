"""HTTP/1.1 on a raw socket: for requests an HTTP client will not send
(bytes that are not UTF-8 in a header, odd paths, slow headers)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def raw_request(
    url: str,
    method: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    body: bytes = b"",
) -> RawResponse:
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        head = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: test"]
        head += [k + b": " + v for k, v in headers or []]
        head += [b"Content-Length: %d" % len(body), b"Connection: close"]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return RawResponse(status, hdrs, rest)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return out
