"""The percentiles an output's manifest and summary report (`raycap.output.stats`) are
numpy's own, to the bit, computed without `np.percentile`: its linear method sorts
through `np.unique`, whose first use imports numpy.ma (20 ms of every process that
commits an output)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raycap.output.stats import Percentiles, linear_percentile, percentiles

REPO = Path(__file__).resolve().parents[2]


@settings(max_examples=400, deadline=None)
@given(
    values=st.lists(st.floats(min_value=-1e12, max_value=1e12, allow_nan=False), min_size=1, max_size=50),
    q=st.sampled_from([0, 10, 50, 90, 100]) | st.floats(min_value=0, max_value=100),
)
def test_a_percentile_is_numpys_to_the_bit(values, q):
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    assert linear_percentile(ordered, q) == float(np.percentile(np.asarray(values), q))


def test_the_reported_percentiles_are_numpys_rounded_and_none_without_values():
    fractions = np.array([1.0, 0.8333, 0.6667, 1.0, 0.5, 0.9])
    p10, p50, p90 = (round(float(v), 4) for v in np.percentile(fractions, [10, 50, 90]))
    assert percentiles(fractions) == Percentiles(p10, p50, p90)
    assert percentiles(np.array([], dtype=np.float64)) is None


def test_reporting_percentiles_imports_no_numpy_ma():
    code = (
        "import sys, numpy as np\n"
        "from raycap.output.stats import percentiles\n"
        "percentiles(np.array([0.5, 1.0, 0.25]))\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"]
