"""Cost of the rollout gates (proxy.control.gates), in-process.

Each arm holds `--samples` latency and TTFT samples (lognormal) in the
window. Rows, each the best of `--repeat` runs:
- evaluate, window unchanged: `evaluate()` again on the same samples;
- tick: `--per-tick` new requests per arm (the window slides: as many old
  ones leave), then one `evaluate()` — the evaluation loop's steady state;
- observe: one `observe()` at the window's size (its pruning included).

    .venv/bin/python bench/gates_bench.py [--samples 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable

from proxy.control.gates import ARMS, Gates
from proxy.policy.rollout import GatesPolicy


def best(fn: Callable[[], int], repeat: int) -> float:
    """Seconds per operation: the best of `repeat` runs of `fn` (which
    returns how many operations it did)."""
    out = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        n = fn()
        out = min(out, (time.perf_counter() - t0) / n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000, help="samples per arm in the window")
    ap.add_argument("--per-tick", type=int, default=20, help="new requests per arm per tick")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(21)
    n = args.samples
    # One request per arm every `dt` s: the window holds `n` of each.
    window = 300.0
    dt = window / n
    g = Gates(GatesPolicy(window_s=window, min_samples=5))
    t = 0.0

    def one_round() -> None:
        nonlocal t
        t += dt
        for arm in ARMS:
            x = (0.4 if arm == "candidate" else 0.5) * math.exp(rng.gauss(0.0, 0.5))
            g.observe(arm, t, latency_s=4 * x, ttft_s=x)

    for _ in range(n):
        one_round()
    held = g.held()
    assert all(held[a]["latency"] >= n - 1 for a in ARMS), held

    def evaluate_same() -> int:
        for _ in range(200):
            g.evaluate(t)
        return 200

    def tick() -> int:
        for _ in range(50):
            for _ in range(args.per_tick):
                one_round()
            g.evaluate(t)
        return 50

    def observe() -> int:
        for _ in range(2000):
            one_round()
        return 2000 * len(ARMS)

    rows = [
        ("evaluate, window unchanged", best(evaluate_same, args.repeat)),
        (f"tick ({args.per_tick} new requests per arm + evaluate)", best(tick, args.repeat)),
        ("observe", best(observe, args.repeat)),
    ]
    print(f"{n} samples per arm (latency and TTFT), window {window:g} s")
    for name, s in rows:
        print(f"  {name:<45} {s * 1e6:9.1f} µs")


if __name__ == "__main__":
    main()
