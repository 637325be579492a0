"""Ask one backend the eval set's questions and score its answers.

Each question is one non-streaming chat completion sent straight to that
backend's session (never through the proxy's client path: no admission,
breaker, session history or guard, and nothing a user sees), marked
`X-Priority: sheddable`. The scoring is `proxy.control.evalchecks`'s; this
module only does the I/O and never raises for what the backend does: a
question that fails (HTTP error, timeout, refused connection, an answer
without `choices[0].message.content`) counts all its checks as failed and is
listed in `failures` with the reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.backends.upstream import Upstream
from proxy.control.evalchecks import check_answer, score
from proxy.policy.evalset import EvalQuestion, EvalSet

__all__ = ["MAX_ANSWER_BYTES", "EvalResult", "run_eval"]

# A non-streaming answer larger than this is a failure, not read on.
MAX_ANSWER_BYTES = 8 * 2**20
_REASON_CHARS = 200


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One arm's run of the eval set. `failures`: (question id, reason) for
    every question that did not pass all its checks, in the file's order."""

    arm: str
    passed: int
    total: int
    at: float  # wall-clock time the run ended
    failures: tuple[tuple[str, str], ...] = ()
    errors: int = 0  # questions that got no answer (their checks count as failed)

    @property
    def score(self) -> float:
        """Share of checks passed (0 when there were none)."""
        return self.passed / self.total if self.total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "passed": self.passed,
            "total": self.total,
            "score": self.score,
            "at": self.at,
            "errors": self.errors,
            "failures": [{"id": qid, "reason": why} for qid, why in self.failures],
        }


class _NoAnswer(Exception):
    """The backend gave no answer to score; the message says why."""


async def run_eval(
    evalset: EvalSet,
    up: Upstream,
    *,
    timeout_s: float,
    concurrency: int = 2,
    clock: Callable[[], float] = time.time,
) -> EvalResult:
    """Ask `up` every question (`concurrency` at a time, each within
    `timeout_s`) and score the answers. Cancelling it cancels the questions
    in flight; nothing else raises."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(q: EvalQuestion) -> tuple[int, str | None, bool]:
        async with gate:
            try:
                text = await _ask(q, up, timeout_s)
            except _NoAnswer as exc:
                return 0, _cut(str(exc)), True
            except TimeoutError:
                return 0, f"timeout after {timeout_s:g} s", True
            except aiohttp.ClientError as exc:
                return 0, _cut(f"{type(exc).__name__}: {exc}"), True
            except Exception as exc:  # any other failure of the call is this question's
                return 0, _cut(f"{type(exc).__name__}: {exc}"), True
        passed, total = score(q, text)
        if passed == total:
            return passed, None, False
        failed = [c.kind for c in q.checks if not check_answer(c, text)]
        return passed, f"{passed}/{total} checks passed; failed: {', '.join(failed)}", False

    results = await asyncio.gather(*(one(q) for q in evalset.questions))
    failures = tuple(
        (q.id, why) for q, (_, why, _) in zip(evalset.questions, results, strict=True) if why
    )
    return EvalResult(
        arm=up.name,
        passed=sum(r[0] for r in results),
        total=evalset.total_checks,
        at=clock(),
        failures=failures,
        errors=sum(1 for r in results if r[2]),
    )


def request_body(q: EvalQuestion, up: Upstream) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": q.wire_messages(),
        "max_tokens": q.max_tokens,
        "temperature": q.temperature,
        "stream": False,
    }
    model = up.policy.model or up.served_model
    if model:
        body["model"] = model
    return body


async def _ask(q: EvalQuestion, up: Upstream, timeout_s: float) -> str:
    headers = {"X-Priority": "sheddable", "Accept-Encoding": "identity"}
    if up.auth_header:
        headers["Authorization"] = up.auth_header
    async with asyncio.timeout(timeout_s):
        async with up.session.post(
            up.chat_url,
            json=request_body(q, up),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        ) as resp:
            raw = bytearray()
            async for piece in resp.content.iter_chunked(65536):
                raw += piece
                if len(raw) > MAX_ANSWER_BYTES:
                    raise _NoAnswer(f"answer larger than {MAX_ANSWER_BYTES // 2**20} MiB")
            status = resp.status
    return _content(status, bytes(raw))


def _content(status: int, raw: bytes) -> str:
    """`choices[0].message.content` of a chat completion, else `_NoAnswer`."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if status != 200 or error is not None:
        message = error.get("message") if isinstance(error, dict) else None
        detail = f": {message}" if isinstance(message, str) and message else ""
        raise _NoAnswer(f"HTTP {status}{detail}")
    try:
        content = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise _NoAnswer("no choices[0].message.content in the answer") from None
    if not isinstance(content, str):
        raise _NoAnswer("choices[0].message.content is not text")
    return content


def _cut(text: str) -> str:
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."
