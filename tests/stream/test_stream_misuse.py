"""raycap.Stream used carelessly or with hostile intent: a commit is tied to what the
stream delivered, a step directory is never reused, submit never cuts or invents a
rollout, and every argument is checked before anything changes.

Run in this process (executor "local") except where the rows left on Ray are the point.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from raycap import TokenCaptureStore
from raycap.capture.store import CommitMarker
from raycap.output.faults import OutputError
from raycap.output.manifest import is_committed, output_rollout_ids, shard_paths
from raycap.runs.stream import Stream
from raycap.stream.stepcommit import StepCommit
from raycap.stream.steps import StepRefused
from test_stream import _Crash, _crash, call, write


def _rows(step) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in shard_paths(step)])


def _taken(tmp_path, ids, kinds=None, **options):
    """A stream (to be closed by the caller) that has taken `ids`, and the rows."""
    store = TokenCaptureStore(tmp_path / "c")
    for rid in ids:
        write(store, rid, (kinds or {}).get(rid, "ok"))
    stream = Stream([store.directory], executor="local", **options)
    stream.submit(list(ids))
    rows = stream.take(len(ids), timeout=10)
    assert sorted(set(rows.column("rollout_id").to_pylist())) == sorted(ids)
    return store, stream, rows


def _untouched(store, ids):
    """Nothing of a refused commit reached the directory: no marker, nothing retired."""
    for rid in ids:
        assert store.read_commit(rid) is None, f"{rid}: a refused commit left a marker"
        assert not store.lifecycle(rid).retired, f"{rid}: a refused commit retired it"


# --- 1. a reused step directory -------------------------------------------------------------------


def _recycled(tmp_path):
    """steps/step-00000 holds r1 and r2; the ids are then captured again (after their
    tombstones were swept), as by a trainer restarted with its step counter at 0."""
    store = TokenCaptureStore(tmp_path / "c")
    step = tmp_path / "steps" / "step-00000"
    for rid in ("r1", "r2"):
        write(store, rid)
    with Stream([store.directory], executor="local") as stream:
        stream.submit(["r1", "r2"])
        stream.commit(stream.take(2, timeout=10), output=step)
    assert store.sweep_retired(0) == 2
    for rid in ("r1", "r2"):
        write(store, rid, calls=2)  # another capture under the same id
    return store, step


def test_a_commit_into_a_step_that_holds_other_snapshots_of_the_same_ids_is_refused_before_any_marker(tmp_path):
    store, step = _recycled(tmp_path)
    before = _rows(step)
    with Stream([store.directory], executor="local") as stream:
        stream.submit(["r1", "r2"])
        rows = stream.take(2, timeout=10)
        with pytest.raises(StepRefused, match=r"step-00000 is already committed with other rows") as refused:
            stream.commit(rows, output=step)
        assert isinstance(refused.value, ValueError) and "\n" not in str(refused.value)
        _untouched(store, ["r1", "r2"])
        assert _rows(step).equals(before)
        # The rows stay taken: committed to a step of their own, they are retired.
        report = stream.commit(rows, output=tmp_path / "steps" / "step-00001")
    assert report.retired == 2 and store.lifecycle("r1").retired
    assert _rows(tmp_path / "steps" / "step-00001").column("n_calls").to_pylist() == [2, 2]


def test_a_marker_naming_a_step_that_holds_another_capture_of_the_id_is_not_taken_for_committed(tmp_path):
    store, step = _recycled(tmp_path)
    # A commit into the reused step died after its marker (or an earlier raycap trusted
    # the id): the step holds r1, but not this snapshot of it.
    snap = store.freeze_raw("r1", read=False)
    assert store.write_commit("r1", CommitMarker(snap.snapshot_id, snap.version, str(step), False, "committed"))
    with Stream([store.directory], executor="local") as stream:
        rows = stream.take(1, timeout=10)
        assert rows.column("rollout_id").to_pylist() == ["r1"] and rows.column("n_calls").to_pylist() == [2]
        assert stream.stats.recovered_ready == 1 and stream.stats.recovered_finished == 0
    assert not store.lifecycle("r1").retired and store.read_commit("r1") is None


def test_an_existing_directory_that_is_no_step_dataset_is_refused_before_any_marker(tmp_path):
    store, stream, rows = _taken(tmp_path, ["r1"])
    with stream:
        (tmp_path / "busy").mkdir()
        (tmp_path / "busy" / "notes.txt").write_text("mine")
        with pytest.raises(StepRefused, match="not a committed raycap dataset"):
            stream.commit(rows, output=tmp_path / "busy")
        _untouched(store, ["r1"])
        assert stream.commit(rows, output=tmp_path / "step-0").retired == 1


# --- 3. the rows handed to commit are the rows delivered -----------------------------------------


def test_a_masked_row_with_its_verdict_flipped_is_refused_and_its_evidence_kept(tmp_path):
    store, stream, rows = _taken(tmp_path, ["good", "bad"], {"bad": "two_roots"})
    with stream:
        assert rows.column("mask_sample").to_pylist() == [False, True]
        index = rows.column_names.index("mask_sample")
        forged = rows.set_column(index, rows.schema.field(index), pa.array([False, False]))
        with pytest.raises(ValueError, match="rows of rollout bad are not the rows this stream delivered"):
            stream.commit(forged, output=tmp_path / "step-0")
        assert not (tmp_path / "step-0").exists()
        _untouched(store, ["good", "bad"])
        report = stream.commit(rows, output=tmp_path / "step-0")
    assert (report.retired, report.kept_as_evidence) == (1, 1)
    assert store.paths("bad").jsonl.exists() and not store.lifecycle("bad").retired


def test_a_verdict_flipped_the_other_way_or_a_value_changed_is_refused_too(tmp_path):
    store, stream, rows = _taken(tmp_path, ["good"])
    with stream:
        index = rows.column_names.index("token_ids")
        forged = rows.set_column(index, rows.schema.field(index), pa.array([[9, 9, 9]], rows.schema.field(index).type))
        with pytest.raises(ValueError, match="rollout good"):
            stream.commit(forged)
        index = rows.column_names.index("mask_sample")
        with pytest.raises(ValueError, match="rollout good"):
            stream.commit(rows.set_column(index, rows.schema.field(index), pa.array([True])))
        _untouched(store, ["good"])


def test_one_of_a_rollouts_two_chain_rows_is_refused_and_the_capture_kept(tmp_path):
    store, stream, rows = _taken(tmp_path, ["branchy"], {"branchy": "two_roots"}, delivery="chains")
    with stream:
        assert rows.num_rows == 2 and not any(rows.column("mask_sample").to_pylist())
        for part in (rows.slice(0, 1), rows.slice(1, 1), pa.concat_tables([rows, rows.slice(0, 1)])):
            with pytest.raises(ValueError, match="rollout branchy"):
                stream.commit(part, output=tmp_path / "step-0")
        _untouched(store, ["branchy"])
        report = stream.commit(rows, output=tmp_path / "step-0")
    assert report.rows == 2 and _rows(tmp_path / "step-0").num_rows == 2 and store.lifecycle("branchy").retired


def test_rows_of_several_takes_commit_together_in_any_order_and_chains_may_be_reordered(tmp_path):
    store = TokenCaptureStore(tmp_path / "c")
    for rid in ("a", "b", "c"):
        write(store, rid, "two_roots")
    with Stream([store.directory], executor="local", delivery="chains") as stream:
        stream.submit(["a", "b", "c"])
        first, second = stream.take(1, timeout=10), stream.take(2, timeout=10)
        mixed = pa.concat_tables([second, first])
        mixed = mixed.take(pa.array(list(reversed(range(mixed.num_rows)))))  # every rollout's rows reversed
        with pytest.raises(ValueError, match="not the rows this stream delivered"):
            stream.commit(mixed)  # a rollout's chain rows out of their order are other rows
        report = stream.commit(pa.concat_tables([second, first]), output=tmp_path / "step-0")
    assert report.rollouts == 3 and sorted(output_rollout_ids(tmp_path / "step-0")) == ["a", "b", "c"]


def test_a_foreign_table_is_a_one_line_value_error_not_a_key_error(tmp_path):
    store, stream, rows = _taken(tmp_path, ["r1"])
    with stream:
        twice = pa.Table.from_arrays([pa.array(["r1"]), pa.array(["r1"])], names=["rollout_id", "rollout_id"])
        foreigners = (
            pa.table({"x": [1]}), pa.table({"x\ny": [1]}), pa.table({"rollout_id": [1]}), twice,
            pa.table({"rollout_id": pa.array([None], pa.string())}),
        )
        for foreign in foreigners:
            with pytest.raises(ValueError, match="not rows of a raycap stream") as refused:
                stream.commit(foreign, output=tmp_path / "step-0")
            assert "\n" not in str(refused.value)
        with pytest.raises(ValueError, match="rollout ghost was not taken"):
            stream.commit(pa.table({"rollout_id": ["ghost"]}))
        with pytest.raises(ValueError, match="was not taken") as refused:
            stream.commit(pa.table({"rollout_id": ["gh\nost"]}))
        assert "\n" not in str(refused.value)
        with pytest.raises(ValueError, match="rows of rollout r1 are not the rows"):
            stream.commit(pa.table({"rollout_id": ["r1"]}))  # the id of a taken rollout, and nothing of its rows
        with pytest.raises(TypeError, match="not int"):
            stream.commit(5)
        _untouched(store, ["r1"])
        assert not (tmp_path / "step-0").exists()
        assert stream.commit(rows).retired == 1


# --- 4. two commits of the same rows --------------------------------------------------------------


def test_two_threads_committing_the_same_rows_one_wins_and_the_other_is_refused(tmp_path):
    ids = [f"r{i}" for i in range(8)]
    store, stream, rows = _taken(tmp_path, ids)
    with stream:
        start = threading.Barrier(2)
        outcomes: dict[str, object] = {}

        def commit(name: str) -> None:
            start.wait(5)
            try:
                outcomes[name] = stream.commit(rows, output=tmp_path / name)
            except ValueError as exc:
                outcomes[name] = exc

        threads = [threading.Thread(target=commit, args=(name,)) for name in ("step-a", "step-b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
        won = [name for name, outcome in outcomes.items() if not isinstance(outcome, Exception)]
        assert len(won) == 1, outcomes
        lost = next(outcome for outcome in outcomes.values() if isinstance(outcome, Exception))
        assert "\n" not in str(lost)
        steps = [p for p in (tmp_path / "step-a", tmp_path / "step-b") if is_committed(p)]
        assert steps == [tmp_path / won[0]] and sorted(output_rollout_ids(steps[0])) == ids
        assert (stream.stats.committed, stream.stats.retired) == (8, 8)


def test_a_commit_that_fails_before_its_step_returns_its_claim(tmp_path, monkeypatch):
    store, stream, rows = _taken(tmp_path, ["r1"])
    with stream:
        monkeypatch.setattr(StepCommit, "write", _crash)
        with pytest.raises(_Crash):
            stream.commit(rows, output=tmp_path / "step-0")
        monkeypatch.undo()
        assert stream.commit(rows, output=tmp_path / "step-1").retired == 1
    assert not is_committed(tmp_path / "step-0") and output_rollout_ids(tmp_path / "step-1") == {"r1"}


def test_rows_a_failed_commit_made_durable_in_a_step_are_committed_only_to_that_step(tmp_path, monkeypatch):
    store, stream, rows = _taken(tmp_path, ["r1"])
    with stream:
        monkeypatch.setattr(StepCommit, "retire", _crash)
        with pytest.raises(_Crash):
            stream.commit(rows, output=tmp_path / "step-0")
        monkeypatch.undo()
        for elsewhere in (tmp_path / "step-1", None):
            with pytest.raises(ValueError, match="already in the committed step dataset .*step-0"):
                stream.commit(rows, output=elsewhere)
        assert stream.commit(rows, output=tmp_path / "step-0").retired == 1  # the retried commit finishes
    assert not (tmp_path / "step-1").exists() and store.lifecycle("r1").retired


# --- 5. submit ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids", ["task7-0", b"task7-0"])
def test_submitting_one_string_is_a_type_error_that_freezes_nothing(tmp_path, ids):
    store = TokenCaptureStore(tmp_path)
    write(store, "task7-0")
    for rid in ("t", "a"):
        write(store, rid, calls=1)  # in progress
    with Stream([tmp_path], executor="local", watch=True) as stream:
        with pytest.raises(TypeError, match="wrap a single id in a list"):
            stream.submit(ids)
        assert stream.take(1, timeout=0.3).num_rows == 0
    for rid in ("t", "a"):
        assert not store.lifecycle(rid).frozen
        store.append(call(rid, "ok", 1))  # still open for writes: nothing was cut
    assert sorted(store.rollout_ids()) == ["a", "t", "task7-0"]  # no phantom "s", "k", "7", ...


def test_an_id_without_a_capture_is_refused_and_never_becomes_a_phantom_rollout(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "real")
    with Stream([tmp_path], executor="local", watch=True) as stream:
        submitted = stream.submit(["ghost", "real", "../up", "a/b"])
        assert submitted.ready == ("real",)
        assert set(submitted.refused) == {"ghost", "../up", "a/b"}
        assert "no capture of rollout ghost" in submitted.refused["ghost"]
        assert stream.take(1, timeout=10).column("rollout_id").to_pylist() == ["real"]
        assert stream.take(1, timeout=0.2).num_rows == 0
    assert store.rollout_ids() == ["real"] and not (tmp_path / "ghost.tokens.state.json").exists()
    assert not (tmp_path.parent / "up.tokens.state.json").exists()


def test_submit_refuses_what_is_not_a_list_of_string_ids(tmp_path):
    with Stream([tmp_path], executor="local") as stream:
        for ids in (None, 7, ["r1", 7], {"r1": 1}):
            with pytest.raises(TypeError):
                stream.submit(ids)
    assert list(tmp_path.glob("*.tokens.*")) == []


# --- 9. where a step may be written ---------------------------------------------------------------


def test_a_step_named_like_a_capture_file_is_refused_and_makes_no_phantom_rollout(tmp_path):
    store, stream, rows = _taken(tmp_path, ["r1"])
    with stream:
        with pytest.raises(StepRefused, match=r"named like a capture file"):
            stream.commit(rows, output=store.directory / "Z.tokens.jsonl")
        with pytest.raises(StepRefused, match="inside capture directory"):
            stream.commit(rows, output=store.directory / "steps" / "step-0")
        _untouched(store, ["r1"])
        assert stream.commit(rows, output=tmp_path / "step-0").retired == 1
    assert store.rollout_ids() == ["r1"] and not (store.directory / "steps").exists()


def test_a_step_inside_another_committed_output_is_refused_and_that_output_keeps_its_rows(tmp_path):
    store = TokenCaptureStore(tmp_path / "c")
    for rid in ("r1", "r2"):
        write(store, rid)
    outer = tmp_path / "step-0"
    with Stream([store.directory], executor="local") as stream:
        stream.submit(["r1", "r2"])
        stream.commit(stream.take(1, timeout=10), output=outer)
        rows = stream.take(1, timeout=10)
        with pytest.raises(StepRefused, match="inside the committed output"):
            stream.commit(rows, output=outer / "data" / "inner")
        with pytest.raises(OutputError):  # an OutputError, as rebuild_to_output raises
            stream.commit(rows, output=outer / "inner")
        _untouched(store, ["r2"])
        stream.commit(rows, output=tmp_path / "step-1")
    assert ds.dataset(outer, format="parquet").to_table().num_rows == 1
    assert sorted(p.name for p in (outer / "data").iterdir()) == ["part-000000.parquet"]


# --- 11. staleness arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"current_version": 5, "max_staleness": -1}, ValueError),
        ({"current_version": "5", "max_staleness": 1}, TypeError),
        ({"current_version": 5, "max_staleness": "1"}, TypeError),
        ({"current_version": 5.0, "max_staleness": 1}, TypeError),
        ({"current_version": 5, "max_staleness": True}, TypeError),
        ({"current_version": 5}, ValueError),
        ({"max_staleness": 1}, ValueError),
        ({"current_version": 1 << 70, "max_staleness": 1}, ValueError),
        ({"timeout": "1"}, TypeError),
        ({"timeout": float("nan")}, ValueError),
        ({"refs": "yes"}, TypeError),
    ],
    ids=["staleness-neg", "version-str", "staleness-str", "version-float", "staleness-bool", "version-alone",
         "staleness-alone", "version-huge", "timeout-str", "timeout-nan", "refs-str"],
)
def test_bad_take_arguments_are_refused_before_a_rollout_is_taken(tmp_path, args, error):
    store, stream, _ = _taken(tmp_path, ["r0"], version_key="policy_version")
    with stream:
        write(store, "r1", versions=[5, 5, 5])
        stream.submit(["r1"])
        with pytest.raises(error) as refused:
            stream.take(1, **{"timeout": 10, **args})
        assert "\n" not in str(refused.value)
        rows = stream.take(1, timeout=10, current_version=5, max_staleness=0)
        assert rows.column("rollout_id").to_pylist() == ["r1"]  # not lost off the queue
        assert rows.column("mask_sample").to_pylist() == [False]  # current rows are never stale
        assert stream.stats.stale == 0


@pytest.mark.parametrize(("n", "error"), [("2", TypeError), (2.0, TypeError), (True, TypeError), (None, TypeError),
                                          (0, ValueError), (-1, ValueError)])
def test_a_take_count_that_is_not_a_positive_int_is_refused_before_anything_is_taken(tmp_path, n, error):
    store, stream, _ = _taken(tmp_path, ["r0"])
    with stream:
        write(store, "r1")
        stream.submit(["r1"])
        with pytest.raises(error, match=r"take\(n\)"):
            stream.take(n, timeout=1)
        with pytest.raises(error, match=r"take\(n\)"):
            asyncio.run(stream.take_async(n, timeout=1))
        assert stream.take(1, timeout=10).column("rollout_id").to_pylist() == ["r1"]


def test_take_async_checks_its_arguments_before_the_thread_hop(tmp_path, monkeypatch):
    hops = []
    monkeypatch.setattr(asyncio, "to_thread", lambda *a, **k: hops.append(a))
    with Stream([tmp_path], executor="local") as stream, pytest.raises(TypeError):
        asyncio.run(stream.take_async(1, current_version="5", max_staleness=1))
    assert hops == []


# --- 12. quieter faults -----------------------------------------------------------------------------


def test_non_integer_versions_are_said_once_naming_the_key_and_a_rollout(tmp_path, caplog):
    store = TokenCaptureStore(tmp_path)
    for rid in ("s1", "s2"):
        for i in range(2):
            store.append(call(rid, "ok", i, version="5"))
    with Stream([tmp_path], executor="local", version_key="policy_version") as stream:
        stream.submit(["s1", "s2"])
        with caplog.at_level(logging.WARNING, logger="raycap.runs.stream"):
            stream.take(1, timeout=10, current_version=100, max_staleness=0)
            stream.take(1, timeout=10, current_version=100, max_staleness=0)
    said = [r.getMessage() for r in caplog.records if "policy_version" in r.getMessage()]
    assert len(said) == 1 and "s1" in said[0] and "never stale" in said[0]


def test_integer_versions_say_nothing(tmp_path, caplog):
    store = TokenCaptureStore(tmp_path)
    write(store, "v", versions=[1, 2, 3])
    with Stream([tmp_path], executor="local", version_key="policy_version") as stream:
        stream.submit(["v"])
        with caplog.at_level(logging.WARNING, logger="raycap.runs.stream"):
            stream.take(1, timeout=10, current_version=3, max_staleness=5)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_damaged_commit_marker_is_logged_once_naming_the_rollout_and_file_and_counted(tmp_path, caplog):
    store = TokenCaptureStore(tmp_path)
    write(store, "hidden")
    store.freeze_raw("hidden")
    store.commit_path("hidden").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="raycap.runs.stream"), Stream([tmp_path], executor="local") as stream:
        assert stream.take(1, timeout=0.3).num_rows == 0
        stream.dirs.rescan()  # judged again: said once
        assert stream.submit(["hidden"]).refused
        assert stream.stats.damaged_markers == 1
    said = [r.getMessage() for r in caplog.records if "commit marker" in r.getMessage() and "held back" in r.getMessage()]
    assert len(said) == 1 and "hidden" in said[0] and str(store.commit_path("hidden")) in said[0]


def test_a_stream_option_that_is_not_a_positive_int_is_refused(tmp_path):
    for options in ({"max_ahead_rows": 2.5}, {"max_ahead_rows": True}, {"max_ahead_bytes": "1"}, {"max_ahead_rows": 0}):
        with pytest.raises(ValueError, match="max_ahead"):
            Stream([tmp_path], executor="local", **options)


def test_a_commit_after_close_is_refused(tmp_path):
    store, stream, rows = _taken(tmp_path, ["r1"])
    stream.close()
    with pytest.raises(RuntimeError, match="closed"):
        stream.commit(rows, output=tmp_path / "step-0")
    _untouched(store, ["r1"])


# --- on Ray: rows left in the object store -----------------------------------------------------------


def test_refs_are_committed_once_whole_and_from_the_delivered_rows(ray_shared, tmp_path):
    import ray

    store = TokenCaptureStore(tmp_path / "c")
    ids = ["a", "b", "bad"]
    for rid in ids:
        write(store, rid, "two_roots" if rid == "bad" else "ok")
    with Stream([store.directory], executor="ray") as stream:
        stream.take_refs(1, timeout=0)  # a taker of refs: builds keep rows on Ray from now on
        stream.submit(ids)
        refs = stream.take_refs(3, timeout=120)
        assert not stream._commit.ledger._taken["a"].whole  # the rows stayed on Ray
        table = ray.get(refs[0])
        assert table.column("mask_sample").to_pylist() == [False, False, True]
        with pytest.raises(ValueError, match="more than once"):
            stream.commit([refs[0], refs[0]], output=tmp_path / "step-0")
        index = table.column_names.index("mask_sample")
        with pytest.raises(ValueError, match="rollout bad"):
            stream.commit(table.set_column(index, table.schema.field(index), pa.array([False] * 3)))
        # Values outside the verdict and identity are not trusted either: the step is
        # written from the delivered rows, which stayed on Ray.
        index = table.column_names.index("token_ids")
        forged = table.set_column(index, table.schema.field(index), pc.list_slice(table.column(index), 0, 1))
        _untouched(store, ids)
        report = stream.commit(forged, output=tmp_path / "step-0")
        with pytest.raises(ValueError, match="were not returned by take|committed already"):
            stream.commit(refs)
    assert (report.retired, report.kept_as_evidence) == (2, 1)
    assert _rows(tmp_path / "step-0").column("token_ids").equals(table.column("token_ids"))


def test_a_step_whose_shard_became_a_fifo_is_neither_waited_on_nor_trusted(tmp_path, caplog):
    store = TokenCaptureStore(tmp_path / "c")
    write(store, "evidence", "two_roots")  # masked: its capture and marker stay
    write(store, "next")
    step = tmp_path / "step-0"
    with Stream([store.directory], executor="local") as stream:
        stream.submit(["evidence"])
        stream.commit(stream.take(1, timeout=10), output=step)
    shard = step / "data" / "part-000000.parquet"
    shard.unlink()
    os.mkfifo(shard)
    done: dict[str, object] = {}

    def consume() -> None:
        with Stream([store.directory], executor="local") as stream:
            stream.submit(["next"])
            rows = stream.take(1, timeout=10)
            done["more"] = stream.take(1, timeout=0.3).num_rows
            try:
                stream.commit(rows, output=step)
            except ValueError as exc:
                done["refused"] = str(exc)
            done["taken"] = rows.column("rollout_id").to_pylist()

    with caplog.at_level(logging.WARNING, logger="raycap.runs.stream"):
        worker = threading.Thread(target=consume, daemon=True)
        worker.start()
        worker.join(30)
    assert not worker.is_alive(), "waited on a FIFO planted as a shard"
    assert done["taken"] == ["next"] and done["more"] == 0  # the rollout whose step cannot be read is held back
    assert "cannot be read" in done["refused"] and "\n" not in done["refused"]
    assert any("evidence" in r.getMessage() and "step-0" in r.getMessage() for r in caplog.records)
    assert store.read_commit("evidence") is not None and store.read_commit("next") is None


def test_a_huge_commit_marker_is_never_read_and_holds_its_rollout_back(tmp_path, caplog):
    store = TokenCaptureStore(tmp_path)
    write(store, "hidden")
    store.freeze_raw("hidden")
    with open(store.commit_path("hidden"), "wb") as marker:
        marker.truncate(1 << 30)  # sparse: 1 GiB that takes no disk
    with caplog.at_level(logging.WARNING, logger="raycap.runs.stream"), Stream([tmp_path], executor="local") as stream:
        assert stream.take(1, timeout=0.3).num_rows == 0
        assert stream.stats.damaged_markers == 1
    assert any("more than a commit marker's" in r.getMessage() for r in caplog.records)


def test_a_take_that_fails_after_taking_its_rollouts_off_the_queue_loses_none(tmp_path, monkeypatch):
    import raycap.stream.taking as stream_module  # where take applies the stale masks

    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    real = stream_module.mask_stale
    with Stream([tmp_path], executor="local") as stream:
        stream.submit(["r1"])
        monkeypatch.setattr(stream_module, "mask_stale", _crash)  # a fetch of a lost batch, say
        with pytest.raises(_Crash):
            stream.take(1, timeout=10)
        monkeypatch.setattr(stream_module, "mask_stale", real)
        assert stream.take(1, timeout=10).column("rollout_id").to_pylist() == ["r1"]
