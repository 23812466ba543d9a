"""The `raycap` command, run as users run it: `python -m raycap ...` in a subprocess.

The output the tests inspect is made the way a user makes one, through the command
(`raycap synth`, then `raycap rebuild` with executor "local", so no Ray starts), and
every number `inspect` prints is checked against the rows read back with pyarrow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def raycap_cli(*args: str, cwd: Path | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    """`python -m raycap ARGS` (or `python -c CODE ARGS`) from `cwd`, with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "raycap", *args]
    return subprocess.run(command, cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(output, corpus, config): a small corpus rebuilt by `raycap rebuild` on the local executor."""
    root = tmp_path_factory.mktemp("cli")
    corpus, output = root / "captures", root / "out" / "rows"
    synth = raycap_cli("synth", str(corpus), "--rollouts", "24", "--seed", "5", "--fault-share", "0.3")
    assert synth.returncode == 0, synth.stderr
    config = root / "rebuild.yaml"
    config.write_text(
        yaml.safe_dump(
            {"capture_dirs": [str(corpus)], "output": str(output), "executor": "local", "retire": False}
        )
    )
    # From another directory: the command does not need the checkout as its working directory.
    rebuild = raycap_cli("rebuild", "--config", str(config), cwd=root)
    assert rebuild.returncode == 0, rebuild.stderr
    assert "rollouts" in rebuild.stdout and "executor" in rebuild.stdout
    return output, corpus, config


def _rows(output: Path):
    return pads.dataset(str(output), format="parquet").to_table(
        columns=["rollout_id", "mask_sample", "error", "mask_reasons", "token_ids"]
    )


def test_the_console_script_is_declared_and_points_at_the_cli_main():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["raycap"] == "raycap.cli:main"
    from raycap.cli import main

    assert callable(main)


def test_without_a_command_the_usage_lists_every_command_and_the_status_is_2():
    result = raycap_cli()
    assert result.returncode == 2
    for command in ("rebuild", "demo", "synth", "inspect"):
        assert f"  {command}" in result.stdout


def test_an_unknown_command_is_one_line_on_stderr_with_status_2():
    result = raycap_cli("rebuld")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "unknown command 'rebuld'" in result.stderr


def test_rebuild_exits_like_the_job_on_a_bad_config(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("capture_dirs: [/nonexistent/raycap-cli-test]\noutput: /tmp/x\nexecutor: local\nno_such_key: 1\n")
    via_cli = raycap_cli("rebuild", "--config", str(config))
    via_job = subprocess.run(
        [sys.executable, "-m", "jobs.rebuild", "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert via_cli.returncode == via_job.returncode == 2
    assert via_cli.stderr == via_job.stderr


def test_inspect_reports_the_rows_masks_and_token_lengths_of_the_output(built, tmp_path):
    output, _, _ = built
    png = tmp_path / "lengths.png"
    result = raycap_cli("inspect", str(output), "--png", str(png), "--bins", "6")
    assert result.returncode == 0, result.stderr
    text = result.stdout

    table = _rows(output)
    masked = np.asarray(table["mask_sample"].to_numpy(zero_copy_only=False), dtype=bool)
    lengths = np.asarray(pc.list_value_length(table["token_ids"]).to_numpy(zero_copy_only=False))[~masked]
    assert 0 < masked.sum() < len(masked)  # the fault share gives both kinds
    assert f"rows        {table.num_rows:,}" in text
    assert f"unmasked    {int((~masked).sum()):,}" in text
    assert f"masked      {int(masked.sum()):,}" in text
    reasons: dict[str, int] = {}
    for row in pc.filter(table["mask_reasons"], table["mask_sample"]).to_pylist():
        for reason in set(row or ()):
            reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in reasons.items():
        assert any(line.split() == [reason, f"{count:,}"] for line in text.splitlines()), reason
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99], method="inverted_cdf")  # nearest rank, as the summary
    longest = table["rollout_id"].to_pylist()[int(np.flatnonzero(~masked)[int(np.argmax(lengths))])]
    assert f"p50 {p50:,.0f}  p90 {p90:,.0f}  p99 {p99:,.0f}  max {int(lengths.max()):,} ({longest})" in text
    counts, _ = np.histogram(lengths, bins=6)
    histogram = [line for line in text.splitlines() if " - " in line]
    assert [int(line.split()[-1]) for line in histogram] == counts.tolist()
    assert sum(counts) == len(lengths)

    pytest.importorskip("matplotlib")
    assert f"histogram: {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_writes_the_png_next_to_the_output_by_default(built):
    pytest.importorskip("matplotlib")
    output, _, _ = built
    result = raycap_cli("inspect", str(output))
    assert result.returncode == 0, result.stderr
    png = output.with_name(output.name + ".lengths.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_says_so_when_matplotlib_is_missing_and_still_reports(built, tmp_path):
    output, _, _ = built
    without_matplotlib = "import sys; sys.modules['matplotlib'] = None; from raycap.cli import main; sys.exit(main())"
    png = tmp_path / "never.png"
    result = raycap_cli("inspect", str(output), "--png", str(png), code=without_matplotlib)
    assert result.returncode == 0, result.stderr
    assert "histogram: no PNG: matplotlib is not installed" in result.stdout
    assert "token lengths (trainable rows)" in result.stdout
    assert not png.exists()


def test_inspect_of_a_path_that_is_not_an_output_is_one_line_with_status_2(tmp_path):
    result = raycap_cli("inspect", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "does not exist" in result.stderr
    (tmp_path / "empty").mkdir()
    result = raycap_cli("inspect", str(tmp_path / "empty"))
    assert result.returncode == 2 and "no Parquet shards" in result.stderr


def test_synth_writes_the_corpus_the_library_writes(tmp_path):
    from raycap.synth import CorpusSpec, generate_corpus

    result = raycap_cli("synth", str(tmp_path / "cli"), "--rollouts", "5", "--seed", "9")
    assert result.returncode == 0, result.stderr
    generate_corpus(tmp_path / "lib", CorpusSpec(rollouts=5, seed=9))
    names = sorted(p.name for p in (tmp_path / "lib").iterdir())
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == names
    for name in names:
        if name.endswith(".jsonl"):
            assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes()


@pytest.mark.slow
def test_demo_runs_through_the_command_like_the_job(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config.update(capture_dirs=[str(tmp_path / "demo-data")], output=str(tmp_path / "out" / "demo"), executor="local")
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    result = raycap_cli("demo", "--config", str(path), "--rollouts", "8")
    assert result.returncode == 0, result.stderr
    assert "jobs.demo: done" in result.stdout
    from raycap.manifest import is_committed

    assert is_committed(tmp_path / "out" / "demo")
