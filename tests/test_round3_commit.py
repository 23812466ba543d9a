"""The commit and retirement path against a hostile or faulty world.

- No file raycap writes (records_file, the output, a step output, inspect's PNG) lands
  inside a capture directory, whichever way the directory was named (`NODE:/path` too).
- Retirement drops nothing unless every part the commit wrote (shards and records parts)
  is there with its size and digest, locally as on an object store.
- A `.moved.json` read from the store is untrusted: one naming anything but the move's
  own place, or a place without a whole copy, is refused and nothing is deleted.
- A conditional manifest PUT that landed but was answered with an error is this run's
  commit: it is finished, readers see every row, and a rerun reuses it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import raycap
from raycap.capturedir import CaptureDir
from raycap.cli import main as cli_main
from raycap.finalize import finalize_rollouts
from raycap.output import check_placement
from raycap.outputerrors import OutputError


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


# --- 1. nothing is written inside a capture directory, however it was named ----------------------


def test_records_file_and_output_inside_a_node_named_capture_directory_are_refused(ray_shared, collection, tmp_path):
    import ray

    captures, _, results, records = collection
    spec = f"{ray.get_runtime_context().get_node_id()}:{captures}"
    victim = captures / f"{records[0]['_ng_rollout_id']}.tokens.jsonl"
    before = _snapshot(captures)
    for target in (victim, captures / "finalized.jsonl"):
        with pytest.raises(ValueError, match=r"records_file .* inside capture directory") as refused:
            finalize_rollouts([spec], results, tmp_path / "out", records_file=target, executor="ray", batch_size=8)
        assert "\n" not in str(refused.value) and spec in str(refused.value)
    for place in (captures / "out", captures / "sub" / "out"):
        with pytest.raises(OutputError, match="inside capture directory"):
            finalize_rollouts([spec], results, place, executor="ray", batch_size=8)
        with pytest.raises(OutputError, match="inside capture directory"):
            raycap.rebuild_to_output([spec], place, model="m", executor="ray")
    assert _snapshot(captures) == before and not (tmp_path / "out").exists()
    assert not (captures / "finalized.jsonl").exists()
    assert sorted(p.name for p in captures.iterdir() if p.is_dir()) == []


def test_the_capture_place_check_covers_every_form_of_a_directory(tmp_path):
    from raycap.capturedir import capture_dir_holding, refuse_capture_place

    real = tmp_path / "real" / "caps"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    linked = str(tmp_path / "link" / "caps")
    for dirs in ([("n1:" + linked, linked)], [("n1:" + str(real), str(real))]):
        for path in (real / "x.jsonl", Path(linked) / "x.jsonl", real / "a" / ".." / "x.jsonl", real):
            assert capture_dir_holding(path, dirs) == dirs[0][0]
    assert capture_dir_holding(tmp_path / "real" / "capsule", [("c", str(real))]) is None
    # A step output of a stream whose directories live on nodes: compared as written and resolved.
    with pytest.raises(OutputError, match=f"inside capture directory n1:{linked}"):
        check_placement(real / "steps", (), elsewhere=[(f"n1:{linked}", linked)])
    with pytest.raises(OutputError, match="inside capture directory"):
        check_placement(real / "out", [CaptureDir(linked, "n1")])
    with pytest.raises(OutputError, match="holds capture directory"):
        check_placement(tmp_path / "real", [CaptureDir(str(real), "n1")])
    with pytest.raises(ValueError, match="records_file"):
        refuse_capture_place(real / "out.jsonl", [CaptureDir(linked, "n1")], "records_file")


def test_a_png_is_never_written_over_or_among_captures(collection, tmp_path, capsys):
    captures, _, results, _ = collection
    output = tmp_path / "out"
    finalize_rollouts([str(captures)], results, output, executor="local")
    before = _snapshot(captures)
    victim = next(p for p in captures.iterdir() if p.name.endswith(".tokens.jsonl"))
    for png in (victim, captures / "lengths.png", tmp_path / "x.tokens.jsonl"):
        assert cli_main(["inspect", str(output), "--png", str(png)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "capture" in err
    assert _snapshot(captures) == before and not (tmp_path / "x.tokens.jsonl").exists()


