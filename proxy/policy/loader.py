"""YAML in, frozen typed objects out, `FILE:LINE: dotted.path: message` errors.

The YAML is composed into a node tree (which keeps line marks) and converted
against the dataclass schema, so every error points at the line an SRE has to
fix. Types and each knob's declared range are checked during conversion, at
the value's own line; cross-field rules run after (`proxy.policy.checks`).
All errors of a file are collected, not just the first.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from proxy.policy.evalset import evalset_path, load_evalset
from proxy.policy.faq import FaqFile
from proxy.policy.knobs import Bounds
from proxy.policy.scalars import INVALID, MALFORMED_ENV, ScalarReader
from proxy.policy.schema import Policy, public_fields
from proxy.policy.yamlfile import (
    CORE,
    EXPANSION,
    MAX_FILE_BYTES,
    MIN_BUDGET,
    PolicyError,
    PolicyIssue,
    TooLarge,
    compose,
    count_nodes,
    kind,
    read_text,
)

__all__ = [
    "MALFORMED_ENV",
    "MAX_FILE_BYTES",
    "Converter",
    "PolicyError",
    "PolicyIssue",
    "load_policy",
    "parse_policy",
]


T = TypeVar("T")
# `<<: *a` where a merges b which merges c...: deeper is no configuration.
_MERGE_DEPTH = 32


class Converter(ScalarReader):
    """Walks a YAML node tree against a dataclass schema, collecting issues
    (scalars: `proxy.policy.scalars`)."""

    def convert(self, node: yaml.Node, tp: Any, path: str, bounds: Bounds | None = None) -> Any:
        self.budget -= 1
        if self.budget < 0:
            raise TooLarge(node)
        origin = get_origin(tp)
        if origin is typing.Union or origin is types.UnionType:
            args = [a for a in get_args(tp) if a is not type(None)]
            if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
                return None
            if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
                return None
            return self.convert(node, args[0], path, bounds)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.dataclass(node, tp, path)
        if not isinstance(node, yaml.ScalarNode) and self.explicit_tag(node, path) is INVALID:
            return INVALID
        if origin is tuple:
            (item_tp, _ellipsis) = get_args(tp)
            if isinstance(node, yaml.ScalarNode) and self.scalar(node, path) is None:
                return ()
            if not isinstance(node, yaml.SequenceNode):
                self.issue(node, f"{path}: expected a list, got a {kind(node)}")
                return INVALID
            items = tuple(
                self.convert(n, item_tp, f"{path}[{i}]", bounds) for i, n in enumerate(node.value)
            )
            return INVALID if any(v is INVALID for v in items) else items
        if origin is Literal:
            value = self.scalar(node, path)
            allowed = get_args(tp)
            if value is INVALID:
                return value
            if value not in allowed:
                choices = " | ".join(str(a) for a in allowed)
                self.issue(node, f"{path}: {_shown(value)} is not one of {choices}")
                return INVALID
            return value
        value = self.scalar(node, path, text_wanted=tp is str)
        if value is INVALID:
            return value
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:  # beyond any float: 400 digits
                self.issue(node, f"{path}: number too large, got {len(str(value))} digits")
                return INVALID
        if tp is int and isinstance(value, float) and value.is_integer():
            value = int(value)  # `20.0` is an integer (as JSON Schema has it)
        if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
            # Numbers where text is expected (tokens, names) are kept as written.
            return str(value)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            self.issue(node, f"{path}: expected {_type_name(tp)}, got {_shown(value)}")
            return INVALID
        if tp is float and not math.isfinite(value):  # NaN passes every comparison
            self.issue(node, f"{path}: expected a number, got {value!r} (not finite)")
            return INVALID
        if bounds is not None and tp in (int, float):
            why = bounds.violation(value)
            if why is not None:
                self.issue(node, f"{path}: {why}, got {value!r}")
                return INVALID
        return value

    def pairs(
        self, node: yaml.MappingNode, path: str, inside: tuple[int, ...]
    ) -> list[tuple[yaml.Node, yaml.Node]]:
        """The mapping's key/value pairs with YAML merge keys (`<<: *base`,
        `<<: [*a, *b]`) applied: keys written here win over merged ones, and
        an earlier merged mapping wins over a later one (as PyYAML, and so the
        JSON Schema's view of the file, has it)."""
        own: list[tuple[yaml.Node, yaml.Node]] = []
        merged: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag != f"{CORE}merge":
                own.append((key_node, value_node))
                continue
            sources = (
                value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            )
            for src in sources:
                if not isinstance(src, yaml.MappingNode):
                    self.issue(src, f"{path}.<<: can only merge a mapping, got a {kind(src)}")
                elif id(src) in inside or id(node) == id(src):
                    self.issue(src, f"{path}.<<: a mapping cannot merge itself")
                elif len(inside) >= _MERGE_DEPTH:
                    self.issue(src, f"{path}.<<: merges nested over {_MERGE_DEPTH} deep")
                else:
                    self.budget -= len(src.value)
                    if self.budget < 0:
                        raise TooLarge(src)
                    merged += self.pairs(src, path, (*inside, id(node)))
        if not merged:
            return own
        written = {k.value for k, _ in own if isinstance(k, yaml.ScalarNode)}
        for key_node, value_node in merged:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None or key not in written:
                own.append((key_node, value_node))
                if key is not None:
                    written.add(key)
        return own

    def dataclass(self, node: yaml.Node, cls: type[T], path: str) -> T:
        if not isinstance(node, yaml.MappingNode):
            self.issue(node, f"{path or 'policy'}: expected a mapping, got a {kind(node)}")
            return typing.cast(T, INVALID)
        if self.explicit_tag(node, path or "policy") is INVALID:
            return typing.cast(T, INVALID)
        hints = get_type_hints(cls)
        fields = {f.name: f for f in public_fields(cls)}
        values: dict[str, Any] = {}
        seen: set[str] = set()
        for key_node, value_node in self.pairs(node, path or "policy", ()):
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None:
                self.issue(
                    key_node, f"{path or 'policy'}: a key must be a name, got a {kind(key_node)}"
                )
                continue
            where = f"{path}.{key}" if path else str(key)
            if key not in fields:
                known = ", ".join(sorted(fields))
                self.issue(key_node, f"{where}: unknown key (known here: {known})")
                continue
            if key in seen:
                self.issue(key_node, f"{where}: duplicate key")
                continue
            seen.add(key)
            values[key] = self.convert(
                value_node, hints[key], where, fields[key].metadata.get("bounds")
            )
        missing = False
        for name, f in fields.items():
            if (
                name not in values
                and f.default is dataclasses.MISSING
                and (f.default_factory is dataclasses.MISSING)
            ):
                where = f"{path}.{name}" if path else name
                self.issue(node, f"{where}: missing required key")
                missing = True
        for name, v in list(values.items()):
            if v is not INVALID:
                continue
            # Keep going with the default so the cross-field rules still run and
            # every problem of the file is reported at once.
            self.invalid.add(f"{path}.{name}" if path else name)
            f = fields[name]
            if f.default is not dataclasses.MISSING:
                values[name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[name] = f.default_factory()
            else:
                return typing.cast(T, INVALID)
        if missing:
            return typing.cast(T, INVALID)
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            self.issue(node, f"{path or 'policy'}: {exc}")
            return typing.cast(T, INVALID)


def _shown(value: Any) -> str:
    """A value in a message, cut to a line (a 4000-digit number, a long text)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "text"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _budget(root: yaml.Node) -> int:
    return max(MIN_BUDGET, EXPANSION * count_nodes(root))


def _convert(conv: Converter, root: yaml.Node, cls: type[T]) -> T:
    try:
        return conv.dataclass(root, cls, "")
    except RecursionError:  # a backstop: the schema and merges are depth-bounded
        why = "YAML: nested too deeply (lists or mappings inside each other)"
        raise PolicyError([PolicyIssue(conv.file, 1, why)]) from None
    except TooLarge as exc:
        line = exc.node.start_mark.line + 1
        message = (
            "YAML aliases expand this file to more values than it may hold "
            f"(over {EXPANSION}x its own size): write the repeated parts out"
        )
        raise PolicyError([PolicyIssue(conv.file, line, message)]) from None


def parse_policy(text: str, file: str = "<string>", env: Mapping[str, str] | None = None) -> Policy:
    """Parse and validate policy text; raise PolicyError listing every issue."""
    from proxy.policy.checks import cross_checks

    root = compose(text, file)
    if root is None:
        raise PolicyError([PolicyIssue(file, 1, "backends.primary: empty policy, but required")])
    conv = Converter(file, os.environ if env is None else env, _budget(root))
    policy = _convert(conv, root, Policy)
    if policy is not INVALID:
        cross_checks(policy, root, conv)
    if conv.issues:
        raise PolicyError(sorted(conv.issues, key=lambda i: i.line))
    return dataclasses.replace(policy, source=file)


def load_policy(path: str | Path, env: Mapping[str, str] | None = None) -> Policy:
    """Read a policy file and the files it names (blocking I/O: call at start-up
    or from a thread)."""
    p = Path(path)
    policy = parse_policy(read_text(p), str(p), env)
    if policy.faq.file:
        faq_path = p.parent / policy.faq.file
        faq = _parse_faq(read_text(faq_path), str(faq_path))
        policy = dataclasses.replace(
            policy,
            faq=dataclasses.replace(policy.faq, entries=faq.entries + policy.faq.entries),
        )
    eval_path = evalset_path(policy)
    if eval_path is not None:
        # Checked here, like the FAQ file, so `brownout check` and a reload
        # refuse a broken eval set; the rollout loads it again when it runs.
        load_evalset(eval_path)
    return policy


def _parse_faq(text: str, file: str) -> FaqFile:
    root = compose(text, file)
    if root is None:
        return FaqFile()
    conv = Converter(file, {}, _budget(root))
    faq = _convert(conv, root, FaqFile)
    if conv.issues:
        raise PolicyError(sorted(conv.issues, key=lambda i: i.line))
    return faq
