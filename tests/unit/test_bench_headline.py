"""`bench/run.py`'s README headline: issue 24's targets judged from one full
run's figures, written between the README's markers and nowhere else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import run  # noqa: E402


def sample(rps: float, p50_ms: float = 1.0) -> run.Sample:
    return run.Sample(rps, p50_ms, p50_ms * 2, None, 0)


def results(
    bo_short: float, bo_long: float, sess: float
) -> dict[str, dict[str, dict[int, run.Sample]]]:
    def kind(bo: float, bo_ms: float) -> dict[str, dict[int, run.Sample]]:
        return {
            "direct": {1: sample(10_000, 0.10)},
            "bare aiohttp": {1: sample(2_000, 0.30), 64: sample(6_000)},
            "brownout": {1: sample(1_500, bo_ms), 64: sample(bo)},
            "brownout+redis sessions": {1: sample(900, 0.9), 64: sample(sess)},
            "litellm": {1: sample(40, 20.0), 64: sample(30)},
        }

    return {"short": kind(bo_short, 0.35), "long": kind(bo_long, 0.45)}


def test_the_targets_are_judged_from_the_run() -> None:
    rows = run.headline_rows(
        results(3_600, 3_000, 2_600), {"memory per open stream (brownout)": "36.4 KiB"}
    )
    got = {t: (m, ok) for t, m, ok in rows}
    assert got["≥ 60 % of the bare relay's best req/s, 16-chunk streams"] == ("60%", True)
    assert got["≥ 55 % of the bare relay's best req/s, 1,024-chunk streams"] == ("50%", False)
    # added latency: (0.35 - 0.10) / (0.30 - 0.10) = 1.25; (0.45 - 0.10) / 0.20 = 1.75
    assert got["added latency at c=1 ≤ 1.5 × the bare relay's (wrk), 16-chunk"][1] is True
    assert got["added latency at c=1 ≤ 1.5 × the bare relay's (wrk), 1,024-chunk"][1] is False
    assert got["≥ 45 % of the bare relay with Redis sessions on (16-chunk)"] == ("43%", False)
    assert got["memory per open stream ≤ 64 KB"] == ("36.4 KiB", True)
    assert got["≥ 50 × LiteLLM's requests/s (16-chunk)"] == ("90 ×", True)


def test_the_headline_replaces_only_what_is_between_its_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start, end = run.HEADLINE
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n\n{start}\nold table\n{end}\n\nafter\n")
    monkeypatch.setattr(run, "README", readme)
    run.write_headline(results(3_600, 3_000, 2_600), {})
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n\n" + start + "\nFrom the last full `make bench`")
    assert text.endswith(f"{end}\n\nafter\n")
    assert "old table" not in text
    assert (
        "| ≥ 55 % of the bare relay's best req/s, 1,024-chunk streams | 50% | **not met** |" in text
    )


def test_the_readme_has_the_markers() -> None:
    text = (ROOT / "README.md").read_text()
    start, end = run.HEADLINE
    assert text.count(start) == 1 and text.count(end) == 1
    assert text.index(start) < text.index(end)
