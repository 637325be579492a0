"""Cost of the output guard on the relay's hot path, in-process (no sockets).

Realistic vLLM chat chunks (compact JSON, raw UTF-8, one token of an answer
mixing prose, code, newlines and non-ASCII per chunk) are cut into regions as
`SSEFramer` returns them: one event per read (a token-by-token stream) or 64
events per read (a burst, or a slow client catching up). Each row is the best
of a few runs.

    .venv/bin/python bench/guard_bench.py [--events 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from proxy.guard.core import Guard
from proxy.openai.sse import SSEFramer
from proxy.policy import GuardPolicy, MalformedRule, RepetitionRule

ANSWER = (
    "Sure! Here is a short explanation of how continuous batching works in vLLM.\n\n"
    "1. **Scheduling**: every step, the scheduler picks the running sequences and "
    "admits waiting ones while KV-cache blocks are free.\n"
    "2. **PagedAttention** stores the cache in fixed-size blocks, like pages of "
    "virtual memory, so fragmentation stays low.\n\n"
    "```python\nfor step in range(max_steps):\n    batch = scheduler.schedule()\n"
    "    outputs = model.execute(batch)\n```\n\n"
    "En français : le traitement par lots continu réduit la latence — 日本語でも説明できます 🙂.\n"
)


def tokens() -> list[str]:
    """~4-character pieces, roughly what a BPE tokenizer streams."""
    out: list[str] = []
    i = 0
    while i < len(ANSWER):
        step = 3 + (i * 7) % 4
        out.append(ANSWER[i : i + step])
        i += step
    return out


def chunk(text: str, kind: str) -> bytes:
    if kind == "chat":
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        obj = "text_completion"
    body = {
        "id": "chatcmpl-5f3c0a9b1e8d4b6f9a2c7d1e0b4a3c2f",
        "object": obj,
        "created": 1767225600,
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "choices": [choice],
    }
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + data.encode() + b"\n\n"


def reads(n_events: int, per_read: int, kind: str) -> list[bytes]:
    toks = tokens()
    events = [chunk(toks[i % len(toks)], kind) for i in range(n_events)]
    return [b"".join(events[i : i + per_read]) for i in range(0, n_events, per_read)]


def best_of(
    works: list[Callable[[list[bytes]], None]], data: list[bytes], repeat: int
) -> list[float]:
    """Best time of each work; runs interleaved so machine noise hits them alike."""
    best = [float("inf")] * len(works)
    for _ in range(repeat):
        for i, work in enumerate(works):
            t0 = time.perf_counter()
            work(data)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def framer_only(data: list[bytes]) -> None:
    framer = SSEFramer()
    for chunk_ in data:
        framer.feed(chunk_)


def with_guard(guard: Guard) -> Callable[[list[bytes]], None]:
    def work(data: list[bytes]) -> None:
        framer = SSEFramer()
        sg = guard.stream()
        for i, chunk_ in enumerate(data):
            region = framer.feed(chunk_)
            if sg.feed(region) is not region:
                raise SystemExit(f"guard changed region {i}: {sg.feed(region)!r}")

    return work


def with_json(kind: str) -> Callable[[list[bytes]], None]:
    """The alternative: parse every event and read its text."""
    field = "delta" if kind == "chat" else None

    def work(data: list[bytes]) -> None:
        framer = SSEFramer()
        for chunk_ in data:
            region = framer.feed(chunk_)
            for line in region.split(b"\n\n")[:-1]:
                choice = json.loads(line[6:])["choices"][0]
                choice[field].get("content") if field else choice.get("text")

    return work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.events
    default = Guard(GuardPolicy())
    no_rep = Guard(GuardPolicy(repetition=RepetitionRule(enabled=False)))
    strict = Guard(GuardPolicy(malformed=MalformedRule(strict_json=True)))

    print(f"{n} events per row, best of {args.repeat} (interleaved); µs are per event\n")
    print("| kind | events/read | path | events/s | µs/event | guard µs/event |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for kind, per_read in (("chat", 1), ("chat", 64), ("completion", 1)):
        data = reads(n, per_read, kind)
        rows: list[tuple[str, Callable[[list[bytes]], None]]] = [
            ("SSEFramer", framer_only),
            ("+ guard (default policy)", with_guard(default)),
            ("+ guard, repetition off", with_guard(no_rep)),
            ("+ guard, strict_json", with_guard(strict)),
            ("+ json.loads per event", with_json(kind)),
        ]
        times = best_of([w for _, w in rows], data, args.repeat)
        base = times[0]
        for (label, _), t in zip(rows, times, strict=True):
            extra = f"{(t - base) / n * 1e6:.2f}" if t is not base else ""
            print(f"| {kind} | {per_read} | {label} | {n / t:,.0f} | {t / n * 1e6:.2f} | {extra} |")


if __name__ == "__main__":
    main()
