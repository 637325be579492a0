"""Scripted fake backends for the whole-proxy simulation (test_ladder_simulation.py).

Two OpenAI-compatible fakes on real sockets whose behaviour a rule switches:
the primary looks like vLLM (`/v1/models` with `max_model_len`, `/metrics`
with `vllm:num_requests_running/waiting`, `/tokenize`), the fallback like the
Transformers server (its `/v1/models` card advertises `capabilities`: plain
chat plus `continue_final_message`, no `logprobs`). A healthy backend answers
"from <name>" (a stream, or one chat.completion), so the client can tell who
wrote an answer.

Modes (`MODES`): healthy; down (the port is closed: connection refused);
storm (every request 500, /health still 200, as a wedged engine does); flap
(500 and healthy in turn); stall (nothing before the first byte); cut (a
stream cut mid-answer: one content chunk, then the connection drops); slow
(a late first token); r429 (429 with `Retry-After`). `rejects_prefill` (any
mode) answers 400 to an assistant prefill (`continue_final_message`), as
some models do.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from tests.integration.conftest import chunk, free_port
from tests.integration.test_ladder_flow import DONE, ROLE_CHUNK, SSE_HEADERS, VLLM_500, Fake

Mode = Literal["healthy", "down", "storm", "flap", "stall", "cut", "slow", "r429"]
MODES: tuple[Mode, ...] = ("healthy", "down", "storm", "flap", "stall", "cut", "slow", "r429")
SLOW_S = 0.05  # the slow mode's delay before the first byte (real seconds)
PARTIAL = "partial "  # what a cut stream delivers before the connection drops
MODEL = "tiny"

_PLAIN_CHAT = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "continue_final_message",
    "add_generation_prompt",
]
FALLBACK_CAPABILITIES: dict[str, Any] = {
    "engine": "generate",
    "continue_final_message": True,
    "n": True,
    "max_n": 1,
    "stop": True,
    "seed": False,
    "logprobs": False,
    "max_top_logprobs": 0,
    "response_format": ["text"],
    "tools": False,
    "tool_choice": ["none", "auto"],
    "chat_completions": {"honoured": [*_PLAIN_CHAT, "stop"], "ignored": []},
    "completions": {"honoured": ["model", "prompt", "max_tokens", "stream"], "ignored": []},
}
PREFILL_400 = {
    "error": {
        "message": "continue_final_message is not supported by this chat template",
        "type": "BadRequestError",
        "param": "continue_final_message",
        "code": 400,
    }
}
# A hostile client's sampling value (issue 20): both fakes answer it 500.
POISON_TOP_P = 1e-300
POISON_500 = {
    "error": {
        "message": "probability tensor contains either inf, nan or element < 0",
        "type": "InternalServerError",
        "code": 500,
    }
}
RATE_LIMITED = {
    "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": 429}
}


@dataclass
class ScriptedBackend:
    name: Literal["primary", "fallback"]
    fake: Fake
    max_model_len: int
    mode: Mode = "healthy"
    retry_after: str = "0"
    rejects_prefill: bool = False
    waiting: int = 0  # vllm:num_requests_waiting on /metrics
    _flaps: int = 0

    @classmethod
    async def start(cls, name: Literal["primary", "fallback"]) -> ScriptedBackend:
        fake = Fake(free_port())
        me = cls(name, fake, 8192 if name == "primary" else 4096)
        fake.handlers.update(
            {
                "/health": me.health,
                "/v1/models": me.models,
                "/v1/chat/completions": me.chat,
                "/tokenize": me.tokenize,
                "/metrics": me.metrics,
            }
        )
        await fake.start()
        return me

    @property
    def url(self) -> str:
        return self.fake.url

    @property
    def text(self) -> str:
        return f"from {self.name}"

    async def set_mode(self, mode: Mode) -> None:
        if mode == "down" and self.mode != "down":
            await self.fake.stop()
        elif mode != "down" and self.mode == "down":
            await self.fake.start()
        self.mode = mode

    def chat_bodies(self) -> list[dict[str, Any]]:
        return self.fake.chat_bodies()

    # -- handlers ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.StreamResponse:
        card: dict[str, Any] = {
            "id": MODEL,
            "object": "model",
            "owned_by": "vllm" if self.name == "primary" else "brownout",
            "max_model_len": self.max_model_len,
        }
        if self.name == "fallback":
            card["capabilities"] = FALLBACK_CAPABILITIES
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = json.dumps(body.get("messages") or body.get("prompt") or "")
        n = len(text) // 4 + 1
        return web.json_response(
            {"count": n, "max_model_len": self.max_model_len, "tokens": list(range(n))}
        )

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} 0.0\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {float(self.waiting)}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} 0.1\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("top_p") == POISON_TOP_P:
            # A value the engine chokes on (inf/nan in sampling), in every mode:
            # the request's problem; the probe (no top_p) is unaffected.
            return web.json_response(POISON_500, status=500)
        if self.rejects_prefill and body.get("continue_final_message"):
            return web.json_response(PREFILL_400, status=400)
        mode = self.mode
        if mode == "flap":
            self._flaps += 1
            mode = "storm" if self._flaps % 2 else "healthy"
        if mode == "storm":
            return web.json_response(VLLM_500, status=500)
        if mode == "r429":
            return web.json_response(
                RATE_LIMITED, status=429, headers={"Retry-After": self.retry_after}
            )
        if mode == "stall":
            await asyncio.sleep(3600)  # cancelled when the proxy gives up
        if mode == "slow":
            await asyncio.sleep(SLOW_S)
        stream = bool(body.get("stream"))
        if mode == "cut":
            return await self._cut(request, stream)
        if stream:
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            await resp.write(
                ROLE_CHUNK + chunk("from ") + chunk(self.name) + chunk("", "stop") + DONE
            )
            return resp
        return web.json_response(
            {
                "id": "chatcmpl-sim",
                "object": "chat.completion",
                "created": 1,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": self.text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        )

    async def _cut(self, request: web.Request, stream: bool) -> web.StreamResponse:
        """Part of an answer, then the connection drops (no chunked terminator)."""
        if stream:
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            await resp.write(ROLE_CHUNK + chunk(PARTIAL))
        else:
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 4096
            await resp.prepare(request)
            await resp.write(b'{"id": "chatcmpl-sim", "object": "chat.completion", "cho')
        await asyncio.sleep(0.02)  # let the proxy relay the bytes first
        assert request.transport is not None
        request.transport.abort()
        return resp
