"""The `raycap` command, run as users run it: `python -m raycap ...` in a subprocess.

The output the tests inspect is made the way a user makes one, through the command
(`raycap synth`, then `raycap rebuild` with executor "local", so no Ray starts), and
every number `inspect` prints is checked against the rows read back with pyarrow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


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
    assert project["scripts"]["raycap"] == "raycap.cli.command:console"
    from raycap.cli.command import console, main

    assert callable(main) and callable(console)


@pytest.mark.slow
def test_a_command_process_ends_without_walking_its_objects_again():
    # The command's process exits right after it: its objects are frozen, so the exit's
    # last garbage collections skip them. A caller of main in its own process keeps its
    # collector as it was.
    code = (
        "import gc, sys; from raycap.cli.command import ending, main; "
        "before = gc.get_freeze_count(); main(['--version']); during = gc.get_freeze_count(); "
        "print(before, during, ending(3), gc.get_freeze_count() > 1000)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-4:] == ["0", "0", "3", "True"]


@pytest.mark.slow
def test_without_a_command_the_usage_lists_every_command_and_the_status_is_2():
    result = raycap_cli()
    assert result.returncode == 2
    for command in ("rebuild", "demo", "synth", "inspect"):
        assert f"  {command}" in result.stdout


@pytest.mark.slow
def test_an_unknown_command_is_one_line_on_stderr_with_status_2():
    result = raycap_cli("rebuld")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "unknown command 'rebuld'" in result.stderr


@pytest.mark.slow
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
    # The same line, each naming the way it was started.
    assert via_job.stderr.startswith("jobs.rebuild: ") and via_cli.stderr.startswith("raycap rebuild: ")
    assert via_cli.stderr.removeprefix("raycap rebuild: ") == via_job.stderr.removeprefix("jobs.rebuild: ")


@pytest.mark.slow
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


@pytest.mark.slow
def test_inspect_writes_the_png_next_to_the_output_by_default(built):
    pytest.importorskip("matplotlib")
    output, _, _ = built
    result = raycap_cli("inspect", str(output))
    assert result.returncode == 0, result.stderr
    png = output.with_name(output.name + ".lengths.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_inspect_says_so_when_matplotlib_is_missing_and_still_reports(built, tmp_path):
    output, _, _ = built
    without_matplotlib = "import sys; sys.modules['matplotlib'] = None; from raycap.cli.command import main; sys.exit(main())"
    png = tmp_path / "never.png"
    result = raycap_cli("inspect", str(output), "--png", str(png), code=without_matplotlib)
    assert result.returncode == 0, result.stderr
    assert "histogram: no PNG: matplotlib is not installed" in result.stdout
    assert "token lengths (trainable rows)" in result.stdout
    assert not png.exists()


@pytest.mark.slow
def test_inspect_of_a_path_that_is_not_an_output_is_one_line_with_status_2(tmp_path):
    result = raycap_cli("inspect", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "does not exist" in result.stderr
    (tmp_path / "empty").mkdir()
    result = raycap_cli("inspect", str(tmp_path / "empty"))
    assert result.returncode == 2 and "no Parquet shards" in result.stderr


@pytest.mark.slow
def test_synth_writes_the_corpus_the_library_writes(tmp_path):
    from raycap.cli.synth import CorpusSpec, generate_corpus

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
    assert "raycap demo: done" in result.stdout and result.stdout.count("  rollouts ") == 1  # one summary block
    from raycap.output.manifest import is_committed

    assert is_committed(tmp_path / "out" / "demo")


# --- the flags of rebuild and finalize ------------------------------------------------------------


def _corpus(directory: Path, rollouts: int = 6) -> Path:
    from raycap.cli.synth import CorpusSpec, generate_corpus

    return Path(generate_corpus(directory, CorpusSpec(rollouts=rollouts, seed=3)).directory)


def _committed_rows(output: Path) -> int:
    from raycap.output.manifest import is_committed, read_manifest

    assert is_committed(output), f"{output} is not a committed output"
    return read_manifest(output).totals.rows


@pytest.mark.slow
def test_rebuild_runs_from_flags_alone_with_relative_paths_taken_from_here(tmp_path, monkeypatch, capsys):
    from raycap.capture.store import TokenCaptureStore
    from raycap.cli.command import main

    corpus = _corpus(tmp_path / "captures")
    monkeypatch.chdir(tmp_path)
    status = main(["rebuild", "captures", "--output", "out/step-1", "--executor", "local", "--retire"])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    assert _committed_rows(tmp_path / "out" / "step-1") == 6
    assert "executor            local" in printed.out
    # --retire took effect: every unmasked rollout's capture is retired, the masked ones kept.
    unmasked = [r["rollout_id"] for r in _rows(tmp_path / "out" / "step-1").to_pylist() if not r["mask_sample"]]
    store = TokenCaptureStore(corpus)
    assert unmasked and all(store.lifecycle(rollout_id).retired for rollout_id in unmasked)


@pytest.mark.slow
def test_flags_win_over_the_config_keys_they_name(tmp_path, monkeypatch, capsys):
    from raycap.cli.command import main

    _corpus(tmp_path / "captures")
    config = tmp_path / "configs" / "rebuild.yaml"
    config.parent.mkdir()
    # Relative paths in the config are the config's directory's; an executor that would start Ray.
    config.write_text(yaml.safe_dump({"capture_dirs": ["../captures"], "output": "../from-config", "executor": "ray",
                                      "delivery": "chains"}))
    monkeypatch.chdir(tmp_path / "configs")
    status = main(["rebuild", "--config", str(config), "--output", "../from-flags", "--executor", "local"])
    assert status == 0, capsys.readouterr().err
    assert not (tmp_path / "from-config").exists()
    assert _committed_rows(tmp_path / "from-flags") >= 6  # the config's delivery (chains) still holds
    assert "chain_id" in pads.dataset(str(tmp_path / "from-flags" / "data")).schema.names


def test_finalize_runs_from_flags_alone(tmp_path, capsys):
    import json

    import raycap
    from raycap.cli.command import main

    store = raycap.TokenCaptureStore(tmp_path / "captures")
    results = tmp_path / "rollouts.jsonl"
    with results.open("w") as out:
        for index in range(3):
            store.append(raycap.TokenEntry(
                rollout_id=f"4-{index}", model_call_id="call-1", prompt_token_ids=[1, 2, 3],
                generation_token_ids=[10, 11], generation_log_probs=[-0.1, -0.2],
            ))
            out.write(json.dumps({"_ng_task_index": 4, "_ng_rollout_index": index, "reward": 1.0,
                                  "response": {"model": "policy", "output": []}}) + "\n")
    status = main(["finalize", str(tmp_path / "captures"), "--results", str(results), "--output", str(tmp_path / "out"),
                   "--records-file", str(tmp_path / "finalized.jsonl"), "--executor", "local"])
    assert status == 0, capsys.readouterr().err
    assert _committed_rows(tmp_path / "out") == 3
    assert len((tmp_path / "finalized.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize(
    "args, says",
    [
        (["rebuild"], "give the capture directories and --output"),
        (["rebuild", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["rebuild", "DIR", "--output", "OUT", "--executor", "nope"], "--executor: Input should be 'auto', 'ray' or 'local'"),
        (["rebuild", "DIR", "--output", "OUT", "--max-mask-fraction", "2"], "--max-mask-fraction: Input should be less than"),
        (["rebuild", "DIR", "--output", "OUT", "--builder", "greedy"], "--builder: unknown builder 'greedy'"),
        (["rebuild", "DIR", "--executor", "local"], "missing required key 'output' (give --output)"),
        (["finalize", "DIR", "--output", "OUT"], "missing required key 'results' (give --results)"),
        (["rebuild", "DIR", "--output", "OUT", "--executor", "local"], "capture directory"),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_raycap_command(args, says, tmp_path, monkeypatch, capsys):
    from raycap.cli.command import main

    monkeypatch.chdir(tmp_path)  # DIR and OUT are relative: DIR does not exist here
    assert main(args) == 2
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1, printed.err
    assert printed.err.startswith(f"raycap {args[0]}: ") and says in printed.err, printed.err
    assert not (tmp_path / "OUT").exists()


def test_a_value_is_refused_in_the_same_words_from_a_flag_or_from_the_config(tmp_path, capsys):
    from raycap.cli.command import main

    config = tmp_path / "rebuild.yaml"
    config.write_text(yaml.safe_dump({"capture_dirs": [str(tmp_path)], "output": str(tmp_path / "o"), "executor": "nope"}))
    assert main(["rebuild", "--config", str(config)]) == 2
    from_config = capsys.readouterr().err
    assert main(["rebuild", str(tmp_path), "--output", str(tmp_path / "o"), "--executor", "nope"]) == 2
    from_flags = capsys.readouterr().err
    assert from_config == f"raycap rebuild: config {config}: executor: Input should be 'auto', 'ray' or 'local'\n"
    assert from_flags == "raycap rebuild: arguments: --executor: Input should be 'auto', 'ray' or 'local'\n"


@pytest.mark.slow
def test_the_usage_of_rebuild_and_finalize_names_the_raycap_command():
    for command, usage in (("rebuild", "usage: raycap rebuild DIR... --output OUT"),
                           ("finalize", "usage: raycap finalize DIR... --results FILE --output OUT")):
        result = raycap_cli(command, "--help")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(usage) and "python -m" not in result.stdout
    top = raycap_cli("--help")
    assert "raycap --version" in top.stdout and "python -m jobs" not in top.stdout


@pytest.mark.slow
def test_version_prints_the_package_version():
    tomllib = pytest.importorskip("tomllib")
    import raycap

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    result = raycap_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"raycap {declared}\n"
    assert raycap.__version__ == declared


@pytest.mark.slow
def test_the_job_module_keeps_its_config_form_and_its_own_name(tmp_path):
    corpus = _corpus(tmp_path / "captures", rollouts=3)
    config = tmp_path / "rebuild.yaml"
    config.write_text(yaml.safe_dump({"capture_dirs": [str(corpus)], "output": str(tmp_path / "out"), "executor": "local"}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "jobs.rebuild", "--config", str(config)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _committed_rows(tmp_path / "out") == 3
    bad = subprocess.run([sys.executable, "-m", "jobs.rebuild", "--config", str(config), "--executor", "nope"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("jobs.rebuild: ") and bad.stderr.count("\n") == 1


def test_the_demo_runs_the_packaged_config_and_the_checkout_links_to_it():
    """`make demo` runs the demo with no --config: its default is the config shipped in the
    package, and the checkout's configs/ are those same files (one copy)."""
    from raycap.cli.demo import DEMO_CONFIG

    assert DEMO_CONFIG == REPO / "raycap" / "configs" / "demo.yaml" and DEMO_CONFIG.is_file()
    assert (REPO / "configs").resolve() == DEMO_CONFIG.parent


# --- the conventions: help, config, -q, -v, --json -----------------------------------------------


COMMANDS = ("rebuild", "finalize", "clear", "sweep", "demo", "synth", "inspect", "config")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_usage_line_names_the_raycap_command_and_help_shows_defaults(command, capsys):
    from raycap.cli.command import main

    with pytest.raises(SystemExit) as ended:
        main([command, "--help"])
    assert ended.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: raycap {command}") and "python -m" not in text, text[:200]
    defaults = {
        "rebuild": "(default: prefix_merging)", "finalize": "(default: auto)", "clear": "--records FILE",
        "sweep": "--older-than-seconds S", "demo": "(default: 40)", "synth": "(default: 120)", "inspect": "(default: 10)",
        "config": "(default: list them)",
    }
    assert defaults[command] in " ".join(text.split())
    if command not in ("synth", "config"):
        assert "-q, --quiet" in text and "-v, --verbose" in text and "--json" in text
    if command in ("rebuild", "finalize", "clear", "sweep", "demo"):
        assert "exit status:" in text and "130" in text


def test_config_prints_a_commented_example_that_the_job_accepts(tmp_path, capsys):
    from raycap.cli.command import CONFIGS, main
    from raycap.cli.jobconfig import JOB_CONFIGS, load_config

    assert main(["config"]) == 0
    listed = capsys.readouterr().out
    for name in CONFIGS:
        assert f"raycap config {name} > {name}.yaml" in listed
        assert main(["config", name]) == 0
        text = capsys.readouterr().out
        assert text.startswith("#") and text.count("\n# ") > 5
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        if name in JOB_CONFIGS and name != "clear":  # clear's records file must exist first
            config = load_config(path, JOB_CONFIGS[name])
            assert config.capture_dirs


def _mini_corpus(directory: Path, rollouts: int = 4) -> Path:
    from raycap.cli.synth import CorpusSpec, generate_corpus

    spec = CorpusSpec(rollouts=rollouts, seed=2, turns=(4, 4), system_tokens=(8, 8), fault_share=0.0)
    return Path(generate_corpus(directory, spec).directory)


def test_rebuild_json_is_one_document_on_stdout_and_quiet_prints_nothing(tmp_path, capsys):
    import json

    from raycap.cli.command import main

    corpus = _mini_corpus(tmp_path / "captures")
    assert main(["rebuild", str(corpus), "--output", str(tmp_path / "a"), "--executor", "local", "--json"]) == 0
    printed = capsys.readouterr()
    document = json.loads(printed.out)  # stdout holds the document alone
    assert document["command"] == "rebuild" and document["status"] == 0 and document["error"] is None
    assert document["output"] == str(tmp_path / "a") and document["outcome"] == "done"
    assert document["summary"]["rollouts"] == 4 and "masked_by_reason" in document["summary"]
    assert "rollouts" in printed.err  # the human summary went to stderr
    assert main(["rebuild", str(corpus), "--output", str(tmp_path / "b"), "--executor", "local", "-q"]) == 0
    assert capsys.readouterr() == ("", "")
    assert main(["rebuild", str(corpus), "--output", str(tmp_path / "c"), "--executor", "local", "-v"]) == 0
    assert "rollouts" in capsys.readouterr().out
    # A refusal under --json: the line on stderr, and the document names it.
    assert main(["rebuild", str(tmp_path / "nowhere"), "--output", str(tmp_path / "d"), "--executor", "local",
                 "--json"]) == 2
    printed = capsys.readouterr()
    assert json.loads(printed.out)["status"] == 2 and "does not exist" in json.loads(printed.out)["error"]


def test_inspect_json_holds_the_numbers_the_report_prints(built, capsys):
    import json

    from raycap.cli.command import main

    output, _, _ = built
    assert main(["inspect", str(output), "--json", "--no-png"]) == 0
    printed = capsys.readouterr()
    document = json.loads(printed.out)
    rows = _rows(output)
    masked = pc.fill_null(rows["mask_sample"], True).to_numpy(zero_copy_only=False)
    assert document["command"] == "inspect" and document["status"] == 0
    assert document["rows"] == rows.num_rows and document["masked"] == int(masked.sum())
    assert sum(document["histogram"]["counts"]) == rows.num_rows - int(masked.sum())
    assert document["token_lengths"]["max"] == max(len(r["token_ids"]) for r in rows.to_pylist() if not r["mask_sample"])
    assert f"masked      {document['masked']}" in printed.err
    if len(document["mask_reasons"]) > 1:
        assert "a row may have several" in printed.err


# --- careless input: one line, the documented status, nothing left behind --------------------------


def _traces(root: Path) -> list[str]:
    """Every entry under `root`, relative, so a test can say nothing else was made."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _one_line(printed, command: str = "rebuild") -> str:
    assert printed.err.count("\n") == 1 and printed.err.startswith(f"raycap {command}: "), printed.err
    return printed.err


def test_a_missing_capture_directory_leaves_no_parent_folder_and_no_lock(tmp_path, capsys):
    from raycap.cli.command import main

    before = _traces(tmp_path)
    for executor in ("local", "auto"):
        assert main(["rebuild", str(tmp_path / "typo"), "--output", str(tmp_path / "new" / "deep" / "out"),
                     "--executor", executor]) == 2
        assert "capture directory" in _one_line(capsys.readouterr())
    assert _traces(tmp_path) == before


def test_an_output_that_is_a_file_is_refused_in_the_words_of_flags_and_left_alone(tmp_path, capsys):
    from raycap.cli.command import main

    corpus = _mini_corpus(tmp_path / "captures")
    afile = tmp_path / "results" / "afile.txt"
    afile.parent.mkdir()
    afile.write_text("mine\n")
    before = _traces(tmp_path)
    assert main(["rebuild", str(corpus), "--output", str(afile), "--executor", "local"]) == 2
    line = _one_line(capsys.readouterr())
    assert "--overwrite" in line and "overwrite: true" not in line
    # --overwrite replaces only raycap's rows: the user's file stays where it is.
    assert main(["rebuild", str(corpus), "--output", str(afile), "--executor", "local", "--overwrite"]) == 2
    line = _one_line(capsys.readouterr())
    assert "not a raycap output" in line and "--overwrite replaces only a raycap output or an empty folder" in line
    assert _traces(tmp_path) == before and afile.read_text() == "mine\n"
    # A config user is told the key.
    config = tmp_path / "rebuild.yaml"
    config.write_text(yaml.safe_dump({"capture_dirs": [str(corpus)], "output": str(afile), "executor": "local"}))
    assert main(["rebuild", "--config", str(config)]) == 2
    assert "overwrite: true" in _one_line(capsys.readouterr())


def test_overwrite_replaces_a_raycap_output_and_an_empty_folder(tmp_path, capsys):
    from raycap.cli.command import main

    corpus = _mini_corpus(tmp_path / "captures")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["rebuild", str(corpus), "--output", str(empty), "--executor", "local", "--overwrite", "-q"]) == 0
    assert _committed_rows(empty) == 4
    assert main(["rebuild", str(corpus), "--output", str(empty), "--executor", "local", "--overwrite", "-q",
                 "--model", "other"]) == 0
    assert _committed_rows(empty) == 4 and list(tmp_path.glob("empty.superseded-*"))


def test_an_empty_capture_directory_writes_nothing_and_exits_4_unless_allowed(tmp_path, capsys):
    from raycap.cli.command import main

    (tmp_path / "captures").mkdir()
    before = _traces(tmp_path)
    output = tmp_path / "steps" / "step-1"
    assert main(["rebuild", str(tmp_path / "captures"), "--output", str(output), "--executor", "local"]) == 4
    line = _one_line(capsys.readouterr())
    assert "no captured rollouts" in line and "--allow-empty" in line
    assert _traces(tmp_path) == before
    assert main(["rebuild", str(tmp_path / "captures"), "--output", str(output), "--executor", "local",
                 "--allow-empty", "-q"]) == 0
    assert _committed_rows(output) == 0


def test_an_empty_directory_on_an_embedded_ray_exits_4_without_starting_ray(tmp_path):
    # The build would find nothing after Ray's start (seconds): with no cluster to join,
    # the directory here is all there is, so the command refuses before Ray is imported.
    (tmp_path / "captures").mkdir()
    output = tmp_path / "steps" / "step-1"
    code = (
        "import sys; from raycap.cli.command import main; status = main(sys.argv[1:]); "
        "print(status, 'ray' in sys.modules, flush=True)"
    )
    before = _traces(tmp_path)
    run = raycap_cli("rebuild", str(tmp_path / "captures"), "--output", str(output), "--executor", "ray", code=code)
    assert run.stdout.split() == ["4", "False"], run.stderr
    assert run.stderr == (
        f"raycap rebuild: no captured rollouts in {tmp_path / 'captures'}: nothing was built or written; check the "
        "capture directories (a wrong path, or captures not arrived yet), or pass --allow-empty to commit an empty "
        "dataset\n"
    )
    assert _traces(tmp_path) == before


@pytest.mark.slow
def test_an_empty_directory_on_a_cluster_of_this_node_alone_is_refused_without_joining_it(ray_cluster, tmp_path, monkeypatch, capsys):
    # The cluster's only node is this one (its GCS says so), so the listing here is the
    # actor's: the job refuses the empty directory without joining the cluster (joining
    # and leaving is most of such a command's time), let alone starting a node actor.
    # With a second node alive, the directory here says nothing of that node's: it joins.
    import ray

    import raycap.cluster.nodes.fleet as fleet
    from raycap.cli.command import main

    ray.shutdown()  # this job joins the cluster itself, as a command does
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    (tmp_path / "captures").mkdir()
    before = _traces(tmp_path)
    argv = ["rebuild", str(tmp_path / "captures"), "--output", str(tmp_path / "out"), "--executor", "ray"]
    with monkeypatch.context() as patched:
        patched.setattr(fleet, "_start", lambda node: pytest.fail(f"a node actor was started on {node}"))
        try:
            status = main(argv)
            joined = ray.is_initialized()
        finally:
            ray.shutdown()
    assert (status, joined) == (4, False)
    assert "no captured rollouts" in _one_line(capsys.readouterr())
    assert _traces(tmp_path) == before

    with ray_cluster.nodes([{"raycap-node": "second"}]):
        try:
            status = main(argv)
            joined = ray.is_initialized()
        finally:
            ray.shutdown()
    assert (status, joined) == (4, True)  # refused by the actors, once joined
    assert "no captured rollouts" in _one_line(capsys.readouterr())


@pytest.mark.parametrize(
    "content, says",
    [("", "is empty"), ("\n  \n", "is empty"), ('[{"_ng_rollout_id": "r0000"}]\n', "holds a JSON array")],
)
def test_a_results_file_that_is_not_jsonl_is_refused_and_leaves_nothing(content, says, tmp_path, capsys):
    from raycap.cli.command import main

    corpus = _mini_corpus(tmp_path / "captures", rollouts=1)
    results = tmp_path / "rollouts.jsonl"
    results.write_text(content)
    before = _traces(tmp_path)
    assert main(["finalize", str(corpus), "--results", str(results), "--output", str(tmp_path / "out" / "f"),
                 "--executor", "local"]) == 2
    assert says in _one_line(capsys.readouterr(), "finalize")
    assert _traces(tmp_path) == before


def test_every_rollout_masked_for_want_of_a_capture_hints_that_the_ids_are_wrong(tmp_path, capsys):
    import json

    from raycap.cli.command import main

    corpus = _mini_corpus(tmp_path / "captures", rollouts=2)
    results = tmp_path / "rollouts.jsonl"
    results.write_text("".join(json.dumps({"_ng_rollout_id": f"other-{i}", "reward": 1.0}) + "\n" for i in range(3)))
    assert main(["finalize", str(corpus), "--results", str(results), "--output", str(tmp_path / "f"),
                 "--executor", "local", "--json"]) == 0
    printed = capsys.readouterr()
    hints = json.loads(printed.out)["hints"]
    assert len(hints) == 1 and "rollout ids may be wrong" in hints[0] and "rollout ids may be wrong" in printed.err


def test_an_error_example_is_cut_at_a_word_keeping_its_way_out():
    from raycap.output.summary import shortened

    text = ("r0003: capture schema_version 9 is newer than this reader knows: this reader handles versions 1 to 3 "
            "and refuses to guess at the rest; upgrade raycap on the nodes that read it")
    short = shortened(text, 140)
    assert len(short) <= 140 and short.endswith("; upgrade raycap on the nodes that read it")
    kept = short.split(" ...;")[0]
    assert text.startswith(kept) and text[len(kept)] == " "  # cut between words
    assert shortened("fits; as is", 140) == "fits; as is"


def test_an_error_example_of_pydantic_keeps_its_way_out_before_the_input_trailer():
    from raycap.output.summary import shortened

    text = ("r0027: ValidationError: 1 validation error for TokenEntry Value error, token record schema_version 2 "
            "is newer than this reader knows: this reader understands up to 1; upgrade the reader to read it "
            "[type=value_error, input_value={'created_at': 1750085286, 'token_item_index': 1}, input_type=dict]")
    short = shortened(text, 140)
    assert len(short) <= 140 and short.endswith("; upgrade the reader to read it"), short
    assert "input_value" not in short


# --- a closed pipe, Ctrl-C --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly(built):
    output, _, _ = built
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Thousands of lines: more than a pipe holds, so the write after `head` leaves fails.
    script = f"{sys.executable} -m raycap inspect {output} --no-png --bins 5000 | head -2; echo status=${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "status=141", done.stdout[-500:]
    assert done.stderr == "", done.stderr


def _interrupt(args: list[str], cwd: Path, env: dict) -> tuple[int, str]:
    """Run `python -m raycap ARGS` until it pauses after its first shard, then SIGINT it:
    (status, stderr)."""
    import signal
    import time

    # As a command started in the foreground of a shell gets it: SIGINT at its default, though
    # this process may have been started with it ignored (a background job of a script).
    process = subprocess.Popen([sys.executable, "-m", "raycap", *args], cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line)
        if "test hook: pausing" in line:
            process.send_signal(signal.SIGINT)
            break
    rest = process.communicate(timeout=120)[1]
    return process.returncode, "".join(lines) + rest


def _one_line_of(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "raycap rebuild: interrupted" in line), "")


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_ctrl_c_is_one_line_status_130_and_the_next_run_proceeds(executor, request, tmp_path):
    corpus = _mini_corpus(tmp_path / "captures", rollouts=6)
    output = tmp_path / "steps" / "step-1"
    config = tmp_path / "rebuild.yaml"
    keys = {"capture_dirs": [str(corpus)], "output": str(output), "executor": executor, "batch_size": 1}
    if executor == "ray":
        keys["ray"] = {"num_cpus": 1}
    config.write_text(yaml.safe_dump(keys))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0",
           "RAYCAP_JOB_PAUSE_AFTER_FIRST_SHARD": "60"}
    env.pop("RAY_ADDRESS", None)
    status, err = _interrupt(["rebuild", "--config", str(config)], tmp_path, env)
    assert status == 130, err[-3000:]
    assert "Traceback" not in err and err.count("raycap rebuild: interrupted") == 1, err[-3000:]
    # Nothing after the one line: no error of a task the interruption left behind.
    after = err.split("test hook: pausing", 1)[1].split("\n", 1)[1]
    assert [line for line in after.splitlines() if line.strip()] == [_one_line_of(after)], err[-3000:]
    # Nothing half-committed, no lock, no staging, no folder made: the next run proceeds.
    assert not (tmp_path / "steps").exists(), _traces(tmp_path)
    env.pop("RAYCAP_JOB_PAUSE_AFTER_FIRST_SHARD")
    if executor == "ray":
        # The interrupted run had its embedded Ray; the next one joins the shared cluster, as
        # a job run under `ray job submit` joins its own (the config's num_cpus is then unused).
        env["RAY_ADDRESS"] = request.getfixturevalue("ray_shared").address
    done = subprocess.run([sys.executable, "-m", "raycap", "rebuild", "--config", str(config), "-q"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _committed_rows(output) == 6


def test_the_exit_status_table_of_the_docs_is_the_code_s():
    from raycap.cli.jobs import EXIT_STATUSES

    page = (REPO / "docs" / "jobs-and-cli.md").read_text()
    table = page.split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    documented = [int(line.split("|")[1]) for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert documented == list(EXIT_STATUSES)


def test_finalize_lists_each_mask_reason_once(tmp_path, capsys):
    import json

    from raycap.cli.command import main

    corpus = _mini_corpus(tmp_path / "captures", rollouts=2)
    results = tmp_path / "rollouts.jsonl"
    ids = ["r0000", "r0001", "gone-1"]
    results.write_text("".join(json.dumps({"_ng_rollout_id": rid, "reward": 1.0}) + "\n" for rid in ids))
    assert main(["finalize", str(corpus), "--results", str(results), "--output", str(tmp_path / "f"),
                 "--executor", "local"]) == 0
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines()
              if "capture contains no token records" in line and not line.strip().startswith("e.g.")]
    assert len(listed) == 1, out


@pytest.mark.parametrize(
    "args, says",
    [
        (["config", "nosuch"], "invalid choice: 'nosuch'"),
        (["inspect"], "the following arguments are required: output"),
        (["synth"], "the following arguments are required: out_dir"),
        (["demo", "--rollouts", "x"], "invalid int value: 'x'"),
        (["demo", "afile"], "afile is not a folder"),
    ],
)
def test_the_other_commands_refuse_a_bad_argument_in_one_line(args, says, tmp_path, monkeypatch, capsys):
    from raycap.cli.command import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine")
    try:
        status = main(args)
    except SystemExit as ended:
        status = ended.code
    assert status == 2
    line = _one_line(capsys.readouterr(), args[0])
    assert says in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.slow
def test_a_command_leaves_its_embedded_ray_without_waiting_and_stops_every_process_of_it(tmp_path):
    # After the summary, `ending` stops the embedded Ray the command started: the
    # autoscaler monitor would take its whole second of SIGTERM grace, and Ray's exit hook
    # would pause half a second more. Nothing of that Ray may be left running.
    temp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # short: Ray's socket paths must fit
    code = (
        "import sys, time, ray; from raycap.cli.command import ending; from raycap.cluster.plumbing.connect import connect; "
        "connect(num_cpus=1); started = time.monotonic(); status = ending(0); "
        "print(round(time.monotonic() - started, 3), ray.is_initialized(), status, flush=True)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(temp)}
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        seconds, initialized, status = run.stdout.split()
        assert (initialized, status) == ("False", "0")
        assert float(seconds) < 1.0  # the monitor's grace alone is 1 s
        deadline = time.monotonic() + 10
        while (left := _processes_naming(str(temp))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _processes_naming(marker: str) -> list[str]:
    """The command lines of running processes that name `marker`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in argv:
            found.append(argv[:120])
    return found
