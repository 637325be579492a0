"""The policy as a JSON Schema (draft 2020-12), generated from the schema.

`brownout schema` prints it; `policies/policy.schema.json` is the committed
copy that editors pick up through the `# yaml-language-server: $schema=...`
line of the shipped policies. Types, enums, ranges, defaults, descriptions,
required keys and "no other keys" come from the same declarations the
validator uses; the cross-field rules (`proxy.policy.checks`) are beyond
JSON Schema and are stated in the descriptions instead.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal, get_args, get_origin, get_type_hints

from proxy.policy.faq import FaqFile
from proxy.policy.knobs import Bounds
from proxy.policy.scalars import MALFORMED_ENV
from proxy.policy.schema import Policy, public_fields

# A `${VAR}` anywhere in a value is expanded before the value is typed.
_ENV_STRING = {
    "type": "string",
    "pattern": r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-[^}]*)?\}",
    "not": {"type": "string", "pattern": MALFORMED_ENV},
}


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in public_fields(type(value))}
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _bounds(schema: dict[str, Any], bounds: Bounds | None) -> dict[str, Any]:
    if bounds is None:
        return schema
    for key, value in (
        ("minimum", bounds.ge),
        ("exclusiveMinimum", bounds.gt),
        ("maximum", bounds.le),
        ("exclusiveMaximum", bounds.lt),
    ):
        if value is not None:
            schema[key] = value
    return schema


def _type(tp: Any, bounds: Bounds | None, defs: dict[str, Any]) -> dict[str, Any]:
    origin = get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in get_args(tp) if a is not type(None)]
        return {"anyOf": [_type(inner[0], bounds, defs), {"type": "null"}]}
    if origin is Literal:
        values = list(get_args(tp))
        return (
            {"enum": values}
            if all(isinstance(v, str) for v in values)
            else {"anyOf": [{"enum": values}, _ENV_STRING]}
        )
    if origin is tuple:
        item = _type(get_args(tp)[0], bounds, defs)
        return {"anyOf": [{"type": "array", "items": item}, {"type": "null"}]}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # placeholder: recursion guard
            defs[name] = _object(tp, defs)
        return {"$ref": f"#/$defs/{name}"}
    if tp is bool:
        return {"anyOf": [{"type": "boolean"}, _ENV_STRING]}
    if tp in (int, float):
        number = _bounds({"type": "integer" if tp is int else "number"}, bounds)
        return {"anyOf": [number, _ENV_STRING]}
    if tp is str:
        # A plain number where text goes is kept as written (`api_key: 0123`).
        return {"type": ["string", "number"], "not": {"type": "string", "pattern": MALFORMED_ENV}}
    raise TypeError(f"no JSON Schema for {tp!r}")


def _object(cls: type[Any], defs: dict[str, Any]) -> dict[str, Any]:
    hints = get_type_hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in public_fields(cls):
        prop = _type(hints[f.name], f.metadata.get("bounds"), defs)
        doc = str(f.metadata.get("doc", ""))
        if doc:
            prop["description"] = doc
        if f.default is not dataclasses.MISSING:
            prop["default"] = _jsonable(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            prop["default"] = _jsonable(f.default_factory())
        else:
            required.append(f.name)
        props[f.name] = prop
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def policy_schema(faq: bool = False) -> dict[str, Any]:
    """The schema of a policy file, or (`faq`) of an FAQ file it names."""
    defs: dict[str, Any] = {}
    root = _object(FaqFile if faq else Policy, defs)
    what = "FAQ file (`faq.file`)" if faq else "policy"
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:brownout:{'faq' if faq else 'policy'}",
        "title": f"Brownout {what}",
        "description": f"YAML {what} of the Brownout resilience sidecar (`brownout check`).",
        **root,
        "$defs": dict(sorted(defs.items())),
    }


def render(faq: bool = False) -> str:
    return json.dumps(policy_schema(faq), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    import sys

    print(render(faq=sys.argv[1:] == ["faq"]), end="")
