"""`knob()`: a policy field that carries its documentation, range and marks.

Every policy dataclass declares its fields with `knob()`, so the reference,
the JSON Schema, the generated `policies/default.yaml`, the validator and the
redaction of secrets all read one declaration and never drift apart.

Marks:
- `ge`/`gt`/`le`/`lt`: numeric bounds (for a tuple of numbers, of each item);
- `unit`: shown in the reference (`s` is implied by a `_s` suffix);
- `secret`: how the value is shown anywhere outside the process — `"value"`
  (never shown), `"userinfo"` (a URL whose `user:password@` is hidden) or
  `"pairs"` (`KEY=value` items whose KEY is hidden);
- `restart`: a running process cannot apply a change of this knob; reloads
  report it as "needs restart" and keep the running value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

SecretKind = Literal["value", "userinfo", "pairs"]


@dataclass(frozen=True, slots=True)
class Bounds:
    """Numeric bounds of a knob (None = unbounded on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violation(self, value: float) -> str | None:
        """Why `value` is out of range, or None when it is in range."""
        if self.ge is not None and value < self.ge:
            return f"must be >= {_num(self.ge)}"
        if self.gt is not None and value <= self.gt:
            return f"must be > {_num(self.gt)}"
        if self.le is not None and value > self.le:
            return f"must be <= {_num(self.le)}"
        if self.lt is not None and value >= self.lt:
            return f"must be < {_num(self.lt)}"
        return None

    def text(self) -> str:
        """`> 0`, `≥ 16`, `0 < x ≤ 1` style, for the reference."""
        lo = f"≥ {_num(self.ge)}" if self.ge is not None else ""
        lo = f"> {_num(self.gt)}" if self.gt is not None else lo
        hi = f"≤ {_num(self.le)}" if self.le is not None else ""
        hi = f"< {_num(self.lt)}" if self.lt is not None else hi
        if lo and hi:
            return f"{lo[2:]} {'≤' if lo[0] == '≥' else '<'} x {hi}"
        return lo or hi


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


def knob(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    unit: str = "",
    secret: SecretKind | None = None,
    restart: bool = False,
) -> Any:
    """A policy field with its documentation; a dataclass default becomes a factory."""
    meta: dict[str, Any] = {"doc": doc}
    if any(b is not None for b in (ge, gt, le, lt)):
        meta["bounds"] = Bounds(ge, gt, le, lt)
    if unit:
        meta["unit"] = unit
    if secret is not None:
        meta["secret"] = secret
    if restart:
        meta["restart"] = True
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=meta)
    if isinstance(default, list | dict | set):
        raise TypeError("policy defaults must be immutable (use a tuple)")
    return field(default=default, metadata=meta)


def required(doc: str, *, secret: SecretKind | None = None) -> Any:
    """A field without a default (the YAML must set it)."""
    meta: dict[str, Any] = {"doc": doc}
    if secret is not None:
        meta["secret"] = secret
    return field(metadata=meta)
