"""Worker processes forked from the driver (raycap.finalize.worker): only when that is safe,
holding nothing the driver opened, and never running the driver's code."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import raycap.finalize.rollouts
import raycap.finalize.worker
from raycap.capture.directory import capture_dirs
from raycap.finalize.pool import here_context
from raycap.finalize.worker import WorkerProcess, can_fork
from raycap.rows.options import RebuildOptions

REPO = Path(__file__).resolve().parents[1]


def test_no_fork_while_another_thread_runs():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork()
    finally:
        stop.set()
        thread.join()


def _worker(tmp_path: Path, monkeypatch) -> WorkerProcess:
    captures = tmp_path / "captures"
    captures.mkdir()
    staging = tmp_path / "staging"
    (staging / "data").mkdir(parents=True)
    monkeypatch.setattr(raycap.finalize.worker, "can_fork", lambda: True)
    context = here_context(capture_dirs([str(captures)]), "results.jsonl", RebuildOptions(), (), str(staging))
    return WorkerProcess(context, "results.jsonl")


def test_a_forked_worker_keeps_no_descriptor_the_driver_opened(tmp_path, monkeypatch):
    # The driver holds its output's lock while it runs; a fork that kept the descriptor
    # would hold the lock after the driver is gone, and a restarted run would find it busy.
    lock = tmp_path / ".out.lock"
    held = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    worker = _worker(tmp_path, monkeypatch)
    try:
        assert type(worker.process).__name__ == "_Forked"
        os.close(held)
        again = os.open(lock, os.O_RDWR)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the forked worker still holds the driver's lock"
                    time.sleep(0.02)
        finally:
            os.close(again)
        assert worker.process.poll() is None, "the worker is serving"
    finally:
        worker.stop()


def test_a_forked_worker_leaves_when_the_driver_closes_its_pipe(tmp_path, monkeypatch):
    # It leaves at once, with status 0: a fork that went back into the caller's code
    # (here, pytest's) would go on running it.
    worker = _worker(tmp_path, monkeypatch)
    worker.requests.close()
    assert worker.process.wait(timeout=10) == 0
    worker.stop()


@pytest.mark.slow
def test_a_fresh_driver_forks_and_a_driver_with_ray_started_does_not():
    code = (
        "import raycap.finalize.worker as w; a = w.can_fork(); import ray; "
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False); print(a, w.can_fork()); ray.shutdown()"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["True", "False"]


_DRIVER = """
import sys
import raycap
outcome = raycap.finalize_rollouts([sys.argv[1]], sys.argv[2], sys.argv[3], executor="local", batch_size=2)
print(outcome.status)
"""


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_driver_killed_mid_run_leaves_no_worker_behind_and_the_rerun_commits(collection, tmp_path):
    # The forked workers inherit the driver's output lock until they close it; a SIGKILLed
    # driver's workers must go (their pipe closes) and the rerun must find the lock free.
    captures, _, results, records = collection
    output = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO), RAYCAP_LOCAL_PROCESSES="2", RAYCAP_JOB_PAUSE_AFTER_FIRST_SHARD="60")
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, str(captures), str(results), str(output)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in driver.stderr:
            if "pausing" in line:
                break
        workers = _children(driver.pid)
        assert workers, "the driver started no worker"
        assert all(b"finalize_rollouts" in Path(f"/proc/{w}/cmdline").read_bytes() for w in workers), "not forked"
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, "a worker outlived its driver"
            time.sleep(0.05)
    finally:
        if driver.poll() is None:
            driver.kill()
    env.pop("RAYCAP_JOB_PAUSE_AFTER_FIRST_SHARD")
    rerun = subprocess.run([sys.executable, "-c", _DRIVER, str(captures), str(results), str(output)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert rerun.stdout.split()[-1] == "done"
    assert len(list(raycap.finalize.rollouts.read_records(output))) == len(records)
