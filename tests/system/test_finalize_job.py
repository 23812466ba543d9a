"""The finalize job (`python -m jobs.finalize`, `raycap finalize`) and its config, run in
this process on a small input: executor auto builds here and starts no Ray."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import retired_ids
from raycap.cli import finalize as finalize_job
from raycap.cli.command import main as cli_main
from raycap.cli.jobconfig import ConfigError, FinalizeJobConfig, load_config
from raycap.output.commit import rejected_path, summary_path
from raycap.rows.options import RebuildOptions
from raycap.runs.rollouts import read_records
from test_untrusted import _nested

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_cluster_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


# A line Ray forwards from one of its processes ("(task pid=N) ...", "(pid=N) ..." from a
# worker running nothing, "(raylet) ..."), maybe colored: a Ray test that ran earlier in
# this process may still be printing them.
_RAY_WORKER_LINE = re.compile(r"^(\x1b\[[0-9;]*m)?\((([\w.:-]+ )?pid=\d+|raylet)")


def own_lines(err: str) -> list[str]:
    """The lines of `err` this process wrote, without those Ray forwards from workers."""
    return [line for line in err.strip().splitlines() if not _RAY_WORKER_LINE.match(line)]


def config_file(tmp_path: Path, **keys) -> Path:
    path = tmp_path / "finalize.yaml"
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def test_the_shipped_config_documents_every_key_and_is_valid(tmp_path):
    path = REPO / "configs" / "finalize.yaml"
    text = path.read_text()
    lines = text.splitlines()
    for index, line in enumerate(lines):
        key = re.match(r"^([a-z_]+):", line)
        if key:
            assert lines[index - 1].startswith("#"), f"key {key.group(1)} has no comment above it"
    assert set(yaml.safe_load(text)) == set(FinalizeJobConfig.model_fields)
    # Saved as a file of one's own (`raycap config finalize > f.yaml`), its paths are taken from there.
    copy = tmp_path / "finalize.yaml"
    copy.write_text(text)
    config = load_config(copy, FinalizeJobConfig)
    assert config.results == tmp_path / "out" / "rollouts.jsonl" and config.output == tmp_path / "out" / "finalized"
    assert config.labels == [str(tmp_path / "demo-data")] and config.executor == "auto"
    assert config.worker_stall_s == RebuildOptions().worker_stall_s == 300  # the documented default


def test_the_job_finalizes_prints_the_records_by_outcome_and_retires(collection, tmp_path, capsys):
    captures, _, results, records = collection
    before = retired_ids(captures)
    # Relative paths are taken from the config file's directory.
    config = config_file(
        tmp_path, capture_dirs=["captures"], results="results.jsonl", output="out/finalized", retire=True,
        records_file="out/rollouts.jsonl", record_fields=["verdict"], batch_size=8,
        # Pinned: with "auto", a Ray that an earlier test of this process left connected is used.
        executor="local",
    )
    code = finalize_job.main(["--config", str(config)])
    out, err = capsys.readouterr()
    assert code == 0, err
    output = tmp_path / "out" / "finalized"
    assert len(list(read_records(output))) == len(records)
    for label in ("records", "finalized", "left unchanged", "masked", "no capture key", "records file", "snapshots dropped"):
        assert label in out
    summary = json.loads(summary_path(output).read_text())
    assert summary["records"]["records"] == len(records) and summary["records"]["unusable"] == 5
    assert summary["executor"]["name"] == "local" and retired_ids(captures) - before
    assert (tmp_path / "out" / "rollouts.jsonl").exists()


def test_raycap_finalize_is_the_job(collection, tmp_path, capsys):
    captures, _, results, _ = collection
    config = config_file(tmp_path, capture_dirs=[str(captures)], results=str(results), output=str(tmp_path / "out"))
    assert cli_main(["finalize", "--config", str(config)]) == 0
    assert "finalized" in capsys.readouterr().out


def test_too_many_masked_records_exit_3_and_retire_nothing(collection, tmp_path, capsys):
    captures, _, results, _ = collection
    before = retired_ids(captures)
    config = config_file(
        tmp_path, capture_dirs=[str(captures)], results=str(results), output=str(tmp_path / "out"), retire=True,
        max_mask_fraction=0.05, mask_fraction_min_samples=10,
    )
    code = finalize_job.main(["--config", str(config)])
    _, err = capsys.readouterr()
    assert code == 3
    assert "finalized rollouts (" in err and "exceeding token_id_capture.max_mask_fraction=0.05. Mask reasons:" in err
    assert len([line for line in err.splitlines() if line.startswith("jobs.finalize:")]) == 1
    assert retired_ids(captures) == before and rejected_path(tmp_path / "out").is_dir()


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ({"retrie": True}, r"unknown key 'retrie'"),
        ({"results": "none.jsonl"}, r"results file \S*none.jsonl does not exist"),
        ({"results": "bad.jsonl"}, r"bad.jsonl line 2 \(record 1\) is not JSON"),
        ({"record_fields": ["reward"]}, r"record_fields names 'reward', which is a column of every row already"),
        ({"records_file": "out/x.jsonl"}, r"records_file \S+ is inside the output"),
        ({"capture_dirs": ["nowhere"]}, r"capture directory \S*/nowhere does not exist"),
        ({"executor": "local", "capture_dirs": ["node-a:/abs/captures"]}, r"executor local reads capture directories"),
        ({"max_mask_fraction": 2}, r"max_mask_fraction: Input should be less than or equal to 1"),
        ({"worker_stall_s": 0}, r"worker_stall_s: Input should be greater than 0"),
        ({"records_file": "out.summary.json"}, r"records_file \S+ is the output's summary, which this run writes itself"),
    ],
)
def test_a_finalize_that_cannot_start_exits_2_with_a_one_line_reason(keys, error, corpus_copy, tmp_path, capsys):
    captures = corpus_copy("captures")
    (tmp_path / "bad.jsonl").write_text('{"_ng_rollout_id": "r0001"}\n{"_ng_rollout_id": \n')
    (tmp_path / "ok.jsonl").write_text('{"_ng_rollout_id": "r0001"}\n')
    base = {"capture_dirs": [captures], "results": "ok.jsonl", "output": "out"}
    code = finalize_job.main(["--config", str(config_file(tmp_path, **{**base, **keys}))])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = own_lines(err)
    assert len(lines) == 1 and re.search(error, lines[0]), err
    assert not (tmp_path / "out").exists()


def test_a_config_that_is_not_a_mapping_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(bad, FinalizeJobConfig)


# --- a deeply nested results line --------------------------------------------------------------------


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
    assert len(err) == 1 and "results.jsonl line 2" in err[0] and "depth limit exceeded" in err[0], err  # orjson's words
    assert not (tmp_path / "out").exists()
    assert retired_ids(captures) == before
