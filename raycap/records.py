"""Token capture records: one `TokenEntry` per model call of a rollout.

A record is the exact prompt ids, the sampled ids and their log probs of one call, plus
the call's Responses output items with the token arrays removed. Records are validated
with pydantic on every read: a record that fails validation is never skipped, because a
silently missing call would make a wrong trajectory look right.

Unknown fields are kept and round-trip, so records written by a newer writer of the same
schema version survive a rewrite. Records of a newer schema version are refused.

The JSONL line of a record is its JSON object with sorted keys; its sha256 digest (of
the line without the newline) identifies the payload of a model call in the store.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, model_validator

TOKEN_ENTRY_RECORD_SCHEMA_VERSION = 1

# The token arrays of a call. Output items are stored without them; projection puts them
# back on the carrier item.
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")
_REQUIRED_TOKEN_FIELDS = TOKEN_FIELDS[:3]


class TokenEntry(BaseModel):
    """One model call of one rollout, exactly as the model server sampled it."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any = None
    output_items: list[dict] = []
    token_item_index: int | None = None
    created_at: float = 0.0

    @model_validator(mode="after")
    def _check_consistency(self) -> "TokenEntry":
        if self.schema_version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
            raise ValueError(
                f"token record schema_version {self.schema_version} is newer than this reader "
                f"understands (up to {TOKEN_ENTRY_RECORD_SCHEMA_VERSION}); upgrade raycap to read it"
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
    """The JSONL line of a record (without newline): its JSON object with sorted keys."""
    return json.dumps(entry.model_dump(), sort_keys=True).encode()


def line_digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def loads_line(line: bytes) -> Any:
    """Parse one JSONL line.

    orjson is the fast path; lines it refuses but Python's json accepts (NaN or Infinity
    log probs written by `json.dumps`) are still read, so the two never disagree on what
    counts as a corrupt line. The error raised is `json.JSONDecodeError`.
    """
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


def parse_entry(line: bytes) -> TokenEntry:
    """Parse and validate one JSONL line into a record (JSONDecodeError / ValidationError)."""
    return TokenEntry.model_validate(loads_line(line))


def iter_lines(data: bytes):
    """The non-empty lines of a JSONL byte string, without their newlines."""
    for line in data.split(b"\n"):
        if line.strip():
            yield line


def parse_entries(data: bytes) -> list[TokenEntry]:
    """All records of a JSONL byte string, in file order; the first bad line raises."""
    return [parse_entry(line) for line in iter_lines(data)]


def _as_dict(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return obj


def extract_token_fields(response: Any) -> dict | None:
    """Pull the token arrays out of a served response.

    Responses payloads carry them on one item of `output`; Chat Completions payloads on
    one `choices[*].message`. Returns the `TOKEN_FIELDS` (routed_experts None when
    absent), or None when no item has any of the required token fields. More than one
    token-bearing item, or a carrier missing one of the required fields, is a ValueError:
    guessing which item was sampled would attach the wrong tokens to the call.
    """
    response = _as_dict(response)
    if not isinstance(response, dict):
        raise ValueError(f"expected a response object, got {type(response).__name__}")
    if isinstance(response.get("output"), list):
        items = [_as_dict(item) for item in response["output"]]
    elif isinstance(response.get("choices"), list):
        items = [_as_dict(_as_dict(choice).get("message")) for choice in response["choices"]]
    else:
        items = []
    carriers = [
        item for item in items if isinstance(item, dict) and any(f in item for f in _REQUIRED_TOKEN_FIELDS)
    ]
    if not carriers:
        return None
    if len(carriers) > 1:
        raise ValueError(
            f"response has {len(carriers)} items carrying token ids; exactly one item may carry them"
        )
    carrier = carriers[0]
    missing = [f for f in _REQUIRED_TOKEN_FIELDS if f not in carrier]
    if missing:
        raise ValueError(f"token-carrying item is missing {', '.join(missing)}")
    return {field: carrier.get(field) for field in TOKEN_FIELDS}
