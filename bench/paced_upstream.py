"""A vLLM-like streaming upstream that sends one event per write, `gap` apart.

    python bench/paced_upstream.py PORT [--chunks 16] [--gap-ms 20]

Unlike the static nginx upstream (a whole answer in one read), each token
reaches the proxy in its own read — the per-region work of a real engine's
stream — and, like vLLM, the final usage chunk comes only when the request
asks for it (`stream_options.include_usage`), in its own write before
[DONE]. `bench/instr.py --kind paced` measures against it.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

ENVELOPE = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1}


def event(choices: list[dict[str, object]], **extra: object) -> bytes:
    obj = {**ENVELOPE, "model": "tiny", "choices": choices, **extra}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def app(chunks: int, gap_s: float) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        asked = (body.get("stream_options") or {}).get("include_usage") is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        role = {"role": "assistant", "content": ""}
        await resp.write(
            event([{"index": 0, "delta": role, "logprobs": None, "finish_reason": None}])
        )
        for i in range(chunks):
            await asyncio.sleep(gap_s)
            delta = {"content": f" tok{i}"}
            await resp.write(
                event([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
            )
        await resp.write(
            event([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}])
        )
        if asked:
            usage = {"prompt_tokens": 20, "total_tokens": 20 + chunks, "completion_tokens": chunks}
            await resp.write(event([], usage=usage))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    a = web.Application()
    a.router.add_post("/v1/chat/completions", chat)
    a.router.add_get("/health", health)
    return a


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    args = ap.parse_args()
    web.run_app(
        app(args.chunks, args.gap_ms / 1000),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
