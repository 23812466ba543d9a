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


def _validity(values: Sequence[Any]) -> tuple[pa.Buffer | None, int]:
    present = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    nulls = len(values) - int(present.sum())
    if not nulls:
        return None, 0
    return pa.py_buffer(np.packbits(present, bitorder="little")), nulls


def _offsets(lengths: np.ndarray) -> pa.Buffer:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
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
    if kind == pa.bool_():
        bits = np.fromiter((bool(v) for v in values), dtype=bool, count=n)
        return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(np.packbits(bits, bitorder="little"))], nulls)
    if kind in _NUMPY:
        data = np.array([0 if v is None else v for v in values], dtype=_NUMPY[kind])
        return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(data)], nulls)
    if kind == pa.string():
        encoded = [b"" if v is None else v.encode() for v in values]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=n)
        return pa.Array.from_buffers(kind, n, [validity, _offsets(lengths), pa.py_buffer(b"".join(encoded))], nulls)
    if pa.types.is_list(kind):
        lengths = np.fromiter((0 if v is None else len(v) for v in values), dtype=np.int64, count=n)
        return list_of(values, lengths, column([item for v in values if v is not None for item in v], kind.value_type))
    if pa.types.is_struct(kind):
        children = [column([None if v is None else v[f.name] for v in values], f.type) for f in kind]
        return pa.Array.from_buffers(kind, n, [validity], nulls, children=children)
    raise TypeError(f"no column layout for Arrow type {kind}")
