"""Static limits on a JSON schema before it reaches the grammar compiler (pure).

xgrammar's compile time grows fast with some shapes of schema (measured on
this project's 2-core CI box, tiny model): nesting (a 200-level object
schema 0.5-3.3 s, ~n³), enums (20,000 strings 1.6 s, 100,000 over 120 s,
~n²·⁶) and bounded repetition in a `pattern` (`[a-z]{10000}` 4 s, ~n²).
A compile cannot be interrupted, so what can be refused cheaply is refused
here, with a 400 naming the field, before any compile starts:

- the schema's JSON text: at most `MAX_SCHEMA_BYTES` (64 KiB) of UTF-8;
- nesting: at most `MAX_SCHEMA_DEPTH` (64) JSON objects/arrays inside each
  other (about 30 levels of nested object schemas; OpenAI allows 10);
- `enum` values plus `const`s, all counted together: at most
  `MAX_ENUM_VALUES` (1,000, OpenAI's limit);
- a `{n}` / `{n,m}` repetition bound in a `pattern` string: at most
  `MAX_PATTERN_REPEAT` (1,000).

Within those, the worst compiles measured take well under a second; what
still takes longer is bounded by the compile deadline (`grammarlane`).
"""

from __future__ import annotations

import json
import re

from proxy.fallback.api.errors import APIError, invalid

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64
MAX_ENUM_VALUES = 1000
MAX_PATTERN_REPEAT = 1000

_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _too_big(param: str, what: str) -> APIError:
    return invalid(f"The JSON schema in '{param}' is too large for this server: {what}.", param)


def check_schema(text: str, param: str) -> None:
    """400 naming `param` when the schema (JSON text) is over one of the limits."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise _too_big(param, f"{size} bytes, at most {MAX_SCHEMA_BYTES}")
    check_schema_value(json.loads(text), param)


def check_schema_value(schema: object, param: str) -> None:
    """The depth, enum and pattern limits over an already parsed schema."""
    enum_values = 0
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > MAX_SCHEMA_DEPTH:
                raise _too_big(param, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
            enum = value.get("enum")
            if isinstance(enum, list):
                enum_values += len(enum)
            if "const" in value:
                enum_values += 1
            if enum_values > MAX_ENUM_VALUES:
                raise _too_big(param, f"more than {MAX_ENUM_VALUES} enum and const values in all")
            pattern = value.get("pattern")
            if isinstance(pattern, str):
                _check_pattern(pattern, param)
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            if depth > MAX_SCHEMA_DEPTH:
                raise _too_big(param, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
            stack.extend((item, depth + 1) for item in value)


def _check_pattern(pattern: str, param: str) -> None:
    for match in _REPEAT.finditer(pattern):
        # Digits counted first: int() refuses thousands of them (and that was a 500).
        bounds = [g for g in match.groups() if g]
        if any(len(b) > 9 or int(b) > MAX_PATTERN_REPEAT for b in bounds):
            raise _too_big(
                param, f"a pattern repeats something more than {MAX_PATTERN_REPEAT} times"
            )
