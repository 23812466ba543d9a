"""A training step's freezes: many rollouts frozen at once, each as durable as alone.

`TokenCaptureStore.freeze_many` (what a step's builder tasks call) stages the state files
of a chunk of rollouts, fsyncs them together and the directory once (raycap.capture.freezebatch).
These tests hold it to what a freeze promises one by one: a state file is renamed only
once fsynced (a crash never leaves it torn), the directory is fsynced before anyone can
see the frozen state (a freeze seen is durable), the fsyncs stay one per state file and
one per directory, and a busy rollout is never waited for while others are locked.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from hang import no_hang
from raycap.capture.records import TokenEntry, entry_line
from raycap.capture.store import FrozenCapture, TokenCaptureStore


def write_plain(directory: Path, rollout_id: str, calls: int = 2) -> None:
    """A rollout as a writer without an index leaves it: JSONL only, no lock, no state."""
    lines = b"".join(
        entry_line(
            TokenEntry(
                rollout_id=rollout_id,
                model_call_id=f"{rollout_id}-c{call}",
                prompt_token_ids=list(range(1, 4 + call)),
                generation_token_ids=[7, 8],
                generation_log_probs=[-0.5, -0.25],
            )
        )
        + b"\n"
        for call in range(calls)
    )
    (directory / f"{rollout_id}.tokens.jsonl").write_bytes(lines)


@pytest.fixture
def step(tmp_path: Path) -> tuple[TokenCaptureStore, list[str]]:
    store = TokenCaptureStore(tmp_path / "captures")
    ids = [f"r{i:02d}" for i in range(12)]
    for rid in ids:
        write_plain(store.directory, rid)
    return store, ids


def lock_is_free(store: TokenCaptureStore, rollout_id: str) -> bool:
    fd = os.open(store.paths(rollout_id).lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def is_dir(fd: int) -> bool:
    return stat.S_ISDIR(os.fstat(fd).st_mode)


def test_a_batch_freeze_is_durable_before_any_of_its_locks_is_released(step, monkeypatch):
    store, ids = step
    real_fsync = os.fsync
    free_at_dir_fsync: list[list[str]] = []

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if is_dir(fd):
            # Whoever takes a lock released before this point sees a frozen state that a
            # crash could still undo.
            frozen = [rid for rid in ids if store.paths(rid).state.exists()]
            free_at_dir_fsync.append([rid for rid in frozen if lock_is_free(store, rid)])

    monkeypatch.setattr(os, "fsync", fsync)
    frozen = store.freeze_many(ids, read=False)
    assert all(isinstance(f, FrozenCapture) for f in frozen), frozen
    assert free_at_dir_fsync, "the directory was never fsynced"
    assert free_at_dir_fsync[-1] == [], (
        f"rollouts {free_at_dir_fsync[-1]} were unlocked, frozen, before the directory fsync made their state durable"
    )


def test_a_batch_renames_each_state_file_only_once_it_is_fsynced(step, monkeypatch):
    store, ids = step
    real_fsync, real_replace = os.fsync, os.replace
    synced: set[tuple[int, int]] = set()
    renamed: list[str] = []

    def fsync(fd: int) -> None:
        real_fsync(fd)
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))

    def replace(src, dst, *args, **kwargs) -> None:
        st = os.stat(src)
        assert (st.st_dev, st.st_ino) in synced, f"{src} renamed over {dst} before it was fsynced"
        renamed.append(Path(dst).name)
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.freeze_many(ids, read=False)
    assert sorted(renamed) == sorted(f"{rid}.tokens.state.json" for rid in ids)
    assert not [p.name for p in store.directory.iterdir() if p.name.endswith(".tmp")]


def test_a_batch_makes_every_temp_file_of_its_chunk_before_it_fsyncs_or_renames_one(step, monkeypatch):
    # A file made while earlier ones are fsynced and renamed waits on the directory and
    # on the inode blocks being written (64 freezes measured 50 ms so, 39 ms without).
    import raycap.capture.freezebatch as freezebatch

    store, ids = step
    real_temp, real_fsync, real_replace = freezebatch.temp_beside, os.fsync, os.replace
    events: list[str] = []
    lock = threading.Lock()

    def temp_beside(target, data):
        made = real_temp(target, data)
        with lock:
            events.append("made")
        return made

    def fsync(fd: int) -> None:
        with lock:
            events.append("fsync")
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs) -> None:
        with lock:
            events.append("rename")
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(freezebatch, "temp_beside", temp_beside)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    frozen = store.freeze_many(ids, read=False)
    assert all(isinstance(f, FrozenCapture) for f in frozen), frozen
    assert events.count("made") == len(ids)
    last_made = max(i for i, e in enumerate(events) if e == "made")
    early = [e for e in events[:last_made] if e != "made"]
    assert not early, f"{len(early)} fsyncs or renames ran while the chunk's temp files were still being made: {events}"
    assert events.count("rename") == len(ids)


def test_a_batch_interrupted_while_staging_leaves_whole_states_no_temp_file_and_no_lock(step, monkeypatch):
    store, ids = step
    real_freeze = TokenCaptureStore._freeze_locked
    calls = {"n": 0}

    def freeze_locked(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_freeze(self, *args, **kwargs)

    monkeypatch.setattr(TokenCaptureStore, "_freeze_locked", freeze_locked)
    with pytest.raises(KeyboardInterrupt):
        store.freeze_many(ids, read=False)
    monkeypatch.undo()
    assert not [p.name for p in store.directory.iterdir() if p.name.endswith(".tmp")]
    assert all(lock_is_free(store, rid) for rid in ids[:5])
    # What was staged before the interruption became the state file, whole; nothing after it did.
    with_state = [rid for rid in ids if store.paths(rid).state.exists()]
    assert with_state == ids[:4]
    states = [json.loads(store.paths(rid).state.read_bytes()) for rid in with_state]
    assert all(state["frozen"] for state in states)
    again = store.freeze_many(ids[:4], read=False)
    assert [f.snapshot_id for f in again] == [state["snapshot_id"] for state in states]


def test_a_batch_costs_one_fsync_per_state_file_and_one_per_directory(step, monkeypatch):
    store, ids = step
    real_fsync = os.fsync
    counts = {"file": 0, "dir": 0}

    def fsync(fd: int) -> None:
        counts["dir" if is_dir(fd) else "file"] += 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.freeze_many(ids, read=False)
    assert counts == {"file": len(ids), "dir": 1}
    counts.update(file=0, dir=0)
    again = store.freeze_many(ids, read=False)  # frozen already: nothing to write
    assert all(isinstance(f, FrozenCapture) for f in again)
    assert counts == {"file": 0, "dir": 1}


def test_a_busy_rollout_is_frozen_without_holding_the_others_locks(step):
    store, ids = step
    busy = ids[5]
    fd = os.open(store.paths(busy).lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(store.freeze_many(ids, read=False)))
    with no_hang(30):
        try:
            worker.start()
            deadline = time.monotonic() + 20
            others = [rid for rid in ids if rid != busy]
            while time.monotonic() < deadline and not all(store.paths(rid).state.exists() for rid in others):
                time.sleep(0.01)
            assert all(store.paths(rid).state.exists() for rid in others), "the others were not frozen"
            # The batch waits for the busy rollout alone: every other lock is free meanwhile.
            time.sleep(0.05)
            assert worker.is_alive() and not result
            assert [rid for rid in others if not lock_is_free(store, rid)] == []
        finally:
            os.close(fd)
        worker.join()
    frozen = result[0]
    assert [f.rollout_id for f in frozen] == ids
    assert all(isinstance(f, FrozenCapture) for f in frozen)


def test_a_batch_with_an_id_twice_gives_that_rollout_one_snapshot(step):
    store, ids = step
    frozen = store.freeze_many([ids[0], ids[1], ids[0], "not/valid"], read=False)
    assert isinstance(frozen[0], FrozenCapture) and isinstance(frozen[2], FrozenCapture)
    assert (frozen[0].snapshot_id, frozen[0].version) == (frozen[2].snapshot_id, frozen[2].version)
    assert isinstance(frozen[3], str) and frozen[3].startswith("ValueError:")


def test_a_batch_larger_than_a_chunk_freezes_every_rollout(tmp_path):
    store = TokenCaptureStore(tmp_path / "captures")
    ids = [f"big{i:03d}" for i in range(150)]
    for rid in ids:
        write_plain(store.directory, rid, calls=1)
    frozen = store.freeze_many(ids, read=True)
    assert [f.rollout_id for f in frozen] == ids
    assert all(f.size == len(f.data) > 0 for f in frozen)
    assert all(store.lifecycle(rid).frozen for rid in ids)
