"""The batched engine's side lane under load (`fallback_gpu.py --mixed`).

Against one `fallback-server` (the default engine for the device), per level
N of `--mixed-streams`:

(a) N plain streams alone (the baseline, same server, same run);
(b) N plain streams plus 4 side-lane streams sent at once: 2 with a
    json_schema `response_format` (an enum-only object) and 2 with
    `logprobs` + `top_logprobs` 5;

then 4 side-lane streams alone (the side lane unloaded) and a forced tool call
(`tool_choice` naming a function), streamed and not. Every pair (a)/(b) runs
`--mixed-repeat` times, alternating, so that the run-to-run spread shows.

Checks: every json_schema answer parses and matches the schema; every
logprobs chunk has OpenAI's shape (`logprobs.content[]` of token / logprob /
bytes / top_logprobs with 5 entries, sorted, the greedy token first); the
forced call ends with `tool_calls` of the named function whose arguments
match its parameters, and finish_reason `tool_calls`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

SIDE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "confidence": {"enum": ["low", "medium", "high"]},
        "colour": {"enum": ["red", "green", "blue"]},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "confidence", "colour", "sure"],
    "additionalProperties": False,
}

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TOP_LOGPROBS = 5


def matches_schema(value: Any, schema: dict[str, Any]) -> str | None:
    """Why `value` does not match an enum/boolean-only object schema (None: it does)."""
    if not isinstance(value, dict):
        return f"not an object: {value!r}"
    props = schema["properties"]
    if set(value) != set(props):
        return f"keys {sorted(value)} != {sorted(props)}"
    for key, sub in props.items():
        if "enum" in sub and value[key] not in sub["enum"]:
            return f"{key}={value[key]!r} not in {sub['enum']}"
        if sub.get("type") == "boolean" and not isinstance(value[key], bool):
            return f"{key}={value[key]!r} not a boolean"
    return None


def logprobs_problem(chunk: dict[str, Any]) -> str | None:
    """Why a streamed chunk's logprobs are not OpenAI's shape (None: they are)."""
    choice = chunk["choices"][0]
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("content"), list):
        return f"logprobs {lp!r}"
    for entry in lp["content"]:
        problem = _entry_problem(entry, top=True)
        if problem:
            return problem
    return None


def _entry_problem(entry: Any, *, top: bool) -> str | None:
    if not isinstance(entry, dict):
        return f"entry {entry!r}"
    if not isinstance(entry.get("token"), str):
        return f"token {entry.get('token')!r}"
    logprob = entry.get("logprob")
    if not isinstance(logprob, int | float) or logprob > 1e-6:
        return f"logprob {logprob!r}"
    raw = entry.get("bytes", "missing")
    if raw is not None and not (
        isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw)
    ):
        return f"bytes {raw!r}"
    if not top:
        return None
    tops = entry.get("top_logprobs")
    if not isinstance(tops, list) or len(tops) != TOP_LOGPROBS:
        return f"top_logprobs {tops!r}"
    for sub in tops:
        problem = _entry_problem(sub, top=False)
        if problem:
            return "top: " + problem
    values = [t["logprob"] for t in tops]
    if values != sorted(values, reverse=True):
        return f"top_logprobs not sorted: {values}"
    if abs(tops[0]["logprob"] - logprob) > 1e-3:  # temperature 0: the chosen is the top
        return f"greedy token {logprob} is not the top {tops[0]['logprob']}"
    return None


# --- one request -------------------------------------------------------------------------


@dataclass
class Stream:
    kind: str  # plain, json, logprobs
    sent: float = 0.0
    ttft: float | None = None
    end: float = 0.0
    chunks: int = 0
    status: str = "ok"
    text: str = ""
    finish: str | None = None
    problems: list[str] = field(default_factory=list)
    token_bytes: bytes = b""  # logprobs streams: every entry's bytes, in order

    @property
    def rate(self) -> float | None:
        """Tokens a second after the first (this stream's own decode speed)."""
        if self.ttft is None or self.chunks < 2:
            return None
        return (self.chunks - 1) / max(self.end - self.sent - self.ttft, 1e-9)


def body(kind: str, i: int, tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Tell me story number {i} about a fox."}]
    out: dict[str, Any] = {"messages": messages, "temperature": 0, "stream": True}
    if kind == "json":
        messages[0]["content"] = f"Question {i}: is a fox a dog? Answer in JSON."
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": SIDE_SCHEMA, "strict": True},
        }
        out["max_tokens"] = 200  # the grammar ends the answer well before
    else:
        out.update(max_tokens=tokens, ignore_eos=True)
    if kind == "logprobs":
        out.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
    return out


async def one(session: aiohttp.ClientSession, url: str, kind: str, i: int, tokens: int) -> Stream:
    s = Stream(kind, sent=time.monotonic())
    async with session.post(url, json=body(kind, i, tokens)) as resp:
        if resp.status != 200:
            s.status = f"http {resp.status}: {(await resp.read())[:200]!r}"
            s.end = time.monotonic()
            return s
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                s.status = f"stream error: {chunk['error']}"
                break
            choice = chunk["choices"][0]
            delta = choice.get("delta", {})
            # A token held back (an incomplete UTF-8 sequence) is a chunk of "" content.
            if "content" in delta and "role" not in delta:
                if s.ttft is None:
                    s.ttft = time.monotonic() - s.sent
                s.text += delta["content"] or ""
                if kind == "logprobs":
                    problem = logprobs_problem(chunk)
                    if problem and len(s.problems) < 3:
                        s.problems.append(problem)
                    for entry in (choice.get("logprobs") or {}).get("content") or []:
                        s.chunks += 1
                        s.token_bytes += bytes(entry.get("bytes") or [])
                else:
                    s.chunks += 1
            if choice.get("finish_reason"):
                s.finish = choice["finish_reason"]
    s.end = time.monotonic()
    if kind == "json" and s.status == "ok":
        try:
            problem = matches_schema(json.loads(s.text), SIDE_SCHEMA)
        except json.JSONDecodeError as exc:
            problem = f"does not parse ({exc}): {s.text[:120]!r}"
        if problem:
            s.problems.append(problem)
    if kind == "logprobs" and s.status == "ok":
        text = s.token_bytes.decode("utf-8", errors="replace")
        if text != s.text:  # the tokens' bytes spell the content
            s.problems.append(f"tokens' bytes {text[:60]!r} != content {s.text[:60]!r}")
        if s.chunks != tokens:
            s.problems.append(f"{s.chunks} logprobs entries for {tokens} tokens")
    return s


async def tool_call(session: aiohttp.ClientSession, url: str, stream: bool) -> dict[str, Any]:
    """A forced call of `get_weather`: the call, its finish_reason and what is wrong."""
    req = {
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 200,
        "stream": stream,
    }
    started = time.monotonic()
    async with session.post(url, json=req) as resp:
        if resp.status != 200:
            return {"stream": stream, "problems": [f"http {resp.status}: {await resp.text()}"]}
        if stream:
            calls: dict[int, dict[str, Any]] = {}
            finish = None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                for d in choice.get("delta", {}).get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"function": {"arguments": ""}})
                    call.update({k: d[k] for k in ("id", "type") if k in d})
                    fn = d.get("function", {})
                    if "name" in fn:
                        call["function"]["name"] = fn["name"]
                    call["function"]["arguments"] += fn.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
            tool_calls = [calls[k] for k in sorted(calls)]
        else:
            data = await resp.json()
            choice = data["choices"][0]
            finish = choice.get("finish_reason")
            tool_calls = choice["message"].get("tool_calls") or []
    out: dict[str, Any] = {"stream": stream, "finish_reason": finish, "tool_calls": tool_calls}
    out["seconds"] = time.monotonic() - started
    problems = []
    if finish != "tool_calls":
        problems.append(f"finish_reason {finish!r}")
    if len(tool_calls) != 1:
        problems.append(f"{len(tool_calls)} tool calls")
    for call in tool_calls:
        fn = call.get("function", {})
        if call.get("type") != "function" or not str(call.get("id", "")).startswith("call_"):
            problems.append(f"call id/type {call.get('id')!r}/{call.get('type')!r}")
        if fn.get("name") != "get_weather":
            problems.append(f"name {fn.get('name')!r}")
        try:
            problem = matches_schema(json.loads(fn.get("arguments", "")), TOOL_PARAMS)
        except json.JSONDecodeError:
            problem = f"arguments do not parse: {fn.get('arguments')!r}"
        if problem:
            problems.append(problem)
    out["problems"] = problems
    return out


TOOL_PARAMS: dict[str, Any] = TOOL["function"]["parameters"]  # type: ignore[index]


# --- the phases --------------------------------------------------------------------------


SIDE_KINDS = ("json", "logprobs", "json", "logprobs")


@dataclass
class Phase:
    label: str
    streams: list[Stream]

    def of(self, *kinds: str) -> list[Stream]:
        return [s for s in self.streams if s.kind in kinds]


async def phase(base: str, label: str, plain: int, side: int, tokens: int) -> Phase:
    kinds = ["plain"] * plain + list(SIDE_KINDS[:side])
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        url = base + "/v1/chat/completions"
        streams = await asyncio.gather(
            *(one(session, url, k, i, tokens) for i, k in enumerate(kinds))
        )
    return Phase(label, list(streams))


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def _group(streams: list[Stream]) -> str:
    """tok/s (all streams together, first send to last end), TTFT p50/p95, errors."""
    if not streams:
        return "—"
    wall = max(s.end for s in streams) - min(s.sent for s in streams)
    tok_s = sum(s.chunks for s in streams) / wall if wall > 0 else 0.0
    ttfts = [s.ttft for s in streams if s.ttft is not None]
    p50, p95 = _pct(ttfts, 50), _pct(ttfts, 95)
    out = f"{tok_s:,.0f} tok/s"
    if p50 is not None and p95 is not None:
        out += f", TTFT p50 {p50:.2f} s / p95 {p95:.2f} s"
    bad = sum(1 for s in streams if s.status != "ok")
    return out + (f", {bad} failed" if bad else "") + f" ({wall:.1f} s)"


def _side(streams: list[Stream]) -> str:
    """Per side stream: kind, tokens, TTFT, own decode rate."""
    if not streams:
        return "—"
    parts = []
    for s in streams:
        ttft = "—" if s.ttft is None else f"{s.ttft:.2f} s"
        rate = "—" if s.rate is None else f"{s.rate:.0f}"
        status = "" if s.status == "ok" else f" [{s.status[:60]}]"
        parts.append(f"{s.kind} {s.chunks} tok TTFT {ttft} @ {rate} tok/s{status}")
    return "; ".join(parts)


def table(phases: list[Phase]) -> str:
    lines = [
        "| phase | plain streams | side lane, together | side lane, each (tokens, TTFT, rate) |",
        "|---|---|---|---|",
    ]
    for p in phases:
        plain, side = p.of("plain"), p.of("json", "logprobs")
        lines.append(f"| {p.label} | {_group(plain)} | {_group(side)} | {_side(side)} |")
    return "\n".join(lines)


def checks(phases: list[Phase], tools: list[dict[str, Any]]) -> tuple[list[str], bool]:
    lines: list[str] = []
    ok = True
    every = [s for p in phases for s in p.streams]
    for kind, what in (
        ("plain", "plain streams ended ok, finish_reason length"),
        ("json", "json_schema answers parse and match the schema"),
        ("logprobs", "logprobs streams: OpenAI's shape, an entry a token, bytes spell the text"),
    ):
        mine = [s for s in every if s.kind == kind]
        bad = [s for s in mine if s.status != "ok" or s.problems]
        if kind == "plain":
            bad += [s for s in mine if s.status == "ok" and s.finish != "length"]
        ok &= not bad
        line = f"- {what}: {len(mine) - len(bad)}/{len(mine)}"
        for s in bad[:3]:
            line += f"; FAIL: {s.status} {s.finish} {s.problems[:2]} {s.text[:80]!r}"
        lines.append(line)
    answers = sorted({s.text for s in every if s.kind == "json" and not s.problems})
    lines.append(f"- json_schema answers seen: {', '.join(f'`{a}`' for a in answers[:4])}")
    for t in tools:
        good = not t["problems"]
        ok &= good
        how = "streamed" if t["stream"] else "not streamed"
        calls = [c.get("function") for c in t.get("tool_calls", [])]
        verdict = "ok" if good else "FAIL: " + "; ".join(t["problems"])
        lines.append(
            f"- forced tool call ({how}): finish_reason {t.get('finish_reason')!r}, "
            f"calls {json.dumps(calls)}: {verdict}"
        )
    return lines, ok


async def run(base: str, levels: list[int], tokens: int, repeat: int, deadline: float) -> str:
    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] mixed: {msg}", flush=True)

    # Warm: the plain path, the side lane's first generate() and the grammar's first compile.
    started = time.monotonic()
    warm = await phase(base, "warm", 2, 4, 8)
    log(f"warm in {time.monotonic() - started:.1f} s: {_side(warm.of('json', 'logprobs'))}")
    phases: list[Phase] = []

    async def go(label: str, plain: int, side: int) -> None:
        if time.monotonic() > deadline:
            log(f"{label}: not run (time)")
            return
        p = await phase(base, label, plain, side, tokens)
        phases.append(p)
        log(f"{label}: plain {_group(p.of('plain'))}; side {_side(p.of('json', 'logprobs'))}")

    await go("4 side-lane streams alone", 0, 4)
    for n in levels:
        for r in range(repeat):
            tag = f" (run {r + 1})" if repeat > 1 else ""
            await go(f"{n} plain alone{tag}", n, 0)
            await go(f"{n} plain + 4 side lane{tag}", n, 4)
    tools = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for stream in (False, True):
            t = await tool_call(session, base + "/v1/chat/completions", stream)
            log(f"tool call: {t}")
            tools.append(t)
    lines, ok = checks(phases, tools)
    lines.append(f"- all checks: {'PASS' if ok else 'FAIL'}")
    return table(phases) + "\n\nChecks:\n\n" + "\n".join(lines) + "\n"
