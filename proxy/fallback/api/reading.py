"""Typed reads from untrusted request JSON, with OpenAI-style error messages."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from proxy.fallback.api.errors import APIError, invalid


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def wrong_type(name: str, expected: str, value: object) -> APIError:
    return invalid(
        f"Invalid type for '{name}': expected {expected}, but got {json_type(value)} instead.",
        name,
        code="invalid_type",
    )


class Body:
    """Typed reads from a request object; absent and null read as None."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = data

    @property
    def data(self) -> Mapping[str, Any]:
        return self._data

    def raw(self, name: str) -> Any:
        return self._data.get(name)

    def has(self, name: str) -> bool:
        return self._data.get(name) is not None

    def str_(self, name: str) -> str | None:
        value = self._data.get(name)
        if value is None or isinstance(value, str):
            return value
        raise wrong_type(name, "a string", value)

    def bool_(self, name: str, default: bool) -> bool:
        value = self._data.get(name)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        raise wrong_type(name, "a boolean", value)

    def int_(
        self, name: str, *, min_value: int | None = None, max_value: int | None = None
    ) -> int | None:
        value = self._data.get(name)
        if value is None:
            return None
        # JSON has one number type; 3.0 is an integer to most clients.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong_type(name, "an integer", value)
        if min_value is not None and value < min_value:
            raise invalid(f"'{name}' must be at least {min_value}, got {value}.", name)
        if max_value is not None and value > max_value:
            raise invalid(f"'{name}' must be at most {max_value}, got {value}.", name)
        return value

    def float_(
        self,
        name: str,
        *,
        min_value: float | None = None,
        max_value: float | None = None,
        exclusive_min: bool = False,
    ) -> float | None:
        value = self._data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong_type(name, "a number", value)
        try:
            number = float(value)
        except OverflowError:  # an integer past 1.8e308 (was a 500)
            number = math.inf if value > 0 else -math.inf
        if not math.isfinite(number):
            # Python's JSON reads NaN and Infinity; either makes the logits nan, which
            # ended the batched engine's generation loop (vLLM refuses them too).
            raise invalid(f"'{name}' must be a finite number, got {number}.", name)
        if min_value is not None and (
            number < min_value or (exclusive_min and number == min_value)
        ):
            bound = "greater than" if exclusive_min else "at least"
            raise invalid(f"'{name}' must be {bound} {min_value}, got {number}.", name)
        if max_value is not None and number > max_value:
            raise invalid(f"'{name}' must be at most {max_value}, got {number}.", name)
        return number


def require_object(data: object) -> Body:
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object.", None, code="invalid_type")
    return Body(data)


def json_text(value: object) -> str:
    """Canonical JSON text of an already parsed value (kept immutable in the dataclasses)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
