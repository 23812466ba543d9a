"""Tests for raycap.runs.handoff: the policy a library caller gets, run in this process
(executor="local"); the job-level tests are in tests/system/test_jobs.py, the crash tests in
tests/system/test_job_processes.py, the multi-node ones in tests/system/test_multinode.py."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore
from raycap.output.commit import lock_path, rejected_path, staging_path, summary_path
from raycap.output.faults import OutputError
from raycap.output.manifest import RETIRE_MARKER_NAME, is_committed, read_manifest, shard_paths
from raycap.output.summary import Executor
from raycap.rows.arrow import builds_from_table
from raycap.runs.handoff import DONE, PAUSE_STAGES, REJECTED, rebuild_to_output


def _states(directory: str) -> dict[str, dict]:
    suffix = ".tokens.state.json"
    return {p.name[: -len(suffix)]: json.loads(p.read_text()) for p in Path(directory).glob("*" + suffix)}


def retired(directory: str) -> set[str]:
    return {rid for rid, state in _states(directory).items() if state.get("retired")}


def unmasked(output: Path) -> set[str]:
    rows = pq.read_table(output, columns=["rollout_id", "mask_sample"]).to_pylist()
    return {r["rollout_id"] for r in rows if r["mask_sample"] is False}


def handoff(captures: str, output: Path, **kwargs):
    return rebuild_to_output([captures], output, model="m", executor="local", batch_size=8, **kwargs)


def test_a_library_call_gets_the_whole_policy(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    before = retired(captures)
    output = tmp_path / "rows"
    stages: list[str] = []
    notes: list[str] = []
    outcome = handoff(captures, output, retire=True, pause=stages.append, log=notes.append)

    assert outcome.status == DONE and outcome.ok and outcome.rows == output and outcome.message == ""
    assert stages == list(PAUSE_STAGES)
    assert is_committed(output) and not staging_path(output).exists()
    assert len(read_manifest(output).shards) > 1
    assert retired(captures) == before | unmasked(output)
    summary = outcome.summary
    assert summary.retired.dropped == len(unmasked(output)) and summary.throughput is not None
    assert json.loads(summary_path(output).read_text())["rollouts"] == summary.rollouts
    assert json.loads((output / RETIRE_MARKER_NAME).read_text())["state"] == "finished"

    # Again: the same inputs reuse the output and finish (here: repeat) the retirement.
    again = handoff(captures, output, retire=True, pause=stages.append, log=notes.append)
    assert again.status == DONE and again.summary.reused and again.summary.throughput is None
    assert any("reusing it" in note for note in notes)
    assert retired(captures) == before | unmasked(output)


def test_an_exception_before_the_rename_leaves_nothing_and_retires_nothing(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    before = retired(captures)
    output = tmp_path / "rows"

    def crash(stage: str) -> None:
        if stage == "MID_COMMIT":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        handoff(captures, output, retire=True, pause=crash)
    assert not output.exists() and not staging_path(output).exists() and retired(captures) == before

    outcome = handoff(captures, output, retire=True)
    assert outcome.ok and retired(captures) == before | unmasked(output)


def test_a_failing_mask_gate_retires_nothing_and_moves_the_rows_aside(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    before = retired(captures)
    output = tmp_path / "rows"
    outcome = handoff(captures, output, retire=True, max_mask_fraction=0.0, mask_fraction_min_samples=1)
    assert outcome.status == REJECTED and not outcome.ok
    assert outcome.rows == rejected_path(output) and not output.exists() and is_committed(outcome.rows)
    assert "mask check failed" in outcome.message and str(rejected_path(output)) in outcome.message
    assert retired(captures) == before
    assert outcome.summary.retire_skipped and outcome.summary.retired is None


def test_a_refused_output_fails_before_the_cluster_is_started(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    output = tmp_path / "rows"
    assert handoff(captures, output).ok
    started = []
    with pytest.raises(OutputError, match="different inputs"):
        rebuild_to_output([captures], output, model="other", executor="local", start=lambda: started.append(1))
    assert started == []

    other = os.open(lock_path(output), os.O_WRONLY)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(OutputError, match="another run is writing"):
            handoff(captures, output, start=lambda: started.append(1))
    finally:
        os.close(other)
    assert started == []


def test_rollouts_that_arrived_after_a_listing_output_refuse_its_reuse(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    output = tmp_path / "rows"
    first = handoff(captures, output)
    rows = builds_from_table(pq.read_table(output))
    TokenCaptureStore(captures).append(
        TokenEntry(rollout_id="late-1", model_call_id="c1", prompt_token_ids=[1, 2], generation_token_ids=[3],
                   generation_log_probs=[-0.5])
    )
    with pytest.raises(OutputError, match=r"before 1 more rollouts arrived \(e.g. late-1\)"):
        handoff(captures, output)
    assert builds_from_table(pq.read_table(output)) == rows
    # Explicit ids are not affected by what else arrived.
    ids = sorted(b["rollout_id"] for b in rows)[:3]
    assert handoff(captures, tmp_path / "some", rollout_ids=ids).ok
    assert handoff(captures, tmp_path / "some", rollout_ids=ids).summary.reused

    replaced = handoff(captures, output, overwrite=True)
    assert replaced.ok and replaced.summary.rollouts == first.summary.rollouts + 1
    assert Path(replaced.summary.superseded).name.startswith("rows.superseded-")


def test_the_first_retired_shard_stage_comes_after_that_shard_alone_is_dropped(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    before = retired(captures)
    output = tmp_path / "rows"
    seen: list[tuple[str, set[str]]] = []

    def pause(stage: str) -> None:
        seen.append((stage, retired(captures) - before))

    assert handoff(captures, output, retire=True, pause=pause).ok
    first = shard_paths(output)[0]
    first_unmasked = {r["rollout_id"] for r in pq.read_table(first).to_pylist() if r["mask_sample"] is False}
    stages = [stage for stage, _ in seen]
    assert stages[-2:] == ["BEFORE_RETIRE", "AFTER_FIRST_RETIRED_SHARD"]
    assert not seen[-2][1]
    # Whether later shards have started too depends on where retirement runs (in parallel
    # on a running Ray); the job test that kills at this stage checks the in-process case.
    assert first_unmasked and first_unmasked <= seen[-1][1] <= unmasked(output)


def test_the_summary_names_the_executor_and_verbose_logs_each_masked_row(corpus_copy, tmp_path, caplog):
    captures = corpus_copy("captures")
    with caplog.at_level(logging.DEBUG, logger="raycap"):
        outcome = handoff(captures, tmp_path / "rows", verbose=True)
    assert outcome.summary.executor == Executor("local", "executor: local was asked for")
    assert json.loads(summary_path(tmp_path / "rows").read_text())["executor"]["name"] == "local"
    assert "executor: local was asked for" in outcome.summary.render()
    masked = {r["rollout_id"]: r for r in pq.read_table(tmp_path / "rows").to_pylist() if r["mask_sample"]}
    details = {r.getMessage().split()[1]: r.getMessage() for r in caplog.records if r.name == "raycap.runs.handoff"}
    assert set(details) == set(masked)
    for rid, row in masked.items():
        assert row["error"] is None or details[rid].endswith(row["error"])  # the full, multi-line text

    # Without verbose, expected masks log nothing at all above debug level.
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="raycap"):
        handoff(corpus_copy("again"), tmp_path / "quiet")
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG and "masked" in r.getMessage()]
    assert not [r for r in caplog.records if r.name == "raycap.runs.handoff"]


def test_one_run_reads_the_manifest_once_and_takes_the_output_lock_once(corpus_copy, tmp_path, monkeypatch):
    import raycap.output.local.reads as localread_module
    import raycap.output.local.writes as localstore_module

    captures = corpus_copy("captures")
    output = tmp_path / "rows"
    handoff(captures, output)  # a first run commits; the counted run reuses and retires
    reads: list[Path] = []
    locks: list[int] = []
    real_read, real_flock = localread_module.read_local_manifest, fcntl.flock

    def counted_read(path):
        reads.append(Path(path))
        return real_read(path)

    output_locks = {str(lock_path(output)), str(lock_path(tmp_path / "other"))}

    def counted_flock(fd, operation):
        held = os.readlink(f"/proc/self/fd/{fd}")
        if operation & fcntl.LOCK_EX and held in output_locks:  # capture files are locked too
            locks.append(held)
        return real_flock(fd, operation)

    # The one read of a local manifest, where the local backend and its readers call it.
    for module in (localstore_module, localread_module):
        monkeypatch.setattr(module, "read_local_manifest", counted_read)
    monkeypatch.setattr(fcntl, "flock", counted_flock)
    outcome = handoff(captures, output, retire=True)
    assert outcome.status == DONE and outcome.summary.reused and outcome.summary.retired.dropped > 0
    assert reads == [output] and locks == [str(lock_path(output))]

    # A run that builds takes the lock once too, though staging and commit need it held.
    reads.clear()
    locks.clear()
    fresh = handoff(captures, tmp_path / "other", retire=True)
    assert fresh.status == DONE and not fresh.summary.reused
    assert reads == [] and locks == [str(lock_path(tmp_path / "other"))]


def test_a_second_run_in_this_process_cannot_take_a_held_output_lock(tmp_path):
    from raycap.output.commit import output_lock

    output = tmp_path / "rows"
    with output_lock(output):
        with pytest.raises(OutputError, match="another run is writing .*wait for it or choose another output"):
            with output_lock(output):
                pass
    with output_lock(output) as lock:  # released: free again
        assert lock.held
    assert not lock.held


def test_only_a_listing_ray_build_on_this_machine_alone_is_known_empty_here(tmp_path, monkeypatch):
    import raycap.runs.handoff as handoff
    from raycap.capture.directory import CaptureDir
    from raycap.rows.options import RebuildOptions
    from raycap.runs.handoff import NOTHING_HERE_ENTRIES, nothing_here

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # As in a fresh process: this test process may be a driver of the suite's cluster already.
    monkeypatch.setattr(handoff, "ray_running", lambda: False)
    empty, held, crowded = (tmp_path / name for name in ("empty", "held", "crowded"))
    empty.mkdir()
    crowded.mkdir()
    for i in range(NOTHING_HERE_ENTRIES + 1):
        (crowded / f"stray-{i}.txt").write_text("")
    store = TokenCaptureStore(str(held))
    store.append(
        TokenEntry(rollout_id="r0", model_call_id="c1", prompt_token_ids=[1, 2], generation_token_ids=[3],
                   generation_log_probs=[-0.1])
    )
    ray_build = RebuildOptions(executor="ray", skip_retired=True)

    def here(directory, ids=None, options=ray_build, address=None) -> bool:
        return nothing_here((CaptureDir.parse(str(directory)),), ids, options, address)

    assert here(empty)
    assert not here(held)
    assert not here(crowded)  # not listed twice: the actors list it, as before
    assert not here(empty, ids=("r0",))  # named ids: their rows say what is missing
    assert not here(empty, options=RebuildOptions(executor="auto", skip_retired=True))
    assert not here(empty, address="10.0.0.1:6379")  # another machine's nodes may hold it
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert not here(empty)
