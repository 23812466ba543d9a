"""A streaming trainer loop SIGKILLed at random moments and restarted, against a live
writer and finalizer: afterwards every finished rollout is in exactly one committed step
dataset, with the rows of the sequential build, and its capture is retired if and only
if its row is unmasked."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raycap import TokenCaptureStore
from raycap.output.manifest import shard_paths
from test_stream import call, committed_steps, reference, row_builds

ROOT = Path(__file__).resolve().parents[2]

TRAINER = r"""
import os, sys, time
import raycap

capture, steps, log = sys.argv[1:4]
with raycap.Stream([capture], watch=True, executor="local") as stream:
    while True:
        rows = stream.take(4, timeout=0.2)
        if not rows.num_rows:
            continue
        ids = " ".join(rows.column("rollout_id").to_pylist())
        with open(log, "a") as f:
            f.write(f"took {ids}\n")
        stream.commit(rows, output=os.path.join(steps, f"step-{time.time_ns()}"))
        with open(log, "a") as f:
            f.write(f"committed {ids}\n")
"""

ROLLOUTS = 30
KILLS = 8


def _writer(capture: TokenCaptureStore, ref: TokenCaptureStore, finished: list[str], rng: random.Random) -> None:
    """Appends each rollout's calls through the store, then freezes it like a finalizer."""
    for i in range(ROLLOUTS):
        rid = f"roll-{i}"
        kind = "two_roots" if i % 5 == 3 else "ok"
        for index in range(rng.randint(1, 4)):
            entry = call(rid, kind, index)
            capture.append(entry)
            ref.append(entry)
            time.sleep(rng.uniform(0, 0.03))
        capture.freeze_raw(rid)
        finished.append(rid)
        time.sleep(rng.uniform(0, 0.15))


def _start(script: Path, capture: Path, steps: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(script), str(capture), str(steps), str(log)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


@pytest.mark.slow  # a subprocess (a trainer killed at random, or a README program with its own Ray)
def test_a_streaming_trainer_killed_at_random_moments_commits_every_finished_rollout_exactly_once(tmp_path):
    # A failure names its seed; RAYCAP_CRASH_SEED=<seed> replays its schedule.
    seed = int(os.environ.get("RAYCAP_CRASH_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    capture, ref = TokenCaptureStore(tmp_path / "c"), TokenCaptureStore(tmp_path / "ref")
    steps, log = tmp_path / "steps", tmp_path / "trainer.log"
    steps.mkdir()
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    finished: list[str] = []
    writer = threading.Thread(target=_writer, args=(capture, ref, finished, random.Random(seed + 1)))
    writer.start()
    kills = 0
    try:
        for _ in range(KILLS):
            trainer = _start(script, capture.directory, steps, log)
            time.sleep(rng.uniform(0.8, 2.5))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
            kills += 1
        writer.join()
        masked = {rid: reference(rid, ref.directory)["mask_sample"] for rid in finished}
        trainer = _start(script, capture.directory, steps, log)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = {rid for ids in committed_steps(steps).values() for rid in ids}
            # A step's retirement follows its dataset: a kill in between leaves it to the
            # next stream, which would finish it, so the last trainer lives until it is done.
            if done >= set(finished) and all(capture.lifecycle(rid).retired == (not masked[rid]) for rid in finished):
                break
            assert trainer.poll() is None, trainer.stderr.read().decode()[-3000:]
            time.sleep(0.2)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    finally:
        writer.join()

    context = f"(seed {seed}, {kills} kills)"
    step_ids = committed_steps(steps)
    seen = [rid for ids in step_ids.values() for rid in ids]
    assert sorted(seen) == sorted(finished), f"every finished rollout in exactly one step dataset {context}"
    rows = {}
    for name in step_ids:
        rows.update(row_builds(_read(steps / name)))
    for rid in finished:
        expected = reference(rid, ref.directory)
        assert rows[rid] == expected, f"{rid}: the committed row equals the sequential build {context}"
        assert capture.lifecycle(rid).retired == (not expected["mask_sample"]), (
            f"{rid}: retired iff its row is unmasked and committed {context}"
        )
    committed_at: dict[str, int] = {}
    for number, line in enumerate(log.read_text().splitlines()):
        verb, _, ids = line.partition(" ")
        for rid in ids.split():
            if verb == "committed":
                committed_at.setdefault(rid, number)
            else:
                assert rid not in committed_at, f"{rid} was delivered again after its commit {context}"


def _read(path: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in shard_paths(path)])
