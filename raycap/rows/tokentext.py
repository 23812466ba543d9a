"""A rebuilt response's output items with their token arrays as JSON text, made from the arrays.

Each output item of a rebuilt response carries its call's prompt token ids (every id of
the chain before the call's generation), its generated ids and their log probs
(`raycap.capture.builder.projection_items`). Over a long agentic rollout the prompts repeat the
chain's prefix once per call: forty calls over prompts growing to ten thousand tokens
are some 300,000 ids, which as Python lists cost an int object each before orjson
writes them back out, several times the cost of building the rollout.

`projection_text_items` gives the same items, key for key, with each of the three
arrays as an `orjson.Fragment` holding the text orjson writes for its list, so that
`orjson.dumps` of a record holding them gives the same bytes as of the record holding
the lists. The chain's ids are written once per rollout (orjson's numpy serialisation
writes an int64 as it writes a Python int), and each call's prompt and generation are
slices of that text; log probs are written per call (float64, which orjson writes as it
writes a Python float). Arrays of other types are written from their lists.

Only orjson reads fragments: a record to be written by Python's json (`raycap.finalize.results.
dumps_record` with exact=False: log probs that are not finite, values orjson would not
write back exactly) must get `projection_items`' lists instead.

This module does not import Ray.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from raycap.capture.projection import place_call_fields

_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_COMMA = 44
# orjson.Fragment came with orjson 3.9.6; without it the items keep their lists.
Fragment: Any = getattr(orjson, "Fragment", None)


def array_text(values: np.ndarray) -> bytes:
    """The JSON text orjson writes for `values.tolist()`, made without the list where
    the type allows (int64 and float64, as orjson writes Python's ints and floats)."""
    if values.dtype == np.int64 or values.dtype == np.float64:
        return orjson.dumps(np.ascontiguousarray(values), option=_NUMPY)
    return orjson.dumps(values.tolist())


class _IdsText:
    """The text of one id array, and where each element ends in it, to slice from."""

    def __init__(self, ids: np.ndarray):
        self.text = array_text(ids)
        self.view = memoryview(self.text)  # slices of it are copied once, by the join
        self.ends = np.flatnonzero(np.frombuffer(self.text, dtype=np.uint8) == _COMMA)
        self.size = len(ids)

    def _end(self, k: int) -> int:
        return len(self.text) - 1 if k == self.size - 1 else int(self.ends[k])

    def slice(self, start: int, end: int) -> bytes:
        """The text of ids[start:end]."""
        if end <= start:
            return b"[]"
        last = self._end(end - 1)
        if start == 0:
            return b"".join((self.view[:last], b"]"))
        return b"".join((b"[", self.view[int(self.ends[start - 1]) + 1 : last], b"]"))


def projection_text_items(projection: Any) -> list[dict]:
    """`raycap.capture.builder.projection_items(projection)` with the token arrays as
    fragments (see the module docstring); its lists where orjson has no fragments."""
    if Fragment is None:
        from raycap.capture.builder import projection_items

        return projection_items(projection)
    ids = _IdsText(projection.token_ids)
    log_probs = projection.log_probs
    out: list[dict] = []
    for call in projection.calls:
        start, end = call.gen_start, call.gen_end
        fields: dict[str, Any] = {
            "prompt_token_ids": Fragment(ids.slice(0, start)),
            "generation_token_ids": Fragment(ids.slice(start, end)),
            "generation_log_probs": Fragment(array_text(log_probs[start:end])),
        }
        place_call_fields(call, fields, out)
    return out
