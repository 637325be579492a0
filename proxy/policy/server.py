"""`server:` — the listening side of the proxy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.policy.knobs import knob


@dataclass(frozen=True, slots=True)
class ServerPolicy:
    host: str = knob("127.0.0.1", "Address to listen on (`--host` overrides).", restart=True)
    port: int = knob(8080, "Port to listen on (`--port` overrides).", ge=1, le=65535, restart=True)
    admin_token: str = knob(
        "",
        "Bearer token for the admin endpoints; empty = admin endpoints disabled.",
        secret="value",
    )
    api_keys: tuple[str, ...] = knob(
        (),
        "Accepted client keys (`Authorization: Bearer ...`); empty = no client auth.",
        secret="value",
    )
    max_body_bytes: int = knob(
        4 * 1024 * 1024,
        "Request bodies above this get 413.",
        ge=1024,
        le=1024**3,
        unit="bytes",
        restart=True,
    )
    body_timeout_s: float = knob(
        30.0, "A request body not fully received within this gets 408 (slow clients).", gt=0
    )
    header_timeout_s: float = knob(
        10.0,
        "A request's headers must be complete this long after its first byte, or the "
        "connection is closed (slow-loris); 0 = no limit.",
        ge=0,
        le=3600,
    )
    heartbeat_s: float = knob(
        15.0,
        "Send an SSE comment (`: ping`) when the backend has been silent this long, so "
        "nginx's proxy_read_timeout and idle load balancers keep the stream; must be "
        "shorter than every backend's `timeouts.idle_s` and `timeouts.first_byte_s` "
        "(0 = no heartbeats).",
        ge=0,
        le=300,
    )
    max_event_bytes: int = knob(
        1024 * 1024,
        "A backend stream event larger than this (no blank line yet) ends the stream with "
        "an in-band error (a 502 before the first byte): bounds memory and CPU per stream.",
        ge=1024,
        le=1024**3,
        unit="bytes",
    )
    max_kept_bytes: int = knob(
        8 * 1024 * 1024,
        "Stream bytes kept per answer for a rescue or a session save; a longer answer is "
        "still relayed, but neither rescued nor saved.",
        ge=0,
        le=1024**3,
        unit="bytes",
    )
    max_event_watchers: int = knob(
        64,
        "Open `/brownout/events` streams (status pages) at most; one more gets 503 with "
        "`Retry-After` until one leaves (every watcher costs each push: 1,200 idle ones "
        "moved the proxy's p99 from 13 to 177 ms).",
        ge=1,
        le=100_000,
    )
    log_prompts: bool = knob(False, "Prompts and completions reach the logs only when true.")
    log_level: Literal["debug", "info", "warning", "error"] = knob(
        "info", "Log level.", restart=True
    )
    shutdown_grace_s: float = knob(
        10.0,
        "Seconds in-flight requests get to finish on SIGTERM/SIGINT, while `/readyz` "
        "answers 503 and new API requests 503 with `Retry-After`; the process exits as "
        "soon as the last one ends.",
        ge=0,
        restart=True,
    )
    watch_policy: bool = knob(
        False,
        "Reload the policy when its file, or the FAQ file it names, changes "
        "(besides SIGHUP and the API); a Kubernetes ConfigMap update (the kubelet's "
        "`..data` symlink swap) counts.",
    )
    watch_interval_s: float = knob(2.0, "How often the policy file is checked when watched.", gt=0)
