"""Tests for raycap.rows.arrow: builds as rows of ROLLOUT_SCHEMA and back, exactly (SPEC section 6,
"Results are Arrow tables"). Checked on a synthetic corpus with every fault shape; no Ray."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raycap.capture.consumer import RolloutBuild, build_local
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.rows.arrow import ROLLOUT_SCHEMA, builds_from_table, builds_to_table

SPEC = CorpusSpec(
    rollouts=30,
    seed=2,
    fault_share=1.0,
    system_tokens=(50, 200),
    turns=(4, 8),
    generation_tokens=(1, 40),
    tool_tokens=(1, 60),
)
TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("arrow-corpus") / "caps"
    summary = generate_corpus(directory, SPEC)
    builds = [build_local(rid, directory) for rid in summary.rollout_ids]
    return summary, builds


@pytest.fixture(scope="module")
def table(corpus):
    _, builds = corpus
    return builds_to_table(builds)


def canonical(value) -> str:
    """JSON with types visible: 1, 1.0 and True differ, so "equal" means exactly equal."""
    return json.dumps(value, sort_keys=True)


def captured_records(directory: str, rollout_id: str) -> dict[str, dict]:
    """The rollout's records as written, read with plain json, by model call id."""
    records = {}
    with open(f"{directory}/{rollout_id}.tokens.jsonl", "rb") as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                records[record["model_call_id"]] = record
    return records


def bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).view(np.uint64)


@pytest.mark.slow
def test_the_corpus_has_successes_masks_and_every_failure_kind(corpus):
    _, builds = corpus
    assert all(isinstance(b, RolloutBuild) for b in builds)
    kinds = {b.error.split(":", 1)[0] for b in builds if b.error is not None}
    assert {"RuntimeError", "JSONDecodeError", "ValidationError", "ValueError"} <= kinds
    assert any(b.error is None and not b.mask_sample for b in builds)
    assert any(b.error is None and b.mask_sample for b in builds)
    assert any(b.incomplete and b.error is None for b in builds)


def test_schema_is_rollout_schema(table, corpus):
    _, builds = corpus
    assert table.schema.equals(ROLLOUT_SCHEMA)
    assert table.num_rows == len(builds)
    assert table.column("rollout_id").to_pylist() == [b.rollout_id for b in builds]


def test_table_round_trips_to_exactly_the_build_dicts(table, corpus):
    _, builds = corpus
    expected = [b.to_build() for b in builds]
    got = builds_from_table(table)
    assert got == expected
    assert [canonical(b) for b in got] == [canonical(b) for b in expected]


def test_parquet_round_trip_keeps_the_build_dicts(table, corpus, tmp_path):
    _, builds = corpus
    path = tmp_path / "rollouts.parquet"
    pq.write_table(table, path)
    back = pq.read_table(path)
    assert back.schema.equals(ROLLOUT_SCHEMA)
    expected = [b.to_build() for b in builds]
    got = builds_from_table(back)
    assert got == expected
    assert [canonical(b) for b in got] == [canonical(b) for b in expected]


def test_round_trip_does_not_depend_on_chunking(table, corpus):
    _, builds = corpus
    chunked = pa.concat_tables([table.slice(0, 7), table.slice(7, 11), table.slice(18)])
    assert chunked.column("token_ids").num_chunks == 3
    assert [canonical(b) for b in builds_from_table(chunked)] == [canonical(b.to_build()) for b in builds]


def test_round_trip_of_no_builds():
    empty = builds_to_table([])
    assert empty.schema.equals(ROLLOUT_SCHEMA) and empty.num_rows == 0
    assert builds_from_table(empty) == []


def test_successful_rows_are_training_ready(table, corpus):
    summary, builds = corpus
    rows = table.to_pylist()
    checked = 0
    for build, row in zip(builds, rows):
        if build.error is not None:
            continue
        checked += 1
        response = build.to_build()["rebuilt_response"]
        bearing = [item for item in response["output"] if item.get("generation_token_ids") is not None]
        last = bearing[-1]
        token_ids, loss_mask, logprobs = row["token_ids"], row["loss_mask"], row["logprobs"]
        assert token_ids == last["prompt_token_ids"] + last["generation_token_ids"], build.rollout_id
        assert len(loss_mask) == len(logprobs) == len(token_ids)
        assert sum(loss_mask) == row["generated_tokens_delivered"] == build.metrics.generated_tokens_delivered
        assert set(loss_mask) <= {0, 1}

        # Generated positions, from the rebuilt response and from the captured records.
        from_response = np.zeros(len(token_ids), dtype=np.int8)
        for item in bearing:
            start = len(item["prompt_token_ids"])
            from_response[start : start + len(item["generation_token_ids"])] = 1
        assert loss_mask == from_response.tolist()

        records = captured_records(summary.directory, build.rollout_id)
        expected_lp = np.zeros(len(token_ids), dtype=np.float64)
        from_records = np.zeros(len(token_ids), dtype=np.int8)
        for call_id, start, end in zip(row["call_ids"], row["call_gen_start"], row["call_gen_end"]):
            record = records[call_id]
            assert token_ids[start:end] == record["generation_token_ids"]
            expected_lp[start:end] = record["generation_log_probs"]
            from_records[start:end] = 1
        assert loss_mask == from_records.tolist()
        # Captured values on generated positions, +0.0 elsewhere, bit for bit.
        assert np.array_equal(bits(logprobs), bits(expected_lp))
        assert np.all(bits(logprobs)[from_records == 0] == 0)
        assert row["output_tokens"] == sum(loss_mask)
        assert row["input_tokens"] == response["usage"]["input_tokens"]
        assert row["mask_sample"] == build.mask_sample
        assert row["error"] is None
    assert checked >= 15


def test_every_delivered_call_prompt_is_a_prefix_of_token_ids(table, corpus):
    summary, builds = corpus
    for build, row in zip(builds, table.to_pylist()):
        if build.error is not None:
            continue
        records = captured_records(summary.directory, build.rollout_id)
        for call_id, start in zip(row["call_ids"], row["call_gen_start"]):
            # Each delivered call saw exactly the sequence before its generation.
            assert row["token_ids"][:start] == records[call_id]["prompt_token_ids"], (build.rollout_id, call_id)


def test_failed_rows_have_no_tokens_and_say_why(table, corpus):
    _, builds = corpus
    rows = table.to_pylist()
    failed = 0
    for build, row in zip(builds, rows):
        if build.error is None:
            continue
        failed += 1
        assert row["error"] == build.error
        assert row["mask_sample"] is True
        for name in TOKEN_COLUMNS + ("input_tokens", "output_tokens", "call_ids", "unresolved_retries"):
            assert row[name] is None, (build.rollout_id, name)
        kind = build.error.split(":", 1)[0]
        assert kind in {"RuntimeError", "JSONDecodeError", "ValidationError", "ValueError"}
        assert row["mask_reasons"][0] == kind
        assert row["n_calls"] == build.metrics.n_calls
        assert row["chains"] is None
    assert failed >= 6
    for name in TOKEN_COLUMNS:
        column = table.column(name)
        assert column.null_count == failed


def test_failed_freezes_have_no_snapshot_and_builds_keep_theirs(table, corpus):
    summary, builds = corpus
    for build, row in zip(builds, table.to_pylist()):
        if build.snapshots:
            assert row["snapshot_id"] == build.snapshots[0].snapshot_id
            assert row["snapshot_version"] == build.snapshots[0].version
            assert row["capture_dirs"] == [summary.directory]
        else:
            assert row["snapshot_id"] is None and row["snapshot_version"] is None
            assert row["snapshots"] == [] and row["capture_dirs"] == []


def test_masked_rows_list_their_reasons(table, corpus):
    _, builds = corpus
    for build, row in zip(builds, table.to_pylist()):
        reasons = row["mask_reasons"]
        assert row["mask_sample"] == bool(reasons), build.rollout_id
        assert row["capture_incomplete"] == build.incomplete
        if build.error is None:
            metrics = build.to_build()["metrics"]
            expected = [
                name
                for name, hit in (
                    ("unresolved_retries", bool(row["unresolved_retries"])),
                    ("roots", metrics["roots"] != 1),
                    ("chains", metrics["chains"] != 1),
                )
                if hit
            ]
            assert [r for r in reasons if r != "capture_incomplete"] == expected
        assert ("capture_incomplete" in reasons) == build.incomplete


def test_capture_dirs_can_be_given(corpus):
    _, builds = corpus
    table = builds_to_table(builds, capture_dirs=[["/a", "/b"]] * len(builds))
    assert table.column("capture_dirs").to_pylist() == [["/a", "/b"]] * len(builds)
    assert [canonical(b) for b in builds_from_table(table)] == [canonical(b.to_build()) for b in builds]


def test_a_reason_reading_back_does_not_list_still_masks_the_rollout(table, corpus):
    """A row masked for a reason the reader does not know (a newer writer's, a stream's
    `stale`) reads back masked, with its reasons: never as a clean build."""
    from raycap.capture.maskreasons import STALE

    _, builds = corpus
    clean = next(i for i, build in enumerate(builds) if not build.mask_sample)
    rows = table.slice(clean, 1).to_pylist()
    for reason in (STALE, "a_reason_of_a_newer_writer"):
        row = dict(rows[0], mask_sample=True, mask_reasons=[reason])
        read = builds_from_table(pa.Table.from_pylist([row], schema=table.schema))[0]
        assert read["mask_sample"] is True, reason


def test_every_reason_name_has_one_owner():
    """The reason names are written out in raycap.capture.maskreasons alone."""
    from pathlib import Path

    import raycap
    from raycap.capture import maskreasons

    names = {maskreasons.UNRESOLVED_RETRIES, maskreasons.ROOTS, maskreasons.CHAINS, maskreasons.STALE,
             maskreasons.UNRESOLVED_PARENT_CALLS}
    package = Path(raycap.__file__).parent
    for path in package.rglob("*.py"):
        if path.name == "maskreasons.py":
            continue
        text = path.read_text()
        for name in names:
            for call in (f'.append("{name}")', f'in ("{name}"'):
                assert call not in text, (path, call)


def test_a_rows_snapshot_and_a_streams_part_are_one_type():
    from raycap.capture.consumer import SnapshotRef
    from raycap.stream.steps import SnapshotPart

    part = SnapshotPart("node:/captures", "s1", 3)
    assert SnapshotPart is SnapshotRef and part == SnapshotRef("node:/captures", "s1", 3)
    assert part.label == part.capture_dir == "node:/captures"
