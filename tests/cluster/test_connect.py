"""A model server builds its sink from config (`raycap.cluster.sink:RayTokenSink` with
`sink_kwargs`), or a source; an address that accepts TCP connections and then says nothing,
or where a gRPC service other than Ray answers (directly or as `ray://`), must fail its
start within `connect_timeout_s` (`raycap.cluster.plumbing.connect`), with one line naming the address, and leave no Ray half-connected in the process. Run in a child
process: this one may be a driver of the shared cluster already, and a hang must not hang
the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
from concurrent import futures

import grpc
import ray

import raycap.cluster.plumbing.connect
from raycap.capture.config import TokenIdCaptureConfig

capture_dir, target, kind = sys.argv[1], sys.argv[2], sys.argv[3]
held, calls = [], []
if kind.endswith("silent"):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port = server.getsockname()[1]

    def accept():  # accepts every connection, keeps it open, never sends a byte
        while True:
            connection, _ = server.accept()
            held.append(connection)

    threading.Thread(target=accept, daemon=True).start()
else:  # a real gRPC server with one service of its own, which is not Ray's
    class Echo(grpc.GenericRpcHandler):
        def service(self, details):
            calls.append(details.method)
            if details.method == "/other.Echo/Echo":
                return grpc.unary_unary_rpc_method_handler(lambda request, context: request)
            return None  # any other method: UNIMPLEMENTED

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((Echo(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # it does answer gRPC
        assert channel.unary_unary("/other.Echo/Echo")(b"ping", timeout=10) == b"ping"
    calls.clear()
address = ("ray://" if kind.startswith("ray-") else "") + f"127.0.0.1:{port}"
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
outcome.update(address=address, seconds=time.monotonic() - start, connections=len(held) + len(calls),
               ray_initialized=ray.is_initialized(),
               default_timeout=getattr(raycap.cluster.plumbing.connect, "CONNECT_TIMEOUT_S", None))
print(json.dumps(outcome))
"""


# (who joins, what listens at the address): "silent" accepts and never sends a byte,
# "grpc" is a gRPC server that is not Ray; "ray-" gives the address as ray://host:port.
SILENT_CASES = (("sink", "silent"), ("source", "silent"), ("sink", "grpc"), ("source", "grpc"),
                ("sink", "ray-grpc"), ("sink", "ray-silent"))


@pytest.fixture(scope="module")
def silent_address_outcomes(tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Each case's child process, all run at the same time (each waits out its own
    connect timeout on an address of its own): the finished process by case."""
    started = {}
    for target, kind in SILENT_CASES:
        directory = tmp_path_factory.mktemp(f"silent-{target}-{kind}")
        started[target, kind] = subprocess.Popen(
            [sys.executable, "-c", SILENT_ADDRESS, str(directory), target, kind],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env(), cwd=str(directory),
        )
    finished = {}
    deadline = time.monotonic() + 120
    for case, child in started.items():
        try:
            stdout, stderr = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            stdout, stderr = "", f"constructing the {case[0]} at a {case[1]} address was still blocked after 120 s"
        finished[case] = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    return finished


@pytest.mark.slow
@pytest.mark.parametrize("case", SILENT_CASES, ids=["-".join(case) for case in SILENT_CASES])
def test_an_address_where_ray_does_not_answer_fails_the_start_in_bounded_time(silent_address_outcomes, case):
    done = silent_address_outcomes[case]
    if "still blocked after 120 s" in done.stderr:
        pytest.fail(done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["connections"] >= 1, outcome  # the address did accept (and was asked)
    assert outcome["error"] == "ConnectionError", outcome
    assert outcome["seconds"] < 10, outcome
    message = outcome["message"]
    assert "\n" not in message and outcome["address"] in message, message
    assert not outcome["ray_initialized"], "a failed connect left Ray initialised in the process"
    assert outcome["default_timeout"] is not None and 0 < outcome["default_timeout"] <= 30


WRONG_TOKEN = r"""
import json, os, subprocess, sys

import ray

ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=1 << 28)
gcs = ray.get_runtime_context().gcs_address
joiner = '''
import json, sys, time

import ray

from raycap.cluster.sink import RayTokenSink

start = time.monotonic()
try:
    RayTokenSink(capture_dir=sys.argv[1], address=sys.argv[2], connect_timeout_s=5)
    outcome = {"error": None}
except Exception as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc)}
outcome.update(seconds=time.monotonic() - start, ray_initialized=ray.is_initialized())
print(json.dumps(outcome))
'''
env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}  # no token mode here
done = subprocess.run([sys.executable, "-c", joiner, sys.argv[1], gcs], env=env, capture_output=True,
                      text=True, timeout=90)
ray.shutdown()
print(json.dumps({"gcs": gcs, "stdout": done.stdout, "stderr": done.stderr[-3000:]}))
"""


@pytest.mark.slow
def test_a_cluster_that_refuses_the_token_is_refused_at_once_in_one_line(tmp_path):
    """An embedded Ray turns token authentication on; a process that joins it without
    RAY_AUTH_MODE=token is refused by the GCS, which raycap reports within the connect
    timeout, naming the address and the way out (ray.init alone retries some 20 s)."""
    done = subprocess.run([sys.executable, "-c", WRONG_TOKEN, str(tmp_path)], capture_output=True, text=True,
                          env=_child_env(), cwd=str(tmp_path), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["stdout"].strip(), report["stderr"]
    outcome = json.loads(report["stdout"].strip().splitlines()[-1])
    assert outcome["error"] == "ConnectionError", outcome
    message = outcome["message"]
    assert "\n" not in message and report["gcs"] in message and "InvalidAuthToken" in message, message
    assert "RAY_AUTH_MODE=token" in message, message
    assert outcome["seconds"] < 5, outcome
    assert not outcome["ray_initialized"], outcome


@pytest.mark.slow
def test_a_cluster_counts_as_this_node_alone_only_when_its_gcs_says_so_in_time():
    # Any doubt means joining as usual (which reports what is wrong): a Ray client
    # address, something that is no address, nothing listening, a port that never answers.
    import socket

    from raycap.cluster.plumbing.connect import lone_node_here

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections queue in the backlog; nothing ever answers them
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    nobody = closed.getsockname()[1]
    closed.close()
    port = silent.getsockname()[1]
    start = time.monotonic()
    try:
        assert not lone_node_here(f"ray://127.0.0.1:{port}")
        assert not lone_node_here("not-an-address")
        assert not lone_node_here(f"127.0.0.1:{nobody}", timeout_s=0.5)
        assert not lone_node_here(f"127.0.0.1:{port}", timeout_s=0.5)
    finally:
        silent.close()
    assert time.monotonic() - start < 5
