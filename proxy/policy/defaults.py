"""`policies/default.yaml`, generated from the schema so it can't drift.

Every knob is written out with its default and a one-line comment (the first
sentence of its documentation); the few production choices that differ from
the built-in defaults (listen on all interfaces, backend URLs and the admin
token from the environment, a slower CPU fallback) are in `PRODUCTION` below.

`python -m proxy.policy.defaults > policies/default.yaml` (a test checks the
committed file is current).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, get_type_hints

from proxy.policy.describe import range_text
from proxy.policy.schema import Knob, Policy, knob_index, public_fields, section_of

# Production values that differ from the built-in defaults, by dotted path.
PRODUCTION: dict[str, Any] = {
    "server.host": "0.0.0.0",
    "server.admin_token": "${BROWNOUT_ADMIN_TOKEN:-}",
    "backends.primary.url": "${BROWNOUT_PRIMARY_URL:-http://127.0.0.1:8000}",
    "backends.fallback.url": "${BROWNOUT_FALLBACK_URL:-http://127.0.0.1:8001}",
    "backends.fallback.kind": "transformers",
    "backends.fallback.timeouts.first_byte_s": 120.0,
    "backends.fallback.timeouts.idle_s": 60.0,
    "faq.file": "faq.yaml",
}

HEADER = """\
# yaml-language-server: $schema=policy.schema.json
# Brownout policy — production defaults for a sidecar next to vLLM.
# Every knob is written out with its default; generated from the policy model
# (`python -m proxy.policy.defaults > policies/default.yaml`), do not edit by
# hand: copy it and change what you need. Validate an edit before it goes live:
#   brownout check my-policy.yaml        (brownout check OLD --diff NEW)
# ${VAR} and ${VAR:-default} are replaced from the environment.
# Knobs marked [restart] keep their running value on reload.
"""


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return value if _plain(value) else json.dumps(value, ensure_ascii=False)
    if isinstance(value, tuple):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r}")


def _plain(text: str) -> bool:
    """Whether `text` reads back as the same string when written unquoted."""
    if not re.fullmatch(r"[A-Za-z0-9_./:-]+", text) or text.endswith(":"):
        return False
    if ":" in text and "://" not in text:
        return False
    if text.lower() in ("null", "true", "false", "yes", "no", "on", "off", "~"):
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False


def _comment(k: Knob) -> str:
    doc = str(k.meta.get("doc", "")).strip()
    first = re.split(r"(?<=\.)\s", doc, maxsplit=1)[0]
    rng = range_text(k)
    marks = " [restart]" if k.meta.get("restart") else ""
    marks += " [secret]" if k.meta.get("secret") else ""
    return f"{first}{f' [{rng}]' if rng else ''}{marks}"


# Optional sections the default policy leaves out (written as `null`).
ABSENT = frozenset({"backends.candidate"})


def _section(cls: type[Any], prefix: str, indent: int, out: list[str]) -> None:
    index = knob_index()
    hints = get_type_hints(cls)
    pad = "  " * indent
    for f in public_fields(cls):
        path = f"{prefix}{f.name}"
        sub = section_of(hints[f.name])
        if path in ABSENT:
            # An optional section that is off unless written (same keys as primary).
            out.append(f"{pad}# {str(f.metadata.get('doc', '')).strip()}")
            out.append(f"{pad}{f.name}: null")
            continue
        if sub is not None:
            if indent == 0:
                out.append("")
            doc = str(f.metadata.get("doc", "")).strip()
            if doc and indent:
                out.append(f"{pad}# {doc}")
            out.append(f"{pad}{f.name}:")
            _section(sub, path + ".", indent + 1, out)
            continue
        k = index[path]
        value = PRODUCTION.get(path, k.default)
        if value is dataclasses.MISSING:
            raise ValueError(f"{path} is required: give it a PRODUCTION value")
        out.append(f"{pad}# {_comment(k)}")
        out.append(f"{pad}{f.name}: {_scalar(value)}")


def render() -> str:
    out: list[str] = [HEADER.rstrip("\n")]
    _section(Policy, "", 0, out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
