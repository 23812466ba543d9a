"""Outputs on an object store (raycap.output.objectstore.writes), against a real S3 API.

Every test talks over HTTP to moto's server mode on 127.0.0.1 (tests/s3server.py: `make
test` starts one for the run, a lone run of this file starts its own), each in a bucket
of its own. Nothing here mocks S3 in-process. Most tests run in this process on the local
executor; the Ray ones join the shared cluster, and the crash tests SIGKILL the rebuild
job (a subprocess) at a stage it announces, then rerun it.

What they hold the store to: nothing is visible at the output URI before the commit
point; after a finished run pyarrow, pandas, Ray Data, `read_manifest`, `raycap.dataset`
and the feeds read exactly one row per rollout, equal to the reference build; a capture
is retired if and only if its row was committed unmasked; of two writers exactly one
commits; a commit cut short in its roll-forward is refused by raycap's readers and
finished by the next writer, and a commit point that landed but was answered with an
error is this run's commit. A move record read from the store is untrusted: one naming
anything but the move's own place, or a place without a whole copy, deletes nothing.
"""

from __future__ import annotations

import json
import os
import threading

import pandas as pd
import pyarrow.parquet as pq
import pytest

import raycap
from collection import gym_finalized, text
from conftest import retired_ids
from raycap.cli.inspection import InspectError, inspect_output
from raycap.output.faults import OutputError
from raycap.output.location import parse_location
from raycap.output.manifest import MANIFEST_NAME, RETIRE_MARKER_NAME, output_rollout_ids, read_manifest, shard_paths
from raycap.output.objectstore import client
from raycap.rows.arrow import builds_from_table
from raycap.runs.handoff import DONE, REJECTED

pytestmark = pytest.mark.slow


def visible(s3, bucket: str, prefix: str) -> list[str]:
    """The objects under `prefix` (folder markers a store keeps left out)."""
    return [key for key in s3.keys(bucket, prefix) if not key.endswith("/")]


def reference(captures: str) -> list[dict]:
    """The rows an undisturbed build gives (freezing is idempotent: a later run's
    snapshots are these)."""
    return builds_from_table(raycap.rebuild([captures], model="m", executor="local", skip_retired=True))


def unmasked_ids(table) -> set[str]:
    return {r["rollout_id"] for r in table.select(["rollout_id", "mask_sample"]).to_pylist() if r["mask_sample"] is False}


def assert_committed_once(s3, bucket: str, uri: str, want: list[dict], captures: str, before: set[str]) -> None:
    """The output holds exactly the reference rows, once each, read three ways; no
    staging is left; retired = before + exactly the unmasked committed rows."""
    key = uri.split("/", 3)[3]
    table = pq.read_table(uri)
    ids = table.column("rollout_id").to_pylist()
    assert len(ids) == len(set(ids)), "one row per rollout"
    assert builds_from_table(table) == want
    assert sum(s.rows for s in raycap.read_manifest(uri).shards) == len(ids)
    assert sorted(pd.read_parquet(uri, columns=["rollout_id"])["rollout_id"]) == sorted(ids)
    assert not [k for k in visible(s3, bucket, "") if ".staging/" in k], "no staging left"
    assert not [k for k in visible(s3, bucket, key + "/") if not k.startswith(f"{key}/data/") and "/." not in k]
    assert retired_ids(captures) == before | unmasked_ids(table)


# --- a rebuild to S3 -------------------------------------------------------------------------------


def test_a_rebuild_to_s3_commits_without_rename_and_every_reader_reads_exactly_its_rows(s3, s3_bucket, corpus_copy):
    captures = corpus_copy("captures")
    before, want = retired_ids(captures), reference(captures)
    uri = f"s3://{s3_bucket}/run-1/step-1"
    notes: list[str] = []

    outcome = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True, log=notes.append)

    assert outcome.status == DONE and str(outcome.rows) == uri
    keys = visible(s3, s3_bucket, "run-1/")
    shards = [k for k in keys if k.startswith("run-1/step-1/data/")]
    assert len(shards) > 1 and set(keys) == {
        *shards, "run-1/step-1/.manifest.json", "run-1/step-1/.retire.json", "run-1/step-1.summary.json",
    }
    manifest = raycap.read_manifest(uri)
    assert manifest.committed_as == uri and manifest.staged_as is not None
    assert [f"run-1/step-1/{s.name}" for s in manifest.shards] == sorted(shards)
    assert_committed_once(s3, s3_bucket, uri, want, captures, before)
    summary = json.loads(s3.client.get_object(Bucket=s3_bucket, Key="run-1/step-1.summary.json")["Body"].read())
    assert summary["rollouts"] == len(want)
    marker = json.loads(s3.client.get_object(Bucket=s3_bucket, Key=f"run-1/step-1/{RETIRE_MARKER_NAME}")["Body"].read())
    assert marker["state"] == "finished"

    # The feeds read the committed shards from the store, checked against the manifest.
    table = pq.read_table(uri)
    feed = [b.rollout_ids for b in raycap.shard_batches(uri, 0, 2, seq_len=4096, lines=2, too_long="skip")]
    assert feed == [b.rollout_ids for b in raycap.shard_batches(table, 0, 2, seq_len=4096, lines=2, too_long="skip")]
    assert feed and output_rollout_ids(uri) == set(table.column("rollout_id").to_pylist())

    # A rerun with the same inputs reuses it: nothing rewritten.
    etags = {k: s3.client.head_object(Bucket=s3_bucket, Key=k)["ETag"] for k in shards}
    again = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True, log=notes.append)
    assert again.ok and again.summary.reused and any("reusing it" in note for note in notes)
    assert {k: s3.client.head_object(Bucket=s3_bucket, Key=k)["ETag"] for k in shards} == etags


def test_storage_options_configure_the_store_and_the_commit_point(s3, s3_bucket, corpus_copy, monkeypatch):
    captures = corpus_copy("captures")
    # The environment points nowhere: only storage_options name the store.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    uri = f"s3://{s3_bucket}/opts/rows"
    options = {"endpoint_override": s3.endpoint, "region": "us-east-1"}
    outcome = raycap.rebuild_to_output([captures], uri, model="m", executor="local", storage_options=options)
    assert outcome.ok
    location = parse_location(uri, options)
    assert raycap.read_manifest(location).rows == len(builds_from_table(pq.read_table(location.fs_path, filesystem=client.filesystem(location))))
    with pytest.raises(OutputError, match="cannot be reached"):  # without them, the environment's endpoint
        raycap.rebuild_to_output([captures], uri + "-2", model="m", executor="local")


def test_a_rebuild_on_ray_writes_shards_straight_to_s3_and_ray_data_reads_them(ray_shared, s3, s3_bucket, corpus_copy):
    import ray.data

    captures = corpus_copy("captures")
    before, want = retired_ids(captures), reference(captures)
    uri = f"s3://{s3_bucket}/ray/rows"

    outcome = raycap.rebuild_to_output([captures], uri, model="m", executor="ray", batch_size=8, retire=True)

    assert outcome.ok and outcome.summary.executor.name == "ray"
    assert_committed_once(s3, s3_bucket, uri, want, captures, before)
    assert raycap.dataset(uri).count() == len(want)
    assert sorted(raycap.dataset(uri, columns=["rollout_id"]).to_pandas()["rollout_id"]) == sorted(r["rollout_id"] for r in want)
    assert ray.data.read_parquet(uri).count() == len(want)


# --- two writers, and a commit cut short --------------------------------------------------------


def test_of_two_concurrent_writers_exactly_one_commits_and_the_other_gets_one_line(s3, s3_bucket, corpus_copy):
    dirs = [corpus_copy("a"), corpus_copy("b")]
    uri = f"s3://{s3_bucket}/shared/rows"
    both_built = threading.Barrier(2, timeout=120)
    results: dict[str, object] = {}

    def pause(stage: str) -> None:
        if stage == "MID_COMMIT":
            both_built.wait()  # both runs have built and checked their shards; neither has committed

    def write(captures: str) -> None:
        try:
            results[captures] = raycap.rebuild_to_output(
                [captures], uri, model="m", executor="local", batch_size=8, retire=True, pause=pause
            )
        except OutputError as exc:
            results[captures] = exc

    threads = [threading.Thread(target=write, args=(d,)) for d in dirs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    won = [d for d in dirs if not isinstance(results[d], Exception)]
    lost = [d for d in dirs if isinstance(results[d], OutputError)]
    assert len(won) == 1 and len(lost) == 1, results
    message = str(results[lost[0]])
    assert "\n" not in message and ("another run committed" in message or "appeared while this run was building" in message)
    assert raycap.read_manifest(uri).inputs["capture_dirs"] == [won[0]]
    assert retired_ids(lost[0]) == retired_ids(corpus_copy("fresh")), "the loser retired nothing"
    assert not [k for k in visible(s3, s3_bucket, "") if ".staging/" in k]
    assert len(pq.read_table(uri)) == raycap.read_manifest(uri).rows


def test_the_commit_point_is_a_conditional_write_only_one_of_many_wins(s3, s3_bucket):
    target = parse_location(f"s3://{s3_bucket}/race/.manifest.json")
    wins: list[bool] = []
    start = threading.Barrier(8, timeout=60)

    def put(n: int) -> None:
        start.wait()
        wins.append(client.put_if_absent(target, f"writer {n}".encode()))

    threads = [threading.Thread(target=put, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(wins) == [False] * 7 + [True]


def test_a_commit_cut_short_in_its_roll_forward_is_refused_by_readers_and_finished_by_the_next_run(
    s3, s3_bucket, corpus_copy, tmp_path
):
    captures = corpus_copy("captures")
    before, want = retired_ids(captures), reference(captures)
    uri = f"s3://{s3_bucket}/cut/rows"

    class Crash(Exception):
        pass

    def crash(stage: str) -> None:
        if stage == "MID_ROLL_FORWARD":
            raise Crash

    with pytest.raises(Crash):
        raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True, pause=crash)
    manifest = raycap.read_manifest(uri)  # the commit point was made ...
    assert len(manifest.shards) > 1 and retired_ids(captures) == before  # ... nothing retired
    in_place = visible(s3, s3_bucket, "cut/rows/data/")
    assert len(in_place) == 1  # ... and one shard of several copied into place
    # raycap's readers refuse a partial set, with one line; a generic reader sees part of it.
    for read in (
        lambda: shard_paths(uri), lambda: raycap.dataset(uri), lambda: raycap.DataParallelFeed(uri, 2, seq_len=4096, lines=2),
        lambda: raycap.retire([corpus_copy("other")], uri + "-elsewhere"),
    ):
        with pytest.raises(OutputError) as refused:
            read()
        assert "\n" not in str(refused.value)
    with pytest.raises(OutputError, match="not in place"):
        shard_paths(uri)
    with pytest.raises(InspectError, match="not in place"):
        inspect_output(uri)
    assert pq.read_table(uri).num_rows < manifest.rows

    # The next run with the same inputs finishes the copy, then retires.
    outcome = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True)
    assert outcome.ok and outcome.summary.reused
    assert_committed_once(s3, s3_bucket, uri, want, captures, before)


def test_retire_alone_finishes_a_cut_short_roll_forward_before_it_drops_anything(s3, s3_bucket, corpus_copy):
    captures = corpus_copy("captures")
    before, want = retired_ids(captures), reference(captures)
    uri = f"s3://{s3_bucket}/retire/rows"

    def crash(stage: str) -> None:
        if stage == "MID_ROLL_FORWARD":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, pause=crash)
    report = raycap.retire([captures], uri, executor="local")
    assert not report.errors
    assert_committed_once(s3, s3_bucket, uri, want, captures, before)


# --- overwrite and set-aside -------------------------------------------------------------------------


def test_overwrite_moves_the_old_output_aside_whole_and_a_failed_mask_gate_sets_the_rows_aside(s3, s3_bucket, corpus_copy):
    captures = corpus_copy("captures")
    uri = f"s3://{s3_bucket}/runs/rows"
    first = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8)
    old_rows = builds_from_table(pq.read_table(uri))
    with pytest.raises(OutputError, match="overwrite: true"):
        raycap.rebuild_to_output([captures], uri, model="m2", executor="local")

    second = raycap.rebuild_to_output([captures], uri, model="m2", executor="local", batch_size=8, overwrite=True)
    assert second.ok and str(second.summary.superseded).startswith(f"{uri}.superseded-")
    aside = str(second.summary.superseded)
    assert builds_from_table(pq.read_table(aside)) == old_rows  # the old output, whole, under its new name
    assert raycap.read_manifest(aside).inputs["model"] == "m" and first.ok
    assert {b["model"] for b in builds_from_table(pq.read_table(uri)) if b.get("model")} <= {"m2"}
    with pytest.raises(OutputError, match="not a committed output"):
        raycap.retire([captures], aside)  # only the output at its committed place is retired from

    before = retired_ids(captures)
    third = raycap.rebuild_to_output(
        [captures], uri, model="m3", executor="local", overwrite=True, retire=True, max_mask_fraction=0.0,
        mask_fraction_min_samples=0,
    )
    assert third.status == REJECTED and str(third.rows) == f"{uri}.rejected"
    assert retired_ids(captures) == before and not visible(s3, s3_bucket, "runs/rows/")
    assert raycap.read_manifest(f"{uri}.rejected").rows == len(pq.read_table(f"{uri}.rejected"))
    with pytest.raises(OutputError, match="not a committed output"):
        raycap.retire([captures], f"{uri}.rejected")


def test_a_move_aside_cut_short_while_deleting_is_finished_by_the_next_run(s3, s3_bucket, corpus_copy, monkeypatch):
    from raycap.output.objectstore import writes as objectstore

    captures = corpus_copy("captures")
    before, want = retired_ids(captures), reference(captures)
    uri = f"s3://{s3_bucket}/gate/rows"
    real = objectstore._delete_moved

    def cut_short(output):
        client.read_bytes(output.child(objectstore.MANIFEST_NAME))  # (still there)
        data = sorted(k for k in client.files(output) if k.startswith("data/"))
        client.delete(output.child(data[0]))
        raise KeyboardInterrupt

    monkeypatch.setattr(objectstore, "_delete_moved", cut_short)
    with pytest.raises(KeyboardInterrupt):
        raycap.rebuild_to_output(
            [captures], uri, model="m", executor="local", batch_size=8, retire=True, max_mask_fraction=0.0,
            mask_fraction_min_samples=0,
        )
    monkeypatch.setattr(objectstore, "_delete_moved", real)
    assert builds_from_table(pq.read_table(f"{uri}.rejected")) == want  # the copy is whole
    assert retired_ids(captures) == before
    with pytest.raises(OutputError, match="being moved aside"):
        raycap.retire([captures], uri)
    assert retired_ids(captures) == before

    outcome = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True)
    assert outcome.ok and not outcome.summary.reused  # the leftover was removed, the rows built again
    assert_committed_once(s3, s3_bucket, uri, want, captures, before)
    assert builds_from_table(pq.read_table(f"{uri}.rejected")) == want


# --- finalize, a stream's steps, inspect ---------------------------------------------------------------


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_finalize_rollouts_to_s3_commits_rows_and_records_that_read_back(executor, request, s3, s3_bucket, collection, tmp_path,
                                                                       caplog):
    if executor == "ray":
        request.getfixturevalue("ray_shared")  # finalize tasks PUT their parts and shards from Ray's workers
    captures, oracle, results, records = collection
    before = retired_ids(captures)
    expected, allowed = gym_finalized(records, oracle)
    uri = f"s3://{s3_bucket}/finalized"

    target = tmp_path / "final.jsonl"  # drafted from the staged parts as the run goes
    outcome = raycap.finalize_rollouts([str(captures)], results, uri, executor=executor, batch_size=5, retire=True,
                                       records_file=target)

    assert outcome.status == DONE, outcome.message
    got = list(raycap.read_records(uri))
    assert [json.loads(line) for line in target.read_bytes().splitlines()] == got
    assert "drafted during the run met" not in caplog.text
    assert len(got) == len(records)
    for index, (mine, gyms) in enumerate(zip(got, expected)):
        assert text(mine, captures) == text(gyms, oracle), f"record {index}"
    assert retired_ids(captures) - before == allowed
    assert pq.read_table(uri).num_rows == raycap.read_manifest(uri).rows > 0
    assert visible(s3, s3_bucket, "finalized/.records/")  # the records are objects of the output, hidden


def test_a_stream_commits_its_steps_to_s3_and_recovers_a_step_cut_short(s3, s3_bucket, tmp_path, monkeypatch):
    from raycap import TokenCaptureStore
    from raycap.output.objectstore import writes as objectstore
    from test_stream import write

    store = TokenCaptureStore(tmp_path / "c")
    write(store, "good")
    write(store, "masked", "two_roots")
    write(store, "late")
    step = f"s3://{s3_bucket}/steps/step-00001"
    with raycap.Stream([store.directory], executor="local") as stream:
        stream.submit(["good", "masked"])
        rows = stream.take(2, timeout=10)
        report = stream.commit(rows, output=step)
    assert (report.rollouts, report.retired, report.kept_as_evidence) == (2, 1, 1)
    assert str(report.output) == step and output_rollout_ids(step) == {"good", "masked"}
    assert pq.read_table(step).num_rows == 2 and raycap.read_manifest(step).committed_as == step
    assert store.lifecycle("good").retired and not store.lifecycle("masked").retired

    # A step whose commit point was made but whose roll-forward was cut short: the next
    # stream finishes it, and takes the rollout as committed (retired, never delivered again).
    second = f"s3://{s3_bucket}/steps/step-00002"
    real = objectstore.roll_forward

    def cut_short(output, manifest, after_first=None):
        raise KeyboardInterrupt

    with raycap.Stream([store.directory], executor="local") as stream:
        stream.submit(["late"])
        rows = stream.take(1, timeout=10)
        monkeypatch.setattr(objectstore, "roll_forward", cut_short)
        with pytest.raises(KeyboardInterrupt):
            stream.commit(rows, output=second)
    monkeypatch.setattr(objectstore, "roll_forward", real)
    assert not store.lifecycle("late").retired and not visible(s3, s3_bucket, "steps/step-00002/data/")
    with raycap.Stream([store.directory], executor="local") as stream:
        assert stream.take(1, timeout=0.5).num_rows == 0
        assert stream.stats.recovered_finished == 1
    assert store.lifecycle("late").retired and output_rollout_ids(second) == {"late"}


def test_inspect_reads_an_s3_output_and_writes_its_png_locally(s3, s3_bucket, corpus_copy, tmp_path, monkeypatch, capsys):
    from raycap.cli.command import main

    captures = corpus_copy("captures")
    uri = f"s3://{s3_bucket}/inspect/rows"
    raycap.rebuild_to_output([captures], uri, model="m", executor="local")
    keys = visible(s3, s3_bucket, "")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert f"output      {uri}" in out and f"rows        {raycap.read_manifest(uri).rows}" in out
    assert os.listdir(work) == ["rows.lengths.png"] or "no PNG" in out
    assert visible(s3, s3_bucket, "") == keys  # nothing written to the store


# --- stores that cannot be written ----------------------------------------------------------------------


def test_a_missing_bucket_or_an_unreachable_store_is_refused_before_anything_is_written(s3, corpus_copy, tmp_path, monkeypatch):
    import yaml

    from raycap.cli import rebuild as rebuild_job

    captures = corpus_copy("captures")
    states = sorted(os.listdir(captures))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(OutputError, match="the bucket no-such-bucket does not exist"):
        raycap.rebuild_to_output([captures], "s3://no-such-bucket/rows", executor="local")
    with pytest.raises(OutputError, match="cannot be reached"):
        raycap.rebuild_to_output(
            [captures], f"s3://{s3.new_bucket()}/rows", executor="local",
            storage_options={"endpoint_override": "http://127.0.0.1:9"},
        )
    config = work / "rebuild.yaml"
    config.write_text(yaml.safe_dump({"capture_dirs": [captures], "output": "s3://no-such-bucket/rows", "executor": "local"}))
    assert rebuild_job.main(["--config", str(config)]) == 2
    assert os.listdir(work) == ["rebuild.yaml"] and sorted(os.listdir(captures)) == states


# --- the job, SIGKILLed at a stage and rerun --------------------------------------------------------

# Where the kill lands: AFTER_FIRST_SHARD while builder tasks on Ray are still writing to
# the store; MID_COMMIT with every shard staged and the commit point not yet made;
# MID_ROLL_FORWARD with the manifest written and one shard copied into place;
# BEFORE_RETIRE on Ray with the output whole and nothing retired.
KILLS = [("AFTER_FIRST_SHARD", "ray"), ("MID_COMMIT", "local"), ("MID_ROLL_FORWARD", "local"), ("BEFORE_RETIRE", "ray")]


@pytest.mark.parametrize(("stage", "executor"), KILLS, ids=[f"{s}-{e}" for s, e in KILLS])
def test_a_job_killed_at_a_stage_loses_nothing_and_its_rerun_commits_the_reference_rows(
    stage, executor, request, s3, s3_bucket, corpus_copy, tmp_path, capsys
):
    from raycap.cli import rebuild as rebuild_job
    from test_job_processes import _Driver
    from test_jobs import rebuild_config, run

    env = {f"RAYCAP_JOB_PAUSE_{stage}": "300"}
    if executor == "ray":
        import ray

        # The driver joins the shared cluster, as a submitted job joins its own; the rerun
        # below runs in this process, on the same cluster.
        request.getfixturevalue("ray_shared")
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    captures = corpus_copy("captures")
    before = retired_ids(captures)
    uri = f"s3://{s3_bucket}/jobs/rows"
    config = rebuild_config(tmp_path, captures, output=uri, retire=True, batch_size=2, max_in_flight=1, executor=executor)

    _Driver(config, env).kill_at(stage)

    assert retired_ids(captures) == before  # nothing is retired before the commit is whole
    at_output = visible(s3, s3_bucket, "jobs/rows/")
    if stage in ("AFTER_FIRST_SHARD", "MID_COMMIT"):
        assert at_output == []  # nothing visible at the output before the commit point
        assert any(k.endswith(".parquet") for k in visible(s3, s3_bucket, "jobs/.rows.staging/"))
    elif stage == "MID_ROLL_FORWARD":
        assert "jobs/rows/.manifest.json" in at_output
        with pytest.raises(OutputError, match="not in place"):
            shard_paths(uri)
    else:
        assert len(shard_paths(uri)) == len(raycap.read_manifest(uri).shards)
    want = reference(captures)

    code, _, err = run(rebuild_job.main, config, capsys)

    assert code == 0, err
    assert_committed_once(s3, s3_bucket, uri, want, captures, before)


# --- a move record read from the store is untrusted --------------------------------------------------


def _keys(s3, bucket: str, prefix: str) -> dict[str, str]:
    found = s3.client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in found if not o["Key"].endswith("/")}


@pytest.mark.parametrize("named", ["elsewhere", "itself", "a stamped place holding only a copy of its manifest"])
def test_a_forged_move_record_is_refused_and_nothing_is_deleted(s3, s3_bucket, corpus_copy, named):
    captures = corpus_copy("captures")
    uri = f"s3://{s3_bucket}/runs/rows"
    assert raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True).ok
    rows = pq.read_table(uri).num_rows
    stamped = f"{uri}.superseded-20260101T000000Z"
    if named.startswith("a stamped"):
        manifest = s3.client.get_object(Bucket=s3_bucket, Key=f"runs/rows/{MANIFEST_NAME}")["Body"].read()
        s3.client.put_object(Bucket=s3_bucket, Key=f"runs/rows.superseded-20260101T000000Z/{MANIFEST_NAME}", Body=manifest)
    moved_to = {"elsewhere": f"s3://{s3_bucket}/other/rows", "itself": uri}.get(named, stamped)
    s3.client.put_object(Bucket=s3_bucket, Key="runs/rows/.moved.json", Body=json.dumps({"moved_to": moved_to}).encode())
    kept = _keys(s3, s3_bucket, "runs/rows/")
    retired = retired_ids(captures)

    with pytest.raises(OutputError) as refused:
        raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True)
    assert "\n" not in str(refused.value) and "nothing was deleted" in str(refused.value)
    assert _keys(s3, s3_bucket, "runs/rows/") == kept  # manifest, shards, retire marker, the record: all there
    assert retired_ids(captures) == retired

    s3.client.delete_object(Bucket=s3_bucket, Key="runs/rows/.moved.json")  # the user removes the record
    again = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True)
    assert again.ok and again.summary.reused and pq.read_table(uri).num_rows == rows


# --- a commit point answered with an error after it landed -------------------------------------------


class _AnsweredWrong:
    """A boto3 S3 client whose first conditional PUT is made and then answered with an
    error, as botocore answers after its retry of a write that landed: 412, or a 500."""

    def __init__(self, client, code: str, status: int) -> None:
        self.client, self.code, self.status, self.calls = client, code, status, 0

    def put_object(self, **kwargs):
        from botocore.exceptions import ClientError

        result = self.client.put_object(**kwargs)
        if "IfNoneMatch" in kwargs:
            self.calls += 1
            if self.calls == 1:
                raise ClientError(
                    {"Error": {"Code": self.code, "Message": "answered wrong"}, "ResponseMetadata": {"HTTPStatusCode": self.status}},
                    "PutObject",
                )
        return result

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.mark.parametrize("code,status", [("PreconditionFailed", 412), ("InternalError", 500)])
def test_a_commit_point_that_landed_but_was_answered_with_an_error_is_finished(
    s3, s3_bucket, corpus_copy, monkeypatch, code, status
):
    from raycap.output.objectstore import client as store_client

    captures = corpus_copy("captures")
    want = builds_from_table(raycap.rebuild([captures], model="m", executor="local", skip_retired=True))
    real = store_client._s3_client
    wrong: list[_AnsweredWrong] = []

    def client(options):
        if not wrong:
            wrong.append(_AnsweredWrong(real(options), code, status))
        return wrong[0]

    monkeypatch.setattr(store_client, "_s3_client", client)
    uri = f"s3://{s3_bucket}/cp/rows"
    outcome = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8)
    assert wrong and wrong[0].calls == 1
    assert outcome.ok, outcome.message
    manifest = read_manifest(uri)
    assert builds_from_table(pq.read_table(uri)) == want and manifest.rows == len(want) > 0
    assert shard_paths(uri)  # every listed shard is in place
    assert not [k for k in _keys(s3, s3_bucket, "") if ".staging/" in k]
    again = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8)
    assert again.ok and again.summary.reused and read_manifest(uri).staged_as == manifest.staged_as
