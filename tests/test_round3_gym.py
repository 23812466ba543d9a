"""NeMo Gym parity details: the store's one re-read seam, the error texts finalized
records carry, and the warnings delivery raises.

Records are training data, aggregated by their error text, so a retired rollout and a
corrupt capture line read exactly as in NeMo Gym (`Token capture for rollout X is
retired`; the JSON parser's own message), with no machine path in them: where the bad
line is goes to the log line that names the rollout. Delivery's warnings carry Gym's
phrases ("marked for masking", "carries no id"), which Gym's collection tests match on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

import pytest

import raycap
from collection import _append_rollout
from raycap.capture import consumer, delivery
from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore
from raycap.runs.handoff import DONE

RETIRED = "RuntimeError: Token capture for rollout {} is retired"
BAD_LINE = b"garbage"
# Exactly what Python's json says of that line.
CORRUPT = "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"


def _retired(store: TokenCaptureStore, rollout_id: str) -> None:
    _append_rollout(store, rollout_id)
    snapshot = store.freeze_now(rollout_id)
    assert store.drop_now(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)


def _corrupt(store: TokenCaptureStore, rollout_id: str) -> None:
    """A capture with a bad line in the middle: corruption, not a torn final write."""
    _append_rollout(store, rollout_id, calls=1)
    path = store.paths(rollout_id).jsonl
    good = path.read_bytes()
    with path.open("ab") as handle:
        handle.write(BAD_LINE + b"\n" + good)


def _record(task: int) -> dict:
    return {"_ng_task_index": task, "_ng_rollout_index": 0, "reward": 1.0,
            "response": {"id": "r", "model": "policy", "output": [], "usage": {}}}


@pytest.fixture
def store(tmp_path):
    return TokenCaptureStore(tmp_path / "captures")


# -- the store's re-read seam ----------------------------------------------------------


def test_append_never_rescans_prior_lines_and_every_full_read_goes_through_the_seam(store, monkeypatch):
    _append_rollout(store, "r1", calls=2)

    class Rescanned(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Rescanned(args)

    monkeypatch.setattr(store, "_read_entries_unlocked", refuse)

    for n in range(3):  # appends to a rollout with prior entries read only the index
        store.append(TokenEntry(rollout_id="r1", model_call_id=f"late-{n}", prompt_token_ids=[7, n],
                                generation_token_ids=[8], generation_log_probs=[-1.0]))
    with pytest.raises(Rescanned):
        store.freeze_now("r1")
    with pytest.raises(Rescanned):
        store.read_entries("r1")

    monkeypatch.undo()
    seen = []
    real = store._read_entries_unlocked

    def counting(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "_read_entries_unlocked", counting)
    snapshot = store.freeze_now("r1")
    # Called as Gym's freeze calls it: the rollout id alone, under the freeze's lock.
    assert len(snapshot.entries) == 5 and seen == [(("r1",), {})]
    assert [e.model_call_id for e in store.read_entries("r1")] == [e.model_call_id for e in snapshot.entries]
    frozen = store.freeze_raw("r1", read=False)
    assert store.read_frozen(frozen) == store.paths("r1").jsonl.read_bytes() and len(seen) == 3


# -- error texts in builds and records ---------------------------------------------------


def test_freezing_a_retired_rollout_raises_gyms_exact_text(store):
    _retired(store, "r1")
    with pytest.raises(RuntimeError) as info:
        store.freeze_now("r1")
    assert str(info.value) == "Token capture for rollout r1 is retired"
    # A writer of the consumed attempt gets the same words first, then the way out.
    with pytest.raises(RuntimeError, match=r"^Token capture for rollout r1 is retired: .*fresh rollout id"):
        _append_rollout(store, "r1")


def test_a_corrupt_line_is_the_json_parsers_message_and_its_place_is_logged(store, caplog):
    _corrupt(store, "r1")
    path = store.paths("r1").jsonl
    with caplog.at_level(logging.WARNING, logger="raycap"):
        with pytest.raises(json.JSONDecodeError) as info:
            store.freeze_now("r1")
    with pytest.raises(json.JSONDecodeError) as plain:
        json.loads(BAD_LINE)
    assert f"JSONDecodeError: {info.value}" == f"JSONDecodeError: {plain.value}" == CORRUPT
    logged = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert logged and "r1" in logged[0] and "at byte " in logged[0]


def test_a_line_damaged_after_it_was_indexed_reads_the_same_as_one_in_the_tail(store):
    _append_rollout(store, "indexed", calls=2)
    path = store.paths("indexed").jsonl
    first, second = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(BAD_LINE + b"\n" + second)
    state = json.loads(store.paths("indexed").state.read_bytes())
    state["indexed_size"] = path.stat().st_size  # the index covers the damaged line
    store.paths("indexed").state.write_text(json.dumps(state))
    _corrupt(store, "tail")
    builds = [consumer.trajectories_for_rollout(rid, [store.root]) for rid in ("indexed", "tail")]
    assert [b["error"] for b in builds] == [CORRUPT, CORRUPT]


@pytest.mark.parametrize("case, error", [(_retired, RETIRED.format("r1")), (_corrupt, CORRUPT)])
def test_consumer_builds_carry_gyms_texts_and_no_paths(store, tmp_path, case, error):
    case(store, "r1")
    local = consumer.trajectories_for_rollout("r1", [store.root])
    from_source = asyncio.run(consumer.trajectories_from_source("r1", store))
    for build in (local, from_source):
        assert build["error"] == error and build["mask_sample"] is True
        assert str(tmp_path) not in json.dumps(build)


@pytest.mark.parametrize("case, error", [(_retired, RETIRED.format("0-0")), (_corrupt, CORRUPT)])
def test_delivery_writes_gyms_texts_into_the_record(store, tmp_path, case, error):
    case(store, "0-0")
    result = _record(0)
    with pytest.warns(UserWarning, match="marked for masking"):
        built = asyncio.run(delivery.finalize_rollout_token_capture(result, store))
    assert built["error"] == error
    assert result["_ng_token_capture"]["error"] == error and result["mask_sample"] is True
    assert str(tmp_path) not in json.dumps(result)


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


def test_a_newer_schema_is_refused_in_words_that_name_no_implementation(store):
    _append_rollout(store, "r1", calls=1)
    path = store.paths("r1").jsonl
    line = json.loads(path.read_bytes())
    line["model_call_id"], line["schema_version"] = "next", 2
    with path.open("a") as handle:
        handle.write(json.dumps(line, sort_keys=True) + "\n")
    error = consumer.trajectories_for_rollout("r1", [store.root])["error"]
    assert error.startswith("ValidationError: ") and "understands up to 1" in error
    assert "raycap" not in error


# -- delivery's warnings ----------------------------------------------------------------


def test_a_masked_build_warns_that_the_rollout_is_marked_for_masking(store):
    _append_rollout(store, "0-0")
    store.mark_incomplete_now("0-0", "lost")
    with pytest.warns(UserWarning, match=r"Token capture of rollout 0-0 is marked for masking: .*incomplete"):
        built = asyncio.run(delivery.finalize_rollout_token_capture(_record(0), store))
    assert built["mask_sample"] is True


def test_a_record_without_an_id_warns_that_it_carries_no_id(store):
    result = {"reward": 1.0, "response": {"output": []}}
    with pytest.warns(UserWarning, match="carries no id") as caught:
        built = asyncio.run(delivery.finalize_rollout_token_capture(result, store))
    assert "marked for masking" in str(caught[0].message)
    assert built["error"] == "no capture key" and result["_ng_token_capture"] == {"n_calls": 0, "error": "no capture key"}


# -- other store errors: the file by its name in the record, its path in the log -----------


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


def test_on_ray_records_and_the_node_actors_source_carry_the_same_texts(ray_shared, store, tmp_path):
    from raycap.cluster.rebuild import session as cluster

    _retired(store, "0-0")
    _corrupt(store, "1-0")
    _symlinked(store, "2-0", tmp_path)
    records = [_record(0), _record(1), _record(2)]
    outcome = raycap.finalize_rollouts([str(store.root)], records, tmp_path / "out", executor="ray", batch_size=2)
    assert outcome.status == DONE and outcome.summary.executor.name == "ray", outcome.message
    got = [r["_ng_token_capture"]["error"] for r in raycap.read_records(tmp_path / "out")]
    assert got[:2] == [RETIRED.format("0-0"), CORRUPT]
    assert got[2].startswith("CaptureFileError: rollout '2-0': capture file 2-0.tokens.jsonl is a symbolic link")

    source = cluster.token_source(str(store.root))
    for task, expected in ((0, RETIRED.format("0-0")), (1, CORRUPT)):
        result = _record(task)
        with pytest.warns(UserWarning, match="marked for masking"):
            asyncio.run(delivery.finalize_rollout_token_capture(result, source))
        assert result["_ng_token_capture"]["error"] == expected
