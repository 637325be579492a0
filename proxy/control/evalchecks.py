"""Does an answer pass an eval check (`proxy.policy.evalset`)? Pure, no I/O.

Any text is an answer: NULs, lone surrogates, a megabyte of it, JSON nested
100,000 deep. A check never raises; what cannot be read as JSON is not JSON.

`json_schema` validates a subset of JSON Schema (the keywords the loader
accepts: type, properties, required, items, enum, const, minimum, maximum,
minLength, maxLength, pattern, additionalProperties). As in JSON Schema,
`true` is no number, `1.0` is an integer, `1` equals `1.0`, lengths count
code points, and `pattern` searches (it is not anchored). Recursion follows
the schema, whose depth the loader bounds, never the answer's.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from proxy.policy.evalset import Check, EvalQuestion

__all__ = ["check_answer", "matches_schema", "parse_json", "score"]

_NOT_JSON = object()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(text: str) -> Any:
    """The JSON value of `text`, or `_NOT_JSON` (NaN and Infinity are not
    JSON; neither is anything nested past the interpreter's recursion limit)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError, MemoryError):
        return _NOT_JSON


def check_answer(check: Check, text: str) -> bool:
    """Whether `text` passes `check`."""
    try:
        return _check(check, text)
    except (RecursionError, MemoryError, re.error, TypeError, ValueError):
        return False


def _check(check: Check, text: str) -> bool:
    kind, value = check.kind, check.value
    if kind == "contains":
        return str(value) in text
    if kind == "icontains":
        return str(value).casefold() in text.casefold()
    if kind == "regex":
        return re.search(str(value), text) is not None
    if kind == "equals":
        return text.strip() == str(value).strip()
    if kind == "json":
        return (parse_json(text) is not _NOT_JSON) is bool(value)
    if kind == "json_schema":
        data = parse_json(text)
        return data is not _NOT_JSON and matches_schema(value, data)
    return False  # a kind this code does not know passes nothing


def score(question: EvalQuestion, text: str) -> tuple[int, int]:
    """(checks passed, checks) of one answer."""
    passed = sum(1 for c in question.checks if check_answer(c, text))
    return passed, len(question.checks)


# -- the JSON Schema subset ---------------------------------------------------


def _is_type(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if name == "number":
        return True
    return isinstance(value, int) or (math.isfinite(value) and value.is_integer())  # integer


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON has it: `true` is not `1`, `1` is `1.0`."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def matches_schema(schema: Any, value: Any) -> bool:
    """Whether the JSON `value` matches `schema` (a loader-checked subset)."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    if t is not None:
        names = t if isinstance(t, list) else [t]
        if not any(_is_type(value, n) for n in names):
            return False
    if "const" in schema and not json_equal(schema["const"], value):
        return False
    if "enum" in schema and not any(json_equal(e, value) for e in schema["enum"]):
        return False
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and not value >= schema["minimum"]:
            return False
        if "maximum" in schema and not value <= schema["maximum"]:
            return False
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            return False
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return False
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            return False
    if (
        isinstance(value, list)
        and "items" in schema
        and not all(matches_schema(schema["items"], v) for v in value)
    ):
        return False
    if isinstance(value, dict):
        if any(name not in value for name in schema.get("required", ())):
            return False
        props: dict[str, Any] = schema.get("properties", {})
        for name, sub in props.items():
            if name in value and not matches_schema(sub, value[name]):
                return False
        extra = schema.get("additionalProperties", True)
        if extra is not True:
            for name, v in value.items():
                if name not in props and not matches_schema(extra, v):
                    return False
    return True
