"""A stream and a training step over nodes' own capture directories (`NODE:/path`), and
a node actor's hold on its directories for a stream (`raycap.cluster.nodes.node_stream`).

The Ray tests add two worker nodes to the session's shared cluster (see conftest), each
holding its own directory (the simulated nodes share this machine's file system, so
each directory is given as `NODE_ID:/path`), and remove them after the module (asking for
Ray, they are in the slow tier). The
node-loss test adds a node of its own whose paths resolve under a root of its own (the
placement test seam, `raycap.cluster.plumbing.placement.ROOT_LABEL`), so that removing it hides
its directory and a new node with the same labels brings it back.

The subscription's file work is tested without Ray, at the end: a stand-in for the
stream's hub records what is pushed to it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

import raycap
from raycap import TokenCaptureStore
from raycap.capture.markers import CommitMarker
from raycap.cluster.nodes.node_stream import Check, Subscription
from raycap.cluster.plumbing import task as builder_task
from raycap.cluster.plumbing.placement import ROOT_LABEL
from raycap.output.manifest import shard_paths
from raycap.stream.readiness import DirectoryBusy
from raycap.stream.steps import SnapshotPart
from test_stream import call, committed_steps, reference, row_builds, write

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("w1", "w2")


@pytest.fixture(scope="module")
def nodes(ray_cluster):
    """The session's cluster with two worker nodes, this process its driver; their ids by name."""
    with ray_cluster.nodes([{"raycap-node": name} for name in WORKERS]):
        ray_cluster.connect()
        yield ray_cluster, ray_cluster.node_ids()


def _read(path: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in shard_paths(path)])


# --- a step over several nodes ------------------------------------------------------------------


class _NoSubmit:
    """Stands in for the builder task in this process: a step over several nodes must not
    submit one from the driver."""

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        raise AssertionError("the driver submitted a builder task")


def test_rebuild_refs_over_two_nodes_gives_the_local_rows_in_the_order_of_the_ids(nodes, tmp_path, comparable,
                                                                                   monkeypatch):
    cluster, node_of = nodes
    dirs = {name: tmp_path / name for name in WORKERS}
    merged = TokenCaptureStore(tmp_path / "merged")
    for name in WORKERS:
        store = TokenCaptureStore(dirs[name])
        for i in range(3):
            kind = "two_roots" if i == 1 else "ok"
            write(store, f"{name}-{i}", kind)
            write(merged, f"{name}-{i}", kind)
    # A rollout whose calls were captured on both nodes, assembled across them.
    for i, name in enumerate(WORKERS * 2):
        entry = call("split", "ok", i)
        TokenCaptureStore(dirs[name]).append(entry)
        merged.append(entry)
    specs = [f"{node_of[name]}:{dirs[name]}" for name in WORKERS]
    # Interleaved across the nodes, as rollouts finish; "nowhere" is held by no directory.
    ids = ["w1-0", "w2-0", "split", "w1-1", "w2-1", "nowhere", "w1-2", "w2-2"]

    refs = raycap.Rebuilder(specs, executor="ray").rebuild_refs(ids)

    table = pa.concat_tables(ray.get(refs))
    assert table.column("rollout_id").to_pylist() == ids
    want = raycap.rebuild([str(merged.directory)], ids, executor="local")
    for got, expected in zip(raycap.builds_from_table(table), raycap.builds_from_table(want)):
        got.pop("_capture_snapshot", None), expected.pop("_capture_snapshot", None)
        if got["rollout_id"] == "nowhere":
            assert got["mask_sample"] and "no token records" in got["error"]
            continue
        assert comparable(got, "")[0] == comparable(expected, "")[0], got["rollout_id"]
    split = table.filter(pa.compute.equal(table.column("rollout_id"), "split")).column("snapshots")[0].as_py()
    assert sorted(s["capture_dir"] for s in split) == sorted(specs)
    # Rollouts held on one node each are built by the nodes' actors, never by a builder
    # task this process submits.
    monkeypatch.setattr(builder_task, "build_batch_task", _NoSubmit())
    again = pa.concat_tables(ray.get(raycap.Rebuilder(specs, executor="ray").rebuild_refs(["w2-2", "w1-0", "w2-1"])))
    assert again.column("rollout_id").to_pylist() == ["w2-2", "w1-0", "w2-1"]
    assert again.equals(table.take([7, 0, 4]))  # the same snapshots: freezing is idempotent


# --- the stream ---------------------------------------------------------------------------------


def test_a_stream_over_two_nodes_directories_delivers_and_commits_each_rollout_once(nodes, tmp_path):
    cluster, node_of = nodes
    dirs = {name: tmp_path / name for name in WORKERS}
    stores = {name: TokenCaptureStore(dirs[name]) for name in WORKERS}
    ref = TokenCaptureStore(tmp_path / "ref")
    kinds = {f"{name}-{i}": ("two_roots" if i == 1 else "ok") for name in WORKERS for i in range(3)}
    for rid, kind in kinds.items():
        write(stores[rid[:2]], rid, kind)
        write(ref, rid, kind)
    specs = [f"{node_of[name]}:{dirs[name]}" for name in WORKERS]
    steps = tmp_path / "steps"

    with raycap.Stream(specs, watch=True) as stream:
        assert stream.paths == specs
        # A second stream over the same directories, while this one lives, is refused.
        with pytest.raises(RuntimeError, match="another stream consumes"):
            raycap.Stream(specs)
        # Ready by watch: another process froze it.
        frozen_at = time.monotonic()
        stores["w1"].freeze_raw("w1-0")
        first = stream.take(1, timeout=30)
        latency = time.monotonic() - frozen_at
        assert first.column("rollout_id").to_pylist() == ["w1-0"]
        assert latency < 10, f"freeze -> take took {latency:.1f} s"
        # Ready by submit: the node actors freeze what they hold; "nope" is held nowhere.
        submitted = stream.submit(["w2-0", "w2-1", "w1-1", "nope"])
        assert submitted.ready == ("w2-0", "w2-1", "w1-1") and set(submitted.refused) == {"nope"}
        refs = stream.take_refs(3, timeout=60)
        rest = stream.submit(["w1-2", "w2-2"])
        assert rest.ready == ("w1-2", "w2-2")
        last = stream.take(2, timeout=60)
        reports = [
            stream.commit(first, output=steps / "step-0"),
            stream.commit(refs, output=steps / "step-1"),
            stream.commit(last),  # durable elsewhere: the caller's checkpoint
        ]
        assert stream.take(1, timeout=0.5).num_rows == 0
    assert sum(r.rollouts for r in reports) == len(kinds) and not any(r.skipped or r.not_retired for r in reports)
    rows = row_builds(pa.concat_tables([_read(steps / "step-0"), _read(steps / "step-1"), last]))
    assert sorted(rows) == sorted(kinds)
    for rid in kinds:
        expected = reference(rid, ref.directory)
        assert rows[rid] == expected, rid
        assert stores[rid[:2]].lifecycle(rid).retired == (not expected["mask_sample"]), rid
    # A new stream delivers nothing again: the masked ones stay as evidence.
    with raycap.Stream(specs, watch=True) as again:
        assert again.take(1, timeout=2).num_rows == 0


def test_a_commit_a_dead_trainer_left_half_done_is_finished_or_undone_where_the_directory_is(
    nodes, tmp_path, monkeypatch
):
    from raycap.cluster.streaming.driver_dirs import NodeDirectories
    from raycap.stream.stepcommit import StepCommit

    cluster, node_of = nodes
    store = TokenCaptureStore(tmp_path / "w1")
    for rid in ("done", "undone"):
        write(store, rid)
        store.freeze_raw(rid)
    spec = f"{node_of['w1']}:{store.directory}"
    steps = tmp_path / "steps"

    def crash(*args, **kwargs):
        raise RuntimeError("the trainer died here")

    with raycap.Stream([spec], watch=True) as stream:
        rows = stream.take(2, timeout=60)
        by_id = {rid: rows.filter(pa.compute.equal(rows.column("rollout_id"), rid)) for rid in ("done", "undone")}
        with monkeypatch.context() as m:
            m.setattr(NodeDirectories, "drop", crash)  # the step is durable, nothing retired yet
            with pytest.raises(RuntimeError, match="died"):
                stream.commit(by_id["done"], output=steps / "s-done")
        with monkeypatch.context() as m:
            m.setattr(StepCommit, "write", crash)  # the marker is written, the step never renamed into place
            with pytest.raises(RuntimeError, match="died"):
                stream.commit(by_id["undone"], output=steps / "s-undone")
    assert store.read_commit("done") is not None and store.read_commit("undone") is not None
    assert not store.lifecycle("done").retired
    with raycap.Stream([spec], watch=True) as stream:
        again = stream.take(1, timeout=30)
        assert again.column("rollout_id").to_pylist() == ["undone"]  # its step never held it
        assert stream.take(1, timeout=1).num_rows == 0
        assert stream.stats.recovered_ready == 1 and stream.stats.recovered_finished == 1
        assert stream.commit(again, output=steps / "s-again").retired == 1
    assert store.lifecycle("done").retired and store.lifecycle("undone").retired
    assert committed_steps(steps) == {str(steps / "s-again"): ["undone"], str(steps / "s-done"): ["done"]}


def test_a_stream_over_node_directories_keeps_each_record_on_its_node_and_commits_what_gyms_finalizer_makes(
    nodes, tmp_path
):
    from collection import gym_finalized, text
    from test_stream_records import expected_columns, record

    cluster, node_of = nodes
    kinds = {"n-0": "ok", "n-1": "two_roots", "n-2": "ok"}
    store, chains = TokenCaptureStore(tmp_path / "w1"), TokenCaptureStore(tmp_path / "w2")
    for rid, kind in kinds.items():
        write(store, rid, kind)
    write(chains, "c-0", "two_roots")
    oracle = tmp_path / "oracle"
    shutil.copytree(store.directory, oracle)
    shutil.copytree(chains.directory, oracle, dirs_exist_ok=True)
    given = [record(rid, 5, i, i / 2) for i, rid in enumerate(kinds)]
    gyms, _ = gym_finalized([*given, record("c-0", 6, 0, 1.0)], oracle)
    spec, steps = f"{node_of['w1']}:{store.directory}", tmp_path / "steps"

    with raycap.Stream([spec]) as stream:
        submitted = stream.submit([*given, {"_ng_rollout_id": "ghost"}])
        assert submitted.ready == tuple(kinds) and list(submitted.refused) == ["record 3"]
        assert all(store.record_path(rid).exists() for rid in kinds)  # kept by the node's actor, beside the capture
        refs = stream.take_refs(2, timeout=60)  # rows left beside the nodes: the hub sets the columns
        taken = ray.get(refs[0])
        report = stream.commit(refs, output=steps / "step-0")
        last = stream.take(1, timeout=60)  # taken, never committed: this trainer dies here
    with raycap.Stream([spec]) as stream:
        again = stream.take(1, timeout=60)
        assert again.equals(last)  # delivered again, with its record's fields
        stream.commit(again, output=steps / "step-1")
    with raycap.Stream([f"{node_of['w2']}:{chains.directory}"], delivery="chains") as stream:
        stream.submit([record("c-0", 6, 0, 1.0)])
        branchy = stream.take(1, timeout=60)
        stream.commit(branchy, output=steps / "step-2")

    rows = pa.concat_tables([taken, again]).to_pylist()
    assert sorted(r["rollout_id"] for r in rows) == sorted(kinds) and report.rollouts == 2
    for row in rows:
        i = list(kinds).index(row["rollout_id"])
        assert {k: row[k] for k in expected_columns(given[i], i)} == expected_columns(given[i], i)
        assert row["model"] == "policy-5"
    assert branchy.column("reward").to_pylist() == [1.0, 1.0]  # every chain row carries it
    got = {r["_ng_rollout_id"]: r for step in ("step-0", "step-1", "step-2") for r in raycap.read_records(steps / step)}
    assert {rid: text(r, store.directory, chains.directory) for rid, r in got.items()} == {
        r["_ng_rollout_id"]: text(r, oracle) for r in gyms
    }
    for rid in kinds:
        masked = reference(rid, oracle)["mask_sample"]
        assert store.lifecycle(rid).retired == (not masked) and store.record_path(rid).exists() == masked, rid


TRAINER = r"""
import os, sys, time
import raycap

address, steps, log, hidden = sys.argv[1:5]
specs = sys.argv[5:]
if hidden != "-" and os.path.exists(hidden):
    raise SystemExit(f"the capture directory {hidden} should not exist for this process")
with raycap.Stream(specs, watch=True, address=address) as stream:
    with open(log, "a") as f:
        f.write("started\n")
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

ROLLOUTS = 16
KILLS = 2


def _mount_namespace() -> bool:
    """Whether this machine lets a process see a file system of its own (unshare)."""
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as probe:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'mount -t tmpfs tmpfs "{probe}"'],
            capture_output=True, check=False,
        )
    return done.returncode == 0


def test_a_trainer_without_the_directories_killed_at_random_commits_every_finished_rollout_once(nodes, tmp_path):
    """The trainer joins by address; where this machine allows it, from a mount namespace
    where the capture directories do not exist (a tmpfs over their root). It is SIGKILLed
    at random moments and restarted: its successor is never locked out."""
    cluster, node_of = nodes
    seed = int(os.environ.get("RAYCAP_CRASH_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    captures = tmp_path / "captures"
    dirs = {name: captures / name for name in WORKERS}
    stores = {name: TokenCaptureStore(dirs[name]) for name in WORKERS}
    ref = TokenCaptureStore(tmp_path / "ref")
    steps, log = tmp_path / "steps", tmp_path / "trainer.log"
    steps.mkdir()
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    specs = [f"{node_of[name]}:{dirs[name]}" for name in WORKERS]
    hide = _mount_namespace()
    finished: list[str] = []

    def writer() -> None:
        """Writes rollouts on both nodes' directories and freezes each, as a finalizer."""
        writer_rng = random.Random(seed + 1)
        for i in range(ROLLOUTS):
            name = WORKERS[i % 2]
            rid = f"{name}-{i}"
            kind = "two_roots" if i % 5 == 3 else "ok"
            for index in range(writer_rng.randint(1, 3)):
                entry = call(rid, kind, index)
                stores[name].append(entry)
                ref.append(entry)
            stores[name].freeze_raw(rid)
            finished.append(rid)
            time.sleep(writer_rng.uniform(0.05, 0.4))

    def start() -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("RAY_ADDRESS", None)
        command = [sys.executable, str(script), cluster.address, str(steps), str(log), str(dirs["w1"]) if hide else "-"]
        if hide:
            mount = f'mount -t tmpfs tmpfs "{captures}" && exec "$0" "$@"'
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, *command]
        return subprocess.Popen([*command, *specs], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def started(trainer: subprocess.Popen, count: int) -> None:
        deadline = time.monotonic() + 60
        while (log.read_text().count("started") if log.exists() else 0) < count:
            assert trainer.poll() is None, f"the trainer was refused (seed {seed}): {trainer.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "the trainer did not start"
            time.sleep(0.05)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for kill in range(KILLS):
            trainer = start()
            started(trainer, kill + 1)  # a successor of a killed trainer is never locked out
            time.sleep(rng.uniform(0.2, 2.0))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
        thread.join()
        masked = {rid: reference(rid, ref.directory)["mask_sample"] for rid in finished}
        trainer = start()
        started(trainer, KILLS + 1)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            # A step's retirement follows its dataset: a kill in between leaves it to the
            # next stream, which would finish it, so the last trainer lives until it is done.
            if {rid for ids in committed_steps(steps).values() for rid in ids} >= set(finished) and all(
                stores[rid[:2]].lifecycle(rid).retired == (not masked[rid]) for rid in finished
            ):
                break
            assert trainer.poll() is None, trainer.stderr.read().decode()[-3000:]
            time.sleep(0.2)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    finally:
        thread.join()

    context = f"(seed {seed}, {KILLS} kills, directories hidden from the trainer: {hide})"
    step_ids = committed_steps(steps)
    seen = [rid for ids in step_ids.values() for rid in ids]
    assert sorted(seen) == sorted(finished), f"every finished rollout in exactly one step dataset {context}"
    rows = {}
    for name in step_ids:
        rows.update(row_builds(_read(steps / name)))
    for rid in finished:
        expected = reference(rid, ref.directory)
        assert rows[rid] == expected, f"{rid}: the committed row equals the sequential build {context}"
        assert stores[rid[:2]].lifecycle(rid).retired == (not expected["mask_sample"]), f"{rid} {context}"
    committed_at: dict[str, int] = {}
    for number, line in enumerate(log.read_text().splitlines()):
        verb, _, ids = line.partition(" ")
        for rid in ids.split():
            if verb == "committed":
                committed_at.setdefault(rid, number)
            elif verb == "took":
                assert rid not in committed_at, f"{rid} was delivered again after its commit {context}"


# --- node loss ----------------------------------------------------------------------------------


def test_a_lost_nodes_ready_rollouts_wait_for_it_and_are_delivered_when_it_is_back(nodes, tmp_path):
    cluster, _ = nodes
    root = tempfile.mkdtemp(prefix="raycap-own-disk-")
    labels = {"raycap-node": "comes-back", ROOT_LABEL: root}
    directory = "/captures/comes-back"
    store = TokenCaptureStore(os.path.join(root, directory.lstrip("/")))  # the node's disk
    node = cluster.add_node(labels=labels)
    back = None
    try:
        ids = [f"c{i}" for i in range(4)]
        for rid in ids:
            write(store, rid)
            store.freeze_raw(rid)
        with raycap.Stream([f"raycap-node=comes-back:{directory}"], watch=True) as stream:
            taken = stream.take(1, timeout=60)
            assert taken.num_rows == 1
            deadline = time.monotonic() + 30
            while len(stream._built) < 3 and time.monotonic() < deadline:  # the others built ahead
                time.sleep(0.05)
            cluster.remove_node(node)
            deadline = time.monotonic() + 20
            while stream.stats.lost < 3 and time.monotonic() < deadline:  # the stream sees the loss
                time.sleep(0.05)
            # Not delivered while the node is gone, even those already built.
            assert stream.stats.lost == 3
            assert stream.take(3, timeout=2).num_rows == 0
            # A commit of rows taken from the lost node claims nothing it could not do.
            report = stream.commit(taken)
            assert report.rollouts == 0 and list(report.skipped) == taken.column("rollout_id").to_pylist()
            assert "could not be written" in next(iter(report.skipped.values()))
            # Nothing of it is lost: a node with its disk comes back, and every rollout,
            # the one whose commit could not be made included, is delivered.
            back = cluster.add_node(labels=labels)
            rows = stream.take(4, timeout=60)
            assert sorted(rows.column("rollout_id").to_pylist()) == ids
            report = stream.commit(rows)
            assert report.retired == 4 and not report.skipped
        assert all(store.lifecycle(rid).retired for rid in ids)
    finally:
        cluster.remove_node(node)
        if back is not None:
            cluster.remove_node(back)
        shutil.rmtree(root, ignore_errors=True)


# --- the subscription's file work, without Ray -------------------------------------------------


class _Remote:
    def __init__(self, record):
        self.record = record

    def remote(self, *args):
        self.record(args)


class _Hub:
    """What a node pushes to the stream's hub, in order."""

    def __init__(self):
        self.pushed: list[tuple] = []
        self.push = _Remote(lambda args: self.pushed.extend(args[2]))


@pytest.fixture
def sub(tmp_path):
    store = TokenCaptureStore(tmp_path / "c")
    hub = _Hub()
    subscription = Subscription("key", hub, [("n1:/c", str(store.directory))], watch=False, node="n1")
    subscription.lock()
    yield subscription, store, hub
    subscription.release()


def test_a_second_hold_on_a_directory_is_refused_while_the_first_lives(sub):
    subscription, store, _ = sub
    other = Subscription("other", _Hub(), [("n1:/c", str(store.directory))], watch=False, node="n1")
    with pytest.raises(DirectoryBusy, match="another stream consumes n1:/c"):
        other.lock()
    subscription.release()
    other.lock()  # let go: the next stream takes it
    other.release()


def test_each_ready_rollout_is_pushed_once_in_freeze_order_and_unfinished_ones_never(sub):
    subscription, store, hub = sub
    for rid in ("b", "a", "running"):
        write(store, rid)
    store.freeze_raw("b")
    time.sleep(0.05)  # apart by more than the file system's timestamp granularity
    store.freeze_raw("a")
    subscription.start()
    subscription.rescan()  # a rescan pushes nothing it pushed already
    assert hub.pushed == [("ready", "b"), ("ready", "a")]


def test_a_marker_naming_a_step_is_checked_by_the_stream_and_settled_here(sub):
    subscription, store, hub = sub
    write(store, "r1")
    write(store, "r2")
    snaps = {rid: store.freeze_raw(rid) for rid in ("r1", "r2")}
    for rid, snap in snaps.items():
        store.write_commit(rid, CommitMarker(snap.snapshot_id, snap.version, "/steps/s0", False, "committed"))
    subscription.start()
    checks = [event[1] for event in hub.pushed]
    assert [c.rollout_id for c in checks] == ["r1", "r2"] and all(isinstance(c, Check) for c in checks)
    hub.pushed.clear()
    # The step held r1 (its retirement is finished here), and not r2 (delivered again).
    assert subscription.settle([(checks[0], True), (checks[1], False)]) == ["committed", "ready"]
    assert store.lifecycle("r1").retired
    assert store.read_commit("r2") is None and not store.lifecycle("r2").retired
    assert ("count", "recovered_finished", 1) in hub.pushed and ("count", "recovered_ready", 1) in hub.pushed


def test_a_rollout_committed_after_it_was_pushed_is_found_gone_when_built(sub):
    subscription, store, hub = sub
    write(store, "r1")
    write(store, "r2")
    snap = store.freeze_raw("r1")
    store.freeze_raw("r2")
    subscription.start()
    part = SnapshotPart("n1:/c", snap.snapshot_id, snap.version)
    marker = CommitMarker(snap.snapshot_id, snap.version, None, False, "committed")
    assert subscription.mark([("r1", part, marker)]) == [True]
    assert subscription.drop([("r1", [part])]) == [True]
    # A push of r1 that crossed its commit is answered by the build: not ready any more.
    assert subscription.still_ready(["r1", "r2"]) == (["r2"], ["r1"], {})


def test_submit_freezes_what_this_node_holds_and_says_what_it_does_not(sub):
    subscription, store, _ = sub
    write(store, "r1")
    answers = subscription.submit(["r1", "elsewhere"])
    assert answers == [(True, None), (False, None)]
    assert store.lifecycle("r1").frozen and not store.held(["elsewhere"])


def test_submit_keeps_each_record_here_before_freezing_and_the_build_reads_it_back(sub):
    from raycap.capture.recordfile import KeptRecord

    subscription, store, hub = sub
    for rid in ("r1", "r2"):
        write(store, rid)
    kept = KeptRecord(2, b'{"_ng_rollout_id":"r1","reward":1}')
    answers = subscription.submit(["r1", "r2", "elsewhere"], {"r1": kept, "elsewhere": KeptRecord(0, b'{"a":1}')})
    assert answers == [(True, None), (True, None), (False, None)]
    assert store.read_record("r1") == kept and not store.record_path("elsewhere").exists()
    assert store.lifecycle("r1").frozen and store.read_record("r2") is None
    # Frozen with a record: another one is refused (the same one is kept as it is).
    (held, why), = subscription.submit(["r1"], {"r1": KeptRecord(0, b'{"_ng_rollout_id":"r1","reward":2}')})
    assert held and "pending with another record" in why and store.read_record("r1") == kept
    store.record_path("r2").write_text("not a record")  # damaged from outside
    assert subscription.still_ready(["r1", "r2"]) == (["r1"], ["r2"], {"r1": kept})
    assert [event[:2] for event in hub.pushed] == [("held", "r2"), ("count", "damaged_records")]
    subscription.still_ready(["r2"])
    assert len(hub.pushed) == 2  # said once
