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

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import raycap
from conftest import retired_ids
from raycap.capture.directory import CaptureDir
from raycap.cli.command import main as cli_main
from raycap.output.commit import check_placement
from raycap.output.faults import OutputError
from raycap.output.manifest import MANIFEST_NAME, RETIRE_MARKER_NAME, read_manifest, shard_paths
from raycap.rows.arrow import builds_from_table
from raycap.runs.rollouts import finalize_rollouts


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
    from raycap.capture.directory import capture_dir_holding, refuse_capture_place

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


@pytest.mark.slow
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


# --- 2. retirement verifies the whole commit before it drops anything ------------------------------


def _first_part(output: Path) -> Path:
    return output / read_manifest(output).records.parts[0].name


def _first_shard(output: Path) -> Path:
    return output / read_manifest(output).shards[0].name


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["part missing", "part truncated", "part altered", "shard altered"])
def test_retire_drops_nothing_when_a_committed_part_is_missing_or_changed(collection, tmp_path, damage):
    captures, _, results, _ = collection
    output = tmp_path / "out"
    finalize_rollouts([str(captures)], results, output, executor="local", batch_size=5)
    assert read_manifest(output).records.redundant()  # a record carrying its own token ids
    before = retired_ids(captures)
    target = _first_shard(output) if damage.startswith("shard") else _first_part(output)
    data = target.read_bytes()
    if damage.endswith("missing"):
        target.unlink()
    elif damage.endswith("truncated"):
        target.write_bytes(data[:-7])
    else:
        middle = len(data) // 2
        target.write_bytes(data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:])  # same size, other bytes
    with pytest.raises(OutputError) as refused:
        raycap.retire([str(captures)], output, executor="local")
    message = str(refused.value)
    assert "\n" not in message and str(target) in message and "nothing was retired" in message
    assert retired_ids(captures) == before
    assert not (output / RETIRE_MARKER_NAME).exists()
    # The run itself, asked to retire, refuses the same way (the job exits 2 on OutputError).
    with pytest.raises(OutputError, match="nothing was retired"):
        finalize_rollouts([str(captures)], results, output, executor="local", batch_size=5, retire=True)
    assert retired_ids(captures) == before


def test_retire_from_s3_drops_nothing_when_a_records_part_was_altered(s3, s3_bucket, collection):
    captures, _, results, _ = collection
    uri = f"s3://{s3_bucket}/fin/rows"
    assert finalize_rollouts([str(captures)], results, uri, executor="local", batch_size=5).ok
    part = read_manifest(uri).records.parts[0]
    key = f"fin/rows/{part.name}"
    data = s3.client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    s3.client.put_object(Bucket=s3_bucket, Key=key, Body=data.replace(b"{", b"[", 1))  # same size
    before = retired_ids(captures)
    with pytest.raises(OutputError, match="nothing was retired") as refused:
        raycap.retire([str(captures)], uri, executor="local")
    assert part.name in str(refused.value) and "\n" not in str(refused.value)
    assert retired_ids(captures) == before
    assert "Contents" not in s3.client.list_objects_v2(Bucket=s3_bucket, Prefix=f"fin/rows/{RETIRE_MARKER_NAME}")


# --- 3. a move record read from the store is untrusted ---------------------------------------------


def _keys(s3, bucket: str, prefix: str) -> dict[str, str]:
    found = s3.client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in found if not o["Key"].endswith("/")}


@pytest.mark.parametrize("named", ["elsewhere", "itself", "a stamped place holding only a copy of its manifest"])
def test_a_forged_move_record_is_refused_and_nothing_is_deleted(s3, s3_bucket, corpus_copy, named):
    captures = corpus_copy("captures")
    uri = f"s3://{s3_bucket}/runs/rows"
    assert raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True).ok
    rows = pq.read_table(uri).num_rows
    stamped = f"{uri}.superseded-20260101T000000Z"
    if named.startswith("a stamped"):
        manifest = s3.client.get_object(Bucket=s3_bucket, Key=f"runs/rows/{MANIFEST_NAME}")["Body"].read()
        s3.client.put_object(Bucket=s3_bucket, Key=f"runs/rows.superseded-20260101T000000Z/{MANIFEST_NAME}", Body=manifest)
    moved_to = {"elsewhere": f"s3://{s3_bucket}/other/rows", "itself": uri}.get(named, stamped)
    s3.client.put_object(Bucket=s3_bucket, Key="runs/rows/.moved.json", Body=json.dumps({"moved_to": moved_to}).encode())
    kept = _keys(s3, s3_bucket, "runs/rows/")
    retired = retired_ids(captures)

    with pytest.raises(OutputError) as refused:
        raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True)
    assert "\n" not in str(refused.value) and "nothing was deleted" in str(refused.value)
    assert _keys(s3, s3_bucket, "runs/rows/") == kept  # manifest, shards, retire marker, the record: all there
    assert retired_ids(captures) == retired

    s3.client.delete_object(Bucket=s3_bucket, Key="runs/rows/.moved.json")  # the user removes the record
    again = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8, retire=True)
    assert again.ok and again.summary.reused and pq.read_table(uri).num_rows == rows


# --- 4. a commit point answered with an error after it landed ----------------------------------------


class _AnsweredWrong:
    """A boto3 S3 client whose first conditional PUT is made and then answered with an
    error, as botocore answers after its retry of a write that landed: 412, or a 500."""

    def __init__(self, client, code: str, status: int) -> None:
        self.client, self.code, self.status, self.calls = client, code, status, 0

    def put_object(self, **kwargs):
        from botocore.exceptions import ClientError

        result = self.client.put_object(**kwargs)
        if "IfNoneMatch" in kwargs:
            self.calls += 1
            if self.calls == 1:
                raise ClientError(
                    {"Error": {"Code": self.code, "Message": "answered wrong"}, "ResponseMetadata": {"HTTPStatusCode": self.status}},
                    "PutObject",
                )
        return result

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.mark.parametrize("code,status", [("PreconditionFailed", 412), ("InternalError", 500)])
def test_a_commit_point_that_landed_but_was_answered_with_an_error_is_finished(
    s3, s3_bucket, corpus_copy, monkeypatch, code, status
):
    from raycap.output.objectstore import client as store_client

    captures = corpus_copy("captures")
    want = builds_from_table(raycap.rebuild([captures], model="m", executor="local", skip_retired=True))
    real = store_client._s3_client
    wrong: list[_AnsweredWrong] = []

    def client(options):
        if not wrong:
            wrong.append(_AnsweredWrong(real(options), code, status))
        return wrong[0]

    monkeypatch.setattr(store_client, "_s3_client", client)
    uri = f"s3://{s3_bucket}/cp/rows"
    outcome = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8)
    assert wrong and wrong[0].calls == 1
    assert outcome.ok, outcome.message
    manifest = read_manifest(uri)
    assert builds_from_table(pq.read_table(uri)) == want and manifest.rows == len(want) > 0
    assert shard_paths(uri)  # every listed shard is in place
    assert not [k for k in _keys(s3, s3_bucket, "") if ".staging/" in k]
    again = raycap.rebuild_to_output([captures], uri, model="m", executor="local", batch_size=8)
    assert again.ok and again.summary.reused and read_manifest(uri).staged_as == manifest.staged_as
