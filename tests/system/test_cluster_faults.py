"""The Ray delivery layer under placement across nodes and under faults.

Every test runs on the session's shared cluster (see conftest): the multi-node tests add
the worker nodes they need and remove them afterwards; the fault tests connect a fresh
driver (`fresh_ray`), so the actors they kill and the runtime environment they set are
their own and gone after them.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import ray

import raycap
from conftest import on_ray
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.cluster.plumbing import task as builder_task
from raycap.cluster.rebuild import session as cluster
from raycap.cluster.rebuild.scheduler import BatchScheduler

pytestmark = pytest.mark.slow

SMALL_FAULTS = dict(fault_share=1.0, system_tokens=(50, 200), turns=(4, 8), generation_tokens=(1, 40), tool_tokens=(1, 60))


def _assert_same_rows(got, want, got_dir, want_dir, comparable):
    """Same builds row by row, apart from random snapshot ids and directory paths."""
    assert got.column("rollout_id").to_pylist() == want.column("rollout_id").to_pylist()
    for a, b in zip(raycap.builds_from_table(got), raycap.builds_from_table(want)):
        assert comparable(a, got_dir) == comparable(b, want_dir), a["rollout_id"]


def _kill_once_after_first_batch(action):
    fired = []

    def progress(state):
        if state.done and not fired:
            fired.append(state.done)
            action()

    return progress, fired


def test_directories_are_served_from_the_nodes_that_hold_them(fresh_ray, comparable, tmp_path):
    ray_cluster = fresh_ray()
    data = str(tmp_path)
    # n1 is the driver's node (the head); n2 and n3 are worker nodes added for this test.
    with ray_cluster.nodes([{"raycap-node": "n2"}, {"raycap-node": "n3"}]):
        node_of = ray_cluster.node_ids()
        node_of["n1"] = node_of["head"]
        assert ray.get_runtime_context().get_node_id() == node_of["n1"]

        dirs, refs = {}, {}
        for i, name in enumerate(("n1", "n2", "n3")):
            dirs[name] = os.path.join(data, name)
            refs[name] = os.path.join(data, f"{name}-ref")
            generate_corpus(dirs[name], CorpusSpec(rollouts=8, seed=20 + i, id_prefix=name, **SMALL_FAULTS))
            shutil.copytree(dirs[name], refs[name])
        specs = [dirs["n1"], f"raycap-node=n2:{dirs['n2']}", f"{node_of['n3']}:{dirs['n3']}"]

        flt = cluster.fleet(specs)
        served = ray.get([h.actor.node_id.remote() for h in flt.handles])
        # n2 and n3 by label and node id; the plain path is on every node here (one
        # shared file system), so by the placement rule it is served from the driver's node.
        assert served == [node_of["n1"], node_of["n2"], node_of["n3"]]
        only_n2 = cluster.fleet([f"raycap-node=n2:{dirs['n1']}"])
        assert ray.get(only_n2.handles[0].actor.node_id.remote()) == node_of["n2"]
        # All three nodes share one IP here, so an IP matcher behaves like a plain path.
        by_ip = cluster.fleet([f"{ray.nodes()[0]['NodeManagerAddress']}:{dirs['n2']}"])
        assert by_ip.nodes == [node_of["n1"]]

        table = on_ray(specs)
        want = on_ray([refs["n1"], refs["n2"], refs["n3"]])
        ids = table.column("rollout_id").to_pylist()
        assert ids == want.column("rollout_id").to_pylist() and len(ids) > 20
        spec_of = dict(zip(("n1", "n2", "n3"), specs))
        assert table.column("capture_dirs").to_pylist() == [[spec_of[rid[:2]]] for rid in ids]
        for got, expected in zip(raycap.builds_from_table(table), raycap.builds_from_table(want)):
            rid = got["rollout_id"]
            directory = dirs[rid[:2]]
            assert comparable(got, directory) == comparable(expected, refs[rid[:2]]), rid


def test_a_directory_actor_killed_mid_rebuild_is_restarted_and_rows_are_unchanged(
    fresh_ray, corpus_copy, comparable, monkeypatch
):
    fresh_ray()
    # On one node builder tasks freeze for themselves; take the path that uses the actor.
    monkeypatch.setattr(BatchScheduler, "_direct_batches", lambda self: False)
    directory, reference = corpus_copy("killed"), corpus_copy("reference")
    actor = cluster.fleet([directory]).handles[0].actor
    pid = ray.get(actor.pid.remote())
    progress, fired = _kill_once_after_first_batch(lambda: os.kill(pid, signal.SIGKILL))

    disturbed = on_ray([directory], batch_size=2, max_in_flight=2, progress=progress)

    assert fired and fired[0] < disturbed.num_rows, "the kill did not happen mid-rebuild"
    assert ray.get(actor.pid.remote()) != pid  # the same actor, restarted
    undisturbed = on_ray([directory], batch_size=2, max_in_flight=2)
    assert disturbed.equals(undisturbed)  # snapshot ids included: freeze is idempotent
    _assert_same_rows(disturbed, on_ray([reference]), directory, reference, comparable)


def test_a_builder_worker_that_dies_is_retried_and_rows_are_unchanged(
    fresh_ray, corpus_copy, comparable, tmp_path, monkeypatch
):
    marker = tmp_path / "builder-died"
    fresh_ray()
    flag = str(marker)

    def dies_once_then_builds(*args):
        if not os.path.exists(flag):
            open(flag, "w").close()
            os._exit(1)  # the first task to get here dies like a lost worker
        return builder_task.build_one_batch(*args)

    faulty = ray.remote(num_cpus=1, max_retries=builder_task.TASK_MAX_RETRIES)(dies_once_then_builds)
    monkeypatch.setattr(builder_task, "build_batch_task", faulty)
    directory, reference = corpus_copy("crashed"), corpus_copy("reference")

    disturbed = on_ray([directory], batch_size=4)

    assert marker.exists(), "no builder task died"
    assert not any("builder task" in (error or "") for error in disturbed.column("error").to_pylist())
    undisturbed = on_ray([directory], batch_size=4)
    assert disturbed.equals(undisturbed)
    _assert_same_rows(disturbed, on_ray([reference]), directory, reference, comparable)


def test_an_actor_killed_for_good_is_replaced_by_the_next_call(fresh_ray, corpus_copy, comparable):
    fresh_ray()
    directory, reference = corpus_copy("dead"), corpus_copy("reference")
    old = cluster.fleet([directory]).handles[0].actor
    ray.kill(old, no_restart=True)

    table = on_ray([directory])

    _assert_same_rows(table, on_ray([reference]), directory, reference, comparable)
    assert cluster.fleet([directory]).handles[0].actor._actor_id != old._actor_id


def test_an_actor_killed_for_good_mid_rebuild_masks_the_rest_and_a_rerun_recovers(
    fresh_ray, corpus_copy, comparable, monkeypatch
):
    fresh_ray()
    # Builder tasks on the directory's node freeze for themselves; the actor freezes
    # (and can be lost) when the directories span nodes: take that path here.
    monkeypatch.setattr(BatchScheduler, "_direct_batches", lambda self: False)
    directory, reference = corpus_copy("dead"), corpus_copy("reference")
    actor = cluster.fleet([directory]).handles[0].actor
    progress, fired = _kill_once_after_first_batch(lambda: ray.kill(actor, no_restart=True))

    table = on_ray([directory], batch_size=2, max_in_flight=2, progress=progress)

    assert fired
    want = {b["rollout_id"]: b for b in raycap.builds_from_table(on_ray([reference]))}
    lost = []
    for row in raycap.builds_from_table(table):
        if row.get("error", "").startswith("ActorDiedError"):
            # Masked, naming the directory and why; no snapshot, so nothing is retired.
            assert directory in row["error"] and "died" in row["error"]
            assert row["mask_sample"] is True and "_capture_snapshot" not in row
            lost.append(row["rollout_id"])
        else:
            assert comparable(row, directory) == comparable(want[row["rollout_id"]], reference)
    assert 0 < len(lost) < table.num_rows
    assert not any(r for r in cluster.retirable(table) if r[1] in lost)

    rerun = on_ray([directory])
    _assert_same_rows(rerun, on_ray([reference]), directory, reference, comparable)
    assert _without(rerun, lost).equals(_without(table, lost))  # same snapshots as before


def _without(table, rollout_ids):
    keep = pc.invert(pc.is_in(table.column("rollout_id"), value_set=pa.array(rollout_ids, type=pa.string())))
    return table.filter(keep)


def test_a_node_lost_mid_rebuild_fails_its_work_at_once_with_a_clear_error(fresh_ray, caplog, tmp_path):
    """The directory is pinned to a worker node that is removed after the first batch:
    one row per id, the lost ones masked with an error naming the directory and saying
    a rebuild later is safe, and no waiting on restarts that cannot be scheduled."""
    ray_cluster = fresh_ray()
    with ray_cluster.nodes([{"raycap-node": "w1"}, {}]) as (worker, _):
        directory = str(tmp_path / "captures")
        generate_corpus(directory, CorpusSpec(rollouts=24, seed=9, **SMALL_FAULTS))
        spec = f"{worker.node_id}:{directory}"
        ids = raycap.Rebuilder([spec]).list_rollouts()
        removed = []

        def progress(state):
            if state.done and not removed:
                removed.append(time.monotonic())
                ray_cluster.remove_node(worker)

        caplog.set_level(logging.WARNING, logger="raycap")
        table = on_ray([spec], ids, batch_size=2, max_in_flight=2, progress=progress)
        waited = time.monotonic() - removed[0]

        assert table.column("rollout_id").to_pylist() == ids  # one row per id, in order
        lost = [r for r in table.to_pylist() if r["error"] and r["error"].startswith("NodeDiedError")]
        assert lost, "nothing was pending on the removed node"
        for row in lost:
            assert spec in row["error"] and "rebuilding these rollouts later is safe" in row["error"]
            assert row["mask_sample"] is True and not row["snapshots"]
        assert not any("ActorUnschedulableError" in (r["error"] or "") for r in table.to_pylist())
        assert waited < 8.0, f"the rebuild waited {waited:.1f} s after the node was removed"
        assert any("gone" in record.getMessage() for record in caplog.records)
