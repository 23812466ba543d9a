"""Worker processes forked from the driver (raycap.finalize.worker): only when that is safe,
holding nothing the driver opened, and never running the driver's code."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import raycap.finalize.worker
import raycap.runs.rollouts
from raycap.capture.directory import capture_dirs
from raycap.finalize.pool import here_context
from raycap.finalize.worker import WorkerProcess, can_fork
from raycap.output.location import Location
from raycap.output.protocol import backend_of
from raycap.rows.options import RebuildOptions

REPO = Path(__file__).resolve().parents[2]


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


def _printed(code: str, *args: str) -> list[str]:
    """The words `python -c code args...` printed, run from the repository; it must exit 0."""
    run = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


# Threads a driver may fork beside: a started Ray's own driver threads, and the freezes'
# fsync threads, kept as long as the process once a freeze started them (so a second
# finalize in a process still forks).
_BESIDE = {
    "ray": "import ray; ray.init(num_cpus=1, include_dashboard=False)",
    "fsync": "from raycap.capture import freezebatch as f; f._syncer().submit(int).result()",
}


@pytest.mark.slow
@pytest.mark.parametrize("beside", list(_BESIDE))
def test_a_driver_forks_beside_these_threads_and_not_beside_one_of_its_own(beside):
    code = (
        "import threading; import raycap.finalize.worker as w; alone = w.can_fork(); "
        f"{_BESIDE[beside]}; others = threading.active_count() > 1; beside = w.can_fork(); "
        "threading.Thread(target=threading.Event().wait, daemon=True).start(); print(alone, others, beside, w.can_fork())"
    )
    assert _printed(code)[-4:] == ["True", "True", "True", "False"]


_INHERITING_DRIVER = """
import logging, os, sys
logging.basicConfig(filename=sys.argv[1])  # the driver's log file: the lowest free descriptor
stray = open(sys.argv[2], "wb", buffering=0)  # a file of the driver's, which an object of its writes to
import raycap.finalize.worker as w

def serve(requests_read, replies_write, shelf=None):
    # In the fork: a file of its own, and, while it writes there, a warning logged and a
    # write through the driver's file object.
    fd = os.open(sys.argv[3], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    logging.getLogger("raycap").warning("a warning the fork logged")
    stray.write(b"a stray write")
    os.write(fd, b"what the fork wrote")
    os.close(fd)

w.serve = serve
requests_read, requests_write = os.pipe()
replies_read, replies_write = os.pipe()
print(w._fork(requests_read, replies_write).wait())
"""


def test_what_a_fork_writes_through_the_drivers_objects_never_lands_in_a_file_of_the_fork(tmp_path):
    # The fork lets go of the files it inherited (the output's lock), but the driver's
    # objects that wrote to them are still there. Had it closed their descriptors, the
    # fork's next file (a records part, a state file) would get one of their numbers,
    # and a warning's bytes with it (which once made a records part's sha256 wrong). A
    # logging handler's file it keeps: what the fork logs reaches the driver's log.
    log, theirs, own = tmp_path / "driver.log", tmp_path / "drivers-file", tmp_path / "fork-file"
    assert _printed(_INHERITING_DRIVER, str(log), str(theirs), str(own)) == ["0"]
    assert own.read_bytes() == b"what the fork wrote"
    assert "a warning the fork logged" in log.read_text()
    assert theirs.read_bytes() == b""  # its number in the fork is /dev/null's


_HELD_STREAM = """
import io, logging, os, select, signal, sys, threading, time
from raycap.finalize.worker import _own_streams

read_end, write_end = os.pipe()
os.dup2(write_end, 2)
os.close(write_end)
sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), line_buffering=True)  # as Python's own
logging.getLogger("raycap.test").addHandler(logging.StreamHandler(sys.stderr))


def printer():  # as Ray's log printer, caught by the fork in the middle of a long line
    sys.stderr.write("x" * (1 << 20))  # the pipe holds 64 KiB: this waits, holding the stream's lock


threading.Thread(target=printer, name="ray_print_logs", daemon=True).start()
time.sleep(0.5)
pid = os.fork()
if pid == 0:
    signal.alarm(4)  # a fork still waiting then waits for ever
    if sys.argv[1] == "own":
        _own_streams()
    print("printed by the fork", file=sys.stderr)
    logging.getLogger("raycap.test").warning("logged by the fork")
    os._exit(0)
seen = b""
while True:
    if select.select([read_end], [], [], 0.05)[0]:
        seen += os.read(read_end, 1 << 16)
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
while select.select([read_end], [], [], 0.2)[0]:
    seen += os.read(read_end, 1 << 16)
print(os.waitstatus_to_exitcode(status), b"printed by the fork" in seen, b"logged by the fork" in seen)
"""


@pytest.mark.slow
@pytest.mark.parametrize("streams", ["own", "driver's"])
def test_a_fork_prints_and_logs_though_a_thread_of_the_driver_held_its_stream(streams):
    # Ray's log printer may be writing to the driver's stderr when a worker is forked:
    # the stream's lock is then held in the fork for ever, and its first warning would
    # hang it. A fork gets streams of its own (the control shows the hang without).
    expected = ["0", "True", "True"] if streams == "own" else [str(-signal.SIGALRM), "False", "False"]
    assert _printed(_HELD_STREAM, streams) == expected


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
    assert len(list(raycap.runs.rollouts.read_records(output))) == len(records)


def test_a_worker_waited_for_by_two_threads_at_once_gives_both_its_exit_code(monkeypatch):
    # A worker's feeding thread waits for it when its pipe breaks while the driver's stop
    # waits for it too: whichever reaps it, neither may fail (ECHILD) and both read its code.
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    time.sleep(0.2)  # gone, not yet reaped
    real = os.waitpid

    def slow(waited: int, flags: int):
        # The first reaper is slow to return: the other thread comes while it is reaping.
        got = real(waited, flags)
        if waited == pid:
            time.sleep(0.5)
        return got

    monkeypatch.setattr(raycap.finalize.worker.os, "waitpid", slow)
    forked = raycap.finalize.worker._Forked(pid)
    codes, errors = [], []

    def poll_until_gone():
        try:
            codes.append(forked.wait(timeout=10))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=poll_until_gone)
    thread.start()
    time.sleep(0.1)  # that thread is reaping
    try:
        codes.append(forked.wait())
    except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
        errors.append(exc)
    thread.join()
    assert errors == [] and codes == [3, 3]


_FULL_DISK_DRIVER = """
import errno, os, sys
import raycap
import raycap.output.shards as shards

real = shards.replace_durably

def full(path, write, **options):
    # Every records part meets a full disk, in the driver and in its forked workers alike.
    def failing(handle):
        handle.write(b"x" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(path, failing if ".records" in str(path) else write, **options)

shards.replace_durably = full
try:
    raycap.finalize_rollouts([sys.argv[1]], sys.argv[2], sys.argv[3], executor="local", batch_size=2)
except Exception as exc:
    print("raised", type(exc).__name__, exc)
"""


@pytest.mark.slow
def test_a_full_disk_under_forked_workers_fails_the_run_with_the_disks_error_alone(collection, tmp_path):
    # The run fails with the write's own error, whichever process met it first; stopping
    # the other workers is no second failure (no "No child processes" in its place) and no
    # warning that this process will finalize their batches, which it will not.
    captures, _, results, records = collection
    output = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO), RAYCAP_LOCAL_PROCESSES="2")
    for attempt in range(3):
        run = subprocess.run([sys.executable, "-c", _FULL_DISK_DRIVER, str(captures), str(results), str(output)],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        raised = run.stdout.strip().splitlines()[-1]
        assert raised.startswith("raised OutputWriteError") and "No space left on device" in raised, (attempt, raised)
        assert "finalizes its batches instead" not in run.stderr and "exited with code" not in run.stderr, run.stderr
        assert not output.exists()
    rerun = subprocess.run([sys.executable, "-c", _DRIVER, str(captures), str(results), str(output)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert len(list(raycap.runs.rollouts.read_records(output))) == len(records)


_S3_DRIVER = """
import sys
import raycap
outcome = raycap.finalize_rollouts([sys.argv[1]], sys.argv[2], sys.argv[3], executor="local", batch_size=2)
print(outcome.status, len(list(raycap.read_records(sys.argv[3]))))
"""


@pytest.mark.slow
def test_a_driver_writing_to_an_object_store_does_not_fork_its_workers(collection, s3_bucket):
    # An object store's client keeps native threads and descriptors that a fork has not:
    # a forked worker's first write there crashed it, and the driver finalized alone.
    captures, _, results, records = collection
    output = f"s3://{s3_bucket}/finalized"
    assert not backend_of(Location.parse(output)).staging_written_by_forks
    env = dict(os.environ, PYTHONPATH=str(REPO), RAYCAP_LOCAL_PROCESSES="2")
    run = subprocess.run([sys.executable, "-c", _S3_DRIVER, str(captures), str(results), output], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["done", str(len(records))]
    assert "exited with code" not in run.stderr and "finalizes its batches instead" not in run.stderr, run.stderr


_IGNORING_DRIVER = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a job started in the background
import raycap
outcome = raycap.finalize_rollouts([sys.argv[1]], sys.argv[2], sys.argv[3], executor="local", batch_size=2)
print(outcome.status)
"""


@pytest.mark.slow
def test_the_forked_workers_of_a_driver_that_ignores_sigint_ignore_it_too(collection, tmp_path):
    # A Ctrl-C meant for the foreground reaches the background job's whole process group:
    # the driver ignores it, and so must its workers, or they die and the driver is left
    # to finalize their batches alone.
    captures, _, results, records = collection
    output = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO), RAYCAP_LOCAL_PROCESSES="2", RAYCAP_JOB_PAUSE_AFTER_FIRST_SHARD="2")
    driver = subprocess.Popen([sys.executable, "-c", _IGNORING_DRIVER, str(captures), str(results), str(output)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in driver.stderr:
            if "pausing" in line:
                break
        assert _children(driver.pid), "the driver started no worker"
        os.killpg(driver.pid, signal.SIGINT)
        out, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0 and out.split()[-1] == "done", err[-2000:]
    assert "exited with code" not in err and "finalizes its batches instead" not in err, err
    assert len(list(raycap.runs.rollouts.read_records(output))) == len(records)


def test_a_worker_reaped_by_the_system_reads_as_gone():
    # A caller that ignores SIGCHLD has its children reaped for it: waiting for a worker
    # then finds no child, which means the worker is gone, not that the run failed.
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forked = raycap.finalize.worker._Forked(pid)
        assert forked.wait(timeout=10) == 0
        assert forked.wait() == 0 and forked.poll() == 0
    finally:
        signal.signal(signal.SIGCHLD, previous)
