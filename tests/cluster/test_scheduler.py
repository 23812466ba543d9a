"""A cluster whose CPUs are all held (a collection's or a trainer's own actors often hold
them): a rebuild on Ray says why it waits, and finishes once a CPU is freed."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import raycap
import raycap.cluster.rebuild.scheduler
from test_misuse import GOOD, small_corpus


def test_a_rebuild_waiting_for_a_cpu_says_so_and_ends_once_one_is_freed(ray_shared, tmp_path, monkeypatch, caplog):
    import ray

    captures = small_corpus(tmp_path / "caps")
    monkeypatch.setattr(raycap.cluster.rebuild.scheduler, "STALL_WARN_S", 1.0)

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> int:
            return 1

    holders = [Holder.remote() for _ in range(int(ray.available_resources().get("CPU", 0)))]
    pool = ThreadPoolExecutor(1)
    try:
        ray.get([h.ping.remote() for h in holders], timeout=120)
        with caplog.at_level(logging.WARNING, logger="raycap.cluster.rebuild.scheduler"):
            running = pool.submit(raycap.rebuild, [captures], GOOD, model="m", executor="ray")
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
