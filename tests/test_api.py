"""One way to do each thing: the second calling forms still work, each with a
DeprecationWarning naming the one form, and give what the one form gives; the things
that were defined twice are defined once; the main entry points' examples run."""

from __future__ import annotations

import asyncio
import os
import warnings

import pyarrow.parquet as pq
import pytest

import raycap
from raycap import TokenCaptureStore
from raycap.output.manifest import shard_paths
from raycap.rows.options import RebuildOptions
from raycap.runs.stream import Stream
from test_stream import write


def _rows(output) -> list[dict]:
    return [row for path in shard_paths(output) for row in pq.read_table(path).to_pylist()]


# --- the deprecated second forms -------------------------------------------------------------


def test_retire_with_the_output_first_warns_and_retires_as_the_directories_first_does(corpus_copy, tmp_path):
    old, new = corpus_copy("old"), corpus_copy("new")
    raycap.rebuild_to_output([old], tmp_path / "out-old", model="m", executor="local")
    raycap.rebuild_to_output([new], tmp_path / "out-new", model="m", executor="local")

    with pytest.warns(DeprecationWarning, match=r"raycap\.retire\(capture_dirs, output\)") as caught:
        legacy = raycap.retire(str(tmp_path / "out-old"), [old], executor="local")
    assert caught[0].filename == __file__  # said of the caller's line, not of raycap's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = raycap.retire([new], str(tmp_path / "out-new"), executor="local")

    assert legacy.dropped == one.dropped > 0 and legacy.errors == one.errors == []
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == sorted(p.name for p in (tmp_path / "new").iterdir())


def _stream_of(tmp_path, name, ids):
    store = TokenCaptureStore(tmp_path / name)
    for rid in ids:
        write(store, rid)
    return Stream([store.directory], executor="local")


class _Ref:
    """What ray.put returns here: a handle on the table, so the comparison needs no Ray."""

    def __init__(self, table):
        self.table = table


def test_take_with_refs_warns_and_returns_what_take_refs_returns(tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "put", _Ref)  # rows built in this process go through ray.put
    ids = ["a", "b"]
    with _stream_of(tmp_path, "old", ids) as legacy, _stream_of(tmp_path, "new", ids) as stream:
        legacy.submit(ids)
        stream.submit(ids)
        with pytest.warns(DeprecationWarning, match=r"Stream\.take_refs\(") as caught:
            old = legacy.take(2, timeout=30, refs=True)
        assert caught[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new = stream.take_refs(2, timeout=30)
        assert isinstance(old, list) and isinstance(new, list) and len(old) == len(new) == 1
        same = ["rollout_id", "token_ids", "mask_sample", "n_calls"]
        assert old[0].table.select(same).to_pylist() == new[0].table.select(same).to_pylist()
        assert old[0].table.num_rows == 2
        # Either form's refs are what the ledger knows as refs this stream returned.
        assert set(legacy._commit.ledger._refs) == {old[0]} and set(stream._commit.ledger._refs) == {new[0]}


def test_take_async_with_refs_warns_and_names_take_refs_async(tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "put", _Ref)
    with _stream_of(tmp_path, "c", ["a"]) as stream:
        stream.submit(["a"])

        async def taker():
            return await stream.take_async(1, timeout=30, refs=True)

        with pytest.warns(DeprecationWarning, match=r"Stream\.take_refs_async\(") as caught:
            old = asyncio.run(taker())
        assert caught[0].filename == __file__
        assert len(old) == 1 and old[0].table.num_rows == 1
        assert asyncio.run(stream.take_refs_async(1, timeout=0))[0].table.num_rows == 0  # delivered once


def test_a_non_bool_refs_is_still_refused_before_anything_is_taken(tmp_path):
    with _stream_of(tmp_path, "c", ["a"]) as stream, pytest.raises(TypeError, match="refs must be True or False"):
        stream.take(1, timeout=0, refs="yes")


@pytest.mark.slow
def test_rebuild_to_output_with_options_warns_and_writes_what_the_keywords_write(corpus_copy, tmp_path):
    old, new = corpus_copy("old"), corpus_copy("new")
    options = RebuildOptions(model="m", executor="local", delivery="chains", batch_size=3)
    with pytest.warns(DeprecationWarning, match="pass the options as keywords") as caught:
        legacy = raycap.rebuild_to_output([old], tmp_path / "out-old", options=options)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = raycap.rebuild_to_output([new], tmp_path / "out-new", model="m", executor="local", delivery="chains",
                                       batch_size=3)
    assert legacy.status == one.status and legacy.summary.rollouts == one.summary.rollouts > 0

    def comparable(output):
        return sorted((r["rollout_id"], r["token_ids"], r["mask_sample"]) for r in _rows(output))

    assert comparable(tmp_path / "out-old") == comparable(tmp_path / "out-new")


# --- defined once --------------------------------------------------------------------------------


def test_inspect_reports_the_token_lengths_the_summary_reports(corpus_copy, tmp_path):
    from raycap.cli import inspection
    from raycap.cli.inspection import inspect_output
    from raycap.output import stats as shardstats

    assert inspection.LengthStats is shardstats.LengthStats
    outcome = raycap.rebuild_to_output([corpus_copy("c")], tmp_path / "out", model="m", executor="local")
    assert inspect_output(tmp_path / "out").length_stats == outcome.summary.token_lengths is not None


def test_one_directory_fsync_which_refuses_a_path_that_is_not_a_directory(tmp_path):
    from raycap.capture import files as capturefiles
    from raycap.output import durable

    assert durable.fsync_dir is capturefiles.fsync_dir
    capturefiles.fsync_dir(tmp_path)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        capturefiles.fsync_dir(tmp_path / "file")


def test_both_deliveries_read_frozen_parts_one_way(monkeypatch):
    from raycap.capture import consumer
    from raycap.rows.chains import build_frozen_chains

    monkeypatch.setattr(consumer, "read_frozen", lambda rollout_id, parts: f"rollout {rollout_id}: unreadable")
    assert consumer.build_frozen("r", [], model="m").error == "rollout r: unreadable"
    chains = build_frozen_chains("r", [], model="m")
    assert chains.rows == [] and chains.rollout.error == "rollout r: unreadable"


def test_the_output_lock_and_the_stream_lock_are_taken_one_way(tmp_path):
    from raycap.capture import files as capturefiles
    from raycap.output import commit as output
    from raycap.output.faults import OutputError
    from raycap.output.local import writes as localstore
    from raycap.stream import readiness

    assert localstore.lock_or_raise is readiness.lock_or_raise is capturefiles.lock_or_raise
    with output.output_lock(tmp_path / "out"), pytest.raises(OutputError, match="another run is writing"):
        with output.output_lock(tmp_path / "out"):
            pass
    fd = readiness.lock_directory(str(tmp_path))
    try:
        with pytest.raises(readiness.DirectoryBusy, match="another stream consumes"):
            readiness.lock_directory(str(tmp_path))
    finally:
        os.close(fd)


def test_node_actors_live_in_a_versioned_namespace_so_an_older_raycaps_are_not_reused():
    import re

    from raycap.cluster.nodes.actor import ACTOR_NAMESPACE

    assert ACTOR_NAMESPACE != "raycap"  # where the detached actors of an older raycap still live
    assert re.fullmatch(r"raycap-v\d+", ACTOR_NAMESPACE)


# --- options documented once; runnable examples ------------------------------------------------


def _entry_points():
    from raycap.api import rebuild
    from raycap.runs.handoff import rebuild_to_output
    from raycap.runs.rollouts import finalize_rollouts

    return {"rebuild": rebuild, "rebuild_to_output": rebuild_to_output, "finalize_rollouts": finalize_rollouts,
            "Stream": Stream}


def test_the_rebuild_options_are_documented_once_and_the_entry_points_refer_there():
    from raycap.runs.rebuilder import Rebuilder

    documented = RebuildOptions.__doc__
    for field in RebuildOptions.__dataclass_fields__:
        assert f"`{field}`" in documented, field
    for name, entry in {**_entry_points(), "Rebuilder": Rebuilder}.items():
        doc = entry.__doc__
        assert "raycap.rows.options.RebuildOptions" in doc, name
        # The executor's values and the capture bound are said in RebuildOptions only.
        assert '"auto", "ray" or "local"' not in doc and "(None: no limit)" not in doc, name


@pytest.mark.parametrize("name", ["rebuild", "rebuild_to_output", "finalize_rollouts", "Stream"])
def test_the_main_entry_points_have_examples_that_run(name):
    import doctest

    entry = _entry_points()[name]
    assert "Examples:" in entry.__doc__
    tests = doctest.DocTestFinder(recurse=False).find(entry, name, globs={})
    assert tests and tests[0].examples
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
