"""The hostile client of drill 8: one identity, requests that a client can shape
to hurt a backend, sent while the normal load runs.

The hostile client connects to nginx from its own loopback address
(127.0.0.2), so nginx's `X-Forwarded-For` names it and the proxy sees a
client identity (`proxy/ingress/identity.py`) other than the load's
(127.0.0.1, the "frontend" the load stands for). It is an end user: nginx's
per-address limits apply to it (the load's address is exempt).

What it sends (issue #20), from a few lanes at once, for the fault window:

- poison sampling values: `repetition_penalty`, `temperature`, `top_p` of
  1e-300, alone and together;
- hostile schemas: `response_format` json_schema 200 objects deep, and an
  enum of 100,000 entries;
- long non-streaming answers (`max_tokens` far past what `first_byte_s`
  allows for a whole generation);
- retry amplification: bursts of poison requests at once.

Each kind goes once the plain way (the primary, vLLM, takes it) and once
with a `max_tokens` larger than the primary's window (`context_length_exceeded`
there), which the proxy sends on to the fallback (the Transformers server):
that way the fallback server gets the same poison through the proxy, as it
would during a failover.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from tests.chaos.drill import classify

__all__ = [
    "HOSTILE_ADDRESS",
    "KINDS",
    "HostileClient",
    "HostileReq",
    "deep_schema",
    "hostile_policy",
    "metric_values",
]

HOSTILE_ADDRESS = "127.0.0.2"
PRIMARY_WINDOW_TOKENS = 1024  # the chaos vLLM's --max-model-len
PAST_PRIMARY = 1020  # max_tokens: with any prompt (≥ 11 tokens) past the primary's window
LONG_TOKENS = 900  # a long non-stream answer the primary can give (≈ 3 s idle)
POISON = 1e-300

Verdict = Literal["answer", "clear_error", "bad"]


def deep_schema(depth: int) -> dict[str, Any]:
    """An object schema nested `depth` objects deep."""
    s: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}


def _enum(n: int) -> dict[str, Any]:
    return {"enum": [f"v{i:06d}" for i in range(n)]}


def kinds(enum_entries: int = 100_000) -> dict[str, dict[str, Any]]:
    """Body fields of each hostile request kind (`-fb`: routed on to the fallback)."""
    rp = {"repetition_penalty": POISON}
    all3 = {"repetition_penalty": POISON, "temperature": POISON, "top_p": POISON}
    deep = {"response_format": _schema(deep_schema(200))}
    enum = {"response_format": _schema(_enum(enum_entries))}
    short, past = {"max_tokens": 16}, {"max_tokens": PAST_PRIMARY}
    return {
        "poison:repetition_penalty": {**rp, **short},
        "poison:temperature": {"temperature": POISON, **short},
        "poison:top_p": {"top_p": POISON, **short},
        "poison:all-stream": {**all3, **short, "stream": True},
        "poison:repetition_penalty-fb": {**rp, **past},
        "poison:all-fb-stream": {**all3, **past, "stream": True},
        "schema:deep200": {**deep, **short},
        "schema:deep200-fb": {**deep, **past},
        "schema:enum-stream": {**enum, **short, "stream": True},
        "schema:enum-fb": {**enum, **past},
        "long:non-stream": {"max_tokens": LONG_TOKENS, "ignore_eos": True},
        "long:non-stream-fb": {"max_tokens": PAST_PRIMARY, "ignore_eos": True},
    }


KINDS = tuple(kinds(1))

# Each lane cycles through its kinds, one request at a time, `pause_s` apart.
LANES: dict[str, tuple[tuple[str, ...], float]] = {
    "poison": (
        (
            "poison:repetition_penalty",
            "poison:temperature",
            "poison:top_p",
            "poison:all-stream",
            "poison:repetition_penalty-fb",
            "poison:all-fb-stream",
        ),
        0.3,
    ),
    "schema": (("schema:deep200", "schema:deep200-fb", "schema:enum-fb"), 0.5),
    "long": (("long:non-stream", "long:non-stream-fb"), 0.3),
}
# Sent once per fault window: vLLM compiles a 100k enum for minutes on CPU.
ONCE = ("schema:enum-stream",)
# Retry amplification: this many poison requests at once, every `burst_every_s`.
BURST_KINDS = ("poison:repetition_penalty-fb", "poison:all-fb-stream")


@dataclass
class HostileReq:
    kind: str
    started: float
    ended: float = 0.0
    status: int = 0
    code: str = ""  # the error object's code (or an HTTP status / transport failure)
    backend: str = ""
    tier: str = ""
    verdict: Verdict = "bad"
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def judge(status: int, ctype: str, raw: bytes, transport: str) -> tuple[Verdict, str]:
    """A hostile request's end: a valid answer, a clear error (an OpenAI error
    object with a 4xx, 502 or 504, or in-band in a stream that ends with
    `[DONE]`), or bad (a 500, a broken or truncated reply)."""
    v = classify(status, ctype, raw, transport)
    if v.outcome == "complete":
        return "answer", ""
    if v.outcome == "error" and not v.code.startswith("transport:"):
        code = v.code.split(":", 1)[1] if status != 200 and ":" in v.code else v.code
        if status == 200 or 400 <= status < 500 or status in (502, 504):
            return "clear_error", code
        return "bad", code
    return "bad", v.code or v.outcome


class HostileClient:
    """Lanes of hostile requests from one address, through nginx."""

    def __init__(
        self,
        base_url: str,
        *,
        enum_entries: int = 100_000,
        burst: int = 4,
        burst_every_s: float = 10.0,
        timeout_s: float = 150.0,
    ) -> None:
        self.base_url = base_url
        self.bodies = kinds(enum_entries)
        self.burst = burst
        self.burst_every_s = burst_every_s
        self.timeout_s = timeout_s
        self.records: list[HostileReq] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None
        self._n = 0

    async def __aenter__(self) -> HostileClient:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, local_addr=(HOSTILE_ADDRESS, 0)),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        if self._http is not None:
            await self._http.close()
            self._http = None

    def start(self) -> None:
        for name, (cycle, pause) in LANES.items():
            self._tasks.append(asyncio.create_task(self._lane(name, cycle, pause)))
        for kind in ONCE:
            self._tasks.append(asyncio.create_task(self._record(kind)))
        self._tasks.append(asyncio.create_task(self._bursts()))

    def halt(self) -> None:
        """No new hostile requests from now on."""
        self._stop.set()

    async def stop(self) -> None:
        """Halt, then wait for the ones in flight (each bounded by `timeout_s`)."""
        self._stop.set()
        tasks, self._tasks = self._tasks, []
        await asyncio.gather(*tasks)

    async def _pause(self, s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), s)

    async def _lane(self, name: str, cycle: tuple[str, ...], pause: float) -> None:
        i = 0
        while not self._stop.is_set():
            await self._record(cycle[i % len(cycle)])
            i += 1
            await self._pause(pause)

    async def _bursts(self) -> None:
        while not self._stop.is_set():
            await asyncio.gather(
                *(self._record(BURST_KINDS[j % len(BURST_KINDS)]) for j in range(self.burst))
            )
            await self._pause(self.burst_every_s)

    async def _record(self, kind: str) -> None:
        self.records.append(await self.one(kind))

    async def one(self, kind: str) -> HostileReq:
        assert self._http is not None, "use `async with HostileClient(...)`"
        self._n += 1
        rec = HostileReq(kind, time.time())
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Hostile {self._n}: say something."}],
            **self.bodies[kind],
        }
        raw = bytearray()
        status, ctype, transport = 0, "", ""
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                self._http.post(
                    self.base_url + "/v1/chat/completions",
                    json=body,
                    headers={"X-Request-Id": f"hostile-{self._n}"},
                ) as resp,
            ):
                status = rec.status = resp.status
                ctype = resp.headers.get("Content-Type", "")
                rec.backend = resp.headers.get("X-Brownout-Backend", "")
                rec.tier = resp.headers.get("X-Brownout-Tier", "")
                try:
                    async for chunk in resp.content.iter_any():
                        raw += chunk
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    transport = type(exc).__name__
        except TimeoutError:
            rec.ended = time.time()
            rec.verdict, rec.code = "bad", f"no end after {self.timeout_s:.0f} s"
            return rec
        except aiohttp.ClientError as exc:
            rec.ended = time.time()
            rec.verdict, rec.code = "bad", "transport:" + type(exc).__name__
            return rec
        rec.ended = time.time()
        rec.verdict, rec.code = judge(status, ctype, bytes(raw), transport)
        if rec.verdict != "answer":
            rec.detail = bytes(raw[-300:]).decode("utf-8", "replace")
        return rec


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class HostileSummary:
    """What drill 8 reports about the hostile client and everyone else."""

    others_total: int
    others_normal: int
    others_fallback: int
    others_bad: dict[str, int]
    hostile_by_kind: dict[str, dict[str, int]]  # kind → "status code" → count
    hostile_verdicts: dict[str, int]
    bad_examples: list[str]
    slow_non_stream: tuple[int, int, float]  # (answers over first_byte_s, all, longest s)
    first_byte_s: float
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # family → labels → delta
    breakers_seen: dict[str, list[str]] = field(default_factory=dict)  # backend → states

    @property
    def others_share(self) -> float:
        return self.others_normal / self.others_total if self.others_total else 0.0


def summarize(
    hostile: list[HostileReq],
    others: list[Any],
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    first_byte_s: float,
    breakers_seen: dict[str, list[str]] | None = None,
) -> HostileSummary:
    """`others`: the load's requests (tests.chaos.drill.Req) that ended during
    and after the fault."""
    bad = collections.Counter(
        f"{r.outcome}" + (f" ({r.code})" if r.code else "")
        for r in others
        if r.outcome != "complete"
    )
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for h in hostile:
        label = f"{h.status or '-'} {h.code}".strip() if h.verdict != "answer" else f"{h.status} ok"
        by_kind[h.kind][label] += 1
    longs = [h for h in hostile if h.kind.startswith("long:") and h.verdict == "answer"]
    slow = sum(1 for h in longs if h.seconds > first_byte_s)
    delta: dict[str, dict[str, float]] = {}
    for fam, series in after.items():
        for labels, v in series.items():
            d = v - before.get(fam, {}).get(labels, 0.0)
            if d:
                delta.setdefault(fam, {})[labels] = d
    return HostileSummary(
        others_total=len(others),
        others_normal=sum(1 for r in others if r.outcome == "complete"),
        others_fallback=sum(
            1 for r in others if r.outcome == "complete" and r.backend == "fallback"
        ),
        others_bad=dict(bad),
        hostile_by_kind={k: dict(v) for k, v in sorted(by_kind.items())},
        hostile_verdicts=dict(collections.Counter(h.verdict for h in hostile)),
        bad_examples=[
            f"{h.kind}: {h.status} {h.code} after {h.seconds:.1f} s: {h.detail[-160:]!r}"
            for h in hostile
            if h.verdict == "bad"
        ][:8],
        slow_non_stream=(slow, len(longs), max((h.seconds for h in longs), default=0.0)),
        first_byte_s=first_byte_s,
        metrics=delta,
        breakers_seen=breakers_seen or {},
    )


# --------------------------------------------------------------------------- policy, metrics

FAMILIES = (
    "brownout_failures_total",
    "brownout_breaker_transitions_total",
    "brownout_corroborations_total",
    "brownout_retries_total",
)
_SAMPLE = re.compile(r"^(\w+)(\{[^}]*\})?\s+(\S+)$")


def metric_values(text: str) -> dict[str, dict[str, float]]:
    """The counters of FAMILIES from a Prometheus scrape: family → labels → value."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in FAMILIES:
            out.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return out


def hostile_policy(text: str, first_byte_s: float, total_s: float) -> str:
    """The drill's policy: the primary's `first_byte_s` short enough that a
    long non-streaming answer outlives it (what used to be charged to the
    backend), and `total_s` for non-streaming answers on both backends."""
    lines = []
    section = ""
    for line in text.splitlines(keepends=True):
        if m := re.match(r"^  (primary|fallback):\s*$", line):
            section = m.group(1)
        if line.lstrip().startswith("timeouts: {") and section:
            line = line.replace("}", f", total_s: {total_s:g}}}", 1)
            if section == "primary":
                line = re.sub(r"first_byte_s: [\d.]+", f"first_byte_s: {first_byte_s:g}", line)
        lines.append(line)
    out = "".join(lines)
    if out.count("total_s:") != 2:
        raise RuntimeError("the drill policy no longer has two backend `timeouts:` lines")
    return out
