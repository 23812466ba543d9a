"""Tests for raycap.capture.records: the TokenEntry model, its JSONL line, the fast reader and
token extraction from served responses (SPEC section 1)."""

from __future__ import annotations

import json
import math

import numpy as np
import orjson
import pydantic
import pytest

from raycap.capture.records import (
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    TOKEN_FIELDS,
    TokenEntry,
    entry_line,
    extract_token_fields,
    iter_lines,
    loads_line,
    parse_entries,
    parse_entry,
    parse_record,
    parse_records,
)


def make_entry(**overrides) -> TokenEntry:
    values = dict(
        rollout_id="r1",
        model_call_id="c1",
        prompt_token_ids=[1, 2, 3],
        generation_token_ids=[4, 5],
        generation_log_probs=[-0.5, -0.25],
    )
    values.update(overrides)
    return TokenEntry(**values)


def record(**overrides) -> dict:
    """A plain record dict as a writer would serialise it."""
    values = dict(
        rollout_id="r1",
        model_call_id="c1",
        prompt_token_ids=[1, 2, 3],
        generation_token_ids=[4, 5],
        generation_log_probs=[-0.5, -0.25],
    )
    values.update(overrides)
    return values


def exact(entry: TokenEntry) -> str:
    """The entry's content with types made visible: True and 1, 1 and 1.0 differ here,
    and integers of any size are kept exactly."""
    return json.dumps(entry.model_dump(), sort_keys=True)


# -- the model ------------------------------------------------------------------------------


def test_token_entry_defaults():
    entry = make_entry()
    assert entry.schema_version == 1 == TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    assert entry.model == ""
    assert entry.routed_experts is None
    assert entry.output_items == []
    assert entry.token_item_index is None
    assert entry.created_at == 0.0 and isinstance(entry.created_at, float)


def test_default_output_items_are_not_shared_between_entries():
    first, second = make_entry(), make_entry()
    first.output_items.append({"type": "message"})
    assert second.output_items == []


@pytest.mark.parametrize(
    "missing", ["rollout_id", "model_call_id", "prompt_token_ids", "generation_token_ids", "generation_log_probs"]
)
def test_required_fields_are_required(missing):
    values = record()
    del values[missing]
    with pytest.raises(pydantic.ValidationError) as info:
        TokenEntry.model_validate(values)
    assert missing in str(info.value)


def test_extra_fields_are_kept_and_round_trip_through_the_line():
    entry = make_entry(trace={"span": "abc", "depth": [1, 2]}, writer="other-writer/2.1")
    assert entry.model_dump()["trace"] == {"span": "abc", "depth": [1, 2]}
    line = entry_line(entry)
    assert b'"writer":"other-writer/2.1"' in line
    again = parse_entry(line)
    assert again == entry
    assert again.model_extra == {"trace": {"span": "abc", "depth": [1, 2]}, "writer": "other-writer/2.1"}
    assert entry_line(again) == line


def test_extra_fields_of_a_line_written_elsewhere_are_kept():
    line = json.dumps(record(future_field=[{"x": 1}])).encode()
    entry = parse_entry(line)
    assert entry.model_extra == {"future_field": [{"x": 1}]}
    assert json.loads(entry_line(entry))["future_field"] == [{"x": 1}]


def test_full_entry_round_trips_through_the_line():
    entry = make_entry(
        model="m",
        routed_experts=[[[1, 2], [3, 4]]],
        output_items=[{"type": "reasoning", "summary": []}, {"type": "message", "content": "hi"}],
        token_item_index=1,
        created_at=1234.5,
    )
    again = parse_entry(entry_line(entry))
    assert again == entry
    assert exact(again) == exact(entry)


@pytest.mark.parametrize("version", [2, 3, 100])
def test_newer_schema_version_is_refused(version):
    with pytest.raises(pydantic.ValidationError) as info:
        make_entry(schema_version=version)
    assert "up to 1" in str(info.value)


def test_newer_schema_version_line_is_refused_by_the_reader():
    line = json.dumps(record(schema_version=2)).encode()
    with pytest.raises(pydantic.ValidationError) as info:
        parse_entry(line)
    assert "up to 1" in str(info.value)


def test_older_schema_versions_are_read():
    assert make_entry(schema_version=0).schema_version == 0


@pytest.mark.parametrize("log_probs", [[-0.5], [-0.5, -0.25, -0.1], []])
def test_log_prob_count_must_match_generated_ids(log_probs):
    with pytest.raises(pydantic.ValidationError) as info:
        make_entry(generation_log_probs=log_probs)
    assert "same length" in str(info.value)
    with pytest.raises(pydantic.ValidationError) as info:
        parse_entry(json.dumps(record(generation_log_probs=log_probs)).encode())
    assert "same length" in str(info.value)


@pytest.mark.parametrize(
    ("items", "index"),
    [([], 0), ([{"type": "message"}], 1), ([{"type": "message"}], -1), ([{"a": 1}, {"b": 2}], 5), ([{"a": 1}], -2)],
)
def test_token_item_index_must_index_output_items(items, index):
    with pytest.raises(pydantic.ValidationError) as info:
        make_entry(output_items=items, token_item_index=index)
    assert "token_item_index" in str(info.value)
    with pytest.raises(pydantic.ValidationError):
        parse_entry(json.dumps(record(output_items=items, token_item_index=index)).encode())


def test_token_item_index_within_range_is_accepted():
    items = [{"type": "reasoning"}, {"type": "message"}]
    assert make_entry(output_items=items, token_item_index=0).token_item_index == 0
    assert make_entry(output_items=items, token_item_index=1).token_item_index == 1
    assert make_entry(output_items=items).token_item_index is None


# -- the JSONL line ---------------------------------------------------------------------------


def test_entry_line_is_compact_sorted_key_json_without_newline():
    entry = make_entry(model="m", output_items=[{"type": "message", "b": 1, "a": 2}], token_item_index=0)
    assert entry_line(entry) == (
        b'{"created_at":0.0,"generation_log_probs":[-0.5,-0.25],"generation_token_ids":[4,5],'
        b'"model":"m","model_call_id":"c1","output_items":[{"a":2,"b":1,"type":"message"}],'
        b'"prompt_token_ids":[1,2,3],"rollout_id":"r1","routed_experts":null,"schema_version":1,'
        b'"token_item_index":0}'
    )


def test_entry_line_round_trips_64_bit_extremes():
    entry = make_entry(prompt_token_ids=[2**64 - 1, -(2**63), 0], generation_token_ids=[2**63 - 1, 1])
    assert exact(parse_entry(entry_line(entry))) == exact(entry)


@pytest.mark.parametrize("field", ["prompt_token_ids", "generation_token_ids"])
@pytest.mark.parametrize("bad_id", [2**64, -(2**63) - 1, 10**30, -(10**30)])
def test_token_ids_outside_the_range_are_refused_in_every_path(bad_id, field):
    # Token ids are JSON integers in [-2^63, 2^64): int64 and uint64.
    overrides = {field: [1, bad_id]}
    if field == "generation_token_ids":
        overrides["generation_log_probs"] = [-0.5, -0.25]
    line = json.dumps(record(**overrides)).encode()
    for validate in (
        lambda: make_entry(**overrides),
        lambda: TokenEntry.model_validate(record(**overrides)),
        lambda: TokenEntry.model_validate_json(line),
        lambda: parse_record(line),
        lambda: parse_record(line, prompt_lists=False),
        lambda: parse_records(line + b"\n"),
    ):
        with pytest.raises(pydantic.ValidationError) as info:
            validate()
        [error] = info.value.errors()
        assert error["loc"] == (field, 1) and error["input"] == bad_id
        assert error["type"] == ("less_than" if bad_id > 0 else "greater_than_equal")


@pytest.mark.parametrize("edge_id", [2**64 - 1, -(2**63), 2**63, 2**63 - 1])
def test_token_ids_at_the_range_ends_are_kept_exactly(edge_id):
    entry = make_entry(prompt_token_ids=[edge_id, 1], generation_token_ids=[2, edge_id])
    assert entry.prompt_token_ids == [edge_id, 1] and entry.generation_token_ids == [2, edge_id]
    line = entry_line(entry)
    assert exact(parse_entry(line)) == exact(entry)
    [(read, arrays)] = parse_records(line)
    assert exact(read) == exact(entry)
    assert arrays.prompt.tolist() == [edge_id, 1] and arrays.generation.tolist() == [2, edge_id]


def test_entry_line_sorts_extra_keys_with_the_others():
    line = entry_line(make_entry(zeta=1, alpha=2))
    keys = [key for key, _ in json.loads(line, object_pairs_hook=list)]
    assert keys == sorted(keys)
    assert keys[0] == "alpha" and keys[-1] == "zeta"
    assert b"\n" not in line and b": " not in line and b", " not in line


# -- the fast reader agrees with plain pydantic validation ----------------------------------------

ODD_BUT_VALID = {
    "ids_as_strings": record(prompt_token_ids=["3", "4"], generation_token_ids=["5"], generation_log_probs=[-1.0]),
    "ids_as_whole_floats": record(prompt_token_ids=[1.0, 2.0], generation_token_ids=[3.0], generation_log_probs=[-1.0]),
    "ids_all_booleans": record(prompt_token_ids=[True, False]),
    "ids_booleans_among_ints": record(prompt_token_ids=[True, 2, 3]),
    "generation_booleans_among_ints": record(generation_token_ids=[False, 7]),
    "log_probs_as_ints": record(generation_log_probs=[-1, 0]),
    "log_probs_booleans_among_floats": record(generation_log_probs=[True, -0.5]),
    "log_probs_as_strings": record(generation_log_probs=["-0.5", "-1e-3"]),
    "empty_lists": record(prompt_token_ids=[], generation_token_ids=[], generation_log_probs=[]),
    "uint64_range_ids": record(prompt_token_ids=[2**63, 2**64 - 1]),
    "uint64_range_generated_ids": record(generation_token_ids=[2**64 - 1, 2**63]),
    "int64_range_ends": record(prompt_token_ids=[-(2**63), 2**63 - 1]),
    "huge_int_log_prob": record(generation_token_ids=[1], generation_log_probs=[2**70]),
    "negative_ids": record(prompt_token_ids=[-1, -2]),
}


@pytest.mark.parametrize("name", list(ODD_BUT_VALID))
def test_fast_reader_equals_plain_validation_for_odd_but_valid_records(name):
    line = json.dumps(ODD_BUT_VALID[name]).encode()
    expected = TokenEntry.model_validate(json.loads(line))
    [(entry, arrays)] = parse_records(line + b"\n")
    assert entry == expected
    assert exact(entry) == exact(expected)
    assert exact(parse_entry(line)) == exact(expected)
    assert arrays.prompt.tolist() == expected.prompt_token_ids
    assert arrays.generation.tolist() == expected.generation_token_ids
    assert arrays.log_probs.tolist() == expected.generation_log_probs


@pytest.mark.parametrize(
    "overrides",
    [
        dict(prompt_token_ids=[1, 1.5]),
        dict(generation_token_ids=[1.5, 2]),
        dict(prompt_token_ids=None),
        dict(generation_token_ids=None, generation_log_probs=None),
        dict(prompt_token_ids=[[1, 2], [3, 4]]),
        dict(generation_token_ids=[[4], [5]]),
        dict(generation_log_probs=[[-0.5], [-0.25]]),
        dict(prompt_token_ids=[1, None]),
        dict(prompt_token_ids=["x"]),
        dict(generation_log_probs=["nope", -0.1]),
        dict(prompt_token_ids={"0": 1}),
        dict(prompt_token_ids="123"),
        dict(rollout_id=None),
        dict(model_call_id=7),
        dict(prompt_token_ids=[1, 2**64]),
        dict(prompt_token_ids=[-(2**63) - 1, 1]),
        dict(generation_token_ids=[10**30, 5]),
        dict(prompt_token_ids=["18446744073709551616"]),
    ],
    ids=repr,
)
def test_fast_reader_raises_pydantics_error_for_invalid_records(overrides):
    line = json.dumps(record(**overrides)).encode()
    with pytest.raises(pydantic.ValidationError) as plain:
        TokenEntry.model_validate(json.loads(line))
    with pytest.raises(pydantic.ValidationError) as fast:
        parse_records(line)
    assert type(fast.value) is type(plain.value)
    assert [(e["type"], e["loc"]) for e in fast.value.errors()] == [(e["type"], e["loc"]) for e in plain.value.errors()]


def test_parse_records_reads_lines_in_file_order_and_skips_blank_lines():
    lines = [entry_line(make_entry(model_call_id=f"c{i}", created_at=float(10 - i))) for i in range(3)]
    data = b"\n" + lines[0] + b"\n\n  \n" + lines[1] + b"\n" + lines[2]
    assert [entry.model_call_id for entry, _ in parse_records(data)] == ["c0", "c1", "c2"]
    assert [entry.model_call_id for entry in parse_entries(data)] == ["c0", "c1", "c2"]


def test_parse_records_skips_whitespace_only_lines_of_any_length():
    # Blank is what bytes.strip() leaves nothing of, as in the store.
    lines = [entry_line(make_entry(model_call_id=f"c{i}")) for i in range(2)]
    for blank in (b" " * 100, b"\t\r\x0b\x0c " * 30, b"  \r"):
        data = blank + b"\n" + lines[0] + b"\n" + blank + b"\n" + lines[1] + b"\n" + blank
        assert [entry.model_call_id for entry, _ in parse_records(data)] == ["c0", "c1"]
        assert [entry.model_call_id for entry in parse_entries(data)] == ["c0", "c1"]
        assert list(iter_lines(np.frombuffer(data, dtype=np.uint8))) == lines


def test_parse_records_first_bad_line_raises():
    data = entry_line(make_entry()) + b"\n" + b'{"rollout_id": "r1"\n' + entry_line(make_entry(model_call_id="c2"))
    with pytest.raises(json.JSONDecodeError):
        parse_records(data)


def test_non_finite_log_probs_written_by_json_dumps_are_readable():
    line = json.dumps(
        record(generation_token_ids=[4, 5, 6], generation_log_probs=[float("nan"), float("-inf"), float("inf")])
    ).encode()
    assert b"NaN" in line and b"-Infinity" in line
    assert math.isnan(loads_line(line)["generation_log_probs"][0])
    [(entry, arrays)] = parse_records(line)
    nan, minus_inf, plus_inf = entry.generation_log_probs
    assert math.isnan(nan) and minus_inf == float("-inf") and plus_inf == float("inf")
    assert math.isnan(arrays.log_probs[0]) and arrays.log_probs[1] == float("-inf")


@pytest.mark.parametrize("bad", [b"{not json", b'{"a": 1', b"", b"[1, 2,]", b"NaNx"])
def test_loads_line_raises_json_decode_error(bad):
    with pytest.raises(json.JSONDecodeError):
        loads_line(bad)



# Lines each parser refuses in its own words; some only one of the two paths reads (NaN,
# integers beyond 64 bits, invalid UTF-8 inside a string, nesting past the depth limit).
CORRUPT_LINES = [
    b"{not json", b"garbage", b'{"a": 1', b"[1, 2,]", b"NaNx", b'{"a":1}x', '\u00fc{"\u00e9":1,x'.encode(),
    b'{"a":"\xc3"}', b"\xff\xfe", b"[" * 2000, b'{"id": 123456789012345678901234567890, x}', b'{"a": NaN, "b": }',
]


@pytest.mark.parametrize("bad", CORRUPT_LINES)
def test_a_corrupt_line_is_refused_in_orjsons_words_as_nemo_gyms_store_refuses_it(bad):
    """Gym's store parses capture lines with orjson, and records carry the error's text:
    raycap's error for the same line is the same JSONDecodeError, word for word."""
    with pytest.raises(orjson.JSONDecodeError) as gyms:
        orjson.loads(bad)
    with pytest.raises(json.JSONDecodeError) as mine:
        loads_line(bad)
    assert type(mine.value).__name__ == "JSONDecodeError" and str(mine.value) == str(gyms.value)
    # The same inside a capture, read line by line or the lines together.
    data = entry_line(make_entry()) + b"\n" + bad + b"\n" + entry_line(make_entry(model_call_id="c2"))
    for read in (parse_records, parse_entries):
        with pytest.raises(json.JSONDecodeError) as within:
            read(data)
        assert str(within.value) == str(gyms.value)

def test_loads_line_reads_memoryviews():
    line = b'xx{"a": [1, 2.5]}'
    assert loads_line(memoryview(line)[2:]) == {"a": [1, 2.5]}


# -- extracting token arrays from served responses ---------------------------------------------

TOKENS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}


def test_token_fields_lists_the_arrays_of_a_call():
    assert TOKEN_FIELDS == ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")


def test_extract_from_a_responses_payload():
    response = {
        "id": "resp-1",
        "output": [{"type": "reasoning", "summary": []}, {"type": "message", "content": [], **TOKENS}],
    }
    assert extract_token_fields(response) == {**TOKENS, "routed_experts": None}


def test_extract_carries_routed_experts_through():
    response = {"output": [{"type": "message", **TOKENS, "routed_experts": [[[0, 5]]]}]}
    assert extract_token_fields(response) == {**TOKENS, "routed_experts": [[[0, 5]]]}


def test_extract_from_a_chat_completions_payload():
    response = {
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi", **TOKENS}},
        ]
    }
    assert extract_token_fields(response) == {**TOKENS, "routed_experts": None}


def test_extract_from_the_one_carrying_choice():
    response = {"choices": [{"message": {"role": "assistant"}}, {"message": {"role": "assistant", **TOKENS}}]}
    assert extract_token_fields(response) == {**TOKENS, "routed_experts": None}


@pytest.mark.parametrize(
    "response",
    [
        {"output": []},
        {"output": [{"type": "message", "content": "hi"}]},
        {"output": [{"type": "message", "routed_experts": [[1]]}]},
        {"choices": []},
        {"choices": [{"message": {"role": "assistant", "content": "hi"}}]},
        {"id": "resp-without-output"},
    ],
    ids=repr,
)
def test_extract_is_none_when_no_item_carries_tokens(response):
    assert extract_token_fields(response) is None


@pytest.mark.parametrize(
    "response",
    [
        {"output": [{"type": "message", **TOKENS}, {"type": "function_call", **TOKENS}]},
        {"output": [{"type": "message", **TOKENS}, {"type": "function_call", "prompt_token_ids": [1]}]},
        {"choices": [{"message": TOKENS}, {"message": TOKENS}]},
    ],
)
def test_extract_refuses_more_than_one_carrier(response):
    with pytest.raises(ValueError):
        extract_token_fields(response)


@pytest.mark.parametrize("missing", ["prompt_token_ids", "generation_token_ids", "generation_log_probs"])
@pytest.mark.parametrize("shape", ["responses", "chat"])
def test_extract_refuses_a_carrier_missing_a_required_field(missing, shape):
    item = {key: value for key, value in TOKENS.items() if key != missing}
    response = {"output": [item]} if shape == "responses" else {"choices": [{"message": item}]}
    with pytest.raises(ValueError) as info:
        extract_token_fields(response)
    assert missing in str(info.value)
