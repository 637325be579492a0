"""Token-aware trimming of a chat prompt to the backend's context window.

Public API::

    budget_tokens(max_model_len, max_tokens, *, margin_tokens, default_max_tokens) -> int
    await trim(messages, budget, counter, *, high_water, low_water) -> TrimResult

The counter is any `proxy.sessions.counters.TokenCounter`.

Exceptions::

    ContextTooLong    system prompt + current question alone exceed the budget
                      (→ 400 context_length_exceeded)
    TokenCountError   a counter failed (`proxy.sessions.counters`)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.policy import TrimPolicy
from proxy.sessions.counters import Message, TokenCounter

__all__ = [
    "ContextTooLong",
    "Message",
    "TrimPolicy",
    "TrimResult",
    "budget_tokens",
    "trim",
]

# Roles kept at the front of the prompt whatever the budget.
_HEAD_ROLES = frozenset({"system", "developer"})


# --------------------------------------------------------------------------- errors


class ContextTooLong(Exception):
    """The parts that are never dropped (system prompt + current question) exceed the budget."""

    def __init__(
        self,
        prompt_tokens: int,
        budget_tokens: int,
        messages: Sequence[Message] = (),
        *,
        estimated: bool = False,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.budget_tokens = budget_tokens
        # The count is an estimate (which errs on the large side), not the backend's.
        self.estimated = estimated
        # What is left after dropping every turn (system prompt + question).
        self.messages = list(messages)
        super().__init__(
            f"the prompt needs {prompt_tokens} tokens without any history, "
            f"but only {budget_tokens} fit in the context window"
        )


# --------------------------------------------------------------------------- budget


def budget_tokens(
    max_model_len: int,
    max_tokens: int | None,
    *,
    margin_tokens: int,
    default_max_tokens: int,
) -> int:
    """Prompt tokens allowed: max_model_len − requested max_tokens − margin (may be ≤ 0)."""
    answer = default_max_tokens if max_tokens is None else max_tokens
    return max_model_len - answer - margin_tokens


# --------------------------------------------------------------------------- trimming


@dataclass(frozen=True, slots=True)
class TrimResult:
    messages: list[Message]  # what to send: the same message objects, oldest turns removed
    prompt_tokens: int  # the counter's count of `messages` (with the generation prompt)
    budget_tokens: int
    dropped_turns: int
    dropped_messages: int
    estimated: bool  # counts came from EstimateTokenCounter-like counters

    @property
    def trimmed(self) -> bool:
        return self.dropped_messages > 0


def _split(messages: Sequence[Message]) -> tuple[int, int, list[tuple[int, int]]]:
    """(end of the head, start of the tail, [start, end) of each droppable turn).

    Head = leading system/developer messages. Tail = the last user message and
    whatever follows it (e.g. a partial assistant answer being continued).
    Between them, a turn starts at each user message; anything before the
    first one forms its own group, dropped first.
    """
    n = len(messages)
    head = 0
    while head < n and messages[head].get("role") in _HEAD_ROLES:
        head += 1
    tail = n
    for i in range(n - 1, head - 1, -1):
        if messages[i].get("role") == "user":
            tail = i
            break
    else:
        tail = head  # no user message after the head: nothing is droppable
    starts = [i for i in range(head, tail) if messages[i].get("role") == "user"]
    if not starts or starts[0] != head:
        starts.insert(0, head)
    groups = [(s, e) for s, e in zip(starts, [*starts[1:], tail], strict=True) if s < e]
    return head, tail, groups


# Exact recounts of the kept prompt after the first, at most (each is a
# tokenizer call or a /tokenize round trip).
_MAX_RECOUNTS = 3


def _replay_cut(
    fixed: int,
    turn_tokens: Sequence[int],
    question_tokens: Sequence[int],
    current: int,
    high: float,
    low: float,
) -> int:
    """Number of oldest turns to drop, by replaying block trimming over the session.

    Request i of the session sent turns[0:i] plus its question (the user
    message of turn i); the current request sends all turns plus `current`.
    Replaying the high/low-water rule over those requests finds the cut the
    previous requests used, so the cut only moves when a new block is dropped.
    """
    cut = 0
    kept = 0  # tokens of turns[cut:i]
    steps = [*question_tokens, current]
    for i, question in enumerate(steps):
        size = fixed + kept + question
        if size > high:
            while cut < i and size > low:
                size -= turn_tokens[cut]
                kept -= turn_tokens[cut]
                cut += 1
        if i < len(turn_tokens):
            kept += turn_tokens[i]
    return cut


async def trim(
    messages: Sequence[Message],
    budget_tokens: int,
    counter: TokenCounter,
    *,
    high_water: float,
    low_water: float,
) -> TrimResult:
    """Fit `messages` into `budget_tokens`, dropping the oldest turns first.

    The system prompt(s) at the front and the current question (the last user
    message, plus anything after it) are always kept; whole turns (a user
    message and the answers that follow it) are dropped from the oldest.

    Block trimming, for vLLM's prefix cache: a sliding window that drops just
    enough every request changes the start of the prompt on every request of
    a long session, so the engine re-computes the whole prompt each time.
    Instead nothing is dropped while the prompt fits in `high_water × budget`;
    when it no longer does, the oldest turns are dropped in one block until it
    fits in `low_water × budget`. The following requests then extend the same
    prefix (cache hits) until the prompt grows past the high-water mark again.
    No state is kept between requests: the cut is found by replaying the rule
    over the earlier requests of the session, which are the prefixes of this
    one's history, so each request finds the same cut its predecessor used.

    Counter calls: `count_messages` once and `count_prompt` once (twice when
    turns are dropped: the kept prompt is counted exactly), plus a recount
    only when the per-message sums under-estimated the kept prompt (chat
    templates that add text once per prompt, e.g. a default system prompt) —
    at most three; the third keeps only the head and the question.
    The result always fits in `budget_tokens` by the counter's count.

    Raises ContextTooLong when the kept parts alone exceed the budget, and
    TokenCountError when the counter fails.
    """
    if not 0.0 < low_water < high_water <= 1.0:
        raise ValueError("need 0 < low_water < high_water <= 1")
    msgs = list(messages)
    head, tail, groups = _split(msgs)
    per = await counter.count_messages(msgs)
    total = await counter.count_prompt(msgs)
    # Template text not attributed to any message (mostly the generation prompt).
    overhead = total - sum(per)

    fixed = overhead + sum(per[:head])
    turn_tokens = [sum(per[s:e]) for s, e in groups]
    # The question of an earlier request = the first message of its turn.
    question_tokens = [per[s] for s, _ in groups]
    current = sum(per[tail:])
    cut = _replay_cut(
        fixed,
        turn_tokens,
        question_tokens,
        current,
        high_water * budget_tokens,
        low_water * budget_tokens,
    )

    def assemble(n_dropped: int) -> list[Message]:
        keep_from = groups[n_dropped][0] if n_dropped < len(groups) else tail
        return msgs[:head] + msgs[keep_from:]

    kept = msgs if cut == 0 else assemble(cut)
    tokens = total if cut == 0 else await counter.count_prompt(kept)
    # The per-message estimate can be short of the real count: drop enough
    # further turns to cover the excess and count again (rare; see docstring).
    recounts = 0
    while tokens > budget_tokens:
        if cut >= len(groups):
            raise ContextTooLong(tokens, budget_tokens, kept, estimated=counter.is_estimate)
        freed = 0
        while cut < len(groups) and freed < tokens - budget_tokens:
            freed += turn_tokens[cut]
            cut += 1
        recounts += 1
        if recounts >= _MAX_RECOUNTS:
            cut = len(groups)  # the estimates are far off: keep only what must stay
        kept = assemble(cut)
        tokens = await counter.count_prompt(kept)
    return TrimResult(
        messages=kept,
        prompt_tokens=tokens,
        budget_tokens=budget_tokens,
        dropped_turns=cut,
        dropped_messages=len(msgs) - len(kept),
        estimated=counter.is_estimate,
    )
