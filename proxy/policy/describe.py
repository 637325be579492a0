"""Human words for a knob's type, default, range and reload behaviour.

Shared by the reference (`proxy.policy.doc`), the generated default policy
(`proxy.policy.defaults`) and the JSON Schema (`proxy.policy.jsonschema`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin

from proxy.policy.knobs import Bounds
from proxy.policy.schema import Knob


def type_label(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_label(a) for a in get_args(tp))
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    if origin is tuple:
        return f"list of {type_label(get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp.__name__
    return {int: "int", float: "number", bool: "bool", str: "text"}.get(tp, str(tp))


def unit(k: Knob) -> str:
    u = str(k.meta.get("unit", ""))
    return u or ("s" if k.path.endswith("_s") else "")


def range_text(k: Knob) -> str:
    bounds: Bounds | None = k.meta.get("bounds")
    text = bounds.text() if bounds is not None else ""
    origin = get_origin(k.type)
    if origin is tuple and text:
        text = f"each: {text}"
    u = unit(k)
    return f"{text} {u}".strip() if text else u


def default_text(k: Knob) -> str:
    d = k.default
    if d is dataclasses.MISSING:
        return "(required)"
    return repr(d)
