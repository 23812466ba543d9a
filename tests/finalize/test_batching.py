"""How finalize_rollouts cuts a results file into tasks, and what a task writes.

A batch is cut by what it costs: its records' bytes and their captures' bytes (a stat
of each rollout's files), so that a small results file over large captures still
spreads over several tasks, each writing its own records part, and the records read
back are still each what NeMo Gym's finalizer makes of it, in input order. The driver
keeps byte ranges, never the records. The records' token arrays are written from the
arrays (`raycap.rows.tokentext`), byte for byte as orjson writes their lists."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

import raycap.finalize.results
import raycap.runs.rollouts
from collection import gym_finalized, text
from raycap.capture.builder import ProjectedCall, Projection, projection_items
from raycap.capture.directory import capture_dirs
from raycap.finalize.results import scan_results
from raycap.output.manifest import read_manifest
from raycap.rows.tokentext import projection_text_items
from raycap.runs.handoff import DONE
from raycap.runs.rollouts import capture_cost, finalize_rollouts, read_records

REPO = Path(__file__).resolve().parents[2]

# A batch's bound in these tests: a few of the collection's captures, several hundred
# of its records.
SMALL_BATCH = 96 << 10


def _parts_against_oracle(collection, output, executor):
    captures, oracle, results, records = collection
    expected, _ = gym_finalized(records, oracle)
    outcome = finalize_rollouts([str(captures)], results, output, executor=executor)
    assert outcome.status == DONE, outcome.message
    got = list(read_records(output))
    assert len(got) == len(records)
    for index, (mine, gyms) in enumerate(zip(got, expected)):
        assert text(mine, captures) == text(gyms, oracle), f"record {index}"
    return read_manifest(output).records.parts


@pytest.mark.slow
def test_a_small_results_file_over_large_captures_spreads_over_several_records_parts(collection, tmp_path, monkeypatch):
    captures, _, results, records = collection
    monkeypatch.setattr(raycap.runs.rollouts, "BATCH_BYTES", SMALL_BATCH)
    # The records alone fit one batch many times over: only their captures split them.
    assert results.stat().st_size * 4 < SMALL_BATCH
    scan = scan_results(results, batch_bytes=SMALL_BATCH, cost=capture_cost(capture_dirs([str(captures)])))
    assert len(scan.batches) >= 3

    parts = _parts_against_oracle(collection, tmp_path / "out", "local")

    # One records part per batch, in input order, every record in one of them.
    assert [(p.first_index, p.records) for p in parts] == [(b.first_index, b.records) for b in scan.batches]
    assert sum(p.records for p in parts) == len(records)


def test_on_ray_each_task_writes_its_own_records_part(ray_shared, collection, tmp_path, monkeypatch):
    monkeypatch.setattr(raycap.runs.rollouts, "BATCH_BYTES", SMALL_BATCH)
    parts = _parts_against_oracle(collection, tmp_path / "out", "ray")
    assert len(parts) >= 3
    assert [p.first_index for p in parts] == sorted(p.first_index for p in parts)


def test_batches_are_cut_alike_whatever_the_window_of_captures_looked_up_at_once(collection, monkeypatch):
    captures, _, results, _ = collection
    cost = capture_cost(capture_dirs([str(captures)]))
    whole = scan_results(results, batch_bytes=SMALL_BATCH, cost=cost).batches
    monkeypatch.setattr(raycap.finalize.results, "COST_WINDOW", 3)
    windowed = scan_results(results, batch_bytes=SMALL_BATCH, cost=cost).batches
    assert windowed == whole and len(whole) >= 3
    # Each batch knows the line it starts on (what a line that is not JSON is named by).
    data = results.read_bytes()
    for batch in whole:
        assert batch.first_line == 1 + data.count(b"\n", 0, batch.start), batch


_SCAN_PEAK = """
import sys, tracemalloc
import raycap.finalize.results as results
from raycap.capture.directory import capture_dirs
from raycap.runs.rollouts import capture_cost
results.READ_CHUNK = 256 << 10
cost = capture_cost(capture_dirs([sys.argv[1]]))
tracemalloc.start()
scan = results.scan_results(sys.argv[2], cost=cost)
print(tracemalloc.get_traced_memory()[1], scan.records, len(scan.batches))
"""


@pytest.mark.slow
def test_the_scan_keeps_no_records_while_it_looks_up_their_captures(collection, tmp_path):
    captures, _, _, _ = collection
    # 20 MB of results, read in 256 KB chunks: the scan's peak must not follow the file.
    # Measured in a process of its own: tracemalloc counts every thread's allocations, and
    # a test process has others (Ray's log threads, earlier tests' pools).
    big = tmp_path / "big.jsonl"
    pad = "x" * 4000
    with open(big, "wb") as handle:
        for n in range(5000):
            handle.write(orjson.dumps({"_ng_task_index": n // 8, "_ng_rollout_index": n % 8, "pad": pad}) + b"\n")
    run = subprocess.run([sys.executable, "-c", _SCAN_PEAK, str(captures), str(big)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr[-2000:]
    peak, records, batches = map(int, run.stdout.split())
    assert records == 5000 and batches > 1
    assert peak < 4 << 20, f"the scan held {peak / 1e6:.1f} MB of a 20 MB results file"


def _projection(rng: random.Random) -> Projection:
    n = rng.randrange(0, 400)
    ids = np.array([rng.choice([0, 7, -1, 2**63 - 1, -(2**63), rng.randrange(-10**12, 10**12)]) for _ in range(n)], dtype=np.int64)
    bits = np.array([rng.getrandbits(64) for _ in range(n)], dtype=np.uint64).view(np.float64)
    specials = np.array([0.0, -0.0, 5e-324, -1e-310, 1e300, -0.25, 0.1 + 0.2, 1 / 3], dtype=np.float64)
    log_probs = np.where(np.isfinite(bits), bits, -0.5)
    if n:
        log_probs[: min(n, len(specials))] = specials[: min(n, len(specials))]
    cuts = sorted(rng.randrange(0, n + 1) for _ in range(2 * rng.randrange(0, 5)))
    calls = []
    for k, (start, end) in enumerate(zip(cuts[::2], cuts[1::2])):
        items = [{"type": "message", "text": f"t{k}"}, {"type": "function_call", "generation_token_ids": [1]}]
        carriers = rng.choice([(), (0,), (1,), (0, 1)])
        routed = rng.choice([None, [[1, 2], [3]]])
        calls.append(ProjectedCall(f"c{k}", items, routed, start, end, carriers))
    return Projection(ids, log_probs, np.zeros(n, dtype=np.int8), calls)


@pytest.mark.parametrize("seed", range(20))
def test_token_arrays_written_as_text_are_the_bytes_orjson_writes_for_their_lists(seed):
    projection = _projection(random.Random(seed))
    as_lists = orjson.dumps({"output": projection_items(projection)})
    assert orjson.dumps({"output": projection_text_items(projection)}) == as_lists
    # Prompts and generations alike, at every boundary of the chain's ids.
    n = len(projection.token_ids)
    ends = [(0, 0), (0, n), (n, n)] + [(a, b) for a in (0, 1, n // 2) for b in (a, a + 1, n) if b <= n]
    text_of = raycap.rows.tokentext._IdsText(projection.token_ids)
    for start, end in ends:
        assert text_of.slice(start, end) == orjson.dumps(projection.token_ids[start:end].tolist()), (start, end)
