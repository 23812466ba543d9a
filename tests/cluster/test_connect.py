"""A model server builds its sink from config (`raycap.cluster.sink:RayTokenSink` with
`sink_kwargs`), or a source; an address that accepts TCP connections and then says nothing
must fail its start within `connect_timeout_s` (`raycap.cluster.connect`), with one line
naming the address, and leave no Ray half-connected in the process. Run in a child
process: this one may be a driver of the shared cluster already, and a hang must not hang
the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = str(ROOT)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


SILENT_ADDRESS = r"""
import json, socket, sys, threading, time

import ray

import raycap.cluster.connect
from raycap.capture.config import TokenIdCaptureConfig

capture_dir, target = sys.argv[1], sys.argv[2]
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(16)
address = f"127.0.0.1:{server.getsockname()[1]}"
held = []

def accept():  # accepts every connection, keeps it open, never sends a byte
    while True:
        connection, _ = server.accept()
        held.append(connection)

threading.Thread(target=accept, daemon=True).start()
kwargs = {"capture_dir": capture_dir, "address": address, "connect_timeout_s": 3}
start = time.monotonic()
try:
    if target == "sink":
        TokenIdCaptureConfig(token_id_capture={
            "enabled": True, "sink": "raycap.cluster.sink:RayTokenSink", "sink_kwargs": kwargs,
        }).build_sink()
    else:
        from raycap import RayTokenSource
        RayTokenSource(**kwargs)
    outcome = {"error": None}
except Exception as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc)}
outcome.update(address=address, seconds=time.monotonic() - start, connections=len(held),
               ray_initialized=ray.is_initialized(),
               default_timeout=getattr(raycap.cluster.connect, "CONNECT_TIMEOUT_S", None))
print(json.dumps(outcome))
"""


SILENT_TARGETS = ("sink", "source")


@pytest.fixture(scope="module")
def silent_address_outcomes(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each target's child process, the two run at the same time (each waits out its own
    connect timeout on an address of its own): the finished process by target."""
    started = {}
    for target in SILENT_TARGETS:
        directory = tmp_path_factory.mktemp(f"silent-{target}")
        started[target] = subprocess.Popen(
            [sys.executable, "-c", SILENT_ADDRESS, str(directory), target],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env(), cwd=str(directory),
        )
    finished = {}
    for target, child in started.items():
        try:
            stdout, stderr = child.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            stdout, stderr = "", f"constructing the {target} was still blocked after 120 s"
        finished[target] = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    return finished


@pytest.mark.slow
@pytest.mark.parametrize("target", SILENT_TARGETS)
def test_an_address_that_accepts_and_never_answers_fails_the_start_in_bounded_time(silent_address_outcomes, target):
    done = silent_address_outcomes[target]
    if "still blocked after 120 s" in done.stderr:
        pytest.fail(done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["connections"] >= 1, outcome  # the address did accept
    assert outcome["error"] == "ConnectionError", outcome
    assert outcome["seconds"] < 10, outcome
    message = outcome["message"]
    assert "\n" not in message and outcome["address"] in message, message
    assert not outcome["ray_initialized"], "a failed connect left Ray initialised in the process"
    assert outcome["default_timeout"] is not None and 0 < outcome["default_timeout"] <= 30
