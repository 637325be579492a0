"""Shared pieces of the benchmarks: a fast static upstream, ports, processes."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def sse_body(chunks: int, usage: bool = False) -> bytes:
    """A vLLM-shaped chat stream: `chunks` content chunks, a finish, with
    `usage` vLLM's usage chunk (what `stream_options.include_usage` asks
    for), [DONE]."""
    out = []
    for i in range(chunks):
        obj = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": f"tok{i} "},
                    "logprobs": None,
                    "finish_reason": "stop" if i == chunks - 1 else None,
                }
            ],
        }
        out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
    if usage:
        obj = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "tiny",
            "choices": [],
            "usage": {
                "prompt_tokens": 20,
                "total_tokens": 20 + chunks,
                "completion_tokens": chunks,
            },
        }
        out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def start_static_upstream(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    """nginx serving prebuilt SSE bodies at /{short,long}/v1/chat/completions
    (POST answered through `error_page 405 =200 $uri`), /health and a slow
    variant (`limit_rate`) for open-stream memory measurements."""
    for name, chunks, usage in (
        ("short", 16, False),
        ("long", 1024, False),
        ("slow", 64, False),
        # What vLLM sends when asked for usage (Brownout asks on every stream).
        ("usage", 16, True),
    ):
        d = tmp / "www" / name / "v1" / "chat"
        d.mkdir(parents=True)
        (d / "completions").write_bytes(sse_body(chunks, usage))
    conf = tmp / "upstream.conf"
    conf.write_text(
        f"""
worker_processes 1;
error_log {tmp}/upstream-error.log warn;
pid {tmp}/upstream.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        root {tmp}/www;
        default_type text/event-stream;
        location = /health {{ return 200; }}
        location /slow/ {{ limit_rate 64; error_page 405 =200 $uri; }}
        location / {{ error_page 405 =200 $uri; }}
    }}
}}
"""
    )
    return subprocess.Popen(
        [NGINX, "-p", str(tmp), "-c", str(conf), "-g", "daemon off; user root;"]
    )


def start_nginx_proxy(
    tmp: Path, port: int, upstream_port: int, prefix: str
) -> subprocess.Popen[bytes]:
    """nginx as a reverse proxy, configured like nginx/brownout.conf (buffering off)."""
    conf = tmp / f"proxy-{prefix}.conf"
    conf.write_text(
        f"""
worker_processes 1;
error_log {tmp}/proxy-error.log warn;
pid {tmp}/proxy-{prefix}.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/pbody;
    proxy_temp_path {tmp}/ptemp;
    upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://up/{prefix}/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_cache off;
            gzip off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""
    )
    return subprocess.Popen(
        [NGINX, "-p", str(tmp), "-c", str(conf), "-g", "daemon off; user root;"]
    )


def proc_tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    tick = 100.0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_bytes(pids: list[int], field: str = "VmRSS") -> int:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total
