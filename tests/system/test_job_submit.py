"""The rebuild and finalize jobs submitted with `ray job submit` to a real Ray head on this machine.

The head runs as `ray start --head --block` in its own session with a private temp
directory, so it neither joins nor disturbs any other Ray on the machine (the tests'
shared embedded instance included). It is stopped through its own process (SIGINT makes
`ray start --block` shut its processes down), then by its process group: `ray stop` is
not used because it stops every Ray process on the machine, not just this head's. One head
serves the module, and the rebuild and finalize jobs are submitted to it once: one test
checks what they wrote, the other what they logged and what reached the metrics endpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from raycap.output.commit import summary_path

REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
EXCLUDES = [".venv", ".git", "demo-data", "out", ".hypothesis", ".pytest_cache"]
START_TIMEOUT_S = 90
JOB_TIMEOUT_S = 240

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dashboard_answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/api/version", timeout=2).close()
        return True
    except urllib.error.HTTPError:
        return True  # it answers; the token-protected API just wants credentials
    except OSError:
        return False


def _stop(head: subprocess.Popen) -> None:
    if head.poll() is None:
        head.send_signal(signal.SIGINT)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(head.pid, signal.SIGKILL)  # anything of this head's session still running
    except ProcessLookupError:
        pass
    head.wait(timeout=30)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """(dashboard URL, environment for the Ray CLI, Prometheus metrics URL) of a fresh
    2-CPU head on loopback, one for the module: starting a head is what costs here."""
    with head_of(RAY, tmp_path_factory.mktemp("head") / "head.log") as (url, env, _, metrics_url):
        yield url, env, metrics_url


@contextmanager
def head_of(ray: Path, log_path: Path, environ: dict | None = None):
    """(dashboard URL, environment for the Ray CLI, GCS address, Prometheus metrics URL) of
    a fresh 2-CPU head started by the `ray` at `ray`, whose folder comes first on the PATH
    of its jobs."""
    dashboard_port, gcs_port, metrics_port = _free_port(), _free_port(), _free_port()
    env = {
        **(os.environ if environ is None else environ),
        "RAY_USAGE_STATS_ENABLED": "0",
        # The job's entrypoint runs `python` (or `raycap`): it must be this environment's.
        "PATH": f"{ray.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="raycap-head-")  # short: Ray's socket paths must fit
    log = open(log_path, "w")
    head = subprocess.Popen(
        [
            str(ray), "start", "--head", "--block",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
            "--num-cpus=2",
            f"--metrics-export-port={metrics_port}",
            f"--object-store-memory={256 << 20}",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # SIGINT stops it (`_stop`), though this process may have been started with it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _dashboard_answers(url):
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        # The CLI reads the cluster's token (~/.ray/auth_token) only in token mode.
        yield (url, {**env, "RAY_AUTH_MODE": "token"}, f"127.0.0.1:{gcs_port}",
               f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        _stop(head)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass
class SubmittedJobs:
    """The rebuild job and then the finalize job, each submitted once to the module's head
    (its tests assert on what the jobs returned, wrote, logged and exported)."""

    submit: list[str]  # the rebuild's `ray job submit` command line
    captured: set[str]  # the rollout ids of the captures
    rebuild_output: Path
    rebuilt: subprocess.CompletedProcess
    finalize_output: Path
    finalized: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def submitted_jobs(ray_head, fault_corpus, tmp_path_factory) -> SubmittedJobs:
    url, env, _ = ray_head
    work = tmp_path_factory.mktemp("jobs")
    captures = work / "captures"
    shutil.copytree(fault_corpus.directory, captures)
    captured = {p.name[: -len(".tokens.jsonl")] for p in captures.glob("*.tokens.jsonl")}
    output = work / "out" / "rows.parquet"
    config = work / "job.yaml"
    # Absolute paths: the driver runs inside an uploaded copy of the working directory.
    config.write_text(yaml.safe_dump(
        {"capture_dirs": [str(captures)], "output": str(output), "model": "m", "retire": True, "batch_size": 2}
    ))
    submit = [
        str(RAY), "job", "submit",
        "--address", url,
        "--working-dir", str(REPO),
        "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
        "--", "python", "-m", "jobs.rebuild", "--config", str(config),
    ]
    rebuilt = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)

    # The finalize job: a results file over another copy of the captures.
    captures = work / "finalize-captures"
    shutil.copytree(fault_corpus.directory, captures)
    results = work / "rollouts.jsonl"
    results.write_text("".join(json.dumps({"_ng_rollout_id": rid, "reward": 1.0}) + "\n" for rid in sorted(captured)))
    finalized = work / "out" / "finalized"
    finalize_config = work / "finalize.yaml"
    finalize_config.write_text(yaml.safe_dump(
        {"capture_dirs": [str(captures)], "results": str(results), "output": str(finalized), "retire": True,
         "batch_size": 4}
    ))
    finalize = [*submit[:-3], "jobs.finalize", "--config", str(finalize_config)]
    done = subprocess.run(finalize, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    return SubmittedJobs(submit, captured, output, rebuilt, finalized, done)


def test_the_rebuild_and_finalize_jobs_run_under_ray_job_submit(submitted_jobs):
    jobs = submitted_jobs
    done = jobs.rebuilt
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    table = pq.read_table(jobs.rebuild_output, columns=["rollout_id", "mask_sample"])
    assert jobs.captured and jobs.captured <= set(table.column("rollout_id").to_pylist())
    summary = json.loads(summary_path(jobs.rebuild_output).read_text())
    assert summary["rollouts"] == table.num_rows
    assert summary["retired"]["dropped"] == table.num_rows - summary["masked"]
    # executor auto (the default): a submitted job has a cluster to build on, and uses it.
    assert summary["executor"]["name"] == "ray", summary["executor"]
    assert "snapshots dropped" in done.stdout  # the job's summary reaches the submitter's log

    # The finalize job runs under `ray job submit` the same way, on the same head.
    done = jobs.finalized
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    summary = json.loads(summary_path(jobs.finalize_output).read_text())
    assert summary["records"]["records"] == len(jobs.captured) and summary["executor"]["name"] == "ray"
    assert "left unchanged" in done.stdout


# --- what a job shows: progress in its log, raycap_* series at the head's metrics endpoint ---------

ANSI = "\x1b["
STREAM_SCRIPT = """
import json, sys
import ray
import raycap

ray.init()
with raycap.Stream([sys.argv[1]], executor="ray") as stream:
    stream.submit(json.loads(sys.argv[3]))
    rows = stream.take(len(json.loads(sys.argv[3])), timeout=120)
    report = stream.commit(rows, output=sys.argv[2])
    print("FIGURES " + json.dumps({"metrics": stream.metrics(), "rows": report.rows, "retired": report.retired}))
"""


def _series(metrics_url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the endpoint: (name, labels, value)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    samples = []
    for line in text.splitlines():
        found = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if found:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', found.group(2)))
            samples.append((found.group(1), labels, float(found.group(3))))
    return samples


def _total(samples, name: str, **labels: str) -> float:
    return sum(v for n, got, v in samples if n == name and all(got.get(k) == want for k, want in labels.items()))


def _by_reason(samples, name: str, **labels: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for n, got, v in samples:
        if n == name and all(got.get(k) == want for k, want in labels.items()) and v:
            out[got["reason"]] = out.get(got["reason"], 0) + int(v)
    return out


def _until(check, what: str, timeout: float = 60.0):
    """Poll `check` (Ray's metrics agent exports every few seconds) until it holds."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            return last
        except AssertionError as exc:
            last = exc
        time.sleep(1.0)
    raise AssertionError(f"{what}: {last}")


def test_a_submitted_job_logs_plain_progress_and_its_counts_reach_the_metrics_endpoint(
        ray_head, submitted_jobs, corpus_copy, tmp_path):
    _, env, metrics_url = ray_head
    jobs = submitted_jobs
    output, done = jobs.rebuild_output, jobs.rebuilt
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    # The job's log, without the lines `ray job submit` prints about the submission itself.
    log = "\n".join(line for line in done.stdout.splitlines() if " cli.py:" not in line)
    # The job's log: progress lines before the summary, no colour codes, warnings alone on their lines.
    progress = [i for i, line in enumerate(log.splitlines()) if re.match(r"^rebuild: \d+/\d+ rollouts \(\d+%\)", line)]
    summary_at = next(i for i, line in enumerate(log.splitlines()) if line.startswith("  output "))
    assert progress and progress[0] < summary_at, log[-4000:]
    assert ANSI not in log, log[-4000:]
    for line in log.splitlines():
        if "WARNING" in line:
            assert "rollouts/s" not in line, line
    summary = json.loads(summary_path(output).read_text())

    def rebuilt():
        samples = _series(metrics_url)
        tag = {"output": str(output)}
        assert _total(samples, "ray_raycap_rows_total", **tag) == summary["rollouts"]
        assert _by_reason(samples, "ray_raycap_rows_masked_by_reason_total", **tag) == summary["masked_by_reason"]
        assert _total(samples, "ray_raycap_rows_masked_total", **tag) == summary["masked"]
        assert _total(samples, "ray_raycap_retired_total", **tag) == summary["retired"]["dropped"]
        assert _total(samples, "ray_raycap_commit_seconds_count", **tag) == 1
        assert _total(samples, "ray_raycap_bytes_written_total", **tag) > 0
        return samples

    _until(rebuilt, "the rebuild's series")

    # The finalize job: its counts too.
    finalized, done = jobs.finalize_output, jobs.finalized
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    log = "\n".join(line for line in done.stdout.splitlines() if " cli.py:" not in line)
    assert re.search(r"^finalize: \d+/\d+ rollouts \(\d+%\)", log, re.M) and ANSI not in log
    summary = json.loads(summary_path(finalized).read_text())

    def finalized_counts():
        samples = _series(metrics_url)
        tag = {"output": str(finalized)}
        assert _total(samples, "ray_raycap_rows_total", **tag) == summary["rollouts"]
        assert _by_reason(samples, "ray_raycap_rows_masked_by_reason_total", **tag) == summary["masked_by_reason"]
        assert _total(samples, "ray_raycap_retired_total", **tag) == summary["retired"]["dropped"]

    _until(finalized_counts, "the finalize's series")

    # A stream on the same head: what it delivered and committed.
    captures = corpus_copy("stream-captures")
    ids = sorted(p.name[: -len(".tokens.jsonl")] for p in Path(captures).glob("*.tokens.jsonl"))
    script = tmp_path / "stream_job.py"
    script.write_text(STREAM_SCRIPT)
    step = tmp_path / "out" / "step-0"
    wanted = json.dumps(ids[:6])
    submit = jobs.submit
    stream_submit = submit[: submit.index("--") + 1] + ["python", str(script), captures, str(step), wanted]
    done = subprocess.run(stream_submit, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    figures = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("FIGURES "))[len("FIGURES "):])
    flat = figures["metrics"]

    def streamed():
        samples = _series(metrics_url)
        tag = {"capture_dir": captures}
        assert _total(samples, "ray_raycap_stream_rows_delivered_total", **tag) == flat["raycap/rows_delivered"]
        reasons = {k[len("raycap/rows_masked/"):]: v for k, v in flat.items() if k.startswith("raycap/rows_masked/")}
        assert _by_reason(samples, "ray_raycap_stream_rows_masked_by_reason_total", **tag) == reasons
        assert _total(samples, "ray_raycap_rows_total", output=str(step)) == figures["rows"] == flat["raycap/rows_committed"]
        assert _total(samples, "ray_raycap_retired_total", output=str(step)) == figures["retired"] == flat["raycap/retired"]
        assert _total(samples, "ray_raycap_stream_freeze_to_take_seconds_count", **tag) == flat["raycap/rollouts_delivered"]
        assert _total(samples, "ray_raycap_stream_rows_uncommitted", **tag) == 0

    _until(streamed, "the stream's series")
