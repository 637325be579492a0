"""The policy: a leaf package (standard library and PyYAML only).

One frozen dataclass tree mirrors the YAML tree (`schema` and its section
modules); every knob is declared once with `knob()` — its default, doc,
range, unit and marks (secret, restart). From that one declaration come:

- `yamlfile`: the file read (bounded) and composed into line-marked nodes;
- `loader`: YAML → objects, `FILE:LINE: dotted.path: message` for every
  problem at once (types and ranges), then `checks` (cross-field rules);
- `diff`: what a reload changes, with secrets redacted by their mark and
  restart-only knobs kept at their running value;
- `doc`, `defaults`, `jsonschema`: the reference, `policies/default.yaml`
  and the JSON Schema, generated (tests keep the committed copies current).

Nothing here imports aiohttp, redis or any other part of the proxy.
"""

from proxy.policy.backends import (
    BackendKind,
    BackendPolicy,
    BackendsPolicy,
    HealthPolicy,
    PoolPolicy,
    ProbePolicy,
    TimeoutPolicy,
)
from proxy.policy.diff import (
    flatten,
    policy_diff,
    policy_hash,
    redact,
    redact_url,
    split_restart,
)
from proxy.policy.faq import FaqEntry, FaqFile, FaqPolicy
from proxy.policy.guard import (
    Action,
    ControlCharsRule,
    GuardPolicy,
    MalformedRule,
    RepetitionRule,
    ReplacementCharsRule,
    SpecialTokensRule,
)
from proxy.policy.knobs import knob
from proxy.policy.ladder import (
    AdmissionPolicy,
    BreakerPolicy,
    FailoverPolicy,
    LadderPolicy,
    MaintenancePolicy,
    RecoveryPolicy,
    SharedPolicy,
    ThrottlePolicy,
)
from proxy.policy.loader import PolicyError, PolicyIssue, load_policy, parse_policy
from proxy.policy.priority import (
    PRIORITIES,
    RANK,
    Grant,
    Priority,
    parse_key_priorities,
    parse_key_priority,
)
from proxy.policy.schema import Policy
from proxy.policy.server import ServerPolicy
from proxy.policy.sessions import SessionsPolicy, TrimPolicy
from proxy.policy.telemetry import TelemetryPolicy

__all__ = [
    "PRIORITIES",
    "RANK",
    "Action",
    "AdmissionPolicy",
    "BackendKind",
    "BackendPolicy",
    "BackendsPolicy",
    "BreakerPolicy",
    "ControlCharsRule",
    "FailoverPolicy",
    "FaqEntry",
    "FaqFile",
    "FaqPolicy",
    "Grant",
    "GuardPolicy",
    "HealthPolicy",
    "LadderPolicy",
    "MaintenancePolicy",
    "MalformedRule",
    "Policy",
    "PolicyError",
    "PolicyIssue",
    "PoolPolicy",
    "Priority",
    "ProbePolicy",
    "RecoveryPolicy",
    "RepetitionRule",
    "ReplacementCharsRule",
    "ServerPolicy",
    "SessionsPolicy",
    "SharedPolicy",
    "SpecialTokensRule",
    "TelemetryPolicy",
    "ThrottlePolicy",
    "TimeoutPolicy",
    "TrimPolicy",
    "flatten",
    "knob",
    "load_policy",
    "parse_key_priorities",
    "parse_key_priority",
    "parse_policy",
    "policy_diff",
    "policy_hash",
    "redact",
    "redact_url",
    "split_restart",
]
