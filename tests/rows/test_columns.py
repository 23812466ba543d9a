"""raycap.rows.columns lays Arrow arrays out from buffers so that converting rows never
imports pandas; the arrays must be exactly what pyarrow.array makes of the same values.
raycap.rows.batch.IpcTable carries a batch's table out of a builder task the same way."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raycap.rows.arrow import CHAIN_SCHEMA, ROLLOUT_SCHEMA
from raycap.rows.batch import IpcTable, failed_rows
from raycap.rows.columns import column

_SCALARS = {
    pa.int8(): st.integers(-128, 127),
    pa.int32(): st.integers(-(2**31), 2**31 - 1),
    pa.int64(): st.integers(-(2**63), 2**63 - 1),
    pa.float64(): st.floats(allow_nan=False),
    pa.bool_(): st.booleans(),
    pa.string(): st.text(max_size=8),
}


def _values_of(kind: pa.DataType) -> st.SearchStrategy:
    if kind in _SCALARS:
        inner = _SCALARS[kind]
    elif pa.types.is_list(kind):
        inner = st.lists(_values_of(kind.value_type), max_size=4)
    else:
        inner = st.fixed_dictionaries({f.name: _values_of(f.type) for f in kind})
    return st.none() | inner


_TYPES = sorted({str(f.type): f.type for f in (*ROLLOUT_SCHEMA, *CHAIN_SCHEMA)}.items())


@pytest.mark.slow
@pytest.mark.parametrize("name,kind", _TYPES, ids=[name for name, _ in _TYPES])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_schema_column_is_what_pyarrow_array_makes(name, kind, data):
    values = data.draw(st.lists(_values_of(kind), max_size=12))
    got = column(values, kind)
    got.validate(full=True)
    assert got.equals(pa.array(values, type=kind))


@pytest.mark.slow
def test_converting_rows_does_not_import_pandas():
    """pyarrow.array imports pandas (half a second) on its first call in a process."""
    code = (
        "import sys\n"
        "from raycap.rows.batch import failed_rows, IpcTable\n"
        "import pickle\n"
        "for delivery in ('rollout', 'chains'):\n"
        "    t = failed_rows(['a', 'b'], [['d'], ['e']], 'prefix_merging', '', 'ValueError: x', delivery)\n"
        "    pickle.loads(pickle.dumps(IpcTable(t), protocol=5))\n"
        "assert 'pandas' not in sys.modules, 'pandas was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("protocol", [4, 5])
def test_a_shipped_table_unpickles_as_the_table(protocol):
    table = failed_rows(["a", "b"], [["d"], ["e", "f"]], "prefix_merging", "m", "ValueError: lost", "chains")
    buffers: list = []
    data = pickle.dumps(IpcTable(table), protocol=protocol, buffer_callback=buffers.append if protocol >= 5 else None)
    assert len(buffers) == (1 if protocol >= 5 else 0)  # out of band: zero-copy from Ray's object store
    back = pickle.loads(data, buffers=buffers)
    assert isinstance(back, pa.Table) and back.equals(table) and back.schema.equals(CHAIN_SCHEMA)
