"""Scalars of a policy file: `${NAME}` / `${NAME:-default}` expansion,
explicit YAML tags, and YAML 1.1 typing of what is left, each problem an
issue at the value's own line. The structural walk over the schema (unions,
lists, literals, dataclasses, merge keys) is `proxy.policy.loader`'s.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from proxy.policy.yamlfile import (
    COLLECTION_TAGS,
    CORE,
    MIN_BUDGET,
    SCALAR_TAGS,
    TYPED,
    PolicyIssue,
    kind,
    short_tag,
)

__all__ = ["INVALID", "MALFORMED_ENV", "MALFORMED_ENV_RE", "ScalarReader"]


_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# A `${` that does not start `${NAME}` or `${NAME:-default}` with a default
# free of `}` and `${` (also in the JSON Schema, as an ECMA-262 pattern).
MALFORMED_ENV = r"\$\{(?![A-Za-z_][A-Za-z0-9_]*(?::-(?:[^}$]|\$(?!\{))*)?\})"
MALFORMED_ENV_RE = re.compile(MALFORMED_ENV)


class _Invalid:
    def __repr__(self) -> str:
        return "<invalid>"


INVALID: Any = _Invalid()


class ScalarReader:
    """One file's scalars: `${ENV}` expansion, explicit tags, YAML 1.1 typing;
    every problem collected as an issue at its line. (`proxy.policy.loader`'s
    `Converter` adds the structure: unions, lists, literals, dataclasses.)"""

    def __init__(self, file: str, env: Mapping[str, str], budget: int = MIN_BUDGET) -> None:
        self.file = file
        self.env = env
        self.issues: list[PolicyIssue] = []
        # Knobs whose value was rejected (cross-field rules skip them).
        self.invalid: set[str] = set()
        self.budget = budget
        self._resolver = yaml.resolver.Resolver()
        self._constructor = yaml.constructor.SafeConstructor()

    def issue(self, node: yaml.Node, message: str) -> None:
        self.issues.append(PolicyIssue(self.file, node.start_mark.line + 1, message))

    def interpolate(self, node: yaml.ScalarNode, path: str) -> str:
        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in self.env:
                return self.env[name]
            if default is not None:
                return default
            self.issue(node, f"{path}: environment variable {name} is not set")
            return ""

        # A `${` that does not start a well-formed `${NAME}` or `${NAME:-default}`
        # (unterminated, nested, a bad name) would otherwise stay in the value
        # as literal text, silently.
        if MALFORMED_ENV_RE.search(node.value):
            self.issue(
                node,
                f"{path}: malformed ${{...}}: write ${{NAME}} or ${{NAME:-default}} "
                "(a default cannot contain '}' or another ${...})",
            )
            return ""
        return _ENV_RE.sub(sub, node.value)

    def resolve(self, text: str, plain: bool) -> str:
        """The tag YAML gives a scalar without an explicit one."""
        tag = self._resolver.resolve(  # type: ignore[no-untyped-call]
            yaml.ScalarNode, text, (plain, not plain)
        )
        return str(tag)

    def explicit_tag(self, node: yaml.Node, path: str) -> str | None:
        """The node's explicit core tag (`!!str 80`), None when it has none;
        an unsupported tag is an issue (and INVALID is returned)."""
        if isinstance(node, yaml.ScalarNode):
            plain = node.style is None
            implicit = self.resolve(node.value, plain)
            allowed = SCALAR_TAGS
        else:
            implicit = f"{CORE}map" if isinstance(node, yaml.MappingNode) else f"{CORE}seq"
            allowed = COLLECTION_TAGS
        if node.tag == implicit:
            return None
        if node.tag in allowed:
            return str(node.tag)
        self.issue(node, f"{path}: YAML tag {short_tag(node.tag)} is not supported here")
        return typing.cast(str, INVALID)

    def typed(self, node: yaml.ScalarNode, tag: str, text: str, path: str) -> Any:
        """`text` as the core type `tag` names (int, float, bool, null)."""
        try:
            return self._constructor.construct_object(yaml.ScalarNode(tag, text))
        except ValueError as exc:
            if "limit" in str(exc):  # more digits than int() accepts
                self.issue(node, f"{path}: number too large, got {len(text)} characters")
            else:
                self.issue(node, f"{path}: {text!r} is not a valid {short_tag(tag)}")
        except yaml.YAMLError:
            self.issue(node, f"{path}: {text!r} is not a valid {short_tag(tag)}")
        return INVALID

    def scalar(self, node: yaml.Node, path: str, text_wanted: bool = False) -> Any:
        """A scalar's value with YAML 1.1 typing applied after ${ENV} expansion.

        Where text is wanted, a plain value is kept as written (`0123`, `1_000`,
        `12:30` stay those characters, they are not numbers first)."""
        if not isinstance(node, yaml.ScalarNode):
            self.issue(node, f"{path}: expected a single value, got a {kind(node)}")
            return INVALID
        tag = self.explicit_tag(node, path)
        if tag is INVALID:
            return INVALID
        has_env = "${" in node.value
        before = len(self.issues)
        text = self.interpolate(node, path) if has_env else node.value
        if len(self.issues) != before:
            return INVALID
        if tag is not None:
            return text if tag == f"{CORE}str" else self.typed(node, tag, text, path)
        if node.style is not None and not (has_env and not text_wanted):
            # Quoted (or block) text is text; a quoted `"${PORT}"` where a
            # number goes is typed after expansion like a plain one.
            return text
        if text == "":
            # An empty ${VAR} means "empty text", not null.
            return "" if has_env else None
        # Resolve the plain scalar's type as YAML would (int, float, bool, null);
        # anything else (dates, an expanded value that looks like a structure)
        # stays text.
        resolved = self.resolve(text, True)
        if resolved not in TYPED or (text_wanted and resolved in (f"{CORE}int", f"{CORE}float")):
            return text
        return self.typed(node, resolved, text, path)
