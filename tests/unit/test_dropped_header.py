"""`X-Brownout-Dropped`, whatever the names: visible ASCII, bounded, each
name escaped (issue 20; the ingress test is tests/integration/test_response_headers.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.openai.headers import MAX_DROPPED_CHARS, dropped_value, header_name


@given(names=st.lists(st.text(st.characters(codec=None, exclude_categories=())), max_size=300))
def test_the_dropped_header_is_always_safe_and_bounded(names: list[str]) -> None:
    value = dropped_value(names)
    assert len(value) <= MAX_DROPPED_CHARS
    parts = value.split(",") if value else []
    assert all(0x21 <= ord(c) <= 0x7E for p in parts if not p.startswith("(+") for c in p), value
    assert all(0x20 <= ord(c) <= 0x7E for c in value), value
    if parts and parts[-1].startswith("(+"):
        shown = len(parts) - 1
        assert parts[-1] == f"(+{len(names) - shown} more)"
    else:
        shown = len(parts)
        assert shown == len(names)
    assert parts[:shown] == [header_name(n) for n in names[:shown]]


def test_many_dropped_fields_fit_one_header() -> None:
    names = [f"field_{i:04d}" for i in range(1000)]
    value = dropped_value(names)
    assert len(value) <= MAX_DROPPED_CHARS
    assert value.startswith("field_0000,field_0001,") and value.endswith(" more)")
    assert header_name("a\r\nb") == "a%0D%0Ab" and header_name("a,b%") == "a%2Cb%25"
    assert header_name("best_of") == "best_of" and header_name("%") == "%"
    assert header_name("é") == "%C3%A9" and header_name("\ud800") == "%ED%A0%80"
