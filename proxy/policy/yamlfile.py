"""The YAML side of a policy file: reading it (bounded), composing it into
line-marked nodes, and the errors that point at a line.

Standard library and PyYAML only, like the rest of `proxy.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True, slots=True)
class PolicyIssue:
    file: str
    line: int  # 1-based
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class PolicyError(Exception):
    """A policy file that cannot be used; carries every issue found."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))

    def lines(self) -> list[str]:
        return [str(i) for i in self.issues]


MAX_FILE_BYTES = 16 * 2**20

CORE = "tag:yaml.org,2002:"
# Explicit tags a policy may carry: the core schema's scalar types (their
# value is typed by the tag, not guessed); anything else (`!!binary`,
# `!!python/object:...`, `!!set`, custom `!foo`) is refused.
SCALAR_TAGS = frozenset({f"{CORE}{t}" for t in ("str", "int", "float", "bool", "null")})
COLLECTION_TAGS = frozenset({f"{CORE}map", f"{CORE}seq"})
TYPED = frozenset({f"{CORE}{t}" for t in ("int", "float", "bool", "null")})
# A file without aliases visits each node once; aliases may repeat a node
# (shared settings), but not multiply the work without bound (a "billion
# laughs" file of a few KB would otherwise hang `check` and reloads).
EXPANSION = 10
MIN_BUDGET = 100_000


class TooLarge(Exception):
    def __init__(self, node: yaml.Node) -> None:
        self.node = node


def count_nodes(root: yaml.Node) -> int:
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack += (k, v)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return len(seen)


def short_tag(tag: str) -> str:
    return "!!" + tag[len(CORE) :] if tag.startswith(CORE) else tag


def kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "mapping"
    if isinstance(node, yaml.SequenceNode):
        return "list"
    return "value"


def compose(text: str, file: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise PolicyError([PolicyIssue(file, line, f"YAML syntax: {exc.problem}")]) from None
    except yaml.reader.ReaderError as exc:  # NUL and other characters YAML forbids
        line = text[: exc.position].count("\n") + 1
        why = f"YAML: character {chr(exc.character)!r} is not allowed in a YAML file"
        raise PolicyError([PolicyIssue(file, line, why)]) from None
    except RecursionError:
        why = "YAML: nested too deeply (lists or mappings inside each other)"
        raise PolicyError([PolicyIssue(file, 1, why)]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([PolicyIssue(file, 1, f"YAML: {type(exc).__name__}")]) from None


def read_text(p: Path, limit: int = MAX_FILE_BYTES) -> str:
    try:
        with p.open("rb") as f:  # bounded: `/dev/zero` or a runaway file must not hang
            raw = f.read(limit + 1)
    except OSError as exc:
        raise PolicyError([PolicyIssue(str(p), 1, f"cannot read file: {exc.strerror}")]) from None
    if len(raw) > limit:
        why = f"file is larger than {limit / 2**20:g} MiB"
        raise PolicyError([PolicyIssue(str(p), 1, why)])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PolicyError([PolicyIssue(str(p), line, "file is not valid UTF-8")]) from None
