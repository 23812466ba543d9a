"""Token capture records: one `TokenEntry` per model call of a rollout.

A record is the exact prompt ids, the sampled ids and their log probs of one call, plus
the call's Responses output items with the token arrays removed. Records are validated
with pydantic on every read: a record that fails validation is never skipped, because a
silently missing call would make a wrong trajectory look right.

Unknown fields are kept and round-trip, so records written by a newer writer of the same
schema version survive a rewrite. Records of a newer schema version are refused. Token ids
are JSON integers in [-2^63, 2^64), the range the reference reader parses as integers; an
id outside it fails validation on every path, never silently rounded or wrapped.

The JSONL line of a record is its JSON object with sorted keys; its sha256 digest (of
the line without the newline) identifies the payload of a model call in the store.

A served response becomes a record in three steps, as a model server takes it apart
(`raycap.capture.sink`): `extract_token_fields` finds the one item that carries the token
arrays, `response_to_output_items` lists the response's output items (a Chat Completions
message becomes one), and `strip_token_fields` removes the arrays from them and notes
which item carried them.
"""

from __future__ import annotations

import array
import hashlib
import json
from typing import Annotated, Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from raycap.capture.untrusted import MAX_JSON_DEPTH, UntrustedJSONError, bounded, has_big_int, nests_deeper

TOKEN_ENTRY_RECORD_SCHEMA_VERSION = 1

# The token arrays of a call. Output items are stored without them; projection puts them
# back on the carrier item.
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")
_REQUIRED_TOKEN_FIELDS = TOKEN_FIELDS[:3]

# int64 and uint64 together. Ids of 2^63 and more are valid records but do not fit the
# int64 Arrow columns; the rebuild masks their rollouts, saying so.
TokenId = Annotated[int, Field(ge=-(2**63), lt=2**64)]


class TokenEntry(BaseModel):
    """One model call of one rollout, exactly as the model server sampled it."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[TokenId]
    generation_token_ids: list[TokenId]
    generation_log_probs: list[float]
    routed_experts: Any = None
    output_items: list[dict] = []
    token_item_index: int | None = None
    created_at: float = 0.0

    @model_validator(mode="after")
    def _check_consistency(self) -> "TokenEntry":
        if self.schema_version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
            raise ValueError(
                f"token record schema_version {self.schema_version} is newer than this reader knows: "
                f"this reader understands up to {TOKEN_ENTRY_RECORD_SCHEMA_VERSION}; upgrade the reader to read it"
            )
        if len(self.generation_log_probs) != len(self.generation_token_ids):
            raise ValueError(
                "generation_log_probs and generation_token_ids must have the same length "
                f"(got {len(self.generation_log_probs)} and {len(self.generation_token_ids)})"
            )
        if self.token_item_index is not None and not 0 <= self.token_item_index < len(self.output_items):
            raise ValueError(
                f"token_item_index {self.token_item_index} does not index output_items "
                f"({len(self.output_items)} items)"
            )
        return self


def entry_line(entry: TokenEntry) -> bytes:
    """The JSONL line of a record (without newline): its compact JSON object with sorted keys."""
    payload = entry.model_dump()
    try:
        return orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        # orjson refuses integers beyond 64 bits; output items and unknown fields may hold
        # them, so write them exactly.
        return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def line_digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def loads_line(line: bytes) -> Any:
    """Parse one JSONL line.

    orjson is the fast path; lines it refuses but Python's json accepts (NaN or Infinity
    log probs written by `json.dumps`) are still read, so the two never disagree on what
    counts as a corrupt line. The error raised is `json.JSONDecodeError` in orjson's words,
    as NeMo Gym's store (which reads lines with orjson) says it of the same line.
    """
    return read_line(line)[0]


def read_line(line: bytes) -> tuple[Any, bool]:
    """`loads_line`, and whether orjson read the line: only then does `orjson.dumps`
    write the value back exactly (it writes NaN and Infinity as null and refuses
    integers beyond 64 bits and lone surrogates, which Python's json reads)."""
    data = bytes(line)
    if not has_big_int(data):
        try:
            return orjson.loads(data), True
        except orjson.JSONDecodeError as exc:
            if exc.msg.startswith("depth limit"):  # Python's json would only run out of stack
                raise json.JSONDecodeError(exc.msg, exc.doc, exc.pos) from None
    try:
        return _exact_loads(data), False
    except (json.JSONDecodeError, UnicodeDecodeError):
        try:
            orjson.loads(data)  # a corrupt line (invalid UTF-8 too) is said in orjson's words
        except orjson.JSONDecodeError as exc:
            raise json.JSONDecodeError(exc.msg, exc.doc, exc.pos) from None
        raise


def _too_deep() -> json.JSONDecodeError:
    return UntrustedJSONError(f"the line nests arrays or objects deeper than {MAX_JSON_DEPTH} levels")


def _exact_loads(line: Any) -> Any:
    """A line as Python's json reads it (the rare lines orjson cannot read exactly),
    bounded like orjson: JSONDecodeError, never RecursionError, for nesting deeper than
    MAX_JSON_DEPTH, and for an integer literal beyond Python's conversion limit."""
    data = bytes(line)
    if nests_deeper(data):
        raise _too_deep()
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise UntrustedJSONError(f"the line is not JSON raycap can read ({bounded(exc)})") from None


class CallArrays:
    """The token arrays of one call as numpy arrays, converted once per read."""

    __slots__ = ("prompt", "generation", "log_probs", "home")

    def __init__(self, prompt: np.ndarray, generation: np.ndarray, log_probs: np.ndarray, home: np.ndarray | None = None):
        self.prompt = prompt
        self.generation = generation
        self.log_probs = log_probs
        # The buffer whose first len(prompt) ids the prompt is (the capture reader's; see
        # _PromptTexts), or None: prompts with one home agree on their common length.
        self.home = home

    @classmethod
    def of(cls, entry: TokenEntry) -> "CallArrays":
        return cls(
            int_array(entry.prompt_token_ids),
            int_array(entry.generation_token_ids),
            np.array(entry.generation_log_probs, dtype=np.float64),
        )


def int_array(ids: list[int]) -> np.ndarray:
    try:
        return np.fromiter(ids, dtype=np.int64, count=len(ids))
    except OverflowError:
        # Ids in [2^63, 2^64) are nonsense for a tokenizer but valid records; keep them exact.
        return np.array(ids, dtype=object)


_NO_TOKENS: dict[str, list] = {"prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": []}


def _typed_list(values: Any, code: str) -> np.ndarray | None:
    """values as a typed array ("q": int64, "d": float64), or None when an element does
    not fit: array.array refuses floats among ints, strings, None and nested lists
    element by element, so an accepted id list is exactly one pydantic keeps unchanged
    as list[int], and an accepted log-prob list one it keeps as list[float]."""
    if type(values) is not list:
        return None
    try:
        return np.frombuffer(array.array(code, values), dtype=np.int64 if code == "q" else np.float64)
    except (TypeError, OverflowError):
        return None


def _int_list(values: Any) -> np.ndarray | None:
    return _typed_list(values, "q")


def _fast_parse(obj: Any, prompt: np.ndarray | None = None) -> tuple[TokenEntry, CallArrays] | None:
    """Validate a parsed record without making pydantic copy its token lists.

    The token lists are checked while they are copied into typed arrays instead: an id
    list that converts to int64 holds only ints inside the id range, which pydantic keeps
    with the same values (booleans count as 0 and 1 for both). Anything else (floats or
    strings among ids, ids beyond int64, length mismatches, a record pydantic rejects)
    returns None, and the caller validates the record the ordinary way, so the accepted
    records and the error texts are pydantic's own. `prompt` is the prompt ids when they
    were converted already (see _PromptTexts); the entry's prompt_token_ids is left to
    the caller.
    """
    if not isinstance(obj, dict):
        return None
    if prompt is None:
        prompt = _int_list(obj.get("prompt_token_ids"))
    generation = _int_list(obj.get("generation_token_ids"))
    log_probs = _typed_list(obj.get("generation_log_probs"), "d")
    if prompt is None or generation is None or log_probs is None or len(log_probs) != len(generation):
        return None
    try:
        entry = TokenEntry.model_validate({**obj, **_NO_TOKENS})
    except ValueError:
        return None
    # The short lists are rebuilt from the arrays, exactly as pydantic would coerce them.
    entry.generation_token_ids = generation.tolist()
    entry.generation_log_probs = log_probs.tolist()
    return entry, CallArrays(prompt, generation, log_probs)


def _parse_plain(line) -> tuple[TokenEntry, CallArrays]:
    """One line parsed whole: the reference path, and the one every odd line takes."""
    obj = loads_line(line)
    fast = _fast_parse(obj)
    if fast is not None:
        return fast
    # An odd line is validated as Python's json reads it. orjson reads integers outside
    # [-2^63, 2^64) as floats, and rounds -2^63 - 1 to the valid -2^63: validating its
    # object could accept an id the spec refuses, or name the wrong value in the error.
    entry = TokenEntry.model_validate(_exact_loads(line))
    return entry, CallArrays.of(entry)


def parse_record(line: bytes, *, prompt_lists: bool = True) -> tuple[TokenEntry, CallArrays]:
    """Parse and validate one JSONL line (JSONDecodeError / pydantic ValidationError);
    prompt_lists as for `parse_records`."""
    entry, arrays = _parse_plain(line)
    entry.prompt_token_ids = arrays.prompt.tolist() if prompt_lists else arrays.prompt
    return entry, arrays


# --- reading a capture's lines together -----------------------------------------------------
#
# A rollout's calls repeat each other's prompts: call k's prompt starts with call k-1's
# prompt, and the prompt ids are most of a capture's bytes. The JSON text of one prompt
# array therefore starts with the text of an earlier one, and the ids of that common text
# are already known. A line is read as its prompt array's text plus the rest of the line
# with the array cut out (a placeholder in its place); only the part of the prompt text
# no earlier line has is parsed. Reusing ids of identical bytes is exact, and the new
# text is parsed as JSON, so the result is the one a whole-line parse gives; any line
# that does not fit this shape is parsed whole.

_PROMPT_KEY = b'"prompt_token_ids"'
_LOG_PROBS_KEY = b'"generation_log_probs"'
_PLACEHOLDER = b'["\\u0000raycap"]'
_PLACEHOLDER_VALUE = ["\x00raycap"]
_JSON_SPACE = b" \t\r\n"
# What bytes.strip() removes: a line of only these is blank, for the store and every reader.
_BLANK_BYTES = frozenset(b" \t\n\r\x0b\x0c")
# A prompt of less text than this (about 500 ids) is parsed with its line: cutting it out
# and looking for a known prefix would cost more than parsing it.
PREFIX_MIN_BYTES = 2048


def _array_text_span(data: bytes, start: int, end: int, key: bytes) -> tuple[int, int] | None:
    """(first, last) of the top-level array of `key` (a quoted key) in the line
    data[start:end]: data[first] is its '[' and data[last] the first ']' after it; None
    when the line does not have that shape.

    The key is searched as a quoted string, which cannot occur inside another string
    (quotes there are escaped), and must occur once; whether it is the top-level key is
    checked by the caller (the placeholder must land there, or the parsed array must be
    a list of numbers, which holds no ']')."""
    at = data.find(key, start, end)
    if at <= start or data[at - 1] == 0x5C:
        return None
    position = at + len(key)
    while position < end and data[position] in _JSON_SPACE:
        position += 1
    if position >= end or data[position] != 0x3A:  # ':'
        return None
    position += 1
    while position < end and data[position] in _JSON_SPACE:
        position += 1
    if position >= end or data[position] != 0x5B:  # '['
        return None
    last = data.find(b"]", position, end)
    if last < 0 or data.find(key, last, end) >= 0:
        return None
    return position, last


def _same(data: bytes, view: memoryview, at: int, other: int, length: int) -> bool:
    """Whether data[at:at+length] equals data[other:other+length] (one memcmp, no copy)."""
    return data.startswith(view[other : other + length], at)


def _common_prefix(data: bytes, view: memoryview, at: int, other: int, length: int) -> int:
    """The length of the common prefix of data[at:at+length] and data[other:other+length]:
    equal chunks of doubling size, then halving, so no byte is copied or compared twice
    more than a few times."""
    done, step = 0, 4096
    while done < length:
        size = min(step, length - done)
        if _same(data, view, at + done, other + done, size):
            done += size
            step *= 2
            continue
        while size > 1:  # the first difference is within [done, done + size)
            half = size // 2
            if _same(data, view, at + done, other + done, half):
                done += half
                size -= half
            else:
                size = half
        return done
    return done


class _PromptTexts:
    """The prompt id arrays of the latest lines of one capture, with where their JSON
    texts (from the '[' up to the closing ']', excluded) are in the capture's bytes."""

    KEEP = 8

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.view = memoryview(data)
        self.recent: list[tuple[int, int, np.ndarray]] = []
        self.buffer: np.ndarray | None = None  # the latest prompt's ids, then room to grow
        self.filled = 0

    def ids(self, start: int, end: int) -> np.ndarray | None:
        """The ids of the prompt array's text data[start:end], or None when it is not a
        JSON array of int64 ids (the caller then parses the line whole, which reports why)."""
        data = self.data
        known, at = self._longest_known(start, end)
        try:
            if known is None:
                ids = _int_list(orjson.loads(data[start : end + 1]))
                ids = None if ids is None else self._extend(ids[:0], ids)
            elif at < 0:
                ids = known  # the same text: the same ids
            else:
                rest = _int_list(orjson.loads(b"[" + data[at : end + 1]))
                # An empty rest would hide a trailing comma, which JSON refuses.
                ids = self._extend(known, rest) if rest is not None and len(rest) else None
        except orjson.JSONDecodeError:
            ids = None
        if ids is not None:
            ids.flags.writeable = False  # shared by the calls whose prompt texts are equal
            self.recent.append((start, end, ids))
            if len(self.recent) > self.KEEP:
                del self.recent[0]
        return ids

    def _extend(self, known: np.ndarray, rest: np.ndarray) -> np.ndarray:
        """known + rest, as a prefix view of a growing buffer. A call's prompt mostly
        extends the one before it: its new ids are written after those, in place, so
        reading a rollout costs its new ids rather than all of its prompts, and the
        builders see prompts that share memory (and their prefix hashes)."""
        size = len(known) + len(rest)
        buffer = self.buffer
        # Every array handed out is buffer[:n] (or a slice from its start), so `known` is
        # the whole filled part exactly when it is a view of this buffer that long.
        appendable = buffer is not None and known.base is buffer and len(known) == self.filled
        if not appendable or size > len(buffer):
            grown = np.empty(max(2 * size, 1024), dtype=np.int64)
            grown[: len(known)] = known
            buffer = self.buffer = grown
        buffer[len(known) : size] = rest
        self.filled = size
        return buffer[:size]

    def _longest_known(self, start: int, end: int) -> tuple[np.ndarray | None, int]:
        """The ids of the longest run of whole elements the text shares with a recent
        prompt, and the position in data where the rest begins (after the separating
        comma; -1 when the text equals a recent text)."""
        data, view = self.data, self.view
        length = end - start
        best, best_at = None, start
        for earlier_start, earlier_end, ids in reversed(self.recent):
            if not len(ids):
                continue
            earlier = earlier_end - earlier_start
            if earlier <= length and _same(data, view, start, earlier_start, earlier):
                if earlier == length:
                    return ids, -1
                if data[start + earlier] == 0x2C:  # ',': every earlier element is shared
                    return ids, start + earlier + 1
            shared = _common_prefix(data, view, start, earlier_start, min(length, earlier))
            comma = data.rfind(b",", start, start + shared)
            if comma + 1 > best_at:
                best, best_at = ids[: data.count(b",", start, comma) + 1], comma + 1
        return best, best_at


def _exact_read(rest: bytes) -> bool:
    """Whether orjson reads every number of a line (its prompt array cut out) exactly:
    no integer literal of 19 or more digits (see has_big_int). The log-prob array, most
    of the bytes, is left out of the scan: its values are checked once parsed (a literal
    beyond 64 bits becomes a float of at least 2^63 in magnitude)."""
    span = _array_text_span(rest, 0, len(rest), _LOG_PROBS_KEY)
    if span is None:
        return not has_big_int(rest)
    first, last = span
    return not has_big_int(rest[:first] + rest[last:])


_HUGE = float(2**63)


def _exact_floats(log_probs: np.ndarray) -> bool:
    """Whether no parsed log prob may stand for an integer orjson could not read."""
    return not len(log_probs) or float(np.abs(log_probs).max()) < _HUGE


def _parse_in_capture(data: bytes, start: int, end: int, prompts: _PromptTexts) -> tuple[TokenEntry, CallArrays]:
    span = _array_text_span(data, start, end, _PROMPT_KEY) if end - start >= PREFIX_MIN_BYTES else None
    if span is not None and span[1] - span[0] >= PREFIX_MIN_BYTES:
        first, last = span
        rest = data[start:first] + _PLACEHOLDER + data[last + 1 : end]
        try:
            obj = orjson.loads(rest) if _exact_read(rest) else None
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and obj.get("prompt_token_ids") == _PLACEHOLDER_VALUE:
            prompt = prompts.ids(first, last)
            if prompt is not None:
                fast = _fast_parse(obj, prompt)
                if fast is not None and _exact_floats(fast[1].log_probs):
                    fast[1].home = prompt.base
                    return fast
    return _parse_plain(data[start:end])


def parse_entry(line: bytes) -> TokenEntry:
    return parse_record(line)[0]


def _line_spans(data) -> list[tuple[int, int]]:
    """(start, end) of the non-blank lines of JSONL bytes or a uint8 buffer."""
    if isinstance(data, bytes):
        ends, position = [], data.find(b"\n")
        while position >= 0:
            ends.append(position)
            position = data.find(b"\n", position + 1)
    else:
        ends = np.flatnonzero(data == 10).tolist()
    if not ends or ends[-1] != len(data) - 1:
        ends.append(len(data))
    spans, start = [], 0
    for end in ends:
        # Blank means bytes.strip() leaves nothing, at any length. A record line starts
        # with '{', so its first byte decides without a copy.
        if start < end and (data[start] not in _BLANK_BYTES or _has_content(data, start, end)):
            spans.append((start, end))
        start = end + 1
    return spans


def _has_content(data, start: int, end: int) -> bool:
    """Whether bytes.strip() leaves anything of data[start:end]. A line indented by a few
    spaces is decided by its first 64 bytes; only a longer blank run is copied whole."""
    head = min(end, start + 64)
    return bool(bytes(data[start:head]).strip() or bytes(data[head:end]).strip())


def _as_buffer(data) -> bytes | np.ndarray:
    if isinstance(data, (bytes, np.ndarray)):
        return data
    return np.frombuffer(data, dtype=np.uint8)


def iter_lines(data):
    """The non-blank lines of JSONL bytes (or a uint8 buffer), without their newlines."""
    buffer = _as_buffer(data)
    return (bytes(buffer[start:end]) for start, end in _line_spans(buffer))


def parse_records(data, *, prompt_lists: bool = True) -> list[tuple[TokenEntry, CallArrays]]:
    """All records of JSONL bytes (or a uint8 buffer, e.g. zero-copy from Ray's object
    store) with their arrays, in file order; the first bad line raises.

    With prompt_lists=False the entries' prompt_token_ids hold the prompt ids as the
    same int64 array as the record's CallArrays instead of a list: builders read the
    arrays, and a list of every prompt id costs about as much as the parse itself."""
    return parse_lines(data, prompt_lists=prompt_lists)[1]


def parse_lines(data, *, prompt_lists: bool = True) -> tuple[list[tuple[int, int]], list[tuple[TokenEntry, CallArrays]]]:
    """`parse_records`, and the (start, end) of each record's line in `data` (end is its
    newline, or the end of `data` for a last line without one)."""
    buffer = _as_buffer(data)
    if not isinstance(buffer, bytes):
        buffer = buffer.tobytes()
    prompts = _PromptTexts(buffer)
    spans = _line_spans(buffer)
    records = []
    for start, end in spans:
        entry, arrays = _parse_in_capture(buffer, start, end, prompts)
        entry.prompt_token_ids = arrays.prompt.tolist() if prompt_lists else arrays.prompt
        records.append((entry, arrays))
    return spans, records


def parse_entries(data) -> list[TokenEntry]:
    """All records of a JSONL byte string, in file order; the first bad line raises."""
    return [entry for entry, _ in parse_records(data)]


def _as_dict(obj: Any) -> Any:
    return obj.model_dump() if hasattr(obj, "model_dump") else obj


def extract_token_fields(response_json: Any) -> dict | None:
    """Pull the token arrays out of a served response.

    Responses payloads carry them on one item of `output`; Chat Completions payloads on
    one `choices[*].message`. Returns the `TOKEN_FIELDS` (routed_experts None when
    absent), or None when no item has any of the required token fields (a null value
    counts as absent). More than one token-bearing item ("multiple response items"), or
    a carrier missing one of the required fields, is a ValueError: guessing which item
    was sampled would attach the wrong tokens to the call.
    """
    response = _as_dict(response_json)
    if not isinstance(response, dict):
        raise ValueError(f"expected a response object, got {type(response).__name__}")
    if isinstance(response.get("output"), list):
        items = [_as_dict(item) for item in response["output"]]
    elif isinstance(response.get("choices"), list):
        items = [_as_dict(_as_dict(choice).get("message")) for choice in response["choices"]]
    else:
        items = []
    carriers = [
        item
        for item in items
        if isinstance(item, dict) and any(item.get(f) is not None for f in _REQUIRED_TOKEN_FIELDS)
    ]
    if not carriers:
        return None
    if len(carriers) > 1:
        raise ValueError(
            f"multiple response items carry token ids ({len(carriers)}); exactly one item may carry them"
        )
    carrier = carriers[0]
    missing = [f for f in _REQUIRED_TOKEN_FIELDS if carrier.get(f) is None]
    if missing:
        raise ValueError(f"token-carrying item is missing {', '.join(missing)}")
    return {field: carrier.get(field) for field in TOKEN_FIELDS}


def response_to_output_items(payload: dict) -> list[dict]:
    """The output items of a served response, as a record keeps them.

    A Responses payload's non-empty `output` gives its dict items; otherwise each dict
    `choices[*].message` of a Chat Completions payload becomes one item (a copy, with
    `type` "message" and `role` "assistant" unless it says otherwise)."""
    output = payload.get("output")
    if isinstance(output, list) and output:
        return [item for item in output if isinstance(item, dict)]
    choices = payload.get("choices")
    items = []
    for choice in choices if isinstance(choices, list) else ():
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict):
            item = dict(message)
            item.setdefault("type", "message")
            item.setdefault("role", "assistant")
            items.append(item)
    return items


def strip_token_fields(items: list[dict]) -> tuple[list[dict], int | None]:
    """Copies of the items without the `TOKEN_FIELDS`, and the index of the item that
    carried `generation_token_ids` (None when none did): a record stores its arrays once,
    and projection puts them back on that item. Several carriers are a ValueError."""
    stripped, index = [], None
    for position, item in enumerate(items):
        if item.get("generation_token_ids") is not None:
            if index is not None:
                raise ValueError(
                    f"multiple output items carry token metadata (items {index} and {position}); "
                    "exactly one item may carry a call's token ids"
                )
            index = position
        stripped.append({key: value for key, value in item.items() if key not in TOKEN_FIELDS})
    return stripped, index
