"""`backends:` — the primary (vLLM) and the fallback (Transformers) servers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.policy.knobs import knob, required

BackendKind = Literal["vllm", "transformers", "openai"]


@dataclass(frozen=True, slots=True)
class TimeoutPolicy:
    connect_s: float = knob(3.0, "TCP connect to the backend.", gt=0)
    first_byte_s: float = knob(
        60.0,
        "Until the first answer event (response headers and, for streams, the first "
        "event); long prefills count here.",
        gt=0,
    )
    idle_s: float = knob(30.0, "Longest silence between two stream events mid-answer.", gt=0)
    total_s: float = knob(
        600.0,
        "Whole answer of a non-streaming request (its first byte comes after the whole "
        "generation): a 504 past it, charged to the request, never to the backend.",
        gt=0,
    )


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    max_connections: int = knob(512, "Connection pool size towards this backend.", ge=1)
    keepalive_s: float = knob(30.0, "Idle keep-alive connections are closed after this.", gt=0)


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    path: str = knob("/health", "Probe path (vLLM: 200 = fine, 503 = engine dead).")
    interval_s: float = knob(2.0, "Seconds between probes.", gt=0)
    timeout_s: float = knob(1.0, "A probe slower than this fails.", gt=0)


@dataclass(frozen=True, slots=True)
class ProbePolicy:
    path: str = knob(
        "/v1/chat/completions",
        "Recovery probe: POSTed after /health passes while the breaker is open; a "
        "2xx closes the breaker. HTTP 400/404/405/422 means the backend does not take it: "
        "counted, shown in status, and real requests become the trial.",
    )
    body: str = knob(
        "",
        "The probe's JSON body (an object, as text); empty = a 1-token chat "
        '(`{"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}`). '
        "`model` is added when missing: the model whose breaker is tested, else the "
        "backend's `model`, else the model of the traffic that failed there, else the "
        "first model of its /v1/models.",
    )


@dataclass(frozen=True, slots=True)
class BackendPolicy:
    url: str = required(
        "Root URL of the OpenAI-compatible server (`/v1/...` is appended).", secret="userinfo"
    )
    kind: BackendKind = knob(
        "vllm", "`vllm`, `transformers` (brownout fallback-server) or `openai`."
    )
    model: str | None = knob(
        None, "Rewrite the request's `model` to this name; unset = pass through."
    )
    api_key: str | None = knob(
        None,
        "Sent as `Authorization: Bearer` to this backend instead of the client's header.",
        secret="value",
    )
    tokenizer: str | None = knob(
        None,
        "Local directory of this backend's Hugging Face tokenizer, for token-exact "
        "trimming (never downloaded); unset = the backend's /tokenize endpoint.",
    )
    max_model_len: int | None = knob(
        None,
        "Context window in tokens; unset = read from the backend's /v1/models.",
        ge=16,
        unit="tokens",
    )
    supports_continuation: bool | None = knob(
        None,
        "Whether the backend continues a partial assistant message "
        "(`continue_final_message`); unset = as it advertises, else yes for vllm and "
        "transformers, until it refuses a prefill. No: rescues continue by prompt.",
    )
    stream_usage: bool | None = knob(
        None,
        "Ask this backend for the token usage of every stream "
        "(`stream_options.include_usage`), for brownout_prompt_tokens_total and "
        "brownout_completion_tokens_total; the usage chunk is removed from the client's "
        "stream unless the client asked for it. Unset = yes for vllm and transformers, no "
        "for openai (OpenAI itself then adds `usage: null` to every chunk; other servers "
        "may refuse the field).",
    )
    drop_params: tuple[str, ...] = knob(
        (),
        "Request parameters removed before sending to this backend; the answer names "
        "them in `X-Brownout-Dropped`.",
    )
    timeouts: TimeoutPolicy = knob(TimeoutPolicy, "")
    pool: PoolPolicy = knob(PoolPolicy, "")
    health: HealthPolicy = knob(HealthPolicy, "")
    probe: ProbePolicy = knob(ProbePolicy, "")


@dataclass(frozen=True, slots=True)
class BackendsPolicy:
    primary: BackendPolicy = required("The main engine (vLLM).")
    fallback: BackendPolicy | None = knob(None, "The fallback (Transformers server); optional.")
    candidate: BackendPolicy | None = knob(
        None,
        "The engine being rolled out against the primary (`rollout:`); optional. Same "
        "keys as the primary.",
    )
