"""Tests for raycap.output.commit (the staged Parquet dataset, never inside a capture directory), the modules it
stands on (raycap.output.shards, raycap.output.manifest, raycap.output.durable) and raycap.output.summary (no Ray,
except the Ray Data reader test and a capture directory named by its node)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

import raycap
from raycap.capture.consumer import build_local
from raycap.capture.directory import CaptureDir
from raycap.capture.store import TokenCaptureStore
from raycap.output.commit import (
    Inputs,
    StagedOutput,
    check_output,
    check_placement,
    lock_path,
    rejected_path,
    set_aside,
    staging_path,
    summary_path,
)
from raycap.output.durable import write_json_durably
from raycap.output.faults import OutputError
from raycap.output.manifest import (
    MANIFEST_NAME,
    RETIRE_MARKER_NAME,
    is_committed,
    mark_retiring,
    output_rollout_ids,
    read_manifest,
    shard_paths,
    was_retired_from,
)
from raycap.output.shards import DATA_DIR, shard_name, write_shard
from raycap.output.summary import ProgressLine, RebuildSummary, ShardStats, Throughput, mask_gate, summarize
from raycap.rows.arrow import CHAIN_SCHEMA, builds_from_table, builds_to_table, chains_to_table
from raycap.runs.rollouts import finalize_rollouts

INPUTS = Inputs(("/captures/a",), None, "prefix_merging", "m")
CHAIN_INPUTS = Inputs(("/captures/a",), None, "prefix_merging", "m", "chains")


@pytest.fixture(scope="module")
def rows(fault_corpus, tmp_path_factory) -> pa.Table:
    """Rows of every fault shape, built locally (no Ray) from a copy of the fault corpus."""
    directory = tmp_path_factory.mktemp("output-rows") / "captures"
    shutil.copytree(fault_corpus.directory, directory)
    ids = TokenCaptureStore(directory).rollout_ids()
    return builds_to_table([build_local(rid, directory, model="m") for rid in ids])


@pytest.fixture(scope="module")
def chain_rows(fault_corpus, tmp_path_factory) -> pa.Table:
    """Chain-delivery rows of the same corpus: several rows for rollouts with branches."""
    from raycap.rows.chains import build_frozen_chains, failed_chains

    directory = tmp_path_factory.mktemp("output-chains") / "captures"
    shutil.copytree(fault_corpus.directory, directory)
    store = TokenCaptureStore(directory)
    builds = []
    for rid in store.rollout_ids():
        try:
            builds.append(build_frozen_chains(rid, [(str(directory), store.freeze_raw(rid))], model="m"))
        except Exception as exc:  # noqa: BLE001 - a failed freeze is a masked row, as on Ray
            builds.append(failed_chains(rid, "prefix_merging", "m", f"{type(exc).__name__}: {exc}"))
    table = chains_to_table(builds, [[str(directory)]] * len(builds))
    assert table.num_rows > len(builds)
    return table


def _batches(table: pa.Table, size: int = 7) -> list[pa.Table]:
    return [table.slice(start, size) for start in range(0, table.num_rows, size)]


def _by_rollout(table: pa.Table, per_batch: int = 5) -> list[pa.Table]:
    """Batches that never split a rollout's rows, as the driver cuts them."""
    ids = table.column("rollout_id").to_pylist()
    starts = [i for i, rid in enumerate(ids) if i == 0 or rid != ids[i - 1]]
    cuts = starts[::per_batch] + [len(ids)]
    return [table.slice(a, b - a) for a, b in zip(cuts, cuts[1:])]


def _commit(output, tables, inputs=INPUTS, schema="rollout", **kwargs):
    with StagedOutput(output, inputs=inputs, schema=schema, **kwargs) as staged:
        shards = [write_shard(staged.staging, i, t) for i, t in enumerate(tables)]
        return staged.commit(shards)


# --- shards ---------------------------------------------------------------------------------------


def test_a_shard_is_fsynced_renamed_and_its_directory_fsynced(rows, tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", f"{src} -> {dst}"))
        return real_replace(src, dst)

    (tmp_path / DATA_DIR).mkdir()  # as StagedOutput makes it
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    info = write_shard(tmp_path, 3, rows.slice(0, 7))

    target = tmp_path / "data" / "part-000003.parquet"
    assert info.name == shard_name(3) == "data/part-000003.parquet"
    temp = events[0][1]
    assert os.path.basename(temp).startswith(".part-000003.parquet.tmp-")
    assert events == [("fsync", temp), ("replace", f"{temp} -> {target}"), ("fsync", str(target.parent))]
    assert [p.name for p in tmp_path.iterdir()] == [DATA_DIR] and [p.name for p in target.parent.iterdir()] == [target.name]
    assert info.rows == 7 and info.file_bytes == target.stat().st_size and info.arrow_bytes == rows.slice(0, 7).nbytes
    assert builds_from_table(pq.read_table(target)) == builds_from_table(rows.slice(0, 7))


def test_a_retried_batch_replaces_its_own_shard(rows, tmp_path):
    write_shard(tmp_path, 0, rows.slice(0, 3))
    again = write_shard(tmp_path, 0, rows.slice(0, 5))
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()] == ["data/part-000000.parquet"]
    assert pq.read_table(tmp_path / again.name).num_rows == 5


def test_a_shard_refuses_other_rows_and_a_missing_staging_directory(rows, tmp_path):
    with pytest.raises(OutputError, match="do not have the rollout or chain schema"):
        write_shard(tmp_path, 0, pa.table({"x": [1]}))
    with pytest.raises(OutputError, match="does not exist on this node; .*shared file system"):
        write_shard(tmp_path / "gone", 0, rows.slice(0, 1))


def test_shard_info_is_small_and_survives_pickling(rows):
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        info = write_shard(directory, 0, rows.slice(0, 7))
    data = pickle.dumps(info)
    assert len(data) < 4096
    back = pickle.loads(data)
    assert back == info and back.stats.delivered_fractions.tolist() == info.stats.delivered_fractions.tolist()
    listed = rows.slice(0, 7).select(["mask_sample", "error"]).to_pylist()
    assert info.retirable == sum(1 for r in listed if r["mask_sample"] is False and r["error"] is None) > 0


# --- the staged run and its commit ---------------------------------------------------------------------


def test_nothing_is_visible_at_the_output_until_the_commit(rows, tmp_path):
    out = tmp_path / "rows"
    with StagedOutput(out, inputs=INPUTS) as staged:
        assert staged.staging == staging_path(out) == tmp_path / ".rows.staging" and staged.staging.is_dir()
        shards = [write_shard(staged.staging, i, t) for i, t in enumerate(_batches(rows))]
        assert not out.exists() and not is_committed(out)
        seen = []
        committed = staged.commit(shards, before_rename=lambda: seen.append(out.exists()))
    assert seen == [False]
    assert committed.path == out and committed.superseded is None and is_committed(out)
    assert not staging_path(out).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME, DATA_DIR])
    assert sorted(f"{DATA_DIR}/{p.name}" for p in (out / DATA_DIR).iterdir()) == [s.name for s in shards]
    assert shard_paths(out) == [out / s.name for s in shards]
    assert builds_from_table(pq.read_table(out)) == builds_from_table(rows)


def test_the_commit_writes_the_manifest_then_renames_then_fsyncs_the_parent(rows, tmp_path, monkeypatch):
    out = tmp_path / "rows"
    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename
    with StagedOutput(out, inputs=INPUTS) as staged:
        shards = [write_shard(staged.staging, 0, rows)]
        monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
        monkeypatch.setattr(os, "rename", lambda a, b: (events.append(f"rename {a} -> {b}"), real_rename(a, b))[1])
        staged.commit(shards, before_rename=lambda: events.append("before rename"))
    staging = str(staging_path(out))
    manifest_temp = next(e for e in events if MANIFEST_NAME in e).split(" ", 1)[1]
    assert events == [
        f"fsync {manifest_temp}",  # the manifest's temp file
        f"fsync {staging}",  # the staging directory, after the manifest's rename into it
        "before rename",
        f"rename {staging} -> {out}",
        f"fsync {tmp_path}",
    ]


def test_the_manifest_records_inputs_schema_shards_and_totals(rows, tmp_path):
    out = tmp_path / "rows"
    inputs = Inputs(("/a", "node:/b"), ("r1", "r2"), "prefix_merging", "m")
    committed = _commit(out, _batches(rows), inputs=inputs)
    raw = json.loads((out / MANIFEST_NAME).read_text())
    assert raw["format"] == "raycap.dataset" and raw["schema"] == "rollout" and raw["schema_version"] == 2
    assert raw["fingerprint"] == inputs.fingerprint()
    assert raw["inputs"] == {"builder": "prefix_merging", "capture_dirs": ["/a", "node:/b"], "model": "m", "rollout_ids": "2 given"}
    assert [s["name"] for s in raw["shards"]] == [shard_name(i) for i in range(len(_batches(rows)))]
    assert raw["rows"] == raw["rollouts"] == rows.num_rows == sum(s["rows"] for s in raw["shards"])
    assert raw["file_bytes"] == sum(p.stat().st_size for p in shard_paths(out))
    manifest = read_manifest(out)
    assert manifest == committed.manifest
    assert manifest.totals.masked == sum(s.stats.masked for s in manifest.shards) > 0
    assert manifest.delivered_fraction is not None and "delivered_fractions" not in raw["totals"]


def test_leftovers_of_a_dead_run_are_removed_and_never_committed(rows, tmp_path):
    out = tmp_path / "rows"
    # A run killed after its manifest, before the rename: a complete-looking staging directory.
    dead = staging_path(out)
    dead.mkdir()
    write_shard(dead, 0, rows.slice(0, 4))
    write_shard(dead, 1, rows.slice(4, 4))
    (dead / ".part-000002.parquet.tmp-123").write_bytes(b"half")
    (dead / MANIFEST_NAME).write_text("{}")
    with StagedOutput(out, inputs=INPUTS) as staged:
        assert [p.name for p in staged.staging.rglob("*")] == [DATA_DIR]
        staged.commit([write_shard(staged.staging, 0, rows.slice(10, 3))])
    assert pq.read_table(out, columns=["rollout_id"]).column(0).to_pylist() == rows.column("rollout_id").to_pylist()[10:13]


def test_an_aborted_run_leaves_nothing_not_even_its_lock_file(rows, tmp_path):
    out = tmp_path / "steps" / "rows"
    with pytest.raises(RuntimeError, match="worker lost"):
        with StagedOutput(out, inputs=INPUTS) as staged:
            write_shard(staged.staging, 0, rows.slice(0, 3))
            raise RuntimeError("worker lost")
    assert list(tmp_path.iterdir()) == []  # nor the folder it made for the output
    # A lock file that was there before the run stays: another run may hold it open.
    out.parent.mkdir()
    lock_path(out).touch()
    with pytest.raises(RuntimeError, match="worker lost"):
        with StagedOutput(out, inputs=INPUTS):
            raise RuntimeError("worker lost")
    assert [p.name for p in out.parent.iterdir()] == [lock_path(out).name]


def test_a_failed_commit_publishes_nothing(rows, tmp_path):
    out = tmp_path / "rows"
    with pytest.raises(OutputError, match="is missing from .*storage every node can see"):
        with StagedOutput(out, inputs=INPUTS) as staged:
            info = write_shard(staged.staging, 0, rows.slice(0, 3))
            (staged.staging / info.name).unlink()
            staged.commit([info])
    assert not out.exists() and not staging_path(out).exists()
    with pytest.raises(OutputError, match="has \\d+ bytes, its task reported"):
        with StagedOutput(out, inputs=INPUTS) as staged:
            info = write_shard(staged.staging, 0, rows.slice(0, 3))
            write_shard(staged.staging, 0, rows.slice(0, 9))
            staged.commit([info])
    with pytest.raises(OutputError, match="holds chains rows; this output is rollout"):
        with StagedOutput(out, inputs=INPUTS) as staged:
            staged.commit([write_shard(staged.staging, 0, CHAIN_SCHEMA.empty_table())])
    assert not out.exists()


def test_the_commit_publishes_exactly_the_listed_shards(rows, tmp_path):
    out = tmp_path / "rows"
    with StagedOutput(out, inputs=INPUTS) as staged:
        listed = write_shard(staged.staging, 0, rows.slice(0, 3))
        write_shard(staged.staging, 1, rows.slice(3, 3))  # e.g. a zombie attempt of an old plan
        (staged.staging / DATA_DIR / ".part-000001.parquet.tmp-abc").write_bytes(b"x")
        (staged.staging / "stray.parquet").write_bytes(b"x")
        staged.commit([listed])
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, DATA_DIR]
    assert [f"{DATA_DIR}/{p.name}" for p in (out / DATA_DIR).iterdir()] == [listed.name]
    assert pq.read_table(out).num_rows == 3


def test_the_commit_keeps_exactly_the_listed_records_parts(rows, tmp_path):
    from raycap.output.recordparts import RECORDS_DIR, RecordCounts, RecordsManifest, write_records_part

    out = tmp_path / "rows"
    with StagedOutput(out, inputs=INPUTS) as staged:
        shard = write_shard(staged.staging, 0, rows.slice(0, 3))
        first = write_records_part(staged.staging, 0, [b'{"a":1}', b'{"a":2}'], first_index=0, records=2)
        second = write_records_part(staged.staging, 1, [b'{"a":3}'], first_index=2, records=1)
        write_records_part(staged.staging, 2, [b'{"zombie":1}'], first_index=3, records=1)  # an attempt of an old plan
        (staged.staging / RECORDS_DIR / ".part-000001.jsonl.tmp-abc").write_bytes(b"x")
        records = RecordsManifest((first, second), RecordCounts(records=3))
        committed = staged.commit([shard], records=records)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, RECORDS_DIR, DATA_DIR]
    assert sorted(f"{RECORDS_DIR}/{p.name}" for p in (out / RECORDS_DIR).iterdir()) == [first.name, second.name]
    assert read_manifest(out).records == committed.manifest.records
    with pytest.raises(OutputError, match="records part .records/part-000005.jsonl is missing"):
        with StagedOutput(tmp_path / "other", inputs=INPUTS) as staged:
            shard = write_shard(staged.staging, 0, rows.slice(0, 3))
            part = write_records_part(staged.staging, 5, [b"{}"], first_index=0, records=1)
            (staged.staging / part.name).unlink()
            staged.commit([shard], records=RecordsManifest((part,), RecordCounts(records=1)))


def test_an_empty_run_commits_an_empty_table_with_the_schema(tmp_path):
    out = tmp_path / "chains"
    committed = _commit(out, [], inputs=CHAIN_INPUTS, schema="chains")
    table = pq.read_table(out)
    assert table.num_rows == 0 and table.schema.remove_metadata().equals(CHAIN_SCHEMA)
    assert committed.manifest.rows == 0 and committed.manifest.delivered_fraction is None
    assert summarize(committed.manifest).rows == 0


def test_another_live_run_holds_the_output(rows, tmp_path):
    out = tmp_path / "rows"
    out.parent.mkdir(exist_ok=True)
    other = os.open(lock_path(out), os.O_WRONLY | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's lock, as flock sees it
    try:
        with pytest.raises(OutputError, match="another run is writing .*wait for it or choose another output"):
            with StagedOutput(out, inputs=INPUTS):
                pass
    finally:
        os.close(other)
    _commit(out, [rows.slice(0, 2)])  # free again
    assert pq.read_table(out).num_rows == 2


def test_a_dead_runs_lock_is_free(rows, tmp_path):
    out = tmp_path / "rows"
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.kill(os.getpid(), 9)"
    )
    subprocess.run([sys.executable, "-c", code, str(lock_path(out))], timeout=60)
    _commit(out, [rows.slice(0, 2)])
    assert is_committed(out)


# --- readers -----------------------------------------------------------------------------------------


def _committed_with_metadata(rows, tmp_path):
    out = tmp_path / "rows"
    _commit(out, _batches(rows))
    mark_retiring(out, "started")
    write_json_durably(summary_path(out), {"a": 1})
    return out


def test_the_dataset_reads_as_one_table_in_rollout_order_with_pyarrow_and_pandas(rows, tmp_path):
    out = _committed_with_metadata(rows, tmp_path)
    expected = builds_from_table(rows)
    assert builds_from_table(pq.read_table(out)) == expected
    assert builds_from_table(pads.dataset(out, format="parquet").to_table()) == expected
    import pandas

    frame = pandas.read_parquet(out)
    assert frame["rollout_id"].tolist() == rows.column("rollout_id").to_pylist()
    assert output_rollout_ids(out) == set(rows.column("rollout_id").to_pylist())


def test_the_dataset_reads_with_duckdb(rows, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    out = _committed_with_metadata(rows, tmp_path)
    got = duckdb.sql(f"SELECT rollout_id, mask_sample, len(token_ids) AS n FROM read_parquet('{out}/**/*.parquet')").fetchall()
    want = [(r["rollout_id"], r["mask_sample"], None if r["token_ids"] is None else len(r["token_ids"]))
            for r in rows.select(["rollout_id", "mask_sample", "token_ids"]).to_pylist()]
    assert sorted(got, key=lambda r: r[0]) == sorted(want, key=lambda r: r[0])


def test_the_dataset_reads_with_ray_data(ray_shared, rows, tmp_path):
    import raycap

    out = _committed_with_metadata(rows, tmp_path)
    dataset = raycap.dataset(out)
    table = pa.concat_tables(dataset.iter_batches(batch_format="pyarrow", batch_size=None))
    assert sorted(table.column("rollout_id").to_pylist()) == sorted(rows.column("rollout_id").to_pylist())
    got = {b["rollout_id"]: b for b in builds_from_table(table)}
    assert got == {b["rollout_id"]: b for b in builds_from_table(rows)}
    with pytest.raises(OutputError, match="not a committed raycap output"):
        raycap.dataset(tmp_path / "nothing")


def test_the_dataset_reads_the_listed_shards_without_a_listing_pass(ray_shared, rows, tmp_path):
    """Ray Data's listing reader starts a pool of footer-reading actors (new processes)
    for every read; the manifest names every shard, so raycap.dataset reads them as
    named, and leaves the process's Ray Data context as it found it."""
    import ray.data

    import raycap

    out = _committed_with_metadata(rows, tmp_path)
    context = ray.data.DataContext.get_current()
    before = context.use_datasource_v2
    dataset = raycap.dataset(out, columns=["rollout_id"]).materialize()
    assert "ListFiles" not in dataset.stats()
    assert sorted(dataset.to_pandas()["rollout_id"]) == sorted(rows.column("rollout_id").to_pylist())
    assert context.use_datasource_v2 == before


# --- deciding between reuse and rewrite -------------------------------------------------------------------


def test_a_new_output_is_written_and_its_directory_created(tmp_path):
    out = tmp_path / "deep" / "er" / "rows"
    assert check_output(out, INPUTS).reuse is False
    assert out.parent.is_dir() and list(out.parent.iterdir()) == []
    (tmp_path / "empty").mkdir()
    assert check_output(tmp_path / "empty", INPUTS).reuse is False


def test_an_output_of_the_same_inputs_is_reused(rows, tmp_path):
    out = tmp_path / "rows"
    committed = _commit(out, [rows])
    checked = check_output(out, INPUTS)
    assert checked.reuse is True and checked.manifest == committed.manifest  # handed on, not read again
    assert check_output(out, INPUTS, overwrite=True).reuse is True  # the same inputs are never rebuilt


def test_an_output_of_other_inputs_is_refused_unless_overwriting(rows, tmp_path):
    out = tmp_path / "rows"
    _commit(out, [rows], inputs=Inputs(("/elsewhere",), None, "prefix_merging", "m"))
    with pytest.raises(OutputError, match="different inputs.*overwrite: true"):
        check_output(out, INPUTS)
    assert check_output(out, INPUTS, overwrite=True).reuse is False
    (out / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(OutputError, match="an unreadable manifest"):
        check_output(out, INPUTS)


def test_a_single_file_output_of_the_previous_format_is_refused_unless_overwriting(tmp_path):
    out = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"rollout_id": ["r0"], "mask_sample": [False]}), out)
    with pytest.raises(OutputError, match="is a file .*overwrite: true"):
        check_output(out, INPUTS)
    assert check_output(out, INPUTS, overwrite=True).reuse is False


def test_overwrite_never_replaces_a_file_that_is_not_raycap_rows(tmp_path):
    (tmp_path / "other.parquet").write_bytes(b"")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    (tmp_path / "afile.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "afile.txt")
    for name in ("other.parquet", "afile.txt", "link"):
        with pytest.raises(OutputError, match="is not a raycap output; overwrite replaces only a raycap output"):
            check_output(tmp_path / name, INPUTS, overwrite=True)


def test_a_directory_that_is_no_raycap_output_is_always_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="is a directory that is not a raycap output"):
            check_output(tmp_path / "mine", INPUTS, overwrite=overwrite)


def test_an_output_that_cannot_be_created_fails_before_any_work(tmp_path):
    (tmp_path / "blocker").write_text("a file, not a directory")
    with pytest.raises(OutputError, match="cannot write output .*choose a writable output directory"):
        check_output(tmp_path / "blocker" / "rows", INPUTS)
    with pytest.raises(OutputError, match="cannot write output .*choose a writable output directory"):
        with StagedOutput(tmp_path / "blocker" / "rows", inputs=INPUTS):
            pass


# --- overwriting moves aside, never deletes ------------------------------------------------------------------


def test_overwriting_moves_the_old_output_aside_and_says_if_it_was_retired_from(rows, tmp_path):
    out = tmp_path / "rows"
    _commit(out, [rows.slice(0, 4)], inputs=Inputs(("/old",), None, "prefix_merging", "m"))
    write_json_durably(summary_path(out), {"old": True})
    old_shards = sorted(p.name for p in out.iterdir())
    committed = _commit(out, [rows.slice(4, 2)], overwrite=True)
    moved = committed.superseded
    assert moved is not None and moved.name.startswith("rows.superseded-") and moved.name.endswith("Z")
    assert sorted(p.name for p in moved.iterdir()) == old_shards  # intact
    assert json.loads(summary_path(moved).read_text()) == {"old": True} and not summary_path(out).exists()
    assert pq.read_table(out).num_rows == 2

    # Retirement started on the current output: its rows may be the only copy left.
    mark_retiring(out, "started")
    assert was_retired_from(out)
    again = _commit(out, [rows.slice(6, 1)], overwrite=True)
    assert again.superseded.name.startswith("rows.retired-superseded-")
    assert pq.read_table(again.superseded).num_rows == 2 and pq.read_table(out).num_rows == 1


def test_overwriting_a_single_file_output_moves_it_aside(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    pq.write_table(rows.slice(0, 3), out)
    before = out.read_bytes()
    committed = _commit(out, [rows.slice(3, 3)], overwrite=True)
    assert committed.superseded.read_bytes() == before and is_committed(out)


def test_an_output_that_appears_during_the_run_is_not_replaced_without_overwrite(rows, tmp_path):
    out = tmp_path / "rows"
    with pytest.raises(OutputError, match="appeared while this run was building"):
        with StagedOutput(out, inputs=INPUTS) as staged:
            info = write_shard(staged.staging, 0, rows.slice(0, 2))
            out.mkdir()
            (out / "x").write_text("someone else's")
            staged.commit([info])
    assert (out / "x").read_text() == "someone else's" and not staging_path(out).exists()


def test_a_rejected_output_is_set_aside_with_its_summary(rows, tmp_path):
    out = tmp_path / "rows"
    _commit(out, [rows.slice(0, 3)])
    write_json_durably(summary_path(out), {"run": 1})
    kept = set_aside(out)
    assert kept == rejected_path(out) and is_committed(kept) and not out.exists()
    assert json.loads(summary_path(kept).read_text()) == {"run": 1}

    # A later rejection replaces a rejected output nothing was retired from ...
    _commit(out, [rows.slice(0, 5)])
    assert pq.read_table(set_aside(out)).num_rows == 5
    # ... but moves aside one that retirement had started on.
    mark_retiring(rejected_path(out), "started")
    _commit(out, [rows.slice(0, 6)])
    set_aside(out)
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("rows.rejected.retired-superseded-")]
    assert len(moved) == 1 and pq.read_table(moved[0]).num_rows == 5
    assert pq.read_table(rejected_path(out)).num_rows == 6


def test_the_retire_marker_keeps_its_first_start(rows, tmp_path):
    out = tmp_path / "rows"
    _commit(out, [rows.slice(0, 1)])
    assert not was_retired_from(out)
    mark_retiring(out, "started")
    first = json.loads((out / RETIRE_MARKER_NAME).read_text())
    mark_retiring(out, "finished", dropped=1)
    second = json.loads((out / RETIRE_MARKER_NAME).read_text())
    assert second["first_started_at"] == first["first_started_at"] == second["started_at"]
    assert second["state"] == "finished" and second["dropped"] == 1 and "finished_at" in second
    assert pq.read_table(out).num_rows == 1  # readers skip the marker


def test_json_is_replaced_atomically(tmp_path):
    target = summary_path(tmp_path / "rows")
    assert target.name == "rows.summary.json"
    write_json_durably(target, {"a": 1})
    write_json_durably(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


# --- the summary, from shard stats -----------------------------------------------------------------------------


def _from_rows(table: pa.Table) -> dict:
    """The summary's numbers computed straight from the rows, row by row (the oracle)."""
    listed = table.drop_columns([c for c in ("token_ids", "logprobs", "call_output_items") if c in table.column_names]).to_pylist()
    chains = "chain_id" in table.column_names
    reasons: dict[str, int] = {}
    for r in listed:
        if r["mask_sample"] is not False:
            for reason in set(r["mask_reasons"] or ["unknown"]):
                reasons[reason] = reasons.get(reason, 0) + 1
    first: dict[str, dict] = {}
    live: dict[str, dict] = {}
    for r in listed:
        first.setdefault(r["rollout_id"], r)
        if r["mask_sample"] is False:
            live.setdefault(r["rollout_id"], r)
    if chains:
        captured = sum(r["generated_tokens_captured"] or 0 for r in first.values())
        delivered = sum(r["generated_tokens_delivered"] or 0 for r in first.values())
        fractions = [r["delivered_fraction"] for r in live.values() if r["delivered_fraction"] is not None]
        by_main = sum(sum(r["loss_mask"] or []) for r in listed if r["is_main"] and r["rollout_mask_sample"] is False)
    else:
        captured = sum(r["generated_tokens_captured"] or 0 for r in listed)
        delivered = sum(r["generated_tokens_delivered"] or 0 for r in listed if r["mask_sample"] is False)
        fractions = [r["delivered_fraction"] for r in listed if r["mask_sample"] is False and r["delivered_fraction"] is not None]
        by_main = None
    p = None if not fractions else tuple(round(float(v), 4) for v in np.percentile(fractions, [10, 50, 90]))
    return {
        "rows": len(listed),
        "rollouts": len(first),
        "masked": sum(1 for r in listed if r["mask_sample"] is not False),
        "failed": sum(1 for r in listed if r["mask_sample"] is not False and r["error"] is not None),
        "reasons": reasons,
        "captured": captured,
        "delivered": delivered,
        "percentiles": p,
        "by_main": by_main,
    }


def _as_numbers(summary: RebuildSummary) -> dict:
    d = summary.delivered_fraction
    return {
        "rows": summary.row_count,
        "rollouts": summary.rollouts,
        "masked": summary.masked,
        "failed": summary.failed,
        "reasons": summary.masked_by_reason,
        "captured": summary.generated_tokens_captured,
        "delivered": summary.generated_tokens_delivered,
        "percentiles": None if d is None else (d.p10, d.p50, d.p90),
        "by_main": summary.rollout_delivery_tokens,
    }


@pytest.mark.parametrize("delivery", ["rollout", "chains"])
def test_the_summary_from_shard_stats_equals_the_summary_from_the_rows(rows, chain_rows, delivery, tmp_path):
    table = chain_rows if delivery == "chains" else rows
    out = tmp_path / "rows"
    committed = _commit(out, _by_rollout(table), inputs=CHAIN_INPUTS if delivery == "chains" else INPUTS, schema=delivery)
    expected = _from_rows(table)
    assert 0 < expected["masked"] < expected["rows"] and expected["percentiles"]

    fresh = summarize(committed.manifest, throughput=Throughput(2.0, 20.0, 1.5))
    reread = summarize(read_manifest(out), reused=True)  # through the manifest's JSON
    assert _as_numbers(fresh) == _as_numbers(reread) == expected
    assert list(fresh.masked_by_reason.values()) == sorted(fresh.masked_by_reason.values(), reverse=True)
    assert fresh.output_bytes == sum(p.stat().st_size for p in shard_paths(out))
    assert fresh.error_examples and all(": " in e for e in fresh.error_examples)
    assert fresh.delivery == delivery

    as_json = json.loads(json.dumps(fresh.to_json()))
    assert as_json["masked_fraction"] == round(expected["masked"] / expected["rows"], 4)
    assert as_json["throughput"] == {"seconds": 2.0, "rollouts_per_s": 20.0, "mb_per_s": 1.5}
    text = fresh.render()
    for reason in expected["reasons"]:
        assert f"  {reason}" in text
    assert "20.0 rollouts/s, 1.5 MB/s" in text and "p50" in text and "e.g." in text
    assert ("vs rollout delivery" in text) is (delivery == "chains")


def test_shard_stats_add_up_in_any_grouping(rows):
    from dataclasses import replace

    def counts(stats: ShardStats) -> ShardStats:  # examples are the first few of each shard, not of the whole
        return replace(stats, error_examples=())

    parts = [ShardStats.from_table(t) for t in _batches(rows, 5)]
    whole = ShardStats.from_table(rows)
    assert counts(ShardStats.merge(parts)) == counts(whole)
    assert counts((parts[0] + parts[1]) + ShardStats.merge(parts[2:])) == counts(whole)
    assert ShardStats.merge(parts).error_examples[: len(parts[0].error_examples)] == parts[0].error_examples
    assert ShardStats.from_json(json.loads(json.dumps(whole.to_json()))).to_json() == whole.to_json()
    assert ShardStats.merge([], "chains").rows == 0


def test_a_summary_with_no_unmasked_rows_has_no_percentiles(rows, tmp_path):
    out = tmp_path / "rows"
    committed = _commit(out, [rows.filter(pc.field("mask_sample"))])
    summary = summarize(committed.manifest, reused=True, superseded="/x/rows.superseded-1")
    assert summary.delivered_fraction is None and summary.generated_tokens_delivered == 0
    text = summary.render()
    assert "no unmasked rows" in text and "reused" in text and "moved to /x/rows.superseded-1" in text


def _summary(rollouts: int, masked: int) -> RebuildSummary:
    return RebuildSummary("o", rollouts, masked, 0, {"ValidationError": masked}, None, 0, 0, 0)


def test_the_mask_gate_applies_only_from_the_minimum_sample_count():
    assert mask_gate(_summary(10, 9), None, 0) is None
    small = mask_gate(_summary(10, 9), 0.5, 50)
    assert small.passed and not small.applied and "not applied" in small.message
    ok = mask_gate(_summary(100, 50), 0.5, 50)
    assert ok.passed and ok.applied
    bad = mask_gate(_summary(100, 51), 0.5, 50)
    assert not bad.passed and "51 of 100" in bad.message and "ValidationError 51" in bad.message


# --- the progress line --------------------------------------------------------------------


class _Progress:
    def __init__(self, total: int, done: int, started: float):
        self.total, self.done, self.started = total, done, started


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal():
    stream = _Terminal()
    line = ProgressLine("rebuild", stream, interval=0.0)
    for done in (0, 5, 10):
        line(_Progress(10, done, started=0.0))
    line.finish()
    text = stream.getvalue()
    assert text.count("\r") == 4 and text.count("\n") == 1 and text.endswith("\n")
    assert "5/10 rollouts" in text and "rebuild: 10/10 rollouts in" in text


def test_progress_off_a_terminal_prints_whole_lines_never_redraws():
    stream = io.StringIO()
    line = ProgressLine("rebuild", stream, interval=0.0)
    for done in range(0, 11):
        line(_Progress(10, done, started=0.0))
    line.finish()
    text = stream.getvalue()
    # One line per tenth (tests/test_observe.py has the rest), then the final line.
    assert "\r" not in text and text.count("\n") == 10 and text.splitlines()[-1].startswith("rebuild: 10/10 rollouts in")


@pytest.mark.slow
def test_the_output_summary_handoff_and_feed_modules_do_not_import_ray():
    code = (
        "import sys, raycap.output.commit, raycap.output.summary, raycap.runs.handoff, raycap.train.feed; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- the committed place, the output's place, and faults of its file system ----------------------


def test_only_the_output_at_its_committed_place_counts_as_committed_for_retirement(rows, tmp_path):
    from raycap.output.manifest import committed_manifest

    out = tmp_path / "rows"
    _commit(out, [rows.slice(0, 3)])
    assert committed_manifest(out).committed_as == str(out.resolve())
    shutil.copytree(out, staging_path(out))
    shutil.copytree(out, tmp_path / "copy")
    for elsewhere in (staging_path(out), tmp_path / "copy"):
        with pytest.raises(OutputError, match=f"committed as {out.resolve()}"):
            committed_manifest(elsewhere)
    kept = set_aside(out)
    with pytest.raises(OutputError, match="set-aside"):
        committed_manifest(kept)


def test_an_output_is_refused_inside_a_capture_directory_a_committed_output_or_named_like_a_capture(rows, tmp_path):
    from raycap.output.commit import check_placement

    captures = tmp_path / "captures"
    captures.mkdir()
    (tmp_path / "link").symlink_to(captures)
    outer = tmp_path / "outer"
    _commit(outer, [rows.slice(0, 3)])
    for output, reason in [
        (captures / "rows", "inside capture directory"),
        (tmp_path / "link" / "deeper" / "rows", "inside capture directory"),
        (captures, "inside capture directory"),
        (outer / "inner", "inside the committed output"),
        (tmp_path / "r1.tokens.jsonl", "named like a capture file"),
    ]:
        with pytest.raises(OutputError, match=reason):
            check_placement(output, [str(captures)])
    check_placement(tmp_path / "rows", [str(captures)])  # beside them is fine


def test_an_output_inside_another_nodes_capture_directory_is_refused_by_its_path_alone(tmp_path):
    from raycap.output.commit import check_placement

    # A directory that lives on another node is never looked at from here: its path says it.
    remote = ("n1:/data/captures", "/data/captures")
    with pytest.raises(OutputError, match="inside capture directory n1:/data/captures"):
        check_placement("/data/captures/step-0", elsewhere=[remote])
    check_placement(tmp_path / "step-0", elsewhere=[remote])
    check_placement(tmp_path / "captures-2", elsewhere=[(f"n1:{tmp_path}/captures", f"{tmp_path}/captures")])


def test_a_shard_write_that_hits_a_full_disk_raises_output_write_error_naming_the_output(rows, tmp_path, monkeypatch):
    import errno

    from raycap.output.faults import OutputWriteError
    from raycap.output.shards import write_shard

    out = tmp_path / "rows"
    staging = staging_path(out)
    staging.mkdir()

    def full(table, where, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pq, "write_table", full)
    with pytest.raises(OutputWriteError, match=rf"cannot write output {out} .*No space left on device") as caught:
        write_shard(staging, 0, rows.slice(0, 3))
    assert "\n" not in str(caught.value) and [p.name for p in staging.rglob("*")] == [DATA_DIR]
    # A Ray task's exception crosses processes pickled: it must survive the trip.
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)


def test_a_staged_run_given_the_held_lock_does_not_take_it_again_and_refuses_another_outputs(rows, tmp_path):
    from raycap.output.commit import output_lock

    out = tmp_path / "rows"
    with output_lock(out) as lock:
        # Taking it again would fail: the lock is not re-entrant.
        committed = _commit(out, [rows.slice(0, 3)], lock=lock)
        with pytest.raises(ValueError, match="not held on it"):
            StagedOutput(tmp_path / "other", inputs=INPUTS, lock=lock)
    assert committed.manifest.rows == 3
    with pytest.raises(ValueError, match="not held on it"):
        StagedOutput(out, inputs=INPUTS, lock=lock)  # released


# --- nothing is written inside a capture directory, however it was named -----------------------------


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


def test_records_file_and_output_inside_a_node_named_capture_directory_are_refused(ray_shared, collection, tmp_path):
    import ray

    captures, _, results, records = collection
    spec = f"{ray.get_runtime_context().get_node_id()}:{captures}"
    victim = captures / f"{records[0]['_ng_rollout_id']}.tokens.jsonl"
    before = _snapshot(captures)
    for target in (victim, captures / "finalized.jsonl"):
        with pytest.raises(ValueError, match=r"records_file .* inside capture directory") as refused:
            finalize_rollouts([spec], results, tmp_path / "out", records_file=target, executor="ray", batch_size=8)
        assert "\n" not in str(refused.value) and spec in str(refused.value)
    for place in (captures / "out", captures / "sub" / "out"):
        with pytest.raises(OutputError, match="inside capture directory"):
            finalize_rollouts([spec], results, place, executor="ray", batch_size=8)
        with pytest.raises(OutputError, match="inside capture directory"):
            raycap.rebuild_to_output([spec], place, model="m", executor="ray")
    assert _snapshot(captures) == before and not (tmp_path / "out").exists()
    assert not (captures / "finalized.jsonl").exists()
    assert sorted(p.name for p in captures.iterdir() if p.is_dir()) == []


def test_the_capture_place_check_covers_every_form_of_a_directory(tmp_path):
    from raycap.capture.directory import capture_dir_holding, refuse_capture_place

    real = tmp_path / "real" / "caps"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    linked = str(tmp_path / "link" / "caps")
    for dirs in ([("n1:" + linked, linked)], [("n1:" + str(real), str(real))]):
        for path in (real / "x.jsonl", Path(linked) / "x.jsonl", real / "a" / ".." / "x.jsonl", real):
            assert capture_dir_holding(path, dirs) == dirs[0][0]
    assert capture_dir_holding(tmp_path / "real" / "capsule", [("c", str(real))]) is None
    # A step output of a stream whose directories live on nodes: compared as written and resolved.
    with pytest.raises(OutputError, match=f"inside capture directory n1:{linked}"):
        check_placement(real / "steps", (), elsewhere=[(f"n1:{linked}", linked)])
    with pytest.raises(OutputError, match="inside capture directory"):
        check_placement(real / "out", [CaptureDir(linked, "n1")])
    with pytest.raises(OutputError, match="holds capture directory"):
        check_placement(tmp_path / "real", [CaptureDir(str(real), "n1")])
    with pytest.raises(ValueError, match="records_file"):
        refuse_capture_place(real / "out.jsonl", [CaptureDir(linked, "n1")], "records_file")
