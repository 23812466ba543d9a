"""The rebuild and finalize jobs submitted with `ray job submit` to a real Ray head on this machine.

The head runs as `ray start --head --block` in its own session with a private temp
directory, so it neither joins nor disturbs any other Ray on the machine (the tests'
shared embedded instance included). It is stopped through its own process (SIGINT makes
`ray start --block` shut its processes down), then by its process group: `ray stop` is
not used because it stops every Ray process on the machine, not just this head's.
"""

from __future__ import annotations

import json
import os
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


@pytest.fixture
def ray_head(tmp_path):
    """(dashboard URL, environment for the Ray CLI) of a fresh 2-CPU head on loopback."""
    with head_of(RAY, tmp_path / "head.log") as (url, env, _):
        yield url, env


@contextmanager
def head_of(ray: Path, log_path: Path, environ: dict | None = None):
    """(dashboard URL, environment for the Ray CLI, GCS address) of a fresh 2-CPU head
    started by the `ray` at `ray`, whose folder comes first on the PATH of its jobs."""
    dashboard_port, gcs_port = _free_port(), _free_port()
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
            f"--object-store-memory={256 << 20}",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _dashboard_answers(url):
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        # The CLI reads the cluster's token (~/.ray/auth_token) only in token mode.
        yield url, {**env, "RAY_AUTH_MODE": "token"}, f"127.0.0.1:{gcs_port}"
    finally:
        _stop(head)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_the_rebuild_and_finalize_jobs_run_under_ray_job_submit(ray_head, corpus_copy, tmp_path):
    url, env = ray_head
    captures = corpus_copy("captures")
    captured = {p.name[: -len(".tokens.jsonl")] for p in Path(captures).glob("*.tokens.jsonl")}
    output = tmp_path / "out" / "rows.parquet"
    config = tmp_path / "job.yaml"
    # Absolute paths: the driver runs inside an uploaded copy of the working directory.
    config.write_text(
        yaml.safe_dump(
            {"capture_dirs": [captures], "output": str(output), "model": "m", "retire": True, "batch_size": 8}
        )
    )
    submit = [
        str(RAY), "job", "submit",
        "--address", url,
        "--working-dir", str(REPO),
        "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
        "--", "python", "-m", "jobs.rebuild", "--config", str(config),
    ]
    done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"

    table = pq.read_table(output, columns=["rollout_id", "mask_sample"])
    assert captured and captured <= set(table.column("rollout_id").to_pylist())
    summary = json.loads(summary_path(output).read_text())
    assert summary["rollouts"] == table.num_rows
    assert summary["retired"]["dropped"] == table.num_rows - summary["masked"]
    # executor auto (the default): a submitted job has a cluster to build on, and uses it.
    assert summary["executor"]["name"] == "ray", summary["executor"]
    assert "snapshots dropped" in done.stdout  # the job's summary reaches the submitter's log

    # The finalize job runs under `ray job submit` the same way (the same head, to keep the
    # slow tier short): a results file over another copy of the captures.
    captures = corpus_copy("finalize-captures")
    results = tmp_path / "rollouts.jsonl"
    results.write_text("".join(json.dumps({"_ng_rollout_id": rid, "reward": 1.0}) + "\n" for rid in sorted(captured)))
    finalized = tmp_path / "out" / "finalized"
    config.write_text(
        yaml.safe_dump(
            {"capture_dirs": [captures], "results": str(results), "output": str(finalized), "retire": True, "batch_size": 8}
        )
    )
    submit[-3] = "jobs.finalize"
    done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    summary = json.loads(summary_path(finalized).read_text())
    assert summary["records"]["records"] == len(captured) and summary["executor"]["name"] == "ray"
    assert "left unchanged" in done.stdout
