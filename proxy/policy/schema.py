"""The policy's root: one dataclass tree that mirrors the YAML tree.

Standard library only (this package is a leaf: `brownout check` loads no
aiohttp, redis or model code). The sections live in their own modules.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints

from proxy.policy.backends import BackendsPolicy
from proxy.policy.faq import FaqPolicy
from proxy.policy.guard import GuardPolicy
from proxy.policy.knobs import knob
from proxy.policy.ladder import LadderPolicy
from proxy.policy.recorder import RecorderPolicy
from proxy.policy.rollout import RolloutPolicy
from proxy.policy.server import ServerPolicy
from proxy.policy.sessions import SessionsPolicy
from proxy.policy.telemetry import TelemetryPolicy


@dataclass(frozen=True, slots=True)
class Policy:
    backends: BackendsPolicy = field(metadata={"doc": ""})
    server: ServerPolicy = knob(ServerPolicy, "")
    sessions: SessionsPolicy = knob(SessionsPolicy, "")
    ladder: LadderPolicy = knob(LadderPolicy, "")
    guard: GuardPolicy = knob(GuardPolicy, "")
    faq: FaqPolicy = knob(FaqPolicy, "")
    rollout: RolloutPolicy = knob(RolloutPolicy, "")
    recorder: RecorderPolicy = knob(RecorderPolicy, "")
    telemetry: TelemetryPolicy = knob(TelemetryPolicy, "")
    # Where the policy came from (for status and reload), not a YAML key.
    source: str = field(default="<memory>", metadata={"internal": True})


@dataclass(frozen=True, slots=True)
class Knob:
    """One leaf of the schema: its dotted path, type and declaration."""

    path: str
    type: Any
    field: dataclasses.Field[Any]

    @property
    def meta(self) -> typing.Mapping[str, Any]:
        return self.field.metadata

    @property
    def default(self) -> Any:
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return dataclasses.MISSING


def public_fields(cls: type[Any]) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def section_of(tp: Any) -> type[Any] | None:
    """The dataclass a field's type holds (`X` and `X | None`), or None for a leaf."""
    origin = get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else tp
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def knobs(cls: type[Any] = Policy, prefix: str = "") -> Iterator[Knob]:
    """Every leaf knob of the schema, depth first, in declaration order.

    Optional sections (`backends.fallback`) are walked like the others;
    lists of records (`faq.entries`) are leaves.
    """
    hints = get_type_hints(cls)
    for f in public_fields(cls):
        path = f"{prefix}{f.name}"
        sub = section_of(hints[f.name])
        if sub is not None:
            yield from knobs(sub, path + ".")
        else:
            yield Knob(path, hints[f.name], f)


@functools.cache
def knob_index() -> dict[str, Knob]:
    """Knobs by dotted path (computed once; the schema never changes)."""
    return {k.path: k for k in knobs()}
