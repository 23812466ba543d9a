"""A cluster whose CPUs are all held (a collection's or a trainer's own actors often hold
them): a rebuild on Ray says why it waits, and finishes once a CPU is freed; a training
step does not wait, this process builds it whole."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import raycap
import raycap.cluster.rebuild.scheduler
from test_misuse import GOOD, small_corpus
from test_task import record_batches, step_dir, steps_shared, unmasked


def holding_every_cpu():
    """Actors holding every CPU of the cluster, up and running."""
    import ray

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> int:
            return 1

    holders = [Holder.remote() for _ in range(int(ray.cluster_resources().get("CPU", 0)))]
    ray.get([h.ping.remote() for h in holders], timeout=120)
    return holders


def test_a_rebuild_waiting_for_a_cpu_says_so_and_ends_once_one_is_freed(ray_shared, tmp_path, monkeypatch, caplog):
    import ray

    captures = small_corpus(tmp_path / "caps")
    monkeypatch.setattr(raycap.cluster.rebuild.scheduler, "STALL_WARN_S", 1.0)

    holders = holding_every_cpu()
    pool = ThreadPoolExecutor(1)
    try:
        with caplog.at_level(logging.WARNING, logger="raycap.cluster.rebuild.scheduler"):
            # One batch per rollout, more than CPUs: no batch is built by this process.
            running = pool.submit(raycap.rebuild, [captures], GOOD, model="m", executor="ray", batch_size=1)
            deadline = time.monotonic() + 60
            while not any("waited" in r.getMessage() and "CPU" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no word of the wait for a CPU"
                assert not running.done(), "built with every CPU held"
                time.sleep(0.2)
    finally:
        for holder in holders:
            ray.kill(holder)
    table = running.result(timeout=120)
    pool.shutdown()
    assert table.column("rollout_id").to_pylist() == GOOD
    message = next(r.getMessage() for r in caplog.records if "CPU" in r.getMessage())
    assert "every CPU of the cluster is held" in message and "executor='local'" in message


def test_a_step_whose_builder_task_cannot_start_is_built_here_whole_with_the_same_rows(ray_shared, tmp_path, monkeypatch):
    import ray

    directory, ids = step_dir(tmp_path, history=20, fresh=72)
    steps_shared(monkeypatch)
    rebuilder = raycap.Rebuilder([str(directory)], executor="ray")
    assert unmasked(rebuilder.rebuild(ids[:8])) == ids[:8]  # placement and actors, found once
    step = ids[8:]
    submitted, here = record_batches(monkeypatch)
    holders = holding_every_cpu()
    pool = ThreadPoolExecutor(1)
    try:
        running = pool.submit(rebuilder.rebuild, step)
        # Waiting for the builder task would take until a CPU is freed, after this.
        table = running.result(timeout=120)
    finally:
        for holder in holders:
            ray.kill(holder)
        pool.shutdown()
    assert unmasked(table) == step
    assert submitted and [rid for batch in here for rid in batch] == step, (submitted, here)
    # Built here, the rows are the ones a build anywhere gives (the freezes stand).
    assert table.equals(raycap.Rebuilder([str(directory)], executor="local").rebuild(step))
