"""The gray release of `backends.candidate`: states, steps, sticky buckets.

    idle ─start─► [mirror ─mirror_s─►] step 0 ─step_s─► step 1 … last step ─step_s─► complete
    running ─a gate fails─► rolled_back   (all new traffic back on the primary, at once)
    running ─abort─► aborted;   step ◄─pause/resume─► paused;   running ─promote─► complete

A request's arm comes from a *bucket*: a hash of its sticky key (session id,
API key or a header) onto [0, 1). A step with share s sends the buckets below
s to the candidate, so a client on the candidate at 5 % stays on it at 20 %.
Priorities outside `rollout.priorities` (critical, by default) join only at
the last step. A step advances after `step_s` only when the gates say it may
(`GateReport.ready`), inside `advance_window` if one is set; a rollback never
waits for anything.

Decisions only: the clock comes in, events go out through `on_event`
(timeline, metrics, logs, the rollback bundle are the runtime's business).
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo

from proxy.policy.rollout import RolloutPolicy

RolloutState = Literal["idle", "mirror", "step", "paused", "complete", "rolled_back", "aborted"]
STATES: tuple[RolloutState, ...] = (
    "idle",
    "mirror",
    "step",
    "paused",
    "complete",
    "rolled_back",
    "aborted",
)
STATE_VALUES: dict[str, int] = {s: i for i, s in enumerate(STATES)}
Arm = Literal["primary", "candidate"]
Action = Literal["start", "pause", "resume", "abort", "promote"]
ACTIONS: tuple[Action, ...] = ("start", "pause", "resume", "abort", "promote")
RUNNING = frozenset({"mirror", "step", "paused"})
# What `Rollout`'s per-request attributes (`routing`, `cut_joined`, ...) follow.
_ROUTING_INPUTS = frozenset({"policy", "state", "step"})


def bucket(key: str) -> float:
    """A sticky key's place in [0, 1): stable across steps, processes and restarts."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def below(cut: float) -> bytes:
    """The digests whose bucket is below `cut`, as a bound: for any 8-byte
    big-endian digest `d` (`bucket`'s), `d < below(cut)` exactly when
    `int.from_bytes(d, "big") / 2.0**64 < cut` — the int's rounding to a float
    included (a few digests next to the cut round onto it). Made when the cut
    changes, so a request compares bytes: no int, no float, no division."""
    c = cut * 2.0**64  # exact: a power of two
    # The digests below the cut are a prefix [0, t) (float(n) rises with n):
    # t is the first n whose float reaches c.
    lo, hi = 0, 1 << 64
    while lo < hi:
        mid = (lo + hi) // 2
        if float(mid) >= c:
            hi = mid
        else:
            lo = mid + 1
    # t = 2**64: every digest (9 bytes of 0xff are above any 8 bytes).
    return lo.to_bytes(8, "big") if lo < 1 << 64 else b"\xff" * 9


def random_bucket() -> float:
    """`sticky: none` (or no key): a fresh bucket per request, uniform on [0, 1)
    (`random.random`: no system call per request, and a bucket needs no secrecy)."""
    return random.random()


def in_window(window: str | None, tz: str, epoch_s: float) -> bool:
    """Whether wall time `epoch_s` is inside the daily "HH:MM-HH:MM" window
    (one that wraps midnight, "22:00-06:00", included); no window = always."""
    if not window:
        return True
    start, _, end = window.partition("-")
    local = datetime.fromtimestamp(epoch_s, ZoneInfo(tz))
    now = local.hour * 60 + local.minute
    a = int(start[:2]) * 60 + int(start[3:5])
    b = int(end[:2]) * 60 + int(end[3:5])
    return a <= now < b if a <= b else (now >= a or now < b)


@dataclass(frozen=True, slots=True)
class RolloutEvent:
    """One change of the rollout (the timeline's records)."""

    # started | mirror_done | step | paused | resumed | complete | promoted | rolled_back | aborted
    kind: str
    at: float  # clock time
    state: RolloutState
    step: int
    share: float
    detail: str = ""
    gate: str = ""  # rolled_back: the gate that failed


@dataclass
class Rollout:
    policy: RolloutPolicy
    clock: Callable[[], float]
    on_event: Callable[[RolloutEvent], None] | None = None
    wall: Callable[[], float] | None = None  # epoch seconds, for advance_window
    rollout_id: str = ""
    state: RolloutState = "idle"
    step: int = 0
    step_started_at: float = 0.0
    started_at: float | None = None
    reason: str = ""  # why it ended (rolled_back, aborted) or paused
    failed_gate: str = ""
    history: list[RolloutEvent] = field(default_factory=list)

    # -- routing (per request: no allocation, no I/O) ------------------------------
    #
    # What a request reads is decided when the state, the step or the policy
    # changes (`__setattr__`, `_derive`), not per request: `routing`,
    # `mirroring` and `running` are plain attributes (a property is a Python
    # call on every read), and the cut of each kind of priority is a float.

    routing: bool = field(init=False, repr=False, compare=False)
    """Whether requests may go to the candidate (a paused step holds its share)."""
    mirroring: bool = field(init=False, repr=False, compare=False)
    running: bool = field(init=False, repr=False, compare=False)
    """`state in RUNNING`: the gates take samples."""
    cut_joined: float = field(init=False, repr=False, compare=False)
    """`cut()` of a priority in `policy.priorities`."""
    cut_other: float = field(init=False, repr=False, compare=False)
    """`cut()` of the others (critical): 0.0 before the last step."""
    below_joined: bytes = field(init=False, repr=False, compare=False)
    """`below(cut_joined)`: a sticky key's digest under it goes to the candidate."""
    below_other: bytes = field(init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _ROUTING_INPUTS:
            self._derive()

    def _derive(self) -> None:
        d = self.__dict__
        if "policy" not in d or "state" not in d or "step" not in d:
            return  # mid-__init__: the last of the three derives
        st, p = self.state, self.policy
        d["routing"] = st in ("step", "paused", "complete")
        d["mirroring"] = st == "mirror" and p.mirror > 0
        d["running"] = st in RUNNING
        if st == "step" or st == "paused":
            share = p.steps[self.step] if 0 <= self.step < len(p.steps) else 0.0
            d["cut_joined"] = share
            d["cut_other"] = share if self.step >= len(p.steps) - 1 else 0.0
        elif st == "complete":
            d["cut_joined"] = d["cut_other"] = 1.0
        else:
            d["cut_joined"] = d["cut_other"] = 0.0
        d["below_joined"] = below(d["cut_joined"])
        d["below_other"] = below(d["cut_other"])

    @property
    def share(self) -> float:
        """Share of eligible traffic on the candidate now."""
        st = self.state
        if st == "step" or st == "paused":
            return self.policy.steps[self.step]
        if st == "complete":
            return 1.0
        return 0.0

    def cut(self, priority: str) -> float:
        """The bucket below which a request of `priority` goes to the candidate
        now; 0.0: none does (not routing, or a priority that joins only at the
        last step). Known before the bucket: a request that cannot go is not hashed."""
        return self.cut_joined if priority in self.policy.priorities else self.cut_other

    def arm(self, b: float, priority: str) -> Arm:
        """The arm of a request with bucket `b` and `priority`."""
        cut = self.cut(priority)
        return "candidate" if cut > 0.0 and b < cut else "primary"

    # -- operator actions --------------------------------------------------------

    def act(self, action: Action, now: float) -> str:
        """Apply an admin action; "" when done, else why not (a 409's message)."""
        st = self.state
        if action == "start":
            if st in RUNNING:
                return f"a rollout is already running ({st})"
            self.rollout_id = _new_id(self.wall() if self.wall else now)
            self.started_at = now
            self.failed_gate = self.reason = ""
            self.step = 0
            first: RolloutState = "mirror" if self.policy.mirror > 0 else "step"
            self._go(first, now, "started", "")
            return ""
        if action == "pause":
            if st != "step":
                return f"only a running step can be paused (state {st})"
            self._go("paused", now, "paused", "by the operator")
            return ""
        if action == "resume":
            if st != "paused":
                return f"not paused (state {st})"
            self._go("step", now, "resumed", "")
            return ""
        if action == "abort":
            if st not in RUNNING and st != "complete":
                return f"no rollout to abort (state {st})"
            self._go("aborted", now, "aborted", "by the operator")
            return ""
        if action == "promote":
            if st not in RUNNING:
                return f"no rollout to promote (state {st})"
            self.step = len(self.policy.steps) - 1
            self._go("complete", now, "promoted", "by the operator")
            return ""
        return f"unknown action {action!r}"  # type: ignore[unreachable]

    # -- time and gates ------------------------------------------------------------

    def tick(self, now: float, ready: bool) -> RolloutEvent | None:
        """Advance when the current step has been held long enough and the gates
        allow it (`ready`), inside the advance window."""
        st = self.state
        if st == "mirror":
            if now - self.step_started_at >= self.policy.mirror_s and ready and self._window():
                return self._go("step", now, "mirror_done", "")
            return None
        if st != "step":
            return None
        if now - self.step_started_at < self.policy.step_s or not ready or not self._window():
            return None
        if self.step + 1 < len(self.policy.steps):
            self.step += 1
            return self._go("step", now, "step", "")
        return self._go("complete", now, "complete", "every step held with passing gates")

    def rollback(self, now: float, gate: str, detail: str) -> RolloutEvent | None:
        """A gate failed (or the candidate is unhealthy): everything back on the
        primary at once. None when nothing was running."""
        if self.state not in RUNNING:
            return None
        self.failed_gate = gate
        return self._go("rolled_back", now, "rolled_back", detail, gate)

    def _window(self) -> bool:
        p = self.policy
        if not p.advance_window or self.wall is None:
            return True
        return in_window(p.advance_window, p.timezone, self.wall())

    def _go(
        self, state: RolloutState, now: float, kind: str, detail: str, gate: str = ""
    ) -> RolloutEvent:
        if state != self.state or kind in ("step", "started"):
            self.step_started_at = now
        self.state = state
        if state in ("rolled_back", "aborted", "paused"):
            self.reason = detail
        ev = RolloutEvent(kind, now, state, self.step, self.share, detail, gate)
        self.history.append(ev)
        del self.history[:-200]
        if self.on_event is not None:
            self.on_event(ev)
        return ev

    # -- persistence and status -----------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """What survives a restart (written by the runtime, read by `restore`)."""
        return {
            "rollout_id": self.rollout_id,
            "state": self.state,
            "step": self.step,
            "held_s": max(0.0, self.clock() - self.step_started_at),
            "reason": self.reason,
            "failed_gate": self.failed_gate,
        }

    def restore(self, saved: dict[str, Any], now: float) -> None:
        """Continue a saved rollout: same id, state and step; the time already
        spent on the step counts."""
        state = saved.get("state")
        step = saved.get("step")
        if state not in STATES or not isinstance(step, int):
            return
        if not 0 <= step < len(self.policy.steps):
            return
        self.rollout_id = str(saved.get("rollout_id") or "")
        self.state = state
        self.step = step
        held = saved.get("held_s")
        self.step_started_at = now - (float(held) if isinstance(held, int | float) else 0.0)
        self.reason = str(saved.get("reason") or "")
        self.failed_gate = str(saved.get("failed_gate") or "")

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "id": self.rollout_id or None,
            "state": self.state,
            "step": self.step if self.state in ("step", "paused", "complete") else None,
            "steps": list(self.policy.steps),
            "share": self.share,
            "step_held_s": round(now - self.step_started_at, 1) if self.state in RUNNING else None,
            "step_s": self.policy.step_s,
            "reason": self.reason or None,
            "failed_gate": self.failed_gate or None,
            "sticky": self.policy.sticky,
            "priorities": list(self.policy.priorities),
        }


def _new_id(epoch_s: float) -> str:
    stamp = datetime.fromtimestamp(epoch_s, ZoneInfo("UTC")).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{os.urandom(3).hex()}"
