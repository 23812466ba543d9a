"""Reading a capture's lines together (raycap.capture.records.parse_records): the prompt ids a
line shares with an earlier line are reused from it, and only the new text is parsed
(a prompt shorter than PREFIX_MIN_BYTES of text is parsed whole: every test runs both ways).

Whatever the lines look like, the result must be the one each line parsed whole gives
(`parse_record`): the same entries, the same arrays, or the same error for the first
bad line."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raycap.capture.records
from raycap.capture.records import TokenEntry, iter_lines, parse_record, parse_records
from strategies import examples


@pytest.fixture(autouse=True, params=["every line", "long prompts"])
def prefix_min_bytes(request, monkeypatch):
    """Each test twice: with every line read together (the lines here are short, and
    short prompts are otherwise parsed whole, PREFIX_MIN_BYTES), and with the default."""
    if request.param == "every line":
        monkeypatch.setattr(raycap.capture.records, "PREFIX_MIN_BYTES", 0)
    return raycap.capture.records.PREFIX_MIN_BYTES


def record(prompt, index=0, generation=None, **extra) -> dict:
    generation = [7 + index, 8] if generation is None else generation
    return {
        "rollout_id": "r1",
        "model_call_id": f"c{index}",
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [(-0.5, -1.25e-7)[k % 2] for k in range(len(generation))],
        **extra,
    }


def render(obj: dict, style: str) -> bytes:
    if style == "compact":
        try:
            return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # orjson refuses integers beyond 64 bits
            return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    if style == "spaced":
        return json.dumps(obj, sort_keys=True).encode()
    raise AssertionError(style)


def outcome(data: bytes, reader) -> tuple:
    """("ok", entries as exact JSON, arrays) or ("error", type, text)."""
    try:
        records = reader(data)
    except Exception as exc:  # noqa: BLE001 - the error itself is compared
        return ("error", type(exc).__name__, str(exc))
    return (
        "ok",
        [json.dumps(entry.model_dump(), sort_keys=True) for entry, _ in records],
        [
            (a.prompt.dtype.str, a.prompt.tolist(), a.generation.tolist(), a.log_probs.tolist())
            for _, a in records
        ],
    )


def line_by_line(data: bytes):
    return [parse_record(line) for line in iter_lines(data)]


def assert_same_as_line_by_line(data: bytes) -> tuple:
    together = outcome(data, parse_records)
    assert together == outcome(data, line_by_line)
    return together


# -- shapes of prompt texts -----------------------------------------------------------------


def test_a_growing_conversation_reuses_the_earlier_prompt_ids():
    prompts = [[1, 2, 3], [1, 2, 3, 9, 10], [1, 2, 3, 9, 10, 11, 12, 13]]
    data = b"\n".join(render(record(p, i), "compact") for i, p in enumerate(prompts))
    result = assert_same_as_line_by_line(data)
    assert [arrays[1] for arrays in result[2]] == prompts


@pytest.mark.parametrize("style", ["compact", "spaced"])
def test_branches_retries_and_unrelated_prompts(style):
    prompts = [
        [5, 6, 7, 8],
        [5, 6, 7, 8, 20, 21],  # continues the first
        [5, 6, 7, 8],  # a retry of the first: the same text
        [5, 6, 70, 8],  # branches inside an element's digits
        [5, 6, 7],  # a prefix of the first, ending inside its elements
        [],  # empty
        [5, 6, 7, 81, 82],  # the last element of [5, 6, 7, 8] extended by digits
        [900, 1],  # nothing shared
        [5, 6, 7, 8, 20, 21, 22],
    ]
    data = b"\n".join(render(record(p, i), style) for i, p in enumerate(prompts))
    result = assert_same_as_line_by_line(data)
    assert [arrays[1] for arrays in result[2]] == prompts


@pytest.mark.parametrize(
    "bad_text",
    [
        b"[1,2,3,]",  # a trailing comma after the earlier prompt's elements
        b"[1,2,3, ]",
        b"[1,2,3,,4]",
        b"[1,2,3,04]",  # a leading zero
        b"[1,2,3,4",  # unterminated
        b"[1,2,3,4.5]",  # a float id (pydantic refuses a fractional one)
        b'[1,2,3,"four"]',
        b"[1,2,3,null]",
    ],
)
def test_bad_new_text_after_a_shared_prefix_fails_like_a_whole_line_parse(bad_text):
    good = render(record([1, 2, 3], 0), "compact")
    template = render(record([424242], 1), "compact")
    bad = template.replace(b"[424242]", bad_text)
    together = assert_same_as_line_by_line(good + b"\n" + bad)
    assert together[0] == "error"


@pytest.mark.parametrize(
    "odd_text, expected",
    [
        (b"[1,2,3,1e2]", [1, 2, 3, 100]),  # an integral float: pydantic coerces it
        (b"[1,2,3,true]", [1, 2, 3, 1]),
        (b'[1,2,3,"4"]', [1, 2, 3, 4]),  # a numeric string: pydantic coerces it too
        (b"[1,2,3,-0]", [1, 2, 3, 0]),
        (b"[1,2,3,9223372036854775808]", [1, 2, 3, 2**63]),  # beyond int64: kept exact
        (b"[1 ,2,3 , 4 ]", [1, 2, 3, 4]),
    ],
)
def test_odd_but_valid_new_text_reads_like_a_whole_line_parse(odd_text, expected):
    good = render(record([1, 2, 3], 0), "compact")
    odd = render(record([424242], 1), "compact").replace(b"[424242]", odd_text)
    together = assert_same_as_line_by_line(good + b"\n" + odd)
    assert together[0] == "ok"
    assert together[2][1][1] == expected


def test_the_key_inside_a_nested_item_or_a_string_is_not_taken_for_the_prompt():
    nested = {"type": "message", "prompt_token_ids": [1, 2, 3, 99], "text": '"prompt_token_ids":[1,2]'}
    lines = [
        render(record([1, 2, 3], 0), "compact"),
        render(record([1, 2, 3, 4], 1, output_items=[nested]), "compact"),
        render(record([1, 2, 3, 4, 5], 2, output_items=[{"text": 'say "prompt_token_ids": [1]'}]), "compact"),
        # the nested key before the top-level one, with a different spacing
        json.dumps({"a": {"prompt_token_ids": [1, 2, 3, 7]}, **record([1, 2, 3, 4, 5, 6], 3)}).encode(),
    ]
    result = assert_same_as_line_by_line(b"\n".join(lines))
    assert [arrays[1] for arrays in result[2]] == [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]


def test_a_prompt_that_is_not_an_array_fails_like_a_whole_line_parse():
    lines = [render(record([1, 2, 3], 0), "compact"), render(record("1,2,3", 1), "compact")]
    assert assert_same_as_line_by_line(b"\n".join(lines))[0] == "error"


def test_reused_prompt_arrays_are_read_only_and_entries_can_hold_lists_or_arrays(prefix_min_bytes):
    if prefix_min_bytes:
        pytest.skip("these short prompts are parsed whole: no array is shared")
    data = b"\n".join(render(record(p, i), "compact") for i, p in enumerate([[1, 2], [1, 2], [1, 2, 3]]))
    with_lists = parse_records(data)
    with_arrays = parse_records(data, prompt_lists=False)
    assert [e.prompt_token_ids for e, _ in with_lists] == [[1, 2], [1, 2], [1, 2, 3]]
    assert all(type(e.prompt_token_ids) is list for e, _ in with_lists)
    assert all(e.prompt_token_ids is a.prompt for e, a in with_arrays)
    assert not with_arrays[0][1].prompt.flags.writeable


# -- whitespace-only lines and the token id range ---------------------------------------------

# What bytes.strip() removes: the store's definition of a blank line, and every reader's.
WHITESPACE = b" \t\n\r\x0b\x0c"


@pytest.mark.parametrize(
    "blank",
    [b" " * 100, b" \t\r\x0b\x0c" * 20, b"\x0c" * 64, b" " * 63 + b"\r"],
    ids=["100 spaces", "mixed", "64 form feeds", "63 spaces and a CR"],
)
def test_a_whitespace_only_line_of_any_length_between_records_is_skipped(blank):
    first, second = render(record([1, 2], 0), "compact"), render(record([1, 2, 3], 1), "spaced")
    data = first + b"\n" + blank + b"\n" + second + b"\n" + blank
    assert list(iter_lines(data)) == [first, second]
    result = assert_same_as_line_by_line(data)
    assert [arrays[1] for arrays in result[2]] == [[1, 2], [1, 2, 3]]


OUT_OF_RANGE_IDS = [2**64, -(2**63) - 1, 10**30, -(10**30), 2**64 + 5]
RANGE_ENDS = [-(2**63), 2**63 - 1, 2**63, 2**64 - 1]


def errors(exc: pydantic.ValidationError) -> list:
    return [(e["type"], e["loc"], e["input"]) for e in exc.errors()]


@pytest.mark.parametrize("style", ["compact", "spaced"])
@pytest.mark.parametrize("field", ["prompt", "generation"])
@pytest.mark.parametrize("bad_id", OUT_OF_RANGE_IDS)
def test_an_id_outside_the_token_range_fails_validation_in_every_reader(bad_id, field, style):
    good = render(record([1, 2, 3], 0), style)
    if field == "prompt":  # after a line it shares the prompt text with, and alone
        bad = render(record([1, 2, 3, bad_id], 1), style)
    else:
        bad = render(record([1, 2, 3], 1, generation=[bad_id, 5]), style)
    with pytest.raises(pydantic.ValidationError) as plain:
        TokenEntry.model_validate(json.loads(bad))
    where = (f"{field}_token_ids", 3 if field == "prompt" else 0)
    assert errors(plain.value) == [("less_than" if bad_id > 0 else "greater_than_equal", where, bad_id)]
    for data in (good + b"\n" + bad + b"\n", bad):
        with pytest.raises(pydantic.ValidationError) as together:
            parse_records(data)
        assert errors(together.value) == errors(plain.value)
        assert str(together.value) == str(plain.value)
    with pytest.raises(pydantic.ValidationError) as whole:
        parse_record(bad)
    assert str(whole.value) == str(plain.value)
    assert_same_as_line_by_line(good + b"\n" + bad)


@pytest.mark.parametrize("style", ["compact", "spaced"])
@pytest.mark.parametrize("edge_id", RANGE_ENDS)
def test_ids_at_the_ends_of_the_token_range_are_kept_exactly(edge_id, style):
    lines = [
        render(record([1, 2, 3], 0), style),
        render(record([1, 2, 3, edge_id], 1), style),
        render(record([edge_id], 2, generation=[edge_id, 5]), style),
    ]
    result = assert_same_as_line_by_line(b"\n".join(lines))
    assert result[0] == "ok"
    assert [arrays[1] for arrays in result[2]] == [[1, 2, 3], [1, 2, 3, edge_id], [edge_id]]
    assert result[2][2][2] == [edge_id, 5]
    assert [json.loads(entry)["prompt_token_ids"] for entry in result[1]] == [arrays[1] for arrays in result[2]]


# -- random captures ------------------------------------------------------------------------

_ids = st.integers(min_value=0, max_value=151_935)
_BAD_ELEMENTS = [b"", b"01", b"1.5", b"1e2", b"true", b'"7"', b"null", b"9223372036854775808", b" 5 ", b"-3", b"[1]"]
# Both ends of the token id range and the first integers beyond them.
_EDGE_IDS = [-(2**63), -(2**63) - 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64]
_blanks = st.one_of(
    st.lists(st.sampled_from(WHITESPACE), max_size=300).map(bytes),
    st.builds(lambda char, n: bytes([char]) * n, st.sampled_from(WHITESPACE), st.integers(0, 300)),
)


def _with_edge_ids(draw, ids: list) -> list:
    ids = list(ids)
    for _ in range(draw(st.integers(0, 2))):
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(_EDGE_IDS)))
    return ids


@st.composite
def captures(draw):
    edges = draw(st.booleans())  # whether some ids are at or beyond the ends of the range

    def new_ids(ids: list) -> list:
        return _with_edge_ids(draw, ids) if edges and draw(st.booleans()) else ids

    prompts = [new_ids(draw(st.lists(_ids, max_size=12)))]
    for _ in range(draw(st.integers(0, 11))):  # more lines than _PromptTexts keeps
        base = draw(st.sampled_from(prompts))  # (perhaps one holding an edge id)
        keep = draw(st.integers(0, len(base)))
        prompts.append(base[:keep] + new_ids(draw(st.lists(_ids, max_size=6))))
    lines = []
    for i, prompt in enumerate(prompts):
        generation = new_ids([7 + i, 8])
        line = render(record(prompt, i, generation), draw(st.sampled_from(["compact", "spaced"])))
        lines.append(line)
    if draw(st.booleans()):
        # Spoil one element of one prompt text (some spoilings are still valid JSON).
        i = draw(st.integers(0, len(lines) - 1))
        start = lines[i].index(b"[", lines[i].index(b'"prompt_token_ids"'))
        end = lines[i].index(b"]", start)
        elements = lines[i][start + 1 : end].split(b",") if end > start + 1 else []
        at = draw(st.one_of(st.just(len(elements)), st.integers(0, len(elements))))
        elements.insert(at, draw(st.sampled_from(_BAD_ELEMENTS)))
        lines[i] = lines[i][: start + 1] + b",".join(elements) + lines[i][end:]
    for _ in range(draw(st.integers(0, 3))):  # whitespace-only lines anywhere
        lines.insert(draw(st.integers(0, len(lines))), draw(_blanks))
    data = b"\n".join(lines)
    if draw(st.booleans()):
        data += b"\n" + draw(_blanks)  # a blank tail
    return data + draw(st.sampled_from([b"\n", b""]))


def plain_outcome(data: bytes) -> tuple:
    """The spec's words: each line that bytes.strip() leaves something of is one record,
    read by Python's json and validated by pydantic."""
    try:
        entries = [TokenEntry.model_validate(json.loads(line)) for line in data.split(b"\n") if line.strip()]
    except json.JSONDecodeError:
        return ("error", "JSONDecodeError")
    except pydantic.ValidationError as exc:
        return ("error", "ValidationError", str(exc))
    return ("ok", entries)


@pytest.mark.slow
@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(captures())
def test_random_captures_read_together_equal_each_line_read_whole(data):
    assert list(iter_lines(data)) == [line for line in data.split(b"\n") if line.strip()]
    together = assert_same_as_line_by_line(data)
    plain = plain_outcome(data)
    if together[0] == "error":
        # the same verdict as plain validation (JSON error texts are the parser's own)
        assert together[1:] == plain[1:] or together[1] == plain[1] == "JSONDecodeError"
    else:
        # and whole-line reading equals plain pydantic validation of each line
        assert plain[0] == "ok"
        expected = plain[1]
        assert together[1] == [json.dumps(e.model_dump(), sort_keys=True) for e in expected]
        assert all(np.array_equal(np.array(e.prompt_token_ids, dtype=object), np.array(a[1], dtype=object)) for e, a in zip(expected, together[2]))
        # and every id read is inside the token id range
        assert all(-(2**63) <= i < 2**64 for a in together[2] for i in a[1] + a[2])


@pytest.mark.parametrize("style", ["compact", "spaced"])
def test_integers_beyond_64_bits_outside_the_token_arrays_are_read_exactly(style):
    """orjson reads such an integer as a float; the record holds the exact value."""
    items = [{"type": "function_call", "arguments": {"n": 2**70, "m": -(2**70) - 3, "f": 1.5e30, "s": "1" * 25}}]
    first = record([5, 6, 7], 0, output_items=items, token_item_index=None)
    second = record([5, 6, 7, 7, 8, 9], 1, routed_experts=[[2**65, 1]], extra_field=-(2**80))
    data = render(first, style) + b"\n" + render(second, style) + b"\n"
    entries = [entry for entry, _ in parse_records(data)]
    assert entries[0].output_items == items
    assert entries[1].routed_experts == [[2**65, 1]]
    assert entries[1].model_extra["extra_field"] == -(2**80)
    assert outcome(data, parse_records) == outcome(data, line_by_line)


def test_integers_beyond_64_bits_next_to_the_log_probs_are_read_exactly():
    """The big-int scan leaves out the top-level log-prob array (its values are checked
    once parsed); an inline carrier's own log-prob key must not hide a big int."""
    big = 2**64 + 1
    inline = record([1, 2], 0)
    inline["output_items"] = [{"type": "message", "generation_log_probs": [big], "id": big}]
    beyond = record([1, 2, 3], 1)
    beyond["generation_log_probs"] = [-(2**63) - 1] * len(beyond["generation_token_ids"])
    nested = record([1, 2, 3, 4], 2)
    nested["extra"] = {"deep": [[{"n": -(2**70)}]]}
    for obj in (inline, beyond, nested):
        for style in ("compact", "spaced"):
            together = assert_same_as_line_by_line(render(obj, style))
            assert together[0] in ("ok", "error")
    result = assert_same_as_line_by_line(render(inline, "compact"))
    assert result[0] == "ok" and str(big) in result[1][0]
