"""Issue 21: the gray release's per-request routing (proxy.control.rollout's
`cut`/`arm`, proxy.runtime.canary's sticky key), decisions only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.control.rollout import STATES, Rollout, below, bucket
from proxy.policy import parse_policy
from proxy.policy.rollout import RolloutPolicy
from proxy.runtime.canary import Canary
from proxy.telemetry.metrics import Metrics

STEPS = (0.05, 0.2, 0.5, 1.0)


def reference_arm(state: str, step: int, b: float, priority: str, pol: RolloutPolicy) -> str:
    """The rule as the issue states it: the buckets below the step's share go
    to the candidate, in the step (a paused one too) and at 100 % once
    complete; priorities outside `priorities` join at the last step only."""
    if state not in ("step", "paused", "complete"):
        return "primary"
    last = step >= len(pol.steps) - 1
    if state != "complete" and priority not in pol.priorities and not last:
        return "primary"
    share = 1.0 if state == "complete" else pol.steps[step]
    return "candidate" if b < share else "primary"


@given(
    state=st.sampled_from(STATES),
    step=st.integers(0, len(STEPS) - 1),
    b=st.floats(0.0, 1.0, exclude_max=True),
    priority=st.sampled_from(["critical", "normal", "sheddable"]),
)
def test_the_arm_follows_the_rule_in_every_state_step_and_priority(
    state: Any, step: int, b: float, priority: str
) -> None:
    pol = RolloutPolicy(steps=STEPS)
    ro = Rollout(pol, clock=lambda: 0.0, state=state, step=step)
    assert ro.arm(b, priority) == reference_arm(state, step, b, priority, pol)
    # The cut is the share the request can get: 0 when it cannot go at all.
    cut = ro.cut(priority)
    assert (cut > 0.0) == any(ro.arm(x, priority) == "candidate" for x in (0.0, 0.01, 0.04))


def test_a_share_boundary_bucket_stays_on_the_primary() -> None:
    ro = Rollout(RolloutPolicy(steps=STEPS), clock=lambda: 0.0, state="step", step=1)
    assert ro.arm(0.2, "normal") == "primary"
    assert ro.arm(0.19999, "normal") == "candidate"
    assert ro.arm(0.1, "critical") == "primary"  # critical joins at the last step
    ro.step = 3
    assert ro.arm(0.1, "critical") == "candidate"


def canary(sticky: str, tmp: str) -> Canary:
    doc = {
        "backends": {
            "primary": {"url": "http://127.0.0.1:1"},
            "candidate": {"url": "http://127.0.0.1:2"},
        },
        "rollout": {"steps": [0.5, 1.0], "sticky": sticky, "snapshot_dir": tmp},
    }
    pol = parse_policy(yaml.safe_dump(doc), "routing.yaml")
    return Canary(pol, time.monotonic, Metrics(), lambda coro, name: coro.close())


def rec(headers: dict[str, str], priority: str = "normal") -> Any:
    proxy = CIMultiDictProxy(CIMultiDict(headers))
    return SimpleNamespace(request=SimpleNamespace(headers=proxy), priority=priority)


@pytest.mark.parametrize(
    ("sticky", "headers", "key"),
    [
        ("session", {"X-Session-Id": "s-1", "X-Team": "t"}, "s-1"),
        ("session", {"x-session-id": "s-2"}, "s-2"),
        ("header:X-Team", {"X-Session-Id": "s-1", "x-team": "blue"}, "blue"),
        ("api_key", {"Authorization": "Bearer sk-abc"}, "sk-abc"),
    ],
)
def test_the_sticky_key_is_the_policys_header(
    sticky: str, headers: dict[str, str], key: str, tmp_path: Any
) -> None:
    c = canary(sticky, str(tmp_path))
    assert c.bucket_of(rec(headers)) == bucket(key)
    c.act("start")
    # The same client, the same arm, request after request.
    arms = {c.wants_candidate(rec(headers)) for _ in range(20)}
    assert arms == {bucket(key) < 0.5}


@pytest.mark.parametrize(
    ("sticky", "headers"),
    [
        ("none", {"X-Session-Id": "s-1", "Authorization": "Bearer sk-abc"}),
        ("session", {"X-Team": "blue"}),  # no session id: a bucket of its own
        ("api_key", {}),
    ],
)
def test_no_key_draws_a_fresh_bucket_per_request(
    sticky: str, headers: dict[str, str], tmp_path: Any
) -> None:
    c = canary(sticky, str(tmp_path))
    buckets = [c.bucket_of(rec(headers)) for _ in range(2000)]
    assert all(0.0 <= b < 1.0 for b in buckets)
    assert len(set(buckets)) == len(buckets)
    c.act("start")
    share = sum(c.wants_candidate(rec(headers)) for _ in range(4000)) / 4000
    assert 0.45 < share < 0.55  # step 0 at 50 %: ±5 points is > 6 standard deviations


def test_an_idle_or_ended_rollout_sends_nothing_to_the_candidate(tmp_path: Any) -> None:
    c = canary("session", str(tmp_path))
    r = rec({"X-Session-Id": next(f"s{i}" for i in range(100) if bucket(f"s{i}") < 0.5)})
    assert not c.wants_candidate(r)
    c.act("start")
    assert c.wants_candidate(r)
    c.act("abort")
    assert not c.wants_candidate(r)


def test_the_inline_arm_choice_is_the_bucket_rule(tmp_path: Any) -> None:
    """`wants_candidate` hashes inline: for every sticky kind and key it agrees
    with `bucket(key) < share` (the documented, cross-process rule), keys with
    lone surrogates, non-ASCII and long ones included."""
    keys = ["a", "user-1", "é", "\udcff-lone", "x" * 300, "0", "s-1"]
    for sticky, header in (("session", "X-Session-Id"), ("header:X-Team", "X-Team")):
        c = canary(sticky, str(tmp_path))
        c.act("start")
        for key in keys:
            assert c.wants_candidate(rec({header: key})) == (bucket(key) < 0.5), key
    c = canary("api_key", str(tmp_path))
    c.act("start")
    for key in keys[:4]:
        got = c.wants_candidate(rec({"Authorization": f"Bearer sk-{key}"}))
        assert got == (bucket(f"sk-{key}") < 0.5), key


def reference_derived(ro: Rollout) -> dict[str, Any]:
    """What `Rollout`'s per-request attributes must say, from its state and
    step (the properties they replaced)."""
    st_, p = ro.state, ro.policy
    last = ro.step >= len(p.steps) - 1
    share = 1.0 if st_ == "complete" else p.steps[ro.step] if st_ in ("step", "paused") else 0.0
    return {
        "routing": st_ in ("step", "paused", "complete"),
        "mirroring": st_ == "mirror" and p.mirror > 0,
        "running": st_ in ("mirror", "step", "paused"),
        "cut_joined": share,
        "cut_other": share if st_ == "complete" or last else 0.0,
    }


def derived(ro: Rollout) -> dict[str, Any]:
    return {
        k: getattr(ro, k) for k in ("routing", "mirroring", "running", "cut_joined", "cut_other")
    }


@given(
    mirror=st.sampled_from([0.0, 0.3]),
    moves=st.lists(
        st.one_of(
            st.sampled_from(["start", "pause", "resume", "abort", "promote"]),
            st.sampled_from(["tick", "rollback", "restore"]),
            st.tuples(st.sampled_from(STATES), st.integers(0, len(STEPS) - 1)),
        ),
        max_size=12,
    ),
)
def test_the_per_request_attributes_follow_every_change(mirror: float, moves: list[Any]) -> None:
    """`routing`, `mirroring`, `running` and the cuts are set when the state,
    the step or the policy changes (not computed per request): whatever moved
    them — an action, a step, a rollback, a restore, a direct assignment —
    they say what the state and step say."""
    t = [0.0]
    ro = Rollout(RolloutPolicy(steps=STEPS, mirror=mirror, step_s=1.0, mirror_s=1.0), lambda: t[0])
    assert derived(ro) == reference_derived(ro)
    for move in moves:
        t[0] += 2.0
        if isinstance(move, tuple):
            ro.state, ro.step = move
        elif move == "tick":
            ro.tick(t[0], True)
        elif move == "rollback":
            ro.rollback(t[0], "error_rate", "x")
        elif move == "restore":
            ro.restore({"state": "paused", "step": 2, "held_s": 1.0}, t[0])
        else:
            ro.act(move, t[0])
        assert derived(ro) == reference_derived(ro), move
        for priority in ("critical", "normal", "sheddable"):
            assert ro.cut(priority) == (
                ro.cut_joined if priority in ro.policy.priorities else ro.cut_other
            )
    ro.policy = RolloutPolicy(steps=(0.5, 1.0), mirror=mirror)
    ro.step = 0
    assert derived(ro) == reference_derived(ro)


# A sticky key's bucket must not move between processes, restarts and
# releases (a client on the candidate stays there): pinned values of the
# documented hash (blake2b, 8 bytes, big-endian, / 2**64).
PINNED = {"user-1": 0.6041924073669338, "s-1": 0.012253782196995883, "é": 0.7933768955844694}


def test_buckets_are_pinned_across_processes_and_hash_seeds() -> None:
    for key, b in PINNED.items():
        assert bucket(key) == b
    code = "from proxy.control.rollout import bucket; print(repr([bucket(k) for k in %r]))"
    for seed in ("0", "1", "random"):
        out = subprocess.run(
            [sys.executable, "-c", code % list(PINNED)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.strip() == repr(list(PINNED.values()))


def _near_bound(cut: float) -> list[int]:
    """Digests next to where `cut`'s bucket boundary falls (where a float's
    rounding decides), and the ends."""
    c = int(cut * 2.0**64)
    return [n for d in range(-4100, 4100, 7) if 0 <= (n := c + d) < 1 << 64] + [0, (1 << 64) - 1]


@given(
    cut=st.one_of(
        st.sampled_from([0.05, 0.2, 0.5, 1.0, 0.0, 1e-300, 2.0**-64, 1 - 2.0**-53]),
        st.floats(0.0, 1.0),
    ),
    ns=st.lists(st.integers(0, (1 << 64) - 1), max_size=20),
)
def test_the_digest_bound_is_the_bucket_rule_exactly(cut: float, ns: list[int]) -> None:
    """`below(cut)` (bytes, made per step) sorts a digest exactly as
    `bucket() < cut` did with the int turned float and divided — next to the
    boundary too, where the float's rounding moves it."""
    bound = below(cut)
    for n in [*ns, *_near_bound(cut)]:
        assert (n.to_bytes(8, "big") < bound) == (n / 2.0**64 < cut), (cut, n)


@pytest.mark.parametrize("state_step", [("step", 0), ("step", 1), ("paused", 1), ("complete", 1)])
def test_the_arm_of_a_key_is_its_bucket_below_the_cut_at_every_step(
    state_step: tuple[str, int], tmp_path: Any
) -> None:
    c = canary("session", str(tmp_path))
    ro = c.rollout
    ro.state, ro.step = state_step  # type: ignore[assignment]
    for i in range(300):
        for priority in ("normal", "critical"):
            key = f"user-{i}"
            want = bucket(key) < ro.cut(priority)
            assert c.wants_candidate(rec({"X-Session-Id": key}, priority)) == want
