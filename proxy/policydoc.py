"""The policy reference, generated from the config model so it never drifts.

`python -m proxy.policydoc > docs/policy-reference.md` (a test checks the
committed file is current).
"""

from __future__ import annotations

from proxy.config import policy_fields


def render() -> str:
    lines = [
        "# Policy reference",
        "",
        "Generated from `proxy/config.py` by `python -m proxy.policydoc`; do not edit by hand.",
        "Every key is optional except `backends.primary.url`. `${VAR}` and `${VAR:-default}`",
        "are replaced from the environment. Unknown keys and wrong types are rejected with",
        "`FILE:LINE: message` (`brownout check FILE`).",
        "",
        "| key | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for key, tp, default, doc in policy_fields():
        tp = tp.replace("|", "\\|")
        default = default.replace("|", "\\|")
        lines.append(f"| `{key}` | `{tp}` | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
