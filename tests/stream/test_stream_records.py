"""raycap.Stream taking finished result records: the rows carry the record columns, a
committed step holds the records as NeMo Gym's finalizer leaves them (the oracle runs
that finalizer record by record on an untouched copy of the captures: tests/collection.py),
and a record is kept beside its capture until its commit, so a new stream after a crash
delivers it again with its fields. In this process (executor="local"); the SIGKILLed
trainer and the NODE:/path stream are at the end (slow)."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raycap
from collection import gym_finalized, text
from raycap import TokenCaptureStore
from raycap.capture.recordfile import RECORD
from raycap.output.manifest import is_committed, output_rollout_ids, read_manifest, shard_paths
from raycap.rows.arrow import RECORD_NAMES
from raycap.runs.stream import Stream
from raycap.stream.stepcommit import StepCommit
from test_stream import _Crash, _crash, call, reference, write

ROOT = Path(__file__).resolve().parents[2]


def record(rid: str, task: int, index: int, reward, **extra) -> dict:
    """A result record as a collection writes it, naming its rollout explicitly."""
    out = {
        "_ng_task_index": task, "_ng_rollout_index": index, "_ng_rollout_id": rid, "reward": reward,
        "agent_ref": {"name": "swe"}, "response": {"id": "r", "model": f"policy-{task}", "output": [{"type": "message"}]},
    }
    out.update(extra)
    return out


def expected_columns(rec: dict, position: int) -> dict:
    """SPEC 10.7's record columns of a row built from `rec`, given at `position` of a submit."""
    reward = rec.get("reward")

    def index(key):
        value = rec.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    agent = rec.get("agent_ref")
    return {
        "reward": float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None,
        "task_index": index("_ng_task_index"),
        "rollout_index": index("_ng_rollout_index"),
        "attempt_index": index("_ng_attempt_index"),
        "agent_name": agent.get("name") if isinstance(agent, dict) and isinstance(agent.get("name"), str) else None,
        "record_index": position,
    }


def two_stores(tmp_path: Path, kinds: dict[str, str]) -> tuple[TokenCaptureStore, Path]:
    """The stream's captures, and an untouched copy for the oracle."""
    store = TokenCaptureStore(tmp_path / "c")
    for rid, kind in kinds.items():
        write(store, rid, kind)
    oracle = tmp_path / "oracle"
    shutil.copytree(store.directory, oracle)
    return store, oracle


def read_step(path: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in shard_paths(path)])


# --- the rows and the step ---------------------------------------------------------------------


@pytest.mark.slow
def test_records_give_their_rows_the_record_columns_and_the_step_the_records_gyms_finalizer_makes(collection, tmp_path):
    captures, oracle, _, records = collection
    gyms, _ = gym_finalized(records, oracle)
    step = tmp_path / "step-0"
    given = [r for r in records if isinstance(r, dict)]  # a list is no record: submit refuses the whole call
    with Stream([str(captures)], executor="local") as stream:
        submitted = stream.submit(given)
        ready = set(submitted.ready)
        rows = stream.take(len(ready), timeout=60)
        assert stream.take(1, timeout=0.1).num_rows == 0
        before = stream.records(rows)
        report = stream.commit(rows, output=step)

    # The rollouts taken are exactly the records that were not refused (in the order they
    # became ready: the corpus's frozen ones were found at start).
    accepted = [i for i in range(len(given)) if f"record {i}" not in submitted.refused]
    assert sorted(rows.column("rollout_id").to_pylist()) == sorted(ready)
    assert sorted(rows.column("record_index").to_pylist()) == accepted and len(accepted) == len(ready)
    for i in set(range(len(given))) - set(accepted):
        if "another record of rollout" in submitted.refused[f"record {i}"]:
            continue  # a repeated id: one record per rollout and submit
        # Never one Gym's finalizer builds into an unmasked record.
        finalized = gyms[records.index(given[i])]
        assert finalized.get("mask_sample") or "_ng_token_capture" not in finalized, submitted.refused[f"record {i}"]
    # Every row carries its record's columns, and the model its response names.
    for row in rows.select(["rollout_id", "model", *RECORD_NAMES]).to_pylist():
        rec = given[row["record_index"]]
        assert {k: row[k] for k in RECORD_NAMES} == expected_columns(rec, row["record_index"])
        response = rec.get("response")
        assert row["model"] == (response.get("model") or "" if isinstance(response, dict) else "")
    # The committed step holds each record as Gym's finalizer leaves it, in commit order.
    order = rows.column("record_index").to_pylist()
    expected = [gyms[records.index(given[i])] for i in order]
    got = list(raycap.read_records(step))
    assert len(got) == len(expected) == len(report.records) == len(before)
    for i, (mine, gyms_record, early, reported) in enumerate(zip(got, expected, before, report.records)):
        assert text(mine, captures) == text(gyms_record, oracle), f"record {order[i]}"
        assert text(early, captures) == text(mine, captures) == text(reported, captures)
    assert read_step(step).equals(rows)
    assert read_manifest(step).records.counts.records == len(expected)


def test_refused_records_are_never_frozen_and_say_why(tmp_path):
    store = TokenCaptureStore(tmp_path)
    write(store, "open")  # captured, still running: never cut
    given = [
        {"reward": 1.0, "response": {"model": "m"}},  # no id: no capture key
        {"_ng_rollout_id": "../etc", "reward": 1.0},  # malformed id
        {"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": "x"},  # malformed attempt
        {"_ng_rollout_id": "ghost", "reward": 1.0},  # no capture anywhere
        {"_ng_task_index": "a b", "_ng_rollout_index": 0},  # an id the store refuses
        {"response": {"output": [{"generation_token_ids": [1]}]}},  # its own token ids, no id
        {"_ng_rollout_id": "open", "when": float("nan"), "bad": {1, 2}},  # not JSON
    ]
    with Stream([tmp_path], executor="local", watch=True) as stream:
        submitted = stream.submit(given)
        assert submitted.ready == ()
        assert set(submitted.refused) == {f"record {i}" for i in range(len(given))}
        assert submitted.refused["record 0"] == "no capture key"
        assert submitted.refused["record 1"].startswith("malformed rollout id: _ng_rollout_id must be a string")
        assert submitted.refused["record 2"].startswith("malformed rollout id:")
        assert "no capture of rollout ghost" in submitted.refused["record 3"]
        assert "Invalid rollout id: 'a b-0'" in submitted.refused["record 4"]
        assert "carries token ids and it names no rollout" in submitted.refused["record 5"]
        assert "not a JSON value" in submitted.refused["record 6"]
        assert stream.take(1, timeout=0.3).num_rows == 0
    assert store.rollout_ids() == ["open"] and not store.lifecycle("open").frozen
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(RECORD)) == []
    store.append(call("open", "ok", 3))  # still open for writes


@pytest.mark.parametrize("single", [{"_ng_rollout_id": "r1"}, {}])
def test_a_single_record_is_a_type_error_that_freezes_nothing(tmp_path, single):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    with Stream([tmp_path], executor="local") as stream:
        with pytest.raises(TypeError, match="wrap a single id in a list"):
            stream.submit(single)
        with pytest.raises(TypeError, match="neither a rollout id nor a record"):
            stream.submit([{"_ng_rollout_id": "r1"}, ["r1"]])
    assert not store.lifecycle("r1").frozen and not store.record_path("r1").exists()


def test_ids_and_records_mix_and_rows_of_rollouts_given_by_id_have_null_record_columns(tmp_path):
    store = TokenCaptureStore(tmp_path)
    for rid in ("a", "b", "c"):
        write(store, rid)
    with Stream([tmp_path], executor="local") as stream:
        submitted = stream.submit(["a", record("b", 3, 1, 0.5), "c"])
        assert submitted.ready == ("a", "b", "c") and not submitted.refused
        rows = stream.take(3, timeout=10).select(["rollout_id", "model", *RECORD_NAMES]).to_pylist()
    assert [r["rollout_id"] for r in rows] == ["a", "b", "c"]
    assert {k: rows[1][k] for k in RECORD_NAMES} == expected_columns(record("b", 3, 1, 0.5), 1)
    assert rows[1]["model"] == "policy-3"
    for row in (rows[0], rows[2]):
        assert all(row[k] is None for k in RECORD_NAMES) and row["model"] == ""


def test_a_second_record_for_a_pending_rollout_is_refused_unless_it_is_the_same(tmp_path):
    store = TokenCaptureStore(tmp_path)
    for rid in ("r1", "r2", "r3"):
        write(store, rid)
    first = record("r1", 0, 0, 1.0)
    with Stream([tmp_path], executor="local") as stream:
        assert stream.submit([first]).ready == ("r1",)
        again = stream.submit([copy.deepcopy(first), record("r2", 0, 1, 2.0), record("r2", 0, 1, 3.0)])
        assert again.ready == ("r1", "r2")  # the same record again is a no-op, as a repeated id is
        assert list(again.refused) == ["record 2"] and "another record of rollout r2" in again.refused["record 2"]
        other = stream.submit([record("r1", 0, 0, 0.0)])
        assert other.ready == () and "pending with another record" in other.refused["record 0"]
        assert stream.submit(["r3"]).ready == ("r3",)
        rows = stream.take(3, timeout=10)
        # Taken: the same record is a no-op, another one (or one for r3, taken without) refused.
        assert stream.submit([first]).ready == ("r1",)
        late = stream.submit([record("r1", 9, 9, 9.0), record("r3", 0, 3, 1.0)])
        assert late.ready == () and set(late.refused) == {"record 0", "record 1"}
        assert "taken from this stream with another record" in late.refused["record 0"]
        assert "taken from this stream without a record" in late.refused["record 1"]
        assert rows.column("reward").to_pylist() == [1.0, 2.0, None]
        stream.commit(rows)
    assert not any(store.record_path(rid).exists() for rid in ("r1", "r2", "r3"))


def test_a_record_submitted_after_its_rollout_was_found_frozen_is_delivered_with_it(tmp_path):
    """A finalizer froze the rollout and a watching stream built it ahead; the record
    (from the results file) arrives after, before the take."""
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    store.freeze_raw("r1")
    with Stream([tmp_path], executor="local", watch=True) as stream:
        deadline = time.monotonic() + 10
        while not stream._built and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream._built and stream._built[0].record is None  # built without a record
        assert stream.submit([record("r1", 4, 2, 0.25)]).ready == ("r1",)
        rows = stream.take(1, timeout=10)
    assert rows.column("reward").to_pylist() == [0.25] and rows.column("task_index").to_pylist() == [4]


# --- kept until the commit --------------------------------------------------------------------------


def test_a_record_taken_and_not_committed_is_delivered_again_with_its_fields_then_committed_once(tmp_path):
    store, oracle = two_stores(tmp_path, {"good": "ok", "masked": "two_roots"})
    given = [record("good", 1, 0, 0.75, verdict="pass"), record("masked", 1, 1, -1.0, text="é ✓ 🚀")]
    gyms, _ = gym_finalized(given, oracle)
    with Stream([store.directory], executor="local") as stream:
        stream.submit(copy.deepcopy(given))
        first = stream.take(2, timeout=10)
        given[0]["reward"] = 99.0  # the caller's dict changing after submit changes nothing kept
    # close() writes nothing: the next stream sees exactly what a killed one leaves.
    assert store.record_path("good").exists() and store.record_path("masked").exists()
    with Stream([store.directory], executor="local") as stream:
        again = stream.take(2, timeout=10)
        assert again.equals(first)
        assert again.column("reward").to_pylist() == [0.75, -1.0]
        report = stream.commit(again, output=tmp_path / "step-0")
    assert (report.retired, report.kept_as_evidence) == (1, 1)
    assert [text(r, store.directory) for r in raycap.read_records(tmp_path / "step-0")] == [
        text(r, oracle) for r in gyms
    ]
    # Retired iff committed unmasked, its record file with it; the masked one keeps both.
    assert store.lifecycle("good").retired and not store.record_path("good").exists()
    assert not store.lifecycle("masked").retired and store.paths("masked").jsonl.exists()
    assert store.record_path("masked").exists()
    with Stream([store.directory], executor="local", watch=True) as stream:
        assert stream.take(1, timeout=0.3).num_rows == 0  # committed exactly once
        assert stream.submit([given[1]]).ready == ()  # and its evidence takes no record


@pytest.mark.parametrize("crash_at", ["mark", "write", "retire"])
def test_a_commit_that_dies_keeps_the_records_and_the_next_stream_finishes_or_redelivers(tmp_path, monkeypatch, crash_at):
    store, oracle = two_stores(tmp_path, {"r1": "ok", "r2": "two_roots"})
    given = [record("r1", 0, 0, 1.0), record("r2", 0, 1, 0.0)]
    gyms, _ = gym_finalized(given, oracle)
    step = tmp_path / "step-0"
    with Stream([store.directory], executor="local") as stream:
        stream.submit(given)
        rows = stream.take(2, timeout=10)
        monkeypatch.setattr(StepCommit, crash_at, _crash)
        with pytest.raises(_Crash):
            stream.commit(rows, output=step)
    monkeypatch.undo()
    assert store.record_path("r1").exists() and store.record_path("r2").exists()
    with Stream([store.directory], executor="local") as stream:
        again = stream.take(2, timeout=0.3 if crash_at == "retire" else 10)
        if crash_at == "retire":
            assert again.num_rows == 0 and stream.stats.recovered_finished == 1  # the step was committed
        else:
            by_id = dict(zip(again.column("rollout_id").to_pylist(), again.column("reward").to_pylist()))
            assert by_id == {"r1": 1.0, "r2": 0.0}
            stream.commit(again, output=step)
    got = {r["_ng_rollout_id"]: text(r, store.directory) for r in raycap.read_records(step)}
    assert got == {r["_ng_rollout_id"]: text(r, oracle) for r in gyms}
    assert store.lifecycle("r1").retired and not store.record_path("r1").exists()
    assert store.record_path("r2").exists() and not store.lifecycle("r2").retired


def test_a_retirement_that_dies_after_its_tombstone_is_finished_by_the_next_stream(tmp_path, monkeypatch):
    # The drop makes the retired state durable, then removes the capture, the record file
    # and the commit marker. A trainer killed in between left a retired rollout with its
    # record file and marker for good: every later stream skips a retired rollout by name.
    import raycap.capture.store as store_module

    store, oracle = two_stores(tmp_path, {"r1": "ok"})
    given = [record("r1", 0, 0, 1.0)]
    gyms, _ = gym_finalized(given, oracle)
    real_unlink_all = store_module.unlink_all

    def dies_while_dropping(paths):
        paths = list(paths)
        if store.record_path("r1") in paths:
            raise _Crash("killed after the tombstone")
        real_unlink_all(paths)

    with Stream([store.directory], executor="local") as stream:
        stream.submit(given)
        rows = stream.take(1, timeout=10)
        monkeypatch.setattr(store_module, "unlink_all", dies_while_dropping)
        with pytest.raises(_Crash):
            stream.commit(rows, output=tmp_path / "step-0")
    monkeypatch.undo()
    assert store.lifecycle("r1").retired and store.record_path("r1").exists() and store.commit_path("r1").exists()
    with Stream([store.directory], executor="local", watch=True) as stream:
        assert stream.take(1, timeout=0.3).num_rows == 0  # committed once, never again
    assert not store.record_path("r1").exists() and not store.commit_path("r1").exists()
    assert not store.paths("r1").jsonl.exists() and store.lifecycle("r1").retired
    assert [text(r, store.directory) for r in raycap.read_records(tmp_path / "step-0")] == [text(r, oracle) for r in gyms]


def test_without_an_output_the_records_reach_the_caller_before_anything_is_retired(tmp_path, monkeypatch):
    store, oracle = two_stores(tmp_path, {"r1": "ok"})
    given = [record("r1", 0, 0, 1.0)]
    gyms, _ = gym_finalized(given, oracle)
    with Stream([store.directory], executor="local") as stream:
        stream.submit(given)
        rows = stream.take(1, timeout=10)
        records = stream.records(rows)
        assert not store.lifecycle("r1").retired and store.read_commit("r1") is None  # nothing committed by it
        records[0]["reward"] = "changed by the caller"
        report = stream.commit(rows)
        with pytest.raises(ValueError, match="was not taken from this stream, or was committed already"):
            stream.records(rows)
    assert [text(r, store.directory) for r in report.records] == [text(r, oracle) for r in gyms]
    assert store.lifecycle("r1").retired and not store.record_path("r1").exists()


def test_stale_and_chain_rows_carry_the_record_columns_and_the_records_stay_gyms(tmp_path):
    kinds = {"old": "ok", "branchy": "two_roots", "fresh": "ok"}
    store = TokenCaptureStore(tmp_path / "c")
    for rid, kind in kinds.items():
        write(store, rid, kind, versions=[1, 1, 1] if rid == "old" else [5, 5, 5])
    oracle = tmp_path / "oracle"
    shutil.copytree(store.directory, oracle)
    given = [record(rid, 2, i, float(i)) for i, rid in enumerate(kinds)]
    gyms, _ = gym_finalized(given, oracle)
    with Stream([store.directory], executor="local", delivery="chains", version_key="policy_version") as stream:
        stream.submit(given)
        rows = stream.take(3, timeout=10, current_version=5, max_staleness=1)
        report = stream.commit(rows, output=tmp_path / "step-0")
    by_row = rows.select(["rollout_id", "chain_index", "mask_reasons", *RECORD_NAMES]).to_pylist()
    assert [r["rollout_id"] for r in by_row] == ["old", "branchy", "branchy", "fresh"]
    for row in by_row:
        i = list(kinds).index(row["rollout_id"])
        assert {k: row[k] for k in RECORD_NAMES} == expected_columns(given[i], i)
    assert "stale" in by_row[0]["mask_reasons"]
    # The stale rollout's record is what Gym's finalizer makes of its capture (unmasked);
    # the branchy one's is Gym's single-response build (masked: two roots).
    assert [text(r, store.directory) for r in raycap.read_records(tmp_path / "step-0")] == [
        text(r, oracle) for r in gyms
    ]
    assert "mask_sample" not in gyms[0] and gyms[1]["mask_sample"] is True
    # Retired by the stream's rule (chain rows all unmasked), kept as evidence when stale.
    assert (report.retired, report.kept_as_evidence) == (2, 1)
    assert store.record_path("old").exists() and not store.record_path("fresh").exists()
    assert not store.record_path("branchy").exists()


def test_a_record_whose_response_carries_token_ids_is_delivered_and_left_as_it_is(tmp_path):
    store, oracle = two_stores(tmp_path, {"inline": "ok"})
    given = [record("inline", 0, 0, 1.0, response={"model": "m", "output": [{"generation_token_ids": [5, 6]}]})]
    gyms, retire = gym_finalized(given, oracle)
    with Stream([store.directory], executor="local") as stream:
        stream.submit(given)
        rows = stream.take(1, timeout=10)
        report = stream.commit(rows, output=tmp_path / "step-0")
    assert rows.column("reward").to_pylist() == [1.0] and rows.column("model").to_pylist() == ["m"]
    assert list(raycap.read_records(tmp_path / "step-0")) == gyms == given  # as Gym leaves it: unchanged
    assert retire == {"inline"} and report.retired == 1 and store.lifecycle("inline").retired
    assert read_manifest(tmp_path / "step-0").records.counts.redundant == 1


# --- the record file -------------------------------------------------------------------------------


def test_the_record_file_is_kept_beside_the_capture_and_goes_only_with_it(tmp_path):
    from raycap.capture.recordfile import KeptRecord

    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    one, other = KeptRecord(0, b'{"_ng_rollout_id":"r1"}'), KeptRecord(3, b'{"_ng_rollout_id":"r1","x":1}')
    assert store.write_record("r1", one) is None
    assert store.write_record("r1", other) is None  # not frozen: never taken, replaced
    assert store.read_record("r1") == other and store.rollout_ids() == ["r1"]
    snap = store.freeze_raw("r1")
    assert "pending with another record" in store.write_record("r1", one)
    assert store.write_record("r1", KeptRecord(5, other.data)) is None and store.read_record("r1") == other
    assert store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version)
    assert not store.record_path("r1").exists()
    assert "retired" in store.write_record("r1", one)
    # A record file alone never makes a rollout listed; delete and the sweep remove it.
    store.record_path("r2").write_bytes(one.to_bytes())
    assert store.held(["r2"]) == {} and "r2" not in store.rollout_ids()
    store.delete("r2")
    assert not store.record_path("r2").exists()
    store.record_path("r1").write_bytes(one.to_bytes())  # left by an interrupted drop
    assert store.sweep_retired(0) == 1 and not store.record_path("r1").exists()


def test_a_damaged_record_file_holds_its_rollout_back_and_a_link_is_never_followed(tmp_path):
    store = TokenCaptureStore(tmp_path / "c")
    for rid in ("linked", "fifo", "garbled", "huge", "elsewhere", "fine"):
        write(store, rid)
        store.freeze_raw(rid)
    target = tmp_path / "target.json"
    target.write_text('{"record_index":0,"record":{"_ng_rollout_id":"linked"}}')
    os.symlink(target, store.record_path("linked"))
    os.mkfifo(store.record_path("fifo"))
    store.record_path("garbled").write_text('{"record_index":0,"record":')
    with open(store.record_path("huge"), "wb") as handle:
        handle.truncate((64 << 20) + 1)
    store.record_path("elsewhere").write_text('{"record_index":0,"record":{"_ng_rollout_id":"fine"}}')
    with Stream([store.directory], executor="local") as stream:
        assert stream.take(1, timeout=10).column("rollout_id").to_pylist() == ["fine"]
        assert stream.take(1, timeout=0.2).num_rows == 0 and stream.stats.damaged_records == 5
        # A record given for a rollout frozen beside a damaged file is refused, never written through it.
        assert "symbolic link" in stream.submit([{"_ng_rollout_id": "linked"}]).refused["record 0"]
    assert target.read_text() == '{"record_index":0,"record":{"_ng_rollout_id":"linked"}}'
    assert not any(store.lifecycle(rid).retired for rid in ("linked", "fifo", "garbled", "huge", "elsewhere"))


# --- SIGKILL at any moment (slow: a subprocess) ------------------------------------------------------


TRAINER = r"""
import json, os, sys, time
import raycap

capture, steps, log, results = sys.argv[1:5]
records = [json.loads(line) for line in open(results)]
with raycap.Stream([capture], executor="local") as stream:
    stream.submit(records)  # a restarted trainer submits its results again: the same records are no-ops
    while True:
        rows = stream.take(3, timeout=0.2)
        if not rows.num_rows:
            continue
        with open(log, "a") as f:
            f.write("took " + json.dumps(rows.select(["rollout_id", "reward", "task_index", "record_index"]).to_pylist()) + "\n")
        stream.commit(rows, output=os.path.join(steps, f"step-{time.time_ns()}"))
        with open(log, "a") as f:
            f.write("committed " + " ".join(rows.column("rollout_id").to_pylist()) + "\n")
"""


@pytest.mark.slow  # a subprocess killed at random moments
def test_a_trainer_taking_records_killed_at_random_moments_commits_each_once_with_its_record(tmp_path):
    seed = int(os.environ.get("RAYCAP_CRASH_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    kinds = {f"t{i // 4}-{i % 4}": ("two_roots" if i % 5 == 3 else "ok") for i in range(16)}
    store, oracle = two_stores(tmp_path, kinds)
    given = [record(rid, i // 4, i % 4, i / 4) for i, rid in enumerate(kinds)]
    gyms, _ = gym_finalized(given, oracle)
    results, steps, log, script = tmp_path / "results.jsonl", tmp_path / "steps", tmp_path / "log", tmp_path / "t.py"
    results.write_text("".join(json.dumps(r) + "\n" for r in given))
    steps.mkdir()
    script.write_text(TRAINER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(store.directory), str(steps), str(log), str(results)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def committed() -> dict[str, list[str]]:
        return {p.name: sorted(output_rollout_ids(p)) for p in sorted(steps.iterdir()) if is_committed(p)}

    for _ in range(4):
        trainer = start()
        time.sleep(rng.uniform(0.8, 2.0))
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    trainer = start()
    deadline = time.monotonic() + 120
    while {rid for ids in committed().values() for rid in ids} != set(kinds) and time.monotonic() < deadline:
        assert trainer.poll() is None, trainer.stderr.read().decode()[-3000:]
        time.sleep(0.2)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()

    context = f"(seed {seed})"
    by_step = committed()
    seen = [rid for ids in by_step.values() for rid in ids]
    assert sorted(seen) == sorted(kinds), f"every rollout in exactly one step {context}"
    finalized = {}
    for name in by_step:
        rows = read_step(steps / name).to_pylist()
        for row, rec in zip(rows, raycap.read_records(steps / name), strict=True):
            i = list(kinds).index(row["rollout_id"])
            assert {k: row[k] for k in RECORD_NAMES} == expected_columns(given[i], i), context
            finalized[row["rollout_id"]] = rec
    for i, rid in enumerate(kinds):
        assert text(finalized[rid], store.directory) == text(gyms[i], oracle), f"{rid} {context}"
        masked = reference(rid, oracle)["mask_sample"]
        assert store.lifecycle(rid).retired == (not masked), f"{rid}: retired iff committed unmasked {context}"
        assert store.record_path(rid).exists() == masked, f"{rid}: its record file goes with its capture {context}"
    # Every time a rollout was taken, it came with its record's fields.
    for line in log.read_text().splitlines():
        if line.startswith("took "):
            for row in json.loads(line[5:]):
                i = list(kinds).index(row["rollout_id"])
                assert (row["reward"], row["task_index"], row["record_index"]) == (i / 4, i // 4, i), context
