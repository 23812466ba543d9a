"""Finalizing fast without giving anything up: no pandas, both cores, the same bytes.

The local executor finalizes large inputs in worker processes as well as in the
calling process (`raycap.finalize.pool`): every batch's records part and shard are
written as a task writes them, so the records are byte for byte those of one process,
the rows the same, each part's digest that of its bytes on disk, and a batch that
fails in a worker fails the run with the error it has in one process. No process that
finalizes imports pandas (pyarrow's conversions would, half a second each)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import raycap.finalize.pool
import raycap.finalize.worker
import raycap.runs.rollouts
from collection import gym_finalized, text
from conftest import driver_waits
from raycap.capture.directory import capture_dirs
from raycap.finalize.pool import here_context, local_finalizer
from raycap.finalize.results import ResultsError, scan_results
from raycap.finalize.worker import WorkerProcess
from raycap.output.manifest import read_manifest
from raycap.rows.options import RebuildOptions
from raycap.runs.handoff import DONE
from raycap.runs.rollouts import finalize_rollouts, read_records

# Every test starts worker processes (fresh interpreters): the slow tier.
pytestmark = pytest.mark.slow

SMALL_BATCH = 96 << 10
REPO = Path(__file__).resolve().parents[2]
# Columns that differ between two freezes of the same captures (a freeze names a new snapshot).
_PER_FREEZE = ("snapshot_id", "snapshots")


def _finalize(captures: Path, results: Path, output: Path, monkeypatch, processes: int, spy: list | None = None, **kwargs):
    monkeypatch.setattr(raycap.runs.rollouts, "BATCH_BYTES", SMALL_BATCH)
    monkeypatch.setenv(raycap.finalize.worker.PROCESSES_ENV, str(processes))
    if spy is not None:
        hand = WorkerProcess.hand

        def counted(self, batch, data):
            spy.append(batch.index)
            return hand(self, batch, data)

        monkeypatch.setattr(WorkerProcess, "hand", counted)
        # A worker takes batches only once it has started, and this process would finalize
        # these few small batches before a fresh interpreter has: it waits for a worker.
        started = threading.Event()
        ready = WorkerProcess.ready

        def signalled(self):
            ready(self)
            started.set()

        monkeypatch.setattr(WorkerProcess, "ready", signalled)
        driver_waits(monkeypatch, raycap.runs.dispatch, lambda: started.wait(120))
    return finalize_rollouts([str(captures)], results, output, executor="local", **kwargs)


def _files(output: Path) -> dict[str, bytes]:
    return {p.relative_to(output).as_posix(): p.read_bytes() for p in sorted((output / ".records").iterdir())}


def _rows(output: Path):
    table = pq.read_table(output / "data")
    return table.drop_columns([c for c in _PER_FREEZE if c in table.column_names])


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh-interpreter"])
def test_worker_processes_write_the_records_and_rows_one_process_writes(collection, tmp_path, monkeypatch, forked):
    captures, oracle, results, records = collection
    pristine = tmp_path / "pristine"
    shutil.copytree(captures, pristine)

    alone = _finalize(captures, results, tmp_path / "alone", monkeypatch, processes=1)
    shutil.rmtree(captures)
    shutil.copytree(pristine, captures)
    used: list[int] = []
    monkeypatch.setattr(raycap.finalize.worker, "can_fork", lambda: forked)
    started = []
    start = WorkerProcess.__init__

    def spied(self, *args):
        start(self, *args)
        started.append(type(self.process).__name__)

    monkeypatch.setattr(WorkerProcess, "__init__", spied)
    pooled = _finalize(captures, results, tmp_path / "pooled", monkeypatch, processes=3, spy=used)

    assert started == ["_Forked" if forked else "Popen"] * 2
    assert alone.status == pooled.status == DONE, pooled.message
    scan = scan_results(results, batch_bytes=SMALL_BATCH, cost=raycap.runs.rollouts.capture_cost(capture_dirs([str(captures)])))
    assert len(scan.batches) >= 3 and used, "the worker processes finalized no batch"
    # Byte for byte the same records parts, and the same rows.
    assert _files(tmp_path / "pooled") == _files(tmp_path / "alone")
    assert _rows(tmp_path / "pooled").equals(_rows(tmp_path / "alone"))
    # Each record is what NeMo Gym's finalizer makes of it, in input order.
    expected, _ = gym_finalized(records, oracle)
    got = list(read_records(tmp_path / "pooled"))
    assert [text(r, captures) for r in got] == [text(r, oracle) for r in expected]
    assert pooled.summary.records.to_json() == alone.summary.records.to_json()


def test_each_part_a_worker_wrote_is_listed_with_the_size_and_sha256_of_its_bytes(collection, tmp_path, monkeypatch):
    captures, _, results, _ = collection
    used: list[int] = []
    output = tmp_path / "out"
    assert _finalize(captures, results, output, monkeypatch, processes=2, spy=used).status == DONE
    assert used
    manifest = read_manifest(output)
    listed = [(p.name, p.file_bytes, p.sha256) for p in manifest.records.parts]
    listed += [(s.name, s.file_bytes, s.sha256) for s in manifest.shards]
    for name, size, digest in listed:
        data = (output / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, digest), name


def _batches(results: Path, captures: Path):
    scan = scan_results(results, batch_bytes=SMALL_BATCH, cost=raycap.runs.rollouts.capture_cost(capture_dirs([str(captures)])))
    data = results.read_bytes()
    return scan, [(batch, data[batch.start : batch.end]) for batch in scan.batches]


def test_a_batch_that_fails_in_a_worker_raises_the_error_it_raises_in_this_process(collection, tmp_path):
    captures, _, results, _ = collection
    lines = results.read_bytes().splitlines(keepends=True)
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"".join(lines[:-1]) + b'{"not json\n')
    scan, batches = _batches(broken, captures)
    staging = tmp_path / "staging"
    (staging / "data").mkdir(parents=True)
    (staging / ".records").mkdir()
    context = here_context(capture_dirs([str(captures)]), scan.label, RebuildOptions(), (), str(staging))
    batch, data = batches[-1]

    with pytest.raises(ResultsError) as here:
        local_finalizer(context)(batch, data)
    worker = WorkerProcess(context, scan.label)
    try:
        with pytest.raises(ResultsError) as there:
            worker.run(batch, data)
        assert str(there.value) == str(here.value)
        assert len(str(there.value).splitlines()) == 1 and f"line {len(lines)}" in str(there.value)
        # The worker serves the next batch after a failed one.
        assert worker.run(*batches[0]).part.records == batches[0][0].records
    finally:
        worker.stop()


def test_a_worker_that_dies_fails_the_run_in_one_line_naming_its_records(collection, tmp_path):
    captures, _, results, _ = collection
    scan, batches = _batches(results, captures)
    staging = tmp_path / "staging"
    (staging / "data").mkdir(parents=True)
    (staging / ".records").mkdir()
    context = here_context(capture_dirs([str(captures)]), scan.label, RebuildOptions(), (), str(staging))
    worker = WorkerProcess(context, scan.label)
    try:
        worker.process.kill()
        worker.process.wait()
        batch, data = batches[1]
        with pytest.raises(RuntimeError) as lost:
            worker.run(batch, data)
    finally:
        worker.stop()
    message = str(lost.value)
    assert len(message.splitlines()) == 1
    assert f"records {batch.first_index}..{batch.first_index + batch.records - 1} of {scan.label}" in message
    assert "nothing was committed" in message


_NO_PANDAS = """
import sys
import raycap
retire = sys.argv[4] == "retire"
outcome = raycap.finalize_rollouts([sys.argv[1]], sys.argv[2], sys.argv[3], executor="local", retire=retire)
assert outcome.status == "done", outcome.message
assert not retire or outcome.summary.retired.dropped > 0, outcome.summary.retired
print("pandas" in sys.modules, "pyarrow.compute" in sys.modules, "pyarrow.dataset" in sys.modules, "asyncio" in sys.modules,
      "numpy.ma" in sys.modules, "numpy.random" in sys.modules)
"""


@pytest.mark.parametrize("retire", ["keep", "retire"])
def test_finalizing_in_a_fresh_process_imports_no_pandas_pyarrow_compute_or_asyncio(collection, tmp_path, retire):
    # Retiring reads the committed shards back: as one file each, never through the
    # dataset layer, whose import alone loads pandas (half a second). Nothing in a
    # finalize awaits, so asyncio (20 ms to import) is left to async callers. The
    # manifest's percentiles do not go through np.percentile, which imports numpy.ma
    # (20 ms), and the builder's hash weights do not come from numpy.random (23 ms).
    captures, _, results, _ = collection
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(raycap.finalize.worker.PROCESSES_ENV, None)
    run = subprocess.run(
        [sys.executable, "-c", _NO_PANDAS, str(captures), str(results), str(tmp_path / "out"), retire],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"] * 6


def test_a_bad_line_fails_the_pooled_run_as_it_fails_one_process(collection, tmp_path, monkeypatch):
    captures, _, results, _ = collection
    lines = results.read_bytes().splitlines(keepends=True)
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"".join(lines[:-1]) + b'{"not json\n')
    errors = []
    for processes in (1, 3):
        output = tmp_path / f"out-{processes}"
        with pytest.raises(ResultsError) as failed:
            _finalize(captures, broken, output, monkeypatch, processes=processes)
        errors.append(str(failed.value))
        assert not output.exists(), "nothing is committed"
    assert errors[0] == errors[1] and len(errors[1].splitlines()) == 1


def _slow_here(monkeypatch, seconds: float = 1.0) -> None:
    """This process takes `seconds` more over each batch it finalizes (worker processes do not)."""
    finalizer = raycap.runs.dispatch.local_finalizer

    def slow(context, *rest):
        here = finalizer(context, *rest)
        hand = here.hand

        def late(batch, data):
            time.sleep(seconds)
            return hand(batch, data)

        here.hand = late
        return here

    monkeypatch.setattr(raycap.runs.dispatch, "local_finalizer", slow)


@pytest.mark.parametrize("dies_at", [1, 2])
def test_the_batches_of_a_worker_that_dies_are_finalized_by_this_process(collection, tmp_path, monkeypatch, caplog, dies_at):
    # At its second batch, the worker has taken its first and may still be writing it:
    # that batch is not finalized until the worker says it is written, so it is redone here.
    captures, oracle, results, records = collection
    hand = WorkerProcess.hand
    handed: list[int] = []

    def dies_once(self, batch, data):
        handed.append(batch.index)
        if len(handed) == dies_at:
            self.process.kill()
            self.process.wait()
        return hand(self, batch, data)

    monkeypatch.setattr(WorkerProcess, "hand", dies_once)
    _slow_here(monkeypatch)  # so that the worker takes a second batch
    outcome = _finalize(captures, results, tmp_path / "out", monkeypatch, processes=2)
    assert outcome.status == DONE, outcome.message
    assert len(handed) >= dies_at, "the worker was not handed enough batches"
    assert any("finalizes its batches instead" in r.getMessage() for r in caplog.records)
    expected, _ = gym_finalized(records, oracle)
    assert [text(r, captures) for r in read_records(tmp_path / "out")] == [text(r, oracle) for r in expected]


@pytest.mark.parametrize("processes, slow_here", [(1, False), (3, False), (3, True)])
def test_a_results_file_that_changed_fails_the_pooled_run_and_commits_nothing(
    collection, tmp_path, monkeypatch, processes, slow_here
):
    captures, _, results, _ = collection
    scan = raycap.runs.rollouts.scan_results
    if slow_here:
        # This process is slow, so a worker's thread reads past the last batch and finds the change.
        _slow_here(monkeypatch)

    def stale(*args, **kwargs):
        found = scan(*args, **kwargs)
        found.sha256 = "0" * 64  # as if the file's bytes changed after the scan
        return found

    monkeypatch.setattr(raycap.runs.rollouts, "scan_results", stale)
    output = tmp_path / "out"
    for _ in range(3):  # whichever process reads past the last batch finds it
        with pytest.raises(ResultsError, match="changed while it was finalized"):
            _finalize(captures, results, output, monkeypatch, processes=processes)
        assert not output.exists()


def test_a_run_does_not_wait_for_a_worker_that_is_still_starting(collection, tmp_path, monkeypatch):
    # A worker takes a batch only once it has started: one that is slow to start (here a
    # fresh interpreter 30 s late) holds no batch, and a run this process can finish
    # alone ends without it.
    captures, oracle, results, records = collection
    monkeypatch.setattr(raycap.finalize.worker, "can_fork", lambda: False)
    monkeypatch.setattr(raycap.finalize.worker, "_WORKER", "import time; time.sleep(30); " + raycap.finalize.worker._WORKER)
    began = time.monotonic()
    outcome = _finalize(captures, results, tmp_path / "out", monkeypatch, processes=2)
    took = time.monotonic() - began
    assert outcome.status == DONE, outcome.message
    assert took < 20, f"the run waited {took:.1f} s for a worker that had not started"
    expected, _ = gym_finalized(records, oracle)
    assert [text(r, captures) for r in read_records(tmp_path / "out")] == [text(r, oracle) for r in expected]


_NO_RAY = """
import sys
import raycap
outcome = raycap.finalize_rollouts([sys.argv[1]], sys.argv[2], sys.argv[3], executor="local", retire=True)
assert outcome.status == "done", outcome.message
print(outcome.summary.retired.dropped > 0, "ray" in sys.modules)
"""


def test_a_local_run_that_retires_never_loads_ray(collection, tmp_path):
    # Retiring from this process loads no Ray (most of a second of a fresh process).
    captures, _, results, _ = collection
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, "-c", _NO_RAY, str(captures), str(results), str(tmp_path / "out")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "False"]


_NO_RAY_REBUILD = """
import sys
import raycap
outcome = raycap.rebuild_to_output([sys.argv[1]], sys.argv[2], executor="local", retire=True)
assert outcome.ok, outcome.message
print(outcome.summary.retired.dropped > 0, "ray" in sys.modules)
"""


def test_a_local_rebuild_to_an_output_that_retires_never_loads_ray(collection, tmp_path):
    captures, _, _, _ = collection
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, "-c", _NO_RAY_REBUILD, str(captures), str(tmp_path / "rows")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "False"]


def _kill_later(pids: list[int], after_s: float) -> threading.Timer:
    """The guard of a test whose worker is stopped: were the stall never noticed, the
    worker is killed after `after_s` (the run then fails the test instead of hanging)."""

    def kill() -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    timer = threading.Timer(after_s, kill)
    timer.daemon = True
    timer.start()
    return timer


def test_a_stopped_worker_is_killed_after_the_stall_bound_and_its_batch_handed_back(collection, tmp_path):
    captures, _, results, _ = collection
    scan, batches = _batches(results, captures)
    staging = tmp_path / "staging"
    (staging / "data").mkdir(parents=True)
    (staging / ".records").mkdir()
    options = RebuildOptions(worker_stall_s=1.0)
    context = here_context(capture_dirs([str(captures)]), scan.label, options, (), str(staging))
    worker = WorkerProcess(context, scan.label)
    guard = _kill_later([worker.process.pid], 60)
    try:
        worker.ready()
        os.kill(worker.process.pid, signal.SIGSTOP)
        batch, data = batches[1]
        begun = time.monotonic()
        with pytest.raises(raycap.finalize.pool._RunnerLost) as lost:
            worker.run(batch, data)
        waited = time.monotonic() - begun
    finally:
        guard.cancel()
        worker.stop()
    message = str(lost.value)
    assert "made no progress for 1 s" in message and len(message.splitlines()) == 1, message
    assert f"records {batch.first_index}..{batch.first_index + batch.records - 1} of {scan.label}" in message
    assert [b.index for b, _ in lost.value.batches] == [batch.index]  # handed back whole
    assert waited < 30, waited
    assert worker.process.returncode == -signal.SIGKILL  # killed, so it writes nothing more


def test_a_run_whose_worker_stops_is_finished_by_the_driver_with_one_warning(collection, tmp_path, monkeypatch, caplog):
    captures, oracle, results, records = collection
    monkeypatch.setattr(raycap.finalize.worker, "can_fork", lambda: True)
    stopped: list[int] = []
    ready = WorkerProcess.ready

    def stops(self):  # the worker starts, then is stopped (SIGSTOP) before its first batch
        ready(self)
        os.kill(self.process.pid, signal.SIGSTOP)
        stopped.append(self.process.pid)

    monkeypatch.setattr(WorkerProcess, "ready", stops)
    used: list[int] = []
    outcome: list = []
    run = threading.Thread(
        target=lambda: outcome.append(
            _finalize(captures, results, tmp_path / "out", monkeypatch, processes=2, spy=used, worker_stall_s=1.5)
        ),
        daemon=True,
    )
    with caplog.at_level(logging.WARNING, logger="raycap.finalize"):
        run.start()
        run.join(120)
        if run.is_alive():
            for pid in stopped:
                os.kill(pid, signal.SIGKILL)
            run.join(60)
            pytest.fail("a finalize whose worker was stopped was still running after 120 s")
    assert stopped and used, "the worker was never handed a batch"
    assert outcome and outcome[0].status == DONE, outcome
    expected, _ = gym_finalized(records, oracle)
    assert [text(r, captures) for r in read_records(tmp_path / "out")] == [text(r, oracle) for r in expected]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("raycap.finalize")]
    assert len(warned) == 1 and "made no progress for 1.5 s" in warned[0], warned
    assert "this process finalizes its batches instead" in warned[0] and "\n" not in warned[0]
