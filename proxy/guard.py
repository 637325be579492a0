"""The output guard: validators on every streamed event (work in progress)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.knobs import knob


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    enabled: bool = knob(True, "Output guard on streamed answers.")
