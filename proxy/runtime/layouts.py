"""The attribute layouts of objects every request makes, settled at start-up.

CPython 3.11 keeps an instance's attributes in a compact array laid out by
keys its class shares, and gives those keys less room with every instance
made (`init_inline_values` in Objects/dictobject.c): after a few dozen
instances no new attribute name can join them. An instance that then sets a
name the first instances never set gets a dictionary of its own, and every
attribute read and write on it is a dictionary operation.

Which names joined depends on what ran first. aiohttp's `StreamWriter` is
made for every request a client session sends and for every response the
server writes; a health probe (a GET, no body) sets fewer names than a
streamed answer (`chunked`, `buffer_size`, `output_size`, ...). A proxy
whose probes made a few dozen writers before its first streamed answer — a
minute without traffic, or a rollout's candidate probed besides the
primary — then paid ~15,000 more instructions per 16-chunk stream (+1.4 %,
issue 21: measured as the cost of an idle rollout; the same proxy without a
candidate after 45 s without traffic paid it too).

`settle_layouts()` sets those names on one throwaway instance per class
before anything else makes one (`proxy.server.run`, first thing), so they
all join whatever the order of the traffic. No effect elsewhere than on the
instances' layout; idempotent.
"""

from __future__ import annotations

from aiohttp.client_reqrep import ClientResponse
from aiohttp.http_writer import StreamWriter

# Every instance attribute aiohttp 3.x's writer sets, on any path (its own
# methods, `web_response`'s `writer.length`, `client_reqrep`'s
# `writer.on_body_write`, `web_urldispatcher`'s `writer.output_size`).
_LAYOUTS: tuple[tuple[type, tuple[str, ...]], ...] = (
    (
        StreamWriter,
        (
            "_protocol",
            "loop",
            "length",
            "chunked",
            "buffer_size",
            "output_size",
            "_eof",
            "_compress",
            "_on_chunk_sent",
            "_on_headers_sent",
            "_headers_buf",
            "_headers_written",
            "on_body_write",
        ),
    ),
    # A response the client sessions read (one per backend attempt): what a
    # streamed answer sets, in the 29 names a class can take besides its
    # first instance (30 in all, SHARED_KEYS_MAX_SIZE) — all but the cookie
    # headers' raw list and the debug mode's traceback.
    (
        ClientResponse,
        (
            "method",
            "_url",
            "_real_url",
            "_body",
            "_ClientResponse__writer",  # its `__writer`
            "_continue",
            "_closed",
            "_history",
            "_request_info",
            "_timer",
            "_cache",
            "_traces",
            "_loop",
            "_session",
            "_resolve_charset",
            "_protocol",
            "_connection",
            "_stream_writer",
            "_output_size",
            "_in_context",
            "_released",
            "_upload_complete",
            "_cookies",
            "_headers",
            "_raw_headers",
            "content",
            "status",
            "reason",
            "version",
        ),
    ),
)

_settled = False


def settle_layouts() -> None:
    """Give each class of `_LAYOUTS` every name it will ever set, now (once)."""
    global _settled
    if _settled:
        return
    _settled = True
    for cls, names in _LAYOUTS:
        obj: object = object.__new__(cls)  # no __init__: nothing opened, nothing to close
        for name in names:
            # The class's default where it has one (a value of the right kind).
            object.__setattr__(obj, name, getattr(cls, name, None))
        del obj
