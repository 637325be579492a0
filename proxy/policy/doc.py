"""The policy reference, generated from the schema so it never drifts.

`python -m proxy.policy.doc > docs/policy-reference.md` (a test checks the
committed file is current).
"""

from __future__ import annotations

from proxy.policy.describe import default_text, range_text, type_label
from proxy.policy.schema import knobs


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    lines = [
        "# Policy reference",
        "",
        "Generated from `proxy/policy/` by `python -m proxy.policy.doc`; do not edit by hand.",
        "Every key is optional except `backends.primary.url`. `${VAR}` and `${VAR:-default}`",
        "are replaced from the environment. Unknown keys, wrong types, values out of range",
        "and broken cross-field rules are rejected with `FILE:LINE: dotted.path: message`",
        "(`brownout check FILE`), all at once. The JSON Schema (`brownout schema`) says the",
        "same for editors.",
        "",
        "Reload: `live` knobs take effect on `brownout reload` / SIGHUP / the file watch;",
        "`restart` knobs keep their running value until the process restarts (the reload",
        "response and `brownout check --diff` list them as needing a restart). Secret knobs",
        "are never shown by the status page, the events or the logs.",
        "",
        "| key | type | default | range | reload | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in knobs():
        reload = "restart" if k.meta.get("restart") else "live"
        doc = str(k.meta.get("doc", ""))
        if k.meta.get("secret"):
            doc = f"{doc} *(secret)*"
        lines.append(
            f"| `{k.path}` | `{_cell(type_label(k.type))}` | `{_cell(default_text(k))}` "
            f"| {_cell(range_text(k))} | {reload} | {_cell(doc)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
