"""Capture directories as a hostile user or a faulty machine leaves them.

A capture file that is a symbolic link, FIFO, socket, device or directory masks its
rollout with a one-line reason; nothing is ever read, written, truncated, created or
deleted through it, and no such entry can hang a freeze, a listing or a rebuild. Ids
that path normalisation would change are invalid. A capture over `max_capture_bytes`
is masked without being read.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import raycap
from hang import no_hang
from raycap.capture.records import TokenEntry, entry_line
from raycap.capture.store import (
    CaptureFileError,
    CaptureTooLarge,
    TokenCaptureStore,
    validate_rollout_id,
)
from raycap.cli.jobconfig import RebuildJobConfig
from raycap.rows.batch import MAX_CAPTURE_BYTES

REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = ("jsonl", "state", "lock", "intents", "incomplete", "retired")


def make_entry(rollout_id: str = "r1", call_id: str = "c1") -> TokenEntry:
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        prompt_token_ids=[1, 2, 3],
        generation_token_ids=[7, 8],
        generation_log_probs=[-0.5, -0.25],
    )


def snapshot_of(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `path` with its size and mtime (links not followed)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            info = os.lstat(full)
            out[os.path.relpath(full, path)] = (info.st_size, info.st_mtime_ns)
    return out


@pytest.fixture
def store(tmp_path: Path) -> TokenCaptureStore:
    return TokenCaptureStore(tmp_path / "captures")


def make_entry_of(path: Path, kind: str, elsewhere: Path) -> None:
    """Put a non-regular entry of `kind` at `path` (any file there is replaced)."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "symlink":
        os.symlink(elsewhere, path)
    elif kind == "dangling symlink":
        os.symlink(elsewhere.parent / "nothing-here", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "device":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("creating a device node needs privileges this run lacks")
    else:
        raise AssertionError(kind)


KIND_TEXT = {
    "symlink": "a symbolic link",
    "dangling symlink": "a symbolic link",
    "fifo": "a FIFO",
    "directory": "a directory",
    "socket": "a socket",
    "device": "a character device",
}


# -- symbolic links: nothing written through them ---------------------------------------


@pytest.mark.parametrize(
    "victim_bytes",
    [b"this line is not JSON", entry_line(make_entry("sym"))],
    ids=["torn-looking target", "target without a final newline"],
)
def test_a_symlinked_jsonl_is_masked_and_its_target_never_touched(store, tmp_path, victim_bytes):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(victim_bytes)
    before = snapshot_of(victim)
    os.symlink(victim, store.paths("sym").jsonl)

    with pytest.raises(CaptureFileError) as caught:
        store.freeze_raw("sym")
    with pytest.raises(CaptureFileError):
        store.append(make_entry("sym", "c2"))

    message = str(caught.value)
    assert "'sym'" in message and store.paths("sym").jsonl.name in message and "is a symbolic link" in message
    assert "\n" not in message
    assert snapshot_of(victim) == before
    # The rollout was not frozen: no state file was written for it.
    assert not store.paths("sym").state.exists()


@pytest.mark.parametrize("which", ["lock", "retired", "intents", "incomplete", "jsonl", "state"])
def test_a_dangling_link_never_creates_a_file_at_its_target(store, tmp_path, which):
    store.append(make_entry("r1"))
    target = tmp_path / f"target-of-{which}"
    path = getattr(store.paths("r1"), which)
    if path.exists():
        path.unlink()
    os.symlink(target, path)

    for operation in (
        lambda: store.append(make_entry("r1", "c2")),
        lambda: store.begin_call_now("r1", "c3"),
        lambda: store.mark_incomplete_now("r1", "c4"),
        lambda: store.freeze_raw("r1"),
    ):
        try:
            operation()
        except CaptureFileError:
            pass
        assert not os.path.lexists(target), which
    assert os.path.islink(path)


def test_drop_through_a_dangling_retired_link_refuses_and_keeps_the_capture(store, tmp_path):
    store.append(make_entry("r1"))
    frozen = store.freeze_raw("r1")
    target = tmp_path / "retired-target"
    os.symlink(target, store.paths("r1").retired)

    with pytest.raises(CaptureFileError, match="retired"):
        store.drop_now("r1", snapshot_id=frozen.snapshot_id, version=frozen.version)

    assert not os.path.lexists(target)
    assert store.paths("r1").jsonl.exists() and not json.loads(store.paths("r1").state.read_bytes())["retired"]


# -- every non-regular kind, every file: masked, never a hang ----------------------------


@pytest.mark.parametrize("which", FILES)
@pytest.mark.parametrize("kind", list(KIND_TEXT))
def test_a_non_regular_capture_file_fails_the_freeze_with_its_kind_and_never_hangs(store, tmp_path, kind, which):
    store.append(make_entry("r1"))
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_bytes(b'{"not": "a record"}\n')
    before = snapshot_of(elsewhere)
    path = getattr(store.paths("r1"), which)
    make_entry_of(path, kind, elsewhere)

    with no_hang():
        with pytest.raises(CaptureFileError) as caught:
            store.freeze_raw("r1")
        assert store.rollout_ids() == ["r1"]
        store.rollout_ids(skip_retired=True)
        store.held(["r1"])
        store.held(["r1"], skip_retired=True)

    assert str(caught.value) == (
        f"rollout 'r1': capture file {path.name} is {KIND_TEXT[kind]} (capture files must be regular files; "
        + (
            "replace the link with the file it points to)"
            if "symlink" in kind
            else "move it out of the capture directory, or delete() the rollout)"
        )
    )
    assert snapshot_of(elsewhere) == before
    assert not os.path.lexists(tmp_path / "nothing-here")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["state", "intents", "jsonl", "lock"])
def test_a_fifo_among_a_rollouts_files_never_hangs_a_rebuild(tmp_path, which):
    data = tmp_path / "data"
    store = TokenCaptureStore(data)
    store.append(make_entry("ok"))
    store.append(make_entry("victim"))
    make_entry_of(getattr(store.paths("victim"), which), "fifo", tmp_path)
    script = textwrap.dedent(
        f"""
        import raycap
        rows = raycap.rebuild([{str(data)!r}], ["ok", "victim"], executor="local").to_pylist()
        print([(r["rollout_id"], r["mask_sample"], (r["error"] or "").split(":")[0]) for r in rows])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=90,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[('ok', False, ''), ('victim', True, 'CaptureFileError')]"


# -- rebuild: the masked row and its neighbours -------------------------------------------


def test_rebuild_masks_symlinked_and_fifo_captures_and_leaves_other_rows_unchanged(tmp_path):
    data = tmp_path / "data"
    store = TokenCaptureStore(data)
    for rid in ("a", "b"):
        store.append(make_entry(rid))
    alone = raycap.rebuild([str(data)], ["a", "b"], executor="local").to_pylist()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not json")
    before = snapshot_of(victim)
    os.symlink(victim, store.paths("sym").jsonl)
    os.mkfifo(store.paths("fifo").state)

    with no_hang(60):
        rows = raycap.rebuild([str(data)], ["a", "sym", "fifo", "b"], executor="local").to_pylist()

    by_id = {row["rollout_id"]: row for row in rows}
    assert [r["rollout_id"] for r in rows] == ["a", "sym", "fifo", "b"]
    assert by_id["sym"]["mask_sample"] and by_id["sym"]["error"].startswith(
        f"CaptureFileError: rollout 'sym': capture file {store.paths('sym').jsonl.name} is a symbolic link"
    )
    assert by_id["fifo"]["mask_sample"] and by_id["fifo"]["error"].startswith(
        f"CaptureFileError: rollout 'fifo': capture file {store.paths('fifo').state.name} is a FIFO"
    )
    assert [by_id["a"], by_id["b"]] == alone
    assert snapshot_of(victim) == before


def test_rebuild_on_ray_masks_a_symlinked_capture_alone(ray_shared, tmp_path):
    data = tmp_path / "data"
    store = TokenCaptureStore(data)
    store.append(make_entry("a"))
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not json")
    before = snapshot_of(victim)
    os.symlink(victim, store.paths("sym").jsonl)
    alone = raycap.rebuild([str(data)], ["a"], executor="local").to_pylist()

    rows = raycap.rebuild([str(data)], ["sym", "a"], executor="ray").to_pylist()
    limited = raycap.rebuild([str(data)], ["a"], executor="ray", max_capture_bytes=10).to_pylist()

    assert rows[0]["rollout_id"] == "sym" and rows[0]["mask_sample"]
    assert rows[0]["error"].startswith(
        f"CaptureFileError: rollout 'sym': capture file {store.paths('sym').jsonl.name} is a symbolic link"
    )
    assert rows[1:] == alone
    assert snapshot_of(victim) == before
    assert limited[0]["error"].startswith("CaptureTooLarge: rollout 'a'") and "max_capture_bytes=10;" in limited[0]["error"]


# -- rollout ids that path normalisation would change ------------------------------------


@pytest.mark.parametrize("bad", [".", "..", "...", 123, b"r1", None])
def test_ids_made_of_dots_and_non_string_ids_are_invalid(store, bad):
    with pytest.raises(ValueError, match="Invalid rollout id") as caught:
        validate_rollout_id(bad)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="Invalid rollout id"):
        store.paths(bad)
    with pytest.raises(ValueError, match="Invalid rollout id"):
        store.freeze_raw(bad)
    assert list(store.directory.iterdir()) == []


@pytest.mark.parametrize("bad", [".", ".."])
def test_append_refuses_an_entry_whose_id_would_leave_the_directory(store, bad):
    entry = make_entry("r1").model_copy(update={"rollout_id": bad})
    with pytest.raises(ValueError, match="Invalid rollout id"):
        store.append(entry)
    assert list(store.directory.iterdir()) == []
    assert sorted(p.name for p in store.directory.parent.iterdir()) == ["captures"]


@pytest.mark.parametrize("rid", [".hidden", "a.", "a..b", "-", "_"])
def test_every_capture_file_is_named_inside_the_directory_exactly_as_the_format_says(store, rid):
    suffixes = (".tokens.jsonl", ".tokens.state.json", ".tokens.lock", ".tokens.intents", ".tokens.incomplete",
                ".tokens.retired")
    for path, suffix in zip(store.paths(rid), suffixes):
        name = rid + suffix
        assert str(path) == os.path.join(str(store.directory), name)
        assert os.path.basename(path) == name and os.path.normpath(path) == str(path)


def test_rebuild_of_id_dot_creates_nothing_beside_the_directory(tmp_path):
    data = tmp_path / "data"
    TokenCaptureStore(data).append(make_entry("ok"))
    before = tree(tmp_path)

    rows = raycap.rebuild([str(data)], ["."], executor="local").to_pylist()

    assert tree(tmp_path) == before
    assert rows[0]["mask_sample"] and rows[0]["error"].startswith("ValueError: Invalid rollout id: '.'")


def test_a_run_over_a_subdirectory_with_id_dot_never_touches_the_parents_capture(tmp_path):
    data = tmp_path / "data"
    TokenCaptureStore(data).append(make_entry("run1"))
    run1 = data / "run1"
    TokenCaptureStore(run1).append(make_entry("ok"))
    before = tree(tmp_path)

    rows = raycap.rebuild([str(run1)], [".", "ok"]).to_pylist()

    assert [r["mask_sample"] for r in rows] == [True, False]
    def outside_run1(entries: dict) -> dict:
        return {k: v for k, v in entries.items() if not k.startswith("data/run1")}

    assert outside_run1(tree(tmp_path)) == outside_run1(before)
    assert (data / "run1.tokens.jsonl").read_bytes() == entry_line(make_entry("run1")) + b"\n"


def test_a_non_string_id_among_good_ids_is_its_own_masked_row(tmp_path):
    data = tmp_path / "data"
    TokenCaptureStore(data).append(make_entry("ok-id"))
    alone = raycap.rebuild([str(data)], ["ok-id"], executor="local").to_pylist()
    for executor in ("local", "auto"):
        rows = raycap.rebuild([str(data)], ["ok-id", 123], executor=executor).to_pylist()
        assert rows[0] == alone[0]
        assert rows[1]["rollout_id"] == "123" and rows[1]["mask_sample"]
        assert rows[1]["error"].startswith("ValueError: Invalid rollout id: 123")
    assert sorted(os.listdir(data)) == ["ok-id.tokens.jsonl", "ok-id.tokens.lock", "ok-id.tokens.state.json"]


def test_an_invalid_id_masks_only_its_own_row_with_several_directories(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    TokenCaptureStore(one).append(make_entry("a"))
    TokenCaptureStore(two).append(make_entry("b"))

    rows = raycap.rebuild([str(one), str(two)], ["a", "..", "b"], executor="local").to_pylist()

    assert [(r["rollout_id"], r["mask_sample"]) for r in rows] == [("a", False), ("..", True), ("b", False)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


# -- bounded memory: the size limit ------------------------------------------------------


def test_a_capture_over_max_capture_bytes_is_masked_naming_the_limit_and_other_rows_are_unchanged(tmp_path):
    data = tmp_path / "data"
    store = TokenCaptureStore(data)
    store.append(make_entry("small"))
    for i in range(20):
        store.append(make_entry("big", f"c{i}"))
    assert store.paths("small").jsonl.stat().st_size < 1000 < store.paths("big").jsonl.stat().st_size
    alone = raycap.rebuild([str(data)], ["small"], executor="local").to_pylist()
    state_before = store.paths("big").state.read_bytes()

    rows = raycap.rebuild([str(data)], ["big", "small"], executor="local", max_capture_bytes=1000).to_pylist()

    size = store.paths("big").jsonl.stat().st_size
    assert rows[0]["mask_sample"] and rows[0]["error"] == (
        f"CaptureTooLarge: rollout 'big': capture file {store.paths('big').jsonl.name} is {size} bytes, more than "
        "max_capture_bytes=1000; raise max_capture_bytes (the rebuild keyword or job config key) to build it"
    )
    assert rows[1] == alone[0]
    # Judged before anything changed: the big rollout was not frozen.
    assert store.paths("big").state.read_bytes() == state_before
    # Without a limit it builds (its calls share one prompt, so it is masked for "roots", not for size).
    unlimited = raycap.rebuild([str(data)], ["big"], executor="local", max_capture_bytes=None).to_pylist()[0]
    assert unlimited["error"] is None and unlimited["n_calls"] == 20


def test_the_store_refuses_a_capture_over_max_bytes_before_reading_it(store):
    for i in range(5):
        store.append(make_entry("r1", f"c{i}"))
    with pytest.raises(CaptureTooLarge, match="max_capture_bytes=100;"):
        store.freeze_raw("r1", max_bytes=100)
    assert [isinstance(f, str) and f.startswith("CaptureTooLarge:") for f in store.freeze_many(["r1"], max_bytes=100)] == [True]
    assert store.freeze_raw("r1", max_bytes=10_000).size == store.paths("r1").jsonl.stat().st_size


def test_the_default_limit_is_one_gib_and_a_job_config_key_sets_it(tmp_path):
    assert MAX_CAPTURE_BYTES == 1 << 30
    fields = RebuildJobConfig.model_fields
    assert fields["max_capture_bytes"].default == MAX_CAPTURE_BYTES
    with pytest.raises(ValueError, match="max_capture_bytes"):
        raycap.rebuild([str(tmp_path)], [], executor="local", max_capture_bytes=0)


def test_a_sparse_three_gib_capture_is_masked_quickly_without_being_read(tmp_path):
    data = tmp_path / "data"
    TokenCaptureStore(data).append(make_entry("ok"))
    big = data / "huge.tokens.jsonl"
    with open(big, "wb") as handle:
        handle.truncate(3 << 30)
    script = textwrap.dedent(
        f"""
        import resource, time
        import raycap
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.monotonic()
        rows = raycap.rebuild([{str(data)!r}], ["huge", "ok"], executor="local").to_pylist()
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grown, time.monotonic() - started, rows[0]["error"], rows[1]["mask_sample"], sep="|")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=90,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stderr
    grown_kib, seconds, error, ok_masked = done.stdout.strip().split("|")
    assert int(grown_kib) < 200 * 1024
    assert float(seconds) < 20
    assert error.startswith(f"CaptureTooLarge: rollout 'huge': capture file {big.name} is {3 << 30} bytes")
    assert f"max_capture_bytes={1 << 30}" in error
    assert ok_masked == "False"
    assert big.stat().st_size == 3 << 30 and big.stat().st_blocks == 0


def test_the_rebuild_job_path_passes_max_capture_bytes_to_the_builders(tmp_path):
    import pyarrow.parquet as pq

    from raycap.runs.handoff import rebuild_to_output

    data = tmp_path / "data"
    store = TokenCaptureStore(data)
    store.append(make_entry("small"))
    for i in range(20):
        store.append(make_entry("big", f"c{i}"))

    rebuild_to_output([str(data)], tmp_path / "out", ["big", "small"], executor="local", max_capture_bytes=1000)

    rows = {r["rollout_id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert rows["big"]["error"].startswith("CaptureTooLarge: rollout 'big'")
    assert rows["small"]["error"] is None


# -- the write side's bound ----------------------------------------------------------------


def test_the_store_refuses_a_record_that_would_take_a_capture_over_its_limit_and_writes_nothing(tmp_path):
    store = TokenCaptureStore(tmp_path / "captures", max_capture_bytes=3 * len(entry_line(make_entry("r1", "c0"))) + 3)
    for i in range(3):
        store.append(make_entry("r1", f"c{i}"))
    paths = store.paths("r1")
    before = (paths.jsonl.read_bytes(), paths.state.read_bytes())
    with pytest.raises(CaptureTooLarge) as caught:
        store.append(make_entry("r1", "c3"))
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert "rollout 'r1'" in message and f"max_capture_bytes={store.max_capture_bytes}" in message
    assert (paths.jsonl.read_bytes(), paths.state.read_bytes()) == before
    assert not paths.incomplete.exists()
    # The capture is intact: it freezes with its three records, and other rollouts still write.
    assert len(store.freeze_now("r1").entries) == 3
    store.append(make_entry("r2", "c0"))


def test_the_async_put_is_bounded_like_append(tmp_path):
    import asyncio

    store = TokenCaptureStore(tmp_path / "captures", max_capture_bytes=len(entry_line(make_entry("r1"))) + 1)
    asyncio.run(store.put(make_entry("r1", "c0")))
    with pytest.raises(CaptureTooLarge, match="max_capture_bytes="):
        asyncio.run(store.put(make_entry("r1", "c1")))
    assert [e.model_call_id for e in store.read_entries("r1")] == ["c0"]


def test_the_write_limit_defaults_to_the_read_limit_and_refuses_without_reading_the_capture(tmp_path):
    store = TokenCaptureStore(tmp_path / "captures")
    assert store.max_capture_bytes == MAX_CAPTURE_BYTES
    assert TokenCaptureStore(tmp_path / "captures", max_capture_bytes=None).max_capture_bytes is None
    big = store.paths("big").jsonl
    with open(big, "wb") as handle:
        handle.truncate(MAX_CAPTURE_BYTES - 10)  # sparse: refusing it must not read it
    started = time.monotonic()
    with pytest.raises(CaptureTooLarge, match=f"rollout 'big'.*max_capture_bytes={MAX_CAPTURE_BYTES}"):
        store.append(make_entry("big"))
    assert time.monotonic() - started < 5
    assert big.stat().st_size == MAX_CAPTURE_BYTES - 10 and big.stat().st_blocks == 0
