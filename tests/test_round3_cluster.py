"""Hardening of the Ray layer: a cluster address that never answers, a capture
directory spelled with '..', and a driver that meets several clusters in turn.

- A model server builds its sink from config (`raycap.cluster.sink:RayTokenSink` with
  `sink_kwargs`); an address that accepts TCP connections and then says nothing must
  fail its start within `connect_timeout_s`, with one line naming the address, and
  leave no Ray half-connected in the process. Run in a child process: this one may be
  a driver of the shared cluster already, and a hang must not hang the suite.
- `/w/lnk/../cap` with `lnk -> /w/deep/inner` is `/w/deep/cap` to the kernel, not the
  `/w/cap` it reads as: such a spec is refused wherever a capture directory is given.
- One driver process, two clusters one after another (a head restart, a test suite
  with a cluster per module): each is served fully by `rebuild_refs`, `raycap.rebuild`
  and a stream over `NODE:/path` directories, with nothing kept from the cluster before.
  Run in a child process with clusters of its own, so the shared cluster of this
  process is never disturbed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import raycap
from raycap.capture.directory import CaptureDir, capture_dirs

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


# --- a cluster address that accepts and never answers ------------------------------------------

SILENT_ADDRESS = r"""
import json, socket, sys, threading, time

import ray

import raycap.cluster.plumbing.connect
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
               default_timeout=getattr(raycap.cluster.plumbing.connect, "CONNECT_TIMEOUT_S", None))
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


# --- '..' after a symlink ----------------------------------------------------------------------


def _linked(tmp_path: Path) -> tuple[Path, Path, str]:
    """(/w/cap, /w/deep/cap, "/w/lnk/../cap") with lnk -> /w/deep/inner; both
    directories exist."""
    (tmp_path / "deep" / "cap").mkdir(parents=True)
    (tmp_path / "deep" / "inner").mkdir()
    (tmp_path / "cap").mkdir()
    (tmp_path / "lnk").symlink_to(tmp_path / "deep" / "inner")
    return tmp_path / "cap", tmp_path / "deep" / "cap", f"{tmp_path}/lnk/../cap"


def test_a_capture_dir_with_dotdot_is_refused_in_every_form_it_can_be_given(tmp_path):
    lexical, real, spec = _linked(tmp_path)
    assert os.path.realpath(spec) == str(real)  # what the kernel opens
    for given in (spec, f"node-a:{spec}", {"path": spec}, {"path": spec, "node": "rack=b"}, Path(spec)):
        with pytest.raises(ValueError, match=r"'\.\.'") as caught:
            CaptureDir.parse(given)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"'\.\.'"):
        capture_dirs([str(real), spec])
    with pytest.raises(ValueError, match=r"'\.\.'"):
        raycap.rebuild([spec], ["r1"], executor="local")
    # '.' and repeated slashes still read as the directory they spell.
    assert CaptureDir.parse(f"{tmp_path}/./deep//cap/").path == str(real)
    assert CaptureDir.parse(f"{tmp_path}/..deep").path == f"{tmp_path}/..deep"  # a name, not '..'


def test_a_sink_or_source_for_a_dotdot_capture_dir_is_refused_before_joining_ray(tmp_path):
    """Refused from the spec alone: the address (where nothing listens) is never tried,
    and so no Ray is started or joined for a directory that would be refused anyway."""
    lexical, real, spec = _linked(tmp_path)
    for build in (raycap.token_sink, raycap.token_source):
        with pytest.raises(ValueError, match=r"'\.\.'"):
            build(spec, address="127.0.0.1:1")
    assert not list(lexical.iterdir()) and not list(real.iterdir())


# --- two clusters in one driver process --------------------------------------------------------


ATTEMPTS = 4  # to start one cluster


def _descendants(pid: int) -> list[int]:
    """The processes started by `pid`, and by them, in turn."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            child = int(stat.parent.name)
            found += [child, *_descendants(child)]
    return found


def _start_cluster():
    """A 2-node cluster (head raycap-node=a, worker b), started again when a node timed
    out while starting (Ray waits 30 s for a raylet to register, which a loaded machine can miss):
    this test is about what the driver keeps, not about how fast nodes start."""
    from ray.cluster_utils import Cluster

    for attempt in range(ATTEMPTS):
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=1, object_store_memory=80 << 20, include_dashboard=False,
                             labels={"raycap-node": "a"})
            cluster.add_node(num_cpus=1, object_store_memory=80 << 20, labels={"raycap-node": "b"})
            cluster.wait_for_nodes()
            return cluster
        except Exception:
            cluster.shutdown()
            for leftover in _descendants(os.getpid()):  # what the node that never registered started
                try:
                    os.kill(leftover, signal.SIGKILL)
                except OSError:
                    pass
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(10)


CLUSTERS = 2  # the second meets every cache the first left in this process


def clusters_in_turn(work: str) -> None:
    """In this process, two clusters in turn (2 nodes each, the head labelled
    raycap-node=a, the worker b), each served by `rebuild_refs`, `raycap.rebuild` and a
    stream over `NODE:/path` directories: node-id specs for the Rebuilder, label specs
    (the same text on every cluster) for `raycap.rebuild` and the stream."""
    import logging
    import shutil
    import tempfile

    import pyarrow as pa
    import ray

    from raycap import TokenCaptureStore
    from test_stream import write

    dirs = {name: os.path.join(work, name) for name in "ab"}
    for round_ in range(CLUSTERS):
        temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths must fit
        os.environ["RAY_TMPDIR"] = temp
        cluster = None
        try:
            cluster = _start_cluster()
            ray.init(address=cluster.address, logging_level=logging.WARNING)
            node_of = {n["Labels"]["raycap-node"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
            ids = {name: [f"{name}{round_}-{i}" for i in range(4)] for name in "ab"}
            for name in "ab":
                store = TokenCaptureStore(dirs[name])
                for rid in ids[name]:
                    write(store, rid)
            by_id = [f"{node_of[name]}:{dirs[name]}" for name in "ab"]
            by_label = [f"raycap-node={name}:{dirs[name]}" for name in "ab"]

            wanted = [ids["a"][0], ids["b"][0], ids["a"][1], ids["b"][1]]
            refs = raycap.Rebuilder(by_id, executor="ray").rebuild_refs(wanted)
            table = pa.concat_tables(ray.get(refs))
            assert table.column("rollout_id").to_pylist() == wanted, (round_, "rebuild_refs")
            assert not any(table.column("mask_sample").to_pylist()), (round_, table.column("error").to_pylist())

            wanted = [ids["b"][2], ids["a"][2]]
            table = raycap.rebuild(by_label, wanted, executor="ray")
            assert table.column("rollout_id").to_pylist() == wanted, (round_, "rebuild")
            assert not any(table.column("mask_sample").to_pylist()), (round_, table.column("error").to_pylist())

            every = sorted(ids["a"] + ids["b"])
            with raycap.Stream(by_label) as stream:
                submitted = stream.submit(every)
                assert sorted(submitted.ready) == every, (round_, submitted)
                got: list[str] = []
                deadline = time.monotonic() + 120
                while len(got) < len(every) and time.monotonic() < deadline:
                    rows = stream.take(len(every) - len(got), timeout=10)
                    if rows.num_rows:
                        assert not any(rows.column("mask_sample").to_pylist()), (round_, "stream")
                        stream.commit(rows)
                        got += rows.column("rollout_id").to_pylist()
                assert sorted(got) == every, (round_, "stream", got)
            print(f"cluster {round_}: served", flush=True)
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_two_clusters_in_turn_are_each_served_by_one_driver_process(tmp_path):
    script = textwrap.dedent(f"""
        import test_round3_cluster
        test_round3_cluster.clusters_in_turn({str(tmp_path)!r})
    """)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=_child_env(),
            cwd=str(tmp_path),
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"two clusters in turn did not finish in 900 s: {(exc.stdout or '')[-2000:]}")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert [line for line in done.stdout.splitlines() if line.startswith("cluster ")] == [
        f"cluster {k}: served" for k in range(CLUSTERS)
    ]
