"""Tests for raycap.output (the durable Parquet handoff) and raycap.summary (no Ray)."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from raycap.arrow import ROLLOUT_SCHEMA, builds_from_table, builds_to_table
from raycap.consumer import build_local
from raycap.output import (
    FINGERPRINT_KEY,
    INPUTS_KEY,
    RETIRE_COLUMNS,
    Inputs,
    OutputError,
    ParquetOutput,
    check_output,
    iter_retirable,
    partial_path,
    recorded_fingerprint,
    summary_path,
    write_durably,
    write_json_durably,
)
from raycap.store import TokenCaptureStore
from raycap.summary import ProgressLine, RebuildSummary, Throughput, mask_gate, summarize

INPUTS = Inputs(("/captures/a",), None, "prefix_merging", "m")


@pytest.fixture(scope="module")
def rows(fault_corpus, tmp_path_factory) -> pa.Table:
    """Rows of every fault shape, built locally (no Ray) from a copy of the fault corpus."""
    import shutil

    directory = tmp_path_factory.mktemp("output-rows") / "captures"
    shutil.copytree(fault_corpus.directory, directory)
    ids = TokenCaptureStore(directory).rollout_ids()
    return builds_to_table([build_local(rid, directory, model="m") for rid in ids])


def _batches(table: pa.Table, size: int = 7) -> list[pa.Table]:
    return [table.slice(start, size) for start in range(0, table.num_rows, size)]


# --- the durable writer -------------------------------------------------------------------


def test_commit_fsyncs_the_file_renames_it_then_fsyncs_the_directory(rows, tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", f"{src} -> {dst}"))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "rows.parquet"
    written = write_durably(out, _batches(rows), metadata=INPUTS.metadata())

    partial = partial_path(out)
    assert events == [
        ("fsync", str(partial)),
        ("replace", f"{partial} -> {out}"),
        ("fsync", str(tmp_path)),
    ]
    assert not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.parquet"]
    assert written.rows == rows.num_rows and written.file_bytes == out.stat().st_size
    assert builds_from_table(pq.read_table(out)) == builds_from_table(rows)


def test_the_output_records_its_inputs_and_their_fingerprint(rows, tmp_path):
    inputs = Inputs(("/a", "node:/b"), ("r1", "r2"), "prefix_merging", "m")
    out = tmp_path / "rows.parquet"
    write_durably(out, [rows], metadata=inputs.metadata())
    metadata = pq.read_schema(out).metadata
    assert metadata[FINGERPRINT_KEY].decode() == inputs.fingerprint() == recorded_fingerprint(out)
    described = json.loads(metadata[INPUTS_KEY])
    assert described == {"builder": "prefix_merging", "capture_dirs": ["/a", "node:/b"], "model": "m", "rollout_ids": "2 given"}
    assert pq.read_schema(out).remove_metadata().equals(ROLLOUT_SCHEMA.remove_metadata())


def test_fingerprints_differ_in_every_input():
    base = Inputs(("/a",), ("r1",), "prefix_merging", "m")
    variants = [
        Inputs(("/b",), ("r1",), "prefix_merging", "m"),
        Inputs(("/a",), ("r2",), "prefix_merging", "m"),
        Inputs(("/a",), None, "prefix_merging", "m"),
        Inputs(("/a",), ("r1",), "per_request", "m"),
        Inputs(("/a",), ("r1",), "prefix_merging", "other"),
    ]
    assert base.fingerprint() == Inputs(("/a",), ("r1",), "prefix_merging", "m").fingerprint()
    assert len({v.fingerprint() for v in variants} | {base.fingerprint()}) == len(variants) + 1


def test_a_failure_mid_stream_leaves_neither_output_nor_partial_file(rows, tmp_path):
    out = tmp_path / "rows.parquet"

    def tables():
        yield rows.slice(0, 5)
        raise RuntimeError("worker lost")

    with pytest.raises(RuntimeError, match="worker lost"):
        write_durably(out, tables(), metadata=INPUTS.metadata())
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rewrite_keeps_the_previous_output(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    write_durably(out, [rows.slice(0, 3)])
    before = out.read_bytes()
    with pytest.raises(OutputError, match="does not match the output schema"):
        write_durably(out, [pa.table({"x": [1]})])
    assert out.read_bytes() == before and not partial_path(out).exists()


def test_a_partial_file_left_by_a_crash_is_rewritten_not_appended_to(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    partial_path(out).write_bytes(b"half a file from a killed run" * 1000)
    write_durably(out, _batches(rows))
    assert pq.read_table(out).num_rows == rows.num_rows
    assert not partial_path(out).exists()


def test_two_writers_of_one_output_cannot_interleave(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    with ParquetOutput(out) as first:
        first.write(rows.slice(0, 2))
        with pytest.raises(OutputError, match="another run is writing"):
            ParquetOutput(out)
        first.commit()
    assert pq.read_table(out).num_rows == 2


def test_small_tables_are_gathered_into_row_groups(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    with ParquetOutput(out, row_group_bytes=rows.nbytes // 2) as writer:
        for table in _batches(rows, 1):
            writer.write(table)
        writer.commit()
    groups = pq.ParquetFile(out).metadata.num_row_groups
    assert 2 <= groups <= 4


def test_retirable_rows_are_read_back_from_the_durable_file_in_batches(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    write_durably(out, [rows])
    batches = list(iter_retirable(out, batch_rows=16))
    assert len(batches) > 1 and all(b.num_rows <= 32 for b in batches)
    assert all(b.column_names == list(RETIRE_COLUMNS) for b in batches)
    assert pa.concat_tables(batches).equals(rows.select(list(RETIRE_COLUMNS)))


def test_retirable_batches_never_split_a_rollouts_rows(tmp_path):
    """Chain delivery writes several rows per rollout; the retire verdict needs them all."""
    ids = [f"r{i // 5:03d}" for i in range(100)]  # five rows per rollout
    table = pa.table({"rollout_id": ids, "mask_sample": [False] * 100, "error": pa.nulls(100, pa.string()),
                      "snapshots": pa.nulls(100, ROLLOUT_SCHEMA.field("snapshots").type)})
    out = tmp_path / "chains.parquet"
    pq.write_table(table, out)
    batches = list(iter_retirable(out, batch_rows=7))
    seen = [set(b.column("rollout_id").to_pylist()) for b in batches]
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])
    assert sum(b.num_rows for b in batches) == 100


# --- deciding between reuse and rewrite ---------------------------------------------------


def test_a_new_output_is_written_and_its_directory_created(tmp_path):
    out = tmp_path / "deep" / "er" / "rows.parquet"
    assert check_output(out, INPUTS) is False
    assert out.parent.is_dir() and list(out.parent.iterdir()) == []


def test_an_output_of_the_same_inputs_is_reused(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    write_durably(out, [rows], metadata=INPUTS.metadata())
    assert check_output(out, INPUTS) is True
    assert check_output(out, INPUTS, overwrite=True) is True  # the same inputs are never rebuilt


def test_an_output_of_other_inputs_is_refused_unless_overwriting(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    write_durably(out, [rows], metadata=Inputs(("/elsewhere",), None, "prefix_merging", "m").metadata())
    with pytest.raises(OutputError, match="different inputs.*overwrite: true"):
        check_output(out, INPUTS)
    assert check_output(out, INPUTS, overwrite=True) is False


def test_a_foreign_or_unreadable_output_is_refused(rows, tmp_path):
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"x": [1]}), foreign)
    with pytest.raises(OutputError, match="no raycap fingerprint"):
        check_output(foreign, INPUTS)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet")
    with pytest.raises(OutputError, match="not a readable Parquet file"):
        check_output(garbage, INPUTS)


def test_an_output_that_cannot_be_created_fails_before_any_work(tmp_path):
    (tmp_path / "blocker").write_text("a file, not a directory")
    with pytest.raises(OutputError, match="cannot write output .*choose a writable output directory"):
        check_output(tmp_path / "blocker" / "rows.parquet", INPUTS)
    with pytest.raises(OutputError, match="is a directory"):
        check_output(tmp_path, INPUTS)


def test_json_is_replaced_atomically(tmp_path):
    target = summary_path(tmp_path / "rows.parquet")
    assert target.name == "rows.parquet.summary.json"
    write_json_durably(target, {"a": 1})
    write_json_durably(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


# --- the summary --------------------------------------------------------------------------


def test_the_summary_counts_masks_by_reason_and_percentiles_over_unmasked_rows(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    write_durably(out, _batches(rows))
    summary = summarize(out, throughput=Throughput(2.0, 20.0, 1.5), batch_rows=8)

    listed = rows.to_pylist()
    masked = [r for r in listed if r["mask_sample"]]
    unmasked = [r for r in listed if not r["mask_sample"]]
    assert summary.rollouts == len(listed) and summary.masked == len(masked) and 0 < len(masked) < len(listed)
    assert summary.failed == sum(1 for r in masked if r["error"] is not None)
    expected_reasons: dict[str, int] = {}
    for r in masked:
        for reason in set(r["mask_reasons"]):
            expected_reasons[reason] = expected_reasons.get(reason, 0) + 1
    assert summary.masked_by_reason == expected_reasons
    counts = list(summary.masked_by_reason.values())
    assert counts == sorted(counts, reverse=True)
    expected = np.percentile([r["delivered_fraction"] for r in unmasked], [10, 50, 90])
    got = summary.delivered_fraction
    assert (got.p10, got.p50, got.p90) == tuple(round(float(v), 4) for v in expected)
    assert summary.generated_tokens_captured == sum(r["generated_tokens_captured"] or 0 for r in listed)
    assert summary.generated_tokens_delivered == sum(r["generated_tokens_delivered"] for r in unmasked)

    as_json = json.loads(json.dumps(summary.to_json()))
    assert as_json["masked_fraction"] == round(len(masked) / len(listed), 4)
    assert as_json["throughput"] == {"seconds": 2.0, "rollouts_per_s": 20.0, "mb_per_s": 1.5}
    text = summary.render()
    for reason in expected_reasons:
        assert f"  {reason}" in text
    assert "20.0 rollouts/s, 1.5 MB/s" in text and "p50" in text


def test_a_summary_with_no_unmasked_rows_has_no_percentiles(rows, tmp_path):
    out = tmp_path / "rows.parquet"
    write_durably(out, [rows.filter(pc.field("mask_sample"))])
    summary = summarize(out, reused=True)
    assert summary.delivered_fraction is None and summary.generated_tokens_delivered == 0
    assert "no unmasked rows" in summary.render() and "reused" in summary.render()


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


def test_progress_redraws_one_line_on_a_terminal(monkeypatch):
    stream = _Terminal()
    line = ProgressLine("rebuild", stream, interval=0.0)
    for done in (0, 5, 10):
        line(_Progress(10, done, started=0.0))
    line.finish()
    text = stream.getvalue()
    assert text.count("\r") == 4 and text.count("\n") == 1 and text.endswith("\n")
    assert "5/10 rollouts" in text and "rebuild: 10/10 rollouts in" in text


def test_progress_is_quiet_off_a_terminal_except_for_the_final_line():
    stream = io.StringIO()
    line = ProgressLine("rebuild", stream, interval=0.0)
    for done in range(0, 11):
        line(_Progress(10, done, started=0.0))
    line.finish()
    text = stream.getvalue()
    assert "\r" not in text and text.count("\n") == 1 and text.startswith("rebuild: 10/10 rollouts in")


def test_the_handoff_and_summary_modules_do_not_import_ray():
    import subprocess
    import sys

    code = "import sys, raycap.output, raycap.summary; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
