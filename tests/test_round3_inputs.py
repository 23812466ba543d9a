"""Input hardening: what raycap reads from files it did not write (damaged commit markers,
deeply nested JSON anywhere), names it discovers by itself (hidden and temporary files
are never rollouts), record_fields and relative capture directories, and the retired
markers a sweep by either tool leaves behind."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

import raycap
from conftest import retired_ids
from raycap.capture.store import TokenCaptureStore
from raycap.finalize.results import ResultsError
from raycap.runs.rollouts import finalize_rollouts
from raycap.runs.stream import Stream
from test_stream import write

DEEP = 5000


def _nested(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


# -- damaged commit markers hold back their rollout only ---------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"snapshot_id": "S", "version": Infinity, "output": null, "masked": false, "reason": ""}',
        '{"snapshot_id": "S", "version": 1, "output": null, "masked": false, "reason": %s}' % _nested(30_000),
        _nested(30_000),
    ],
    ids=["infinity", "nested-value", "nested"],
)
@pytest.mark.slow
def test_a_damaged_commit_marker_holds_back_only_its_rollout_and_is_counted(tmp_path, text):
    store = TokenCaptureStore(tmp_path)
    write(store, "hidden")
    write(store, "fine")
    store.freeze_raw("hidden")
    store.commit_path("hidden").write_text(text)
    with pytest.raises(ValueError, match="commit marker .* of rollout 'hidden'"):
        store.read_commit("hidden")
    with Stream([tmp_path], executor="local") as stream:
        stream.submit(["fine"])
        rows = stream.take(2, timeout=2)
        assert rows.column("rollout_id").to_pylist() == ["fine"]
        assert stream.stats.damaged_markers == 1


# -- deeply nested JSON ------------------------------------------------------------------


def test_untrusted_json_is_bounded_and_every_failure_is_one_typed_error():
    from raycap.capture.untrusted import MAX_JSON_DEPTH, UntrustedJSONError, loads_untrusted

    assert loads_untrusted(_nested(MAX_JSON_DEPTH)) is not None
    assert loads_untrusted('["\\ud800", 123456789012345678901234567890]') == ["\ud800", 123456789012345678901234567890]
    assert loads_untrusted('"' + "[" * 10_000 + '"') == "[" * 10_000  # brackets inside a string are text
    for text in (_nested(), '{"a": ' * DEEP + "1" + "}" * DEEP, '{"v": Infinity}', "[NaN]", "1" * 5000, b"\xff"):
        with pytest.raises(UntrustedJSONError) as caught:
            loads_untrusted(text, "the file F")
        assert str(caught.value).startswith("the file F") and "\n" not in str(caught.value)
    assert loads_untrusted("[NaN]", allow_nan=True)[0] != 0


def test_a_deeply_nested_results_line_exits_2_naming_file_and_line_and_commits_nothing(corpus_copy, tmp_path, capsys):
    from raycap.cli.finalize import main

    captures = corpus_copy("captures")
    before = retired_ids(captures)
    results = tmp_path / "results.jsonl"
    results.write_text('{"_ng_rollout_id": "r0000"}\n{"_ng_rollout_id": "r0001", "deep": %s}\n' % _nested())
    config = tmp_path / "finalize.yaml"
    config.write_text(yaml.safe_dump({
        "capture_dirs": [captures], "results": str(results), "output": str(tmp_path / "out"),
        "retire": True, "executor": "local",
    }))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "results.jsonl line 2" in err[0] and "deeper" in err[0], err
    assert not (tmp_path / "out").exists()
    assert retired_ids(captures) == before


def test_a_deeply_nested_results_line_is_refused_by_the_api_naming_the_line(corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    results = tmp_path / "results.jsonl"
    # A big integer takes the exact (Python json) path; the nesting must be refused there too.
    results.write_text('{"_ng_rollout_id": "r0000", "id": 123456789012345678901, "deep": %s}\n' % _nested())
    with pytest.raises(ResultsError, match=r"results.jsonl line 1 \(record 0\) is not JSON.*deeper"):
        finalize_rollouts([captures], results, tmp_path / "out", executor="local", record_fields=["id"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", [_nested(), '{"version": Infinity}', '{"frozen": true, "version": 1e999}'])
def test_a_damaged_state_file_is_refused_with_one_line_naming_it(tmp_path, text):
    store = TokenCaptureStore(tmp_path)
    write(store, "r1")
    store.state_path_for("r1").write_text(text)
    with pytest.raises(ValueError, match="state file .* of rollout 'r1'") as caught:
        store.lifecycle("r1")
    assert "\n" not in str(caught.value)


# -- hidden and temporary names are never rollouts ---------------------------------------


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


# -- record_fields and relative capture directories --------------------------------------


def test_forty_thousand_record_fields_are_checked_in_well_under_a_second(corpus_copy, tmp_path):
    names = [f"field_{i}" for i in range(40_000)] + ["field_7"]
    started = time.monotonic()
    with pytest.raises(ValueError, match="record_fields names field_7 more than once"):
        finalize_rollouts([corpus_copy("captures")], tmp_path / "results.jsonl", tmp_path / "out", record_fields=names)
    assert time.monotonic() - started < 1.0


def test_a_relative_capture_directory_is_resolved_against_the_working_directory(tmp_path, monkeypatch):
    for name in ("rebuilt", "streamed", "finalized"):
        store = TokenCaptureStore(tmp_path / name)
        for rid in ("r1", "r2"):
            write(store, rid)
    monkeypatch.chdir(tmp_path)
    rows = raycap.rebuild(["rebuilt"], executor="local")
    assert sorted(rows.column("rollout_id").to_pylist()) == ["r1", "r2"]
    with Stream(["streamed"], executor="local") as stream:
        stream.submit(["r1"])
        assert stream.take(1, timeout=5).column("rollout_id").to_pylist() == ["r1"]
    (tmp_path / "results.jsonl").write_text('{"_ng_rollout_id": "r2"}\n')
    outcome = finalize_rollouts(["finalized"], "results.jsonl", "out", executor="local", retire=True)
    assert outcome.ok, outcome.message
    assert TokenCaptureStore(tmp_path / "finalized").lifecycle("r2").retired
    # A directory on a node, or anything that reads as NODE:path, stays absolute-only.
    for spec in ("node-a:rebuilt", {"path": "rebuilt", "node": "node-a"}):
        with pytest.raises(ValueError, match="not an absolute path"):
            raycap.rebuild([spec], executor="local")


def test_a_job_config_resolves_a_relative_capture_directory_against_its_own_directory_only_for_local_paths(tmp_path, monkeypatch):
    from raycap.cli.jobconfig import ConfigError, RebuildJobConfig, load_config

    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "rebuild.yaml"
    monkeypatch.chdir(tmp_path)
    config.write_text(yaml.safe_dump({"capture_dirs": ["caps", "node-a:/abs/caps"], "output": "out"}))
    dirs = load_config(config, RebuildJobConfig).capture_dirs
    assert [(d.path, d.node) for d in dirs] == [(str(tmp_path / "conf" / "caps"), None), ("/abs/caps", "node-a")]
    config.write_text(yaml.safe_dump({"capture_dirs": ["node-a:caps"], "output": "out"}))
    with pytest.raises(ConfigError, match="not an absolute path"):
        load_config(config, RebuildJobConfig)


# -- retired markers left alone ----------------------------------------------------------


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
