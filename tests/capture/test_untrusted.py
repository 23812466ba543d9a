"""Which lines take Python's json (`raycap.capture.untrusted.has_big_int`): every line
holding an integer literal orjson could read inexactly does, and a line whose strings
hold long digit runs (ids with nanosecond timestamps or 64-bit ids) does not. JSON raycap
did not write (`loads_untrusted`) is bounded in depth, and each failure is one typed error."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import raycap.capture.records
from raycap.capture.records import TokenEntry, entry_line, parse_records
from raycap.capture.untrusted import has_big_int
from strategies import examples

# Strings rich in what the scan looks at: digits, signs, separators, spaces.
_TEXT = st.text(alphabet="0123456789-_:,. eE+[]abc", max_size=30)
_INTS = st.integers() | st.integers(min_value=10**17, max_value=10**22) | st.integers(min_value=-(10**22), max_value=-(10**17))
_LEAVES = st.none() | st.booleans() | _INTS | st.floats(allow_nan=False, allow_infinity=False) | _TEXT
_VALUES = st.recursive(
    _LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4), max_leaves=12
)
_LAYOUTS = st.sampled_from([
    {"separators": (",", ":")}, {"separators": (", ", ": ")}, {"indent": 1}, {"indent": "\t"}, {"indent": "\r\n"},
])


def _ints(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [i for item in value for i in _ints(item)]
    if isinstance(value, dict):
        return [i for item in value.values() for i in _ints(item)]
    return []


@settings(max_examples=examples(400), deadline=None)
@given(_VALUES, _LAYOUTS)
def test_a_line_holding_a_big_integer_is_seen_and_any_other_reads_the_same_by_orjson(value, layout):
    text = json.dumps(value, **layout).encode()
    if any(abs(i) >= 10**18 for i in _ints(value)):
        assert has_big_int(text)
    if not has_big_int(text):
        # What the scan lets orjson read, orjson reads exactly as Python's json does.
        assert json.dumps(orjson.loads(text), sort_keys=True) == json.dumps(json.loads(text), sort_keys=True)


def test_ids_holding_long_digit_runs_keep_the_fast_reader(monkeypatch):
    # Rollout and call ids with a nanosecond timestamp: the digits are inside strings.
    entries = [
        TokenEntry(rollout_id="run-1796191508052553812", model_call_id=f"call-1796191508052553812-{k}",
                   prompt_token_ids=list(range(40 + 10 * k)), generation_token_ids=[7, 8], generation_log_probs=[-0.5, -0.25])
        for k in range(3)
    ]
    data = b"".join(entry_line(e) + b"\n" for e in entries)
    slow = []
    exact = raycap.capture.records._exact_loads
    monkeypatch.setattr(raycap.capture.records, "_exact_loads", lambda line: slow.append(line) or exact(line))
    parsed = [entry for entry, _ in parse_records(data)]
    assert parsed == entries and slow == []


def test_a_big_integer_in_an_output_item_keeps_its_exact_value():
    entry = TokenEntry(rollout_id="r1", model_call_id="c1", prompt_token_ids=[1, 2], generation_token_ids=[3],
                       generation_log_probs=[-0.5], output_items=[{"type": "message", "id": 2**64 + 1}])
    (parsed, _), = parse_records(entry_line(entry) + b"\n")
    assert parsed.output_items[0]["id"] == 2**64 + 1 and type(parsed.output_items[0]["id"]) is int


# --- deeply nested JSON ------------------------------------------------------------------------------


DEEP = 5000


def _nested(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def test_untrusted_json_is_bounded_and_every_failure_is_one_typed_error():
    from raycap.capture.untrusted import MAX_JSON_DEPTH, UntrustedJSONError, loads_untrusted

    assert loads_untrusted(_nested(MAX_JSON_DEPTH)) is not None
    assert loads_untrusted('["\\ud800", 123456789012345678901234567890]') == ["\ud800", 123456789012345678901234567890]
    assert loads_untrusted('"' + "[" * 10_000 + '"') == "[" * 10_000  # brackets inside a string are text
    for text in (_nested(), '{"a": ' * DEEP + "1" + "}" * DEEP, '{"v": Infinity}', "[NaN]", "1" * 5000, b"\xff"):
        with pytest.raises(UntrustedJSONError) as caught:
            loads_untrusted(text, "the file F")
        assert str(caught.value).startswith("the file F") and "\n" not in str(caught.value)
    assert loads_untrusted("[NaN]", allow_nan=True)[0] != 0
