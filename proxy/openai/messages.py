"""What a request asks: the text of its last user message.

One definition for what a session turn stores and what the FAQ is matched
against. The semantics, chosen to match what the model is shown (vLLM renders
a list of content parts by joining its text parts with newlines):

- the *last* user message is the question; an older one is never used instead
  (that would store or answer a question that was not asked);
- its `content` is a string, or a list of parts of which only text parts
  (`{"type": "text", "text": str}`, or a part without `type` whose `text` is
  a string) count, joined with `\\n`;
- no user message, or one without any text: None.
"""

from __future__ import annotations

from typing import Any


def content_text(content: object) -> str | None:
    """The text of one message's `content` (a string or a list of parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [
        p["text"]
        for p in content
        if isinstance(p, dict)
        and p.get("type", "text") == "text"
        and isinstance(p.get("text"), str)
    ]
    return "\n".join(texts) if texts else None


def last_user_text(body: dict[str, Any]) -> str | None:
    """The text of a chat request's last user message (see the module doc)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return content_text(m.get("content"))
    return None


def question_text(body: dict[str, Any]) -> str:
    """What to match a canned answer against: the last user text of a chat
    request, the prompt of a completion (a string prompt only: a batch of
    prompts has no one question); "" when there is none."""
    if "messages" in body:
        return last_user_text(body) or ""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""
