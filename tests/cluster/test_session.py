"""Sessions hold placement and actors, never a caller's options (on a shared Ray).

Every call brings its own options: two calls at once on the same directories, or on the
same session, each get the rows they asked for, and the object-ref path honours every
option like the others.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import ray

import raycap
from raycap.cluster.rebuild.session import session
from raycap.rows.arrow import CHAIN_SCHEMA, ROLLOUT_SCHEMA
from raycap.rows.options import RebuildOptions
from raycap.runs.handoff import rebuild_to_output

ROOT = Path(__file__).resolve().parents[2]


def test_rebuild_async_with_refs_honours_the_delivery(ray_shared, corpus_copy):
    directory = corpus_copy("d")
    rebuilder = raycap.Rebuilder([directory], executor="ray", batch_size=8)
    refs = asyncio.run(rebuilder.rebuild_async(refs=True, delivery="chains", model="m"))
    tables = ray.get(refs)
    assert tables and all(table.schema.equals(CHAIN_SCHEMA) for table in tables)
    assert set(tables[0].column("model").to_pylist()) == {"m"}
    expected = raycap.rebuild([directory], delivery="chains", model="m", executor="local")
    got = pa_concat(tables)
    assert got.select(["rollout_id", "chain_id"]).equals(expected.select(["rollout_id", "chain_id"]))


def pa_concat(tables):
    import pyarrow as pa

    return pa.concat_tables(tables)


def test_two_threads_on_the_same_directories_with_different_deliveries_each_get_their_own(ray_shared, corpus_copy):
    directory = corpus_copy("d")
    results: dict[str, list] = {"rollout": [], "chains": []}
    rebuilder = raycap.Rebuilder([directory], executor="ray", batch_size=4)

    def call(delivery: str) -> None:
        for _ in range(3):
            # The module API shares one cached session; the Rebuilder is shared too.
            results[delivery].append(raycap.rebuild([directory], delivery=delivery, executor="ray", batch_size=4))
            results[delivery].append(rebuilder.rebuild(delivery=delivery))

    threads = [threading.Thread(target=call, args=(delivery,)) for delivery in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(table.schema.equals(ROLLOUT_SCHEMA) for table in results["rollout"])
    assert all(table.schema.equals(CHAIN_SCHEMA) for table in results["chains"])
    assert len(results["rollout"]) == len(results["chains"]) == 6


def test_the_module_api_leaves_no_options_on_its_cached_session(ray_shared, corpus_copy):
    directory = corpus_copy("d")
    raycap.rebuild([directory], delivery="chains", batch_size=3, executor="ray")
    shared = session([directory])
    assert not any(isinstance(value, RebuildOptions) for value in vars(shared).values())
    assert raycap.rebuild([directory], executor="ray").schema.equals(ROLLOUT_SCHEMA)


def test_the_dataset_writer_reports_the_executor_its_own_run_chose(ray_shared, corpus_copy, tmp_path):
    directory = corpus_copy("d")
    outcome = rebuild_to_output([directory], tmp_path / "out", model="m", executor="ray", batch_size=8)
    assert outcome.summary.executor is not None
    assert (outcome.summary.executor.name, outcome.summary.executor.reason) == ("ray", "executor: ray was asked for")
    assert pq.read_table(tmp_path / "out").num_rows == outcome.summary.rollouts


def test_retire_takes_the_directories_first(corpus_copy, tmp_path):
    directory = corpus_copy("d")
    output = tmp_path / "out"
    outcome = rebuild_to_output([directory], output, model="m", executor="local")
    store_files = sorted(p.name for p in (tmp_path / "d").glob("*.tokens.jsonl"))

    report = raycap.retire([directory], output)

    assert report.dropped == outcome.summary.rollouts - outcome.summary.masked > 0 and report.errors == []
    left = sorted(p.name for p in (tmp_path / "d").glob("*.tokens.jsonl"))
    assert len(left) == len(store_files) - report.dropped
    again = raycap.retire([directory], str(output))
    assert again.errors == [] and again.changed == []
    assert sorted(p.name for p in (tmp_path / "d").glob("*.tokens.jsonl")) == left


# A fresh interpreter whose first use of Ray is rebuild_async(refs=True) inside
# asyncio.run: the refs must still be fetchable from the main thread afterwards, and the
# process must exit promptly (Ray started in a worker thread left both broken).
_FIRST_USE_IS_ASYNC = """
import asyncio, sys, time
import ray
import raycap
from raycap.cli.synth import CorpusSpec, generate_corpus

corpus = generate_corpus(sys.argv[1], CorpusSpec(rollouts=6, seed=3, system_tokens=(20, 40), turns=(4, 5),
                                                 generation_tokens=(5, 20), tool_tokens=(5, 20)))
assert not ray.is_initialized()
rebuilder = raycap.Rebuilder([corpus.directory], batch_size=2)
refs = asyncio.run(rebuilder.rebuild_async(list(corpus.rollout_ids), refs=True))
started = time.monotonic()
tables = ray.get(refs, timeout=60)
print("ROWS", sum(t.num_rows for t in tables), len(corpus.rollout_ids), round(time.monotonic() - started, 1))
"""


@pytest.mark.slow
def test_refs_of_an_async_rebuild_that_started_ray_stay_fetchable_after_asyncio_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_USE_IS_ASYNC, str(tmp_path / "captures")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows, ids, fetch_s = done.stdout.split("ROWS", 1)[1].split()[:3]
    assert rows == ids == "6" and float(fetch_s) < 30
    # Ray's start and shutdown take seconds; a Ray that died with its thread makes the
    # process wait out the GCS reconnection timeout (60 s) before it can exit.
    assert time.monotonic() - started < 60, done.stderr[-2000:]


def test_rebuild_async_off_the_main_thread_refuses_to_start_an_embedded_ray(corpus_copy, monkeypatch):
    import raycap.cluster.plumbing.connect as connecting

    started = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # As if no Ray ran in this process; an init would be the embedded start refused here.
    monkeypatch.setattr(connecting, "ray", SimpleNamespace(is_initialized=lambda: False, init=lambda **kw: started.append(kw)))
    rebuilder = raycap.Rebuilder([corpus_copy("d")])
    failures: list[BaseException] = []

    def loop_in_a_thread() -> None:
        try:
            asyncio.run(rebuilder.rebuild_async(["r0000"], refs=True))
        except RuntimeError as exc:
            failures.append(exc)

    thread = threading.Thread(target=loop_in_a_thread, name="trainer-loop")
    thread.start()
    thread.join(timeout=60)
    assert started == []
    assert len(failures) == 1 and "'trainer-loop'" in str(failures[0]) and "main thread" in str(failures[0])


def test_rebuild_async_on_ray_connects_in_the_event_loops_thread_before_handing_work_to_a_thread(
    corpus_copy, monkeypatch
):
    import raycap.runs.rebuilder as rebuilding

    class Connected(Exception):
        pass

    threads = []

    def connect_here(address=None, *, caller="this call"):
        threads.append(threading.current_thread().name)
        raise Connected  # stop here: what matters is where the connection was made

    monkeypatch.setattr(rebuilding, "connect_here", connect_here)
    monkeypatch.setattr(rebuilding.ray, "is_initialized", lambda: False)
    rebuilder = raycap.Rebuilder([corpus_copy("d")], executor="ray")
    for refs in (False, True):
        with pytest.raises(Connected):
            asyncio.run(rebuilder.rebuild_async(["r0000"], refs=refs))
    assert threads == [threading.main_thread().name] * 2
