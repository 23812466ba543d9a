"""Tests for the jobs (jobs/rebuild.py, clear.py, sweep.py) and their configs, run in-process
on the shared Ray. The job run as a process of its own (killed at a stage and rerun, or
started fresh) is tested in tests/system/test_job_processes.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore
from raycap.cli import clear as clear_job
from raycap.cli import rebuild as rebuild_job
from raycap.cli import sweep as sweep_job
from raycap.cli.jobconfig import (
    ClearJobConfig,
    ConfigError,
    RebuildJobConfig,
    SweepJobConfig,
    load_config,
    load_job_config,
)
from raycap.output.commit import Inputs, rejected_path, staging_path, summary_path
from raycap.output.manifest import RETIRE_MARKER_NAME, is_committed, read_manifest, shard_paths
from raycap.rows.arrow import CHAIN_SCHEMA

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_cluster_address(monkeypatch):
    # In-process jobs must use the shared embedded Ray, never a cluster named by the caller.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def write_config(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def run(main, config: Path, capsys) -> tuple[int, str, str]:
    code = main(["--config", str(config)])
    out, err = capsys.readouterr()
    return code, out, _own_lines(err)


def _own_lines(err: str) -> str:
    """stderr without the lines Ray forwards from worker processes (they may belong to an
    earlier test's rebuild and arrive late)."""
    return "".join(line for line in err.splitlines(keepends=True) if "pid=" not in line)


def _states(directory: str | Path) -> dict[str, dict]:
    suffix = ".tokens.state.json"
    return {p.name[: -len(suffix)]: json.loads(p.read_text()) for p in Path(directory).glob("*" + suffix)}


def retired(directory: str | Path) -> set[str]:
    return {rid for rid, state in _states(directory).items() if state.get("retired")}


def frozen(directory: str | Path) -> set[str]:
    return {rid for rid, state in _states(directory).items() if state.get("frozen")}


def with_jsonl(directory: str | Path) -> set[str]:
    return {p.name[: -len(".tokens.jsonl")] for p in Path(directory).glob("*.tokens.jsonl")}


def files_of(output: Path) -> dict[str, tuple[int, bytes]]:
    """The committed dataset's files (inode and bytes), the retire marker aside."""
    return {str(p.relative_to(output)): (p.stat().st_ino, p.read_bytes()) for p in output.rglob("*") if p.is_file() and p.name != RETIRE_MARKER_NAME}


def fingerprint_of(output: Path) -> str:
    return read_manifest(output).fingerprint


def split_rows(output: Path) -> tuple[set[str], set[str]]:
    rows = pq.read_table(output, columns=["rollout_id", "mask_sample"]).to_pylist()
    return {r["rollout_id"] for r in rows if not r["mask_sample"]}, {r["rollout_id"] for r in rows if r["mask_sample"]}


def assert_handoff_kept_its_promise(captures: str, output: Path, before_retired: set[str], before_jsonl: set[str]) -> None:
    """Retired = what was retired before + exactly the unmasked rows of the durable output;
    every masked rollout that had a capture still has it."""
    assert is_committed(output) and not staging_path(output).exists()
    ids = pq.read_table(output, columns=["rollout_id"]).column(0).to_pylist()
    assert len(ids) == len(set(ids)), "one row per rollout"
    unmasked, masked = split_rows(output)
    assert retired(captures) == before_retired | unmasked
    assert masked & before_jsonl <= with_jsonl(captures)
    assert masked & before_jsonl, "the corpus should have masked rollouts with captures"


def rebuild_config(tmp_path: Path, captures: str, **keys) -> Path:
    base = {"capture_dirs": [captures], "output": "out/rows", "model": "m", "batch_size": 4}
    return write_config(tmp_path / "rebuild.yaml", **{**base, **keys})


# --- configs and jobs that cannot start -------------------------------------------------------

BAD_CONFIGS = {
    "unknown key": ({"retrie": True}, r"unknown key 'retrie' \(known keys: capture_dirs, "),
    "bad builder": ({"builder": "nope"}, r"builder: unknown builder 'nope'; known builders: per_request, prefix_merging"),
    "missing directory": ({"capture_dirs": ["nowhere"]}, r"capture directory \S*/nowhere does not exist"),
    "unwritable output directory": ({"output": "blocker/rows"}, r"cannot write output \S*/blocker/rows"),
    "resources for a cluster": ({"ray": {"address": "auto", "num_cpus": 2}}, r"ray.num_cpus sizes an embedded Ray only"),
    "two id sources": ({"rollout_ids": ["r1"], "rollout_ids_file": "ids.txt"}, r"give rollout_ids or rollout_ids_file"),
    "invalid rollout id": ({"rollout_ids": ["../etc"]}, r"Invalid rollout id: '../etc'"),
    "missing output": ({"output": None}, r"output: "),
    "unknown executor": ({"executor": "gpu"}, r"executor: Input should be 'auto', 'ray' or 'local'"),
    "local executor on a node's directory": (
        {"executor": "local", "capture_dirs": ["node-a:/abs/captures"]},
        r"executor local reads capture directories in this process, but node-a:/abs/captures names a node",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_rebuild_that_cannot_start_exits_2_with_a_one_line_reason(case, tmp_path, capsys):
    (tmp_path / "captures").mkdir()
    (tmp_path / "blocker").write_text("a file where the output directory should be")
    edits, pattern = BAD_CONFIGS[case]
    config = rebuild_config(tmp_path, "captures", **edits)
    code, out, err = run(rebuild_job.main, config, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("jobs.rebuild: "), err
    assert re.search(pattern, err), err
    assert not (tmp_path / "out" / "rows").exists()


def test_relative_paths_are_resolved_against_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "ids.txt").write_text("# rollouts to build\nr1\n\nr2\n")
    config = write_config(
        tmp_path / "conf" / "job.yaml",
        capture_dirs=["../captures", "node-a:/abs/captures", {"path": "/abs/other", "node": "rack=b"}],
        rollout_ids_file="ids.txt",
        output="../out/rows",
    )
    monkeypatch.chdir("/")
    parsed = load_config(config, RebuildJobConfig)
    assert parsed.labels == [str(tmp_path / "captures"), "node-a:/abs/captures", "rack=b:/abs/other"]
    assert parsed.rollout_ids == ["r1", "r2"]
    assert parsed.output == tmp_path / "out" / "rows"
    assert parsed.retire is False and parsed.mask_fraction_min_samples == 50 and parsed.ray.address is None


def test_a_config_that_is_not_a_mapping_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(bad, RebuildJobConfig)
    bad.write_text("capture_dirs: [\n")
    with pytest.raises(ConfigError, match="line 2 is not valid YAML"):
        load_config(bad, RebuildJobConfig)


def test_the_shipped_configs_are_valid_and_document_every_key():
    for name in ("demo.yaml", "cluster.yaml"):
        path = REPO / "configs" / name
        parsed = load_config(path, RebuildJobConfig)
        lines = path.read_text().splitlines()
        for index, line in enumerate(lines):
            key = re.match(r"^([a-z_]+):", line)
            if key:
                assert lines[index - 1].startswith("#"), f"{name}: key {key.group(1)} has no comment above it"
        assert set(yaml.safe_load(path.read_text())) == set(RebuildJobConfig.model_fields) - {"rollout_ids_file"}
        assert parsed.capture_dirs
    # The demo takes the packaged config's relative paths from the folder it writes into.
    demo = load_job_config(REPO / "configs" / "demo.yaml", RebuildJobConfig, base_dir=REPO)
    assert demo.labels == [str(REPO / "demo-data")] and demo.output == REPO / "out" / "demo"


def test_the_clear_and_sweep_configs_document_every_key(tmp_path):
    for name, model in (("clear.yaml", ClearJobConfig), ("sweep.yaml", SweepJobConfig)):
        text = (REPO / "configs" / name).read_text()
        lines = text.splitlines()
        for index, line in enumerate(lines):
            if re.match(r"^[a-z_]+:", line):
                assert lines[index - 1].startswith("#"), f"{name}: {line}"
        assert set(yaml.safe_load(text)) == set(model.model_fields)
    # Valid as shipped once its records file exists.
    copy = tmp_path / "configs"
    copy.mkdir()
    (copy / "clear.yaml").write_text((REPO / "configs" / "clear.yaml").read_text())
    (tmp_path / "out").mkdir()
    (copy / "out").mkdir()
    (copy / "out" / "dispatch.jsonl").write_text("{}\n")
    assert load_config(copy / "clear.yaml", ClearJobConfig).records == copy / "out" / "dispatch.jsonl"
    assert load_config(REPO / "configs" / "sweep.yaml", SweepJobConfig).older_than_seconds == 86400


# --- the rebuild job ---------------------------------------------------------------------------


def test_rebuild_writes_rows_and_summary_then_retires_only_unmasked_rows(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    before_retired, before_jsonl = retired(captures), with_jsonl(captures)
    config = rebuild_config(
        tmp_path, captures, retire=True, max_mask_fraction=1.0, mask_fraction_min_samples=1, executor="ray"
    )
    code, out, err = run(rebuild_job.main, config, capsys)
    assert code == 0, err
    output = tmp_path / "out" / "rows"
    assert_handoff_kept_its_promise(captures, output, before_retired, before_jsonl)
    marker = json.loads((output / RETIRE_MARKER_NAME).read_text())
    assert marker["state"] == "finished" and marker["dropped"] == len(split_rows(output)[0])

    unmasked, masked = split_rows(output)
    summary = json.loads(summary_path(output).read_text())
    assert summary["rollouts"] == len(unmasked) + len(masked) and summary["masked"] == len(masked)
    assert summary["retired"]["dropped"] == len(unmasked) and summary["retired"]["error_count"] == 0
    assert summary["mask_check"]["passed"] and not summary["reused"]
    assert sum(summary["masked_by_reason"].values()) >= len(masked)
    assert summary["throughput"]["rollouts_per_s"] > 0
    assert summary["executor"] == {"name": "ray", "reason": "executor: ray was asked for"}
    assert "ray (executor: ray was asked for)" in out
    assert "masked" in out and f"{len(unmasked):,} snapshots dropped" in out
    assert re.search(r"rebuild: \d+/\d+ rollouts in", err)  # the final progress line
    assert fingerprint_of(output) == Inputs((captures,), None, "prefix_merging", "m").fingerprint()
    assert summary["output_bytes"] == sum(p.stat().st_size for p in shard_paths(output))


def test_a_rerun_with_the_same_inputs_reuses_the_output_and_finishes_retirement(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    before_retired, before_jsonl = retired(captures), with_jsonl(captures)
    output = tmp_path / "out" / "rows"
    # A first run that wrote its output but never retired (as if killed right after the rename).
    code, _, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, retire=False), capsys)
    assert code == 0, err
    assert retired(captures) == before_retired
    first = files_of(output)

    code, out, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, retire=True), capsys)
    assert code == 0, err
    assert "reusing it" in err and "reused" in out
    assert files_of(output) == first
    assert_handoff_kept_its_promise(captures, output, before_retired, before_jsonl)
    summary = json.loads(summary_path(output).read_text())
    assert summary["reused"] and summary["throughput"] is None and summary["executor"] is None

    # Once more: every drop repeats harmlessly and nothing changes.
    code, _, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, retire=True), capsys)
    assert code == 0, err
    assert json.loads(summary_path(output).read_text())["retired"]["dropped"] == len(split_rows(output)[0])
    assert_handoff_kept_its_promise(captures, output, before_retired, before_jsonl)


def test_an_output_of_other_inputs_is_refused_unless_overwrite(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    output = tmp_path / "out" / "rows"
    assert run(rebuild_job.main, rebuild_config(tmp_path, captures), capsys)[0] == 0
    before = files_of(output)

    code, _, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, model="other"), capsys)
    assert code == 2 and err.count("\n") == 1
    assert "already exists and was written from different inputs" in err and "overwrite: true" in err
    assert files_of(output) == before

    code, out, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, model="other", overwrite=True), capsys)
    assert code == 0, err
    assert fingerprint_of(output) == Inputs((captures,), None, "prefix_merging", "other").fingerprint()
    assert set(pq.read_table(output, columns=["model"]).column("model").to_pylist()) == {"other"}
    # The replaced output is moved aside, intact, and the summary says where.
    moved = Path(json.loads(summary_path(output).read_text())["superseded"])
    assert moved.parent == output.parent and moved.name.startswith("rows.superseded-")
    assert {name: data for name, (_, data) in files_of(moved).items()} == {name: data for name, (_, data) in before.items()}
    assert f"moved to {moved}" in out


def test_too_many_masked_rollouts_exit_3_with_reasons_and_retire_nothing(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    before_retired = retired(captures)
    keys = dict(retire=True, max_mask_fraction=0.05, mask_fraction_min_samples=10)
    code, out, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, **keys), capsys)
    assert code == 3
    reason = err.strip().splitlines()[-1]
    assert re.search(r"mask check failed: \d+ of \d+ rollouts masked .* > max_mask_fraction 5.0%; reasons: ", reason)
    assert "ValidationError" in reason and "JSONDecodeError" in reason
    assert retired(captures) == before_retired
    output = tmp_path / "out" / "rows"
    # A rejected batch never sits at the output path; its rows are kept beside it.
    assert not output.exists() and str(rejected_path(output)) in reason
    summary = json.loads(summary_path(rejected_path(output)).read_text())
    assert summary["mask_check"]["passed"] is False and summary["retired"] is None
    assert "mask check failed" in summary["retire_skipped"]
    assert is_committed(rejected_path(output)) and not (rejected_path(output) / RETIRE_MARKER_NAME).exists()

    # Below the minimum sample count the same share passes and retirement happens.
    code, _, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, **{**keys, "mask_fraction_min_samples": 1000}), capsys)
    assert code == 0, err
    assert retired(captures) == before_retired | split_rows(output)[0]


def test_explicit_rollout_ids_are_built_in_the_given_order(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    ids = sorted(with_jsonl(captures))[:5][::-1] + ["not-captured"]
    code, _, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, rollout_ids=ids), capsys)
    assert code == 0, err
    table = pq.read_table(tmp_path / "out" / "rows", columns=["rollout_id", "error"])
    assert table.column("rollout_id").to_pylist() == ids
    assert table.column("error").to_pylist()[-1] == "capture contains no token records"


# --- clear and sweep ---------------------------------------------------------------------------


def test_clear_deletes_the_captures_of_the_records_about_to_be_dispatched(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    victims = sorted(with_jsonl(captures))[:2]
    records = tmp_path / "records.jsonl"
    lines = [
        {"_ng_rollout_id": victims[0], "responses_create_params": {"input": "hi"}},
        {"_ng_rollout_id": victims[1], "_ng_attempt_index": 0},
        {"_ng_task_index": 7, "_ng_rollout_index": 3},  # "7-3": nothing captured, a no-op
        {"task": "a record without rollout indices"},
    ]
    records.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    config = write_config(tmp_path / "clear.yaml", capture_dirs=[captures], records="records.jsonl")
    before = set(os.listdir(captures))

    code, out, err = run(clear_job.main, config, capsys)
    assert code == 0, err
    assert "cleared 3 rollout ids in 1 capture directories (1 records carry no rollout id)" in out
    removed = before - set(os.listdir(captures))
    assert {name.split(".tokens.")[0] for name in removed} == set(victims)
    assert all(not name.endswith(".lock") for name in removed)  # the lock outlives a clear


def test_clear_refuses_a_bad_record_before_deleting_anything(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    victim = sorted(with_jsonl(captures))[0]
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"_ng_rollout_id": victim}) + "\n" + json.dumps({"_ng_rollout_id": "bad id!"}) + "\n")
    config = write_config(tmp_path / "clear.yaml", capture_dirs=[captures], records=str(records))
    before = set(os.listdir(captures))
    code, _, err = run(clear_job.main, config, capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"records file {records} line 2: _ng_rollout_id must be a string of letters, digits" in err
    assert "'bad id!'" in err
    assert set(os.listdir(captures)) == before

    records.write_text("{not json\n")
    code, _, err = run(clear_job.main, config, capsys)
    assert code == 2 and "line 1" in err


def test_clear_refuses_an_id_the_store_would_refuse_before_any_work(tmp_path):
    # "x\n" passes the run-record rule (a pattern applied with `.match`) but names no
    # capture file: the job refuses it with the records' other errors, not mid-clear.
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"_ng_rollout_id": "ok"}) + "\n" + json.dumps({"_ng_rollout_id": "x\n"}) + "\n")
    with pytest.raises(ValueError, match=f"records file {re.escape(str(records))} line 2: Invalid rollout id"):
        clear_job.rollout_ids_of_records(records)
    records.write_text(json.dumps({"_ng_rollout_id": "ok"}) + "\n" + json.dumps({"_ng_task_index": 1}) + "\n")
    assert clear_job.rollout_ids_of_records(records) == (["ok"], 1)


def test_sweep_removes_only_tombstones_older_than_the_retention(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    tombstones = retired(captures)
    assert tombstones, "the fault corpus has retired rollouts"
    recent = write_config(tmp_path / "keep.yaml", capture_dirs=[captures], older_than_seconds=3600)
    code, out, err = run(sweep_job.main, recent, capsys)
    assert code == 0, err
    assert "0 tombstones older than 3600 s removed" in out and retired(captures) == tombstones

    now = write_config(tmp_path / "sweep.yaml", capture_dirs=[captures], older_than_seconds=0)
    code, out, err = run(sweep_job.main, now, capsys)
    assert code == 0, err
    assert f"{len(tombstones)} tombstones older than 0 s removed" in out
    assert retired(captures) == set()
    assert not any(Path(captures, f"{rid}.tokens.lock").exists() for rid in tombstones)


def test_sweep_and_clear_refuse_bad_configs(tmp_path, capsys):
    (tmp_path / "captures").mkdir()
    config = write_config(tmp_path / "sweep.yaml", capture_dirs=["captures"])
    code, _, err = run(sweep_job.main, config, capsys)
    assert code == 2 and "missing required key 'older_than_seconds'" in err
    config = write_config(tmp_path / "clear.yaml", capture_dirs=["captures"], records="none.jsonl")
    code, _, err = run(clear_job.main, config, capsys)
    assert code == 2 and "records file" in err and "does not exist" in err


def test_chain_delivery_job_writes_one_row_per_chain_and_retires_whole_rollouts_only(
    ray_shared, corpus_copy, tmp_path, capsys
):
    captures = corpus_copy("captures")
    already = retired(captures)
    config = rebuild_config(tmp_path, captures, retire=True, delivery="chains")
    code, out, err = run(rebuild_job.main, config, capsys)
    assert code == 0, err
    output = tmp_path / "out" / "rows"
    table = pq.read_table(output)
    assert table.schema.names == CHAIN_SCHEMA.names
    rows = table.select(["rollout_id", "mask_sample", "chain_id"]).to_pylist()
    summary = json.loads(summary_path(output).read_text())
    assert summary["delivery"] == "chains" and summary["rows"] == len(rows) > summary["rollouts"]
    assert "vs rollout delivery" in out
    # A rollout is retired only when every one of its chain rows is unmasked.
    states = _states(captures)
    by_rollout: dict[str, list[bool]] = {}
    for row in rows:
        by_rollout.setdefault(row["rollout_id"], []).append(row["mask_sample"])
    for rid, masks in by_rollout.items():
        if rid not in already:
            assert states[rid]["retired"] is (not any(masks)), rid
    assert fingerprint_of(output) == Inputs((captures,), None, "prefix_merging", "m", "chains").fingerprint()


def test_a_later_run_over_the_same_directory_skips_retired_rollouts(ray_shared, corpus_copy, tmp_path, capsys):
    """Rebuilding a directory after an earlier run retired part of it builds only what is left."""
    captures = corpus_copy("captures")
    first = rebuild_config(tmp_path, captures, retire=True)
    code, _, err = run(rebuild_job.main, first, capsys)
    assert code == 0, err
    consumed = retired(captures)
    second = write_config(tmp_path / "second.yaml", capture_dirs=[captures], output="out/second", model="m")
    code, _, err = run(rebuild_job.main, second, capsys)
    assert code == 0, err
    ids = set(pq.read_table(tmp_path / "out" / "second", columns=["rollout_id"]).column(0).to_pylist())
    assert ids and not ids & consumed


def test_reusing_a_listing_output_refuses_when_new_rollouts_arrived(ray_shared, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    before_retired = retired(captures)
    output = tmp_path / "out" / "rows"
    config = rebuild_config(tmp_path, captures, retire=True)
    code, _, err = run(rebuild_job.main, config, capsys)
    assert code == 0, err
    first = files_of(output)
    first_unmasked = split_rows(output)[0]
    store = TokenCaptureStore(captures)
    store.append(TokenEntry(rollout_id="late-1", model_call_id="c1", prompt_token_ids=[1, 2],
                            generation_token_ids=[3], generation_log_probs=[-0.5]))
    code, _, err = run(rebuild_job.main, config, capsys)
    assert code == 2 and "1 more rollouts arrived (e.g. late-1)" in err
    assert files_of(output) == first

    code, out, err = run(rebuild_job.main, rebuild_config(tmp_path, captures, retire=True, overwrite=True), capsys)
    assert code == 0, err
    ids = pq.read_table(output, columns=["rollout_id"]).column(0).to_pylist()
    assert "late-1" in ids and not set(ids) & first_unmasked  # what the first run retired is not rebuilt
    # The first output's rows were retired from: it is the only copy of them, kept under a
    # name that says so, and the summary reports where.
    moved = Path(json.loads(summary_path(output).read_text())["superseded"])
    assert moved.name.startswith("rows.retired-superseded-") and f"moved to {moved}" in out
    assert {n: d for n, (_, d) in files_of(moved).items()} == {n: d for n, (_, d) in first.items()}
    assert retired(captures) == before_retired | first_unmasked | split_rows(output)[0]
