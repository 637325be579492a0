"""`brownout replay --html` in a real headless Chromium (issue 22): the page
is self-contained and its tier timelines are drawn — seen by the browser's
layout and computed style, not just present in the markup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.cli import main
from tests.statuspage.cdp import chromium, find_chromium

BACKENDS = """backends:
  primary: {url: http://primary.invalid, kind: vllm}
  fallback: {url: http://fallback.invalid, kind: transformers}
"""

# The element's box and computed style, and how many of its tier bands are
# drawn (each with a width): what a person looking at the page would see.
SEEN = """(sel => {
  const el = document.querySelector(sel);
  if (!el) return null;
  const box = el.getBoundingClientRect();
  let visible = true;
  for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
    const s = getComputedStyle(e);
    if (s.display === 'none' || s.visibility !== 'visible' || Number(s.opacity) === 0)
      visible = false;
  }
  const bands = [...el.querySelectorAll('rect')].filter(r => r.getBoundingClientRect().width > 0);
  const tiers = [...new Set(bands.map(r => r.dataset.tier))].sort();
  return {visible, width: box.width, height: box.height, bands: bands.length, tiers,
          onscreen: box.top < innerHeight * 3 && box.left < innerWidth};
})"""


async def test_the_html_report_shows_both_timelines_in_a_browser(tmp_path: Path) -> None:
    exe = find_chromium()
    if exe is None:
        pytest.fail("chromium is not installed (apt-get install -y chromium)")
    cand = tmp_path / "no-rescue.yaml"
    cand.write_text(BACKENDS + "ladder:\n  failover: {rescue_streams: false}\n")
    page_path = tmp_path / "report.html"
    rc = main(
        ["replay", "--scenario", "fallback-down", "--policy", str(cand), "--html", str(page_path)]
    )
    assert rc == 0
    async with chromium(exe, tmp_path / "profile") as page:
        await page.navigate(page_path.as_uri())
        for name in ("baseline", "candidate"):
            seen = await page.evaluate(f"{SEEN}({json.dumps(f'#timeline-{name}')})")
            assert seen is not None, f"#timeline-{name} is missing"
            assert seen["visible"] and seen["width"] > 300 and seen["height"] > 10, seen
            # The scenario's incident: failover, then maintenance while both are down.
            assert {"normal", "failover", "maintenance"} <= set(seen["tiers"]), seen
        for plot in ("#plot-load", "#plot-latency"):
            seen = await page.evaluate(f"{SEEN}({json.dumps(plot)})")
            assert seen is not None and seen["visible"] and seen["width"] > 300, (plot, seen)
            lines = await page.evaluate(
                f"document.querySelectorAll({json.dumps(plot + ' polyline')}).length"
            )
            assert lines >= 2, plot
        # Self-contained: nothing was fetched but the page itself.
        resources = await page.evaluate("performance.getEntriesByType('resource').map(e => e.name)")
        assert resources == []
        title = await page.evaluate("document.title")
        assert "brownout replay" in title
