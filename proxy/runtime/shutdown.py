"""The drain on SIGTERM: finish what is in flight, turn the rest away politely.

What a load balancer, a Kubernetes Service or nginx sees once `brownout
serve` gets SIGTERM (or SIGINT):

1. `/readyz` answers 503 (`"draining": true`) at once, so the replica is
   taken out of rotation while it still listens;
2. a new API request (`/v1/*`) is answered 503 with `Retry-After: 1` and
   `Connection: close` (code `shutting_down`): the client retries, on a new
   connection, and reaches another replica — never a refused connection or
   a reset;
3. requests already in flight (streams included) run to their end, for up to
   `server.shutdown_grace_s`; the listener closes when the last one ends
   (or at that deadline, when what is left is cancelled). A second signal
   cuts the wait short.

`/healthz` and `/metrics` keep answering during the drain (a liveness probe
must not kill a draining process). `Draining` does no I/O; `drain` is the
wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("brownout")

#: `Retry-After` on the requests a draining replica turns away: come back at
#: once, on a new connection (another replica).
RETRY_AFTER_S = 1
#: How often the drain looks at the in-flight count.
POLL_S = 0.05


@dataclass(slots=True)
class Draining:
    """Whether the process is draining, and the API requests in flight.

    `active` counts `/v1/*` requests from the moment the ingress middleware
    sees them (their body may still be arriving) to their answer's end."""

    draining: bool = False
    active: int = 0
    since: float | None = None
    hurry: asyncio.Event = field(default_factory=asyncio.Event)

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.since = time.monotonic()


async def drain(state: Draining, grace_s: float) -> bool:
    """Start draining and wait until no API request is in flight, for at most
    `grace_s` (or until `hurry` is set). True when everything finished."""
    state.begin()
    log.info("draining", inflight=state.active, grace_s=grace_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while state.active > 0 and not state.hurry.is_set():
        left = deadline - loop.time()
        if left <= 0:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.hurry.wait(), timeout=min(POLL_S, left))
    done = state.active == 0
    took = round(time.monotonic() - (state.since or time.monotonic()), 3)
    if done:
        log.info("drained", took_s=took)
    else:
        log.warning("drain_cut_short", inflight=state.active, took_s=took, grace_s=grace_s)
    return done
