"""A committed output loads as-is, given as its directory, with every common Parquet
reader: exactly the manifest's rows, and no metadata file read as data."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import retired_ids
from raycap.capture.consumer import build_local
from raycap.capture.store import TokenCaptureStore
from raycap.output.commit import Inputs, StagedOutput, summary_path
from raycap.output.durable import write_json_durably
from raycap.output.manifest import (
    LEGACY_MANIFEST_NAME,
    LEGACY_RETIRE_MARKER_NAME,
    MANIFEST_NAME,
    mark_retiring,
    output_rollout_ids,
    read_manifest,
    shard_paths,
    was_retired_from,
)
from raycap.output.shards import write_shard
from raycap.rows.arrow import builds_to_table, chains_to_table
from raycap.rows.batch import schema_of


def _commit(out, table: pa.Table, delivery: str):
    """Commit `table` in several shards, then add what a finished run leaves: the
    retirement marker inside the output and the summary beside it."""
    inputs = Inputs(("/captures",), None, "prefix_merging", "m", delivery)
    with StagedOutput(out, inputs=inputs, schema=delivery) as staged:
        cuts = range(0, table.num_rows, 9)
        staged.commit([write_shard(staged.staging, i, table.slice(start, 9)) for i, start in enumerate(cuts)])
    mark_retiring(out, "started")
    write_json_durably(summary_path(out), {"rows": table.num_rows})
    return out


@pytest.fixture(scope="module", params=["rollout", "chains"])
def committed(request, fault_corpus, tmp_path_factory):
    """A committed output of each delivery, with several shards and its metadata files."""
    base = tmp_path_factory.mktemp(f"readers-{request.param}")
    directory = base / "captures"
    shutil.copytree(fault_corpus.directory, directory)
    store = TokenCaptureStore(directory)
    ids = store.rollout_ids()
    if request.param == "rollout":
        table = builds_to_table([build_local(rid, directory, model="m") for rid in ids])
    else:
        from raycap.rows.chains import build_frozen_chains, failed_chains

        builds = []
        for rid in ids:
            try:
                builds.append(build_frozen_chains(rid, [(str(directory), store.freeze_raw(rid))], model="m"))
            except Exception as exc:  # noqa: BLE001 - a failed freeze is a masked row
                builds.append(failed_chains(rid, "prefix_merging", "m", f"{type(exc).__name__}: {exc}"))
        table = chains_to_table(builds, [[str(directory)]] * len(builds))
    out = _commit(base / "rows", table, request.param)
    manifest = read_manifest(out)
    assert len(manifest.shards) > 1 and was_retired_from(out)
    return out, manifest, request.param


def _check(ids: list, columns: list, committed) -> None:
    """The reader saw exactly the manifest's rows, of the row schema: no metadata file
    was read as data (it would add rows, fail, or add a partition column)."""
    out, manifest, delivery = committed
    assert len(ids) == manifest.rows
    assert sorted(ids) == sorted(
        rid for path in shard_paths(out) for rid in pq.read_table(path, columns=["rollout_id"]).column(0).to_pylist()
    )
    assert set(ids) == output_rollout_ids(out)
    assert list(columns) == schema_of(delivery).names


@pytest.mark.slow
def test_pyarrow_reads_the_output_directory(committed):
    import pyarrow.dataset as pads

    out = committed[0]
    table = pq.read_table(out)
    _check(table.column("rollout_id").to_pylist(), table.column_names, committed)
    table = pads.dataset(out).to_table()
    _check(table.column("rollout_id").to_pylist(), table.column_names, committed)


def test_pandas_reads_the_output_directory(committed):
    pd = pytest.importorskip("pandas")
    frame = pd.read_parquet(committed[0])
    _check(frame["rollout_id"].tolist(), list(frame.columns), committed)


def test_polars_reads_the_data_directory_and_a_glob_of_the_output(committed):
    pl = pytest.importorskip("polars")
    out = committed[0]
    # polars refuses a directory holding anything but Parquet (the hidden manifest), so
    # it is given the output's data directory, or a glob of the output.
    for frame in (
        pl.read_parquet(out / "data"),
        pl.scan_parquet(out / "data").collect(),
        pl.read_parquet(f"{out}/**/*.parquet"),
        pl.scan_parquet(f"{out}/**/*.parquet").collect(),
    ):
        _check(frame["rollout_id"].to_list(), frame.columns, committed)


def test_duckdb_reads_the_output_directory_and_a_glob_of_it(committed):
    duckdb = pytest.importorskip("duckdb")
    out = committed[0]
    for source in (str(out), f"{out}/**/*.parquet"):
        relation = duckdb.sql(f"SELECT * FROM read_parquet('{source}')")
        _check([row[0] for row in relation.select("rollout_id").fetchall()], relation.columns, committed)


@pytest.mark.slow
def test_hugging_face_datasets_loads_the_output_directory(committed, tmp_path):
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("parquet", data_dir=str(committed[0]), split="train", cache_dir=str(tmp_path))
    _check(loaded["rollout_id"], loaded.column_names, committed)


def test_ray_data_reads_the_output_directory(ray_shared, committed):
    import ray

    import raycap

    for dataset in (ray.data.read_parquet(str(committed[0])), raycap.dataset(committed[0])):
        table = pa.concat_tables(dataset.iter_batches(batch_format="pyarrow", batch_size=None))
        _check(table.column("rollout_id").to_pylist(), table.column_names, committed)


# --- an output of the layout before data/ -----------------------------------------------------


def test_an_output_with_shards_at_the_top_and_the_old_metadata_names_is_still_read(committed, tmp_path):
    """Written before the data/ layout: shards at the top, `_manifest.json` naming them
    `part-*.parquet`, `_retire.json`. The manifest's names are paths relative to the output."""
    from raycap.cli.inspection import inspect_output

    out, manifest, _ = committed
    old = tmp_path / "old"
    old.mkdir()
    for path in shard_paths(out):
        shutil.copy(path, old / path.name)
    raw = json.loads((out / MANIFEST_NAME).read_text())
    for shard in raw["shards"]:
        shard["name"] = shard["name"].split("/")[-1]
    (old / LEGACY_MANIFEST_NAME).write_text(json.dumps(raw))
    (old / LEGACY_RETIRE_MARKER_NAME).write_text(json.dumps({"state": "finished"}))

    assert shard_paths(old) == [old / path.name for path in shard_paths(out)]
    assert read_manifest(old).rows == manifest.rows and output_rollout_ids(old) == output_rollout_ids(out)
    assert was_retired_from(old)
    mark_retiring(old, "started")  # a rerun's retirement updates the marker it finds
    assert json.loads((old / LEGACY_RETIRE_MARKER_NAME).read_text())["state"] == "started"
    assert inspect_output(old).rows == manifest.rows


# --- an output of the row schema before the record columns (schema_version 1) ---------------------


@pytest.mark.slow
def test_an_output_without_the_record_columns_is_still_read_fed_inspected_and_retired(committed, tmp_path):
    """Written before the record columns (reward, task_index, ...; schema_version 1):
    every reader takes it as it is, and retirement drops what its rows allow."""
    import hashlib

    from raycap.cli.inspection import inspect_output
    from raycap.output.location import parse_location
    from raycap.output.manifest import committed_location
    from raycap.output.retiring import retiring
    from raycap.rows.arrow import RECORD_NAMES, retirable
    from raycap.stream.steps import committed_parts
    from raycap.train.feed import collate, shard_batches

    out, manifest, delivery = committed
    old = tmp_path / "v1"
    (old / "data").mkdir(parents=True)
    raw = json.loads((out / MANIFEST_NAME).read_text())
    for shard, path in zip(raw["shards"], shard_paths(out)):
        table = pq.read_table(path)
        table = table.drop_columns(list(RECORD_NAMES))
        pq.write_table(table, old / shard["name"])
        shard["file_bytes"] = (old / shard["name"]).stat().st_size
        shard["sha256"] = hashlib.sha256((old / shard["name"]).read_bytes()).hexdigest()
    raw.update(schema_version=1, committed_as=committed_location(old))
    (old / MANIFEST_NAME).write_text(json.dumps(raw))

    table = pq.read_table(old)
    assert not set(RECORD_NAMES) & set(table.column_names) and table.num_rows == manifest.rows
    assert read_manifest(old).schema_version == 1 and inspect_output(old).rows == manifest.rows
    assert collate(table, seq_len=4096).token_ids.shape[1] == 4096
    assert sum(1 for _ in shard_batches(old, rank=0, world_size=1, seq_len=4096, lines=2)) >= 1
    assert committed_parts(old) == committed_parts(out)
    allowed = set(retirable(pq.read_table(out)))
    with retiring(parse_location(old)) as retired:
        found = {(label, *item) for shard in retired.shards for label, items in retired.by_dir(shard).items() for item in items}
    assert allowed and found == allowed
    import raycap

    (label,) = {label for label, *_ in allowed}
    report = raycap.retire([label], old, executor="local")
    assert not report.errors and not report.changed
    assert {rid for _, rid, _, _ in allowed} <= retired_ids(label)


def test_retiring_marks_an_output_only_once_every_part_is_whole_and_records_how_it_ended(fault_corpus, tmp_path):
    """Retirement's output side: a part that changed since the commit refuses the output
    before the marker is written (its rows may be the only copy); a whole output is marked
    "started" with its fingerprint, and `ended` records how the drops went."""
    from raycap.output.faults import OutputError
    from raycap.output.manifestformat import RETIRE_MARKER_NAME
    from raycap.output.retiring import RetireReport, retiring
    from raycap.rows.arrow import retirable

    directory = tmp_path / "captures"
    shutil.copytree(fault_corpus.directory, directory)
    ids = TokenCaptureStore(directory).rollout_ids()
    table = builds_to_table([build_local(rid, directory, model="m") for rid in ids])
    out = tmp_path / "rows"
    with StagedOutput(out, inputs=Inputs(("/captures",), None, "prefix_merging", "m", "rollout"), schema="rollout") as staged:
        staged.commit([write_shard(staged.staging, i, table.slice(start, 9)) for i, start in enumerate(range(0, table.num_rows, 9))])
    marker = out / RETIRE_MARKER_NAME
    shard = shard_paths(out)[0]
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-1])
    with pytest.raises(OutputError):
        with retiring(out):
            pytest.fail("a changed part must refuse the output")
    assert not marker.exists()

    shard.write_bytes(whole)
    with retiring(out) as retired:
        assert json.loads(marker.read_text())["state"] == "started"
        allowed = {(label, *item) for s in retired.shards for label, items in retired.by_dir(s).items() for item in items}
        assert allowed and allowed == set(retirable(table))
        retired.ended(RetireReport(dropped=1, errors=["r: gone"]))
    ended = json.loads(marker.read_text())
    assert ended["state"] == "incomplete" and ended["errors"] == 1 and ended["dropped"] == 1


def test_retirement_lists_a_snapshot_named_by_several_steps_once_in_the_first():
    """A rollout id given by several records appears in several shards, or among the
    redundant captures too: its snapshot is dropped once, by the first step naming it."""
    from raycap.output.retiring import once_each

    a, b = ("d1", "r1", "s1", 1), ("d2", "r2", "s2", 3)
    listed = once_each([("shard-0", [a]), ("shard-1", [a, b]), ("records", [b, a])])
    assert listed == [("shard-0", {"d1": [("r1", "s1", 1)]}), ("shard-1", {"d2": [("r2", "s2", 3)]}), ("records", {})]
