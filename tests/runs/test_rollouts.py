"""Tests for raycap.runs.rollouts: a results file finalized at once, checked record by record
against NeMo Gym's one-at-a-time finalizer (`raycap.capture.delivery.finalize_rollout_token_capture`,
run on a copy of the same captures, without retiring in between). Run in this process
(executor="local"); the Ray path and the crash of the job are in tests/cluster/test_finalizer.py."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raycap
from collection import _append_rollout, gym_finalized, text
from conftest import retired_ids
from raycap.capture.store import TokenCaptureStore
from raycap.finalize.results import ResultsError, write_records_file
from raycap.output.commit import lock_path, rejected_path, staging_path, summary_path
from raycap.output.faults import OutputError
from raycap.output.manifest import MANIFEST_NAME, is_committed, read_manifest
from raycap.output.recordparts import RECORDS_DIR
from raycap.rows.arrow import RECORD_NAMES
from raycap.rows.batch import schema_of
from raycap.runs.handoff import DONE, PAUSE_STAGES, REJECTED
from raycap.runs.rollouts import finalize_rollouts, read_records, spool_path
from test_consumer import CORRUPT, RETIRED, _corrupt, _record, _retired
from test_untrusted import _nested


def finalize(captures, results, output, **kwargs):
    kwargs.setdefault("executor", "local")
    kwargs.setdefault("batch_size", 5)
    return finalize_rollouts([str(captures)], results, output, **kwargs)


def test_every_record_is_what_gyms_finalizer_makes_of_it_and_exactly_its_retirable_captures_are_retired(collection, tmp_path):
    captures, oracle, results, records = collection
    before = retired_ids(captures)
    expected, allowed = gym_finalized(records, oracle)
    output = tmp_path / "out"

    outcome = finalize(captures, results, output, retire=True)

    assert outcome.status == DONE, outcome.message
    got = list(read_records(output))
    assert len(got) == len(records)
    for index, (mine, gyms) in enumerate(zip(got, expected)):
        assert text(mine, captures) == text(gyms, oracle), f"record {index}"
    # Unicode and floats came back as they were.
    assert got[47]["text"] == "🚀 ünïcödé \u2028" and got[41]["reward"] == 0.1 + 0.2
    assert retired_ids(captures) - before == allowed
    assert allowed >= {"100-0", "inline-1"} and raycap.read_records is read_records


@pytest.mark.slow
def test_every_row_carries_its_records_columns(collection, tmp_path):
    captures, _, results, records = collection
    output = tmp_path / "out"
    finalize(captures, results, output, record_fields=["verdict"])
    table = pq.read_table(output)
    assert table.schema.names == [*schema_of("rollout").names, "verdict"]
    assert table.schema.field("verdict").type == pa.string()
    rows = table.select(["rollout_id", "model", *RECORD_NAMES, "verdict"]).to_pylist()
    # One row per record built from its capture: not the unusable, inline or non-object ones.
    assert len(rows) == len(records) - 8
    for row in rows:
        record = records[row["record_index"]]
        reward = record.get("reward")
        assert row["reward"] == (None if isinstance(reward, bool) or reward is None else float(reward))
        task = record.get("_ng_task_index")
        assert row["task_index"] == (task if isinstance(task, int) else None)
        assert row["rollout_index"] == (record.get("_ng_rollout_index") if isinstance(record.get("_ng_rollout_index"), int) else None)
        assert row["attempt_index"] == record.get("_ng_attempt_index")
        assert row["agent_name"] == (record.get("agent_ref") or {}).get("name")
        response = record.get("response")
        assert row["model"] == (response.get("model", "") if isinstance(response, dict) else "")
        assert row["verdict"] == (record.get("verdict") if isinstance(record.get("verdict"), str) else None)
    repeated = [row for row in rows if row["rollout_id"] == records[0]["_ng_rollout_id"]]
    assert [r["reward"] for r in repeated] == [0.0, 7.5] and [r["model"] for r in repeated] == ["", "other"]


def test_a_type_clash_in_record_fields_names_the_field_and_records_and_writes_nothing(collection, tmp_path):
    captures, _, results, records = collection
    output = tmp_path / "out"
    with open(results, "a") as handle:
        handle.write(json.dumps({"_ng_rollout_id": "r0001", "verdict": 1}) + "\n")
    with pytest.raises(ResultsError, match=rf"field 'verdict' is string in record 0 but int64 in record {len(records)} of "):
        finalize(captures, results, output, record_fields=["verdict", "reward_model"])
    with pytest.raises(ResultsError, match=r"field 'agent_ref' of record 0 of \S+ is an object, and record_fields carries scalar"):
        finalize(captures, results, output, record_fields=["agent_ref"])
    assert not output.exists() and not staging_path(output).exists()


def test_record_fields_are_checked_before_anything_is_touched(collection, tmp_path):
    captures, _, results, _ = collection
    for fields, error in (("verdict", TypeError), (["reward"], ValueError), (["a", "a"], ValueError), ([""], ValueError)):
        with pytest.raises(error):
            finalize(captures, results, tmp_path / "out", record_fields=fields)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_iterable_of_records_gives_what_its_results_file_gives(collection, tmp_path):
    captures, _, results, records = collection
    twin = tmp_path / "twin"
    shutil.copytree(captures, twin)
    finalize(captures, results, tmp_path / "from-file")
    outcome = finalize(twin, (copy.deepcopy(r) for r in records), tmp_path / "from-iterable")
    assert outcome.status == DONE
    assert text(list(read_records(tmp_path / "from-iterable")), twin) == text(list(read_records(tmp_path / "from-file")), captures)
    columns = [*RECORD_NAMES, "rollout_id", "mask_sample", "token_ids", "logprobs", "loss_mask"]
    assert pq.read_table(tmp_path / "from-iterable", columns=columns).equals(pq.read_table(tmp_path / "from-file", columns=columns))
    assert not spool_path(tmp_path / "from-iterable").exists()


def test_records_that_are_no_json_values_are_refused_naming_them(tmp_path, corpus_copy):
    import datetime

    captures = corpus_copy("captures")
    with pytest.raises(ResultsError, match="record 1 of the records iterable is not a JSON value"):
        finalize(captures, [{"a": 1}, {"when": datetime.date(2024, 1, 1)}], tmp_path / "out")
    with pytest.raises(ResultsError, match="record 0 of the records iterable is not a JSON value"):
        finalize(captures, [{1: "not a string key"}], tmp_path / "out")
    with pytest.raises(TypeError, match="wrap a single record in a list"):
        finalize(captures, {"_ng_rollout_id": "r0000"}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_line_that_is_not_json_fails_the_run_naming_the_line_and_commits_nothing(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    before = retired_ids(captures)
    results = tmp_path / "results.jsonl"
    results.write_text('{"_ng_rollout_id": "r0000"}\n\n{"_ng_rollout_id": "r0001"}\n{"_ng_rollout_id": "r00\n')
    with pytest.raises(ResultsError, match=r"results.jsonl line 4 \(record 2\) is not JSON"):
        finalize(captures, results, tmp_path / "out", retire=True, batch_size=1)
    assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()
    assert retired_ids(captures) == before


@pytest.mark.slow
def test_records_file_holds_the_finalized_records_as_one_results_file(collection, tmp_path):
    captures, _, results, _ = collection
    output, target = tmp_path / "out", tmp_path / "final" / "rollouts.jsonl"
    target.parent.mkdir()
    target.symlink_to(tmp_path / "elsewhere.jsonl")  # replaced, never written through
    outcome = finalize(captures, results, output, records_file=target)
    lines = target.read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == list(read_records(output))
    assert not target.is_symlink() and not (tmp_path / "elsewhere.jsonl").exists()
    assert outcome.summary.records_file == str(target)
    assert json.loads(summary_path(output).read_text())["records_file"] == str(target)
    (tmp_path / "a-file").write_text("")
    for bad in (tmp_path / "other" / "x.jsonl", results, captures / "x.jsonl", tmp_path / "a-file" / "deeper" / "x.jsonl",
                tmp_path / "final"):
        with pytest.raises(ValueError, match="records_file"):
            finalize(captures, results, tmp_path / "other", records_file=bad)
    assert not (tmp_path / "other").exists()  # refused before anything was written


def test_a_records_file_is_refused_where_the_kernel_puts_it_and_at_every_file_the_run_writes(collection, tmp_path):
    """The place is decided as the kernel will decide it (`lnk/..` is the parent of the
    link's target, not the folder `lnk` sits in), and no records file is a file the run
    itself writes beside the output, where it would be overwritten or locked."""
    captures, _, results, _ = collection
    (captures.parent / "inner").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "lnk").symlink_to(captures.parent / "inner")
    through_link = f"{tmp_path}/a/lnk/../{captures.name}/x.jsonl"  # reads as a/<captures>, is in the captures
    assert os.path.realpath(os.path.dirname(through_link)) == os.path.realpath(captures)
    with pytest.raises(ValueError, match=r"^records_file .* is inside capture directory"):
        finalize(captures, results, tmp_path / "out", records_file=through_link)

    output = tmp_path / "out"
    (tmp_path / "deep" / "inner").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "lnk").symlink_to(tmp_path / "deep" / "inner")
    owned = {
        summary_path(output): "the output's summary",
        f"{tmp_path}/b/lnk/../../out.summary.json": "the output's summary",
        lock_path(output): "the output's lock",
        spool_path(output): "results spool",
        staging_path(output) / "x.jsonl": "staging",
        rejected_path(output): "the output's rejected copy",
        summary_path(rejected_path(output)): "rejected copy",
        tmp_path / ".out.summary.json.tmp-0123abcd": "temp file of the output's summary",
        tmp_path / "out.superseded-20261206T120000Z": "moved aside",
    }
    for bad, what in owned.items():
        with pytest.raises(ValueError, match=r"^records_file .* which this run writes itself") as refused:
            finalize(captures, results, output, records_file=bad)
        assert what in str(refused.value) and "\n" not in str(refused.value), bad
    assert not output.exists() and not summary_path(output).exists()  # refused before anything was written

    # A name of the user's own beside the output is the user's.
    outcome = finalize(captures, results, output, records_file=f"{output}.records.jsonl")
    assert outcome.status == DONE and len(Path(f"{output}.records.jsonl").read_bytes().splitlines()) == len(
        list(read_records(output)))
    assert json.loads(summary_path(output).read_text())["records_file"] == f"{output}.records.jsonl"


def test_the_records_file_is_drafted_during_the_run_and_placed_after_the_commit(collection, tmp_path, monkeypatch):
    # The file is the parts streamed as their batches are reported; nothing is read back
    # from the committed output (writing it from there fails the test).
    import raycap.runs.rollouts as rollouts

    captures, _, results, _ = collection
    placed: list[bool] = []

    def no_rewrite(*args, **kwargs):
        raise AssertionError("the records file was written from the output")

    def pause(at: str) -> None:
        if at == "BEFORE_RETIRE":
            placed.append(target.exists())

    monkeypatch.setattr(rollouts, "write_records", no_rewrite)
    output, target = tmp_path / "out", tmp_path / "final.jsonl"
    finalize(captures, results, output, records_file=target, pause=pause, retire=True, batch_size=3)
    assert placed == [True]
    parts = read_manifest(output).records.parts
    assert len(parts) > 2
    assert target.read_bytes() == b"".join((output / p.name).read_bytes() for p in parts)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".final")) == []


def test_a_killed_runs_draft_is_removed_by_the_next_run_and_a_live_ones_is_not(collection, tmp_path):
    import fcntl

    captures, _, results, _ = collection
    target = tmp_path / "final.jsonl"
    dead, live, link = (tmp_path / f".final.jsonl.draft-{name}" for name in ("dead", "live", "link"))
    dead.write_bytes(b"x" * 10_000)  # a killed run's: nobody holds it
    live.write_bytes(b"y")
    link.symlink_to(tmp_path / "elsewhere")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a run still writing it
        finalize(captures, results, tmp_path / "out", records_file=target)
    assert not dead.exists() and live.exists() and link.is_symlink()
    assert [json.loads(line) for line in target.read_bytes().splitlines()] == list(read_records(tmp_path / "out"))


def test_a_draft_that_meets_a_fault_gives_way_to_the_file_written_from_the_output(collection, tmp_path, monkeypatch, caplog):
    import raycap.finalize.recordsfile as recordsfile
    import raycap.output.local.writes as localstore

    captures, _, results, _ = collection
    real = localstore.stream_local_part
    calls = []

    def counted(output, part, write):
        calls.append(part.name)
        real(output, part, write)

    class FillingDisk(recordsfile.UnbufferedFile):
        writes = 0

        def write(self, data):
            FillingDisk.writes += 1
            if FillingDisk.writes == 5:
                raise OSError(28, "No space left on device")
            return super().write(data)

    monkeypatch.setattr(localstore, "stream_local_part", counted)
    monkeypatch.setattr(recordsfile, "UnbufferedFile", FillingDisk)
    output, target = tmp_path / "out", tmp_path / "final.jsonl"
    finalize(captures, results, output, records_file=target, batch_size=3)
    parts = read_manifest(output).records.parts
    assert FillingDisk.writes == 5  # nothing drafted after the fault
    assert len(calls) == len(parts)  # then each part read from the output
    assert "drafted during the run met" in caplog.text and "No space left on device" in caplog.text
    assert target.read_bytes() == b"".join((output / p.name).read_bytes() for p in parts)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".final")) == []


def test_a_part_this_process_wrote_is_drafted_from_its_lines_and_never_read_back(collection, tmp_path, monkeypatch):
    # The lines a part was written from go to the draft as they are: reading any part
    # back (from the staging or the output) fails the test.
    import raycap.output.local.writes as localstore
    import raycap.runs.rollouts as rollouts

    def no_read(*args, **kwargs):
        raise AssertionError("a records part was read back")

    monkeypatch.setattr(localstore, "stream_local_part", no_read)
    monkeypatch.setattr(rollouts, "write_records", no_read)
    captures, _, results, _ = collection
    output, target = tmp_path / "out", tmp_path / "final.jsonl"
    finalize(captures, results, output, records_file=target, batch_size=3, executor="local")
    parts = read_manifest(output).records.parts
    assert len(parts) > 2
    assert target.read_bytes() == b"".join((output / p.name).read_bytes() for p in parts)


# A driver that can fork its workers (a clean interpreter: a test process may hold threads
# of other tests, and then its workers are fresh interpreters, which have no shelf).
_HANDED_BACK = """
import functools, json, sys
import raycap.finalize.worker as worker
import raycap.output.local.writes as localstore
from raycap.finalize.shelf import Handed, Shelf
from raycap.runs.rollouts import finalize_rollouts

captures, results, output, target, slot_bytes = sys.argv[1:6]
read_back, released = [], []
stream, release = localstore.stream_local_part, Handed.release

def counted_stream(staging, part, write):
    read_back.append(part.name)
    return stream(staging, part, write)

def counted_release(handed):
    released.append(handed.slot)
    return release(handed)

localstore.stream_local_part = counted_stream
Handed.release = counted_release
worker.Shelf = functools.partial(Shelf, slots=64, slot_bytes=int(slot_bytes))
assert worker.can_fork()
finalize_rollouts([captures], results, output, records_file=target, executor="local", batch_size=1)
print(json.dumps({"read_back": read_back, "released": released}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("slot_bytes", [64 << 20, 0], ids=["fits", "too-large"])
def test_a_worker_processs_parts_are_handed_back_in_memory_and_read_back_only_when_they_do_not_fit(
    collection, tmp_path, slot_bytes
):
    # A fork hands each part's lines back on its shelf; a part too large for a slot is
    # read back from the staging instead. Either way the file is the committed parts.
    import subprocess
    import sys

    captures, _, results, _ = collection
    output, target = tmp_path / "out", tmp_path / "final.jsonl"
    env = {**os.environ, "RAYCAP_LOCAL_PROCESSES": "2", "PYTHONPATH": str(Path(raycap.__file__).parents[1])}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run(
        [sys.executable, "-c", _HANDED_BACK, str(captures), str(results), str(output), str(target), str(slot_bytes)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    parts = read_manifest(output).records.parts
    assert target.read_bytes() == b"".join((output / p.name).read_bytes() for p in parts)
    if slot_bytes:
        assert seen["released"] and not seen["read_back"]  # the worker finalized batches, and none was read back
    else:
        assert seen["read_back"] and not seen["released"]


def test_a_finalized_batchs_lines_stay_in_the_process_that_wrote_them():
    import pickle

    from raycap.finalize.batch import FinalizedBatch
    from raycap.output.recordparts import RecordCounts, RecordsPart

    part = RecordsPart(".records/part-000000.jsonl", 0, 1, 3, "0" * 64, ())
    here = FinalizedBatch(0, None, part, RecordCounts(), [b"{}"])
    sent = pickle.loads(pickle.dumps(here))
    assert here.lines == [b"{}"] and sent.lines is None
    assert sent == here  # the lines are no part of the report's value


def test_a_batchs_lines_are_kept_only_for_a_records_file_drafted_here(tmp_path):
    # A run without a records file lets a batch's lines go with its write: a report
    # waiting for its turn would otherwise hold them.
    from raycap.finalize.batch import PreparedBatch, write_batch
    from raycap.output.recordparts import RecordCounts
    from raycap.rows.batch import empty_rows

    staging = tmp_path / "staging"
    (staging / ".records").mkdir(parents=True)
    prepared = PreparedBatch(0, 0, [b'{"a": 1}', b'{"a": 2}'], empty_rows("rollout"), [], RecordCounts())
    assert write_batch(prepared, str(staging)).lines is None
    kept = write_batch(prepared, str(staging), keep_lines=True)
    assert kept.lines == prepared.lines and kept.part.file_bytes == len(b'{"a": 1}\n{"a": 2}\n')


def test_a_draft_that_cannot_begin_leaves_the_file_to_be_written_after_the_commit(collection, tmp_path, monkeypatch, caplog):
    import raycap.finalize.recordsfile as recordsfile

    def refused(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(recordsfile, "UnbufferedFile", refused)
    captures, _, results, _ = collection
    output, target = tmp_path / "out", tmp_path / "final.jsonl"
    finalize(captures, results, output, records_file=target)
    assert "cannot draft the records file" in caplog.text
    assert [json.loads(line) for line in target.read_bytes().splitlines()] == list(read_records(output))


@pytest.mark.parametrize("stage", ["AFTER_FIRST_SHARD", "MID_COMMIT"])
def test_a_run_that_stops_leaves_no_records_file_nor_its_draft(collection, tmp_path, stage):
    captures, _, results, _ = collection

    def crash(at: str) -> None:
        if at == stage:
            raise KeyboardInterrupt(at)

    target = tmp_path / "final.jsonl"
    with pytest.raises(KeyboardInterrupt):
        finalize(captures, results, tmp_path / "out", records_file=target, pause=crash, batch_size=3)
    assert sorted(p.name for p in tmp_path.iterdir() if "final" in p.name) == []


def test_records_are_written_back_exactly_as_orjson_would_or_as_json_reads_them(corpus_copy, tmp_path):
    from raycap.finalize.results import dumps_record

    assert dumps_record({"b": 1, "a": [1.5, "é"]}) == '{"b":1,"a":[1.5,"é"]}'.encode()
    # NaN, beyond-64-bit integers and lone surrogates: orjson would not write them back.
    for value in ({"x": float("nan")}, {"x": 1 << 70}, {"x": "\ud800"}, {"x": float("inf")}):
        line = dumps_record(value, exact=False)
        assert json.dumps(json.loads(line)) == json.dumps(value)
    assert json.loads(dumps_record({"x": 1 << 70})) == {"x": 1 << 70}
    captures = corpus_copy("captures")
    results = tmp_path / "results.jsonl"
    results.write_text('{"_ng_rollout_id": "r0001", "big": 123456789012345678901234567890, "n": NaN, "s": "\\ud800"}\n')
    finalize(captures, results, tmp_path / "out")
    (record,) = read_records(tmp_path / "out")
    assert record["big"] == 123456789012345678901234567890 and record["n"] != record["n"] and record["s"] == "\ud800"


@pytest.mark.slow
def test_the_mask_check_counts_as_a_collection_and_a_rejected_output_retires_nothing(collection, tmp_path):
    captures, _, results, records = collection
    before = retired_ids(captures)
    output = tmp_path / "out"
    outcome = finalize(captures, results, output, retire=True, max_mask_fraction=0.1, mask_fraction_min_samples=10,
                       records_file=tmp_path / "final.jsonl")
    assert outcome.status == REJECTED and outcome.rows == rejected_path(output)
    counts = outcome.summary.records
    assert counts.records == len(records) and counts.unusable == 5 and counts.redundant == 1 and counts.unchanged == 2
    assert counts.finalized == counts.records - counts.unchanged
    check = outcome.summary.mask_check.message
    assert check.startswith(f"{counts.masked}/{counts.finalized} finalized rollouts (")
    assert "are masked, exceeding token_id_capture.max_mask_fraction=0.1. Mask reasons: {" in check
    assert counts.masked_by_reason["no capture key"] == 2 and counts.masked_by_reason["capture_incomplete"] >= 1
    assert check in outcome.message and "nothing was retired" in outcome.message
    assert retired_ids(captures) == before and not output.exists() and is_committed(rejected_path(output))
    assert not (tmp_path / "final.jsonl").exists()
    assert len(list(read_records(rejected_path(output)))) == len(records)
    # Below mask_fraction_min_samples finalized records the check is not applied.
    few = finalize(captures, results, tmp_path / "few", max_mask_fraction=0.1, mask_fraction_min_samples=counts.finalized + 1)
    assert few.status == DONE and few.summary.mask_check.message.startswith(f"not applied: {counts.finalized} finalized")


@pytest.mark.slow
def test_a_rerun_reuses_the_output_and_other_results_are_refused_unless_overwrite(collection, tmp_path):
    captures, _, results, records = collection
    output = tmp_path / "out"
    finalize(captures, results, output)
    files = {p: p.read_bytes() for p in output.rglob("*") if p.is_file()}
    notes: list[str] = []
    again = finalize(captures, results, output, retire=True, log=notes.append)
    assert again.summary.reused and "reusing it" in notes[0] and again.summary.retired.dropped > 0
    assert {p: p.read_bytes() for p in files} == files
    results.write_text(results.read_text() + json.dumps({"_ng_rollout_id": "r0002"}) + "\n")
    with pytest.raises(OutputError, match="already exists and was written from different inputs"):
        finalize(captures, results, output)
    replaced = finalize(captures, results, output, overwrite=True)
    assert replaced.summary.superseded and replaced.summary.records.records == len(records) + 1


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["AFTER_FIRST_SHARD", "AFTER_LAST_SHARD", "MID_COMMIT", "BEFORE_RETIRE"])
def test_a_crash_before_retirement_retires_nothing_and_a_rerun_finishes(collection, tmp_path, stage):
    captures, oracle, results, records = collection
    before = retired_ids(captures)
    _, allowed = gym_finalized(records, oracle)
    output = tmp_path / "out"

    def crash(at: str) -> None:
        if at == stage:
            raise KeyboardInterrupt(at)

    target = tmp_path / "final.jsonl"
    with pytest.raises(KeyboardInterrupt):
        finalize(captures, results, output, retire=True, pause=crash, records_file=target)
    assert retired_ids(captures) == before
    assert is_committed(output) is (stage == "BEFORE_RETIRE")
    # records_file is written after the commit and before any retirement.
    assert target.exists() is (stage == "BEFORE_RETIRE")
    stages: list[str] = []
    outcome = finalize(captures, results, output, retire=True, pause=stages.append)
    assert outcome.status == DONE and outcome.summary.reused is (stage == "BEFORE_RETIRE")
    assert retired_ids(captures) - before == allowed
    assert stages == (list(PAUSE_STAGES[3:]) if stage == "BEFORE_RETIRE" else list(PAUSE_STAGES))


@pytest.mark.slow
def test_raycap_retire_on_a_finalized_output_drops_each_allowed_snapshot_once(collection, tmp_path):
    captures, oracle, results, records = collection
    before = retired_ids(captures)
    _, allowed = gym_finalized(records, oracle)
    output = tmp_path / "out"
    finalize(captures, results, output, batch_size=3)
    manifest = read_manifest(output)
    assert [snapshot[1] for snapshot in manifest.records.redundant()] == ["inline-1"]
    report = raycap.retire([str(captures)], output)
    # The repeated rollout's snapshot is listed by two records in two shards: dropped once.
    assert report.dropped == len(allowed) and not report.changed and not report.errors
    assert retired_ids(captures) - before == allowed



def test_a_local_retirement_drops_several_snapshots_at_once_and_reports_each_step_in_order(collection, tmp_path, monkeypatch):
    """Each drop waits on three fsyncs: a retirement from this process makes a few at
    once (raycap.runs.retirement.DROP_THREADS), and still reports each step, in order,
    once its own drops have ended."""
    import threading
    import time

    captures, oracle, results, records = collection
    _, allowed = gym_finalized(records, oracle)
    output = tmp_path / "out"
    finalize(captures, results, output, batch_size=3)
    running, most, guard = [0], [0], threading.Lock()
    drop_now = TokenCaptureStore.drop_now

    def slow_drop(self, rollout_id, **kwargs):
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.05)  # a slow disk's fsyncs
            return drop_now(self, rollout_id, **kwargs)
        finally:
            with guard:
                running[0] -= 1

    monkeypatch.setattr(TokenCaptureStore, "drop_now", slow_drop)
    steps = []
    report = raycap.retire(
        [str(captures)], output, executor="local", on_shard=lambda name, so_far: steps.append((str(name), so_far.dropped))
    )
    assert report.dropped == len(allowed) and not report.errors
    assert most[0] > 1, "the drops ran one at a time"
    shards = [str(path) for path in sorted((output / "data").iterdir())]
    assert [name for name, _ in steps][: len(shards)] == shards  # in the manifest's order
    assert [dropped for _, dropped in steps] == sorted(dropped for _, dropped in steps)


def test_an_interrupted_local_retirement_starts_no_more_drops_and_a_rerun_finishes(collection, tmp_path, monkeypatch):
    captures, oracle, results, records = collection
    before = retired_ids(captures)
    _, allowed = gym_finalized(records, oracle)
    output = tmp_path / "out"
    finalize(captures, results, output, batch_size=3)
    drop_now = TokenCaptureStore.drop_now
    calls = []

    def interrupted(self, rollout_id, **kwargs):
        calls.append(rollout_id)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return drop_now(self, rollout_id, **kwargs)

    monkeypatch.setattr(TokenCaptureStore, "drop_now", interrupted)
    with pytest.raises(KeyboardInterrupt):
        raycap.retire([str(captures)], output, executor="local")
    started = len(calls)
    assert started < len(allowed), f"all {started} drops ran after the interruption"
    monkeypatch.setattr(TokenCaptureStore, "drop_now", drop_now)
    report = raycap.retire([str(captures)], output, executor="local")
    assert not report.errors and retired_ids(captures) - before == allowed

@pytest.mark.slow
def test_the_output_reads_as_one_table_with_every_parquet_reader(collection, tmp_path):
    captures, _, results, records = collection
    output = tmp_path / "out"
    finalize(captures, results, output, record_fields=["reward_model"])
    assert (output / RECORDS_DIR).is_dir() and sorted(os.listdir(output)) == [".manifest.json", ".records", "data"]
    names = [*schema_of("rollout").names, "reward_model"]
    rows = read_manifest(output).rows
    table = pq.read_table(output)
    assert table.num_rows == rows and table.column_names == names
    import pyarrow.dataset as pads

    assert pads.dataset(output).to_table().num_rows == rows
    pd = pytest.importorskip("pandas")
    assert len(pd.read_parquet(output)) == rows
    pl = pytest.importorskip("polars")
    assert pl.read_parquet(output / "data").height == rows and pl.read_parquet(f"{output}/**/*.parquet").height == rows
    duckdb = pytest.importorskip("duckdb")
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{output}')").fetchall()[0][0] == rows
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("parquet", data_dir=str(output), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == rows and loaded.column_names == names


def test_a_records_file_is_the_parts_checked_and_none_is_written_from_a_tampered_part(collection, tmp_path):
    # The records file streams each part (read around the page cache) and checks its
    # digest at the end: a part altered in place, its size kept, leaves no records file.
    captures, _, results, _ = collection
    output = tmp_path / "out"
    finalize(captures, results, output)
    assert write_records_file(output, tmp_path / "final.jsonl") == len(list(read_records(output)))
    parts = read_manifest(output).records.parts
    assert (tmp_path / "final.jsonl").read_bytes() == b"".join((output / p.name).read_bytes() for p in parts)
    part = output / parts[-1].name
    data = part.read_bytes()
    assert data.startswith(b"{")
    part.write_bytes(b" " + data[1:])  # still JSON, the same size, other bytes
    with pytest.raises(OutputError, match="is not the records part its manifest lists"):
        write_records_file(output, tmp_path / "again.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir() if "again" in p.name) == []


def test_a_tampered_or_misplaced_records_part_is_refused(collection, tmp_path):
    captures, _, results, _ = collection
    output = tmp_path / "out"
    finalize(captures, results, output)
    raw = json.loads((output / MANIFEST_NAME).read_text())
    part = output / raw["records"]["parts"][1]["name"]
    data = part.read_bytes()
    part.write_bytes(data.replace(b"policy", b"polic1", 1))
    with pytest.raises(OutputError, match="is not the records part its manifest lists"):
        list(read_records(output))
    part.unlink()
    part.symlink_to(tmp_path / "results.jsonl")
    with pytest.raises(OutputError, match="is a symbolic link"):
        list(read_records(output))
    part.unlink()
    part.write_bytes(data)
    for name in ("../results.jsonl", ".records/../../x.jsonl", "data/part-000000.parquet", ".records/.hidden.jsonl", "/abs.jsonl"):
        bad = copy.deepcopy(raw)
        bad["records"]["parts"][0]["name"] = name
        (output / MANIFEST_NAME).write_text(json.dumps(bad))
        with pytest.raises(OutputError, match="lists records part"):
            list(read_records(output))
    with pytest.raises(OutputError, match="holds no finalized records"):
        list(read_records(_rebuilt(captures, tmp_path)))


def _rebuilt(captures: Path, tmp_path: Path) -> Path:
    output = tmp_path / "rebuilt"
    raycap.rebuild_to_output([str(captures)], output, executor="local")
    return output


def test_a_results_file_that_is_a_link_or_a_fifo_is_refused(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    real = tmp_path / "real.jsonl"
    real.write_text("{}\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path, kind in ((link, "a symbolic link"), (fifo, "a FIFO"), (tmp_path / "none.jsonl", "does not exist")):
        with pytest.raises(ResultsError, match=kind):
            finalize(captures, path, tmp_path / "out")
    assert not lock_path(tmp_path / "out").exists()  # refused before anything was touched


def test_a_rollout_given_twice_in_one_batch_is_frozen_once_and_finalized_for_each(tmp_path):
    from collection import _append_rollout

    captures = tmp_path / "captures"
    _append_rollout(TokenCaptureStore(captures), "5-0")
    results = tmp_path / "results.jsonl"
    records = [{"_ng_task_index": 5, "_ng_rollout_index": 0, "reward": 1.0},
               {"_ng_task_index": 5, "_ng_rollout_index": 0, "reward": 2.0, "response": {"model": "m", "output": []}}]
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    outcome = finalize(captures, results, tmp_path / "out", retire=True)
    first, second = read_records(tmp_path / "out")
    assert first["response"]["output"] == second["response"]["output"] and "mask_sample" not in first
    assert first["response"]["model"] == "" and second["response"]["model"] == "m"
    rows = pq.read_table(tmp_path / "out", columns=["rollout_id", "model", "reward", "snapshot_id"]).to_pylist()
    assert [(r["rollout_id"], r["model"], r["reward"]) for r in rows] == [("5-0", "", 1.0), ("5-0", "m", 2.0)]
    assert rows[0]["snapshot_id"] == rows[1]["snapshot_id"]
    assert outcome.summary.retired.dropped == 1 and retired_ids(captures) == {"5-0"}


# --- a deeply nested results line, and many record_fields --------------------------------------------


def test_a_deeply_nested_results_line_is_refused_by_the_api_naming_the_line(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    results = tmp_path / "results.jsonl"
    # A big integer takes the exact (Python json) path; the nesting must be refused there too.
    results.write_text('{"_ng_rollout_id": "r0000", "id": 123456789012345678901, "deep": %s}\n' % _nested())
    with pytest.raises(ResultsError, match=r"results.jsonl line 1 \(record 0\) is not JSON: depth limit exceeded"):
        finalize_rollouts([captures], results, tmp_path / "out", executor="local", record_fields=["id"])
    assert not (tmp_path / "out").exists()


def test_forty_thousand_record_fields_are_checked_in_well_under_a_second(corpus_copy, tmp_path):
    names = [f"field_{i}" for i in range(40_000)] + ["field_7"]
    started = time.monotonic()
    with pytest.raises(ValueError, match="record_fields names field_7 more than once"):
        finalize_rollouts([corpus_copy("captures")], tmp_path / "results.jsonl", tmp_path / "out", record_fields=names)
    assert time.monotonic() - started < 1.0


# --- NeMo Gym's error texts in the records; a store error names the file, the log its path -----------


@pytest.fixture
def store(tmp_path):
    return TokenCaptureStore(tmp_path / "captures")


def test_finalize_rollouts_records_carry_gyms_texts_and_no_paths(store, tmp_path):
    _retired(store, "0-0")
    _corrupt(store, "1-0")
    _append_rollout(store, "2-0")
    records = [_record(0), _record(1), _record(2)]
    outcome = raycap.finalize_rollouts([str(store.root)], records, tmp_path / "out", executor="local")
    assert outcome.status == DONE, outcome.message
    got = list(raycap.read_records(tmp_path / "out"))
    assert [r["_ng_token_capture"].get("error") for r in got] == [RETIRED.format("0-0"), CORRUPT, None]
    assert str(tmp_path) not in json.dumps(got)


def _symlinked(store, rollout_id, tmp_path):
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_bytes(b"{}\n")
    store.paths(rollout_id).jsonl.symlink_to(elsewhere)


def _bad_state(store, rollout_id, tmp_path):
    _append_rollout(store, rollout_id)
    store.paths(rollout_id).state.write_bytes(b"{not json")


def _truncated(store, rollout_id, tmp_path):
    _append_rollout(store, rollout_id)
    os.truncate(store.paths(rollout_id).jsonl, 10)


def _conflicting(store, rollout_id, tmp_path):
    _append_rollout(store, rollout_id, calls=1)
    path = store.paths(rollout_id).jsonl
    line = json.loads(path.read_bytes())
    line["generation_token_ids"], line["generation_log_probs"] = [5], [-1.0]
    with path.open("a") as handle:
        handle.write(json.dumps(line, sort_keys=True) + "\n")


def _too_large(store, rollout_id, tmp_path):
    _append_rollout(store, rollout_id, calls=40)


@pytest.mark.parametrize("case, kind", [
    (_symlinked, "CaptureFileError"), (_bad_state, "JSONDecodeError"), (_truncated, "ValueError"),
    (_conflicting, "ValueError"), (_too_large, "CaptureTooLarge"),
])
@pytest.mark.slow
def test_store_errors_name_the_file_not_its_path_and_log_the_path(store, tmp_path, caplog, case, kind):
    case(store, "0-0", tmp_path)
    with caplog.at_level(logging.WARNING, logger="raycap"):
        outcome = raycap.finalize_rollouts(
            [str(store.root)], [_record(0)], tmp_path / "out", executor="local", max_capture_bytes=4000
        )
    assert outcome.status == DONE, outcome.message
    (record,) = raycap.read_records(tmp_path / "out")
    error = record["_ng_token_capture"]["error"]
    assert error.startswith(f"{kind}: ") and "0-0" in error and str(tmp_path) not in error
    assert any("0-0" in r.getMessage() and str(store.root) in r.getMessage() for r in caplog.records)
