"""A node actor's hold on its directories for a stream (`raycap.cluster.nodes.node_stream`),
without Ray: the subscription's file work, with a stand-in for the stream's hub that
records what is pushed to it."""

from __future__ import annotations

import time

import pytest

from raycap import TokenCaptureStore
from raycap.capture.markers import CommitMarker
from raycap.cluster.nodes.node_stream import Check, Subscription
from raycap.stream.readiness import DirectoryBusy
from raycap.stream.steps import SnapshotPart
from test_stream import write


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
