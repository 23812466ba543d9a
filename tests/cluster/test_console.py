"""A quiet console (`raycap.cluster.plumbing.console`): Ray's three notices stay off raycap's paths.

Each test runs a raycap program in a subprocess, on a terminal (a pty) where it matters,
because Ray Data and tqdm only draw their bars there, and reads everything it printed.
A control run with RAYCAP_QUIET_RAY=0 shows that the notices are real in this
environment, so their absence means raycap silenced them.
"""

from __future__ import annotations

import importlib.util
import os
import pty
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TOKEN_NOTICE = "Token authentication is enabled"
TQDM_NOTICE = "tqdm is not installed"
RAY_DATA_INFO = ("Starting execution of Dataset", "Execution plan of Dataset", "execution finished in")

pytestmark = pytest.mark.slow


def _run(args: list[str], *, quiet: bool = True, address: str | None = None, timeout: float = 300) -> tuple[int, str]:
    """Run `python <args>` from the repository on a pseudo-terminal: (status, everything
    printed). It starts its own Ray unless given a cluster's `address` to join."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    if address:
        env["RAY_ADDRESS"] = address
    env.pop("RAY_AUTH_MODE", None)
    env["RAYCAP_QUIET_RAY"] = "1" if quiet else "0"
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return process.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory) -> Path:
    """configs/demo.yaml with its corpus and output moved to a temporary directory."""
    root = tmp_path_factory.mktemp("demo")
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["capture_dirs"] = [str(root / "demo-data")]
    config["output"] = str(root / "out" / "demo")
    path = root / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def demo_run(demo_config) -> tuple[int, str]:
    """The demo run once on a terminal: (status, everything it printed). Its output is
    what the reading test reads."""
    return _run(["-m", "jobs.demo", "--config", str(demo_config), "--rollouts", "12"])


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if TOKEN_NOTICE in line or TQDM_NOTICE in line or any(m in line for m in RAY_DATA_INFO)]


def test_the_demo_prints_none_of_rays_notices(demo_run):
    status, text = demo_run
    assert status == 0, text
    assert "jobs.demo: done" in text
    assert _noise(text) == []


READ = """
import raycap
from raycap.cluster.rebuild.session import connect
connect()
print("rows", raycap.dataset({output!r}).count())
"""


def test_reading_an_output_with_raycap_dataset_prints_none_of_rays_notices(demo_config, demo_run, ray_cluster):
    output = yaml.safe_load(demo_config.read_text())["output"]
    assert demo_run[0] == 0, demo_run[1]
    # The quiet read joins the session's cluster: Ray Data's lines and the tqdm notice are
    # the read's own (the demo above shows an embedded start of raycap's is quiet too).
    # The control starts its own Ray, so it shows all three notices are real here.
    # The two run at the same time, a terminal each, each read to its end by a thread of its own.
    with ThreadPoolExecutor(2) as pool:
        quiet_read = pool.submit(_run, ["-c", READ.format(output=output)], address=ray_cluster.address)
        loud_read = pool.submit(_run, ["-c", READ.format(output=output)], quiet=False)
        (status, text), (loud_status, loud) = quiet_read.result(), loud_read.result()
    assert status == 0, text
    assert "rows 12" in text
    assert _noise(text) == []

    assert loud_status == 0, loud
    assert any(TOKEN_NOTICE in line for line in _noise(loud))
    if importlib.util.find_spec("tqdm") is None:  # Ray only gives this notice where tqdm is missing
        assert any(TQDM_NOTICE in line for line in _noise(loud))
    assert any(marker in line for marker in RAY_DATA_INFO for line in _noise(loud))
