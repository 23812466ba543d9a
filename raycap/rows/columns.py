"""Arrow arrays from Python values, built from buffers.

`pyarrow.array` asks pandas whether its input is a pandas object, and so imports pandas
(half a second here) in every process that converts its first row. The columns of a
build are plain lists of known types, so they are laid out directly: numpy values,
validity bitmaps and offsets, handed to Arrow as buffers. Nothing here imports pandas.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa

_NUMPY = {
    pa.int8(): np.int8,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.float64(): np.float64,
}


# Types are told apart by their ids: comparing DataType objects costs more than the work
# of a small batch's column.
_NUMPY_BY_ID = {kind.id: dtype for kind, dtype in _NUMPY.items()}
_BOOL_ID, _STRING_ID, _LIST_ID, _STRUCT_ID = pa.bool_().id, pa.string().id, pa.list_(pa.int8()).id, pa.struct([]).id
_INT32_MAX = int(np.iinfo(np.int32).max)


def _validity(values: Sequence[Any]) -> tuple[pa.Buffer | None, int]:
    nulls = 0
    for value in values:
        if value is None:
            nulls += 1
    if not nulls:
        return None, 0
    present = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    return pa.py_buffer(np.packbits(present, bitorder="little")), nulls


def _offsets(lengths: np.ndarray) -> pa.Buffer:
    offsets = np.empty(len(lengths) + 1, dtype=np.int64)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > _INT32_MAX:
        raise OverflowError("a column's values exceed the 2 GiB of one Arrow array; build fewer rollouts per batch")
    return pa.py_buffer(offsets.astype(np.int32))


def primitive(values: np.ndarray, kind: pa.DataType) -> pa.Array:
    """A numpy array without nulls as an Arrow array of the numeric type `kind` (values
    that do not fit, such as ids beyond int64 in an object array, raise OverflowError)."""
    data = np.asarray(values, dtype=_NUMPY[kind])
    return pa.Array.from_buffers(kind, len(data), [None, pa.py_buffer(data)])


def list_of(values: Sequence[Any], lengths: np.ndarray, child: pa.Array) -> pa.Array:
    """A list array whose row i is None (where values[i] is) or the next lengths[i]
    items of `child`."""
    validity, nulls = _validity(values)
    return pa.Array.from_buffers(pa.list_(child.type), len(values), [validity, _offsets(lengths)], nulls, children=[child])


def column(values: Sequence[Any], kind: pa.DataType) -> pa.Array:
    """`values` (None for a null) as an Arrow array of type `kind`."""
    n = len(values)
    validity, nulls = _validity(values)
    kind_id = kind.id
    if kind_id == _BOOL_ID:
        bits = np.fromiter((bool(v) for v in values), dtype=bool, count=n)
        return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(np.packbits(bits, bitorder="little"))], nulls)
    dtype = _NUMPY_BY_ID.get(kind_id)
    if dtype is not None:
        data = np.array([0 if v is None else v for v in values] if nulls else values, dtype=dtype)
        return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(data)], nulls)
    if kind_id == _STRING_ID:
        encoded = [b"" if v is None else v.encode() for v in values]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=n)
        return pa.Array.from_buffers(kind, n, [validity, _offsets(lengths), pa.py_buffer(b"".join(encoded))], nulls)
    if kind_id == _LIST_ID:
        lengths = np.fromiter((0 if v is None else len(v) for v in values), dtype=np.int64, count=n)
        return list_of(values, lengths, column([item for v in values if v is not None for item in v], kind.value_type))
    if kind_id == _STRUCT_ID:
        children = [column([None if v is None else v[f.name] for v in values], f.type) for f in kind]
        return pa.Array.from_buffers(kind, n, [validity], nulls, children=children)
    raise TypeError(f"no column layout for Arrow type {kind}")


# --- and back: numpy from Arrow arrays, read from their buffers ---------------------------------
#
# pyarrow's `to_numpy` and `pyarrow.scalar` (so `pyarrow.compute` given a Python value)
# import pandas too; these read a fixed-width column's buffers instead.

_FROM_ARROW = {
    pa.int8(): np.int8,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.float64(): np.float64,
}


def _chunks(array: pa.Array | pa.ChunkedArray) -> list[pa.Array]:
    return list(array.chunks) if isinstance(array, pa.ChunkedArray) else [array]


def _valid(chunk: pa.Array) -> np.ndarray:
    """Per item of one chunk, whether it is not null."""
    n = len(chunk)
    bitmap = chunk.buffers()[0]
    if chunk.null_count == 0 or bitmap is None:
        return np.ones(n, dtype=bool) if chunk.type != pa.null() else np.zeros(n, dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[chunk.offset : chunk.offset + n].astype(bool)


def _data(chunk: pa.Array, dtype: Any) -> np.ndarray:
    """The values of one chunk without nulls of a numeric type (read-only view) or bool."""
    n = len(chunk)
    buffer = chunk.buffers()[1]
    if not n or buffer is None:
        return np.empty(0, dtype=dtype if chunk.type != pa.bool_() else bool)
    if chunk.type == pa.bool_():
        bits = np.unpackbits(np.frombuffer(buffer, dtype=np.uint8), bitorder="little")
        return bits[chunk.offset : chunk.offset + n].astype(bool)
    return np.frombuffer(buffer, dtype=_FROM_ARROW[chunk.type])[chunk.offset : chunk.offset + n]


def valid(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per item, whether it is not null (a bool numpy array)."""
    parts = [_valid(chunk) for chunk in _chunks(array)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=bool)


def to_numpy(array: pa.Array | pa.ChunkedArray, dtype: Any, null: Any) -> np.ndarray:
    """A bool or numeric column as a numpy array of `dtype`, nulls replaced by `null`."""
    parts = []
    for chunk in _chunks(array):
        if chunk.type == pa.null():
            parts.append(np.full(len(chunk), null, dtype=dtype))
            continue
        values = np.array(_data(chunk, dtype), dtype=dtype)
        if chunk.null_count:
            values[~_valid(chunk)] = null
        parts.append(values)
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


def list_offsets(chunk: pa.Array) -> np.ndarray:
    """The offsets of one list chunk (len + 1 of them, into its child's values)."""
    buffer = chunk.buffers()[1]
    if buffer is None:
        return np.zeros(len(chunk) + 1, dtype=np.int64)
    return np.frombuffer(buffer, dtype=np.int32)[chunk.offset : chunk.offset + len(chunk) + 1]


def list_rows(array: pa.Array | pa.ChunkedArray) -> list[np.ndarray | None]:
    """Each row of a list column of a numeric type without null items (int8, int32,
    int64, float64) as a numpy view of its type (None for a null row)."""
    dtype = _FROM_ARROW[array.type.value_type]
    out: list[np.ndarray | None] = []
    for chunk in _chunks(array):
        offsets = list_offsets(chunk)
        values = _data(chunk.values, dtype)
        present = _valid(chunk)
        for i in range(len(chunk)):
            out.append(values[offsets[i] : offsets[i + 1]] if present[i] else None)
    return out


def list_lengths(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per row of a list column, its length (0 for a null row)."""
    parts = []
    for chunk in _chunks(array):
        lengths = np.diff(list_offsets(chunk)).astype(np.int64)
        lengths[~_valid(chunk)] = 0
        parts.append(lengths)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
