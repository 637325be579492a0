"""Tier 3: answer from the FAQ, or with the maintenance notice, as a valid
OpenAI response (a `chat.completion`, a `text_completion`, or a stream of
chunks ending in `finish_reason: "stop"`, usage and `[DONE]`).

Matching is lexical and fast (it runs on the event loop, per request): word
sets built once per policy, scored by how much of the question an entry
covers, with keyword hits weighted up.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from proxy.policy import FaqEntry, FaqPolicy, MaintenancePolicy

_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    {
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "can",
        "do",
        "does",
        "for",
        "from",
        "how",
        "i",
        "if",
        "in",
        "is",
        "it",
        "me",
        "my",
        "of",
        "on",
        "or",
        "our",
        "please",
        "so",
        "that",
        "the",
        "this",
        "to",
        "was",
        "we",
        "what",
        "when",
        "where",
        "which",
        "who",
        "why",
        "will",
        "with",
        "you",
        "your",
    }
)


def words(text: str) -> frozenset[str]:
    return frozenset(w for w in _WORD.findall(text.lower()) if w not in _STOP)


@dataclass(frozen=True, slots=True)
class _Compiled:
    entry: FaqEntry
    words: frozenset[str]
    keywords: frozenset[str]


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    kind: str  # "faq" | "notice"
    score: float = 0.0


class Maintenance:
    """Built once per policy; `answer()` per request."""

    def __init__(self, faq: FaqPolicy, policy: MaintenancePolicy) -> None:
        self.policy = policy
        self.threshold = faq.threshold
        self._entries = tuple(
            _Compiled(
                e,
                words(e.question) | frozenset().union(*(words(k) for k in e.keywords)),
                frozenset().union(*(words(k) for k in e.keywords)),
            )
            for e in faq.entries
        )

    def match(self, question: str) -> tuple[FaqEntry | None, float]:
        q = words(question)
        if not q:
            return None, 0.0
        best: tuple[FaqEntry | None, float] = (None, 0.0)
        for c in self._entries:
            common = q & c.words
            if not common:
                continue
            # Share of the question's words the entry covers, keyword hits
            # counting double (capped at 1).
            score = min(1.0, (len(common) + len(q & c.keywords)) / len(q))
            if score > best[1]:
                best = (c.entry, score)
        return best

    def answer(self, question: str) -> Answer:
        entry, score = self.match(question)
        if entry is not None and score >= self.threshold:
            return Answer(entry.answer, "faq", score)
        return Answer(self.policy.notice, "notice", score)


def _usage(text: str) -> dict[str, int]:
    # No tokenizer here: a word-piece estimate, honest enough for a canned text.
    n = max(1, len(text) // 4)
    return {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}


def render_json(text: str, model: str, endpoint: str) -> bytes:
    created = int(time.time())
    if endpoint == "chat":
        obj: dict[str, Any] = {
            "id": f"chatcmpl-brownout-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": _usage(text),
        }
    else:
        obj = {
            "id": f"cmpl-brownout-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": _usage(text),
        }
    return json.dumps(obj, ensure_ascii=False).encode()


_PIECE = re.compile(r"\S+\s*|\s+")


def render_stream(text: str, model: str, endpoint: str, include_usage: bool) -> bytes:
    """The whole answer as SSE: role chunk, word chunks, finish chunk, usage, [DONE]."""
    created = int(time.time())
    chat = endpoint == "chat"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-brownout-{uuid.uuid4().hex[:24]}"
    obj_type = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {"id": rid, "object": obj_type, "created": created, "model": model}
        obj["choices"] = [choice] if choice is not None else []
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    out = []
    if chat:
        out.append(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}}))
    for piece in _PIECE.findall(text):
        delta = {"content": piece} if chat else None
        out.append(chunk({"index": 0, "delta": delta} if chat else {"index": 0, "text": piece}))
    final = (
        {"index": 0, "delta": {}, "finish_reason": "stop"}
        if chat
        else {"index": 0, "text": "", "finish_reason": "stop"}
    )
    out.append(chunk(final))
    if include_usage:
        out.append(chunk(None, _usage(text)))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)
