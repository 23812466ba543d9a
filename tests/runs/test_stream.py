"""raycap.Stream: the directories are the queue, rows are delivered until committed.

The property test drives random interleavings of appends, freezes by another process,
submits, takes, commits (with and without a step dataset), crashes between commit steps
and restarts, and checks the guarantees of SPEC section 7 after every operation and at
the end, with every row equal to the sequential build of the same records.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import raycap
from raycap import TokenCaptureStore, TokenEntry
from raycap.capture.store import CommitMarker
from raycap.output.faults import OutputError
from raycap.output.manifest import committed_manifest, is_committed, output_rollout_ids, read_manifest
from raycap.runs.stream import Stream
from raycap.stream.dirs import LocalDirectories
from raycap.stream.stepcommit import StepCommit
from strategies import examples
from test_untrusted import _nested

ROOT = Path(__file__).resolve().parents[2]


# --- rollouts -------------------------------------------------------------------------------


def call(rollout_id: str, kind: str, index: int, version: int | None = None) -> TokenEntry:
    """Call `index` of a rollout: "ok" continues one conversation; "two_roots" starts a
    second, unrelated one at call 1 (the row is masked: two roots)."""
    prompt = [1, 2, 3]
    for i in range(index):
        prompt = prompt + [10 + i, 20 + i] + [7]
    if kind == "two_roots" and index == 1:
        prompt = [90, 91]
    extra = {} if version is None else {"policy_version": version}
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=f"call-{index}",
        prompt_token_ids=prompt,
        generation_token_ids=[10 + index, 20 + index],
        generation_log_probs=[-0.25, -0.5],
        created_at=float(index),
        **extra,
    )


def write(store: TokenCaptureStore, rollout_id: str, kind: str = "ok", calls: int = 3, versions=None) -> None:
    for i in range(calls):
        store.append(call(rollout_id, kind, i, None if versions is None else versions[i]))


def reference(rollout_id: str, ref_dir: Path) -> dict:
    build = raycap.trajectories_for_rollout(rollout_id, [str(ref_dir)])
    build.pop("_capture_snapshot", None)
    return build


def row_builds(table: pa.Table) -> dict[str, dict]:
    out = {}
    for build in raycap.builds_from_table(table):
        build.pop("_capture_snapshot", None)
        out[build["rollout_id"]] = build
    return out


def committed_steps(root: Path) -> dict[str, list[str]]:
    """Step dataset -> the rollout ids it holds, for every step committed at its place
    under root. A trainer killed inside a commit can leave its staging directory
    (`.step-....staging`) with a whole manifest, since the rename into place comes last:
    `is_committed` accepts it, `committed_manifest` does not, and it is no step."""
    out = {}
    for p in sorted(root.iterdir()):
        try:
            committed_manifest(p)
        except OutputError:
            continue
        out[str(p)] = sorted(output_rollout_ids(p))
    return out


# --- the commit marker in the store ---------------------------------------------------------


def test_a_commit_marker_is_written_only_for_the_current_snapshot_and_goes_with_the_drop(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    snap = store.freeze_raw("r1")
    assert not store.write_commit("r1", CommitMarker("other", snap.version, None, False, "committed"))
    assert store.read_commit("r1") is None
    assert store.write_commit("r1", CommitMarker(snap.snapshot_id, snap.version, "/o", True, "stale"))
    assert store.read_commit("r1") == CommitMarker(snap.snapshot_id, snap.version, "/o", True, "stale")
    assert store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version)
    assert store.read_commit("r1") is None


def test_a_commit_marker_alone_never_makes_a_rollout_listed_and_delete_removes_it(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    snap = store.freeze_raw("r1")
    store.write_commit("r1", CommitMarker(snap.snapshot_id, snap.version, None, True, "roots"))
    store.delete("r1")
    assert not store.commit_path("r1").exists()
    store.commit_path("r2").write_text("{}")
    assert store.rollout_ids() == [] and store.held(["r2"]) == {}


def test_a_commit_marker_that_is_a_symlink_is_refused_not_followed(tmp_path):
    store = TokenCaptureStore(tmp_path / "c")
    (tmp_path / "elsewhere").write_text(json.dumps({"snapshot_id": "x", "version": 1, "output": None, "masked": False}))
    os.symlink(tmp_path / "elsewhere", store.commit_path("r1"))
    with pytest.raises(ValueError, match="r1"):
        store.read_commit("r1")


# --- taking and committing -----------------------------------------------------------------


def test_rows_come_in_ready_order_equal_to_the_sequential_build(tmp_path):
    capture, ref = TokenCaptureStore(tmp_path / "c"), TokenCaptureStore(tmp_path / "ref")
    kinds = {"b": "ok", "a": "two_roots", "c": "ok"}
    for rid, kind in kinds.items():
        write(capture, rid, kind)
        write(ref, rid, kind)
    with Stream([capture.directory], executor="local") as stream:
        assert stream.submit(["c", "a", "b"]).ready == ("c", "a", "b")
        rows = stream.take(3, timeout=10)
    assert rows.column("rollout_id").to_pylist() == ["c", "a", "b"]
    assert row_builds(rows) == {rid: reference(rid, ref.directory) for rid in kinds}


def test_a_stream_makes_no_spare_files_in_the_directories_it_reads(tmp_path):
    store = TokenCaptureStore(tmp_path)
    for rid in ("r1", "r2", "r3"):
        write(store, rid)
    with Stream([tmp_path], executor="local") as stream:
        for rid in ("r1", "r2", "r3"):
            stream.submit([rid])
            assert stream.take(1, timeout=10).column("rollout_id").to_pylist() == [rid]
        stream.rebuilder.settle()
        assert not [name for name in os.listdir(tmp_path) if name.startswith(".raycap-spare.")]


def test_take_returns_what_is_built_when_the_timeout_passes(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    with Stream([tmp_path], executor="local") as stream:
        stream.submit(["r1"])
        started = time.monotonic()
        rows = stream.take(5, timeout=0.5)
        assert rows.column("rollout_id").to_pylist() == ["r1"]
        assert time.monotonic() - started >= 0.5
        assert stream.take(1, timeout=0.05).num_rows == 0


def test_a_stream_never_freezes_a_rollout_nobody_said_had_finished(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "running")
    write(store, "done")
    store.freeze_raw("done")
    with Stream([tmp_path], executor="local", watch=True) as stream:
        assert stream.take(2, timeout=0.5).column("rollout_id").to_pylist() == ["done"]
    store.append(call("running", "ok", 3))  # still open for writes


def test_commit_writes_one_step_dataset_then_retires_only_unmasked_rollouts(tmp_path):
    store = TokenCaptureStore(tmp_path / "c")
    write(store, "good")
    write(store, "masked", "two_roots")
    step = tmp_path / "steps" / "step-0"
    with Stream([store.directory], executor="local") as stream:
        stream.submit(["good", "masked"])
        rows = stream.take(2, timeout=10)
        report = stream.commit(rows, output=step)
    assert (report.rollouts, report.retired, report.kept_as_evidence) == (2, 1, 1)
    assert sorted(output_rollout_ids(step)) == ["good", "masked"]
    assert store.lifecycle("good").retired and not store.lifecycle("masked").retired
    assert store.paths("masked").jsonl.exists()  # the evidence stays
    with Stream([store.directory], executor="local", watch=True) as stream:
        assert stream.take(1, timeout=0.5).num_rows == 0  # a committed masked row is never delivered again


def test_rows_taken_but_not_committed_are_delivered_again_by_the_next_stream(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    with Stream([tmp_path], executor="local") as stream:
        stream.submit(["r1"])
        first = stream.take(1, timeout=10)
    with Stream([tmp_path], executor="local") as stream:
        again = stream.take(1, timeout=10)
    assert again.column("rollout_id").to_pylist() == ["r1"]
    assert again.column("snapshot_id").to_pylist() == first.column("snapshot_id").to_pylist()


def test_a_step_that_died_before_its_dataset_was_renamed_is_delivered_again(tmp_path, monkeypatch):
    store = TokenCaptureStore(tmp_path / "c")
    write(store, "r1")
    step = tmp_path / "step-0"
    with Stream([store.directory], executor="local") as stream:
        stream.submit(["r1"])
        rows = stream.take(1, timeout=10)
        monkeypatch.setattr(StepCommit, "write", _crash)
        with pytest.raises(_Crash):
            stream.commit(rows, output=step)
    monkeypatch.undo()
    assert store.read_commit("r1") is not None and not is_committed(step)
    with Stream([store.directory], executor="local") as stream:
        assert stream.take(1, timeout=10).column("rollout_id").to_pylist() == ["r1"]
    assert store.read_commit("r1") is None


def test_a_retirement_interrupted_after_the_commit_is_finished_by_the_next_stream(tmp_path, monkeypatch):
    store = TokenCaptureStore(tmp_path / "c")
    write(store, "r1")
    step = tmp_path / "step-0"
    with Stream([store.directory], executor="local") as stream:
        stream.submit(["r1"])
        rows = stream.take(1, timeout=10)
        monkeypatch.setattr(StepCommit, "retire", _crash)
        with pytest.raises(_Crash):
            stream.commit(rows, output=step)
    monkeypatch.undo()
    assert is_committed(step) and not store.lifecycle("r1").retired
    with Stream([store.directory], executor="local") as stream:
        assert stream.take(1, timeout=0.5).num_rows == 0
        assert stream.stats.recovered_finished == 1
    assert store.lifecycle("r1").retired


def test_a_committed_rollout_whose_version_changed_before_its_drop_is_kept_not_delivered_again(tmp_path, monkeypatch):
    store = TokenCaptureStore(tmp_path / "c")
    write(store, "r1")
    with Stream([store.directory], executor="local") as stream:
        stream.submit(["r1"])
        rows = stream.take(1, timeout=10)
        monkeypatch.setattr(StepCommit, "retire", _crash)
        with pytest.raises(_Crash):
            stream.commit(rows, output=tmp_path / "step-0")
    monkeypatch.undo()
    store.mark_incomplete_now("r1", "late-call")  # the version moves on after the commit
    with Stream([store.directory], executor="local") as stream:
        assert stream.take(1, timeout=0.5).num_rows == 0
    assert not store.lifecycle("r1").retired  # not the committed version: kept, never guessed


def test_two_streams_cannot_consume_one_directory(tmp_path):
    with Stream([tmp_path], executor="local"), pytest.raises(RuntimeError, match="another stream consumes"):
        Stream([tmp_path], executor="local")


def test_rows_not_taken_from_the_stream_cannot_be_committed(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    with Stream([tmp_path], executor="local") as stream:
        stream.submit(["r1"])
        rows = stream.take(1, timeout=10)
        stream.commit(rows)
        with pytest.raises(ValueError, match="r1 was not taken"):
            stream.commit(rows)


def test_chain_delivery_gives_every_chain_row_of_a_rollout_together_and_n_counts_rollouts(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "branchy", "two_roots")
    write(store, "plain")
    with Stream([tmp_path], executor="local", delivery="chains") as stream:
        stream.submit(["branchy", "plain"])
        rows = stream.take(1, timeout=10)
        assert rows.column("rollout_id").to_pylist() == ["branchy", "branchy"]
        assert stream.take(1, timeout=10).column("rollout_id").to_pylist() == ["plain"]


# --- versions and staleness --------------------------------------------------------------------


def test_rows_carry_per_call_versions_and_stale_rows_are_masked_and_kept_as_evidence(tmp_path):
    store = TokenCaptureStore(tmp_path / "c")
    write(store, "old", versions=[3, 4, 5])
    write(store, "fresh", versions=[6, 7, 7])
    write(store, "unversioned")
    with Stream([store.directory], executor="local", version_key="policy_version") as stream:
        stream.submit(["old", "fresh", "unversioned"])
        rows = stream.take(3, timeout=10, current_version=8, max_staleness=2)
        report = stream.commit(rows, output=tmp_path / "step-0")
        assert stream.stats.stale == 1
    by_id = {r["rollout_id"]: r for r in rows.to_pylist()}
    assert by_id["old"]["call_versions"] == [3, 4, 5] and by_id["old"]["version_min"] == 3
    assert by_id["fresh"]["version_min"] == 6 and by_id["fresh"]["version_max"] == 7
    assert by_id["unversioned"]["call_versions"] is None and by_id["unversioned"]["version_min"] is None
    assert by_id["old"]["mask_sample"] and by_id["old"]["mask_reasons"] == ["stale"]
    assert not by_id["fresh"]["mask_sample"] and not by_id["unversioned"]["mask_sample"]
    assert (report.retired, report.kept_as_evidence) == (2, 1)
    assert not store.lifecycle("old").retired and store.read_commit("old").reason == "stale"
    assert read_manifest(tmp_path / "step-0").totals.masked_by_reason == {"stale": 1}


def test_without_a_version_key_the_rows_keep_the_rebuild_schema(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1", versions=[1, 2, 3])
    with Stream([tmp_path], executor="local") as stream:
        stream.submit(["r1"])
        rows = stream.take(1, timeout=10, current_version=100, max_staleness=0)
    assert rows.schema.equals(raycap.rebuild([str(tmp_path)], ["r1"], executor="local").schema)
    assert rows.column("mask_sample").to_pylist() == [False]  # no versions: never stale


def test_stale_chain_rows_are_masked_with_weight_zero_and_mask_their_rollout(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "old", "two_roots", versions=[1, 1, 1])
    with Stream([tmp_path], executor="local", delivery="chains", version_key="policy_version") as stream:
        stream.submit(["old"])
        rows = stream.take(1, timeout=10, current_version=5, max_staleness=2).to_pylist()
    assert len(rows) == 2
    assert all(r["mask_sample"] and "stale" in r["mask_reasons"] and r["weight"] == 0.0 for r in rows)
    assert all(r["rollout_mask_sample"] for r in rows)


def test_building_ahead_stops_at_the_row_bound_but_a_larger_take_still_gets_every_row(tmp_path):
    store = TokenCaptureStore(tmp_path)
    ids = [f"r{i}" for i in range(6)]
    for rid in ids:
        write(store, rid)
    with Stream([tmp_path], executor="local", max_ahead_rows=2) as stream:
        stream.submit(ids)
        time.sleep(1.0)
        assert stream.stats.delivered == 0 and len(stream._built) == 2
        assert stream.take(6, timeout=10).column("rollout_id").to_pylist() == ids


# --- watch mode --------------------------------------------------------------------------------


def test_watch_mode_picks_up_a_rollout_frozen_by_a_store_in_another_thread(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "late")
    with Stream([tmp_path], executor="local", watch=True) as stream:
        assert stream.take(1, timeout=0.2).num_rows == 0
        threading.Timer(0.2, lambda: TokenCaptureStore(tmp_path).freeze_raw("late")).start()
        started = time.monotonic()
        rows = stream.take(1, timeout=5)
        assert rows.column("rollout_id").to_pylist() == ["late"]
        assert time.monotonic() - started < 2


def test_without_inotify_watch_mode_polls_and_still_finds_the_frozen_rollout(tmp_path, monkeypatch):
    from raycap.stream import watch as watch_module

    monkeypatch.setattr(watch_module.Inotify, "open", classmethod(lambda cls, paths: None))
    store = TokenCaptureStore(tmp_path)
    write(store, "late")
    with Stream([tmp_path], executor="local", watch=True) as stream:
        assert stream.dirs.watch.inotify is None
        store.freeze_raw("late")
        assert stream.take(1, timeout=5).column("rollout_id").to_pylist() == ["late"]



def test_on_a_local_file_system_the_watch_alone_discovers_and_the_history_is_never_rescanned(tmp_path, monkeypatch):
    from raycap.stream import watch as watch_module
    monkeypatch.setattr(watch_module, "RESCAN_SECONDS", 0.05)
    scans = []
    real = LocalDirectories.rescan
    monkeypatch.setattr(LocalDirectories, "rescan", lambda self: (scans.append(time.monotonic()), real(self)))
    store = TokenCaptureStore(tmp_path)
    write(store, "late")
    assert watch_module.is_local_file_system(str(tmp_path))
    with Stream([tmp_path], executor="local", watch=True) as stream:
        assert stream.dirs.watch.inotify is not None
        time.sleep(0.5)
        store.freeze_raw("late")
        assert stream.take(1, timeout=5).column("rollout_id").to_pylist() == ["late"]
    assert len(scans) == 1  # the one at start: nothing periodic reads the tombstones' names


def test_a_freeze_that_lands_while_the_rollout_is_being_judged_is_not_lost(tmp_path, monkeypatch):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    with Stream([tmp_path], executor="local") as stream:
        reading, go = threading.Event(), threading.Event()
        real = LocalDirectories.judge
        calls = []

        def slow_status(self, rid, outputs):
            calls.append(rid)
            status = real(self, rid, outputs)  # read before the freeze: not frozen
            if len(calls) == 1:
                reading.set()
                go.wait(5)
            return status

        monkeypatch.setattr(LocalDirectories, "judge", slow_status)
        first = threading.Thread(target=stream._consider, args=("r1",))
        first.start()
        assert reading.wait(5)
        store.freeze_raw("r1")
        assert stream._consider("r1") is None  # the watch's event for the freeze: being judged
        go.set()
        first.join(5)
        assert stream.take(1, timeout=5).column("rollout_id").to_pylist() == ["r1"]


# --- the property test -----------------------------------------------------------------------------


class _Crash(Exception):
    pass


def _crash(*args, **kwargs):
    raise _Crash("injected")


IDS = [f"r{i}" for i in range(5)]
KINDS = ["ok", "two_roots", "ok", "ok", "two_roots"]
CRASH_POINTS = (None, None, "mark", "write", "retire", "drop")

operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 4)),
        st.tuples(st.just("freeze"), st.integers(0, 4)),
        st.tuples(st.just("submit"), st.integers(0, 4)),
        st.tuples(st.just("take"), st.integers(1, 3)),
        st.tuples(st.just("commit"), st.booleans(), st.sampled_from(CRASH_POINTS)),
        st.tuples(st.just("restart")),
    ),
    min_size=5,
    max_size=25,
)


class _World:
    """The stream under test and what the test knows must be true."""

    def __init__(self, root: Path):
        self.root = root
        self.capture = TokenCaptureStore(root / "c")
        self.ref = TokenCaptureStore(root / "ref")
        (root / "steps").mkdir()
        self.calls = dict.fromkeys(IDS, 0)
        self.finished: set[str] = set()
        self.taken: list[pa.Table] = []
        # What this stream can deliver now: found at its start, or submitted to it since.
        self.visible: set[str] = set()
        self.declared: set[str] = set()  # committed without output, the marker written
        self.steps = 0
        self.stream = Stream([self.capture.directory], executor="local")

    def committed(self) -> set[str]:
        out = set(self.declared)
        for ids in committed_steps(self.root / "steps").values():
            out.update(ids)
        return out

    def restart(self) -> None:
        # close() writes nothing, so what follows sees exactly what a dead process leaves.
        self.stream.close()
        self.taken = []
        self.stream = Stream([self.capture.directory], executor="local")
        self.visible = self.finished - self.committed()

    def take(self, n: int) -> pa.Table:
        before = self.committed()
        expected = min(n, len(self.visible))
        # Waits for exactly what must be deliverable, so a slow build cannot hide a bug.
        rows = self.stream.take(max(expected, 1), timeout=10 if expected else 0.05)
        ids = set(rows.column("rollout_id").to_pylist())
        assert len(ids) == expected, f"{expected} rollouts were ready, {len(ids)} delivered"
        self.visible -= ids
        assert not ids & before, f"committed rollouts delivered again: {ids & before}"
        assert ids <= self.finished
        if rows.num_rows:
            got = row_builds(rows)
            assert got == {rid: reference(rid, self.ref.directory) for rid in got}
            self.taken.append(rows)
        return rows

    def commit(self, with_output: bool, crash: str | None, monkeypatch) -> None:
        if not self.taken:
            return
        rows = self.taken.pop(0)
        output = self.root / "steps" / f"step-{self.steps}" if with_output else None
        self.steps += 1
        ids = set(rows.column("rollout_id").to_pylist())
        if crash == "mark":
            monkeypatch.setattr(StepCommit, "mark", _crash)
        elif crash == "write":
            monkeypatch.setattr(StepCommit, "write", _crash)
        elif crash == "retire":
            monkeypatch.setattr(StepCommit, "retire", _crash)
        elif crash == "drop":
            real = LocalDirectories.drop_one
            done = []

            def drop_once(dirs, rid, parts):
                if done:
                    raise _Crash("injected")
                done.append(rid)
                return real(dirs, rid, parts)

            monkeypatch.setattr(LocalDirectories, "drop_one", drop_once)
        try:
            self.stream.commit(rows, output)
        except _Crash:
            monkeypatch.undo()
            if output is None and crash != "mark":
                self.declared |= ids
            self.restart()
            return
        monkeypatch.undo()
        if output is None:
            self.declared |= ids

    def check(self) -> None:
        committed = self.committed()
        for rid in IDS:
            life = self.capture.lifecycle(rid)
            if life.retired:
                assert rid in committed, f"{rid} retired before it was committed"
        steps = committed_steps(self.root / "steps")
        seen = [rid for ids in steps.values() for rid in ids]
        assert len(seen) == len(set(seen)), f"a rollout in two step datasets: {steps}"
        assert not set(seen) & self.declared


def _crash_at(point: str, with_output: bool) -> list[tuple]:
    """Every rollout finished and taken, then a commit that dies at `point`."""
    ops: list[tuple] = [("append", i) for i in range(5)] + [("submit", i) for i in range(4)] + [("freeze", 4)]
    return [*ops, ("take", 3), ("commit", with_output, point), ("take", 3), ("commit", with_output, None)]


@pytest.mark.slow
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations)
@example(ops=_crash_at("mark", True))
@example(ops=_crash_at("write", True))
@example(ops=_crash_at("retire", True))
@example(ops=_crash_at("drop", True))
@example(ops=_crash_at("write", False))
@example(ops=_crash_at("drop", False))
def test_any_interleaving_with_crashes_delivers_every_finished_rollout_once_and_retires_only_committed_rows(
    ops, tmp_path_factory, monkeypatch
):
    world = _World(tmp_path_factory.mktemp("stream"))
    try:
        for op in ops:
            kind = op[0]
            if kind == "append":
                rid = IDS[op[1]]
                if rid not in world.finished and world.calls[rid] < 4:
                    entry = call(rid, KINDS[op[1]], world.calls[rid])
                    world.capture.append(entry)
                    world.ref.append(entry)
                    world.calls[rid] += 1
            elif kind == "freeze":
                # Another process (a finalizer) freezes it; this stream is not watching,
                # so only the next stream finds it.
                rid = IDS[op[1]]
                if not world.capture.lifecycle(rid).retired:  # a finalizer freezes a live rollout
                    world.capture.freeze_raw(rid)
                    world.finished.add(rid)
            elif kind == "submit":
                rid = IDS[op[1]]
                captured = bool(world.capture.held([rid]))
                submitted = world.stream.submit([rid])
                if not captured:
                    # Nothing was captured: refused, never frozen into a phantom rollout.
                    assert rid in submitted.refused and not world.capture.held([rid])
                else:
                    world.finished.add(rid)
                if submitted.ready and rid not in world.committed() and not any(
                    rid in t.column("rollout_id").to_pylist() for t in world.taken
                ):
                    world.visible.add(rid)
            elif kind == "take":
                world.take(op[1])
            elif kind == "commit":
                world.commit(op[1], op[2], monkeypatch)
            else:
                world.restart()
            world.check()
        # The end: a fresh stream drains what is left and commits it as one last step.
        world.restart()
        world.take(len(IDS))
        # Nothing more: what it could wrongly deliver is ready or building by now (the take
        # above waited for every row it must deliver), as in World.take's empty takes.
        assert world.stream.take(1, timeout=0.1).num_rows == 0
        while world.taken:
            world.commit(True, None, monkeypatch)
        world.check()
        committed = world.committed()
        assert committed == world.finished, "every finished rollout is committed exactly once"
        for rid in world.finished:
            life = world.capture.lifecycle(rid)
            masked = reference(rid, world.ref.directory)["mask_sample"]
            assert life.retired == (not masked), f"{rid}: retired iff its row is unmasked and committed"
    finally:
        world.stream.close()


# --- one case on Ray ----------------------------------------------------------------------------


def test_take_with_refs_hands_out_an_object_ref_of_the_rows(ray_shared, tmp_path):
    import ray

    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    with Stream([tmp_path], executor="ray") as stream:
        stream.submit(["r1"])
        refs = stream.take_refs(1, timeout=60)
        table = ray.get(refs[0])
        assert table.column("rollout_id").to_pylist() == ["r1"]
        stream.commit(table)
    assert store.lifecycle("r1").retired


# --- the docs' program (docs/streaming.md) ---------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess (a trainer killed at random, or a README program with its own Ray)
def test_the_readme_streaming_program_runs_as_written(tmp_path, ray_cluster):
    text = (ROOT / "docs" / "streaming.md").read_text()
    section = text.split("# Streaming for asynchronous training", 1)
    if len(section) < 2:
        pytest.fail("docs/streaming.md has no 'Streaming for asynchronous training' section")
    program = re.search(r"```python\n(.*?)```", section[1], re.DOTALL).group(1)
    script = tmp_path / "async_loop.py"
    script.write_text(program)
    # Joins the session's test cluster, as a user's program would join theirs.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ray_cluster.address}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "committed" in done.stdout


def test_token_versions_give_each_generated_token_the_version_of_its_call(tmp_path):
    from raycap.rows.arrow import token_versions

    store = TokenCaptureStore(tmp_path)
    write(store, "r1", calls=2, versions=[4, 9])
    write(store, "r2", "ok", calls=1)
    with Stream([tmp_path], executor="local", version_key="policy_version") as stream:
        stream.submit(["r1", "r2"])
        rows = stream.take(2, timeout=10)
    versions = token_versions(rows).to_pylist()
    # r1: prompt [1, 2, 3], call 0 generates 2 ids, 1 tool id, call 1 generates 2 ids.
    assert versions[0] == [None, None, None, 4, 4, None, 9, 9]
    assert versions[1] == [None, None, None, None, None]  # a call without a version has none
    assert len(versions[0]) == len(rows.column("token_ids")[0])


def test_rows_built_on_ray_reach_a_refs_taker_and_its_step_dataset_without_passing_through_the_driver(
    ray_shared, tmp_path, monkeypatch
):
    import ray

    store, ref_store = TokenCaptureStore(tmp_path / "c"), TokenCaptureStore(tmp_path / "ref")
    for s in (store, ref_store):
        write(s, "old", versions=[1, 2, 3])
        write(s, "fresh", versions=[7, 8, 8])
    through_driver = []
    real_get, real_put = ray.get, ray.put

    def spy_get(refs, *args, **kwargs):
        values = real_get(refs, *args, **kwargs)
        for value in values if isinstance(values, list) else [values]:
            for part in value if isinstance(value, tuple) else [value]:
                if isinstance(part, pa.Table) and "token_ids" in part.column_names:
                    through_driver.append("get")
        return values

    def spy_put(value, *args, **kwargs):
        through_driver.append("put")
        return real_put(value, *args, **kwargs)

    with Stream([store.directory], executor="ray", version_key="policy_version") as stream:
        stream.take_refs(1, timeout=0)  # a taker of refs: builds keep rows on Ray from now on
        monkeypatch.setattr(ray, "get", spy_get)
        monkeypatch.setattr(ray, "put", spy_put)
        fresh = {"_ng_rollout_id": "fresh", "reward": 0.5, "_ng_task_index": 3, "response": {"model": "p", "output": []}}
        stream.submit(["old", fresh])  # a record: its columns are set where the rows are
        refs = stream.take_refs(2, timeout=120, current_version=9, max_staleness=3)
        report = stream.commit(refs, output=tmp_path / "step-0")
        assert stream.stats.stale == 1
        monkeypatch.undo()
    assert through_driver == []
    table = ray.get(refs[0])
    by_id = {r["rollout_id"]: r for r in table.to_pylist()}
    assert by_id["old"]["mask_sample"] and "stale" in by_id["old"]["mask_reasons"]
    assert not by_id["fresh"]["mask_sample"] and by_id["fresh"]["call_versions"] == [7, 8, 8]
    assert (by_id["fresh"]["reward"], by_id["fresh"]["task_index"], by_id["old"]["reward"]) == (0.5, 3, None)
    expected = reference("fresh", ref_store.directory)
    expected["rebuilt_response"]["model"] = "p"  # the record's model, as Gym's finalizer builds with it
    assert row_builds(table)["fresh"] == expected
    (finalized,) = raycap.read_records(tmp_path / "step-0")  # finalized beside the rows, by a Ray task
    assert finalized["response"]["output"] == expected["rebuilt_response"]["output"] and "mask_sample" not in finalized
    assert report.rollouts == 2 and report.retired == 1 and report.kept_as_evidence == 1
    assert committed_steps(tmp_path) == {str(tmp_path / "step-0"): ["fresh", "old"]}
    assert read_manifest(tmp_path / "step-0").totals.masked_by_reason == {"stale": 1}
    assert store.lifecycle("fresh").retired and not store.lifecycle("old").retired


def test_a_stream_lock_planted_as_a_link_is_refused_and_nothing_is_created_at_its_target(tmp_path):
    from raycap.capture.files import CaptureFileError
    from raycap.stream.readiness import LOCK_NAME

    captures = tmp_path / "caps"
    captures.mkdir()
    target = tmp_path / "elsewhere"
    os.symlink(target, captures / LOCK_NAME)
    with pytest.raises(CaptureFileError, match="symbolic link"):
        Stream([str(captures)], executor="local")
    assert not os.path.lexists(target)


# --- a damaged commit marker holds back its rollout only ---------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"snapshot_id": "S", "version": Infinity, "output": null, "masked": false, "reason": ""}',
        '{"snapshot_id": "S", "version": 1, "output": null, "masked": false, "reason": %s}' % _nested(30_000),
        _nested(30_000),
    ],
    ids=["infinity", "nested-value", "nested"],
)
@pytest.mark.slow
def test_a_damaged_commit_marker_holds_back_only_its_rollout_and_is_counted(tmp_path, text):
    store = TokenCaptureStore(tmp_path)
    write(store, "hidden")
    write(store, "fine")
    store.freeze_raw("hidden")
    store.commit_path("hidden").write_text(text)
    with pytest.raises(ValueError, match="commit marker .* of rollout 'hidden'"):
        store.read_commit("hidden")
    with Stream([tmp_path], executor="local") as stream:
        stream.submit(["fine"])
        rows = stream.take(1, timeout=10)
        assert rows.column("rollout_id").to_pylist() == ["fine"]
        assert stream.stats.damaged_markers == 1
        assert stream.take(1, timeout=0.5).num_rows == 0  # "hidden" is held back
