"""Capture directories as they are given (`raycap.capture.directory`): a spec read the way
the kernel reads it, and a relative directory resolved where its reader says.

`/w/lnk/../cap` with `lnk -> /w/deep/inner` is `/w/deep/cap` to the kernel, not the `/w/cap`
it reads as: such a spec is refused wherever a capture directory is given.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import raycap
from raycap.capture.directory import CaptureDir, capture_dirs
from raycap.capture.store import TokenCaptureStore
from raycap.runs.rollouts import finalize_rollouts
from raycap.runs.stream import Stream
from test_stream import write


def _linked(tmp_path: Path) -> tuple[Path, Path, str]:
    """(/w/cap, /w/deep/cap, "/w/lnk/../cap") with lnk -> /w/deep/inner; both
    directories exist."""
    (tmp_path / "deep" / "cap").mkdir(parents=True)
    (tmp_path / "deep" / "inner").mkdir()
    (tmp_path / "cap").mkdir()
    (tmp_path / "lnk").symlink_to(tmp_path / "deep" / "inner")
    return tmp_path / "cap", tmp_path / "deep" / "cap", f"{tmp_path}/lnk/../cap"


def test_a_capture_dir_with_dotdot_is_refused_in_every_form_it_can_be_given(tmp_path):
    lexical, real, spec = _linked(tmp_path)
    assert os.path.realpath(spec) == str(real)  # what the kernel opens
    for given in (spec, f"node-a:{spec}", {"path": spec}, {"path": spec, "node": "rack=b"}, Path(spec)):
        with pytest.raises(ValueError, match=r"'\.\.'") as caught:
            CaptureDir.parse(given)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"'\.\.'"):
        capture_dirs([str(real), spec])
    with pytest.raises(ValueError, match=r"'\.\.'"):
        raycap.rebuild([spec], ["r1"], executor="local")
    # '.' and repeated slashes still read as the directory they spell.
    assert CaptureDir.parse(f"{tmp_path}/./deep//cap/").path == str(real)
    assert CaptureDir.parse(f"{tmp_path}/..deep").path == f"{tmp_path}/..deep"  # a name, not '..'


def test_a_sink_or_source_for_a_dotdot_capture_dir_is_refused_before_joining_ray(tmp_path):
    """Refused from the spec alone: the address (where nothing listens) is never tried,
    and so no Ray is started or joined for a directory that would be refused anyway."""
    lexical, real, spec = _linked(tmp_path)
    for build in (raycap.token_sink, raycap.token_source):
        with pytest.raises(ValueError, match=r"'\.\.'"):
            build(spec, address="127.0.0.1:1")
    assert not list(lexical.iterdir()) and not list(real.iterdir())


# --- relative capture directories --------------------------------------------------------------------


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
