"""While batches are finalized the heap grows 64 MB at a time; afterwards, glibc's default.

A finalize of long rollouts allocates and frees tens of megabytes per batch, and with
glibc's default padding the same memory was faulted in again for each batch
(`raycap.finalize.heap`). These tests hold the padding to its scope: set while a runner
of this process runs, glibc's default back once the last one stops, whether the run
succeeded or failed, so a long-lived trainer keeps no extra memory afterwards.

A batch's parsed records and builds are acyclic but hold millions of list slots, so the
cyclic collector stays paused while a batch is finalized (a full pass walked them all,
some 45 ms per run of the long profile); it resumes as it was, after a failure too.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import raycap.finalize.batch
import raycap.finalize.heap as heap
import raycap.finalize.pool
import raycap.finalize.worker
import raycap.runs.rollouts
from raycap.capture.directory import capture_dirs
from raycap.finalize.pool import here_context, local_finalizer
from raycap.finalize.results import ResultsError, scan_results
from raycap.rows.options import RebuildOptions
from raycap.runs.rollouts import finalize_rollouts

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def mallopt(monkeypatch):
    """glibc's mallopt replaced by a recorder: [(parameter, value), ...]."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(heap, "_libc", lambda parameter, value: calls.append((parameter, value)) or 1)
    return calls


def test_a_finalize_pads_the_heap_while_it_runs_and_restores_the_default_after(collection, tmp_path, monkeypatch, mallopt):
    captures, _, results, _ = collection
    monkeypatch.setenv(raycap.finalize.worker.PROCESSES_ENV, "1")
    held_while_preparing = []
    prepare = raycap.finalize.pool.prepare_batch

    def watched(*args, **kwargs):
        held_while_preparing.append(heap.padding_held())
        return prepare(*args, **kwargs)

    monkeypatch.setattr(raycap.finalize.pool, "prepare_batch", watched)
    finalize_rollouts([str(captures)], results, tmp_path / "out")
    assert held_while_preparing and all(held_while_preparing)
    assert mallopt == [(heap.M_TOP_PAD, heap.FINALIZE_TOP_PAD), (heap.M_TOP_PAD, heap.DEFAULT_TOP_PAD)]
    assert not heap.padding_held()


def test_a_failed_finalize_restores_the_default_too(collection, tmp_path, monkeypatch, mallopt):
    captures, _, results, _ = collection
    monkeypatch.setenv(raycap.finalize.worker.PROCESSES_ENV, "1")
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(results.read_bytes() + b'{"not json\n')
    with pytest.raises(ResultsError):
        finalize_rollouts([str(captures)], broken, tmp_path / "out")
    assert mallopt[0] == (heap.M_TOP_PAD, heap.FINALIZE_TOP_PAD)
    assert mallopt[-1] == (heap.M_TOP_PAD, heap.DEFAULT_TOP_PAD)
    assert not heap.padding_held()


@pytest.mark.parametrize("fails", [False, True], ids=["finalized", "failed"])
def test_a_runner_called_on_one_batch_gives_the_padding_back_when_it_returns(collection, tmp_path, mallopt, fails):
    captures, _, results, _ = collection
    dirs = capture_dirs([str(captures)])
    scan = scan_results(results, cost=raycap.runs.rollouts.capture_cost(dirs))
    batch = scan.batches[0]
    data = results.read_bytes()[batch.start : batch.end]
    if fails:
        data = data[:-1] + b'{"not json\n'
    staging = tmp_path / "staging"
    (staging / "data").mkdir(parents=True)
    (staging / ".records").mkdir()
    runner = local_finalizer(here_context(dirs, scan.label, RebuildOptions(), (), str(staging)))
    assert heap.padding_held()
    if fails:
        with pytest.raises(ResultsError):
            runner(batch, data)
    else:
        assert runner(batch, data).counts.records == batch.records
    assert not heap.padding_held()
    assert mallopt == [(heap.M_TOP_PAD, heap.FINALIZE_TOP_PAD), (heap.M_TOP_PAD, heap.DEFAULT_TOP_PAD)]


def test_the_default_comes_back_only_when_the_last_of_two_runners_stops(mallopt):
    first, second = heap.roomy_heap(), heap.roomy_heap()
    assert mallopt == [(heap.M_TOP_PAD, heap.FINALIZE_TOP_PAD)]
    first.release()
    first.release()  # twice: still one release
    assert heap.padding_held() and len(mallopt) == 1
    second.release()
    assert mallopt[-1] == (heap.M_TOP_PAD, heap.DEFAULT_TOP_PAD) and not heap.padding_held()


# Run in a fresh interpreter: a test process's heap already holds whatever earlier tests
# freed, which the loop would reuse with or without the padding.
_FAULTS = """
import ctypes, json, resource
import raycap.finalize.batch
import raycap.finalize.heap as heap
if heap._mallopt() is None:
    print(json.dumps(None))
    raise SystemExit
size = 24 << 20

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        # Many small blocks (below the mmap threshold): the heap's top grows and shrinks.
        block = [ctypes.create_string_buffer(64 << 10) for _ in range(size // (64 << 10))]
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

plain = faults()
held = heap.roomy_heap()
faults()  # the heap grows to its padded size once
padded = faults()
held.release()
print(json.dumps([plain, padded, size // 4096]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_padding_keeps_a_batchs_memory_from_being_faulted_in_again():
    """The mechanism itself, on this machine's glibc: a loop that allocates, touches and
    frees 24 MB eight times faults its pages in once with the padding, each time without."""
    run = subprocess.run(
        [sys.executable, "-c", _FAULTS], env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout)
    if measured is None:
        pytest.skip("not glibc")
    plain, padded, pages = measured
    assert plain > 4 * pages, f"{plain} faults without the padding: the loop no longer shows the cost"
    assert padded < pages, f"{padded} faults with the padding, {plain} without"


@pytest.fixture
def collections_inside_batches(monkeypatch):
    """Collections the cyclic collector starts in a batch's work (a function that
    `prepare_batch` calls is running), with thresholds so low that any allocation would
    start one: [generation, ...]."""
    seen = []
    module = raycap.finalize.batch.__file__

    def watch(phase, info):
        if phase != "start":
            return
        names = []
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename == module:
                names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "prepare_batch" in names[1:]:
            seen.append(info["generation"])

    monkeypatch.setenv(raycap.finalize.worker.PROCESSES_ENV, "1")
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(watch)
    try:
        yield seen
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*thresholds)


def test_no_collection_runs_while_a_batch_is_finalized_and_the_collector_resumes_after(collection, tmp_path, collections_inside_batches):
    captures, _, results, _ = collection
    assert gc.isenabled()
    outcome = finalize_rollouts([str(captures)], results, tmp_path / "out")
    assert outcome.summary.records.records > 0
    assert collections_inside_batches == []
    assert gc.isenabled()


def test_a_batch_that_fails_leaves_the_collector_running(collection, tmp_path, monkeypatch, collections_inside_batches):
    captures, _, results, _ = collection

    def broken(*args, **kwargs):
        raise RuntimeError("the build broke")

    monkeypatch.setattr(raycap.finalize.batch, "builds_from_table", broken)
    with pytest.raises(RuntimeError, match="the build broke"):
        finalize_rollouts([str(captures)], results, tmp_path / "out")
    assert collections_inside_batches == []
    assert gc.isenabled()
