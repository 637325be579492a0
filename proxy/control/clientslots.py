"""How many of the engine's admission slots one client may hold at once
(`ladder.throttle.max_inflight_per_client`): a client over its share is shed
(429 `client_limit`) instead of taking the capacity every other client
shares. Decisions only; the identity is `proxy.ingress.identity`'s."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ClientSlots:
    held: dict[str, int] = field(default_factory=dict)

    def take(self, client: str, limit: int) -> bool:
        n = self.held.get(client, 0)
        if n >= limit:
            return False
        self.held[client] = n + 1
        return True

    def give(self, client: str) -> None:
        n = self.held.get(client, 0) - 1
        if n > 0:
            self.held[client] = n
        else:
            self.held.pop(client, None)
