"""One backend's judgement: its breakers, their corroboration ledgers and its
retry budget (decisions only; `proxy.backends.upstream` holds the sockets).

Breakers: one per backend (`breaker`), except for a backend that serves
several models and has no `model` rewrite (`per_model`): there a request's
model (one of those its /v1/models lists) gets its own breaker, so failures of
one model never divert another's traffic. Ask `breaker_for(model)` for the
permit and hand it back to `release_trial(permit)` (or report it to the
runtime): a permit knows the breaker that issued it. Each breaker has a
`Ledger` (`proxy.control.attribution`): whether a suspect failure may open it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from proxy.control.attribution import Ledger
from proxy.control.breaker import BackendBreaker, Permit
from proxy.control.retrybudget import RetryBudget

# Models of one backend that get their own breaker (the rest share `breaker`).
MAX_MODEL_BREAKERS = 64

ModelBreakerChange = Callable[[str, str, str, str, str], None]  # backend, model, old, new, why


@dataclass
class BreakerSet:
    breaker: BackendBreaker
    model_breakers: dict[str, BackendBreaker] = field(default_factory=dict)
    retry_budget: RetryBudget = field(default_factory=RetryBudget)
    on_model_breaker_change: ModelBreakerChange | None = None
    ledgers: dict[int, Ledger] = field(default_factory=dict)  # by id(breaker)

    def breaker_for(
        self, model: str | None, per_model: bool, served: tuple[str, ...]
    ) -> BackendBreaker:
        """The breaker that admits a request for `model` (the request's
        `model` field as sent to this backend). The backend's own breaker
        while it is not closed (opened by another replica, or by requests
        without a served model): it gates every model, and real requests can
        then be its half-open trial."""
        if model is None or not per_model or model not in served:
            return self.breaker
        if self.breaker.state != "closed":
            return self.breaker
        b = self.model_breakers.get(model)
        if b is None:
            b = BackendBreaker(
                self.breaker.name, self.breaker.policy, self.breaker.clock, self._changed(model)
            )
            b.model = model
            self.model_breakers[model] = b
            if self.on_model_breaker_change is not None:
                self.on_model_breaker_change(
                    self.breaker.name, model, "closed", "closed", "created"
                )
        return b

    def _changed(self, model: str) -> Callable[[str, str, str, str], None]:
        def changed(name: str, old: str, new: str, reason: str) -> None:
            cb = self.on_model_breaker_change
            if cb is not None:
                cb(name, model, old, new, reason)

        return changed

    def breaker_of(self, permit: Permit) -> BackendBreaker:
        """The breaker of this backend that issued `permit`."""
        owner = permit.owner
        if (
            isinstance(owner, BackendBreaker)
            and self.model_breakers.get(owner.model or "") is owner
        ):
            return owner
        return self.breaker

    def ledger(self, b: BackendBreaker) -> Ledger:
        """`b`'s corroboration ledger (one per breaker, made on first use)."""
        led = self.ledgers.get(id(b))
        if led is None:
            p = b.policy
            led = self.ledgers[id(b)] = Ledger(p.reset_timeout_s, p.min_clients)
        return led

    def release_trial(self, permit: Permit | None) -> None:
        """`breaker.release_trial` on whichever breaker issued `permit`."""
        # Only a half-open trial holds a slot (a closed breaker's permits are
        # all trial 0): nothing to look up on the common path.
        if permit is not None and permit.trial:
            self.breaker_of(permit).release_trial(permit)

    def all(self) -> Iterator[tuple[str | None, BackendBreaker]]:
        """(model or None for the backend's own, breaker) of this backend."""
        yield None, self.breaker
        yield from self.model_breakers.items()

    def trial_due(self, now: float) -> bool:
        """Whether one of the backend's breakers (its own, or a model's) would
        admit a half-open trial now."""
        return any(
            b.state == "half-open" or (b.state == "open" and now >= b.retry_at())
            for _, b in self.all()
        )

    def any_closed_model(self, served: int) -> bool | None:
        """Per-model breakers: None while some served model has none yet,
        else whether one of them is closed."""
        mb = self.model_breakers
        if len(mb) < served:
            return None
        return any(b.state == "closed" for b in mb.values())
