"""The rebuild job as a process of its own (tests of the jobs in-process: tests/system/test_jobs.py).

The crash tests run the rebuild job as a subprocess in its own session, SIGKILL its whole
process tree (the driver, and the Ray it embedded if it started one) at a stage it
announces (RAYCAP_JOB_PAUSE_*, see raycap.runs.handoff), rerun the job and check the
durable-handoff promise: one row per rollout, the same rows as an undisturbed run, a
capture retired if and only if its row is unmasked and committed, every masked rollout's
capture kept. A crash test runs on Ray where the kill lands while Ray work is in flight,
on the local executor (no Ray start in the job) where it lands in code both executors
share. Only the mid-build kill starts an embedded Ray, to die with the driver; the others
on Ray join the shared cluster, as a submitted job joins its own. Subprocess runs also
show what a fresh job does on its own: a cluster that does not answer is exit 2, a small
input with executor auto never starts Ray, and expected masks stay off the console
unless --verbose.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raycap.cli import rebuild as rebuild_job
from raycap.output.commit import staging_path, summary_path
from raycap.output.manifest import MANIFEST_NAME, RETIRE_MARKER_NAME, is_committed, shard_paths
from raycap.rows.arrow import builds_from_table
from test_jobs import (
    assert_handoff_kept_its_promise,
    files_of,
    frozen,
    rebuild_config,
    retired,
    run,
    split_rows,
    with_jsonl,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_cluster_address(monkeypatch):
    # In-process reruns must use the shared embedded Ray, never a cluster named by the caller.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


# --- crashes: SIGKILL the job's process tree, rerun, lose nothing ------------------------------------


class _Driver:
    """The rebuild job as a subprocess in its own session, killed with its embedded Ray."""

    def __init__(self, config: Path, env: dict[str, str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobs.rebuild", "--config", str(config)],
            cwd=REPO,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, stage: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not any("pausing" in line and stage in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the job never reached {stage}:\n{''.join(self.lines)[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the whole process group at once: the driver and what it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)

    def kill_at(self, stage: str) -> None:
        self.wait_for(stage)
        self.kill()
        assert self.proc.returncode == -signal.SIGKILL


def _undisturbed(captures: str) -> list[dict]:
    """The rows an uninterrupted run builds now (freezing is idempotent: the snapshots the
    killed run froze come back with the same ids)."""
    import raycap

    return builds_from_table(raycap.rebuild([captures], model="m", skip_retired=True))


BUILD_STAGES = {
    # stage: what the killed run must have left (output, staging, manifest in staging)
    "AFTER_FIRST_SHARD": "mid-shard",
    "AFTER_LAST_SHARD": "between the last shard and the commit",
    "MID_COMMIT": "between the manifest and the rename",
}


# Where the kill lands on Ray: AFTER_FIRST_SHARD, while builder tasks are still in flight
# and the embedded Ray dies with the driver. The later stages pause in the driver after
# every shard is written (the commit is the same code on either executor), so they run on
# the local executor, which starts no Ray in the job.
BUILD_KILLS = [("AFTER_FIRST_SHARD", "ray"), ("AFTER_LAST_SHARD", "local"), ("MID_COMMIT", "local")]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "executor"), BUILD_KILLS, ids=[f"{s}-{e}" for s, e in BUILD_KILLS])
def test_a_job_killed_before_its_commit_loses_nothing_and_a_rerun_rebuilds_the_same_rows(
    stage, executor, request, corpus_copy, tmp_path, capsys
):
    if executor == "ray":
        request.getfixturevalue("ray_shared")  # the rerun below runs in this process
    captures = corpus_copy("captures")
    before_retired, before_jsonl, before_frozen = retired(captures), with_jsonl(captures), frozen(captures)
    config = rebuild_config(
        tmp_path, captures, retire=True, batch_size=2, max_in_flight=1, ray={"num_cpus": 1}, executor=executor
    )
    output = tmp_path / "out" / "rows"

    _Driver(config, {f"RAYCAP_JOB_PAUSE_{stage}": "300"}).kill_at(stage)
    staging = staging_path(output)
    assert not output.exists() and staging.is_dir(), BUILD_STAGES[stage]  # nothing visible before the commit
    assert any(p.suffix == ".parquet" for p in staging.rglob("*"))
    assert (staging / MANIFEST_NAME).exists() is (stage == "MID_COMMIT")
    assert frozen(captures) - before_frozen, "the killed run should have frozen some rollouts"
    assert retired(captures) == before_retired  # nothing is dropped before the commit

    undisturbed = _undisturbed(captures)
    code, _, err = run(rebuild_job.main, config, capsys)
    assert code == 0, err
    assert builds_from_table(pq.read_table(output)) == undisturbed  # the dead staging was never committed
    assert_handoff_kept_its_promise(captures, output, before_retired, before_jsonl)


@pytest.mark.slow
def test_a_job_killed_after_the_commit_is_finished_by_a_rerun(ray_shared, corpus_copy, tmp_path, capsys):
    import ray

    captures = corpus_copy("captures")
    before_retired, before_jsonl = retired(captures), with_jsonl(captures)
    config = rebuild_config(tmp_path, captures, retire=True, executor="ray")
    output = tmp_path / "out" / "rows"

    # This driver joins the shared cluster, as a submitted job joins its cluster.
    env = {"RAYCAP_JOB_PAUSE_BEFORE_RETIRE": "300", "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    _Driver(config, env).kill_at("BEFORE_RETIRE")
    assert is_committed(output) and retired(captures) == before_retired
    assert not (output / RETIRE_MARKER_NAME).exists()
    committed = files_of(output)
    assert builds_from_table(pq.read_table(output)) == _undisturbed(captures)

    code, out, err = run(rebuild_job.main, config, capsys)
    assert code == 0, err
    assert "reusing it" in err and files_of(output) == committed
    assert_handoff_kept_its_promise(captures, output, before_retired, before_jsonl)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_job_killed_mid_retirement_is_finished_by_a_rerun(executor, request, corpus_copy, tmp_path, capsys):
    """Killed at AFTER_FIRST_RETIRED_SHARD: the first shard's snapshots are dropped, the
    rest are not all dropped. In the job's own process (local) no later shard has started
    then; on Ray the shards retire in parallel, so one rollout's capture lock is held to
    keep its shard from finishing."""
    import fcntl

    captures = corpus_copy("captures")
    before_retired, before_jsonl = retired(captures), with_jsonl(captures)
    config = rebuild_config(tmp_path, captures, retire=True, executor=executor)
    output = tmp_path / "out" / "rows"

    env = {"RAYCAP_JOB_PAUSE_AFTER_FIRST_RETIRED_SHARD": "300"}
    if executor == "ray":
        import ray

        # The driver joins the shared cluster, as a submitted job joins its own; the rerun
        # below runs in this process, on the same cluster.
        request.getfixturevalue("ray_shared")
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        env["RAYCAP_JOB_PAUSE_BEFORE_RETIRE"] = "5"
    driver = _Driver(config, env)
    lock = victim = None
    try:
        if executor == "ray":
            driver.wait_for("BEFORE_RETIRE")
            victim = sorted(split_rows(output)[0])[-1]
            lock = os.open(Path(captures, f"{victim}.tokens.lock"), os.O_RDWR | os.O_CREAT)
            fcntl.flock(lock, fcntl.LOCK_EX)  # before the pause ends: its drop will wait here
        driver.kill_at("AFTER_FIRST_RETIRED_SHARD")
        partly = retired(captures) - before_retired
    finally:
        if lock is not None:
            os.close(lock)
    committed = files_of(output)
    rows = pq.read_table(output)
    unmasked = split_rows(output)[0]
    first = set(pq.read_table(shard_paths(output)[0], columns=["rollout_id"]).column(0).to_pylist())
    assert first & unmasked, "the first shard should hold unmasked rollouts"
    assert first & unmasked <= partly <= unmasked  # killed mid-retirement
    if executor == "local":
        assert partly == first & unmasked
    else:
        assert victim not in partly
    assert json.loads((output / RETIRE_MARKER_NAME).read_text())["state"] == "started"

    code, out, err = run(rebuild_job.main, config, capsys)
    assert code == 0, err
    assert "reusing it" in err and files_of(output) == committed
    assert builds_from_table(pq.read_table(output)) == builds_from_table(rows)
    assert_handoff_kept_its_promise(captures, output, before_retired, before_jsonl)
    assert json.loads((output / RETIRE_MARKER_NAME).read_text())["state"] == "finished"


# --- what a fresh job process does on its own -------------------------------------------------------


@pytest.mark.slow
def test_an_unreachable_cluster_is_exit_2_not_a_hang(tmp_path):
    # In a fresh process: this test process may already be connected to the shared Ray.
    (tmp_path / "captures").mkdir()
    config = write_config(tmp_path / "c.yaml", capture_dirs=[str(tmp_path / "captures")], output="o",
                          ray={"address": "127.0.0.1:1"})
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "jobs.rebuild", "--config", str(config)], capture_output=True,
                          text=True, timeout=60, env=env, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2 and "no Ray cluster answers at 127.0.0.1:1" in done.stderr


def _job_process(
    config: Path, *args: str, timeout: float = 240, address: str | None = None
) -> tuple[subprocess.CompletedProcess, str]:
    """The rebuild job as a fresh process with a private Ray temp directory (where an
    embedded Ray would create its session); (the finished process, that directory). With
    `address` the job joins that cluster, as a submitted job joins its own."""
    ray_tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths must fit
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    if address:
        env["RAY_ADDRESS"] = address
    done = subprocess.run(
        [sys.executable, "-m", "jobs.rebuild", "--config", str(config), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )
    return done, ray_tmp


@pytest.mark.slow
def test_a_small_job_on_executor_auto_builds_in_its_own_process_without_starting_ray(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    before_retired, before_jsonl = retired(captures), with_jsonl(captures)
    config = rebuild_config(tmp_path, captures, retire=True)  # executor: auto, the default
    done, ray_tmp = _job_process(config)
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        assert os.listdir(ray_tmp) == [], "the job started Ray"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    output = tmp_path / "out" / "rows"
    executor = json.loads(summary_path(output).read_text())["executor"]
    assert executor["name"] == "local" and executor["reason"].startswith("no Ray running or asked for")
    assert "local (no Ray running or asked for" in done.stdout  # the printed summary says so too
    # Retirement ran in the job's process too, with the same promise.
    assert_handoff_kept_its_promise(captures, output, before_retired, before_jsonl)


MASK_RUNS = {"quiet": False, "verbose": True}


@pytest.fixture(scope="module")
def masked_job_runs(ray_cluster, fault_corpus, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The fault corpus (most rollouts masked) rebuilt on Ray by two fresh job processes at
    once, one quiet and one with --verbose, each on a copy of its own: (the finished
    process, its output) by run. Both join the shared cluster, as a submitted job joins its
    own: Ray forwards to a driver only its own job's worker lines, so what reaches its
    console is what its builders logged. (tests/cluster/test_console.py runs the demo on an
    embedded Ray.)"""
    def job(run: str) -> tuple[subprocess.CompletedProcess, Path]:
        work = tmp_path_factory.mktemp(f"masks-{run}")
        captures = shutil.copytree(fault_corpus.directory, work / "captures")
        config = rebuild_config(work, str(captures), executor="ray")
        done, ray_tmp = _job_process(config, *(["--verbose"] if MASK_RUNS[run] else []), address=ray_cluster.address)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        return done, work / "out" / "rows"

    with ThreadPoolExecutor(len(MASK_RUNS)) as pool:
        return dict(zip(MASK_RUNS, pool.map(job, MASK_RUNS)))


@pytest.mark.slow
@pytest.mark.parametrize("run_name", list(MASK_RUNS))
def test_expected_masks_stay_off_the_console_unless_verbose(run_name, masked_job_runs):
    verbose = MASK_RUNS[run_name]
    done, output = masked_job_runs[run_name]
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(summary_path(output).read_text())
    assert summary["executor"]["name"] == "ray" and summary["masked_by_reason"].get("ValidationError")
    masked = split_rows(output)[1]
    console = done.stdout + done.stderr
    pydantic = [line for line in console.splitlines() if "validation error for TokenEntry" in line]
    if verbose:
        # Each masked rollout, with pydantic's full text for the ones that failed validation.
        assert "input_value=" in console and "For further information visit" in console
        assert all(f"rollout {rid} masked" in console for rid in masked)
    else:
        assert "input_value=" not in console and "For further information visit" not in console
        assert not re.search(r"rollout \S+ masked", console)
        # Only the summary's one-line examples mention a validation error.
        assert all(line.lstrip().startswith("e.g.") for line in pydantic), pydantic
        assert len(pydantic) <= 3

