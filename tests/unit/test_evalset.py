"""The eval set (`rollout.eval`): the file, its FILE:LINE errors, `brownout
check` on it, and the checks that score an answer — any answer."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.cli import main
from proxy.control.evalchecks import check_answer, matches_schema, score
from proxy.policy import PolicyError, load_policy
from proxy.policy.evalset import (
    MAX_QUESTIONS,
    Check,
    EvalQuestion,
    Message,
    evalset_path,
    load_evalset,
    parse_evalset,
)

ROOT = Path(__file__).resolve().parents[2]


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_evalset(textwrap.dedent(text), "e.yaml")
    return info.value.lines()


# -- the file ----------------------------------------------------------------


def test_a_full_question_loads_with_every_check_kind() -> None:
    es = parse_evalset(
        textwrap.dedent(
            r"""
            questions:
              - id: capital
                messages: [{role: user, content: "What is the capital of France? One word."}]
                max_tokens: 16
                temperature: 0.5
                checks:
                  - contains: "Paris"
                  - icontains: paris
                  - regex: "^\\s*Paris"
                  - equals: 42
                  - json: true
                  - json_schema: {type: object, required: [a], description: ignored}
              - prompt: "second"
                checks: [{json: false}]
            """
        ),
        "e.yaml",
    )
    assert es.source == "e.yaml"
    first, second = es.questions
    assert first == EvalQuestion(
        "capital",
        (Message("user", "What is the capital of France? One word."),),
        16,
        0.5,
        (
            Check("contains", "Paris"),
            Check("icontains", "paris"),
            Check("regex", r"^\s*Paris"),
            Check("equals", "42"),  # a plain number where text goes: as written
            Check("json", True),
            Check("json_schema", {"type": "object", "required": ["a"]}),
        ),
    )
    # Defaults: the id by position, max_tokens 64, temperature 0; a prompt is one user turn.
    assert second == EvalQuestion(
        "q2", (Message("user", "second"),), 64, 0.0, (Check("json", False),)
    )
    assert second.wire_messages() == [{"role": "user", "content": "second"}]
    assert es.total_checks == 7


def test_every_problem_is_reported_at_its_line_at_once() -> None:
    lines = errors(
        """\
        questions:
          - id: a
            prompt: hi
            checks:
              - startswith: "x"
              - regex: "(unclosed"
          - id: b
            prompt: hi
            checks: []
          - id: a
            prompt: hi
            checks: [{contains: x}]
          - prompt: hi
          - messages: [{role: robot, content: x}]
            checks: [{contains: x}]
          - messages: "hello"
            checks: [{contains: x}]
          - prompt: hi
            max_tokens: 0
            temperature: 3
            checks: [{json: maybe}, {contains: ""}, {contains: a, equals: b}]
          - prompt: hi
            messages: [{role: user, content: x}]
            checks: [{contains: x}]
        """
    )
    assert lines == [
        "e.yaml:5: questions[0].checks[0].startswith: unknown key (known here: contains, "
        "icontains, regex, equals, json, json_schema)",
        "e.yaml:6: questions[0].checks[1].regex: not a valid regular expression "
        "(missing ), unterminated subpattern at position 0)",
        "e.yaml:9: questions[1].checks: no checks (a question needs at least one)",
        "e.yaml:10: questions[2].id: duplicate id 'a' (first at line 2)",
        "e.yaml:13: questions[3].checks: missing (at least one check)",
        "e.yaml:14: questions[4].messages[0].role: 'robot' is not one of system | user | assistant",
        "e.yaml:16: questions[5].messages: expected a list of {role, content}, got a value",
        "e.yaml:19: questions[6].max_tokens: must be 1–65536, got 0",
        "e.yaml:20: questions[6].temperature: must be 0–2, got 3",
        "e.yaml:21: questions[6].checks[0].json: expected true or false, got 'maybe'",
        "e.yaml:21: questions[6].checks[1].contains: must not be empty",
        "e.yaml:21: questions[6].checks[2]: one check per item, got contains, equals",
        "e.yaml:23: questions[7]: give prompt or messages, not both",
    ]


def test_a_default_id_and_a_written_one_may_not_collide() -> None:
    assert errors(
        "questions:\n  - {prompt: a, checks: [{json: true}]}\n"
        "  - {id: q1, prompt: b, checks: [{json: true}]}\n"
    ) == ["e.yaml:3: questions[1].id: duplicate id 'q1' (first at line 2)"]


@pytest.mark.parametrize(
    ("text", "wanted"),
    [
        ("", "e.yaml:1: questions: no questions (the file is empty)"),
        ("questions: []\n", "e.yaml:1: questions: no questions (the list is empty)"),
        ("questions:\n", "e.yaml:1: questions: no questions (the list is empty)"),
        (
            "questions: [{prompt: x, checks: [{json: true}]}]\nother: 1\n",
            "e.yaml:2: eval.other: unknown key (known here: questions)",
        ),
        ("# nothing\n{}\n", "e.yaml:2: questions: missing (a list of questions)"),
        ("- a\n", "e.yaml:1: eval: expected a mapping, got a list"),
        ("questions: {a: 1}\n", "e.yaml:1: questions: expected a list, got a mapping"),
        ("questions:\n  - 3\n", "e.yaml:2: questions[0]: expected a mapping, got a value"),
        (
            "questions:\n  - {checks: [{json: true}]}\n",
            "e.yaml:2: questions[0]: needs prompt or messages (the question)",
        ),
        (
            "questions: [{prompt: x, checks: [{}]}]\n",
            "e.yaml:1: questions[0].checks[0]: empty check (one of contains, icontains, "
            "regex, equals, json, json_schema)",
        ),
        (
            "questions: [{prompt: x, checks: {json: true}}]\n",
            "e.yaml:1: questions[0].checks: expected a list of checks, got a mapping",
        ),
        (
            "questions: [{prompt: '', checks: [{json: true}]}]\n",
            "e.yaml:1: questions[0].prompt: must not be empty",
        ),
        (
            "questions: [{prompt: x, bogus: 1, checks: [{json: true}]}]\n",
            "e.yaml:1: questions[0].bogus: unknown key (known here: id, prompt, messages, "
            "max_tokens, temperature, checks)",
        ),
        (
            "questions: [{messages: [], checks: [{json: true}]}]\n",
            "e.yaml:1: questions[0].messages: must list at least one message",
        ),
        (
            "questions: [{messages: [{role: user}], checks: [{json: true}]}]\n",
            "e.yaml:1: questions[0].messages[0]: needs role and content",
        ),
        (
            'questions: [{id: "a\\u0000b", prompt: x, checks: [{json: true}]}]\n',
            "e.yaml:1: questions[0].id: 1–128 characters, no control characters",
        ),
        (
            "questions: [{prompt: x, max_tokens: 1.5, checks: [{json: true}]}]\n",
            "e.yaml:1: questions[0].max_tokens: expected an integer, got 1.5",
        ),
        (
            "questions: [{prompt: x, temperature: .nan, checks: [{json: true}]}]\n",
            "e.yaml:1: questions[0].temperature: expected a number, got nan (not finite)",
        ),
        (
            "questions: [{prompt: x, checks: [{contains: !!binary aGk=}]}]\n",
            "e.yaml:1: questions[0].checks[0].contains: YAML tag !!binary is not supported here",
        ),
        (
            "questions: [{prompt: x, checks: [{equals: null}]}]\n",
            "e.yaml:1: questions[0].checks[0].equals: expected text, got nothing (null)",
        ),
        (
            "questions: [{prompt: x, prompt: y, checks: [{json: true}]}]\n",
            "e.yaml:1: questions[0].prompt: duplicate key",
        ),
    ],
)
def test_one_problem_one_line(text: str, wanted: str) -> None:
    assert errors(text) == [wanted]


@pytest.mark.parametrize(
    ("schema", "wanted"),
    [
        (
            "{type: thing}",
            "json_schema.type: types are object | array | string | number | integer | "
            "boolean | null, got ['thing']",
        ),
        ("{format: email}", "json_schema.format: unknown key (known here: type, properties"),
        (
            "{properties: {a: {minLength: -1}}}",
            "json_schema.properties.a.minLength: must be >= 0, got -1",
        ),
        (
            "{properties: {a: {pattern: '['}}}",
            "json_schema.properties.a.pattern: not a valid regular expression",
        ),
        ("{required: [1]}", "json_schema.required: expected a list of property names"),
        ("{enum: []}", "json_schema.enum: expected a non-empty list of values"),
        (
            "{additionalProperties: 3}",
            "json_schema.additionalProperties: expected true, false or a schema, got 3",
        ),
        ("{maximum: high}", "json_schema.maximum: expected a number, got 'high'"),
        ("[1]", "json_schema: expected a mapping, got a list"),
        ("{items: " * 40 + "{}" + "}" * 40, "schema nested over 32 deep"),
    ],
)
def test_a_schema_outside_the_subset_is_refused(schema: str, wanted: str) -> None:
    (line,) = errors(f"questions:\n  - prompt: x\n    checks:\n      - json_schema: {schema}\n")
    assert line.startswith("e.yaml:4: questions[0].checks[0].")
    assert wanted in line


def test_too_many_questions_and_too_large_a_file(tmp_path: Path) -> None:
    many = "questions:\n" + "  - {prompt: x, checks: [{json: true}]}\n" * (MAX_QUESTIONS + 1)
    assert errors(many) == [f"e.yaml:1: questions: at most {MAX_QUESTIONS} questions, got 1001"]
    parse_evalset("questions:\n" + "  - {prompt: x, checks: [{json: true}]}\n" * MAX_QUESTIONS)
    big = tmp_path / "big.yaml"
    big.write_text("questions:\n  - prompt: '" + "x" * 2**20 + "'\n    checks: [{json: true}]\n")
    with pytest.raises(PolicyError) as info:
        load_evalset(big)
    assert info.value.lines() == [f"{big}:1: file is larger than 1 MiB"]
    with pytest.raises(PolicyError) as info:
        load_evalset("/dev/zero")
    assert info.value.lines() == ["/dev/zero:1: file is larger than 1 MiB"]


def test_hostile_files_are_errors_not_crashes() -> None:
    assert errors('questions: [{prompt: "a\x00b", checks: [{json: true}]}]\n') == [
        "e.yaml:1: YAML: character '\\x00' is not allowed in a YAML file"
    ]
    deep = "questions: " + "[" * 5000 + "]" * 5000 + "\n"
    (line,) = errors(deep)
    assert line.startswith("e.yaml:1: ")
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 8):
        laughs += (
            f"{'abcdefgh'[i]}: &{'abcdefgh'[i]} [{', '.join(['*' + 'abcdefgh'[i - 1]] * 10)}]\n"
        )
    laughs += "questions: [{prompt: x, checks: [{json_schema: {enum: *h}}]}]\n"
    (line,) = errors(laughs.replace("a: &a", "x0: &a"))
    assert "aliases expand this file" in line
    # `${...}` is text in an eval file (a question may be about shell variables).
    es = parse_evalset("questions: [{prompt: 'echo ${HOME}', checks: [{contains: '${'}]}]\n")
    assert es.questions[0].messages[0].content == "echo ${HOME}"
    # A lone surrogate (YAML escapes allow it) is text like any other.
    es = parse_evalset('questions: [{prompt: "\\ud800", checks: [{contains: "\\ud800"}]}]\n')
    assert es.questions[0].checks[0].value == "\ud800"


def test_the_shipped_example_loads() -> None:
    es = load_evalset(ROOT / "policies" / "eval.example.yaml")
    assert [q.id for q in es.questions] == ["capital", "arithmetic", "json-answer", "refusal-free"]
    assert es.total_checks == 7


# -- brownout check on a policy naming an eval set ---------------------------


def _policy(tmp_path: Path, eval_text: str | None) -> Path:
    (tmp_path / "evals").mkdir()
    if eval_text is not None:
        (tmp_path / "evals" / "set.yaml").write_text(eval_text)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "backends:\n  primary:\n    url: http://127.0.0.1:8000\n"
        "  candidate:\n    url: http://127.0.0.1:8001\n"
        "rollout:\n  eval: evals/set.yaml\n"
    )
    return policy


def test_brownout_check_reports_the_eval_sets_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = _policy(
        tmp_path,
        "questions:\n  - prompt: x\n    checks:\n      - regex: '('\n"
        "  - prompt: y\n    checks: []\n",
    )
    assert main(["check", str(policy)]) == 1
    ev = tmp_path / "evals" / "set.yaml"
    assert capsys.readouterr().err.splitlines() == [
        f"{ev}:4: questions[0].checks[0].regex: not a valid regular expression "
        "(missing ), unterminated subpattern at position 0)",
        f"{ev}:6: questions[1].checks: no checks (a question needs at least one)",
    ]


def test_brownout_check_needs_the_eval_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = _policy(tmp_path, None)
    assert main(["check", str(policy)]) == 1
    assert (
        capsys.readouterr().err
        == f"{tmp_path / 'evals' / 'set.yaml'}:1: cannot read file: No such file or directory\n"
    )


def test_brownout_check_passes_a_good_eval_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = _policy(tmp_path, "questions: [{prompt: x, checks: [{regex: '.*'}]}]\n")
    assert main(["check", str(policy)]) == 0
    assert capsys.readouterr().out == f"{policy}: ok\n"
    assert evalset_path(load_policy(policy)) == tmp_path / "evals" / "set.yaml"


# -- the checks --------------------------------------------------------------


@pytest.mark.parametrize(
    ("check", "text", "passes"),
    [
        (Check("contains", "Paris"), "It is Paris.", True),
        (Check("contains", "Paris"), "It is paris.", False),
        (Check("icontains", "PARIS"), "it is paris", True),
        (Check("icontains", "straße"), "STRASSE", True),  # casefold, not lower
        (Check("icontains", "Rome"), "Paris", False),
        (Check("regex", r"^\s*Paris"), "  Paris", True),
        (Check("regex", r"^\s*Paris"), "in Paris", False),
        (Check("regex", r"\d+"), "it is 42", True),  # search, not match
        (Check("equals", "Paris"), "  Paris\n", True),
        (Check("equals", "Paris"), "Paris.", False),
        (Check("equals", ""), " \n", True),
        (Check("json", True), ' {"a": 1} ', True),
        (Check("json", True), "{'a': 1}", False),
        (Check("json", True), "NaN", False),  # not JSON, whatever Python's json says
        (Check("json", True), "[Infinity]", False),
        (Check("json", True), "", False),
        (Check("json", False), "hello", True),
        (Check("json", False), "3", False),
        (Check("json_schema", {"type": "object", "required": ["a"]}), '{"a": null}', True),
        (Check("json_schema", {"type": "object", "required": ["a"]}), '{"b": 1}', False),
        (Check("json_schema", {"type": "object"}), "not json", False),
        (Check("nonesuch", "x"), "x", False),
    ],
)
def test_each_check_kind(check: Check, text: str, passes: bool) -> None:
    assert check_answer(check, text) is passes


@pytest.mark.parametrize(
    ("schema", "value", "ok"),
    [
        ({"type": "integer"}, 3, True),
        ({"type": "integer"}, 3.0, True),
        ({"type": "integer"}, 3.5, False),
        ({"type": "integer"}, True, False),
        ({"type": "number"}, False, False),
        ({"type": "boolean"}, 1, False),
        ({"type": ["string", "null"]}, None, True),
        ({"type": ["string", "null"]}, 0, False),
        ({"type": "array", "items": {"type": "string"}}, ["a", "b"], True),
        ({"type": "array", "items": {"type": "string"}}, ["a", 1], False),
        ({"enum": [1, "a"]}, 1.0, True),
        ({"enum": [1, "a"]}, True, False),
        ({"const": {"a": [1]}}, {"a": [1.0]}, True),
        ({"const": {"a": [1]}}, {"a": [True]}, False),
        ({"const": False}, 0, False),
        ({"minimum": 0, "maximum": 10}, 10, True),
        ({"minimum": 0, "maximum": 10}, -1, False),
        ({"minimum": 0}, "text", True),  # numeric keywords judge numbers only
        ({"minLength": 2, "maxLength": 3}, "ab", True),
        ({"maxLength": 1}, "\U0001f600", True),  # code points
        ({"minLength": 2}, "a", False),
        ({"pattern": "b+"}, "abbc", True),
        ({"pattern": "^b"}, "abbc", False),
        ({"properties": {"a": {"type": "string"}}}, {"a": 1}, False),
        ({"properties": {"a": {"type": "string"}}}, {"b": 1}, True),
        ({"properties": {"a": {}}, "additionalProperties": False}, {"a": 1, "b": 2}, False),
        ({"properties": {"a": {}}, "additionalProperties": False}, {"a": 1}, True),
        ({"additionalProperties": {"type": "integer"}}, {"x": 1, "y": "2"}, False),
    ],
)
def test_the_json_schema_subset(schema: dict[str, object], value: object, ok: bool) -> None:
    assert matches_schema(schema, value) is ok


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "text",
    [
        DEEP,
        '{"a": ' * 100_000 + "1" + "}" * 100_000,
        "\x00" * 10,
        "\ud800 lone \udfff surrogates",
        '"\\ud800"',
        "1" * 5000,  # more digits than int() takes
        "x" * 2**20,
        "[" * 2**20,
    ],
)
def test_hostile_answers_never_raise(text: str) -> None:
    checks = [
        Check("contains", "x"),
        Check("icontains", "X"),
        Check("regex", r"x+$"),
        Check("equals", "x"),
        Check("json", True),
        Check("json", False),
        Check("json_schema", {"type": "array", "items": {"type": "array"}}),
        Check("json_schema", {"type": "string", "pattern": "^x"}),
    ]
    for c in checks:
        assert isinstance(check_answer(c, text), bool)
    if text in (DEEP, '{"a": ' * 100_000 + "1" + "}" * 100_000):
        assert check_answer(Check("json", True), text) is False  # too deep to be read: not JSON
        assert check_answer(Check("json", False), text) is True


def test_a_lone_surrogate_answer_is_scored() -> None:
    q = EvalQuestion(
        "s",
        (Message("user", "x"),),
        8,
        0.0,
        (
            Check("contains", "\ud800"),
            Check("json", True),
            Check("json_schema", {"type": "string"}),
        ),
    )
    assert score(q, '"\\ud800"') == (2, 3)  # the escape is JSON text, not the character
    assert score(q, "\ud800") == (1, 3)


def test_score_counts_each_check() -> None:
    q = EvalQuestion(
        "c",
        (Message("user", "x"),),
        8,
        0.0,
        (Check("contains", "Paris"), Check("equals", "Paris"), Check("json", True)),
    )
    assert score(q, "Paris") == (2, 3)
    assert score(q, '"Paris"') == (2, 3)
    assert score(q, "Rome") == (0, 3)


schemas = st.recursive(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(
                ["object", "array", "string", "number", "integer", "boolean", "null"]
            ),
            "minimum": st.integers(-5, 5),
            "maxLength": st.integers(0, 5),
            "pattern": st.sampled_from(["a", "^$", "\\d"]),
            "enum": st.lists(
                st.none() | st.booleans() | st.integers() | st.text(max_size=3), min_size=1
            ),
        },
    ),
    lambda inner: st.fixed_dictionaries(
        {},
        optional={
            "items": inner,
            "properties": st.dictionaries(st.text(max_size=3), inner, max_size=3),
            "required": st.lists(st.text(max_size=3), max_size=3),
            "additionalProperties": st.booleans() | inner,
        },
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["contains", "icontains", "regex", "equals", "json"]),
    st.text(max_size=20),
    st.text() | st.from_regex(r"[\[\]{}\"0-9,:a ]*", fullmatch=True),
)
def test_check_answer_never_raises_for_any_text(kind: str, value: str, text: str) -> None:
    if kind == "regex":
        value = "a|" + "".join(c for c in value if c.isalnum())
    if kind == "json":
        assert isinstance(check_answer(Check(kind, bool(len(value) % 2)), text), bool)
    else:
        assert isinstance(check_answer(Check(kind, value), text), bool)


@settings(max_examples=300, deadline=None)
@given(
    schemas,
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=10,
    ),
)
def test_a_schema_check_never_raises_for_any_json(schema: dict[str, object], value: object) -> None:
    text = json.dumps(value)
    assert isinstance(check_answer(Check("json_schema", schema), text), bool)
    assert isinstance(check_answer(Check("json_schema", schema), text + "\ud800"), bool)
