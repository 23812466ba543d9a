"""raycap.observe: progress lines a job log can show, stage timings in the summary, a
stream's figures as a flat dict (the series at a Ray head's metrics endpoint:
tests/test_job_submit.py)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raycap.observe import timing
from raycap.observe.progress import ProgressLine, heartbeat
from raycap.output.commit import summary_path

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[")
PLAIN_LINE = re.compile(r"^(rebuild|finalize): [\d,]+/[\d,]+ rollouts \(\d+%\)  [\d.]+ rollouts/s(  ETA \d+ s)?  masked [\d,]+$")


class _State:
    def __init__(self, total: int, done: int = 0, started: float | None = None):
        self.total, self.done = total, done
        self.started = time.monotonic() if started is None else started


def test_off_a_terminal_a_plain_line_is_printed_at_each_tenth_with_rate_eta_and_masked():
    stream = io.StringIO()
    line = ProgressLine("rebuild", stream, every=3600)
    line.masked = 0
    state = _State(100)
    for done in range(0, 101, 5):
        state.done = done
        line.masked = done // 10
        line(state)
    line.finish()
    lines = stream.getvalue().splitlines()
    # 10%, 20%, ... 90%, then the final line: nothing redrawn, nothing glued.
    assert len(lines) == 10, lines
    assert all(PLAIN_LINE.match(text) for text in lines[:-1]), lines
    assert lines[0].startswith("rebuild: 10/100 rollouts (10%)") and lines[0].endswith("masked 1")
    assert lines[-1].startswith("rebuild: 100/100 rollouts in") and "10 masked" in lines[-1]
    assert "\r" not in stream.getvalue() and not ANSI.search(stream.getvalue())


def test_off_a_terminal_a_line_is_printed_every_interval_between_tenths():
    stream = io.StringIO()
    line = ProgressLine("finalize", stream, every=0.05)
    state = _State(1000)
    line(state)
    for done in range(1, 6):  # under a tenth of the work: only the interval prints
        time.sleep(0.06)
        state.done = done
        line(state)
    assert len(stream.getvalue().splitlines()) == 5


def test_a_heartbeat_says_a_long_call_still_runs_on_lines_of_its_own():
    stream = io.StringIO()
    with heartbeat("sweep", "3 capture directories", stream=stream, every=0.05):
        time.sleep(0.18)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 2 and all(text.startswith("sweep: 3 capture directories: still running after") for text in lines)


_NESTED = """
import json, time
from raycap.observe import timing

@timing.timed("build")
def build():
    time.sleep(0.05)

with timing.stage("freeze"):
    time.sleep(0.05)
    build()
print(json.dumps([timing.take_batch_figures(), timing.take_batch_figures()]))
"""


def test_a_timed_stage_inside_another_counts_only_in_its_own():
    # In a process of its own: the figures are the process's, and other tests' threads add to them here.
    done = subprocess.run([sys.executable, "-c", _NESTED], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    figures, again = json.loads(done.stdout)
    assert 0.045 < figures["build"] < 0.09 and 0.045 < figures["freeze"] < 0.09
    assert again == {}


def test_the_summary_holds_the_run_s_stage_timings_and_the_capture_bytes_read(corpus_copy, tmp_path):
    import raycap

    captures = corpus_copy("captures")
    output = tmp_path / "rows"
    outcome = raycap.rebuild_to_output([captures], output, model="m", retire=True, executor="local", batch_size=8)
    written = json.loads(summary_path(output).read_text())
    timings = written["timings_s"]
    assert list(timings) == [s for s in timing.STAGES if s in timings]  # in stage order
    assert {"discovery", "freeze", "build", "write", "commit", "retire"} <= set(timings)
    assert all(seconds >= 0 for seconds in timings.values()) and timings["build"] > 0
    assert timings == outcome.summary.timings_s
    assert written["capture_bytes_read"] > 0
    assert "timings" in outcome.summary.render() and "retire" in outcome.summary.render()


@pytest.mark.parametrize("running_before", [False, True])
def test_ray_start_is_a_stage_only_when_the_run_s_start_started_ray(corpus_copy, tmp_path, monkeypatch, running_before):
    import raycap
    import raycap.runs.handoff as handoff

    running = [running_before]

    def start() -> None:
        running[0] = True

    monkeypatch.setattr(handoff, "ray_running", lambda: running[0])
    captures = corpus_copy("captures")
    outcome = raycap.rebuild_to_output([captures], tmp_path / "rows", model="m", executor="local", start=start)
    assert ("ray_start" in outcome.summary.timings_s) is not running_before


def test_a_stream_gives_its_figures_as_a_flat_dict_equal_to_what_it_did(tmp_path):
    import raycap
    from raycap.cli.synth import CorpusSpec, generate_corpus

    corpus = generate_corpus(tmp_path / "captures", CorpusSpec(rollouts=6, turns=(4, 4), system_tokens=(8, 8), fault_share=0.5, seed=5))
    with raycap.Stream([str(tmp_path / "captures")], executor="local") as stream:
        stream.submit(list(corpus.rollout_ids))
        rows = stream.take(4, timeout=60)
        taken = stream.metrics()
        report = stream.commit(rows, output=str(tmp_path / "steps" / "step-0"))
        after = stream.metrics()
    assert all(key.startswith("raycap/") for key in taken)
    assert taken["raycap/rows_delivered"] == rows.num_rows and taken["raycap/rollouts_delivered"] == 4
    assert taken["raycap/rows_uncommitted"] == rows.num_rows and taken["raycap/rollouts_waiting"] == 2
    masked = rows.filter(rows.column("mask_sample")).column("mask_reasons").to_pylist()
    assert taken["raycap/rows_masked"] == len(masked)
    for reason in {r for reasons in masked for r in reasons}:
        assert taken[f"raycap/rows_masked/{reason}"] == sum(reason in reasons for reasons in masked)
    assert 0 <= taken["raycap/freeze_to_take_s_mean"] <= taken["raycap/freeze_to_take_s_max"] < 60
    assert after["raycap/rows_committed"] == report.rows and after["raycap/retired"] == report.retired
    assert after["raycap/rows_uncommitted"] == 0


def _job(module: str, config: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAYCAP_PROGRESS_INTERVAL="0.01", RAY_TMPDIR=str(tmp_path))
    return subprocess.run(
        [sys.executable, "-m", module, "--config", str(config)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=240,
    )


def _assert_a_readable_log(stderr: str, label: str) -> None:
    lines = stderr.splitlines()
    progress = [text for text in lines if text.startswith(f"{label}: ") and " rollouts (" in text]
    assert progress and all(PLAIN_LINE.match(text) for text in progress), stderr[-3000:]
    assert "\r" not in stderr and not ANSI.search(stderr)
    # A warning is a line of its own: never after a progress line's text, never carrying one.
    for text in lines:
        if "WARNING" in text:
            assert re.match(r"^[\w.]+: WARNING: ", text) and "rollouts/s" not in text, text


@pytest.mark.slow
def test_the_rebuild_and_finalize_jobs_print_plain_progress_lines_into_a_pipe(corpus_copy, tmp_path):
    import yaml

    captures = corpus_copy("captures")
    config = tmp_path / "rebuild.yaml"
    config.write_text(yaml.safe_dump({
        "capture_dirs": [captures], "output": str(tmp_path / "rows"), "model": "m", "batch_size": 2,
        "executor": "local", "retire": True,
    }))
    done = _job("jobs.rebuild", config, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_a_readable_log(done.stderr, "rebuild")
    assert "WARNING" in done.stderr  # the fault corpus warns: the check above saw warnings
    assert re.search(r"^retire: \d+/\d+ shards", done.stderr, re.M)
    assert "timings" in done.stdout

    captures = corpus_copy("finalize-captures")
    ids = sorted(p.name[: -len(".tokens.jsonl")] for p in Path(captures).glob("*.tokens.jsonl"))
    results = tmp_path / "rollouts.jsonl"
    results.write_text("".join(json.dumps({"_ng_rollout_id": rid, "reward": 1.0}) + "\n" for rid in ids))
    config.write_text(yaml.safe_dump({
        "capture_dirs": [captures], "results": str(results), "output": str(tmp_path / "finalized"), "batch_size": 2,
        "executor": "local",
    }))
    done = _job("jobs.finalize", config, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_a_readable_log(done.stderr, "finalize")
    assert "timings_s" in json.loads(summary_path(tmp_path / "finalized").read_text())


def test_the_grafana_dashboard_charts_only_series_raycap_records():
    from importlib.resources import files

    from raycap.observe.metrics import METRICS

    board = json.loads(files("raycap.observe").joinpath("grafana.json").read_text())
    named = set()
    for panel in board["panels"]:
        for target in panel["targets"]:
            named.update(re.findall(r"ray_(raycap_\w+?)(?:_total|_bucket|_sum|_count)?\b", target["expr"]))
    assert named and named <= set(METRICS), named - set(METRICS)
    # Every counter and gauge is charted somewhere (histograms by their buckets).
    assert set(METRICS) - named == set(), set(METRICS) - named


def test_on_a_terminal_a_job_s_warning_never_continues_the_bar_s_line():
    import logging

    from raycap.observe.progress import job_console

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    handler = logging.StreamHandler(screen)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    logger = logging.getLogger("raycap")
    logger.addHandler(handler)
    try:
        with job_console():
            line = ProgressLine("rebuild", screen, interval=0.0)
            line(_State(10, 3))
            logging.getLogger("raycap.capture.rolloutfiles").warning("rollout r1: torn final line")
            line(_State(10, 6))
            line.finish()
    finally:
        logger.removeHandler(handler)
    # What a terminal shows: each \r returns to the line's start, so the warning's line
    # starts after a blanked bar, and holds nothing else.
    shown = [text.rsplit("\r", 1)[-1] for text in screen.getvalue().split("\n")]
    assert "raycap.capture.rolloutfiles: WARNING: rollout r1: torn final line" in shown, shown
