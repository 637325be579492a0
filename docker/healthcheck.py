#!/usr/bin/env python3
"""Container healthcheck: exit 0 when URL answers 2xx within the timeout, else 1.

Installed in the Brownout images as /usr/local/bin/brownout-healthcheck,
because python:3.11-slim has no curl or wget. Proxy variables in the
container's environment (HTTP_PROXY, ...) are ignored: the probe must reach
the local server, not an egress proxy.

    brownout-healthcheck http://127.0.0.1:8080/healthz [--timeout 3]
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def probe(url: str, timeout: float) -> str | None:
    """None when healthy, else a one-line reason."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            status: int = response.status
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # URLError, timeouts, resets, bad URL
        return f"{url}: {exc}"
    return None if 200 <= status < 300 else f"{url}: HTTP {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="brownout-healthcheck", description=__doc__)
    parser.add_argument("url")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    reason = probe(args.url, args.timeout)
    if reason is not None:
        print(f"unhealthy: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
