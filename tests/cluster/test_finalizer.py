"""raycap.runs.rollouts on Ray (the shared cluster): the same records and rows as in this
process, an output Ray Data reads as-is, and the finalize job SIGKILLed mid-run then run
again, losing nothing (the slow tier)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

import raycap
from collection import gym_finalized, text
from conftest import driver_waits, retired_ids
from raycap.capture import delivery
from raycap.capture.store import TokenCaptureStore
from raycap.cli import finalize as finalize_job
from raycap.output.commit import staging_path
from raycap.output.manifest import is_committed
from raycap.runs.handoff import DONE
from raycap.runs.rollouts import finalize_rollouts, read_records
from test_consumer import CORRUPT, RETIRED, _corrupt, _record, _retired
from test_rollouts import _symlinked

REPO = Path(__file__).resolve().parents[2]
ROW_COLUMNS = [
    "rollout_id", "model", "mask_sample", "error", "mask_reasons", "token_ids", "loss_mask", "logprobs",
    "call_output_items", "reward", "task_index", "rollout_index", "attempt_index", "agent_name", "record_index", "verdict",
]


def test_ray_and_this_process_give_identical_records_and_rows(ray_shared, collection, tmp_path):
    import shutil

    import ray

    import raycap

    captures, oracle, results, records = collection
    twin = tmp_path / "twin"
    shutil.copytree(oracle, twin)  # the same captures, not frozen yet
    expected, allowed = gym_finalized(records, oracle)
    before = retired_ids(captures)
    here = finalize_rollouts([str(twin)], results, tmp_path / "here", executor="local", record_fields=["verdict"], batch_size=4)
    there = finalize_rollouts(
        [str(captures)], results, tmp_path / "there", executor="ray", record_fields=["verdict"], batch_size=4,
        max_in_flight=2, retire=True,
    )
    assert there.summary.executor.name == "ray" and here.summary.executor.name == "local"
    got = list(read_records(tmp_path / "there"))
    assert text(got, captures) == text(list(read_records(tmp_path / "here")), twin)
    assert [text(g, captures) for g in got] == [text(e, oracle) for e in expected]
    assert retired_ids(captures) - before == allowed
    ours, theirs = (pq.read_table(tmp_path / name, columns=ROW_COLUMNS) for name in ("here", "there"))
    assert theirs.schema.equals(ours.schema) and theirs.num_rows == ours.num_rows
    assert text(theirs.to_pylist(), captures) == text(ours.to_pylist(), twin)  # error texts name the directory
    # Ray Data reads the output as-is (the hidden .records/ folder is skipped).
    for dataset in (ray.data.read_parquet(str(tmp_path / "there")), raycap.dataset(tmp_path / "there")):
        assert dataset.count() == theirs.num_rows


class _Job:
    """The finalize job as a subprocess in its own session, SIGKILLed with what it started."""

    def __init__(self, config: Path, env: dict[str, str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobs.finalize", "--config", str(config)], cwd=REPO,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def kill_at(self, stage: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not any("pausing" in line and stage in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                pytest.fail(f"the job never reached {stage}:\n{''.join(self.lines)[-3000:]}")
            time.sleep(0.05)
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        assert self.proc.returncode == -signal.SIGKILL


def test_a_finalize_job_killed_mid_run_loses_nothing_and_a_rerun_finishes(ray_shared, collection, tmp_path, capsys):
    import ray

    captures, oracle, results, records = collection
    expected, allowed = gym_finalized(records, oracle)
    before = retired_ids(captures)
    output = tmp_path / "out" / "finalized"
    config = tmp_path / "finalize.yaml"
    config.write_text(yaml.safe_dump({
        "capture_dirs": [str(captures)], "results": str(results), "output": str(output), "retire": True,
        "batch_size": 3, "max_in_flight": 1, "executor": "ray", "records_file": str(tmp_path / "final.jsonl"),
    }))
    # The driver joins the shared cluster, as a submitted job joins its own; tasks are in
    # flight on it when the kill lands.
    env = {"RAYCAP_JOB_PAUSE_AFTER_FIRST_SHARD": "300", "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    _Job(config, env).kill_at("AFTER_FIRST_SHARD")
    assert not output.exists() and staging_path(output).is_dir()
    assert any(p.suffix == ".jsonl" for p in staging_path(output).rglob("*"))
    assert retired_ids(captures) == before  # nothing is dropped before the commit
    assert not (tmp_path / "final.jsonl").exists()

    code = finalize_job.main(["--config", str(config)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert is_committed(output) and not staging_path(output).exists()
    got = list(read_records(output))
    assert [text(g, captures) for g in got] == [text(e, oracle) for e in expected]
    assert [json.loads(line) for line in (tmp_path / "final.jsonl").read_bytes().splitlines()] == got
    assert retired_ids(captures) - before == allowed
    assert "finalized" in out and "left unchanged" in out


def test_the_batches_of_an_actor_that_dies_are_finalized_by_the_driver(ray_shared, collection, tmp_path, monkeypatch, caplog):
    # On a one-node Ray the driver finalizes beside an actor per further CPU, which writes
    # a batch while it computes the next: an actor killed at its second batch has taken
    # its first and may still be writing it, and both are finalized by the driver instead.
    import ray

    from raycap.cluster import finalizer

    captures, oracle, results, records = collection
    monkeypatch.setattr(finalizer, "can_fork", lambda: False)  # the actors' way, not the forks'
    hand = finalizer._ActorSlot.hand
    handed: list[int] = []
    second = threading.Event()

    def dies_at_second(self, batch, data):
        handed.append(batch.index)
        if len(handed) == 2:
            ray.kill(self.actor)
            second.set()
        return hand(self, batch, data)

    monkeypatch.setattr(finalizer._ActorSlot, "hand", dies_at_second)
    # The driver waits before each batch until the actor has been handed its second, so
    # that it takes one however long it takes to start.
    driver_waits(monkeypatch, finalizer, lambda: second.wait(120))
    outcome = finalize_rollouts([str(captures)], results, tmp_path / "out", executor="ray", batch_size=4)
    assert outcome.status == "done", outcome.message
    assert len(handed) >= 2, "the actor was not handed a second batch"
    assert any("finalizes its batches instead" in r.getMessage() for r in caplog.records)
    expected, _ = gym_finalized(records, oracle)
    assert [text(r, captures) for r in read_records(tmp_path / "out")] == [text(r, oracle) for r in expected]


@pytest.mark.parametrize("forks", [False, True], ids=["actors", "forks"])
def test_a_cluster_whose_cpus_are_all_held_is_finalized_by_the_driver_alone(ray_shared, collection, tmp_path, monkeypatch, forks):
    # A collection's own actors often hold every CPU of the cluster. The actor that would
    # finalize beside the driver then never starts: the driver finalizes every batch
    # itself and returns, instead of waiting for a CPU that is never freed. Nor does it
    # fork workers onto the CPUs the collection holds.
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from raycap.cluster import finalizer

    captures, oracle, results, records = collection
    monkeypatch.setattr(finalizer, "can_fork", lambda: forks)
    monkeypatch.setenv("RAYCAP_LOCAL_PROCESSES", "2")  # a worker beside the driver, were a CPU free
    started = []
    monkeypatch.setattr(finalizer, "worker_processes", lambda *args, **kwargs: started.append(args) or (lambda: []))

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> int:
            return 1

    # Every CPU free first: one an earlier test's actor still held would be freed mid-run.
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    cpus = int(ray.available_resources().get("CPU", 0))
    holders = [Holder.remote() for _ in range(cpus)]
    pool = ThreadPoolExecutor(1)
    try:
        ray.get([h.ping.remote() for h in holders], timeout=120)
        assert ray.available_resources().get("CPU", 0) == 0
        running = pool.submit(finalize_rollouts, [str(captures)], results, tmp_path / "out", executor="ray", batch_size=4)
        outcome = running.result(timeout=90)
    finally:
        for holder in holders:
            ray.kill(holder)
        pool.shutdown(wait=True)  # a call still waiting for a CPU gets one now, and ends
    assert outcome.status == "done", outcome.message
    assert outcome.summary.executor.name == "ray"
    assert started == []
    expected, _ = gym_finalized(records, oracle)
    assert [text(r, captures) for r in read_records(tmp_path / "out")] == [text(r, oracle) for r in expected]


def test_a_one_node_ray_finalizes_beside_forks_of_the_driver(ray_shared, collection, tmp_path, monkeypatch):
    # Where forking is safe, the runner beside the driver is a fork of it, which starts at
    # once with everything imported: no actor waits for Ray to start a worker. It takes
    # batches while the driver finalizes its own, and the records are Gym's.
    import raycap.finalize.worker
    from raycap.cluster import finalizer

    captures, oracle, results, records = collection
    for module in (finalizer, raycap.finalize.worker):
        monkeypatch.setattr(module, "can_fork", lambda: True)
    monkeypatch.setenv("RAYCAP_LOCAL_PROCESSES", "2")
    monkeypatch.setattr(finalizer, "_free_cpus", lambda: 1)  # an earlier test's actor may still hold one
    actors = []
    monkeypatch.setattr(finalizer, "_ActorSlot", lambda *args: actors.append(args))
    forked: list[int] = []
    hand = raycap.finalize.worker.WorkerProcess.hand

    def counted(self, batch, data):
        assert type(self.process).__name__ == "_Forked"
        forked.append(batch.index)
        return hand(self, batch, data)

    monkeypatch.setattr(raycap.finalize.worker.WorkerProcess, "hand", counted)

    def until_a_fork_took_one() -> None:
        deadline = time.monotonic() + 60
        while not forked and time.monotonic() < deadline:
            time.sleep(0.01)

    driver_waits(monkeypatch, finalizer, until_a_fork_took_one)
    outcome = finalize_rollouts([str(captures)], results, tmp_path / "out", executor="ray", batch_size=4)
    assert outcome.status == "done", outcome.message
    assert outcome.summary.executor.name == "ray"
    assert actors == [] and forked, (actors, forked)
    expected, _ = gym_finalized(records, oracle)
    assert [text(r, captures) for r in read_records(tmp_path / "out")] == [text(r, oracle) for r in expected]


# --- NeMo Gym's error texts on Ray, in records and through the node actor's source -------------------


@pytest.fixture
def store(tmp_path):
    return TokenCaptureStore(tmp_path / "captures")


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
