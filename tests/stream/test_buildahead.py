"""A stream whose builds are round trips (directories served by node actors) keeps a few
builds out at once, so a rollout that becomes ready while one build is out is built
without waiting for it; takes stay in readiness order, also when a build fails.

The directories here are a stand-in with the interface of `raycap.stream.dirs` (no Ray,
no files): each build blocks until the test lets it return.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

import raycap.runs.stream as stream_module
from raycap.stream.steps import Built

WAIT_S = 10.0


class RoundTripDirectories:
    """Directories whose `build` is a round trip the test ends, one gate per rollout."""

    judges_here = False
    real_dirs = False
    build_batch = 64
    builds_in_flight = 4

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.labels = ("n0",)
        self.hooks = None
        self.calls: list[list[str]] = []
        self.started = threading.Condition()
        self.gates: dict[str, threading.Event] = {}
        self.fail: set[str] = set()

    def start(self, hooks) -> None:
        self.hooks = hooks

    def gate(self, rid: str) -> threading.Event:
        return self.gates.setdefault(rid, threading.Event())

    def build(self, ids: list[str], refs: bool):
        with self.started:
            self.calls.append(list(ids))
            self.started.notify_all()
        for rid in ids:
            assert self.gate(rid).wait(WAIT_S), f"the build of {rid} was never let go"
        failing = self.fail & set(ids)
        if failing:
            self.fail -= failing
            raise ConnectionError(f"node lost while building {sorted(failing)}")
        pieces = []
        for rid in ids:
            table = pa.Table.from_pylist([{"rollout_id": rid}], schema=self.schema)
            pieces.append(Built(rid, table, table.get_total_buffer_size()))
        return pieces, []

    def fetch(self, pieces: list[Built]) -> pa.Table:
        return pa.concat_tables([p.table for p in pieces]) if pieces else self.schema.empty_table()

    def settled(self, ids) -> None:
        pass

    def close(self) -> None:
        for event in self.gates.values():
            event.set()


@pytest.fixture
def round_trips(monkeypatch):
    made: list[RoundTripDirectories] = []

    def open_directories(capture_dirs, *, options, address, watch, schema):
        made.append(RoundTripDirectories(schema))
        return made[-1]

    monkeypatch.setattr(stream_module, "open_directories", open_directories)
    try:
        import raycap.stream.buildahead as retries
    except ImportError:  # where the build loop lived before
        retries = stream_module
    monkeypatch.setattr(retries, "RETRY_SECONDS", 0.05)
    stream = stream_module.Stream(["n0:/captures"], watch=True)
    try:
        yield stream, made[0]
    finally:
        stream.close()


def _wait_calls(dirs: RoundTripDirectories, n: int) -> list[list[str]]:
    with dirs.started:
        assert dirs.started.wait_for(lambda: len(dirs.calls) >= n, WAIT_S), (
            f"only {len(dirs.calls)} build calls were made, {n} expected: a rollout that became ready while a "
            "build was out waited for it"
        )
        return [list(c) for c in dirs.calls]


def _taken(stream) -> str:
    rows = stream.take(1, timeout=WAIT_S)
    assert rows.num_rows == 1, "take(1) returned nothing"
    return rows.column("rollout_id")[0].as_py()


def test_a_rollout_ready_while_a_build_is_out_is_built_without_waiting_for_it(round_trips):
    stream, dirs = round_trips
    dirs.hooks.queue(["a"])
    _wait_calls(dirs, 1)
    dirs.hooks.queue(["b"])
    assert _wait_calls(dirs, 2) == [["a"], ["b"]]
    # The later build comes back first: it is not taken before the earlier one.
    dirs.gate("b").set()
    assert stream.take(1, timeout=0.3).num_rows == 0
    dirs.gate("a").set()
    assert [_taken(stream), _taken(stream)] == ["a", "b"]


def test_a_failed_build_is_built_again_before_the_later_ones_are_taken(round_trips):
    stream, dirs = round_trips
    dirs.fail.add("a")
    dirs.hooks.queue(["a"])
    _wait_calls(dirs, 1)
    dirs.hooks.queue(["b"])
    _wait_calls(dirs, 2)
    dirs.gate("b").set()
    dirs.gate("a").set()
    assert [_taken(stream), _taken(stream)] == ["a", "b"]
    assert stream.stats.build_failures == 1
    # Both were built again, in their order, after the failure.
    assert [rid for call in dirs.calls[2:] for rid in call] == ["a", "b"]
