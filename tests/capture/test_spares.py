"""Spare files: a training step's freezes rename files made between steps instead of creating them.

What users rely on: a step's freezes are exactly what they are without spares (same
states, same rows, as durable); a spare becomes a rollout's lock file or state file only
where that file would have been created, never replacing one; a spare that is gone, or
not a plain empty file, or a file system that cannot rename without replacing, only
means the file is created as before; spares are never listed, watched or built; and
they do not outlive the process that made them (its exit, or the sweep after a kill).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import raycap
from raycap.capture import spares as spares_module
from raycap.capture.spares import SPARE_PREFIX, SparePool, Spares, remove_stale
from raycap.capture.store import TokenCaptureStore
from raycap.cluster.rebuild.scheduler import BatchScheduler
from raycap.cluster.rebuild.session import session
from test_task import step_dir, steps_shared, two_calls, unmasked


def spare_names(directory: Path) -> set[str]:
    return {name for name in os.listdir(directory) if name.startswith(SPARE_PREFIX)}


def inode(path: Path) -> int:
    return os.lstat(path).st_ino


def filled_pool(directory: Path, rollouts: int) -> SparePool:
    pool = SparePool(str(directory))
    pool.refill(rollouts)
    pool.settle()
    return pool


def freeze_with(store: TokenCaptureStore, ids: list[str], spares: Spares | None):
    freezing = store.freezing(ids, read=True, spares=spares)
    return freezing.finish()


def test_a_pool_makes_hidden_empty_spares_with_the_modes_of_the_files_they_become(tmp_path):
    pool = filled_pool(tmp_path, 3)
    names = spare_names(tmp_path)
    assert len(names) == 6
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        info = os.lstat(tmp_path / name)
        assert stat.S_ISREG(info.st_mode) and info.st_size == 0
        mode = 0o666 & ~umask if ".lock." in name else 0o600
        assert stat.S_IMODE(info.st_mode) == mode, (name, oct(info.st_mode))
    # A store lists none of them as a rollout.
    assert TokenCaptureStore(tmp_path, create=False).rollout_ids() == []
    taken = pool.take(2)
    assert len(taken.locks) == 2 and len(taken.temps) == 2
    assert len(pool.take(5).locks) == 1  # only what is left


def test_freezes_made_from_spares_are_the_freezes_made_without_and_use_the_spares_inodes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with_spares, ids = step_dir(tmp_path / "a", history=0, fresh=5)
    without, _ = step_dir(tmp_path / "b", history=0, fresh=5)
    pool = filled_pool(with_spares, 5)
    inodes = {inode(with_spares / name) for name in spare_names(with_spares)}

    made = freeze_with(TokenCaptureStore(with_spares, create=False), ids, pool.take(5))
    plain = freeze_with(TokenCaptureStore(without, create=False), ids, None)

    assert [(f.rollout_id, f.data, f.incomplete) for f in made] == [(f.rollout_id, f.data, f.incomplete) for f in plain]
    for rid in ids:
        # Every lock file and state file of the step is a spare renamed into place.
        assert inode(with_spares / f"{rid}.tokens.lock") in inodes
        assert inode(with_spares / f"{rid}.tokens.state.json") in inodes
    assert spare_names(with_spares) == set()
    assert sorted(os.listdir(with_spares)) == sorted(os.listdir(without))  # no other file appeared or stayed
    store = TokenCaptureStore(with_spares, create=False)
    for rid in ids:
        assert store.lifecycle(rid).frozen


def test_a_lock_file_that_is_there_is_never_replaced_and_its_spare_stays(tmp_path):
    directory, ids = step_dir(tmp_path, history=0, fresh=1)
    lock = directory / f"{ids[0]}.tokens.lock"
    lock.write_bytes(b"")
    before = inode(lock)
    pool = filled_pool(directory, 1)
    spares = pool.take(1)

    freeze_with(TokenCaptureStore(directory, create=False), ids, spares)

    assert inode(lock) == before
    assert len(spares.locks) == 1 and (directory / spares.locks[0]).exists()  # for the next rollout
    assert spares.temps == []  # the state file's temp file was the spare


def test_a_spare_that_is_gone_or_not_a_plain_empty_file_means_the_file_is_made_as_before(tmp_path):
    directory, ids = step_dir(tmp_path, history=0, fresh=3)
    pool = filled_pool(directory, 3)
    spares = pool.take(3)
    os.unlink(directory / spares.locks[-1])  # another holder took it
    os.unlink(directory / spares.temps[-1])
    os.unlink(directory / spares.temps[-2])
    os.mkfifo(directory / spares.temps[-2])  # forged: a FIFO must not be waited on or written
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    os.unlink(directory / spares.temps[0])
    os.symlink(outside, directory / spares.temps[0])  # forged: a link is never followed
    os.unlink(directory / spares.locks[0])
    os.symlink(outside, directory / spares.locks[0])  # never moved into a lock file's place

    frozen = freeze_with(TokenCaptureStore(directory, create=False), ids, spares)

    assert all(not isinstance(f, str) for f in frozen), frozen
    assert outside.read_bytes() == b""
    assert all(stat.S_ISREG(os.lstat(directory / f"{rid}.tokens.lock").st_mode) for rid in ids)
    store = TokenCaptureStore(directory, create=False)
    assert all(store.lifecycle(rid).frozen for rid in ids)
    # Nothing forged is left under a temp file's name either.
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_a_file_system_that_cannot_rename_without_replacing_gets_its_lock_files_made(tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=0, fresh=2)
    spares = filled_pool(directory, 2).take(2)

    def unsupported(source, target):
        raise OSError(errno.EINVAL, "not supported here")

    monkeypatch.setattr(spares_module, "rename_noreplace", unsupported)
    frozen = freeze_with(TokenCaptureStore(directory, create=False), ids, spares)

    assert all(not isinstance(f, str) for f in frozen), frozen
    assert spares.locks == []  # not tried again for the rest of the batch
    assert all((directory / f"{rid}.tokens.lock").exists() for rid in ids)


def test_handed_out_spares_not_used_go_back_and_close_removes_every_spare(tmp_path):
    pool = filled_pool(tmp_path, 4)
    handed = pool.take(4)
    os.unlink(tmp_path / handed.temps[0])  # used by a freeze
    pool.refill(4)
    pool.settle()
    names = spare_names(tmp_path)
    assert len(names) == 8 and set(handed.locks) <= names and set(handed.temps[1:]) <= names
    pool.close()
    assert spare_names(tmp_path) == set()
    pool.refill(4)  # a closed pool makes no more
    pool.settle()
    assert spare_names(tmp_path) == set()


def test_a_step_stops_the_refill_under_way_and_the_next_refill_goes_on(tmp_path, monkeypatch):
    started, stepped = threading.Event(), threading.Event()
    make = SparePool._make

    def slow_make(pool, kind):
        started.set()
        stepped.wait(10)  # the first creation lasts until the step has begun
        return make(pool, kind)

    monkeypatch.setattr(SparePool, "_make", slow_make)
    pool = SparePool(str(tmp_path))
    pool.refill(100)
    assert started.wait(10)
    pool.take(4)  # a step begins: its freezes must not wait behind 200 creations
    stepped.set()
    pool.settle(10)
    assert len(spare_names(tmp_path)) == 1  # only the creation already under way
    pool.refill(4)  # the step is over: the pool is made up to the largest step seen
    pool.settle(10)
    assert len(spare_names(tmp_path)) == 200


def test_a_spare_made_while_the_process_exits_is_removed_too(tmp_path, monkeypatch):
    started, exiting = threading.Event(), threading.Event()
    make = SparePool._make

    def slow_make(pool, kind):
        started.set()
        exiting.wait(10)  # the process's exit removes the pool's spares meanwhile
        return make(pool, kind)

    monkeypatch.setattr(SparePool, "_make", slow_make)
    pool = SparePool(str(tmp_path))
    pool.refill(3)
    assert started.wait(10)
    pool._held.release()  # what the pool's finalizer runs at the process's exit
    exiting.set()
    pool.settle(10)
    assert spare_names(tmp_path) == set()


def test_a_directory_where_no_spare_can_be_made_gets_none_until_it_can(tmp_path):
    missing = tmp_path / "gone"
    pool = SparePool(str(missing))
    pool.refill(4)
    pool.settle()
    spares = pool.take(4)
    assert spares.locks == [] and spares.temps == []
    missing.mkdir()  # room again (a full disk freed, say): the next step's refill makes them
    pool.refill(4)
    pool.settle()
    assert len(spare_names(missing)) == 8


def test_spares_do_not_outlive_the_process_that_made_them(tmp_path):
    # The process makes 16 spares, then a fork of it exits the normal way (its exit
    # handlers run) before the process counts them again and exits itself.
    code = (
        "import os, sys\nfrom raycap.capture.spares import SparePool\n"
        "pool = SparePool(sys.argv[1]); pool.refill(8); pool.settle()\n"
        "count = lambda: len([n for n in os.listdir(sys.argv[1]) if n.startswith('.raycap-spare.')])\n"
        "print(count())\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    sys.exit(0)\n"
        "os.waitpid(pid, 0)\nprint(count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["16", "16"]
    assert spare_names(tmp_path) == set()


def test_the_sweep_removes_the_old_spares_of_a_killed_process_and_keeps_young_ones(tmp_path):
    directory, ids = step_dir(tmp_path, history=0, fresh=1)
    old = directory / f"{SPARE_PREFIX}lock.0123456789abcdef"
    young = directory / f"{SPARE_PREFIX}temp.fedcba9876543210"
    old.write_bytes(b"")
    young.write_bytes(b"")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))

    TokenCaptureStore(directory, create=False).sweep_retired(older_than_seconds=600)

    assert not old.exists() and young.exists()
    assert remove_stale(directory, time.time() + 1) == 1 and not young.exists()
    assert (directory / f"{ids[0]}.tokens.jsonl").exists()


@pytest.mark.slow
def test_a_step_on_ray_freezes_with_the_spares_made_after_the_step_before(ray_shared, tmp_path):
    directory, ids = step_dir(tmp_path, history=20, fresh=128)
    rebuilder = raycap.Rebuilder([str(directory)], executor="ray")
    assert unmasked(rebuilder.rebuild(ids[:64])) == ids[:64]
    rebuilder.settle()
    spare_inodes = {inode(directory / name) for name in spare_names(directory)}
    assert len(spare_inodes) == 128  # a lock file and a temp file for each of 64 fresh ids

    step = ids[64:]
    table = rebuilder.rebuild(step)

    assert unmasked(table) == step
    # Every rollout of the step, whether frozen here or by a builder task, got its lock
    # file and its state file from the spares.
    used = {inode(directory / f"{rid}.tokens.{kind}") for rid in step for kind in ("lock", "state.json")}
    assert used <= spare_inodes and len(used) == 128
    # Its rows are those of the same rollouts rebuilt without spares, elsewhere.
    copy = tmp_path / "copy"
    copy.mkdir()
    for rid in step:
        (copy / f"{rid}.tokens.jsonl").write_bytes((directory / f"{rid}.tokens.jsonl").read_bytes())
    plain = raycap.rebuild([str(copy)], step, executor="local")
    same = ["rollout_id", "mask_sample", "error", "n_calls", "token_ids", "loss_mask", "logprobs", "call_ids", "snapshot_version"]
    assert table.select(same).equals(plain.select(same))
    rebuilder.settle()
    assert len(spare_names(directory)) == 128  # made again for the next step

    # Closing the Rebuilder removes them, and the directory can go at once.
    with rebuilder:
        pass
    assert spare_names(directory) == set()
    shutil.rmtree(directory)


def test_a_step_on_the_local_executor_freezes_with_the_spares_made_after_the_step_before(tmp_path):
    directory, ids = step_dir(tmp_path, history=5, fresh=40)
    with raycap.Rebuilder([str(directory)], executor="local") as rebuilder:
        assert unmasked(rebuilder.rebuild(ids[:20])) == ids[:20]
        rebuilder.settle()
        spare_inodes = {inode(directory / name) for name in spare_names(directory)}
        assert len(spare_inodes) == 40

        assert unmasked(rebuilder.rebuild(ids[20:])) == ids[20:]

        used = {inode(directory / f"{rid}.tokens.{kind}") for rid in ids[20:] for kind in ("lock", "state.json")}
        assert used <= spare_inodes and len(used) == 40
        rebuilder.settle()
        assert len(spare_names(directory)) == 40
        # A call that is no training step (every rollout listed) takes none.
        spares_now = {inode(directory / name) for name in spare_names(directory)}
        late = [f"late{i}" for i in range(3)]
        for i, rid in enumerate(late):
            (directory / f"{rid}.tokens.jsonl").write_bytes(two_calls(rid, 500 + i))
        assert len(rebuilder.rebuild()) == 48
        assert {inode(directory / f"{rid}.tokens.lock") for rid in late}.isdisjoint(spares_now)
        assert {inode(directory / name) for name in spare_names(directory)} == spares_now
    assert spare_names(directory) == set()


@pytest.mark.slow
def test_raycap_rebuild_makes_no_file_its_caller_did_not_ask_for(ray_shared, tmp_path):
    directory, ids = step_dir(tmp_path, history=0, fresh=24)
    for part in (ids[:8], ids[8:16], ids[16:]):  # three steps on the cached session, on Ray
        assert unmasked(raycap.rebuild([str(directory)], part, executor="ray")) == part
        session([str(directory)]).settle()
    assert spare_names(directory) == set()
    shutil.rmtree(directory)


@pytest.mark.slow
def test_a_builder_task_that_dies_after_freezing_with_spares_is_retried_and_its_rows_are_right(
    fresh_ray, tmp_path, monkeypatch
):
    import ray

    from raycap.cluster.plumbing import task as builder_task

    fresh_ray()
    directory, ids = step_dir(tmp_path, history=10, fresh=128)
    steps_shared(monkeypatch)
    flag = str(tmp_path / "died")

    def dies_once_after_building(*args):
        built = builder_task.build_one_batch(*args)
        if not os.path.exists(flag):
            open(flag, "w").close()
            os._exit(1)  # the worker is lost after its freezes were made from spares
        return built

    rebuilder = raycap.Rebuilder([str(directory)], executor="ray")
    assert unmasked(rebuilder.rebuild(ids[:64])) == ids[:64]
    rebuilder.settle()
    spare_inodes = {inode(directory / name) for name in spare_names(directory)}
    faulty = ray.remote(num_cpus=1, max_retries=builder_task.TASK_MAX_RETRIES)(dies_once_after_building)
    monkeypatch.setattr(builder_task, "build_batch_task", faulty)
    real_build_here = BatchScheduler._build_here

    def after_the_task_died(self, batch):
        # This process builds a task's batch itself if the task has not started by then:
        # here it waits until the task has built its batch and died.
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_build_here(self, batch)

    monkeypatch.setattr(BatchScheduler, "_build_here", after_the_task_died)

    step = ids[64:]
    table = rebuilder.rebuild(step)

    assert os.path.exists(flag), "no builder task ran, so none died"
    assert unmasked(table) == step
    used = {inode(directory / f"{rid}.tokens.{kind}") for rid in step for kind in ("lock", "state.json")}
    assert used <= spare_inodes and len(used) == 128
    store = TokenCaptureStore(directory, create=False)
    # The retry froze nothing again: every row's snapshot is the one on disk.
    for rid, snapshot in zip(step, table.column("snapshot_id").to_pylist()):
        assert store.lifecycle(rid).snapshot_id == snapshot
    rebuilder.settle()
    assert len(spare_names(directory)) == 128
    rebuilder.close()
    assert spare_names(directory) == set()
