"""Capture directories as they are given (`raycap.capture.directory`): a spec read the way
the kernel reads it, and a relative directory resolved where its reader says.

`/w/lnk/../cap` with `lnk -> /w/deep/inner` is `/w/deep/cap` to the kernel, not the `/w/cap`
it reads as: such a spec is refused wherever a capture directory is given.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import raycap
from raycap.capture.directory import CaptureDir, capture_dirs


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
