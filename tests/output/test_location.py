"""Tests for raycap.output.location: an output parsed once, a URI never taken for a local path.

These need no store: a malformed or unknown URI is refused from its text, before any
network or any file, by every entry point that takes an output. The tests against an S3
API are in tests/output/test_objectstore.py.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import raycap
from raycap.cli.jobconfig import ConfigError, RebuildJobConfig, load_config
from raycap.output.faults import OutputError
from raycap.output.location import Location, is_uri, parse_location

REPO = Path(__file__).resolve().parents[2]

# Text an output may be given as that raycap must refuse from the text alone, and what
# the one-line refusal names.
BAD_URIS = {
    "s3:/bkt/x": "two slashes",
    "s3:///x": "no bucket",
    "ftp://host/x": "unknown scheme ftp://",
    "foo://x": "unknown scheme foo://",
    "s3://bkt": "no key",
    "s3://Bad_Bucket/x": "no S3 bucket name",
    "s3://bkt/a/../b": "'..'",
    "s3://bkt/x?region=eu": "query",
    "gs://bkt/x": "conditional write",  # a store raycap can read but not commit to
}


def test_a_plain_path_stays_a_local_path_and_file_uris_are_local_too(tmp_path):
    relative = parse_location("out/rows")
    assert relative.local and relative.path == Path("out/rows") and relative.fs_path == os.path.abspath("out/rows")
    assert os.fspath(relative) == "out/rows" and Path(relative) == Path("out/rows")
    as_file = parse_location(f"file://{tmp_path}/rows")
    assert as_file.local and as_file.path == tmp_path / "rows"
    assert not is_uri("out/rows") and not is_uri(str(tmp_path)) and is_uri("s3:/x") and is_uri("weird+scheme://x")


def test_an_s3_uri_is_a_location_on_the_store_that_is_never_a_local_path():
    location = parse_location("s3://bkt/run-1/step-1/", {"region": "eu-west-1"})
    assert (location.uri, location.scheme, location.bucket, location.key) == ("s3://bkt/run-1/step-1", "s3", "bkt", "run-1/step-1")
    assert not location.local and location.writable and location.options == {"region": "eu-west-1"}
    assert str(location.child(".manifest.json")) == "s3://bkt/run-1/step-1/.manifest.json"
    assert str(location.sibling(".step-1.staging")) == "s3://bkt/run-1/.step-1.staging"
    with pytest.raises(TypeError):
        Path(location)  # a URI never becomes a local path by accident
    with pytest.raises(ValueError):
        _ = location.path
    again = pickle.loads(pickle.dumps(location))  # builder tasks receive it whole
    assert again == location and again.options == {"region": "eu-west-1"}


@pytest.mark.parametrize("text", list(BAD_URIS))
def test_a_bad_uri_is_refused_from_its_text_with_one_line_naming_the_problem(text):
    with pytest.raises(OutputError) as refused:
        location = parse_location(text)
        from raycap.output.location import check_writable

        check_writable(location)
    message = str(refused.value)
    assert "\n" not in message and BAD_URIS[text] in message
    assert text in message or location.uri in message


@pytest.mark.parametrize("text", ["s3:/bkt/x", "s3:///x", "ftp://host/x", "gs://bkt/x"])
def test_every_entry_point_refuses_a_bad_uri_before_anything_is_written(text, corpus_copy, tmp_path, monkeypatch):
    captures = corpus_copy("captures")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    results = tmp_path / "results.jsonl"
    results.write_text("")
    before = sorted(os.listdir(captures))
    calls = [
        lambda: raycap.rebuild_to_output([captures], text, executor="local"),
        lambda: raycap.finalize_rollouts([captures], str(results), text, executor="local"),
        lambda: raycap.retire([captures], text),
        lambda: raycap.read_manifest(text),
        lambda: raycap.DataParallelFeed(text, 2, seq_len=64, lines=2),
        lambda: raycap.dataset(text),
    ]
    for call in calls[: 3 if text.startswith("gs:") else len(calls)]:  # gs:// is read, not written
        with pytest.raises(OutputError) as refused:
            call()
        assert "\n" not in str(refused.value)
    assert os.listdir(work) == []  # no directory named "s3:", "ftp:" or anything else
    assert sorted(os.listdir(captures)) == before  # nothing frozen, nothing retired


def test_a_stream_commit_to_a_bad_uri_is_refused_before_any_marker(tmp_path, monkeypatch):
    from raycap import TokenCaptureStore
    from raycap.stream.steps import StepRefused
    from test_stream import write

    store = TokenCaptureStore(tmp_path / "c")
    write(store, "r1")
    monkeypatch.chdir(tmp_path)
    with raycap.Stream([store.directory], executor="local") as stream:
        stream.submit(["r1"])
        rows = stream.take(1, timeout=10)
        with pytest.raises(StepRefused, match="no bucket"):
            stream.commit(rows, output="s3:///steps/step-1")
        assert store.read_commit("r1") is None and not (tmp_path / "s3:").exists()
        report = stream.commit(rows, output=tmp_path / "step-1")  # the rows stayed taken
    assert report.rollouts == 1


@pytest.mark.parametrize("text", ["s3:/bkt/x", "s3:///x", "ftp://host/x"])
def test_the_jobs_refuse_a_bad_output_uri_with_exit_2_and_nothing_local(text, corpus_copy, tmp_path):
    captures = corpus_copy("captures")
    config = tmp_path / "rebuild.yaml"
    config.write_text(yaml.safe_dump({"capture_dirs": [captures], "output": text, "executor": "local"}))
    with pytest.raises(ConfigError, match="output"):
        load_config(config, RebuildJobConfig)
    from raycap.cli import finalize as finalize_job
    from raycap.cli import rebuild as rebuild_job

    before = sorted(os.listdir(tmp_path))
    assert rebuild_job.main(["--config", str(config)]) == 2
    results = tmp_path / "results.jsonl"
    results.write_text("")
    finalize = tmp_path / "finalize.yaml"
    finalize.write_text(yaml.safe_dump({"capture_dirs": [captures], "results": str(results), "output": text}))
    assert finalize_job.main(["--config", str(finalize)]) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["finalize.yaml", "results.jsonl"])
    assert not any(name.endswith(":") for name in os.listdir(tmp_path))


def test_a_job_config_keeps_a_uri_output_as_text_and_takes_storage_options(tmp_path):
    config = tmp_path / "rebuild.yaml"
    config.write_text(yaml.safe_dump({
        "capture_dirs": [str(tmp_path)], "output": "s3://bkt/runs/step-1",
        "storage_options": {"endpoint_override": "http://127.0.0.1:9", "region": "us-east-1"},
    }))
    parsed = load_config(config, RebuildJobConfig)
    assert parsed.output == "s3://bkt/runs/step-1" and parsed.storage_options["region"] == "us-east-1"
    config.write_text(yaml.safe_dump({"capture_dirs": [str(tmp_path)], "output": "rows"}))
    assert load_config(config, RebuildJobConfig).output == tmp_path / "rows"


@pytest.mark.slow
def test_inspect_refuses_a_bad_uri_and_a_png_on_a_store_with_exit_2(tmp_path):
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "raycap", "inspect", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    bad = run("s3:/bkt/x")
    assert bad.returncode == 2 and "two slashes" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    png = run(str(tmp_path), "--png", "s3://bkt/x.png")
    assert png.returncode == 2 and "local path" in png.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_a_location_passes_through_every_parse_unchanged():
    location = parse_location("s3://bkt/a/b")
    assert parse_location(location) is location
    with_options = parse_location(location, {"region": "x"})
    assert with_options.uri == location.uri and with_options.options == {"region": "x"}
    assert isinstance(with_options, Location)
