"""Tests for raycap.capture.store: the capture-directory format, its locks and its lifecycle; names it
never takes for rollouts (hidden and temporary files), files it did not write (a damaged state
file), and the retired markers a sweep by either tool leaves behind."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pydantic
import pytest

import raycap
import raycap.capture.store
from collection import _append_rollout
from raycap.capture.files import MAX_ROLLOUT_ID_LENGTH
from raycap.capture.markers import CommitMarker
from raycap.capture.protocols import TokenSink, TokenSource
from raycap.capture.recordfile import KeptRecord
from raycap.capture.records import TokenEntry, entry_line, line_digest
from raycap.capture.store import (
    FrozenCapture,
    TokenCaptureStore,
    validate_rollout_id,
)
from raycap.runs.stream import Stream
from test_consumer import BAD_LINE, CORRUPT, _corrupt
from test_stream import write
from test_untrusted import _nested

REPO_ROOT = Path(__file__).resolve().parents[2]
STATE_KEYS = {"frozen", "retired", "incomplete", "snapshot_id", "version", "entry_digests", "indexed_size"}


def make_entry(rollout_id: str = "r1", call_id: str = "c1", *, gen: int = 7, **extra) -> TokenEntry:
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        prompt_token_ids=[1, 2, 3],
        generation_token_ids=[gen, gen + 1],
        generation_log_probs=[-0.5, -0.25],
        **extra,
    )


def line_of(entry: TokenEntry) -> bytes:
    return entry_line(entry) + b"\n"


def read_state(store: TokenCaptureStore, rollout_id: str) -> dict:
    return json.loads(store.paths(rollout_id).state.read_bytes())


@pytest.fixture
def store(tmp_path: Path) -> TokenCaptureStore:
    return TokenCaptureStore(tmp_path / "captures")


# -- format and round trip ------------------------------------------------------------------


def test_append_then_freeze_round_trips_entries_in_file_order(store):
    first, second = make_entry(call_id="b", gen=1), make_entry(call_id="a", gen=2, extra_field={"k": 1})
    store.append(first)
    asyncio.run(store.put(second))

    paths = store.paths("r1")
    assert paths.jsonl.read_bytes() == line_of(first) + line_of(second)
    state = read_state(store, "r1")
    assert set(state) == STATE_KEYS
    assert paths.state.read_bytes() == json.dumps(state, sort_keys=True).encode()
    assert state["version"] == 2 and state["indexed_size"] == paths.jsonl.stat().st_size
    assert state["entry_digests"] == {
        "b": line_digest(entry_line(first)),
        "a": line_digest(entry_line(second)),
    }

    snap = store.freeze_now("r1")
    assert snap.entries == (first, second)
    assert snap.entries[1].model_extra == {"extra_field": {"k": 1}}
    assert (snap.rollout_id, snap.incomplete, snap.version) == ("r1", False, 3)
    assert len(snap.snapshot_id) == 32 and int(snap.snapshot_id, 16) >= 0
    state = read_state(store, "r1")
    assert (state["frozen"], state["snapshot_id"], state["version"]) == (True, snap.snapshot_id, 3)


def test_freeze_raw_returns_the_indexed_bytes_unparsed(store):
    store.append(make_entry(call_id="c1"))
    store.append(make_entry(call_id="c2"))
    raw = store.freeze_raw("r1")
    assert isinstance(raw, FrozenCapture)
    assert raw.data == store.paths("r1").jsonl.read_bytes()
    snap = store.freeze_now("r1")
    assert (raw.snapshot_id, raw.version, raw.incomplete) == (snap.snapshot_id, snap.version, snap.incomplete)


def test_identical_duplicate_is_a_noop(store):
    store.append(make_entry())
    before = (store.paths("r1").jsonl.read_bytes(), read_state(store, "r1"))
    store.append(make_entry())
    assert (store.paths("r1").jsonl.read_bytes(), read_state(store, "r1")) == before
    assert len(store.freeze_now("r1").entries) == 1


def test_conflicting_duplicate_marks_incomplete_and_raises(store):
    store.append(make_entry(gen=1))
    with pytest.raises(ValueError, match="reused with a different payload") as info:
        store.append(make_entry(gen=2))
    assert "'r1'" in str(info.value)
    state = read_state(store, "r1")
    assert state["incomplete"] is True and state["version"] == 2
    assert store.paths("r1").incomplete.read_bytes() == b"c1\n"
    assert store.paths("r1").jsonl.read_bytes() == line_of(make_entry(gen=1))
    snap = store.freeze_now("r1")
    assert snap.incomplete and [e.generation_token_ids for e in snap.entries] == [[1, 2]]


def test_unknown_state_keys_are_kept(store):
    store.paths("r1").state.write_text(json.dumps({"frozen": False, "writer_note": "x"}))
    store.append(make_entry())
    assert read_state(store, "r1")["writer_note"] == "x"


# -- index sync -----------------------------------------------------------------------------


@pytest.mark.parametrize("torn", [b'{"created_at": 0.0, "generation_lo', b'{"created_at": 0.0, "gen\n'])
def test_torn_final_line_is_truncated_with_a_warning(store, caplog, torn):
    store.append(make_entry(call_id="c1"))
    store.append(make_entry(call_id="c2"))
    path = store.paths("r1").jsonl
    good = path.read_bytes()
    with path.open("ab") as handle:
        handle.write(torn)
    with caplog.at_level(logging.WARNING, logger="raycap.capture.store"):
        snap = store.freeze_now("r1")
    assert [e.model_call_id for e in snap.entries] == ["c1", "c2"]
    assert path.read_bytes() == good
    assert read_state(store, "r1")["version"] == 3  # the torn line was never an entry
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'r1'" in m and str(path) in m for m in messages), messages


def test_torn_line_inside_a_multibyte_character_is_truncated(store, caplog):
    store.append(make_entry(call_id="c1"))
    path = store.paths("r1").jsonl
    good = path.read_bytes()
    with path.open("ab") as handle:
        handle.write('{"model": "caf\u00e9"'.encode()[:-1])
    with caplog.at_level(logging.WARNING, logger="raycap.capture.store"):
        store.append(make_entry(call_id="c2"))
    assert path.read_bytes() == good + line_of(make_entry(call_id="c2"))
    assert caplog.records


def test_corrupt_middle_line_makes_freeze_raise_json_decode_error(store):
    store.append(make_entry(call_id="c1"))
    path = store.paths("r1").jsonl
    with path.open("ab") as handle:
        handle.write(b"{not json\n" + line_of(make_entry(call_id="c2")))
    before = path.read_bytes()
    with pytest.raises(json.JSONDecodeError) as info:
        store.freeze_now("r1")
    assert type(info.value).__name__ == "JSONDecodeError"
    assert str(info.value) == "unexpected character, expected a string key: line 1 column 2 (char 1)"  # orjson's, as Gym's
    assert path.read_bytes() == before  # corruption is reported, never cut away
    with pytest.raises(json.JSONDecodeError):
        store.append(make_entry(call_id="c3"))


def test_tail_written_without_the_index_is_recovered_with_version_bumps(store):
    store.append(make_entry(call_id="c1"))
    path = store.paths("r1").jsonl
    with path.open("ab") as handle:
        # An external writer that died before updating the index; its last line also
        # lacks the newline.
        handle.write(line_of(make_entry(call_id="c2")) + entry_line(make_entry(call_id="c3")))
    store.append(make_entry(call_id="c4"))
    state = read_state(store, "r1")
    assert state["version"] == 4 and set(state["entry_digests"]) == {"c1", "c2", "c3", "c4"}
    assert path.read_bytes() == b"".join(line_of(make_entry(call_id=c)) for c in ("c1", "c2", "c3", "c4"))
    assert state["indexed_size"] == path.stat().st_size
    snap = store.freeze_now("r1")
    assert [e.model_call_id for e in snap.entries] == ["c1", "c2", "c3", "c4"] and snap.version == 5


def test_recovered_duplicate_of_an_indexed_line_is_counted_but_not_a_conflict(store):
    store.append(make_entry(call_id="c1"))
    with store.paths("r1").jsonl.open("ab") as handle:
        handle.write(line_of(make_entry(call_id="c1")))
    snap = store.freeze_now("r1")
    # append 1 + recovered tail entry 1 + freeze 1: every recovered entry bumps the version.
    assert snap.version == 3 and not snap.incomplete and len(snap.entries) == 2


def test_jsonl_without_a_state_file_is_an_empty_index_every_line_recovered(store):
    path = store.paths("r1").jsonl
    written = b"".join(line_of(make_entry(call_id=c)) for c in ("c1", "c2", "c3"))
    path.write_bytes(written[:-1])  # the last line lacks its newline
    snap = store.freeze_now("r1")
    # A missing state file is version 0 with an empty index: 3 recovered entries + freeze.
    assert snap.version == 4 and len(snap.entries) == 3
    # The recovered last line is terminated, so a later line cannot merge into it.
    assert path.read_bytes() == written
    assert read_state(store, "r1")["indexed_size"] == len(written)


def test_conflicting_payload_in_the_tail_marks_incomplete_and_raises(store):
    store.append(make_entry(call_id="c1", gen=1))
    with store.paths("r1").jsonl.open("ab") as handle:
        handle.write(line_of(make_entry(call_id="c1", gen=2)))
    with pytest.raises(ValueError, match="conflicting durable payloads"):
        store.freeze_now("r1")
    state = read_state(store, "r1")
    assert state["incomplete"] is True and state["version"] == 2 and state["frozen"] is False
    assert store.paths("r1").incomplete.read_bytes() == b"c1\n"


def test_index_beyond_the_file_size_is_an_error(store):
    store.append(make_entry(call_id="c1"))
    path = store.paths("r1").jsonl
    os.truncate(path, 10)
    with pytest.raises(ValueError, match="shorter than its index") as info:
        store.freeze_now("r1")
    assert path.name in str(info.value) and str(path) not in str(info.value)
    path.unlink()
    with pytest.raises(ValueError, match="shorter than its index"):
        store.append(make_entry(call_id="c2"))


def test_invalid_record_in_the_tail_fails_the_freeze_with_a_validation_error(store):
    store.paths("r1").jsonl.write_bytes(b'{"rollout_id": "r1", "model_call_id": "c1"}\n[1, 2]\n')
    with pytest.raises(pydantic.ValidationError):
        store.freeze_now("r1")
    # Tail records are validated as they are recovered: nothing was indexed or frozen.
    assert not store.paths("r1").state.exists()


def test_append_starts_a_fresh_line_after_an_indexed_unterminated_line(store):
    # Another writer indexed a complete line that lacks its newline.
    line = entry_line(make_entry(call_id="c1"))
    paths = store.paths("r1")
    paths.jsonl.write_bytes(line)
    state = {"entry_digests": {"c1": line_digest(line)}, "indexed_size": len(line), "version": 1}
    paths.state.write_text(json.dumps(state))
    store.append(make_entry(call_id="c2"))
    assert [e.model_call_id for e in store.freeze_now("r1").entries] == ["c1", "c2"]


# -- intents, incomplete, lifecycle ---------------------------------------------------------


def test_dangling_intent_makes_the_snapshot_incomplete(store):
    store.begin_call_now("r1", "c1")
    store.append(make_entry(call_id="c1"))
    store.begin_call_now("r2", "c1")
    store.begin_call_now("r2", "c2")
    store.append(make_entry("r2", "c1"))
    assert store.paths("r2").intents.read_bytes() == b"c1\nc2\n"
    assert store.freeze_now("r1").incomplete is False
    assert store.freeze_now("r2").incomplete is True
    assert read_state(store, "r2")["incomplete"] is False  # derived at freeze, not stored


def test_mark_incomplete_is_durable_and_bumps_the_version(store):
    store.append(make_entry(call_id="c1"))
    store.mark_incomplete_now("r1", "c2")
    store.mark_incomplete_now("r1")
    assert store.paths("r1").incomplete.read_bytes() == b"c2\n\n"
    state = read_state(store, "r1")
    assert state["incomplete"] is True and state["version"] == 3
    assert store.freeze_now("r1").incomplete is True


def test_frozen_rollout_refuses_appends_and_intents(store):
    store.append(make_entry(call_id="c1"))
    store.freeze_now("r1")
    with pytest.raises(RuntimeError, match="already frozen"):
        store.append(make_entry(call_id="c2"))
    with pytest.raises(RuntimeError, match="already frozen"):
        store.begin_call_now("r1", "c2")
    assert not store.paths("r1").intents.exists()
    assert [e.model_call_id for e in store.freeze_now("r1").entries] == ["c1"]


def test_freeze_is_idempotent_until_the_state_changes(store):
    store.append(make_entry(call_id="c1"))
    first = store.freeze_now("r1")
    second = store.freeze_now("r1")
    assert (first.snapshot_id, first.version) == (second.snapshot_id, second.version)
    assert second.entries == first.entries
    # A late failure report after the freeze is a change the consumer must see.
    store.mark_incomplete_now("r1", "c2")
    third = store.freeze_now("r1")
    assert third.snapshot_id == first.snapshot_id and third.version == first.version + 1
    assert third.incomplete
    assert store.drop_now("r1", snapshot_id=first.snapshot_id, version=first.version) is False


def test_freezing_an_unknown_rollout_creates_an_empty_frozen_state(store):
    snap = store.freeze_now("nothing")
    assert snap.entries == () and snap.version == 1 and not snap.incomplete
    state = read_state(store, "nothing")
    assert state["frozen"] is True and state["entry_digests"] == {} and state["indexed_size"] == 0


def test_retired_rollout_refuses_freeze_append_mark_and_intents(store):
    store.append(make_entry(call_id="c1"))
    snap = store.freeze_now("r1")
    assert store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version)
    for call in (
        lambda: store.freeze_now("r1"),
        lambda: store.freeze_raw("r1"),
        lambda: store.append(make_entry(call_id="c2")),
        lambda: store.mark_incomplete_now("r1", "c2"),
        lambda: store.begin_call_now("r1", "c2"),
    ):
        with pytest.raises(RuntimeError, match="retired") as info:
            call()
        assert str(info.value).startswith("Token capture for rollout r1 is retired")
    assert not store.paths("r1").jsonl.exists() and not store.paths("r1").incomplete.exists()


def test_drop_with_the_wrong_identity_changes_nothing(store):
    store.append(make_entry(call_id="c1"))
    store.begin_call_now("r1", "c1")
    assert store.drop_now("r1", snapshot_id="", version=1) is False  # not frozen yet
    snap = store.freeze_now("r1")
    paths = store.paths("r1")
    before = {p: p.read_bytes() for p in (paths.jsonl, paths.state, paths.intents)}
    assert store.drop_now("r1", snapshot_id="other", version=snap.version) is False
    assert store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version + 1) is False
    assert store.drop_now("unknown", snapshot_id=snap.snapshot_id, version=snap.version) is False
    assert {p: p.read_bytes() for p in before} == before


def test_drop_leaves_a_retired_tombstone(store):
    store.append(make_entry(call_id="c1"))
    store.begin_call_now("r1", "c2")
    store.mark_incomplete_now("r1", "c2")
    snap = store.freeze_now("r1")
    assert store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version) is True
    paths = store.paths("r1")
    assert not paths.jsonl.exists() and not paths.intents.exists() and not paths.incomplete.exists()
    assert paths.lock.exists()
    assert paths.retired.read_bytes() == b""  # the marker that lets listing skip it by name
    state = read_state(store, "r1")
    assert state == {
        "frozen": True,
        "retired": True,
        "incomplete": True,
        "snapshot_id": snap.snapshot_id,
        "version": snap.version,
        "entry_digests": {},
        "indexed_size": 0,
    }
    assert store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version) is True
    assert read_state(store, "r1") == state


def test_delete_removes_everything_but_the_lock_and_is_idempotent(store):
    store.append(make_entry(call_id="c1"))
    store.begin_call_now("r1", "c2")
    store.mark_incomplete_now("r1", "c2")
    store.freeze_now("r1")
    store.delete("r1")
    paths = store.paths("r1")
    assert [p for p in paths if p.exists()] == [paths.lock]
    store.delete("r1")
    store.delete("never-written")
    # The id can be dispatched again from a clean slate.
    store.append(make_entry(call_id="c1", gen=9))
    assert read_state(store, "r1")["version"] == 1


def test_delete_of_a_retired_rollout_removes_its_marker(store):
    store.append(make_entry(call_id="c1"))
    snap = store.freeze_now("r1")
    store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version)
    paths = store.paths("r1")
    assert paths.retired.exists()
    store.delete("r1")
    assert [p for p in paths if p.exists()] == [paths.lock]
    store.append(make_entry(call_id="c1"))
    assert store.rollout_ids(skip_retired=True) == ["r1"]


def test_sweep_removes_only_old_retired_tombstones(store):
    for rollout_id in ("old", "young", "live"):
        store.append(make_entry(rollout_id, "c1"))
    for rollout_id in ("old", "young"):
        snap = store.freeze_now(rollout_id)
        store.drop_now(rollout_id, snapshot_id=snap.snapshot_id, version=snap.version)
    store.freeze_now("live")
    an_hour_ago = time.time() - 3600
    for rollout_id in ("old", "live"):
        os.utime(store.paths(rollout_id).state, (an_hour_ago, an_hour_ago))

    assert store.sweep_retired(600) == 1
    assert not any(p.exists() for p in store.paths("old"))
    assert store.paths("young").state.exists() and store.paths("young").lock.exists()
    assert store.paths("live").jsonl.exists() and store.paths("live").state.exists()
    assert store.sweep_retired(600) == 0
    assert store.sweep_retired(0) == 1  # "young" is older than a zero cutoff


@pytest.mark.parametrize("bad", ["../x", "", "a/b", "\u00e9", "a b", "x\n", "/abs"])
def test_invalid_rollout_ids_are_refused_before_touching_the_file_system(tmp_path, bad):
    # The directory does not exist: any file-system access would raise FileNotFoundError.
    store = TokenCaptureStore(tmp_path / "missing", create=False)
    calls = [
        lambda: store.append(TokenEntry.model_construct(**{**make_entry().model_dump(), "rollout_id": bad})),
        lambda: store.mark_incomplete_now(bad, "c"),
        lambda: store.begin_call_now(bad, "c"),
        lambda: store.freeze_now(bad),
        lambda: store.freeze_raw(bad),
        lambda: store.drop_now(bad, snapshot_id="s", version=1),
        lambda: store.delete(bad),
        lambda: store.paths(bad),
        lambda: validate_rollout_id(bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="ASCII letters, digits") as info:
            call()
        assert repr(bad) in str(info.value)
    assert not (tmp_path / "missing").exists()
    assert validate_rollout_id("Ab.9_-x") == "Ab.9_-x"


def test_missing_directory_without_create_names_the_directory(tmp_path):
    store = TokenCaptureStore(tmp_path / "missing", create=False)
    with pytest.raises(FileNotFoundError, match="missing"):
        store.freeze_now("r1")


def test_rollout_ids_lists_rollouts_with_capture_files_but_not_cleared_ones(store):
    store.append(make_entry("with-entries", "c1"))
    store.begin_call_now("intent-only", "c1")
    store.mark_incomplete_now("incomplete-only", "c1")
    store.freeze_now("frozen-empty")
    store.append(make_entry("consumed", "c1"))
    snap = store.freeze_now("consumed")
    store.drop_now("consumed", snapshot_id=snap.snapshot_id, version=snap.version)
    store.append(make_entry("cleared", "c1"))
    store.delete("cleared")
    (store.directory / "bad id.tokens.jsonl").write_bytes(b"")
    (store.directory / "unrelated.txt").write_bytes(b"")
    # A retired tombstone is listed (freezing it says "retired"); a rollout cleared by
    # delete() keeps only its lock and is not.
    assert store.rollout_ids() == ["consumed", "frozen-empty", "incomplete-only", "intent-only", "with-entries"]


# -- crash-safe drop, the retired marker and cheap lookups ---------------------------------


class _Died(BaseException):
    """The process dying at an injected point: nothing after it runs, no handler catches it."""


def _die(*args, **kwargs):
    raise _Died


def _consumed(store: TokenCaptureStore, rollout_id: str = "r1"):
    """A frozen rollout with entries, an intent and an incomplete file, ready to drop."""
    store.begin_call_now(rollout_id, "c2")
    store.append(make_entry(rollout_id, "c1"))
    store.mark_incomplete_now(rollout_id, "c2")
    return store.freeze_now(rollout_id)


def _foreign_tombstone(store: TokenCaptureStore, rollout_id: str) -> None:
    """A retired state as another writer leaves it: no marker."""
    state = {"frozen": True, "retired": True, "incomplete": False, "snapshot_id": "s", "version": 2,
             "entry_digests": {}, "indexed_size": 0}
    store.paths(rollout_id).state.write_text(json.dumps(state))


def _count_calls(monkeypatch, owner, name: str) -> list:
    calls = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _assert_retired_with_leftovers(store: TokenCaptureStore, snap) -> None:
    paths = store.paths("r1")
    state = read_state(store, "r1")
    assert (state["retired"], state["snapshot_id"], state["version"]) == (True, snap.snapshot_id, snap.version)
    assert (state["indexed_size"], state["entry_digests"]) == (0, {})
    assert paths.jsonl.exists() and paths.intents.exists() and paths.incomplete.exists()
    assert paths.retired.exists()
    # Every path judges the rollout by its state: the leftovers are never handed out.
    for call in (
        lambda: store.freeze_now("r1"),
        lambda: store.freeze_raw("r1", read=False),
        lambda: store.append(make_entry(call_id="c3")),
        lambda: store.begin_call_now("r1", "c3"),
        lambda: store.mark_incomplete_now("r1", "c3"),
    ):
        with pytest.raises(RuntimeError, match="retired"):
            call()
    assert store.rollout_ids() == ["r1"]
    assert store.rollout_ids(skip_retired=True) == []
    assert store.held(["r1"]) == {"r1": paths.jsonl.stat().st_size}
    assert store.held(["r1"], skip_retired=True) == {}


def test_a_drop_that_dies_while_deleting_leaves_a_retired_rollout_with_leftovers(store, monkeypatch):
    snap = _consumed(store)
    with monkeypatch.context() as patched:
        patched.setattr(raycap.capture.store, "unlink_all", _die)
        with pytest.raises(_Died):
            store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version)
    _assert_retired_with_leftovers(store, snap)
    assert store.sweep_retired(0) == 1
    assert [p for p in store.paths("r1") if p.exists()] == []
    assert store.rollout_ids() == [] and store.held(["r1"]) == {}


def test_dropping_the_same_snapshot_again_finishes_an_interrupted_drop(store, monkeypatch):
    snap = _consumed(store)
    with monkeypatch.context() as patched:
        patched.setattr(raycap.capture.store, "unlink_all", _die)
        with pytest.raises(_Died):
            store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version)
    state = read_state(store, "r1")
    assert store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version) is True
    paths = store.paths("r1")
    assert sorted(p.name for p in paths if p.exists()) == ["r1.tokens.lock", "r1.tokens.retired", "r1.tokens.state.json"]
    assert read_state(store, "r1") == state


@pytest.mark.slow
def test_a_drop_killed_after_its_tombstone_leaves_a_retired_rollout_with_leftovers(store):
    snap = _consumed(store)
    # A real process death: no Python cleanup runs, the kernel releases the lock.
    code = textwrap.dedent("""
        import os, sys
        import raycap.capture.store
        raycap.capture.store.unlink_all = lambda paths: os._exit(17)
        store = raycap.capture.store.TokenCaptureStore(sys.argv[1])
        store.drop_now(sys.argv[2], snapshot_id=sys.argv[3], version=int(sys.argv[4]))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code, str(store.directory), "r1", snap.snapshot_id, str(snap.version)],
        cwd=REPO_ROOT, env=_child_env(), timeout=60,
    )
    assert done.returncode == 17
    _assert_retired_with_leftovers(store, snap)
    assert store.sweep_retired(0) == 1
    assert [p for p in store.paths("r1") if p.exists()] == []


def test_a_drop_that_dies_before_its_tombstone_leaves_the_snapshot_intact(store, monkeypatch):
    snap = _consumed(store)
    real_write = TokenCaptureStore._write_state

    def dies_on_the_tombstone(self, paths, state, *, durable):
        if state.retired:
            raise _Died
        return real_write(self, paths, state, durable=durable)

    with monkeypatch.context() as patched:
        patched.setattr(TokenCaptureStore, "_write_state", dies_on_the_tombstone)
        with pytest.raises(_Died):
            store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version)
    # The marker came first, but beside live data it settles nothing: the state does.
    assert store.paths("r1").retired.exists() and read_state(store, "r1")["retired"] is False
    assert store.rollout_ids(skip_retired=True) == ["r1"]
    assert store.held(["r1"], skip_retired=True) == {"r1": store.paths("r1").jsonl.stat().st_size}
    again = store.freeze_now("r1")
    assert (again.snapshot_id, again.version, again.entries) == (snap.snapshot_id, snap.version, snap.entries)
    assert store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version) is True
    assert store.rollout_ids(skip_retired=True) == []


def test_listing_skips_retired_rollouts_by_name_without_reading_or_stating(store, monkeypatch):
    for i in range(20):
        snap = _consumed(store, f"done-{i}")
        store.drop_now(f"done-{i}", snapshot_id=snap.snapshot_id, version=snap.version)
    for i in range(5):
        store.append(make_entry(f"live-{i}", "c1"))
    store.freeze_now("live-0")
    store.freeze_now("frozen-empty")  # a state file alone, not retired
    _foreign_tombstone(store, "foreign")  # a state file alone, retired, no marker
    (store.directory / "orphan.tokens.retired").write_bytes(b"")

    live = ["frozen-empty"] + [f"live-{i}" for i in range(5)]
    with monkeypatch.context() as patched:
        reads = _count_calls(patched, TokenCaptureStore, "_read_state")
        stats = _count_calls(patched, os, "stat")
        assert store.rollout_ids(skip_retired=True) == live
        # Only the two states without a marker, and nothing is stat'ed.
        assert sorted(args[1] for args in reads) == ["foreign", "frozen-empty"]
        assert stats == []
        reads.clear()
        everything = store.rollout_ids()
        assert reads == [] and stats == []
    assert everything == sorted(live + ["foreign"] + [f"done-{i}" for i in range(20)])


def test_a_marker_left_by_another_writers_delete_does_not_hide_the_next_attempt(store):
    snap = _consumed(store)
    store.drop_now("r1", snapshot_id=snap.snapshot_id, version=snap.version)
    # Another writer clears the id for re-dispatch without knowing the marker.
    paths = store.paths("r1")
    for path in (paths.jsonl, paths.state, paths.intents, paths.incomplete):
        path.unlink(missing_ok=True)
    assert paths.retired.exists()
    store.append(make_entry(call_id="c9"))
    assert store.rollout_ids(skip_retired=True) == ["r1"]
    assert store.held(["r1"], skip_retired=True) == {"r1": paths.jsonl.stat().st_size}
    # The sweep retires nothing here but drops the stale marker, so listing stops reading it.
    assert store.sweep_retired(0) == 0
    assert not paths.retired.exists() and paths.jsonl.exists() and paths.state.exists()
    assert [e.model_call_id for e in store.freeze_now("r1").entries] == ["c9"]


def test_a_marker_alone_is_not_a_rollout_and_the_sweep_removes_it(store):
    store.directory.joinpath("x.tokens.retired").write_bytes(b"")
    assert store.rollout_ids() == [] and store.rollout_ids(skip_retired=True) == []
    assert store.held(["x"]) == {} and store.held(["x"], skip_retired=True) == {}
    assert store.sweep_retired(0) == 0
    assert list(store.directory.iterdir()) == []


def test_sweep_reads_only_its_candidates_and_handles_tombstones_without_a_marker(store, monkeypatch):
    for i in range(2):
        snap = _consumed(store, f"done-{i}")
        store.drop_now(f"done-{i}", snapshot_id=snap.snapshot_id, version=snap.version)
    _foreign_tombstone(store, "foreign")
    for i in range(5):
        store.append(make_entry(f"live-{i}", "c1"))
        store.freeze_now(f"live-{i}")
    an_hour_ago = time.time() - 3600
    for state in store.directory.glob("*.tokens.state.json"):
        os.utime(state, (an_hour_ago, an_hour_ago))
    with monkeypatch.context() as patched:
        reads = _count_calls(patched, TokenCaptureStore, "_read_state")
        assert store.sweep_retired(600) == 3
    assert sorted(args[1] for args in reads) == ["done-0", "done-1", "foreign"]
    assert sorted({p.name.split(".")[0] for p in store.directory.iterdir()}) == [f"live-{i}" for i in range(5)]
    assert store.rollout_ids(skip_retired=True) == [f"live-{i}" for i in range(5)]


def test_held_reports_the_given_ids_this_directory_lists_with_their_jsonl_size(store):
    store.append(make_entry("with-entries", "c1"))
    store.begin_call_now("intent-only", "c1")
    store.mark_incomplete_now("incomplete-only", "c1")
    store.freeze_now("frozen-empty")
    snap = _consumed(store, "consumed")
    store.drop_now("consumed", snapshot_id=snap.snapshot_id, version=snap.version)
    _foreign_tombstone(store, "foreign")
    store.append(make_entry("cleared", "c1"))
    store.delete("cleared")
    asked = ["with-entries", "unknown", "cleared", "consumed", "foreign", "frozen-empty",
             "incomplete-only", "intent-only", "with-entries"]

    held = store.held(asked)
    assert list(held) == ["with-entries", "consumed", "foreign", "frozen-empty", "incomplete-only", "intent-only"]
    assert held["with-entries"] == store.paths("with-entries").jsonl.stat().st_size > 0
    assert all(size == 0 for rid, size in held.items() if rid != "with-entries")
    assert sorted(held) == store.rollout_ids()
    live = store.held(asked, skip_retired=True)
    assert sorted(live) == store.rollout_ids(skip_retired=True) == [
        "frozen-empty", "incomplete-only", "intent-only", "with-entries"
    ]
    assert store.held([]) == {}


def test_held_costs_a_few_stats_per_given_id_and_never_lists_the_directory(store, monkeypatch):
    for i in range(50):
        store.append(make_entry(f"r{i}", "c1"))
    snap = _consumed(store, "done")
    store.drop_now("done", snapshot_id=snap.snapshot_id, version=snap.version)
    with monkeypatch.context() as patched:
        patched.setattr(os, "scandir", _die)
        patched.setattr(os, "listdir", _die)
        reads = _count_calls(patched, TokenCaptureStore, "_read_state")
        stats = _count_calls(patched, os, "stat")
        held = store.held(["r3", "r7", "done", "missing"], skip_retired=True)
    assert list(held) == ["r3", "r7"]
    assert reads == [] and len(stats) <= 1 + 5 * 4


def test_held_refuses_invalid_ids_before_touching_the_file_system(tmp_path):
    store = TokenCaptureStore(tmp_path / "missing", create=False)
    with pytest.raises(ValueError, match="ASCII letters, digits"):
        store.held(["ok", "../x"])
    with pytest.raises(FileNotFoundError, match="missing"):
        store.held(["ok"])
    assert not (tmp_path / "missing").exists()


# -- the async protocols and imports --------------------------------------------------------


def test_the_store_is_its_own_async_sink_and_source(store):
    sink, source = store, TokenCaptureStore(store.root)
    assert isinstance(sink, TokenSink) and isinstance(source, TokenSource)

    async def scenario():
        await sink.begin_call("r1", "c2")
        await sink.put(make_entry(call_id="c1"))
        await sink.mark_incomplete("r1", "c3")
        await sink.close()
        snap = await source.freeze("r1")
        dropped = await source.drop("r1", snapshot_id=snap.snapshot_id, version=snap.version)
        await source.close()
        return snap, dropped

    snap, dropped = asyncio.run(scenario())
    assert [e.model_call_id for e in snap.entries] == ["c1"] and snap.incomplete and dropped
    assert read_state(store, "r1")["retired"] is True


@pytest.mark.slow
def test_importing_the_store_does_not_import_ray():
    code = "import sys, raycap.capture.store; sys.exit('ray' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=_child_env())


# -- interop with a writer in another process -----------------------------------------------

_ENTRY_SOURCE = """
def interop_entry(rollout_id, call_id):
    n = int(call_id[1:])
    # Lines of a few kilobytes, so a half-read line would show.
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        prompt_token_ids=list(range(n, n + 400 + n % 300)),
        generation_token_ids=[n, n + 1],
        generation_log_probs=[-0.5, -1.5],
    )
"""

_WRITER_SOURCE = """
import json, sys, time
from raycap.capture.records import TokenEntry
from raycap.capture.store import TokenCaptureStore
{entry_source}
directory, results, n_rollouts, deadline = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
store = TokenCaptureStore(directory)
active = [f"roll-{{i}}" for i in range(n_rollouts)]
n = 0
with open(results, "w") as out:
    while active and time.monotonic() < deadline:
        for rollout_id in list(active):
            n += 1
            call_id = f"c{{n}}"
            started = time.monotonic()
            try:
                store.append(interop_entry(rollout_id, call_id))
                error = None
            except Exception as exc:
                error = f"{{type(exc).__name__}}: {{exc}}"
                active.remove(rollout_id)
            out.write(json.dumps([rollout_id, call_id, started, error]) + "\\n")
            out.flush()
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_freezes_race_a_writer_in_another_process_without_losing_or_half_reading(tmp_path):
    namespace = {"TokenEntry": TokenEntry}
    exec(_ENTRY_SOURCE, namespace)
    interop_entry = namespace["interop_entry"]
    store = TokenCaptureStore(tmp_path / "captures")
    results = tmp_path / "results.jsonl"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER_SOURCE.format(entry_source=textwrap.dedent(_ENTRY_SOURCE)))
    rollouts = [f"roll-{i}" for i in range(20)]

    writer = subprocess.Popen(
        [sys.executable, str(script), str(store.directory), str(results), str(len(rollouts)),
         str(time.monotonic() + 20.0)],
        env=_child_env(),
    )
    try:
        deadline = time.monotonic() + 10.0
        # Let every rollout receive a round of appends before the freezes start.
        while not (results.exists() and results.read_text().count("\n") >= len(rollouts)):
            assert writer.poll() is None, "writer exited before appending"
            assert time.monotonic() < deadline, "writer never started"
            time.sleep(0.01)
        rng = random.Random(1234)
        frozen_at, snapshots = {}, {}
        for rollout_id in rng.sample(rollouts, len(rollouts)):
            time.sleep(rng.uniform(0.0, 0.06))
            snapshots[rollout_id] = store.freeze_now(rollout_id)
            frozen_at[rollout_id] = time.monotonic()
        assert writer.wait(timeout=20) == 0
    finally:
        if writer.poll() is None:
            writer.kill()

    attempts = [json.loads(line) for line in results.read_text().splitlines()]
    appended = {r: set() for r in rollouts}
    for rollout_id, call_id, started, error in attempts:
        if error is None:
            appended[rollout_id].add(call_id)
        else:
            assert "already frozen" in error, error
        if started > frozen_at[rollout_id]:
            assert error is not None, f"{rollout_id}/{call_id} was appended after its freeze"
    assert sum(map(len, appended.values())) > len(rollouts)  # the race actually ran
    for rollout_id, snap in snapshots.items():
        assert {e.model_call_id for e in snap.entries} == appended[rollout_id], rollout_id
        assert len(snap.entries) == len(appended[rollout_id])
        for entry in snap.entries:
            assert entry == interop_entry(rollout_id, entry.model_call_id)
        again = store.freeze_now(rollout_id)
        assert (again.snapshot_id, again.version, again.entries) == (snap.snapshot_id, snap.version, snap.entries)


def test_a_batch_freeze_reads_small_captures_under_their_lock_and_leaves_large_ones(store):
    store.append(make_entry("small"))
    for k in range(40):
        store.append(make_entry("large", f"c{k}", gen=k))
    small_size = store.paths("small").jsonl.stat().st_size
    large_size = store.paths("large").jsonl.stat().st_size
    assert small_size < large_size

    small, large = store.freeze_many(["small", "large"], read=False, read_below=small_size + 1)

    assert small.data == store.paths("small").jsonl.read_bytes() and small.size == small_size
    assert large.data == b"" and large.size == large_size  # read later, run by run
    assert store.read_frozen(large) == store.paths("large").jsonl.read_bytes()
    # Without read_below nothing is read, as before.
    again = store.freeze_many(["small"], read=False)
    assert again[0].data == b"" and again[0].snapshot_id == small.snapshot_id


# --- a damaged state file ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [_nested(), '{"version": Infinity}', '{"frozen": true, "version": 1e999}'])
def test_a_damaged_state_file_is_refused_with_one_line_naming_it(tmp_path, text):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    store.state_path_for("r1").write_text(text)
    with pytest.raises(ValueError, match="state file .* of rollout 'r1'") as caught:
        store.lifecycle("r1")
    assert "\n" not in str(caught.value)


# --- hidden and temporary names are never rollouts ---------------------------------------------------


def _frozen_source(directory: Path, ids) -> TokenCaptureStore:
    store = TokenCaptureStore(directory)
    for rid in ids:
        write(store, rid)
        store.freeze_raw(rid)
    return store


def _copy_in(source: Path, target: Path, rid: str, *, finish: bool = True) -> None:
    """Copy a rollout's files in as a sync tool does: under a hidden temporary name first
    (cp-style `.in-NAME`, then renamed into place), the state file last."""
    for suffix in (".tokens.jsonl", ".tokens.state.json"):
        name = rid + suffix
        partial = target / f".{name}.Xy12Ab"  # rsync's name while it writes
        shutil.copyfile(source / name, partial)
        os.rename(partial, target / f".in-{name}")  # a name that ends like a capture file
        if finish:
            os.rename(target / f".in-{name}", target / name)


def test_hidden_names_are_never_listed_or_rebuilt(tmp_path):
    ids = ["a1", "b2"]
    _frozen_source(tmp_path / "src", ids)
    target = tmp_path / "caps"
    target.mkdir()
    _copy_in(tmp_path / "src", target, "a1")
    _copy_in(tmp_path / "src", target, "b2", finish=False)  # still in flight
    shutil.copyfile(tmp_path / "src" / "a1.tokens.jsonl", target / ".a1.tokens.jsonl.Xy12Ab")
    store = TokenCaptureStore(target)
    assert store.rollout_ids() == ["a1"]
    assert store.rollout_ids(skip_retired=True) == ["a1"]
    assert raycap.rebuild([str(target)], executor="local").column("rollout_id").to_pylist() == ["a1"]
    # An id the caller names keeps the store's own rule.
    assert store.held([".in-b2"]) == {".in-b2": (target / ".in-b2.tokens.jsonl").stat().st_size}


@pytest.mark.slow
def test_a_watching_stream_over_files_copied_in_under_temporary_names_takes_no_phantom_rows(tmp_path):
    ids = [f"t{i}-r{j}" for i in range(4) for j in range(3)]
    _frozen_source(tmp_path / "src", ids)
    target = tmp_path / "caps"
    target.mkdir()
    _copy_in(tmp_path / "src", target, ids[0])
    _copy_in(tmp_path / "src", target, ids[1], finish=False)  # found by the first scan, still hidden
    taken: list[str] = []
    with Stream([target], executor="local", watch=True) as stream:
        for rid in ids[1:]:
            _copy_in(tmp_path / "src", target, rid)
        deadline = time.monotonic() + 30
        while len(set(taken)) < len(ids) and time.monotonic() < deadline:
            taken += stream.take(len(ids), timeout=1).column("rollout_id").to_pylist()
        taken += stream.take(len(ids), timeout=1).column("rollout_id").to_pylist()
    assert sorted(taken) == sorted(ids)


# --- retired markers left alone ----------------------------------------------------------------------


def _retired(directory: Path, ids) -> TokenCaptureStore:
    store = TokenCaptureStore(directory)
    for rid in ids:
        write(store, rid)
        frozen = store.freeze_raw(rid)
        assert store.drop_now(rid, snapshot_id=frozen.snapshot_id, version=frozen.version)
    return store


def _gym_sweep(store: TokenCaptureStore, ids) -> None:
    """What NeMo Gym's sweep of retired rollouts removes: the spec's files, not raycap's marker."""
    for rid in ids:
        for path in (store.state_path_for(rid), store.intents_path_for(rid), store.incomplete_path_for(rid),
                     store.lock_path_for(rid), store.path_for(rid)):
            path.unlink(missing_ok=True)


@pytest.mark.parametrize("then", ["list", "list-skipping-retired", "sweep"])
def test_a_directory_swept_by_gym_after_raycap_retired_it_ends_up_empty(tmp_path, then):
    ids = ["a1", "b2", "c3"]
    store = _retired(tmp_path, ids)
    _gym_sweep(store, ids)
    assert sorted(os.listdir(tmp_path)) == sorted(f"{rid}.tokens.retired" for rid in ids)
    if then == "sweep":
        assert store.sweep_retired(0) == 0
    else:
        assert store.rollout_ids(skip_retired=then != "list") == []
    assert os.listdir(tmp_path) == []


def test_a_lone_marker_is_kept_when_the_id_was_dispatched_again(tmp_path):
    store = _retired(tmp_path, ["a1"])
    _gym_sweep(store, ["a1"])
    write(store, "a1")  # dispatched again before anyone listed
    assert store.rollout_ids() == ["a1"] and store.read_entries("a1")
    assert TokenCaptureStore(tmp_path).sweep_retired(0) == 0 and store.read_entries("a1")


def test_raycaps_own_sweep_of_retired_rollouts_leaves_the_directory_empty(tmp_path):
    store = _retired(tmp_path, ["a1", "b2"])
    assert store.sweep_retired(0) == 2
    assert os.listdir(tmp_path) == []


# --- the store's re-read seam, and NeMo Gym's text for a corrupt line --------------------------------


def test_append_never_rescans_prior_lines_and_every_full_read_goes_through_the_seam(store, monkeypatch):
    _append_rollout(store, "r1", calls=2)

    class Rescanned(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Rescanned(args)

    monkeypatch.setattr(store, "_read_entries_unlocked", refuse)

    for n in range(3):  # appends to a rollout with prior entries read only the index
        store.append(TokenEntry(rollout_id="r1", model_call_id=f"late-{n}", prompt_token_ids=[7, n],
                                generation_token_ids=[8], generation_log_probs=[-1.0]))
    with pytest.raises(Rescanned):
        store.freeze_now("r1")
    with pytest.raises(Rescanned):
        store.read_entries("r1")

    monkeypatch.undo()
    seen = []
    real = store._read_entries_unlocked

    def counting(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "_read_entries_unlocked", counting)
    snapshot = store.freeze_now("r1")
    # Called as Gym's freeze calls it: the rollout id alone, under the freeze's lock.
    assert len(snapshot.entries) == 5 and seen == [(("r1",), {})]
    assert [e.model_call_id for e in store.read_entries("r1")] == [e.model_call_id for e in snapshot.entries]
    frozen = store.freeze_raw("r1", read=False)
    assert store.read_frozen(frozen) == store.paths("r1").jsonl.read_bytes() and len(seen) == 3


def test_a_corrupt_line_is_the_json_parsers_message_and_its_place_is_logged(store, caplog):
    _corrupt(store, "r1")
    path = store.paths("r1").jsonl
    with caplog.at_level(logging.WARNING, logger="raycap"):
        with pytest.raises(json.JSONDecodeError) as info:
            store.freeze_now("r1")
    with pytest.raises(orjson.JSONDecodeError) as plain:
        orjson.loads(BAD_LINE)
    assert f"JSONDecodeError: {info.value}" == f"JSONDecodeError: {plain.value}" == CORRUPT
    logged = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert logged and "r1" in logged[0] and "at byte " in logged[0]


# -- ids at the file system's name limit ------------------------------------------------


@pytest.mark.parametrize("length", [MAX_ROLLOUT_ID_LENGTH + 1, 220, 230, 237, 238, 300])
def test_an_id_whose_file_names_pass_the_name_limit_is_refused_at_validation_leaving_nothing(store, length):
    rollout_id = "r" * length
    with pytest.raises(ValueError, match=r"^Invalid rollout id: ") as caught:
        validate_rollout_id(rollout_id)
    message = str(caught.value)
    assert "\n" not in message and "255-byte name limit" in message and f"at most {MAX_ROLLOUT_ID_LENGTH}" in message
    for action in (
        lambda: store.append(make_entry(rollout_id)),
        lambda: store.begin_call_now(rollout_id, "c1"),
        lambda: store.mark_incomplete_now(rollout_id, "c1"),
        lambda: store.freeze_now(rollout_id),
        lambda: store.is_incomplete(rollout_id),
    ):
        with pytest.raises(ValueError, match="255-byte name limit"):
            action()
    assert list(store.directory.iterdir()) == []


def test_the_longest_valid_id_takes_every_file_raycap_derives_from_it(store):
    """The limit is the longest derived name's: an id one shorter than any refused one
    goes through the whole life of a rollout, its temp files, commit marker and kept
    record (the longest name) included."""
    assert MAX_ROLLOUT_ID_LENGTH == 218  # 255 - len(".<id>.tokens.record.json.XXXXXXXXXXXX.tmp") + len("<id>")
    rollout_id = "r" * MAX_ROLLOUT_ID_LENGTH
    store.begin_call_now(rollout_id, "c1")
    store.append(make_entry(rollout_id, "c1"))
    store.mark_incomplete_now(rollout_id, "c2")
    assert store.write_record(rollout_id, KeptRecord(0, b'{"a":1}')) is None
    snapshot = store.freeze_now(rollout_id)
    assert [entry.model_call_id for entry in snapshot.entries] == ["c1"]
    marker = CommitMarker(snapshot.snapshot_id, snapshot.version, None, False, "")
    assert store.write_commit(rollout_id, marker)
    assert store.read_record(rollout_id) == KeptRecord(0, b'{"a":1}')
    assert store.drop_now(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    assert max(len(name.encode()) for name in os.listdir(store.directory)) <= 255
