"""Issue 23: the usage chunk found on bytes, the usage question spliced into a
request, the cheap histograms, the token counters' label bound, the engine's
queue time re-exported and the policy hash."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from proxy.control.pressure import parse_vllm_metrics
from proxy.openai.sse import DONE_EVENT
from proxy.openai.usage import (
    Usage,
    ask_for_usage,
    find_usage,
    usage_of_body,
    usage_plan,
)
from proxy.policy import parse_policy, policy_hash
from proxy.telemetry.metrics import MAX_MODEL_LABELS, Metrics


def event(obj: dict[str, Any], compact: bool = True) -> bytes:
    sep = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps(obj, separators=sep).encode() + b"\n\n"


def content(text: str, finish: str | None = None) -> bytes:
    return event(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
        }
    )


USAGE = event(
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3},
    }
)


def found(region: bytes) -> bytes | None:
    """What the relay strips: it looks only at regions whose fourth byte from
    the end is `}` or `E` (`}}\n\n`, `[DONE]\n\n`)."""
    if region[-4:-3] not in (b"}", b"E"):
        return None
    got = find_usage(region)
    return None if got is None else region[got[0] : got[1]]


@pytest.mark.parametrize(
    "region",
    [
        USAGE,
        USAGE + DONE_EVENT,
        content("a") + content("", "stop") + USAGE,
        content("a") + content("", "stop") + USAGE + DONE_EVENT,
    ],
)
def test_the_usage_chunk_is_found_at_the_end_or_before_done(region: bytes) -> None:
    assert found(region) == USAGE
    got = find_usage(region)
    assert got is not None and got[2] == Usage(9, 3)


def test_spaced_json_usage_chunk_is_found_too() -> None:
    spaced = event(
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, compact=False
    )
    assert found(content("x") + spaced + DONE_EVENT) == spaced


@pytest.mark.parametrize(
    "region",
    [
        content("a"),  # a content chunk ends with its choices list: "]}"
        content("a") + DONE_EVENT,
        DONE_EVENT,
        # usage in every chunk (continuous_usage_stats): choices not empty
        event({"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": {"a": 1}}),
        # ends like one, but no usage key
        event({"choices": [], "x": {"y": 1}}),
        # "choices":[] inside the content text, escaped: not a real key
        event({"choices": [{"delta": {"content": '"choices":[] "usage"'}}], "u": {"v": 1}}),
        b": comment}}\n\n",
        content("a") + b"\n" + DONE_EVENT,
        # another field before the data line: not stripped as one line
        b"id: 7\n" + USAGE,
        # usage before choices: not the layout recognised
        event({"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "choices": []}),
    ],
)
def test_other_regions_hold_no_usage_chunk(region: bytes) -> None:
    assert found(region) is None


def test_a_usage_chunk_without_counts_reads_as_none() -> None:
    for usage in (
        {},
        {"prompt_tokens": "9", "completion_tokens": 1},
        {"prompt_tokens": True, "completion_tokens": 1},
        {"prompt_tokens": -1, "completion_tokens": 1},
        {"prompt_tokens_details": {"cached_tokens": 1}, "completion_tokens": 1},
    ):
        got = find_usage(event({"choices": [], "usage": usage}))
        assert got is not None and got[2] is None, usage
    nested = {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}
    got = find_usage(event({"choices": [], "usage": {**nested, "completion_tokens": 2}}))
    assert got is not None and got[2] == Usage(7, 2)


def test_usage_plan() -> None:
    assert usage_plan({}) == "ask"
    assert usage_plan({"stream_options": None}) == "ask"
    assert usage_plan({"stream_options": {"include_usage": False}}) == "ask"
    assert usage_plan({"stream_options": {"include_usage": True}}) == "client"
    assert usage_plan({"stream_options": {"continuous_usage_stats": True}}) == "no"


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: k != "stream_options"),
        st.one_of(st.integers(), st.text(max_size=20), st.lists(st.integers(), max_size=3)),
        min_size=1,
        max_size=5,
    ),
    st.sampled_from(["", " ", "\n", "  \n"]),
    st.booleans(),
)
def test_the_usage_question_is_spliced_into_the_client_s_bytes(
    body: dict[str, Any], tail: str, compact: bool
) -> None:
    sep = (",", ":") if compact else (", ", ": ")
    raw = (json.dumps(body, separators=sep) + tail).encode()
    out = ask_for_usage(raw, body)
    assert json.loads(out) == {**body, "stream_options": {"include_usage": True}}
    # Spliced, not re-serialised: the client's bytes are all there, in order.
    assert out.replace(b',"stream_options":{"include_usage":true}', b"") == raw


def test_existing_stream_options_are_kept() -> None:
    body = {"model": "m", "stream_options": {"include_usage": False, "x": 1}}
    out = json.loads(ask_for_usage(json.dumps(body).encode(), body))
    assert out == {"model": "m", "stream_options": {"include_usage": True, "x": 1}}


def test_usage_of_a_json_answer() -> None:
    body = {
        "id": "x",
        "choices": [{"message": {"content": 'say "usage": {"prompt_tokens": 5}'}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 2, "details": {"cached": 1}},
        "service_tier": "default",
    }
    for sep in ((",", ":"), (", ", ": ")):
        assert usage_of_body(json.dumps(body, separators=sep).encode()) == Usage(40, 2)
    assert usage_of_body(b'{"choices":[],"usage":null}') is None
    assert usage_of_body(b'{"choices":[]}') is None
    assert usage_of_body(b'{"usage":{"prompt_tokens":4,') is None
    assert usage_of_body(b"not json at all") is None


def test_the_cheap_histogram_exposes_like_a_prometheus_one() -> None:
    m = Metrics()
    b = m.for_backend("primary")
    b.inter_token.add(0.09, 3)  # three gaps of 30 ms
    b.inter_token.observe(0.5)
    b.inter_token.observe(100.0)
    text = m.exposition().decode()
    [fam] = [
        f for f in text_string_to_metric_families(text) if f.name == "brownout_inter_token_seconds"
    ]
    assert fam.type == "histogram"
    got = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert got[("brownout_inter_token_seconds_bucket", "0.025")] == 0
    assert got[("brownout_inter_token_seconds_bucket", "0.05")] == 3
    assert got[("brownout_inter_token_seconds_bucket", "0.5")] == 4
    assert got[("brownout_inter_token_seconds_bucket", "20.0")] == 4
    assert got[("brownout_inter_token_seconds_bucket", "+Inf")] == 5
    assert got[("brownout_inter_token_seconds_count", None)] == 5
    assert got[("brownout_inter_token_seconds_sum", None)] == pytest.approx(100.59)


def test_model_labels_are_bounded_per_backend() -> None:
    m = Metrics()
    for i in range(MAX_MODEL_LABELS + 5):
        m.count_tokens("primary", f"model-{i}", "normal", 1, 1)
    m.count_tokens("primary", "x" * 200, "normal", 1, 1)
    m.count_tokens("primary", "model-0", "normal", 1, 1)
    m.count_tokens("fallback", "model-99", "normal", 1, 1)
    text = m.exposition().decode()
    [fam] = [f for f in text_string_to_metric_families(text) if f.name == "brownout_prompt_tokens"]
    by_model: dict[tuple[str, str], float] = {}
    for s in fam.samples:
        if s.name.endswith("_total"):
            key = (s.labels["backend"], s.labels["model"])
            by_model[key] = by_model.get(key, 0) + s.value
    primary = {k[1] for k in by_model if k[0] == "primary"}
    assert len(primary) == MAX_MODEL_LABELS + 1 and "other" in primary
    assert by_model[("primary", "other")] == 6
    assert by_model[("primary", "model-0")] == 2
    assert by_model[("fallback", "model-99")] == 1
    assert sum(by_model.values()) == MAX_MODEL_LABELS + 5 + 2 + 1


def test_vllm_queue_time_is_read_and_re_exported() -> None:
    page = (
        "# TYPE vllm:request_queue_time_seconds histogram\n"
        'vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4\n'
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 6.0\n'
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 4\n'
        'vllm:request_queue_time_seconds_sum{engine="1",model_name="m"} 1.5\n'
        'vllm:request_queue_time_seconds_count{engine="1",model_name="m"} 1\n'
    )
    g = parse_vllm_metrics(page)
    assert g.queue_time == (5.0, 7.5)
    assert parse_vllm_metrics("vllm:num_requests_waiting 1\n").queue_time is None
    m = Metrics()
    name = "brownout_upstream_request_queue_time_seconds"
    assert f"{name}_count" not in m.exposition().decode()  # nothing scraped yet
    m.engine_queue.source = lambda: g.queue_time
    text = m.exposition().decode()
    assert f"{name}_count 5.0" in text and f"{name}_sum 7.5" in text


def test_policy_hash_follows_the_policy_not_its_secrets() -> None:
    base = "backends:\n  primary:\n    url: http://127.0.0.1:8000\n"
    a = parse_policy(base, "a.yaml")
    assert policy_hash(a) == policy_hash(parse_policy(base, "b.yaml"))
    assert len(policy_hash(a)) == 12
    slower = parse_policy(base + "    timeouts: {idle_s: 31}\n", "a.yaml")
    assert policy_hash(slower) != policy_hash(a)
    token = dataclasses.replace(a, server=dataclasses.replace(a.server, admin_token="s3cret"))
    other = dataclasses.replace(a, server=dataclasses.replace(a.server, admin_token="other"))
    assert policy_hash(token) == policy_hash(other)
