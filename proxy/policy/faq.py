"""`faq:` — the answers given in maintenance."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policy.knobs import knob, required


@dataclass(frozen=True, slots=True)
class FaqEntry:
    question: str = required("A question this entry answers.")
    answer: str = required("The answer sent in maintenance.")
    keywords: tuple[str, ...] = knob((), "Extra words that point to this entry.")


@dataclass(frozen=True, slots=True)
class FaqFile:
    entries: tuple[FaqEntry, ...] = knob((), "FAQ entries.")


@dataclass(frozen=True, slots=True)
class FaqPolicy:
    file: str | None = knob(
        None, "FAQ YAML (`entries: [{question, answer, keywords}]`), relative to the policy."
    )
    entries: tuple[FaqEntry, ...] = knob((), "Inline FAQ entries (added to the file's).")
    threshold: float = knob(
        0.35,
        "Minimum match score of the user's question for an FAQ answer.",
        ge=0,
        le=1,
        unit="score",
    )
