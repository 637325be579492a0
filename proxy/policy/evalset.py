"""The eval set (`rollout.eval`): test questions with checks on their answers.

Brownout asks both arms of a rollout these questions (`proxy.runtime.evalrun`)
and scores the answers (`proxy.control.evalchecks`); the quality gate compares
the two scores. The file is YAML:

    questions:
      - id: capital                       # optional: q1, q2, ... by position
        prompt: "Capital of France? One word."   # or messages: [{role, content}]
        max_tokens: 16                    # optional (64)
        temperature: 0                    # optional (0)
        checks:                           # all must pass; each counts once
          - contains: "Paris"             # case-sensitive substring
          - icontains: "paris"            # case-insensitive (casefold)
          - regex: "^\\s*Paris"           # Python `re.search`
          - equals: "Paris"               # the answer after strip()
          - json: true                    # the answer is (true) / is not (false) JSON
          - json_schema: {type: object, required: [a]}   # JSON matching a schema

Loading reports every problem at once as `FILE:LINE: message` (a
`PolicyError`, as the policy and the FAQ file do). Standard library and
PyYAML only, like the rest of `proxy.policy`. Text is text here: `${...}`
is not expanded in an eval file (a question may be about shell variables).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from proxy.policy.scalars import INVALID, ScalarReader
from proxy.policy.yamlfile import (
    CORE,
    EXPANSION,
    MIN_BUDGET,
    PolicyError,
    PolicyIssue,
    TooLarge,
    compose,
    count_nodes,
    kind,
    read_text,
)

if TYPE_CHECKING:
    from proxy.policy.schema import Policy

__all__ = [
    "CHECK_KINDS",
    "MAX_EVAL_BYTES",
    "MAX_QUESTIONS",
    "SCHEMA_TYPES",
    "Check",
    "EvalQuestion",
    "EvalSet",
    "Message",
    "evalset_path",
    "load_evalset",
    "parse_evalset",
]

MAX_EVAL_BYTES = 2**20  # 1 MiB
MAX_QUESTIONS = 1000
DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_LIMIT = 65536
MAX_TEMPERATURE = 2.0
MAX_ID_CHARS = 128
MAX_PATTERN_CHARS = 10_000
# Nesting of a `json_schema` (properties inside items inside ...): bounds the
# validator's recursion, whatever the answer.
MAX_SCHEMA_DEPTH = 32

CHECK_KINDS = ("contains", "icontains", "regex", "equals", "json", "json_schema")
ROLES = ("system", "user", "assistant")
SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# The JSON Schema subset `json_schema` checks (proxy.control.evalchecks).
SCHEMA_KEYWORDS = (
    "type",
    "properties",
    "required",
    "items",
    "enum",
    "const",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "additionalProperties",
)
# Keywords that describe and never constrain: accepted and ignored.
SCHEMA_ANNOTATIONS = ("$schema", "$comment", "title", "description", "default", "examples")

_QUESTION_KEYS = ("id", "prompt", "messages", "max_tokens", "temperature", "checks")
_ID_RE = re.compile(r"^[^\x00-\x1f\x7f]+$")


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Check:
    """One check on an answer. `value`: the text of contains / icontains /
    regex / equals, True or False for json, the schema (plain dicts and
    lists, never mutated) for json_schema."""

    kind: str
    value: Any


@dataclass(frozen=True, slots=True)
class EvalQuestion:
    id: str
    messages: tuple[Message, ...]
    max_tokens: int
    temperature: float
    checks: tuple[Check, ...]

    def wire_messages(self) -> list[dict[str, str]]:
        """The messages as a chat completion's `messages`."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True, slots=True)
class EvalSet:
    questions: tuple[EvalQuestion, ...]
    source: str = "<string>"

    @property
    def total_checks(self) -> int:
        return sum(len(q.checks) for q in self.questions)


def evalset_path(policy: Policy) -> Path | None:
    """The file `rollout.eval` names, relative to the policy file's directory."""
    if not policy.rollout.eval:
        return None
    return Path(policy.source).parent / policy.rollout.eval


def load_evalset(path: str | Path) -> EvalSet:
    """Read and check an eval file (blocking I/O: call at start-up or from a
    thread); raise PolicyError listing every problem."""
    p = Path(path)
    return parse_evalset(read_text(p, MAX_EVAL_BYTES), str(p))


def parse_evalset(text: str, file: str = "<string>") -> EvalSet:
    root = compose(text, file)
    if root is None:
        raise PolicyError([PolicyIssue(file, 1, "questions: no questions (the file is empty)")])
    reader = _Reader(file, max(MIN_BUDGET, EXPANSION * count_nodes(root)))
    try:
        questions = reader.document(root)
    except RecursionError:
        why = "YAML: nested too deeply (lists or mappings inside each other)"
        raise PolicyError([PolicyIssue(file, 1, why)]) from None
    except TooLarge as exc:
        line = exc.node.start_mark.line + 1
        why = (
            "YAML aliases expand this file to more values than it may hold "
            f"(over {EXPANSION}x its own size): write the repeated parts out"
        )
        raise PolicyError([PolicyIssue(file, line, why)]) from None
    if reader.issues:
        raise PolicyError(sorted(reader.issues, key=lambda i: i.line))
    return EvalSet(questions, file)


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


class _Reader(ScalarReader):
    """Walks the composed file, collecting every issue at its line."""

    def __init__(self, file: str, budget: int) -> None:
        super().__init__(file, {}, budget)

    # -- structure ----------------------------------------------------------

    def mapping(
        self, node: yaml.Node, path: str, known: tuple[str, ...]
    ) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """A mapping's pairs by key; unknown and duplicate keys are issues."""
        if not isinstance(node, yaml.MappingNode):
            self.issue(node, f"{path}: expected a mapping, got a {kind(node)}")
            return None
        if self.explicit_tag(node, path) is INVALID:
            return None
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            self.spend(key_node)
            key = self.key(key_node, path)
            if key is None:
                continue
            where = f"{path}.{key}"
            if key_node.tag == f"{CORE}merge":
                self.issue(key_node, f"{path}: merge keys (<<) are not supported in an eval file")
            elif key not in known:
                self.issue(key_node, f"{where}: unknown key (known here: {', '.join(known)})")
            elif key in out:
                self.issue(key_node, f"{where}: duplicate key")
            else:
                out[key] = (key_node, value_node)
        return out

    def key(self, node: yaml.Node, path: str) -> str | None:
        if not isinstance(node, yaml.ScalarNode):
            self.issue(node, f"{path}: a key must be a name, got a {kind(node)}")
            return None
        return str(node.value)

    def spend(self, node: yaml.Node) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise TooLarge(node)

    def value(self, node: yaml.Node, path: str) -> Any:
        """A scalar: quoted is text; plain is typed as YAML 1.1 has it."""
        if not isinstance(node, yaml.ScalarNode):
            self.issue(node, f"{path}: expected a single value, got a {kind(node)}")
            return INVALID
        tag = self.explicit_tag(node, path)
        if tag is INVALID:
            return INVALID
        if tag is not None:
            return node.value if tag == f"{CORE}str" else self.typed(node, tag, node.value, path)
        if node.style is not None:
            return node.value
        resolved = self.resolve(node.value, True)
        if resolved in (f"{CORE}int", f"{CORE}float", f"{CORE}bool", f"{CORE}null"):
            return self.typed(node, resolved, node.value, path)
        return node.value

    def text(self, node: yaml.Node, path: str, *, empty: bool = True) -> str | None:
        """Text as written (a plain `42` or `true` is those characters)."""
        if not isinstance(node, yaml.ScalarNode):
            self.issue(node, f"{path}: expected text, got a {kind(node)}")
            return None
        tag = self.explicit_tag(node, path)
        if tag is INVALID:
            return None
        if node.style is None and tag is None and self.resolve(node.value, True).endswith(":null"):
            self.issue(node, f"{path}: expected text, got nothing (null)")
            return None
        text = str(node.value)
        if not empty and not text:
            self.issue(node, f"{path}: must not be empty")
            return None
        return text

    def number(self, node: yaml.Node, path: str, *, integer: bool) -> Any:
        value = self.value(node, path)
        if value is INVALID:
            return INVALID
        if isinstance(value, bool) or not isinstance(value, int | float):
            want = "an integer" if integer else "a number"
            self.issue(node, f"{path}: expected {want}, got {_shown(value)}")
            return INVALID
        if isinstance(value, float) and not math.isfinite(value):
            self.issue(node, f"{path}: expected a number, got {value!r} (not finite)")
            return INVALID
        if integer and isinstance(value, float):
            if not value.is_integer():
                self.issue(node, f"{path}: expected an integer, got {value!r}")
                return INVALID
            value = int(value)
        return value

    # -- the file -----------------------------------------------------------

    def document(self, root: yaml.Node) -> tuple[EvalQuestion, ...]:
        top = self.mapping(root, "eval", ("questions",))
        if top is None:
            return ()
        if "questions" not in top:
            self.issue(root, "questions: missing (a list of questions)")
            return ()
        key_node, node = top["questions"]
        if isinstance(node, yaml.ScalarNode) and self.value(node, "questions") is None:
            node = yaml.SequenceNode(f"{CORE}seq", [], node.start_mark, node.end_mark)
        if not isinstance(node, yaml.SequenceNode):
            self.issue(node, f"questions: expected a list, got a {kind(node)}")
            return ()
        if not node.value:
            self.issue(key_node, "questions: no questions (the list is empty)")
            return ()
        if len(node.value) > MAX_QUESTIONS:
            self.issue(
                key_node,
                f"questions: at most {MAX_QUESTIONS} questions, got {len(node.value)}",
            )
            return ()
        questions: list[EvalQuestion] = []
        first_line: dict[str, int] = {}
        for i, qnode in enumerate(node.value):
            qid, q = self.question(qnode, i)
            if qid in first_line:
                self.issue(
                    qnode,
                    f"questions[{i}].id: duplicate id {qid!r} (first at line {first_line[qid]})",
                )
                continue
            first_line[qid] = _line(qnode)
            if q is not None:
                questions.append(q)
        return tuple(questions)

    def question(self, node: yaml.Node, i: int) -> tuple[str, EvalQuestion | None]:
        """Its id (also of a question with problems: duplicates are found) and
        the question, None when it has problems (issues)."""
        path = f"questions[{i}]"
        qid = f"q{i + 1}"
        fields = self.mapping(node, path, _QUESTION_KEYS)
        if fields is None:
            return qid, None
        before = len(self.issues)
        if "id" in fields:
            got = self.text(fields["id"][1], f"{path}.id", empty=False)
            if got is not None and (len(got) > MAX_ID_CHARS or not _ID_RE.match(got)):
                self.issue(
                    fields["id"][1],
                    f"{path}.id: 1–{MAX_ID_CHARS} characters, no control characters",
                )
            elif got is not None:
                qid = got
        messages: tuple[Message, ...] = ()
        if "prompt" in fields and "messages" in fields:
            self.issue(fields["messages"][0], f"{path}: give prompt or messages, not both")
        elif "prompt" in fields:
            prompt = self.text(fields["prompt"][1], f"{path}.prompt", empty=False)
            if prompt is not None:
                messages = (Message("user", prompt),)
        elif "messages" in fields:
            messages = self.messages(fields["messages"][1], f"{path}.messages")
        else:
            self.issue(node, f"{path}: needs prompt or messages (the question)")
        max_tokens = DEFAULT_MAX_TOKENS
        if "max_tokens" in fields:
            v = self.number(fields["max_tokens"][1], f"{path}.max_tokens", integer=True)
            if v is not INVALID and not 1 <= v <= MAX_TOKENS_LIMIT:
                self.issue(
                    fields["max_tokens"][1],
                    f"{path}.max_tokens: must be 1–{MAX_TOKENS_LIMIT}, got {v}",
                )
            elif v is not INVALID:
                max_tokens = v
        temperature = 0.0
        if "temperature" in fields:
            v = self.number(fields["temperature"][1], f"{path}.temperature", integer=False)
            if v is not INVALID and not 0 <= v <= MAX_TEMPERATURE:
                self.issue(
                    fields["temperature"][1],
                    f"{path}.temperature: must be 0–{MAX_TEMPERATURE:g}, got {v!r}",
                )
            elif v is not INVALID:
                temperature = float(v)
        checks: tuple[Check, ...] = ()
        if "checks" in fields:
            key_node, cnode = fields["checks"]
            checks = self.checks(key_node, cnode, f"{path}.checks")
        else:
            self.issue(node, f"{path}.checks: missing (at least one check)")
        if len(self.issues) != before:
            return qid, None
        return qid, EvalQuestion(qid, messages, max_tokens, temperature, checks)

    def messages(self, node: yaml.Node, path: str) -> tuple[Message, ...]:
        if not isinstance(node, yaml.SequenceNode):
            self.issue(node, f"{path}: expected a list of {{role, content}}, got a {kind(node)}")
            return ()
        if not node.value:
            self.issue(node, f"{path}: must list at least one message")
            return ()
        out: list[Message] = []
        for j, mnode in enumerate(node.value):
            where = f"{path}[{j}]"
            self.spend(mnode)
            fields = self.mapping(mnode, where, ("role", "content"))
            if fields is None:
                continue
            if "role" not in fields or "content" not in fields:
                self.issue(mnode, f"{where}: needs role and content")
                continue
            role = self.text(fields["role"][1], f"{where}.role")
            content = self.text(fields["content"][1], f"{where}.content")
            if role is not None and role not in ROLES:
                self.issue(
                    fields["role"][1], f"{where}.role: {role!r} is not one of {' | '.join(ROLES)}"
                )
            elif role is not None and content is not None:
                out.append(Message(role, content))
        return tuple(out)

    def checks(self, key_node: yaml.Node, node: yaml.Node, path: str) -> tuple[Check, ...]:
        if not isinstance(node, yaml.SequenceNode):
            self.issue(node, f"{path}: expected a list of checks, got a {kind(node)}")
            return ()
        if not node.value:
            self.issue(key_node, f"{path}: no checks (a question needs at least one)")
            return ()
        out: list[Check] = []
        for j, cnode in enumerate(node.value):
            where = f"{path}[{j}]"
            self.spend(cnode)
            fields = self.mapping(cnode, where, CHECK_KINDS)
            if fields is None:
                continue
            if len(fields) != 1:
                if fields:
                    self.issue(cnode, f"{where}: one check per item, got {', '.join(fields)}")
                elif not cnode.value:
                    self.issue(cnode, f"{where}: empty check (one of {', '.join(CHECK_KINDS)})")
                continue
            ((ck, (_, vnode)),) = fields.items()
            check = self.check(ck, vnode, f"{where}.{ck}")
            if check is not None:
                out.append(check)
        return tuple(out)

    def check(self, ck: str, node: yaml.Node, path: str) -> Check | None:
        if ck in ("contains", "icontains"):
            text = self.text(node, path, empty=False)
            return None if text is None else Check(ck, text)
        if ck == "equals":
            text = self.text(node, path)
            return None if text is None else Check(ck, text)
        if ck == "regex":
            text = self.text(node, path)
            if text is None or self.pattern(node, text, path) is None:
                return None
            return Check(ck, text)
        if ck == "json":
            v = self.value(node, path)
            if v is INVALID:
                return None
            if not isinstance(v, bool):
                self.issue(node, f"{path}: expected true or false, got {_shown(v)}")
                return None
            return Check(ck, v)
        schema = self.schema(node, path, 0)
        return None if schema is INVALID else Check(ck, schema)

    def pattern(self, node: yaml.Node, text: str, path: str) -> re.Pattern[str] | None:
        if len(text) > MAX_PATTERN_CHARS:
            self.issue(node, f"{path}: at most {MAX_PATTERN_CHARS} characters, got {len(text)}")
            return None
        try:
            return re.compile(text)
        except (re.error, RecursionError, OverflowError, ValueError) as exc:
            where = f" at position {exc.pos}" if isinstance(exc, re.error) else ""
            msg = exc.msg if isinstance(exc, re.error) else type(exc).__name__
            self.issue(node, f"{path}: not a valid regular expression ({msg}{where})")
            return None

    # -- json_schema (the subset proxy.control.evalchecks validates) --------

    def schema(self, node: yaml.Node, path: str, depth: int) -> Any:
        if depth > MAX_SCHEMA_DEPTH:
            self.issue(node, f"{path}: schema nested over {MAX_SCHEMA_DEPTH} deep")
            return INVALID
        fields = self.mapping(node, path, SCHEMA_KEYWORDS + SCHEMA_ANNOTATIONS)
        if fields is None:
            return INVALID
        out: dict[str, Any] = {}
        ok = True
        for kw, (_, vnode) in fields.items():
            where = f"{path}.{kw}"
            v = self.keyword(kw, vnode, where, depth)
            if v is INVALID:
                ok = False
            elif kw not in SCHEMA_ANNOTATIONS:
                out[kw] = v
        return out if ok else INVALID

    def keyword(self, kw: str, node: yaml.Node, path: str, depth: int) -> Any:
        if kw in SCHEMA_ANNOTATIONS:
            return None  # not read: any well-formed YAML
        if kw == "type":
            single = not isinstance(node, yaml.SequenceNode)
            if single:
                name = self.text(node, path)
                if name is None:
                    return INVALID
                names: Any = [name]
            else:
                names = self.data(node, path)
                if names is INVALID:
                    return INVALID
            if not names or not all(isinstance(n, str) and n in SCHEMA_TYPES for n in names):
                self.issue(node, f"{path}: types are {' | '.join(SCHEMA_TYPES)}, got {names!r}")
                return INVALID
            return names[0] if single else names
        if kw == "properties":
            if not isinstance(node, yaml.MappingNode):
                self.issue(node, f"{path}: expected a mapping of schemas, got a {kind(node)}")
                return INVALID
            return self.properties(node, path, depth)
        if kw == "items":
            return self.schema(node, path, depth + 1)
        if kw == "additionalProperties":
            if isinstance(node, yaml.ScalarNode):
                v = self.value(node, path)
                if v is INVALID:
                    return INVALID
                if not isinstance(v, bool):
                    self.issue(node, f"{path}: expected true, false or a schema, got {_shown(v)}")
                    return INVALID
                return v
            return self.schema(node, path, depth + 1)
        if kw == "required":
            names = self.data(node, path)
            if names is INVALID:
                return INVALID
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                self.issue(node, f"{path}: expected a list of property names")
                return INVALID
            return names
        if kw == "enum":
            values = self.data(node, path)
            if values is INVALID:
                return INVALID
            if not isinstance(values, list) or not values:
                self.issue(node, f"{path}: expected a non-empty list of values")
                return INVALID
            return values
        if kw == "const":
            return self.data(node, path)
        if kw in ("minimum", "maximum"):
            return self.number(node, path, integer=False)
        if kw in ("minLength", "maxLength"):
            v = self.number(node, path, integer=True)
            if v is not INVALID and v < 0:
                self.issue(node, f"{path}: must be >= 0, got {v}")
                return INVALID
            return v
        # pattern
        text = self.text(node, path)
        if text is None or self.pattern(node, text, path) is None:
            return INVALID
        return text

    def properties(self, node: yaml.MappingNode, path: str, depth: int) -> Any:
        if self.explicit_tag(node, path) is INVALID:
            return INVALID
        out: dict[str, Any] = {}
        ok = True
        for key_node, value_node in node.value:
            name = self.key(key_node, path)
            if name is None:
                ok = False
                continue
            if name in out:
                self.issue(key_node, f"{path}.{name}: duplicate key")
                ok = False
                continue
            sub = self.schema(value_node, f"{path}.{name}", depth + 1)
            if sub is INVALID:
                ok = False
            out[name] = sub
        return out if ok else INVALID

    def data(self, node: yaml.Node, path: str) -> Any:
        """Any YAML value as JSON data (mappings with text keys, lists, scalars)."""
        self.spend(node)
        if isinstance(node, yaml.ScalarNode):
            v = self.value(node, path)
            if isinstance(v, float) and not math.isfinite(v):
                self.issue(node, f"{path}: {v!r} is not a JSON value")
                return INVALID
            if v is not INVALID and not isinstance(v, str | int | float | bool | type(None)):
                self.issue(node, f"{path}: {_shown(v)} is not a JSON value")
                return INVALID
            return v
        if self.explicit_tag(node, path) is INVALID:
            return INVALID
        if isinstance(node, yaml.SequenceNode):
            items = [self.data(n, f"{path}[{i}]") for i, n in enumerate(node.value)]
            return INVALID if any(v is INVALID for v in items) else items
        assert isinstance(node, yaml.MappingNode)
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            name = self.key(key_node, path)
            if name is None:
                return INVALID
            v = self.data(value_node, f"{path}.{name}")
            if v is INVALID:
                return INVALID
            out[name] = v
        return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
