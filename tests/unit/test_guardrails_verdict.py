"""`bench/guardrails.py`'s verdict: a feature is over its budget only when
the excess clears the run's noise (a second base process's distance from
base); in between it is inconclusive, not a pass and not a fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def guardrails() -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("guardrails", ROOT / "bench/guardrails.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["guardrails"] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_verdicts() -> None:
    verdict_of = guardrails().verdict_of
    assert verdict_of(0.029, 0.03, 0.02) == "within"
    assert verdict_of(0.03, 0.03, 0.0) == "within"
    assert verdict_of(0.037, 0.03, 0.01).startswith("inconclusive (over by 0.7%, noise 1.0%")
    assert verdict_of(0.041, 0.03, 0.01) == "**over**"
    assert verdict_of(0.031, 0.03, 0.0) == "**over**"  # no noise measured: the budget alone


def test_the_control_is_a_base_process_without_a_budget() -> None:
    g = guardrails()
    keys = [v.key for v in g.VARIANTS]
    assert keys[:2] == ["base", "control"]
    assert g.VARIANTS[1].budget is None
