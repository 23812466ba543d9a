"""A training step's cost: its own ids, frozen durably, built while the disk commits.

A trainer rebuilds the rollouts that just finished on every step, with a `Rebuilder`
kept across steps. What keeps that step cheap, without making it any less safe:
- a builder task builds its batch from the bytes read under the freezes' locks while
  their state files are fsynced, and hands no row out before every freeze is durable
  (a state file that fails to become durable masks its rollout alone);
- the fsync threads are kept by the process, not started for every batch;
- a capture no writer indexed is parsed once, by the freeze that indexes it, and the
  build takes those records; the index and rows are those of a line-by-line reading;
- the step touches only its own rollouts' files, so it costs the same whatever the
  directory's history, and 64 ids are one batch per CPU with no freeze round trip
  through the directory's actor: this process builds one of them (the directory is on
  its node) while builder tasks build the others; a larger call is left to the tasks.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
import threading
import time
from pathlib import Path

import pytest
import ray

import raycap
from raycap.capture import consumer
from raycap.capture.consumer import build_frozen
from raycap.capture.records import TokenEntry, entry_line
from raycap.capture.store import FrozenCapture, TokenCaptureStore
from raycap.cluster.plumbing import task as builder_task
from raycap.cluster.rebuild.scheduler import BatchScheduler
from raycap.cluster.rebuild.step_split import StepSplit
from raycap.rows import batch as batch_module
from raycap.rows.claims import new_claim
from raycap.rows.options import RebuildOptions

# How long a held state-file fsync waits for the batch's build to start: far longer than
# freezing a dozen small rollouts takes, short enough that a build that waits for the
# fsyncs fails the test in seconds.
FSYNC_HOLD_S = 5.0


def two_calls(rollout_id: str, seed: int = 0) -> bytes:
    """A small two-call rollout as a writer without an index leaves it: JSONL only,
    the second prompt extending the first call (prompt, generation, tool output)."""
    first = list(range(seed + 1, seed + 30))
    lines = [
        TokenEntry(rollout_id=rollout_id, model_call_id=f"{rollout_id}-c1", prompt_token_ids=first,
                   generation_token_ids=[7, 8, 9], generation_log_probs=[-0.5, -0.25, -0.125]),
        TokenEntry(rollout_id=rollout_id, model_call_id=f"{rollout_id}-c2",
                   prompt_token_ids=[*first, 7, 8, 9, 40, 41], generation_token_ids=[5], generation_log_probs=[-1.0]),
    ]
    return b"".join(entry_line(entry) + b"\n" for entry in lines)


def step_dir(tmp_path: Path, *, history: int, fresh: int) -> tuple[Path, list[str]]:
    """A capture directory with `history` frozen-before rollouts and `fresh` new ones."""
    directory = tmp_path / "captures"
    directory.mkdir()
    for i in range(history):
        (directory / f"h{i:04d}.tokens.jsonl").write_bytes(two_calls(f"h{i:04d}", i))
    if history:
        TokenCaptureStore(directory, create=False).freeze_many([f"h{i:04d}" for i in range(history)], read=False)
    ids = [f"s{i:02d}" for i in range(fresh)]
    for i, rid in enumerate(ids):
        (directory / f"{rid}.tokens.jsonl").write_bytes(two_calls(rid, 100 + i))
    return directory, ids


def is_dir(fd: int) -> bool:
    return stat.S_ISDIR(os.fstat(fd).st_mode)


def build_here(directory: Path, ids: list[str]):
    """What a step's builder task runs on the directory's node: it freezes its batch itself."""
    here = ray.get_runtime_context().get_node_id()
    source = builder_task.Source(str(directory), str(directory), here, None)
    return builder_task.build_one_batch(0, ids, [source], None, RebuildOptions(), None).table


def unmasked(table) -> list[str]:
    return [rid for rid, masked in zip(table.column("rollout_id").to_pylist(), table.column("mask_sample").to_pylist())
            if not masked]


# -- built while durable ------------------------------------------------------------------------


def test_a_step_batch_is_built_while_its_state_files_are_fsynced_and_handed_out_once_durable(
    ray_shared, tmp_path, monkeypatch
):
    directory, ids = step_dir(tmp_path, history=0, fresh=12)
    events: list[str] = []
    build_started = threading.Event()
    real_fsync, real_build = os.fsync, batch_module.build_batch

    def fsync(fd: int) -> None:
        if is_dir(fd):
            real_fsync(fd)
            events.append("directory fsynced")
            return
        build_started.wait(FSYNC_HOLD_S)
        real_fsync(fd)
        events.append("state file fsynced")

    def build_batch(*args, **kwargs):
        events.append("build started")
        build_started.set()
        return real_build(*args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(batch_module, "build_batch", build_batch)
    table = build_here(directory, ids)

    assert unmasked(table) == ids
    assert events.count("state file fsynced") == len(ids) and events.count("directory fsynced") == 1, events
    first_fsync = events.index("state file fsynced")
    assert events.index("build started") < first_fsync, (
        f"the batch was built only after its state files were fsynced ({events}): the build does not overlap the disk"
    )
    # And nothing was handed out before every state file and the directory were fsynced.
    assert events[-1] == "directory fsynced", events
    assert all(TokenCaptureStore(directory, create=False).lifecycle(rid).frozen for rid in ids)


def test_a_state_file_that_fails_to_become_durable_masks_its_rollout_alone(ray_shared, tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=0, fresh=8)
    failing = ids[3]
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if f".{failing}.tokens.state.json." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(5, "Input/output error (injected)")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    table = build_here(directory, ids)

    assert table.column("rollout_id").to_pylist() == ids
    assert unmasked(table) == [rid for rid in ids if rid != failing]
    error = table.column("error").to_pylist()[3]
    assert error.startswith("OSError") and "injected" in error, error
    store = TokenCaptureStore(directory, create=False)
    assert not store.lifecycle(failing).frozen  # its state never replaced the old one
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


# -- what a batch costs -------------------------------------------------------------------------


def test_the_fsync_threads_are_kept_across_batches(tmp_path, monkeypatch):
    from raycap.capture import freezebatch

    directory, ids = step_dir(tmp_path, history=0, fresh=24)
    store = TokenCaptureStore(directory, create=False)
    store.freeze_many(ids[:12], read=False)  # the process's first batch may start them
    # The pool starts its threads as jobs find none idle, up to FSYNC_THREADS: all of
    # them, as some batch in a long-lived process would have.
    gate = threading.Barrier(freezebatch.FSYNC_THREADS)
    for job in [freezebatch._syncer().submit(gate.wait, 30) for _ in range(freezebatch.FSYNC_THREADS)]:
        job.result()
    started: list[str] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    frozen = store.freeze_many(ids[12:], read=False)
    assert all(isinstance(f, FrozenCapture) for f in frozen)
    assert started == [], f"a batch of {len(ids) - 12} freezes started threads {started}"


def test_a_step_batch_fsyncs_each_state_file_once_and_its_directory_once(ray_shared, tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=20, fresh=16)
    counts = {"file": 0, "directory": 0}
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        counts["directory" if is_dir(fd) else "file"] += 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert unmasked(build_here(directory, ids)) == ids
    # The spec's one state file per freeze, durable; the directory once for the batch
    # (a rollout frozen alone costs a directory fsync of its own).
    assert counts == {"file": len(ids), "directory": 1}


def test_a_step_batch_touches_only_its_own_rollouts_files(ray_shared, tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=300, fresh=16)
    touched: list[str] = []
    listed: list[str] = []

    def recording(name: str, real, listing: bool = False):
        def call(path, *args, **kwargs):
            text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
            if listing:
                listed.append(f"{name}({text})")
            elif os.path.dirname(text) == str(directory):
                touched.append(os.path.basename(text))
            return real(path, *args, **kwargs)

        return call

    for name in ("open", "lstat", "stat", "unlink", "replace", "rename"):
        monkeypatch.setattr(os, name, recording(name, getattr(os, name)))
    for name in ("scandir", "listdir"):
        monkeypatch.setattr(os, name, recording(name, getattr(os, name), listing=True))
    table = build_here(directory, ids)

    assert unmasked(table) == ids
    assert listed == [], f"a step listed the directory: {listed}"

    def owner(name: str) -> str:
        stem = name.lstrip(".")
        return stem[: stem.index(".tokens.")] if ".tokens." in stem else name

    others = sorted({name for name in touched if owner(name) not in ids})
    assert others == [], f"a step of {len(ids)} fresh ids touched other rollouts' files: {others[:10]}"


def steps_shared(monkeypatch) -> None:
    """Every step of the calls that follow is shared with builder tasks, whichever way
    was faster so far (StepSplit would also time steps built alone)."""
    real = StepSplit.task_ids

    def task_ids(self, n: int, tasks: int) -> int:
        self.pace, self.steps = {}, 0  # no way timed yet: the first is to share
        return real(self, n, tasks)

    monkeypatch.setattr(StepSplit, "task_ids", task_ids)


def record_batches(monkeypatch) -> tuple[list[int], list[list[str]]]:
    """The sizes of the batches handed to builder tasks, and the ids of those this
    process built itself, in the calls that follow."""
    submitted: list[int] = []
    here: list[list[str]] = []
    real_submit, real_here = BatchScheduler._submit, BatchScheduler._build_here

    def submit(self, batch):
        submitted.append(len(batch.ids))
        return real_submit(self, batch)

    def build_here(self, batch):
        here.append(list(batch.ids))
        return real_here(self, batch)

    monkeypatch.setattr(BatchScheduler, "_submit", submit)
    monkeypatch.setattr(BatchScheduler, "_build_here", build_here)
    return submitted, here


def test_a_step_of_64_ids_is_a_batch_per_cpu_one_built_here_with_no_freeze_round_trip(ray_shared, tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=0, fresh=128)
    steps_shared(monkeypatch)
    rebuilder = raycap.Rebuilder([str(directory)], executor="ray")
    assert unmasked(rebuilder.rebuild(ids[:64])) == ids[:64]  # placement and actors, found once

    def no_freeze_ahead(self, start, stop):
        raise AssertionError("a step on one node froze through the directory's actor before building")

    submitted, here = record_batches(monkeypatch)
    monkeypatch.setattr(BatchScheduler, "_freeze_ahead", no_freeze_ahead)
    step = ids[64:]
    assert unmasked(rebuilder.rebuild(step)) == step
    cpus = int(ray.cluster_resources()["CPU"])
    # The directory is on this process's node: this process builds the first batch while
    # builder tasks build the others, one batch per CPU in all. A task's batch waits for
    # Ray to start it and to ship its rows back, so this process takes at least an even
    # share (how much more, the steps before measured: StepSplit).
    assert here[0] == step[: len(here[0])] and len(here[0]) >= len(step) // cpus, here
    assert len(submitted) == cpus - 1 and sum(submitted) + len(here[0]) == len(step), (submitted, here)
    # Any other batch built here is a task's whole batch, claimed before its task started.
    assert all(len(batch) in submitted for batch in here[1:]), (submitted, here)


def test_a_call_of_more_batches_than_cpus_is_left_to_builder_tasks(ray_shared, tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=0, fresh=64)
    batch_size = 4
    rebuilder = raycap.Rebuilder([str(directory)], executor="ray", batch_size=batch_size)
    assert unmasked(rebuilder.rebuild(ids[:2])) == ids[:2]
    submitted, here = record_batches(monkeypatch)
    assert int(ray.cluster_resources()["CPU"]) < len(ids) // batch_size

    assert unmasked(rebuilder.rebuild(ids)) == ids
    assert here == [] and submitted == [batch_size] * (len(ids) // batch_size)


def test_a_directory_this_process_cannot_see_is_left_to_builder_tasks(ray_shared, tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=0, fresh=64)
    rebuilder = raycap.Rebuilder([str(directory)], executor="ray")
    assert unmasked(rebuilder.rebuild(ids[:2])) == ids[:2]
    submitted, here = record_batches(monkeypatch)
    # This process sees the node's paths elsewhere (another mount, say); its workers do not.
    monkeypatch.setattr(builder_task, "local_path", lambda path: str(tmp_path / "not-mounted-here" / Path(path).name))

    assert unmasked(rebuilder.rebuild(ids)) == ids
    assert here == [] and sum(submitted) == len(ids)


def test_a_batch_that_fails_as_a_whole_here_masks_its_rollouts_alone(ray_shared, tmp_path, monkeypatch, caplog):
    directory, ids = step_dir(tmp_path, history=0, fresh=64)
    rebuilder = raycap.Rebuilder([str(directory)], executor="ray")
    assert unmasked(rebuilder.rebuild(ids[:2])) == ids[:2]
    submitted, here = record_batches(monkeypatch)

    def fails(*args, **kwargs):
        raise MemoryError("no memory left for the batch")

    # Only this process's build fails: builder tasks run the module's own function.
    monkeypatch.setattr(builder_task, "build_one_batch", fails)
    table = rebuilder.rebuild(ids)

    assert table.column("rollout_id").to_pylist() == ids
    # Every batch this process built fails: its own, and any it claimed before its task started.
    failed = {rid for batch in here for rid in batch}
    assert unmasked(table) == [rid for rid in ids if rid not in failed]
    for rid, error in zip(ids, table.column("error").to_pylist()):
        if rid in failed:
            assert "no memory left for the batch" in error and "this process built the batch" in error, error
    assert any(here[0][0] in record.getMessage() for record in caplog.records), "the log names no rollout"


# -- parsed once --------------------------------------------------------------------------------


def test_a_small_capture_no_writer_indexed_is_parsed_once_by_its_freeze_and_build(tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=0, fresh=3)
    store = TokenCaptureStore(directory, create=False)
    frozen = store.freeze_many(ids, read=False, read_below=1 << 20)
    assert all(isinstance(f, FrozenCapture) and len(f.data) == f.size for f in frozen)
    # What another process gets: the identity and bytes, no records.
    shipped = [pickle.loads(pickle.dumps(f)) for f in frozen]
    assert shipped == frozen

    parses: list[int] = []
    real_parse = consumer.parse_records

    def parse_records(data, **kwargs):
        parses.append(len(data))
        return real_parse(data, **kwargs)

    monkeypatch.setattr(consumer, "parse_records", parse_records)
    built = [build_frozen(f.rollout_id, [(str(directory), f)]).to_build() for f in frozen]
    assert parses == [], f"the build parsed again the {len(parses)} captures its freezes had just parsed"
    elsewhere = [build_frozen(f.rollout_id, [(str(directory), f)]).to_build() for f in shipped]
    assert len(parses) == len(ids)  # shipped freezes carry bytes only
    assert built == elsewhere and not any(b["mask_sample"] for b in built)


def test_a_small_capture_no_writer_indexed_is_read_once_by_its_freeze(tmp_path, monkeypatch):
    """The bytes a freeze indexes and parses are the bytes it hands out: one read of the
    file, not one to index it and another for the freeze."""
    from raycap.capture import files

    directory, ids = step_dir(tmp_path, history=0, fresh=3)
    reads: list[tuple[int, int]] = []
    real_pread = files.os.pread

    def pread(fd, size, offset):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).endswith(".tokens.jsonl"):
            reads.append((size, offset))
        return real_pread(fd, size, offset)

    monkeypatch.setattr(files.os, "pread", pread)
    frozen = TokenCaptureStore(directory, create=False).freeze_many(ids, read=False, read_below=1 << 20)
    sizes = [(directory / f"{rid}.tokens.jsonl").stat().st_size for rid in ids]
    assert reads == [(size, 0) for size in sizes]
    assert [f.data for f in frozen] == [(directory / f"{rid}.tokens.jsonl").read_bytes() for rid in ids]
    assert all(f.take_parsed() for f in frozen)


def test_read_at_reads_to_the_end_of_a_file_that_grew_past_short_reads_and_the_largest_read(tmp_path, monkeypatch):
    from raycap.capture import files

    path = tmp_path / "data"
    data = bytes(range(256)) * 1000
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert files.read_at(fd, -1) == data
        assert files.read_at(fd, 10, 250) == data[250:260]
        assert files.read_at(fd, 10, len(data) - 3) == data[-3:]
        assert files.read_at(fd, -1, len(data) + 5) == b"" and files.read_at(fd, 0) == b""
        # The file grew after its size was taken: read on to its end.
        real_fstat = os.fstat
        monkeypatch.setattr(files.os, "fstat", lambda f: os.stat_result((0,) * 6 + (100,) + (0,) * 3) if f == fd else real_fstat(f))
        assert files.read_at(fd, -1) == data
        monkeypatch.undo()
        # Linux reads at most so much in one call: the rest comes in further calls.
        monkeypatch.setattr(files, "_MAX_READ", 4096)
        assert files.read_at(fd, -1) == data and files.read_at(fd, 10_000, 7) == data[7:10_007]
        monkeypatch.undo()
        # A file system that gives short reads before the end (FUSE, say) is read on from.
        real_pread = os.pread
        monkeypatch.setattr(files.os, "pread", lambda f, n, at: real_pread(f, min(n, 333), at))
        assert files.read_at(fd, -1) == data and files.read_at(fd, 10_000, 7) == data[7:10_007]
    finally:
        os.close(fd)


def _more_calls(rollout_id: str) -> bytes:
    return two_calls(rollout_id, 5).replace(b"-c1", b"-c3").replace(b"-c2", b"-c4")


@pytest.mark.parametrize(
    ("data", "calls"),
    [
        (two_calls("r1") + _more_calls("r1"), 4),
        (two_calls("r1") + b"\n  \n\r\n" + _more_calls("r1").rstrip(b"\n"), 4),
        (two_calls("r1") + b'{"generation_log_probs": [-0.5', 2),
    ],
    ids=["plain", "blank-lines-and-no-last-newline", "torn-last-line"],
)
def test_indexing_a_capture_whole_or_line_by_line_gives_the_same_index_and_file(tmp_path, data, calls):
    """A freeze that keeps its records (a small capture) indexes it exactly as one that
    reads it line by line: the newline it adds to a last line without one, the torn
    last line it cuts off."""
    states, files = [], []
    for way, read_below in (("kept", 1 << 20), ("line-by-line", 0)):
        directory = tmp_path / way
        directory.mkdir()
        (directory / "r1.tokens.jsonl").write_bytes(data)
        (frozen,) = TokenCaptureStore(directory, create=False).freeze_many(["r1"], read=False, read_below=read_below)
        assert isinstance(frozen, FrozenCapture), frozen
        state = json.loads((directory / "r1.tokens.state.json").read_bytes())
        state.pop("snapshot_id")
        states.append(state)
        files.append((directory / "r1.tokens.jsonl").read_bytes())
    assert states[0] == states[1] and files[0] == files[1]
    assert files[0].endswith(b"\n") and len(states[0]["entry_digests"]) == calls


def test_a_freezes_state_temp_file_is_private_and_never_takes_an_existing_name(tmp_path, monkeypatch):
    """A batch of freezes makes one temp file per rollout without mkstemp; it must keep
    mkstemp's guarantees: a new hidden name readable by its owner only, and a name that
    is taken (a leftover, or a link planted there) is passed over, never written."""
    from raycap.capture import files

    target = tmp_path / "r1.tokens.state.json"
    taken = tmp_path / f".{target.name}.{bytes(6).hex()}.tmp"
    taken.write_bytes(b"someone else's")
    planted = tmp_path / f".{target.name}.{bytes([1] * 6).hex()}.tmp"
    planted.symlink_to(tmp_path / "elsewhere")
    draws = iter([bytes(6), bytes([1] * 6), bytes([2] * 6)])
    monkeypatch.setattr(files.os, "urandom", lambda n: next(draws))
    fd, temp = files.temp_beside(target, b'{"frozen": true}')
    os.close(fd)
    assert Path(temp) == tmp_path / f".{target.name}.{bytes([2] * 6).hex()}.tmp"
    assert Path(temp).read_bytes() == b'{"frozen": true}'
    assert stat.S_IMODE(os.stat(temp).st_mode) == 0o600
    assert taken.read_bytes() == b"someone else's" and not (tmp_path / "elsewhere").exists()

    monkeypatch.setattr(files.os, "urandom", lambda n: bytes(6))
    with pytest.raises(FileExistsError, match="no free temp file name beside .*r1.tokens.state.json"):
        files.temp_beside(target, b"{}")


# -- a step's batch shared with this process ----------------------------------------------------


def test_a_task_that_lost_its_batchs_claim_builds_nothing_and_one_that_took_it_builds_it(ray_shared, tmp_path):
    directory, ids = step_dir(tmp_path, history=0, fresh=8)
    here = ray.get_runtime_context().get_node_id()
    source = builder_task.Source(str(directory), str(directory), here, None)
    lost = new_claim()
    assert lost.take()  # the submitter built the batch itself

    answer = builder_task.build_one_batch(0, ids, [source], None, RebuildOptions(), None, None, lost)

    assert answer.rows is None
    assert sorted(os.listdir(directory)) == sorted(f"{rid}.tokens.jsonl" for rid in ids), "a lost batch was frozen"
    taken = builder_task.build_one_batch(0, ids, [source], None, RebuildOptions(), None, None, new_claim())
    assert unmasked(taken.rows.table) == ids


def test_a_shared_batch_whose_task_answered_without_rows_is_built_here(ray_shared, tmp_path, monkeypatch):
    directory, ids = step_dir(tmp_path, history=0, fresh=72)
    steps_shared(monkeypatch)
    rebuilder = raycap.Rebuilder([str(directory)], executor="ray")
    assert unmasked(rebuilder.rebuild(ids[:8])) == ids[:8]

    def claimed_nothing(*args):
        # As a task that ran where the claim is not visible, or a retry after an
        # attempt that took the claim and died.
        return builder_task.SharedRows(None, time.time())

    monkeypatch.setattr(builder_task, "build_batch_task", ray.remote(num_cpus=1)(claimed_nothing))
    submitted, here = record_batches(monkeypatch)
    step = ids[8:]
    table = rebuilder.rebuild(step)

    assert unmasked(table) == step and submitted
    assert [rid for batch in here for rid in batch] == step
    assert table.equals(raycap.Rebuilder([str(directory)], executor="local").rebuild(step))
