"""Who a client is, as far as Brownout may believe it: for the breakers'
"one client" rule (`proxy.control.attribution`) and the per-client session
cap (`sessions.max_sessions_per_client`).

- With `server.api_keys`, the API key (the middleware checked it).
- Else the address nginx saw: the last `X-Forwarded-For` entry — nginx's
  `$proxy_add_x_forwarded_for` appends the peer it accepted, so a client
  cannot forge the last entry — believed only from a loopback peer (a proxy
  on the same host, the sidecar's deployment); else the peer address.
- Never the session id, nor a bearer token without configured keys: both
  are the client's own choice.
"""

from __future__ import annotations

_LOOPBACK = frozenset({"127.0.0.1", "::1"})


def client_identity(
    peer: str | None, api_key: str | None, forwarded_for: str | None, *, keyed: bool
) -> str:
    """`key:<api key>` or `addr:<address>` (callers hash it before storing it)."""
    if keyed and api_key:
        return f"key:{api_key}"
    if forwarded_for and peer in _LOOPBACK:
        last = forwarded_for.rsplit(",", 1)[-1].strip()
        if last:
            return "addr:" + last[:64]
    return f"addr:{peer or 'unknown'}"
